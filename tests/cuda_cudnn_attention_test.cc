// What is the cuDNN attention path's own (kernels/cuda/cudnn_attention.h): the runtime
// version, the graph cache, concurrent callers on their own streams, and the reasons given
// for refusals. Its results, forward and backward (strided dilated views in place, heads
// inside, float32 out, gradients written in place), are checked by the attention
// conformance table (tests/cuda_attention_conformance_test.cc, the cudnn_* cases and every
// other case cuDNN accepts). Skipped without a GPU or without cuDNN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_runner.h"
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

// Gradients that repeat where k and v do not are the caller's error on cuDNN as on every
// kernel (check_attention_backward_args): here along a batch dim that cuDNN runs an entry at
// a time, where one entry's dK would store over another's.
TEST_F(CudnnAttentionTest, GradientsRepeatingWhereKeysDoNotAreRefused) {
  constexpr int64_t kL = 64, kD = 64;
  // [2, 3, 2, L, D] of a [2, 4, 3, L, D] buffer: neither dims 0-1 nor 1-2 fold.
  const std::vector<int64_t> shape = {2, 3, 2, kL, kD};
  const std::vector<int64_t> strides = {12 * kL * kD, 3 * kL * kD, kL * kD, kD, 1};
  const int64_t count = 24 * kL * kD;
  AttentionForwardArgs f;
  f.q = f.k = f.v = device_view(DType::kBFloat16, count, shape, strides);
  f.out = device_view(DType::kBFloat16, count, shape, strides);
  f.lse = device_view(DType::kFloat32, 24 * kL, {2, 3, 2, kL}, {12 * kL, 3 * kL, kL, 1});
  f.params.scale = 0.125;
  backend().attention_forward(AttentionKernel::kCudnn, f);
  AttentionBackwardArgs b = nn::backward_of(f);
  b.grad_out = f.q;
  b.grad_q = device_view(DType::kBFloat16, count, shape, strides);
  // dK and dV: one [3, 2, L, D] buffer for both entries of dim 0.
  b.grad_k = b.grad_v =
      device_view(DType::kBFloat16, 6 * kL * kD, shape, {0, 2 * kL * kD, kL * kD, kD, 1});
  b.overwrite_grads = true;
  try {
    backend().attention_backward(AttentionKernel::kCudnn, b);
    ADD_FAILURE() << "no error for a grad_k that repeats along dim 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'grad_k' overlaps itself"), std::string::npos)
        << e.what();
  }
  synchronize(Device::cuda(0));
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
  // All float32: a valid call (the out of a float32 q is float32) that cuDNN does not take.
  f.q = f.k = f.v = f.out = of(f32_, {1, 2, 16, 64});
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
  // Batch dims [2, 2, 2, 2] laid out in reverse order: no split folds into (B, H), nor does
  // one once the outermost is taken an entry at a time (three reversed dims).
  f = valid();
  f.q = f.k = f.v =
      of(big_, {2, 2, 2, 2, 4, 64}, {4 * 64, 2 * 4 * 64, 4 * 4 * 64, 8 * 4 * 64, 64, 1});
  f.out = of(big_, {2, 2, 2, 2, 4, 64});
  f.lse = of(lse_, {2, 2, 2, 2, 4});
  expect_refused(f, "cannot be folded");
  // Three reversed dims fold once the outermost is taken an entry at a time: supported.
  f.q = f.k = f.v = of(big_, {2, 2, 2, 8, 64}, {8 * 64, 2 * 8 * 64, 4 * 8 * 64, 64, 1});
  f.out = of(big_, {2, 2, 2, 8, 64});
  f.lse = of(lse_, {2, 2, 2, 8});
  std::string why;
  EXPECT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, f, nullptr, &why)) << why;
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

// ---------------------------------------------------------------------------------------
// A call over pieces (document masks) with grouped-query heads: q [B, N, hc * g, D] read as
// [B, hc, g, 1, D] views, k and v [B, N, hc, D] read g times through stride 0 (the views
// nn's piece groups pass), against a naive float64 attention of each piece on the host.
// Each shape is its own test so that a crash in one does not hide the others.

