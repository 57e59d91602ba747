// Asynchronous index errors on CUDA (tensor/device.h): index ops and cross_entropy queue
// their work without a host synchronization, skip out-of-range values, and the next
// synchronization the library performs raises them; a training step makes no host
// synchronization at all (host_sync_count). The CPU checks synchronously.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/stream.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/raises.h"

namespace rd::test {
namespace {

TEST(AsyncErrorsCpu, CpuChecksAtOnceAndNeverSynchronizes) {
  const Tensor weight = ones({4, 3});
  EXPECT_TRUE(raises([&] { embedding(weight, from_vector<int64_t>({1, 4}, {2})); },
                     {ErrorCode::kOutOfRange}, {"embedding", "4"}));
  check_async_errors(Device::cpu());  // nothing recorded, nothing to wait for
  EXPECT_EQ(host_sync_count(Device::cpu()), 0);
}

class AsyncErrorsCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    synchronize(kCuda);  // nothing left over from earlier tests
  }
  static constexpr Device kCuda = Device::cuda(0);
  TensorOptions on_gpu(DType dtype = DType::kFloat32) const {
    return TensorOptions(dtype).with_device(kCuda);
  }
};

TEST_F(AsyncErrorsCuda, OutOfRangeEmbeddingIndexRaisesAtTheNextSynchronize) {
  Generator gen(1);
  const Tensor weight = randn({5, 8}, gen, on_gpu());
  const Tensor indices = from_vector<int64_t>({0, 7, 2, 4}, {4}).to(kCuda);
  const int64_t syncs = host_sync_count(kCuda);
  Tensor out;
  ASSERT_NO_THROW(out = embedding(weight, indices));  // queued: no check on the host
  EXPECT_EQ(host_sync_count(kCuda), syncs) << "embedding synchronized with the host";
  EXPECT_TRUE(raises([&] { synchronize(kCuda); }, {ErrorCode::kOutOfRange},
                     {"index_select", "index 7", "size 5"}));
  EXPECT_NO_THROW(synchronize(kCuda)) << "the error is raised once";
  // The good rows are right; the bad one reads as 0 (nothing outside weight was read).
  const std::vector<float> got = out.to(Device::cpu()).to_vector<float>();
  const std::vector<float> w = weight.to(Device::cpu()).to_vector<float>();
  for (int64_t e = 0; e < 8; ++e) {
    EXPECT_EQ(got[0 * 8 + e], w[0 * 8 + e]);
    EXPECT_EQ(got[1 * 8 + e], 0.0f);
    EXPECT_EQ(got[2 * 8 + e], w[2 * 8 + e]);
    EXPECT_EQ(got[3 * 8 + e], w[4 * 8 + e]);
  }
}

TEST_F(AsyncErrorsCuda, EveryIndexOpAndCheckAsyncErrorsReport) {
  const Tensor x = ones({3, 4}, on_gpu());
  const Tensor bad = from_vector<int64_t>({0, 3, 1, 1}, {1, 4}).to(kCuda);  // 3 >= x.size(0)
  EXPECT_TRUE(raises(
      [&] {
        gather(x, 0, bad);
        check_async_errors(kCuda);
      },
      {ErrorCode::kOutOfRange}, {"gather", "index 3"}));
  EXPECT_TRUE(raises(
      [&] {
        scatter_add(x, 0, bad, ones({1, 4}, on_gpu()));
        Stream::current(kCuda).synchronize();
      },
      {ErrorCode::kOutOfRange}, {"scatter", "index 3"}));
  EXPECT_TRUE(raises(
      [&] {
        index_select(x, 1, from_vector<int64_t>({-2}, {1}).to(kCuda));
        x.to(Device::cpu());  // a device-to-host copy is a synchronization point
      },
      {ErrorCode::kOutOfRange}, {"index_select", "index -2"}));
}

TEST_F(AsyncErrorsCuda, OutOfRangeCrossEntropyTargetRaisesAtTheLossCopy) {
  Generator gen(2);
  for (const Shape& shape : {Shape{4, 6}, Shape{2, 6, 3}}) {
    SCOPED_TRACE(shape.size() == 2 ? "[N, C]" : "[N, C, d]");
    const Tensor logits = randn(shape, gen, on_gpu());
    std::vector<int64_t> t(shape.size() == 2 ? 4 : 6, 1);
    t[1] = 6;  // classes are [0, 6)
    const Shape target_shape = shape.size() == 2 ? Shape{4} : Shape{2, 3};
    const Tensor targets = from_vector<int64_t>(t, target_shape).to(kCuda);
    Tensor loss;
    ASSERT_NO_THROW(loss = cross_entropy(logits, targets));
    EXPECT_TRUE(raises([&] { loss.item<float>(); }, {ErrorCode::kOutOfRange},
                       {"cross_entropy", "target 6", "6 classes"}));
  }
}

// Forward and backward of a small model touching every op that used to synchronize
// (embedding, index ops, spatial cross-entropy) and rotary_embedding: no host
// synchronization until the loss is read.
TEST_F(AsyncErrorsCuda, ATrainingStepMakesNoHostSynchronization) {
  Generator gen(3);
  Tensor table = randn({50, 16}, gen, on_gpu()).set_requires_grad(true);
  Tensor proj = randn({10, 16}, gen, on_gpu()).set_requires_grad(true);
  const Tensor tokens = from_vector<int64_t>({3, 7, 49, 0, 12, 8, 8, 1}, {2, 4}).to(kCuda);
  const Tensor labels = from_vector<int64_t>({1, 2, 9, -100, 0, 5, 5, 3}, {2, 4}).to(kCuda);
  synchronize(kCuda);
  const int64_t before = host_sync_count(kCuda);

  Tensor h = embedding(table, tokens);                                 // [2, 4, 16]
  h = rotary_embedding(h.view({2, 4, 2, 8}), 1'000'000).view({2, 4, 16});
  const Tensor columns = from_vector<int64_t>({0, 1, 15}, {1, 1, 3}).to(kCuda);
  h = h + sum(gather(h, 2, columns.expand({2, 4, 3})), {2}, true);  // gather + scatter_add
  h = h + index_select(h, 1, from_vector<int64_t>({3, 2, 1, 0}, {4}).to(kCuda));
  Tensor logits = linear(h, proj).permute({0, 2, 1});                  // [2, 10, 4]
  Tensor loss = cross_entropy(logits, labels);
  loss.backward();
  EXPECT_EQ(host_sync_count(kCuda), before) << "the step waited for the device";

  EXPECT_NO_THROW(check_async_errors(kCuda));
  EXPECT_EQ(host_sync_count(kCuda), before + 1);
  EXPECT_TRUE(std::isfinite(loss.item<float>()));
  EXPECT_GT(host_sync_count(kCuda), before + 1);  // the copy of the loss counts too
}

}  // namespace
}  // namespace rd::test
