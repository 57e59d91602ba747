// Tests of host<->device tensor copies (Tensor::to(Device), kernels::cuda::copy_bytes) and
// of the pinned staging pool behind them. They need a CUDA device and skip without one.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/pinned_pool.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/cuda/transfer.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd {
namespace {

#if defined(RD_WITH_CUDA)

using kernels::cuda::PinnedHostPool;
using kernels::cuda::StreamGuard;

constexpr Device kCuda0 = Device::cuda(0);
constexpr Device kCpu = Device::cpu();

// A CPU tensor of `shape` whose bytes are random (bool: random 0/1, so the values stay
// valid). Copies move bytes, so raw bit patterns are the sharpest check.
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = empty(shape, dtype);
  auto* data = static_cast<unsigned char*>(t.raw_data());
  const size_t nbytes = static_cast<size_t>(t.numel()) * dtype_size(dtype);
  for (size_t i = 0; i < nbytes; ++i) {
    data[i] = dtype == DType::kBool ? static_cast<unsigned char>(rng() & 1)
                                    : static_cast<unsigned char>(rng());
  }
  return t;
}

// The bytes of a CPU tensor's elements in logical row-major order, gathered by walking its
// shape and strides directly (independent of contiguous() and the copy kernels).
std::vector<unsigned char> logical_bytes(const Tensor& t) {
  EXPECT_EQ(t.device(), kCpu);
  const size_t elem = dtype_size(t.dtype());
  const auto* base = static_cast<const unsigned char*>(t.storage()->data());
  std::vector<unsigned char> out;
  out.reserve(static_cast<size_t>(t.numel()) * elem);
  std::vector<int64_t> index(static_cast<size_t>(t.dim()), 0);
  for (int64_t n = 0; n < t.numel(); ++n) {
    int64_t offset = t.offset();
    for (size_t d = 0; d < index.size(); ++d) offset += index[d] * t.strides()[d];
    const unsigned char* p = base + static_cast<size_t>(offset) * elem;
    out.insert(out.end(), p, p + elem);
    for (size_t d = index.size(); d-- > 0;) {  // odometer increment, last dim fastest
      if (++index[d] < t.shape()[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// Whether the CUDA kernel backend (needed to make a strided CUDA tensor contiguous) exists
// in this build yet.
bool cuda_kernels_available() {
  try {
    backend_for(kCuda0);
    return true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnimplemented) return false;
    throw;
  }
}

using test::StreamGate;
using test::TestStream;

class CudaTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
};

using PinnedPoolTest = CudaTransferTest;

TEST_F(CudaTransferTest, RoundTripPreservesEveryDType) {
  std::mt19937_64 rng(1);
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor host = random_tensor({3, 257}, dtype, rng);
    Tensor device = host.to(kCuda0);
    EXPECT_EQ(device.device(), kCuda0);
    EXPECT_EQ(device.dtype(), dtype);
    EXPECT_EQ(device.shape(), host.shape());
    EXPECT_TRUE(device.is_contiguous());
    Tensor back = device.to(kCpu);
    EXPECT_EQ(back.device(), kCpu);
    EXPECT_EQ(back.shape(), host.shape());
    EXPECT_NE(back.storage(), host.storage());  // a new tensor, not the source
    EXPECT_EQ(logical_bytes(back), logical_bytes(host));
  }
}

TEST_F(CudaTransferTest, ToTheSameDeviceReturnsTheTensorItself) {
  std::mt19937_64 rng(2);
  Tensor device = random_tensor({5}, DType::kFloat32, rng).to(kCuda0);
  EXPECT_TRUE(device.to(kCuda0).is_same(device));
}

TEST_F(CudaTransferTest, TransfersLargerThanOneStagingChunk) {
  std::mt19937_64 rng(3);
  // Two full chunks plus a ragged tail, in both directions.
  const int64_t n = static_cast<int64_t>(2 * kernels::cuda::kStagingChunkBytes / 4) + 1025;
  Tensor host = random_tensor({n}, DType::kFloat32, rng);
  EXPECT_EQ(logical_bytes(host.to(kCuda0).to(kCpu)), logical_bytes(host));
}

TEST_F(CudaTransferTest, SourceMayChangeOnceToReturns) {
  std::mt19937_64 rng(4);
  Tensor host = random_tensor({64, 1000}, DType::kFloat32, rng);
  const std::vector<unsigned char> original = logical_bytes(host);
  Tensor device = host.to(kCuda0);
  // The copy may still be in flight, but it reads the staging buffer, not `host`.
  std::memset(host.raw_data(), 0, original.size());
  EXPECT_EQ(logical_bytes(device.to(kCpu)), original);
}

TEST_F(CudaTransferTest, NonContiguousCpuSourcesArriveInLogicalOrder) {
  std::mt19937_64 rng(5);
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor base = random_tensor({6, 10}, dtype, rng);
    const std::vector<Tensor> views = {base.t(), base.slice(1, 1, 10, 3), base.select(1, 4),
                                       base.unsqueeze(1).expand({6, 4, 10}),
                                       base.view({2, 3, 10}).permute({2, 0, 1})};
    for (const Tensor& view : views) {
      SCOPED_TRACE(shape_str(view.shape()) + " strides " + shape_str(view.strides()));
      ASSERT_FALSE(view.is_contiguous());
      Tensor device = view.to(kCuda0);
      EXPECT_EQ(device.shape(), view.shape());
      EXPECT_TRUE(device.is_contiguous());
      EXPECT_EQ(logical_bytes(device.to(kCpu)), logical_bytes(view));
    }
  }
}

TEST_F(CudaTransferTest, NonContiguousCudaSourcesArriveInLogicalOrder) {
  if (!cuda_kernels_available()) GTEST_SKIP() << "the CUDA kernel backend is not built yet";
  std::mt19937_64 rng(6);
  Tensor base = random_tensor({6, 10}, DType::kFloat32, rng);
  Tensor device = base.to(kCuda0);
  EXPECT_EQ(logical_bytes(device.t().to(kCpu)), logical_bytes(base.t()));
  EXPECT_EQ(logical_bytes(device.slice(1, 1, 10, 3).to(kCpu)),
            logical_bytes(base.slice(1, 1, 10, 3)));
}

TEST_F(CudaTransferTest, DeviceToDeviceOnOneDevice) {
  std::mt19937_64 rng(7);
  Tensor host = random_tensor({33, 65}, DType::kFloat64, rng);
  Tensor source = host.to(kCuda0);
  Tensor copy = empty(host.shape(), TensorOptions(host.dtype()).with_device(kCuda0));
  kernels::cuda::copy_bytes(copy.raw_data(), kCuda0, source.raw_data(), kCuda0,
                            static_cast<size_t>(host.numel()) * dtype_size(host.dtype()));
  EXPECT_NE(copy.raw_data(), source.raw_data());
  EXPECT_EQ(logical_bytes(copy.to(kCpu)), logical_bytes(host));
}

TEST_F(CudaTransferTest, DeviceToOtherDevice) {
  if (kernels::cuda::device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  std::mt19937_64 rng(8);
  Tensor host = random_tensor({17, 129}, DType::kBFloat16, rng);
  Tensor on_second = host.to(kCuda0).to(Device::cuda(1));
  EXPECT_EQ(on_second.device(), Device::cuda(1));
  EXPECT_EQ(logical_bytes(on_second.to(kCpu)), logical_bytes(host));
  EXPECT_EQ(logical_bytes(on_second.to(kCuda0).to(kCpu)), logical_bytes(host));
}

TEST_F(CudaTransferTest, EmptyAndScalarTensors) {
  for (const Shape& shape : {Shape{0}, Shape{0, 5}, Shape{4, 0, 3}}) {
    SCOPED_TRACE(shape_str(shape));
    Tensor device = empty(shape, DType::kFloat32).to(kCuda0);
    EXPECT_EQ(device.device(), kCuda0);
    EXPECT_EQ(device.shape(), shape);
    Tensor back = device.to(kCpu);
    EXPECT_EQ(back.shape(), shape);
    EXPECT_EQ(back.numel(), 0);
  }
  Tensor scalar = scalar_tensor(-3.25, DType::kFloat64).to(kCuda0);
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.item<double>(), -3.25);
}

TEST_F(CudaTransferTest, WorksOnANonDefaultStream) {
  TestStream stream;
  StreamGuard on_stream(0, stream.get());
  std::mt19937_64 rng(9);
  Tensor host = random_tensor({300, 7}, DType::kInt64, rng);
  EXPECT_EQ(logical_bytes(host.to(kCuda0).to(kCpu)), logical_bytes(host));
}

TEST_F(CudaTransferTest, MissingDeviceIsADeviceMismatch) {
  Tensor host = zeros({3});
  try {
    host.to(Device::cuda(1000));
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeviceMismatch) << e.what();
  }
}

