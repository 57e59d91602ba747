// The in-process communicator (ranks as threads): every collective and point-to-point call
// against values each rank computes independently, sub-groups, traffic counters, bad
// arguments, timeouts and the failure of one rank stopping the others.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

namespace rd {
namespace {

using dist::Communicator;
using dist::ReduceOp;
using std::chrono::milliseconds;

// Rank r's contribution: random values every rank can recompute from (seed, r).
Tensor contribution(int rank, const Shape& shape, DType dtype, uint64_t seed = 5) {
  Generator gen(seed * 1000 + static_cast<uint64_t>(rank));
  return randn(shape, gen, TensorOptions(dtype));
}

void expect_equal(const Tensor& got, const Tensor& want, double tol = 0) {
  const test::RefArray g = test::to_ref(got), w = test::to_ref(want);
  ASSERT_EQ(g.shape, w.shape);
  for (int64_t i = 0; i < w.numel(); ++i) {
    ASSERT_NEAR(g.data[i], w.data[i], tol * std::max(1.0, std::abs(w.data[i]))) << "element " << i;
  }
}

class InProcessCollectives : public ::testing::TestWithParam<int> {};

TEST_P(InProcessCollectives, AllGatherStacksEveryRanksTensor) {
  const int P = GetParam();
  dist::run_in_process(P, [&](Communicator& comm) {
    const Tensor in = contribution(comm.rank(), {3, 5}, DType::kFloat32);
    Tensor out = full({P, 3, 5}, NAN, DType::kFloat32);  // poisoned
    comm.all_gather(out, in);
    for (int j = 0; j < P; ++j) expect_equal(out.select(0, j), contribution(j, {3, 5}, DType::kFloat32));
  });
}

TEST_P(InProcessCollectives, ReduceScatterAndAllReduceEveryOp) {
  const int P = GetParam();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
      dist::run_in_process(P, [&](Communicator& comm) {
        // Expected: the reduction of every rank's values, in float64, rank order.
        Tensor want = contribution(0, {P, 4, 3}, dtype).to(DType::kFloat64);
        for (int j = 1; j < P; ++j) {
          const Tensor c = contribution(j, {P, 4, 3}, dtype).to(DType::kFloat64);
          want = op == ReduceOp::kSum ? add(want, c) : op == ReduceOp::kMax ? maximum(want, c)
                                                                             : minimum(want, c);
        }
        // float32 sums of at most 4 terms; bf16 results rounded once to 8 bits.
        const double tol = dtype == DType::kFloat64 ? 1e-15 : dtype == DType::kFloat32 ? 1e-6 : 8e-3;
        Tensor mine = full({4, 3}, NAN, dtype);
        comm.reduce_scatter(mine, contribution(comm.rank(), {P, 4, 3}, dtype), op);
        expect_equal(mine, want.select(0, comm.rank()), tol);
        Tensor all = contribution(comm.rank(), {P, 4, 3}, dtype);
        comm.all_reduce(all, op);
        expect_equal(all, want, tol);
      });
    }
  }
}

TEST_P(InProcessCollectives, BroadcastFromEveryRoot) {
  const int P = GetParam();
  dist::run_in_process(P, [&](Communicator& comm) {
    for (int root = 0; root < P; ++root) {
      Tensor t = comm.rank() == root ? contribution(root, {7}, DType::kFloat64)
                                     : full({7}, NAN, DType::kFloat64);
      comm.broadcast(t, root);
      expect_equal(t, contribution(root, {7}, DType::kFloat64));
    }
  });
}

TEST_P(InProcessCollectives, RingOfSendsArrivesInOrder) {
  const int P = GetParam();
  dist::run_in_process(P, [&](Communicator& comm) {
    const int me = comm.rank(), next = (me + 1) % P, prev = (me + P - 1) % P;
    // Three messages to the next rank, posted before any is received: FIFO per peer.
    std::vector<std::unique_ptr<dist::Request>> sends;
    std::vector<Tensor> sent;
    for (int m = 0; m < 3; ++m) {
      sent.push_back(contribution(me, {2, 3}, DType::kFloat32, 10 + static_cast<uint64_t>(m)));
      sends.push_back(comm.isend(sent.back(), next));
    }
    for (int m = 0; m < 3; ++m) {
      Tensor got = full({2, 3}, NAN, DType::kFloat32);
      comm.irecv(got, prev)->wait();
      expect_equal(got, contribution(prev, {2, 3}, DType::kFloat32, 10 + static_cast<uint64_t>(m)));
    }
    for (auto& s : sends) s->wait();
    const dist::CommStats stats = comm.stats();
    EXPECT_EQ(stats.sends, 3);
    EXPECT_EQ(stats.bytes_sent, 3 * 6 * 4);
    EXPECT_EQ(stats.bytes_received, 3 * 6 * 4);
  });
}