struct PieceShape {
  int64_t head_dim, group, kv_heads;
  bool causal;
  int64_t rate = 1;  // the step: pieces read every rate-th position from position rate - 1
  // The call's heads within larger tensors (0: the tensors hold the call's heads only): q
  // with q_total heads, the call's from q_first; k, v with kv_total, the call's from kv_first.
  int64_t q_total = 0, q_first = 0, kv_total = 0, kv_first = 0;
  // dK and dV into tensors of the call's key/value heads only, whose strides differ from k's
  // and v's: fine under grouped-query attention, refused with full heads (g = 1: cuDNN
  // wrote out of bounds).
  bool own_key_grads = false;
  // q, k and v (and their gradients) as views of one [B, N, H + 2 H_kv, D] tensor (packed
  // projections), out and grad_out tensors of their own: row strides differ.
  bool packed = false;
  // With packed: dQ of its own (contiguous, while q is a packed view) and dO a view of a wider
  // tensor (while out is contiguous): gradients laid out otherwise than q and out.
  bool own_q_grads = false;
};

std::string piece_shape_name(const ::testing::TestParamInfo<PieceShape>& info) {
  const PieceShape& s = info.param;
  return str_cat(
      "D", s.head_dim, "_g", s.group, "_kv", s.kv_heads, s.causal ? "_causal" : "",
      s.rate > 1 ? str_cat("_r", s.rate) : "",
      s.q_total > 0 ? str_cat("_q", s.q_first, "of", s.q_total, "_kv", s.kv_first, "of", s.kv_total)
                    : "",
      s.own_key_grads ? "_own_key_grads" : "", s.packed ? "_packed" : "",
      s.own_q_grads ? "_own_q_grads" : "");
}

// Host float64 copies of [B, N, H, D] (or [B, H, N]) tensors, indexed row-major.
struct HostTensor {
  std::vector<double> values;
  Shape shape;
  double& at(int64_t b, int64_t n, int64_t h, int64_t d) {
    return values[static_cast<size_t>(((b * shape[1] + n) * shape[2] + h) * shape[3] + d)];
  }
};

HostTensor host_of(const Tensor& t) {
  return {t.to(Device::cpu()).to(DType::kFloat64).contiguous().to_vector<double>(), t.shape()};
}

// A gradient's starting values for a reference to add to: as they are where the call must
// not write, 0 in the rows it overwrites (poisoned with NaN before the call).
HostTensor start_of(const Tensor& grad) {
  HostTensor start = host_of(grad);
  for (double& value : start.values) value = std::isnan(value) ? 0.0 : value;
  return start;
}

// Forward and backward of one piece (selected rows [first, first + rows) of batch row b,
// selected row u at position offset + rate * u), every
// query head h reading key/value head h / group, in float64: out, lse and the gradients
// (dK, dV summed over the query heads sharing a key/value head).
struct PieceReference {
  HostTensor q, k, v, grad_out;
  HostTensor out, lse, grad_q, grad_k, grad_v;  // lse as [B, H, N, 1]
  int64_t group = 1, rate = 1, offset = 0;
  int64_t q_first = 0, q_count = 0, kv_first = 0;  // the call's heads
  bool causal = false;

