// The public stream and event API (tensor/stream.h) on a GPU: streams made current by a
// guard, work on one stream ordered after another's by an event, record_stream, and the
// refusal of cudaStreamPerThread as a current stream.
#include <gtest/gtest.h>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/stream.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace rd {
namespace {

#if defined(RD_WITH_CUDA)

class CudaStreams : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
  const Device gpu_ = Device::cuda(0);
};

TEST_F(CudaStreams, GuardMakesAStreamCurrentAndRestoresThePrevious) {
  const Stream before = Stream::current(gpu_);
  const Stream created = Stream::create(gpu_);
  EXPECT_FALSE(created == before);
  {
    const StreamGuard guard(created);
    EXPECT_TRUE(Stream::current(gpu_) == created);
  }
  EXPECT_TRUE(Stream::current(gpu_) == before);
}

// A long chain of writes on stream A, an event, then a copy on stream B that waits for it:
// B must see A's last write (without the event it would race).
TEST_F(CudaStreams, EventOrdersOneStreamAfterAnother) {
  const Stream a = Stream::create(gpu_), b = Stream::create(gpu_);
  const TensorOptions f32 = TensorOptions(DType::kFloat32).with_device(gpu_);
  Tensor x = zeros({1 << 22}, f32);
  Tensor y = full({1 << 22}, -1.0, f32);
  Stream::current(gpu_).synchronize();
  Event written;
  {
    const StreamGuard guard(a);
    for (int i = 1; i <= 50; ++i) x.fill_(i);
    written.record(a);
  }
  {
    const StreamGuard guard(b);
    written.block(b);
    y.copy_(x);
    record_stream(x, b);
  }
  b.synchronize();
  EXPECT_TRUE(written.query());
  const test::RefArray got = test::to_ref(y);
  for (int64_t i = 0; i < got.numel(); i += 4099) ASSERT_EQ(got.data[i], 50.0) << i;
}

TEST_F(CudaStreams, PerThreadDefaultStreamIsRefused) {
  EXPECT_TRUE(test::raises([] { kernels::cuda::set_current_stream(0, cudaStreamPerThread); },
                           {ErrorCode::kInvalidArgument}, {"cudaStreamPerThread"}));
}

#endif  // RD_WITH_CUDA

TEST(Streams, OnTheCpuEveryCallIsANoOpAndBadCallsAreErrors) {
  const Stream s = Stream::create(Device::cpu());
  const StreamGuard guard(s);
  Event e;
  e.record(s);
  e.block(s);
  e.synchronize();
  EXPECT_TRUE(e.query());
  s.synchronize();
  record_stream(zeros({3}), s);
  EXPECT_TRUE(test::raises([&] { record_stream(Tensor(), s); }, {ErrorCode::kInvalidArgument},
                           {"record_stream", "undefined"}));
}

}  // namespace
}  // namespace rd