TEST_F(CudaTransferTest, GradientFlowsBackToACpuLeaf) {
  Generator gen(10);
  Tensor x = randn({4, 7}, gen);
  x.set_requires_grad(true);
  Tensor on_gpu = x.to(kCuda0);
  EXPECT_TRUE(on_gpu.requires_grad());
  ASSERT_NE(on_gpu.grad_fn(), nullptr);
  EXPECT_EQ(on_gpu.grad_fn()->name(), "to_device");
  Tensor loss = sum(on_gpu.to(kCpu));
  loss.backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().device(), kCpu);
  EXPECT_EQ(x.grad().shape(), x.shape());
  for (float g : x.grad().to_vector<float>()) EXPECT_EQ(g, 1.0f);
}

TEST_F(CudaTransferTest, GradientFlowsBackToACudaLeaf) {
  Generator gen(11);
  Tensor x = randn({3, 5}, gen).to(kCuda0);
  x.set_requires_grad(true);
  Tensor weights = randn({3, 5}, gen);
  // d/dx sum(x * w) = w: the gradient comes back to the GPU with the weights' values.
  Tensor loss = sum(mul(x.to(kCpu), weights));
  loss.backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().device(), kCuda0);
  EXPECT_EQ(x.grad().to_vector<float>(), weights.to_vector<float>());
}

