// What is the cuDNN attention path's own (kernels/cuda/cudnn_attention.h): the runtime
// version, the graph cache, concurrent callers on their own streams, and the reasons given
// for refusals. Its results, forward and backward (strided dilated views in place, heads
// inside, float32 out, gradients written in place), are checked by the attention
// conformance table (tests/cuda_attention_conformance_test.cc, the cudnn_* cases and every
// other case cuDNN accepts). Skipped without a GPU or without cuDNN.
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/attention_conformance.h"
#include "testing/host_views.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/cudnn_attention.h"
#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace rd::test {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudnnAttentionTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

namespace gpu = ::rd::kernels::cuda;
using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using kernels::AttentionKernel;
using kernels::StridedView;

class CudnnAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    if (!gpu::cudnn_attention_available()) {
      GTEST_SKIP() << "cuDNN attention unavailable (cuDNN runtime version "
                   << gpu::cudnn_runtime_version() << ")";
    }
  }
  kernels::KernelBackend& backend() { return backend_for(Device::cuda(0)); }
  // A view of `shape` (element strides, row-major when empty, from element `offset`) of a
  // new device buffer of `count` elements, uniform in [-1, 1].
  StridedView device_view(DType dtype, int64_t count, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides = {}, int64_t offset = 0) {
    Generator gen(static_cast<uint64_t>(buffers_.size()) + 9);
    buffers_.push_back(rand({count}, gen, TensorOptions(dtype).with_device(Device::cuda(0))));
    return view_into(buffers_.back(), shape, strides, offset);
  }
  static StridedView view_into(const Tensor& buffer, const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides = {}, int64_t offset = 0) {
    return make_view(kernel_view(buffer).data, buffer.dtype(), shape, strides, offset);
  }

  std::vector<Tensor> buffers_;
};

TEST_F(CudnnAttentionTest, ReportsVersion) {
  const int version = gpu::cudnn_runtime_version();
  std::cout << "cuDNN runtime version " << version << "\n";
  EXPECT_GE(version, 90000);
}

TEST_F(CudnnAttentionTest, GraphCacheBuildsOnce) {
  // A shape no other test uses, so the first call must build.
  AttentionForwardArgs f;
  f.q = f.k = f.v = device_view(DType::kBFloat16, 2 * 24 * 64, {2, 24, 64});
  f.out = device_view(DType::kBFloat16, 2 * 24 * 64, {2, 24, 64});
  f.lse = device_view(DType::kFloat32, 2 * 24, {2, 24});
  f.params.scale = 0.125;
  const gpu::CudnnGraphCacheStats before = gpu::cudnn_graph_cache_stats();
  backend().attention_forward(AttentionKernel::kCudnn, f);
  const gpu::CudnnGraphCacheStats first = gpu::cudnn_graph_cache_stats();
  backend().attention_forward(AttentionKernel::kCudnn, f);
  const gpu::CudnnGraphCacheStats second = gpu::cudnn_graph_cache_stats();
  synchronize(Device::cuda(0));
  EXPECT_EQ(first.builds, before.builds + 1);
  EXPECT_EQ(first.failures, before.failures);
  EXPECT_EQ(second.builds, first.builds);
  EXPECT_EQ(second.hits, first.hits + 1);
  EXPECT_GE(second.size, 1);
  EXPECT_LE(second.size, second.capacity);
  // Another scale is another graph.
  f.params.scale = 0.25;
  backend().attention_forward(AttentionKernel::kCudnn, f);
  synchronize(Device::cuda(0));
  EXPECT_EQ(gpu::cudnn_graph_cache_stats().builds, second.builds + 1);
}

TEST_F(CudnnAttentionTest, ConcurrentCallersGetCorrectResults) {
  // Four threads, each on its own stream, run the same new shape at once: the cache and
  // handle pool must serve them all, and every result (forward and backward) must match the
  // reference.
  const AttentionCase c{.name = "cudnn_concurrent_callers", .dtype = DType::kBFloat16,
                        .grad_dtype = DType::kFloat32, .batch = {2, 2}, .lq = 32, .lk = 32,
                        .d = 64, .scale = 0.1, .grad_lse = false, .q_range = 2,
                        .must = kCudnn};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c] {
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      {
        gpu::StreamGuard guard(0, stream);
        check_attention_case(c, Device::cuda(0), AttentionKernel::kCudnn);
      }
      cudaStreamDestroy(stream);
    });
  }
  for (std::thread& th : threads) th.join();
}

// ---------------------------------------------------------------------------------------
// Refusals: each names its reason, and the call throws kUnimplemented with it.