  void piece(int64_t b, int64_t first, int64_t rows) {
    const auto pos = [&](int64_t u) { return offset + rate * (first + u); };
    const int64_t dim = q.shape[3];
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    for (int64_t h = q_first; h < q_first + q_count; ++h) {
      const int64_t kv = kv_first + (h - q_first) / group;
      std::vector<double> p(static_cast<size_t>(rows * rows), 0.0);
      for (int64_t i = 0; i < rows; ++i) {
        double most = -INFINITY;
        for (int64_t j = 0; j < rows && (!causal || j <= i); ++j) {
          double dot = 0;
          for (int64_t d = 0; d < dim; ++d) dot += q.at(b, pos(i), h, d) * k.at(b, pos(j), kv, d);
          p[static_cast<size_t>(i * rows + j)] = scale * dot;
          most = std::max(most, scale * dot);
        }
        double total = 0;
        for (int64_t j = 0; j < rows && (!causal || j <= i); ++j) {
          double& e = p[static_cast<size_t>(i * rows + j)];
          e = std::exp(e - most);
          total += e;
        }
        for (int64_t j = 0; j < rows; ++j) {
          double& e = p[static_cast<size_t>(i * rows + j)];
          e = (!causal || j <= i) ? e / total : 0.0;
        }
        lse.at(b, h, pos(i), 0) = most + std::log(total);
        for (int64_t d = 0; d < dim; ++d) {
          double sum = 0;
          for (int64_t j = 0; j < rows; ++j)
            sum += p[static_cast<size_t>(i * rows + j)] * v.at(b, pos(j), kv, d);
          out.at(b, pos(i), h, d) = sum;
        }
      }
      // dP = dO V^T; dS = P (dP - rowsum(dO * O)); dQ = scale dS K; dK = scale dS^T Q; dV = P^T dO.
      for (int64_t i = 0; i < rows; ++i) {
        double delta = 0;
        for (int64_t d = 0; d < dim; ++d)
          delta += grad_out.at(b, pos(i), h, d) * out.at(b, pos(i), h, d);
        for (int64_t j = 0; j < rows; ++j) {
          const double pij = p[static_cast<size_t>(i * rows + j)];
          if (pij == 0) continue;
          double dp = 0;
          for (int64_t d = 0; d < dim; ++d)
            dp += grad_out.at(b, pos(i), h, d) * v.at(b, pos(j), kv, d);
          const double ds = pij * (dp - delta);
          for (int64_t d = 0; d < dim; ++d) {
            grad_q.at(b, pos(i), h, d) += scale * ds * k.at(b, pos(j), kv, d);
            grad_k.at(b, pos(j), kv, d) += scale * ds * q.at(b, pos(i), h, d);
            grad_v.at(b, pos(j), kv, d) += pij * grad_out.at(b, pos(i), h, d);
          }
        }
      }
    }
  }
};

// The sizes a case derives from its PieceShape: q [B, len, q_total, D], k and v
// [B, len, kv_total, D]; the call's heads are kv_heads groups of `group` query heads.
struct PieceDims {
  static constexpr int64_t kBatch = 2, kRows = 150;  // selected rows per batch row
  int64_t dim, kv_heads, group, heads, rate, offset, len, q_total, kv_total;

  explicit PieceDims(const PieceShape& s)
      : dim(s.head_dim),
        kv_heads(s.kv_heads),
        group(s.group),
        heads(s.kv_heads * s.group),
        rate(s.rate),
        offset(s.rate - 1),
        len(offset + rate * kRows),
        q_total(std::max(heads, s.q_total)),
        kv_total(std::max(kv_heads, s.kv_total)) {}
};

// One case's GPU tensors: random bf16 inputs (views of one packed tensor, or each its own),
// out and lse poisoned (7), gradients zero (views of grad_qkv where packed).
struct PieceTensors {
  Tensor qkv, q, k, v, grad_out, out, lse, grad_qkv, grad_q, grad_k, grad_v;
};

PieceTensors piece_tensors(const PieceShape& shape, const PieceDims& d, Generator& gen) {
  const TensorOptions on_gpu = TensorOptions(DType::kBFloat16).with_device(Device::cuda(0));
  auto draw = [&](const Shape& s) {
    return randn(s, gen, TensorOptions(DType::kFloat64)).to(DType::kBFloat16).to(Device::cuda(0));
  };
  const int64_t b = PieceDims::kBatch;
  PieceTensors t;
  t.qkv = draw({b, d.len, d.q_total + 2 * d.kv_total, d.dim});
  auto packed_or_own = [&](int64_t first, int64_t count) {
    return shape.packed ? t.qkv.narrow(2, first, count) : draw({b, d.len, count, d.dim});
  };
  t.q = packed_or_own(0, d.q_total);
  t.k = packed_or_own(d.q_total, d.kv_total);
  t.v = packed_or_own(d.q_total + d.kv_total, d.kv_total);
  t.grad_out = shape.own_q_grads ? draw({b, d.len, d.q_total + 1, d.dim}).narrow(2, 1, d.q_total)
                                 : draw({b, d.len, d.q_total, d.dim});
  // Poisoned outputs: every selected row belongs to a piece, so each must be written; the
  // rows between (rate > 1) must keep the poison.
  t.out = full({b, d.len, d.q_total, d.dim}, 7.0, on_gpu);
  t.lse =
      full({b, d.q_total, d.len}, 7.0, TensorOptions(DType::kFloat32).with_device(Device::cuda(0)));
  t.grad_qkv = zeros_like(t.qkv);
  t.grad_q = shape.packed && !shape.own_q_grads ? t.grad_qkv.narrow(2, 0, d.q_total)
                                                : zeros({b, d.len, d.q_total, d.dim}, on_gpu);
  t.grad_k = shape.packed ? t.grad_qkv.narrow(2, d.q_total, d.kv_total) : zeros_like(t.k);
  t.grad_v =
      shape.packed ? t.grad_qkv.narrow(2, d.q_total + d.kv_total, d.kv_total) : zeros_like(t.v);
  return t;
}

