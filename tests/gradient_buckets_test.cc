// GradientBuckets over in-process ranks: the bucket layout, buckets posted during backward
// as their gradients complete, sums equal to a per-parameter all-reduce (exactly) and to a
// float64 sum of every rank's gradients, gradient accumulation without communication,
// parameters some rank does not use, and misuse.
#include "ringdilated/nn/gradient_buckets.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

// A 4 -> 8 -> 8 -> 3 tanh MLP of raw float32 leaves, registered W0 b0 W1 b1 W2 b2. Bytes:
// W0 128, b0 32, W1 256, b1 32, W2 96, b2 12.
struct Mlp {
  std::vector<Tensor> params;

  explicit Mlp(uint64_t seed) {
    Generator gen(seed);
    const std::vector<int64_t> widths = {4, 8, 8, 3};
    for (size_t l = 0; l + 1 < widths.size(); ++l) {
      for (Shape shape : {Shape{widths[l], widths[l + 1]}, Shape{widths[l + 1]}}) {
        Tensor p = randn(shape, gen);
        p.set_requires_grad(true);
        params.push_back(p);
      }
    }
  }

  // sum(mlp(x) * target)
  Tensor loss(const Tensor& x, const Tensor& target) const {
    Tensor h = x;
    for (size_t l = 0; l < params.size(); l += 2) {
      h = add(matmul(h, params[l]), params[l + 1]);
      if (l + 2 < params.size()) h = tanh(h);
    }
    return sum(mul(h, target));
  }
};

constexpr uint64_t kWeightSeed = 7;
constexpr int64_t kRows = 5;
// Buckets of the MLP's parameters under this cap: {b2 W2 b1} (140 bytes; W1 would make 396),
// {W1} (alone: over the cap), {b0 W0} (160, the cap).
constexpr int64_t kCap = 160;

// Rank `rank`'s micro-batch `micro`: its own inputs and targets.
std::pair<Tensor, Tensor> batch(int rank, int micro) {
  Generator gen(1000 + 10 * static_cast<uint64_t>(rank) + static_cast<uint64_t>(micro));
  return {randn({kRows, 4}, gen), randn({kRows, 3}, gen)};
}

void backward_on(const Mlp& m, int rank, int micro) {
  const auto [x, target] = batch(rank, micro);
  m.loss(x, target).backward();
}

std::vector<Tensor> grads_of(const Mlp& m) {
  std::vector<Tensor> g;
  for (const Tensor& p : m.params) g.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  return g;
}

std::shared_ptr<dist::Communicator> borrow(dist::Communicator& comm) {
  return {&comm, [](dist::Communicator*) {}};
}

void expect_equal(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined() && want[i].defined()) << "parameter " << i;
    EXPECT_TRUE(allclose(got[i], want[i], 0.0, 0.0)) << "parameter " << i;
  }
}

TEST(GradientBuckets, BucketsHoldReverseRegistrationOrderUpToTheCap) {
  const std::shared_ptr<dist::Communicator> comm = dist::make_in_process_group(1)[0];
  const Mlp m(kWeightSeed);
  GradientBuckets small(m.params, comm, kCap);
  EXPECT_EQ(small.bucket_indices(), (std::vector<std::vector<size_t>>{{5, 4, 3}, {2}, {1, 0}}));
  GradientBuckets smaller(m.params, comm, kCap - 1);
  EXPECT_EQ(smaller.bucket_indices(),
            (std::vector<std::vector<size_t>>{{5, 4, 3}, {2}, {1}, {0}}));
  GradientBuckets large(m.params, comm);
  EXPECT_EQ(large.bucket_indices(), (std::vector<std::vector<size_t>>{{5, 4, 3, 2, 1, 0}}));
  // A bucket holds one dtype.
  std::vector<Tensor> mixed = m.params;
  Tensor wide = zeros({2}, DType::kFloat64);
  wide.set_requires_grad(true);
  mixed.insert(mixed.begin() + 3, wide);
  GradientBuckets split(mixed, comm);
  EXPECT_EQ(split.bucket_indices(),
            (std::vector<std::vector<size_t>>{{6, 5, 4}, {3}, {2, 1, 0}}));
}