TEST_P(InProcessCollectives, SplitFormsGroupsByColorRankedByKey) {
  const int P = GetParam();
  dist::run_in_process(P, [&](Communicator& comm) {
    const int color = comm.rank() % 2;
    // Reverse order within a color: key = -rank.
    std::shared_ptr<Communicator> sub = comm.split(color, -comm.rank());
    ASSERT_NE(sub, nullptr);
    std::vector<int> members;
    for (int j = P - 1; j >= 0; --j) {
      if (j % 2 == color) members.push_back(j);
    }
    ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
    EXPECT_EQ(members[static_cast<size_t>(sub->rank())], comm.rank());
    Tensor t = full({2}, comm.rank() + 1.0, DType::kFloat64);
    sub->all_reduce(t);
    double want = 0;
    for (int j : members) want += j + 1.0;
    expect_equal(t, full({2}, want, DType::kFloat64));
    // A negative color joins nothing.
    EXPECT_EQ(comm.split(comm.rank() == 0 ? -1 : 0, 0) == nullptr, comm.rank() == 0);
  });
}

TEST_P(InProcessCollectives, CachedSplitIsMadeOnceAndKept) {
  const int P = GetParam();
  dist::run_in_process(P, [&](Communicator& comm) {
    const int color = comm.rank() / 2;  // pairs of neighbours
    std::shared_ptr<Communicator> first = comm.cached_split(color, comm.rank());
    ASSERT_NE(first, nullptr);
    // A second call is no collective: only this rank asks, and it gets the same group.
    EXPECT_EQ(comm.cached_split(color, comm.rank()), first);
    EXPECT_EQ(first->size(), std::min(2, P - 2 * color));
    Tensor t = full({3}, comm.rank() + 1.0, DType::kFloat64);
    first->all_reduce(t);
    double want = 0;
    for (int j = 2 * color; j < std::min(P, 2 * color + 2); ++j) want += j + 1.0;
    expect_equal(t, full({3}, want, DType::kFloat64));
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, InProcessCollectives, ::testing::Values(1, 2, 3, 4));

TEST(InProcess, BadArgumentsNameTheOpAndShapes) {
  dist::run_in_process(2, [&](Communicator& comm) {
    EXPECT_TRUE(test::raises([&] { comm.all_gather(zeros({3, 4}), zeros({4})); },
                             {ErrorCode::kShapeMismatch}, {"all_gather", "[2, 4]", "[3, 4]"}));
    EXPECT_TRUE(test::raises([&] { comm.isend(zeros({4}), 2); }, {ErrorCode::kOutOfRange},
                             {"isend", "peer rank 2", "2 ranks"}));
    EXPECT_TRUE(test::raises([&] { comm.all_reduce(zeros({4, 4}).t()); },
                             {ErrorCode::kInvalidArgument}, {"all_reduce", "contiguous"}));
    comm.barrier();
  });
}

TEST(InProcess, MismatchedCollectivesAreAnErrorNotAHang) {
  EXPECT_TRUE(test::raises(
      [] {
        dist::run_in_process(2, [](Communicator& comm) {
          Tensor t = zeros({2});
          if (comm.rank() == 0) comm.all_reduce(t);
          else comm.broadcast(t, 0);
        });
      },
      {ErrorCode::kInvalidArgument}, {"all_reduce", "broadcast", "same order"}));
}

TEST(InProcess, AWaitPastTheTimeoutFailsNamingTheMissingRank) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::raises(
      [] {
        dist::run_in_process(
            3,
            [](Communicator& comm) {
              if (comm.rank() != 2) comm.barrier();  // rank 2 never comes
            },
            Device::cpu(), {milliseconds(200)});
      },
      {ErrorCode::kTimeout}, {"barrier", "ranks not there: 2"}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// The point-to-point twin of the test above: a receive whose sender never sends fails past
// the timeout, naming the rank that waited and the sender.
TEST(InProcess, AReceiveFromARankThatNeverSendsFailsNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::raises(
      [] {
        dist::run_in_process(
            2,
            [](Communicator& comm) {
              if (comm.rank() == 1) {
                Tensor got = zeros({3});
                comm.irecv(got, 0)->wait();  // rank 0 returns without sending
              }
            },
            Device::cpu(), {milliseconds(200)});
      },
      {ErrorCode::kTimeout}, {"rank 1", "a receive from rank 0"}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(InProcess, AFailingRankStopsTheOthersWithAnErrorNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> others(4);
  EXPECT_TRUE(test::raises(
      [&] {
        dist::run_in_process(
            4,
            [&](Communicator& comm) {
              if (comm.rank() == 1) throw std::runtime_error("disk on fire");
              try {
                Tensor t = zeros({8});
                comm.all_reduce(t);  // would wait for rank 1 for a minute
              } catch (const Error& e) {
                others[static_cast<size_t>(comm.rank())] = e.what();
                throw;
              }
            },
            Device::cpu(), {milliseconds(60000)});
      },
      {ErrorCode::kInternal}, {"rank 1 of 4", "disk on fire"}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int r : {0, 2, 3}) {
    EXPECT_NE(others[static_cast<size_t>(r)].find("rank 1: failed: disk on fire"), std::string::npos)
        << others[static_cast<size_t>(r)];
  }
}

}  // namespace
}  // namespace rd