// Pieces of random lengths (1 to 70 rows) over each batch row, some a row apart (rows no
// piece reads: every buffer must keep its poison there).
kernels::AttentionPieces random_pieces(const PieceDims& d, uint64_t seed) {
  std::mt19937_64 lengths(seed);
  kernels::AttentionPieces pieces;
  for (int64_t b = 0; b < PieceDims::kBatch; ++b) {
    for (int64_t at = 0; at < PieceDims::kRows;) {
      const int64_t rows =
          std::min<int64_t>(PieceDims::kRows - at, 1 + static_cast<int64_t>(lengths() % 70));
      pieces.batch_row.push_back(b);
      pieces.q_position.push_back(d.offset + d.rate * at);
      pieces.k_position.push_back(d.offset + d.rate * at);
      pieces.q_rows.push_back(rows);
      pieces.k_rows.push_back(rows);
      at += rows + (lengths() % 4 == 0 ? 1 : 0);
    }
  }
  pieces.step = d.rate;
  return pieces;
}

// Fills a gradient buffer with 7, and the pieces' rows of heads [first_head, +count), which
// the call overwrites, with NaN: a kernel writing elsewhere (over another call's gradients)
// or leaving one of its rows unwritten shows.
void poison_piece_rows(Tensor t, const kernels::AttentionPieces& pieces, const PieceDims& d,
                       int64_t first_head, int64_t count) {
  t.fill_(7.0);
  const Shape& st = t.strides();
  for (int64_t p = 0; p < pieces.count(); ++p) {
    const auto i = static_cast<size_t>(p);
    t.as_strided({pieces.q_rows[i], count, d.dim}, {d.rate * st[1], st[2], 1},
                 t.offset() + pieces.batch_row[i] * st[0] + pieces.q_position[i] * st[1] +
                     first_head * st[2])
        .fill_(std::numeric_limits<double>::quiet_NaN());
  }
}

// The call's [B, hc, g, 1, D] views at position 0: the query side's heads from first_head;
// the key side's from first_head, each repeated g times through stride 0.
kernels::StridedView q_side(const Tensor& t, const PieceDims& d, int64_t first_head) {
  const Shape& st = t.strides();
  return make_view(kernel_view(t).data, t.dtype(),
                   {PieceDims::kBatch, d.kv_heads, d.group, 1, d.dim},
                   {st[0], d.group * st[2], st[2], d.rate * st[1], 1}, first_head * st[2]);
}
kernels::StridedView k_side(const Tensor& t, const PieceDims& d, int64_t first_head) {
  const Shape& st = t.strides();
  return make_view(kernel_view(t).data, t.dtype(),
                   {PieceDims::kBatch, d.kv_heads, d.group, 1, d.dim},
                   {st[0], st[2], 0, d.rate * st[1], 1}, first_head * st[2]);
}

// The float64 reference of every piece, starting from the gradients' values before the
// call (7, and 0 in the rows it overwrites) and poisoned out and lse.
PieceReference reference_of(const PieceShape& shape, const PieceDims& d, const PieceTensors& t,
                            const kernels::AttentionPieces& pieces, const HostTensor& start_q,
                            const HostTensor& start_k, const HostTensor& start_v) {
  PieceReference ref;
  ref.q = host_of(t.q);
  ref.k = host_of(t.k);
  ref.v = host_of(t.v);
  ref.grad_out = host_of(t.grad_out);
  ref.out = HostTensor{std::vector<double>(ref.q.values.size(), 7.0), t.q.shape()};
  ref.grad_q = start_q;
  ref.grad_k = start_k;
  ref.grad_v = start_v;
  ref.lse = HostTensor{
      std::vector<double>(static_cast<size_t>(PieceDims::kBatch * d.q_total * d.len), 7.0),
      {PieceDims::kBatch, d.q_total, d.len, 1}};
  ref.group = d.group;
  ref.q_first = shape.q_first;
  ref.q_count = d.heads;
  ref.kv_first = shape.kv_first;
  ref.rate = d.rate;
  ref.offset = d.offset;
  ref.causal = shape.causal;
  for (int64_t p = 0; p < pieces.count(); ++p) {
    const auto i = static_cast<size_t>(p);
    ref.piece(pieces.batch_row[i], (pieces.q_position[i] - d.offset) / d.rate, pieces.q_rows[i]);
  }
  return ref;
}