TEST(GradientBuckets, RefusesBadParameters) {
  const std::shared_ptr<dist::Communicator> comm = dist::make_in_process_group(1)[0];
  const Mlp m(kWeightSeed);
  const auto raises = [&](std::vector<Tensor> params, int64_t bytes) {
    try {
      GradientBuckets b(std::move(params), comm, bytes);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("GradientBuckets"), std::string::npos) << e.what();
      return true;
    }
    return false;
  };
  EXPECT_TRUE(raises({m.params[0], m.params[0]}, 1024));  // the same tensor twice
  EXPECT_TRUE(raises({zeros({2})}, 1024));                // needs no grad
  EXPECT_TRUE(raises({mul(m.params[0], 2.0)}, 1024));     // not a leaf
  EXPECT_TRUE(raises(m.params, 0));
}

// Each rank: a bucketed model and a plain copy whose gradients are all-reduced one by one
// after backward. The sums agree bit for bit (the in-process reduction adds in rank order
// either way), and match a float64 sum of every rank's local gradients.
TEST(GradientBuckets, SumsEqualPerParameterAllReduceExactly) {
  constexpr int kRanks = 3;
  std::vector<std::vector<Tensor>> local(kRanks), bucketed(kRanks);
  dist::run_in_process(kRanks, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    const Mlp a(kWeightSeed), b(kWeightSeed);
    GradientBuckets buckets(a.params, borrow(comm), kCap);
    backward_on(a, r, 0);
    buckets.finish();
    backward_on(b, r, 0);
    local[static_cast<size_t>(r)] = grads_of(b);
    for (const Tensor& p : b.params) comm.all_reduce(p.grad());
    bucketed[static_cast<size_t>(r)] = grads_of(a);
    expect_equal(bucketed[static_cast<size_t>(r)], grads_of(b));
  });
  for (size_t i = 0; i < local[0].size(); ++i) {
    Tensor want = zeros(local[0][i].shape(), DType::kFloat64);
    for (const auto& rank : local) want = add(want, rank[i].to(DType::kFloat64));
    const double scale = max(abs(want)).item<double>();
    for (const auto& rank : bucketed) {
      EXPECT_TRUE(allclose(rank[i].to(DType::kFloat64), want, 0.0, 4e-7 * kRanks * scale))
          << "parameter " << i;
    }
  }
}

// Backward produces b2, W2, b1, W1, b0, W0; each bucket is posted as soon as its last
// gradient arrives (and those before it are posted), during backward.
TEST(GradientBuckets, BucketsArePostedDuringBackwardAsTheyComplete) {
  dist::run_in_process(2, [&](dist::Communicator& comm) {
    const Mlp m(kWeightSeed);
    GradientBuckets buckets(m.params, borrow(comm), kCap);  // {5, 4, 3}, {2}, {1, 0}
    struct Seen {
      size_t param, posted;
      int64_t collectives;
    };
    std::vector<Seen> seen;
    std::vector<autograd::HookHandle> hooks;  // run after the buckets' own hooks
    for (size_t i = 0; i < m.params.size(); ++i) {
      hooks.push_back(autograd::register_post_accumulate_grad_hook(
          m.params[i], [&, i](const Tensor&) {
            seen.push_back({i, buckets.posted(), comm.stats().collectives});
          }));
    }
    backward_on(m, comm.rank(), 0);
    const std::vector<size_t> order = {5, 4, 3, 2, 1, 0};
    const std::vector<size_t> posted_after = {0, 0, 1, 2, 2, 3};
    ASSERT_EQ(seen.size(), order.size());
    for (size_t k = 0; k < seen.size(); ++k) {
      EXPECT_EQ(seen[k].param, order[k]) << k;
      EXPECT_EQ(seen[k].posted, posted_after[k]) << k;
      EXPECT_EQ(seen[k].collectives, static_cast<int64_t>(posted_after[k])) << k;
    }
    buckets.finish();
    EXPECT_EQ(comm.stats().collectives, 3);  // finish() had nothing left to post
    // The gradients are views of the bucket buffers: W2 directly follows b2 in bucket 0.
    EXPECT_EQ(m.params[4].grad().storage(), m.params[5].grad().storage());
    EXPECT_EQ(m.params[4].grad().offset(), m.params[5].numel());
  });
}