class CudnnAttentionRefusalTest : public CudnnAttentionTest {
 protected:
  void SetUp() override {
    CudnnAttentionTest::SetUp();
    if (IsSkipped()) return;
    big_ = device_view(DType::kBFloat16, 8 * 2 * 16 * 72 + 64, {1});
    out_ = device_view(DType::kBFloat16, 2 * 16 * 64, {1});
    lse_ = device_view(DType::kFloat32, 2 * 2 * 2 * 8, {1});
    f32_ = device_view(DType::kFloat32, 2 * 16 * 64, {1});
  }
  // A view of one of the buffers above.
  static StridedView of(const StridedView& buffer, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& strides = {}, int64_t offset = 0) {
    return make_view(buffer.data, buffer.dtype, shape, strides, offset);
  }
  // A valid bf16 call [1, 2, 16, 64] over big_ (q, k, v share it) into out_ / lse_.
  AttentionForwardArgs valid() const {
    AttentionForwardArgs f;
    f.q = f.k = f.v = of(big_, {1, 2, 16, 64});
    f.out = of(out_, {1, 2, 16, 64});
    f.lse = of(lse_, {1, 2, 16});
    f.params.scale = 0.125;
    return f;
  }
  void expect_refused(const AttentionForwardArgs& f, const std::string& reason) {
    std::string why;
    EXPECT_FALSE(backend().attention_supports(AttentionKernel::kCudnn, f, nullptr, &why)) << reason;
    EXPECT_NE(why.find(reason), std::string::npos) << "reason: " << why;
    try {
      backend().attention_forward(AttentionKernel::kCudnn, f);
      ADD_FAILURE() << "no error for: " << reason;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnimplemented) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }

  StridedView big_, out_, lse_, f32_;  // whole buffers, allocated once a GPU is known
};

TEST_F(CudnnAttentionRefusalTest, ValidCallIsSupported) {
  std::string why = "unset";
  EXPECT_TRUE(gpu::cudnn_attention_supports(valid(), &why)) << why;
  EXPECT_EQ(why, "");
}

TEST_F(CudnnAttentionRefusalTest, DTypes) {
  AttentionForwardArgs f = valid();
  f.q = f.k = f.v = of(f32_, {1, 2, 16, 64});
  expect_refused(f, "bfloat16 or float16");
  f = valid();
  f.out = of(f32_, {1, 2, 16, 64});
  expect_refused(f, "out is float32");
}

TEST_F(CudnnAttentionRefusalTest, HeadDims) {
  AttentionForwardArgs f = valid();
  for (int64_t head : {20, 264}) {
    f.q = f.k = f.v = of(big_, {1, 2, 16, head});
    f.out = of(big_, {1, 2, 16, head});
    expect_refused(f, "head dim " + std::to_string(head));
  }
}

TEST_F(CudnnAttentionRefusalTest, DropoutAndNegativeCausalOffset) {
  AttentionForwardArgs f = valid();
  f.params.dropout = 0.1;
  expect_refused(f, "dropout");
  f = valid();
  f.params.causal = true;
  f.params.causal_offset = -1;
  expect_refused(f, "causal_offset -1");
}

TEST_F(CudnnAttentionRefusalTest, Strides) {
  // Rows 72 elements apart are fine (a multiple of 8); 68 is not.
  AttentionForwardArgs f = valid();
  f.q = of(big_, {1, 2, 16, 64}, {2 * 16 * 68, 16 * 68, 68, 1});
  expect_refused(f, "multiple of 8");
  // A head dim that is not contiguous.
  f = valid();
  f.k = of(big_, {1, 2, 16, 64}, {2 * 16 * 128, 16 * 128, 128, 2});
  expect_refused(f, "head-dim stride 2");
  // A pointer one element past a 16-byte boundary.
  f = valid();
  f.v = of(big_, {1, 2, 16, 64}, {}, 1);
  expect_refused(f, "aligned");
  // Batch dims [2, 2, 2] laid out in reverse order: no split folds into (B, H).
  f = valid();
  f.q = f.k = f.v = of(big_, {2, 2, 2, 8, 64}, {8 * 64, 2 * 8 * 64, 4 * 8 * 64, 64, 1});
  f.out = of(big_, {2, 2, 2, 8, 64});
  f.lse = of(lse_, {2, 2, 2, 8});
  expect_refused(f, "cannot be folded");
}

TEST_F(CudnnAttentionRefusalTest, BackwardWithGradLse) {
  const AttentionForwardArgs f = valid();
  AttentionBackwardArgs b;
  b.q = b.k = b.v = b.out = b.grad_out = f.q;
  b.grad_q = b.grad_k = b.grad_v = of(f32_, {1, 2, 16, 64});
  b.lse = b.grad_lse = f.lse;
  b.params = f.params;
  std::string why;
  EXPECT_FALSE(gpu::cudnn_attention_supports_backward(b, &why));
  EXPECT_NE(why.find("grad_lse"), std::string::npos) << why;
  EXPECT_THROW(backend().attention_backward(AttentionKernel::kCudnn, b), Error);
  b.grad_lse = StridedView{};
  EXPECT_TRUE(gpu::cudnn_attention_supports_backward(b, &why)) << why;
}

TEST_F(CudnnAttentionRefusalTest, ShapeMismatchIsTheCallersError) {
  AttentionForwardArgs f = valid();
  f.k = of(big_, {1, 2, 16, 32});
  std::string why;
  EXPECT_FALSE(gpu::cudnn_attention_supports(f, &why));
  EXPECT_NE(why.find("does not match"), std::string::npos) << why;
  try {
    backend().attention_forward(AttentionKernel::kCudnn, f);
    ADD_FAILURE() << "no error for a k of another head dim";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch) << e.what();
  }
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::test