// Every element of `got` within tol * (1 + |want|) of `want`; the first miss named.
void expect_all_near(const char* name, const Tensor& got, const HostTensor& want, double tol) {
  const std::vector<double> values = host_of(got).values;
  int64_t off = 0;
  size_t first = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!(std::abs(values[i] - want.values[i]) <= tol * (1 + std::abs(want.values[i])))) {
      if (off++ == 0) first = i;
    }
  }
  EXPECT_EQ(off, 0) << name << ": " << off << " of " << values.size() << " off; first at " << first
                    << ": got " << values[first] << ", want " << want.values[first];
}

class CudnnGroupedPieces : public CudnnAttentionTest,
                           public ::testing::WithParamInterface<PieceShape> {};

TEST_P(CudnnGroupedPieces, MatchFloat64PerPiece) {
  const PieceShape shape = GetParam();
  const PieceDims d(shape);
  const int64_t dim = d.dim, hc = d.kv_heads, g = d.group;
  Generator gen(static_cast<uint64_t>(dim * 100 + g * 10 + hc));
  const PieceTensors t = piece_tensors(shape, d, gen);
  kernels::AttentionPieces pieces = random_pieces(d, static_cast<uint64_t>(dim + g + hc));
  poison_piece_rows(t.grad_q, pieces, d, shape.q_first, d.heads);
  poison_piece_rows(t.grad_k, pieces, d, shape.kv_first, hc);
  poison_piece_rows(t.grad_v, pieces, d, shape.kv_first, hc);

  AttentionForwardArgs fwd;
  fwd.q = q_side(t.q, d, shape.q_first);
  fwd.k = k_side(t.k, d, shape.kv_first);
  fwd.v = k_side(t.v, d, shape.kv_first);
  fwd.out = q_side(t.out, d, shape.q_first);
  fwd.lse = make_view(kernel_view(t.lse).data, DType::kFloat32, {PieceDims::kBatch, hc, g, 1},
                      {d.q_total * d.len, g * d.len, d.len, d.rate}, shape.q_first * d.len);
  fwd.params.scale = 1.0 / std::sqrt(static_cast<double>(dim));
  fwd.params.causal = shape.causal;
  fwd.pieces = &pieces;
  std::string why;
  ASSERT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, fwd, nullptr, &why)) << why;
  backend().attention_forward(AttentionKernel::kCudnn, fwd);
  AttentionBackwardArgs bwd = nn::backward_of(fwd);  // q, k, v, out, lse, params, pieces
  bwd.grad_out = q_side(t.grad_out, d, shape.q_first);
  bwd.grad_q = q_side(t.grad_q, d, shape.q_first);
  // Own key gradients: [B, N, hc, D] tensors.
  const Tensor own_k = empty({PieceDims::kBatch, d.len, hc, dim},
                             TensorOptions(DType::kBFloat16).with_device(Device::cuda(0)));
  const Tensor own_v = empty_like(own_k);
  poison_piece_rows(own_k, pieces, d, 0, hc);
  poison_piece_rows(own_v, pieces, d, 0, hc);
  bwd.grad_k = shape.own_key_grads ? k_side(own_k, d, 0) : k_side(t.grad_k, d, shape.kv_first);
  bwd.grad_v = shape.own_key_grads ? k_side(own_v, d, 0) : k_side(t.grad_v, d, shape.kv_first);
  bwd.overwrite_grads = true;
  if (shape.own_key_grads && g == 1) {
    EXPECT_FALSE(backend().attention_supports(AttentionKernel::kCudnn, fwd, &bwd, &why));
    EXPECT_NE(why.find("grad_k is laid out otherwise"), std::string::npos) << why;
    return;
  }
  ASSERT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, fwd, &bwd, &why)) << why;
  const HostTensor start_q = start_of(t.grad_q), start_k = start_of(t.grad_k),
                   start_v = start_of(t.grad_v);
  backend().attention_backward(AttentionKernel::kCudnn, bwd);
  if (shape.own_key_grads) {
    t.grad_k.narrow(2, shape.kv_first, hc).copy_(own_k);
    t.grad_v.narrow(2, shape.kv_first, hc).copy_(own_v);
  }
  synchronize(Device::cuda(0));

  const PieceReference ref = reference_of(shape, d, t, pieces, start_q, start_k, start_v);
  const double unit = std::ldexp(1.0, -8);  // bfloat16's rounding
  expect_all_near("out", t.out, ref.out, 8 * unit);
  expect_all_near("lse", t.lse, ref.lse, 8 * unit);
  expect_all_near("grad_q", t.grad_q, ref.grad_q, 16 * unit);
  expect_all_near("grad_k", t.grad_k, ref.grad_k, 16 * unit * static_cast<double>(g));
  expect_all_near("grad_v", t.grad_v, ref.grad_v, 16 * unit * static_cast<double>(g));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudnnGroupedPieces,
    ::testing::Values(
        PieceShape{8, 3, 1, false}, PieceShape{16, 3, 1, false}, PieceShape{64, 3, 1, false},
        PieceShape{128, 3, 1, false}, PieceShape{8, 2, 2, false}, PieceShape{64, 2, 2, true},
        PieceShape{64, 4, 2, false}, PieceShape{128, 4, 1, true}, PieceShape{64, 1, 2, false},
        PieceShape{128, 5, 1, false}, PieceShape{8, 3, 1, true}, PieceShape{8, 1, 1, true},
        PieceShape{8, 3, 1, true, 2}, PieceShape{8, 1, 1, true, 2}, PieceShape{8, 2, 1, true, 4},
        PieceShape{64, 3, 1, true, 2}, PieceShape{64, 4, 2, false, 4},
        // The blocks of 12 query heads over 3 key/value
        // heads in head groups of 3 (nn's calls).
        PieceShape{8, 3, 1, true, 1, 12, 0, 3, 0}, PieceShape{8, 1, 1, true, 2, 12, 3, 3, 0},
        PieceShape{8, 2, 1, true, 2, 12, 4, 3, 1}, PieceShape{8, 2, 1, true, 4, 12, 6, 3, 1},
        PieceShape{8, 1, 1, true, 4, 12, 8, 3, 2}, PieceShape{8, 3, 1, true, 2, 12, 9, 3, 2},
        PieceShape{128, 2, 1, false, 2, 16, 6, 4, 1},
        PieceShape{8, 1, 1, true, 2, 12, 3, 3, 0, true},
        PieceShape{128, 2, 1, true, 2, 16, 6, 4, 1, true},
        PieceShape{8, 3, 1, true, 2, 12, 9, 3, 2, true},
        PieceShape{64, 1, 2, true, 1, 0, 0, 0, 0, false, true},
        PieceShape{64, 2, 2, false, 2, 0, 0, 0, 0, false, true},
        PieceShape{64, 1, 1, true, 2, 4, 1, 4, 1, false, true},
        PieceShape{64, 1, 2, true, 1, 0, 0, 0, 0, false, true, true},
        PieceShape{64, 2, 2, false, 2, 0, 0, 0, 0, false, true, true},
        PieceShape{8, 1, 1, true, 2, 12, 3, 3, 0, false, true, true}),
    piece_shape_name);