TEST_F(CudaTransferTest, NoNodeWithoutGradMode) {
  Generator gen(12);
  Tensor x = randn({4}, gen);
  x.set_requires_grad(true);
  autograd::NoGradGuard no_grad;
  Tensor on_gpu = x.to(kCuda0);
  EXPECT_FALSE(on_gpu.requires_grad());
  EXPECT_EQ(on_gpu.grad_fn(), nullptr);
}

TEST_F(CudaTransferTest, TransfersReuseStagingBuffers) {
  PinnedHostPool& pool = kernels::cuda::pinned_host_pool();
  std::mt19937_64 rng(13);
  Tensor host = random_tensor({1000}, DType::kFloat32, rng);
  // A staging buffer is reusable once its copy's event has completed. Waiting after each
  // copy makes the counts independent of timing: without it the copy back finds the
  // upload's buffer free or still in flight depending on how fast the upload ran.
  const auto round_trip = [&host] {
    Tensor device = host.to(kCuda0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Tensor back = device.to(kCpu);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return back;
  };
  round_trip();  // leaves a staging buffer of this size class behind
  const MemoryStats before = pool.stats();
  Tensor back = round_trip();
  const MemoryStats after = pool.stats();
  EXPECT_EQ(after.system_allocs, before.system_allocs);
  EXPECT_EQ(after.cache_hits - before.cache_hits, 2);  // the upload and the copy back
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);  // everything was returned
  EXPECT_EQ(logical_bytes(back), logical_bytes(host));
}

TEST_F(PinnedPoolTest, ReleasedBufferServesItsSizeClass) {
  PinnedHostPool pool;
  EXPECT_EQ(pool.allocate(0), nullptr);
  void* a = pool.allocate(1000);  // class 1024
  std::memset(a, 0x5a, 1000);     // host-writable
  pool.release(a);
  void* b = pool.allocate(900);  // also class 1024
  EXPECT_EQ(b, a);
  void* c = pool.allocate(2000);  // class 2048: a new buffer
  EXPECT_NE(c, a);
  const MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.allocated_bytes, 1024 + 2048);
  EXPECT_EQ(stats.reserved_bytes, 1024 + 2048);
  EXPECT_EQ(stats.cache_hits, 1);
  EXPECT_EQ(stats.cache_misses, 2);
  EXPECT_EQ(stats.system_allocs, 2);
  pool.release(b);
  pool.release(c);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_frees, 2);
}

TEST_F(PinnedPoolTest, BufferInFlightIsReusedOnlyAfterItsStreamFinishes) {
  TestStream stream;
  PinnedHostPool pool;
  void* a = pool.allocate(1000);
  void* b = pool.allocate(1000);
  pool.release(b);  // cached, so no cudaHostAlloc is needed while the gate is closed
  {
    StreamGate gate(stream.get());
    pool.release_after(a, 0, stream.get());
    void* got = pool.allocate(1000);
    EXPECT_EQ(got, b);  // a may still be in use
    EXPECT_EQ(pool.stats().allocated_bytes, 1024);
    b = got;
  }  // opens the gate and waits for the stream
  void* again = pool.allocate(1000);
  EXPECT_EQ(again, a);
  EXPECT_EQ(pool.stats().system_allocs, 2);
  pool.release(b);
  pool.release(again);
}

TEST_F(PinnedPoolTest, BuffersBeyondTheCacheLimitAreFreed) {
  PinnedHostPool pool(/*max_cached_bytes=*/4096);
  void* a = pool.allocate(4096);
  void* b = pool.allocate(4096);
  pool.release(a);  // fills the cache
  pool.release(b);  // does not fit: freed
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.reserved_bytes, 4096);
  EXPECT_EQ(stats.system_frees, 1);
  EXPECT_EQ(pool.allocate(4096), a);
  pool.release(a);
}

TEST_F(PinnedPoolTest, UnknownPointerIsAnInternalError) {
  PinnedHostPool pool;
  int local = 0;
  try {
    pool.release(&local);
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
  }
}

#else  // !RD_WITH_CUDA

TEST(CudaTransferTest, BuiltWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace rd