// Gradient accumulation: the first micro-batch's backward (sync off) communicates nothing;
// the second's sums the accumulated gradients once.
TEST(GradientBuckets, NoSyncAccumulatesLocallyThenSumsOnce) {
  dist::run_in_process(2, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    const Mlp a(kWeightSeed), b(kWeightSeed);
    GradientBuckets buckets(a.params, borrow(comm), kCap);
    buckets.set_sync(false);
    backward_on(a, r, 0);
    EXPECT_EQ(comm.stats().collectives, 0);
    backward_on(b, r, 0);
    expect_equal(grads_of(a), grads_of(b));  // still this rank's own
    buckets.set_sync(true);
    backward_on(a, r, 1);
    buckets.finish();
    EXPECT_EQ(comm.stats().collectives, 3);
    backward_on(b, r, 1);
    for (const Tensor& p : b.params) comm.all_reduce(p.grad());
    expect_equal(grads_of(a), grads_of(b));
    // A second step starts afresh (the trainer drops the gradients between steps).
    for (Tensor p : a.params) p.set_grad(Tensor());
    for (Tensor p : b.params) p.set_grad(Tensor());
    backward_on(a, r, 2);
    buckets.finish();
    backward_on(b, r, 2);
    for (const Tensor& p : b.params) comm.all_reduce(p.grad());
    expect_equal(grads_of(a), grads_of(b));
  });
}

// A parameter rank 1 does not use (registered last, so in the first bucket): rank 1's first
// bucket completes only in finish(), with zeros for it, and both ranks get rank 0's gradient.
TEST(GradientBuckets, ParametersARankDoesNotUseCountAsZero) {
  std::vector<Tensor> extra_grads(2);
  dist::run_in_process(2, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    const Mlp m(kWeightSeed);
    Tensor extra = full({3}, 0.5);
    extra.set_requires_grad(true);
    std::vector<Tensor> params = m.params;
    params.push_back(extra);
    GradientBuckets buckets(params, borrow(comm), kCap);
    const auto [x, target] = batch(r, 0);
    Tensor loss = m.loss(x, target);
    if (r == 0) loss = add(loss, sum(mul(mul(extra, extra), from_vector<float>({1, 2, 3}, {3}))));
    loss.backward();
    EXPECT_EQ(buckets.posted(), r == 0 ? 3u : 0u);
    buckets.finish();
    extra_grads[static_cast<size_t>(r)] = extra.grad().clone();
  });
  for (const Tensor& g : extra_grads) {
    ASSERT_TRUE(g.defined());
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1.0f, 2.0f, 3.0f}));  // 2 * 0.5 * k
  }
}

TEST(GradientBuckets, ASecondBackwardInASynchronizedStepIsRefused) {
  const std::shared_ptr<dist::Communicator> comm = dist::make_in_process_group(1)[0];
  const Mlp m(kWeightSeed);
  GradientBuckets buckets(m.params, comm, kCap);
  backward_on(m, 0, 0);
  try {
    backward_on(m, 0, 1);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("second gradient"), std::string::npos) << e.what();
  }
  try {
    buckets.set_sync(false);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("finish()"), std::string::npos) << e.what();
  }
  buckets.finish();
  buckets.set_sync(false);  // fine between steps
}

}  // namespace
}  // namespace rd::nn