// ---------------------------------------------------------------------------------------
// Pieces at heads of their own (AttentionPieces::q_head): the head sets of one dilation pair
// (each its own offset, hence its own rows) as one call, against float64 per piece and head.
// Full heads; every piece's heads are `count` heads `step` apart from its set's first.

struct HeadSetShape {
  int64_t heads, rate, count, step;  // sets: heads / count of them, first heads 0 .. sets - 1
  bool causal;
};

std::string head_set_name(const ::testing::TestParamInfo<HeadSetShape>& info) {
  const HeadSetShape& s = info.param;
  return str_cat("H", s.heads, "_r", s.rate, "_sets_of", s.count, "_step", s.step,
                 s.causal ? "_causal" : "");
}

class CudnnHeadSetPieces : public CudnnAttentionTest,
                           public ::testing::WithParamInterface<HeadSetShape> {};

TEST_P(CudnnHeadSetPieces, MatchFloat64PerPieceAndHead) {
  const HeadSetShape shape = GetParam();
  constexpr int64_t kBatch = 2, kRows = 120, kDim = 64;
  const int64_t sets = shape.heads / shape.count, len = shape.rate * kRows;
  ASSERT_EQ(sets * shape.count, shape.heads);
  const TensorOptions on_gpu = TensorOptions(DType::kBFloat16).with_device(Device::cuda(0));
  Generator gen(static_cast<uint64_t>(shape.heads * 10 + shape.rate));
  auto draw = [&](const Shape& dims) {
    return randn(dims, gen, TensorOptions(DType::kFloat64))
        .to(DType::kBFloat16)
        .to(Device::cuda(0));
  };
  const Shape bnhd{kBatch, len, shape.heads, kDim};
  const Tensor q = draw(bnhd), k = draw(bnhd), v = draw(bnhd), grad_out = draw(bnhd);
  const Tensor out = full(bnhd, 7.0, on_gpu);
  const Tensor lse = full({kBatch, shape.heads, len}, 7.0,
                          TensorOptions(DType::kFloat32).with_device(Device::cuda(0)));
  const Tensor grad_q = full(bnhd, 7.0, on_gpu), grad_k = full(bnhd, 7.0, on_gpu),
               grad_v = full(bnhd, 7.0, on_gpu);

  // Set s reads the rows of offset s mod rate; its pieces are runs of random lengths.
  std::mt19937_64 lengths(static_cast<uint64_t>(shape.heads + shape.rate));
  kernels::AttentionPieces pieces;
  pieces.step = shape.rate;
  pieces.q_head_step = pieces.k_head_step = shape.step;
  auto offset_of = [&](int64_t set) { return set % shape.rate; };
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t set = 0; set < sets; ++set) {
      for (int64_t at = 0; at < kRows;) {
        const int64_t rows =
            std::min<int64_t>(kRows - at, 1 + static_cast<int64_t>(lengths() % 50));
        pieces.batch_row.push_back(b);
        pieces.q_position.push_back(offset_of(set) + shape.rate * at);
        pieces.k_position.push_back(offset_of(set) + shape.rate * at);
        pieces.q_rows.push_back(rows);
        pieces.k_rows.push_back(rows);
        pieces.q_head.push_back(set);
        pieces.k_head.push_back(set);
        at += rows + (lengths() % 4 == 0 ? 1 : 0);
      }
    }
  }
  // The heads of piece p: its set's first head + step * j, j < count.
  auto piece_heads = [&](size_t p) {
    std::vector<int64_t> heads;
    for (int64_t j = 0; j < shape.count; ++j) heads.push_back(pieces.q_head[p] + shape.step * j);
    return heads;
  };
  // The rows the call overwrites: NaN, so that a row left unwritten shows.
  for (size_t p = 0; p < pieces.batch_row.size(); ++p) {
    for (int64_t h : piece_heads(p)) {
      for (const Tensor& grad : {grad_q, grad_k, grad_v}) {
        const Shape& st = grad.strides();
        Tensor(grad)
            .as_strided({pieces.q_rows[p], kDim}, {shape.rate * st[1], 1},
                        pieces.batch_row[p] * st[0] + pieces.q_position[p] * st[1] + h * st[2])
            .fill_(std::numeric_limits<double>::quiet_NaN());
      }
    }
  }
  // [B, count, 1, D] views from head 0 (lse [B, count, 1]).
  auto view = [&](const Tensor& t) {
    const Shape& st = t.strides();
    return make_view(kernel_view(t).data, t.dtype(), {kBatch, shape.count, 1, kDim},
                     {st[0], shape.step * st[2], shape.rate * st[1], 1}, 0);
  };
  AttentionForwardArgs fwd;
  fwd.q = view(q);
  fwd.k = view(k);
  fwd.v = view(v);
  fwd.out = view(out);
  fwd.lse = make_view(kernel_view(lse).data, DType::kFloat32, {kBatch, shape.count, 1},
                      {shape.heads * len, shape.step * len, shape.rate}, 0);
  fwd.params.scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  fwd.params.causal = shape.causal;
  fwd.pieces = &pieces;
  std::string why;
  ASSERT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, fwd, nullptr, &why)) << why;
  backend().attention_forward(AttentionKernel::kCudnn, fwd);
  AttentionBackwardArgs bwd = nn::backward_of(fwd);
  bwd.grad_out = view(grad_out);
  bwd.grad_q = view(grad_q);
  bwd.grad_k = view(grad_k);
  bwd.grad_v = view(grad_v);
  bwd.overwrite_grads = true;
  ASSERT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, fwd, &bwd, &why)) << why;
  PieceReference ref;
  ref.grad_q = start_of(grad_q);
  ref.grad_k = start_of(grad_k);
  ref.grad_v = start_of(grad_v);
  backend().attention_backward(AttentionKernel::kCudnn, bwd);
  synchronize(Device::cuda(0));

  ref.q = host_of(q);
  ref.k = host_of(k);
  ref.v = host_of(v);
  ref.grad_out = host_of(grad_out);
  ref.out = HostTensor{std::vector<double>(ref.q.values.size(), 7.0), bnhd};
  ref.lse = HostTensor{std::vector<double>(static_cast<size_t>(kBatch * shape.heads * len), 7.0),
                       {kBatch, shape.heads, len, 1}};
  ref.rate = shape.rate;
  ref.causal = shape.causal;
  ref.q_count = 1;
  for (size_t p = 0; p < pieces.batch_row.size(); ++p) {
    ref.offset = offset_of(pieces.q_head[p]);
    for (int64_t h : piece_heads(p)) {
      ref.q_first = ref.kv_first = h;
      ref.piece(pieces.batch_row[p], (pieces.q_position[p] - ref.offset) / shape.rate,
                pieces.q_rows[p]);
    }
  }
  const double unit = std::ldexp(1.0, -8);  // bfloat16's rounding
  expect_all_near("out", out, ref.out, 8 * unit);
  expect_all_near("lse", lse, ref.lse, 8 * unit);
  expect_all_near("grad_q", grad_q, ref.grad_q, 16 * unit);
  expect_all_near("grad_k", grad_k, ref.grad_k, 16 * unit);
  expect_all_near("grad_v", grad_v, ref.grad_v, 16 * unit);
}

// All heads at rate 4 over 4 heads (one head per set), rate 2 over 4 heads (sets {0, 2} and
// {1, 3}), and 8 heads at rate 4 in sets of 2 heads 4 apart.
INSTANTIATE_TEST_SUITE_P(Shapes, CudnnHeadSetPieces,
                         ::testing::Values(HeadSetShape{4, 4, 1, 1, false},
                                           HeadSetShape{4, 4, 1, 1, true},
                                           HeadSetShape{4, 2, 2, 2, false},
                                           HeadSetShape{4, 2, 2, 2, true},
                                           HeadSetShape{8, 4, 2, 4, false}),
                         head_set_name);

// Head tables of the wrong size, or head steps that do not divide the head strides, are
// refused with the reason.
TEST_F(CudnnAttentionTest, PiecesWithBadHeadTablesAreRefused) {
  AttentionForwardArgs fwd;
  fwd.q = device_view(DType::kBFloat16, 2 * 16 * 4 * 64, {1, 2, 1, 64},
                      {16 * 4 * 64, 2 * 64, 4 * 64, 1});
  fwd.k = fwd.q;
  fwd.v = fwd.q;
  fwd.out = device_view(DType::kBFloat16, 2 * 16 * 4 * 64, {1, 2, 1, 64},
                        {16 * 4 * 64, 2 * 64, 4 * 64, 1});
  fwd.lse = device_view(DType::kFloat32, 4 * 16, {1, 2, 1}, {4 * 16, 2 * 16, 1});
  fwd.params.scale = 0.125;
  kernels::AttentionPieces pieces;
  pieces.batch_row = {0, 0};
  pieces.q_position = pieces.k_position = {0, 0};
  pieces.q_rows = pieces.k_rows = {8, 8};
  pieces.q_head = {0, 1};
  pieces.k_head = {0};
  pieces.q_head_step = pieces.k_head_step = 2;
  fwd.pieces = &pieces;
  std::string why;
  EXPECT_FALSE(backend().attention_supports(AttentionKernel::kCudnn, fwd, nullptr, &why));
  EXPECT_NE(why.find("head tables of 2 and 1 entries"), std::string::npos) << why;
  pieces.k_head = {0, 1};
  EXPECT_TRUE(backend().attention_supports(AttentionKernel::kCudnn, fwd, nullptr, &why)) << why;
  pieces.q_head_step = pieces.k_head_step = 3;  // 128-element head strides
  EXPECT_FALSE(backend().attention_supports(AttentionKernel::kCudnn, fwd, nullptr, &why));
  EXPECT_NE(why.find("head steps 3 and 3"), std::string::npos) << why;
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::test
