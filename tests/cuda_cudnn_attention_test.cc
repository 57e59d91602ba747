// GPU tests of the cuDNN attention path (kernels/cuda/cudnn_attention.h) against a float64
// reference written here from kernels/attention.h: forward out and lse, backward gradients
// (accumulated into what the gradient buffers held), strided dilated views read and written
// in place, the graph cache, concurrent callers, and the reasons given for refusals.
// Outputs are poisoned with NaN before each run, and the scratch allocator fills every block
// with NaN bytes, so an element written wrongly or not at all shows. Skipped without a GPU or
// without cuDNN.
//
// Tolerances. cuDNN reads bf16/fp16 inputs, accumulates in float32, and rounds the softmax
// probabilities (and, in the backward, dS) to the input dtype before the second matmul. So an
// output or gradient element may be off by a few units of the input dtype's rounding (eps)
// times its error scale, the sum of the magnitudes of the terms it adds up, plus 2 eps of its
// own value for the final rounding. The lse is float32 arithmetic on exact products:
// 2^-14 relative is loose for it, yet far below any wrong scale or log base.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/cudnn_attention.h"
#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace rd::kernels {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudnnAttentionTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

namespace gpu = ::rd::kernels::cuda;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// Unit roundoff of a dtype's storage.
double storage_eps(DType t) {
  switch (t) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

// ---------------------------------------------------------------------------------------
// Buffers and views.

// Device memory of `count` elements with a host mirror in doubles (the stored values).
class Buffer {
 public:
  Buffer(DType dtype, int64_t count) : dtype_(dtype), host_(count) {
    check_cuda(cudaMalloc(&device_, std::max<size_t>(1, bytes())), "cudaMalloc");
  }
  ~Buffer() { cudaFree(device_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  DType dtype() const { return dtype_; }
  void* data() const { return device_; }
  const std::vector<double>& host() const { return host_; }

  // Uniform values in [lo, hi), rounded to the dtype, on both sides.
  void fill_random(std::mt19937& rng, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (double& x : host_) x = round_to_dtype(dist(rng));
    upload();
  }
  // The given values (already representable in the dtype), on both sides.
  void set(const std::vector<double>& values) {
    for (size_t i = 0; i < host_.size(); ++i) host_[i] = round_to_dtype(values[i]);
    upload();
  }
  // NaN in every element (all-ones bytes are a NaN in every float dtype).
  void poison() {
    std::fill(host_.begin(), host_.end(), std::numeric_limits<double>::quiet_NaN());
    check_cuda(cudaMemset(device_, 0xff, bytes()), "cudaMemset");
  }
  std::vector<double> download() const {
    std::vector<unsigned char> raw(bytes());
    check_cuda(cudaMemcpy(raw.data(), device_, bytes(), cudaMemcpyDeviceToHost), "download");
    std::vector<double> values(host_.size());
    for (size_t i = 0; i < values.size(); ++i) values[i] = load(raw.data() + i * elem());
    return values;
  }

 private:
  size_t elem() const { return dtype_size(dtype_); }
  size_t bytes() const { return host_.size() * elem(); }
  double round_to_dtype(double x) const {
    switch (dtype_) {
      case DType::kBFloat16: return static_cast<float>(BFloat16(static_cast<float>(x)));
      case DType::kFloat16: return static_cast<float>(Float16(static_cast<float>(x)));
      default: return static_cast<float>(x);
    }
  }
  double load(const unsigned char* p) const {
    switch (dtype_) {
      case DType::kBFloat16: {
        BFloat16 v;
        std::memcpy(&v, p, sizeof(v));
        return static_cast<float>(v);
      }
      case DType::kFloat16: {
        Float16 v;
        std::memcpy(&v, p, sizeof(v));
        return static_cast<float>(v);
      }
      default: {
        float v;
        std::memcpy(&v, p, sizeof(v));
        return v;
      }
    }
  }
  void upload() {
    std::vector<unsigned char> raw(bytes());
    for (size_t i = 0; i < host_.size(); ++i) {
      unsigned char* p = raw.data() + i * elem();
      const float f = static_cast<float>(host_[i]);
      if (dtype_ == DType::kBFloat16) {
        const BFloat16 v(f);
        std::memcpy(p, &v, sizeof(v));
      } else if (dtype_ == DType::kFloat16) {
        const Float16 v(f);
        std::memcpy(p, &v, sizeof(v));
      } else {
        std::memcpy(p, &f, sizeof(f));
      }
    }
    check_cuda(cudaMemcpy(device_, raw.data(), bytes(), cudaMemcpyHostToDevice), "upload");
  }

  DType dtype_;
  std::vector<double> host_;
  void* device_ = nullptr;
};

// Where a view's elements sit in its buffer: [batch..., L, D] (or [batch..., L] for an lse),
// element strides and the element offset of [0, ..., 0].
struct Layout {
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  bool has_head_dim = true;

  int batch_dims() const { return static_cast<int>(shape.size()) - (has_head_dim ? 2 : 1); }
  int64_t batch_count() const {
    int64_t n = 1;
    for (int d = 0; d < batch_dims(); ++d) n *= shape[d];
    return n;
  }
  int64_t len() const { return shape[batch_dims()]; }
  int64_t head() const { return has_head_dim ? shape.back() : 1; }
  // Buffer index of element [b (flattened, row-major), i, d].
  int64_t at(int64_t b, int64_t i, int64_t d = 0) const {
    int64_t index = offset;
    for (int dim = batch_dims() - 1; dim >= 0; --dim) {
      index += (b % shape[dim]) * strides[dim];
      b /= shape[dim];
    }
    index += i * strides[batch_dims()];
    if (has_head_dim) index += d * strides.back();
    return index;
  }
  // One past the largest buffer index the view reaches (all strides >= 0 here).
  int64_t extent() const {
    int64_t last = offset;
    for (size_t d = 0; d < shape.size(); ++d) last += (shape[d] - 1) * strides[d];
    return last + 1;
  }
};

Layout packed(std::vector<int64_t> shape, bool has_head_dim = true) {
  Layout l{shape, std::vector<int64_t>(shape.size()), 0, has_head_dim};
  int64_t stride = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    l.strides[d] = stride;
    stride *= shape[d];
  }
  return l;
}

// [B, H, L, D] over a packed [B, L, H, D] buffer (the "BSHD" layout).
Layout heads_inside(int64_t batch, int64_t heads, int64_t len, int64_t head_dim) {
  return Layout{{batch, heads, len, head_dim},
                {len * heads * head_dim, head_dim, heads * head_dim, 1},
                0,
                true};
}

// The dilated selection of docs/dilated-attention.md over a packed [B, N, H, D] buffer:
// segments of w positions, every r-th from offset o, heads h0 .. h0 + hg - 1, viewed as
// [B, N / w, hg, w / r, D] with sequence stride r * H * D.
struct Dilation {
  int64_t batch, seq, heads, head_dim, w, r, o, h0, hg;
};
Layout dilated(const Dilation& x) {
  const int64_t hd = x.heads * x.head_dim;
  return Layout{{x.batch, x.seq / x.w, x.hg, x.w / x.r, x.head_dim},
                {x.seq * hd, x.w * hd, x.head_dim, x.r * hd, 1},
                x.o * hd + x.h0 * x.head_dim,
                true};
}
// The matching lse selection over a packed [B, H, N] float32 buffer.
Layout dilated_lse(const Dilation& x) {
  return Layout{{x.batch, x.seq / x.w, x.hg, x.w / x.r},
                {x.heads * x.seq, x.w, x.seq, x.r},
                x.h0 * x.seq + x.o,
                false};
}

StridedView view_of(const Buffer& buffer, const Layout& layout) {
  StridedView v;
  v.dtype = buffer.dtype();
  v.ndim = static_cast<int>(layout.shape.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = layout.shape[d];
    v.strides[d] = layout.strides[d];
  }
  v.data = static_cast<char*>(buffer.data()) + layout.offset * dtype_size(buffer.dtype());
  return v;
}

// ---------------------------------------------------------------------------------------
// The float64 reference, element by element from kernels/attention.h.

struct Operands {
  const std::vector<double>&q, &k, &v;
  const Layout &q_layout, &kv_layout;
  double scale;
  bool causal;
  int64_t causal_offset;

  bool visible(int64_t i, int64_t j) const { return !causal || j <= i + causal_offset; }
  double score(int64_t b, int64_t i, int64_t j) const {
    double s = 0;
    for (int64_t d = 0; d < q_layout.head(); ++d) {
      s += q[q_layout.at(b, i, d)] * k[kv_layout.at(b, j, d)];
    }
    return scale * s;
  }
};

// Per logical element [b, i, d] (row-major over batch, L, D): value and error scale.
struct Expected {
  std::vector<double> value, scale;
};

struct ForwardReference {
  Expected out;             // scale: sum_j p |v|
  std::vector<double> lse;  // [b, i]
};

ForwardReference reference_forward(const Operands& x) {
  const int64_t batches = x.q_layout.batch_count(), lq = x.q_layout.len(),
                lk = x.kv_layout.len(), dim = x.q_layout.head();
  ForwardReference r;
  r.out.value.assign(batches * lq * dim, 0.0);
  r.out.scale.assign(batches * lq * dim, 0.0);
  r.lse.assign(batches * lq, -std::numeric_limits<double>::infinity());
  std::vector<double> s(lk);
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < lk; ++j) {
        if (x.visible(i, j)) max = std::max(max, s[j] = x.score(b, i, j));
      }
      double sum = 0;
      for (int64_t j = 0; j < lk; ++j) {
        if (x.visible(i, j)) sum += std::exp(s[j] - max);
      }
      const double lse = max + std::log(sum);
      r.lse[b * lq + i] = lse;
      for (int64_t j = 0; j < lk; ++j) {
        if (!x.visible(i, j)) continue;
        const double p = std::exp(s[j] - lse);
        for (int64_t d = 0; d < dim; ++d) {
          const double vj = x.v[x.kv_layout.at(b, j, d)];
          r.out.value[(b * lq + i) * dim + d] += p * vj;
          r.out.scale[(b * lq + i) * dim + d] += p * std::abs(vj);
        }
      }
    }
  }
  return r;
}

struct BackwardReference {
  Expected grad_q, grad_k, grad_v;
};

// The gradients for the given forward out and lse (what the kernel is handed), per the
// contract: p = exp(s - lse), dS = p (dO . v_j - dO . out_i), dq = scale dS k, dk = scale
// dS^T q, dv = p^T dO.
BackwardReference reference_backward(const Operands& x, const std::vector<double>& grad_out,
                                     const std::vector<double>& out_used,
                                     const std::vector<double>& lse_used) {
  const int64_t batches = x.q_layout.batch_count(), lq = x.q_layout.len(),
                lk = x.kv_layout.len(), dim = x.q_layout.head();
  BackwardReference r;
  for (Expected* e : {&r.grad_q}) {
    e->value.assign(batches * lq * dim, 0.0);
    e->scale.assign(batches * lq * dim, 0.0);
  }
  for (Expected* e : {&r.grad_k, &r.grad_v}) {
    e->value.assign(batches * lk * dim, 0.0);
    e->scale.assign(batches * lk * dim, 0.0);
  }
  auto go = [&](int64_t b, int64_t i, int64_t d) { return grad_out[x.q_layout.at(b, i, d)]; };
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      double delta = 0, delta_abs = 0;
      for (int64_t d = 0; d < dim; ++d) {
        delta += go(b, i, d) * out_used[(b * lq + i) * dim + d];
        delta_abs += std::abs(go(b, i, d) * out_used[(b * lq + i) * dim + d]);
      }
      for (int64_t j = 0; j < lk; ++j) {
        if (!x.visible(i, j)) continue;
        const double p = std::exp(x.score(b, i, j) - lse_used[b * lq + i]);
        double dp = 0, dp_abs = 0;
        for (int64_t d = 0; d < dim; ++d) {
          dp += go(b, i, d) * x.v[x.kv_layout.at(b, j, d)];
          dp_abs += std::abs(go(b, i, d) * x.v[x.kv_layout.at(b, j, d)]);
        }
        const double ds = p * (dp - delta), ds_scale = p * (dp_abs + delta_abs);
        for (int64_t d = 0; d < dim; ++d) {
          const double qi = x.q[x.q_layout.at(b, i, d)], kj = x.k[x.kv_layout.at(b, j, d)];
          const int64_t qi_index = (b * lq + i) * dim + d, kj_index = (b * lk + j) * dim + d;
          r.grad_q.value[qi_index] += x.scale * ds * kj;
          r.grad_q.scale[qi_index] += x.scale * ds_scale * std::abs(kj);
          r.grad_k.value[kj_index] += x.scale * ds * qi;
          r.grad_k.scale[kj_index] += x.scale * ds_scale * std::abs(qi);
          r.grad_v.value[kj_index] += p * go(b, i, d);
          r.grad_v.scale[kj_index] += p * std::abs(go(b, i, d));
        }
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------
// Checks of a whole buffer: the view's elements against expectations, every other element
// against what the buffer held before (bit for bit, NaN for poisoned outputs).

struct Mismatches {
  int count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ == 0) first = what;
  }
};

bool same_or_both_nan(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

// got[view element] ~ before + times * expected (tolerance: eps-derived, see the file
// comment; `times` runs of the same call accumulate); elements outside the view unchanged.
Mismatches check_buffer(const std::vector<double>& got, const std::vector<double>& before,
                        const Layout& layout, const Expected& expected, double eps,
                        double times = 1, bool accumulated = false) {
  std::vector<bool> in_view(got.size(), false);
  Mismatches m;
  const int64_t batches = layout.batch_count(), len = layout.len(), dim = layout.head();
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t index = layout.at(b, i, d);
        const int64_t logical = (b * len + i) * dim + d;
        in_view[index] = true;
        const double base = accumulated ? before[index] : 0.0;
        const double want = base + times * expected.value[logical];
        const double tol = 2 * eps * (std::abs(base) + times * std::abs(expected.value[logical])) +
                           8 * eps * times * expected.scale[logical] + 1e-30;
        if (!(std::abs(got[index] - want) <= tol)) {
          m.add("element [" + std::to_string(b) + ", " + std::to_string(i) + ", " +
                std::to_string(d) + "]: got " + std::to_string(got[index]) + ", want " +
                std::to_string(want) + " (tolerance " + std::to_string(tol) + ")");
        }
      }
    }
  }
  for (size_t index = 0; index < got.size(); ++index) {
    if (!in_view[index] && !same_or_both_nan(got[index], before[index])) {
      m.add("buffer element " + std::to_string(index) + " outside the view changed to " +
            std::to_string(got[index]));
    }
  }
  return m;
}

// The logical [b, i, d] values of a view, in row-major order.
std::vector<double> gather(const std::vector<double>& buffer, const Layout& layout) {
  std::vector<double> values;
  for (int64_t b = 0; b < layout.batch_count(); ++b) {
    for (int64_t i = 0; i < layout.len(); ++i) {
      for (int64_t d = 0; d < layout.head(); ++d) values.push_back(buffer[layout.at(b, i, d)]);
    }
  }
  return values;
}

// ---------------------------------------------------------------------------------------
// Fixture and cases.

gpu::CudaCachingAllocator& scratch_pool() {
  // Leaked: kernels of a failed test may still run when the process exits.
  static gpu::CudaCachingAllocator* const pool = [] {
    auto* p = new gpu::CudaCachingAllocator(0);
    p->set_fill_on_allocate(0xff);  // NaN bytes: scratch read before written shows
    return p;
  }();
  return *pool;
}

class CudnnAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    if (!gpu::cudnn_attention_available()) {
      GTEST_SKIP() << "cuDNN attention unavailable (cuDNN runtime version "
                   << gpu::cudnn_runtime_version() << ")";
    }
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    guard_.emplace(0, stream_);
  }
  void TearDown() override {
    guard_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void sync() {
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    check_cuda(cudaGetLastError(), "cudaGetLastError");
  }

  cudaStream_t stream_ = nullptr;
  std::optional<gpu::StreamGuard> guard_;
};

struct Case {
  std::string name;
  DType dtype;
  Layout q_layout, kv_layout, lse_layout;  // out, grad_out, grad_q share q's layout
  bool causal = false;
  int64_t causal_offset = 0;
  double scale = 0;                        // 0: 1 / sqrt(D)
  DType grad_dtype = DType::kFloat32;      // kFloat32 or the case's dtype
  bool float32_out_in_backward = false;    // hand the backward a float32 copy of out
  // Gradients start at zero and the backward is told so (grads_start_at_zero): cuDNN may
  // write them in place. Then the backward runs once, since a second run would overwrite.
  bool grads_start_at_zero = false;
};

// Runs one case: forward (checked), backward twice (checked after each: gradients add up).
void run_case(const Case& c, cudaStream_t stream, uint32_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(seed);
  const int64_t q_size = c.q_layout.extent(), kv_size = c.kv_layout.extent();
  Buffer q(c.dtype, q_size), k(c.dtype, kv_size), v(c.dtype, kv_size);
  q.fill_random(rng, -2, 2);
  k.fill_random(rng, -1, 1);
  v.fill_random(rng, -1, 1);
  Buffer out(c.dtype, q_size), lse(DType::kFloat32, c.lse_layout.extent());
  out.poison();
  lse.poison();

  AttentionForwardArgs f;
  f.q = view_of(q, c.q_layout);
  f.k = view_of(k, c.kv_layout);
  f.v = view_of(v, c.kv_layout);
  f.out = view_of(out, c.q_layout);
  f.lse = view_of(lse, c.lse_layout);
  const double scale = c.scale != 0 ? c.scale : 1 / std::sqrt(double(c.q_layout.head()));
  f.params.scale = scale;
  f.params.causal = c.causal;
  f.params.causal_offset = c.causal_offset;
  std::string why;
  ASSERT_TRUE(gpu::cudnn_attention_supports(f, &why)) << why;
  gpu::cudnn_attention_forward(f, scratch_pool(), stream);
  check_cuda(cudaStreamSynchronize(stream), "forward");

  const Operands x{q.host(), k.host(), v.host(), c.q_layout, c.kv_layout,
                   scale,    c.causal, c.causal_offset};
  const ForwardReference ref = reference_forward(x);
  const double eps = storage_eps(c.dtype);
  const std::vector<double> out_got = out.download(), lse_got = lse.download();
  Mismatches m = check_buffer(out_got, out.host(), c.q_layout, ref.out, eps);
  EXPECT_EQ(m.count, 0) << "out: " << m.first;
  // lse tolerance 2^-14 (1 + |lse|): check_buffer's 2 eps |want| + 8 eps scale with
  // eps = 2^-15 and an error scale of 1/4.
  const Expected lse_expected{ref.lse, std::vector<double>(ref.lse.size(), 0.25)};
  m = check_buffer(lse_got, lse.host(), c.lse_layout, lse_expected, std::ldexp(1.0, -15));
  EXPECT_EQ(m.count, 0) << "lse: " << m.first;

  // Backward with the forward's own out and lse, as a caller would pass them.
  Buffer grad_out(c.dtype, q_size);
  grad_out.fill_random(rng, -1, 1);
  Buffer grad_q(c.grad_dtype, q_size), grad_k(c.grad_dtype, kv_size), grad_v(c.grad_dtype, kv_size);
  for (Buffer* grad : {&grad_q, &grad_k, &grad_v}) {
    if (c.grads_start_at_zero) {
      grad->set(std::vector<double>(grad->host().size(), 0.0));
    } else {
      grad->fill_random(rng, -1, 1);
    }
  }
  Buffer out32(DType::kFloat32, c.float32_out_in_backward ? q_size : 1);
  AttentionBackwardArgs bw;
  bw.q = f.q;
  bw.k = f.k;
  bw.v = f.v;
  bw.out = f.out;
  if (c.float32_out_in_backward) {
    out32.set(out_got);
    bw.out = view_of(out32, c.q_layout);
  }
  bw.lse = f.lse;
  bw.grad_out = view_of(grad_out, c.q_layout);
  bw.grad_q = view_of(grad_q, c.q_layout);
  bw.grad_k = view_of(grad_k, c.kv_layout);
  bw.grad_v = view_of(grad_v, c.kv_layout);
  bw.params = f.params;
  bw.grads_start_at_zero = c.grads_start_at_zero;
  ASSERT_TRUE(gpu::cudnn_attention_supports_backward(bw, &why)) << why;
  const BackwardReference grads = reference_backward(
      x, grad_out.host(), gather(out_got, c.q_layout), gather(lse_got, c.lse_layout));
  for (int run = 1; run <= (c.grads_start_at_zero ? 1 : 2); ++run) {
    SCOPED_TRACE("backward run " + std::to_string(run));
    gpu::cudnn_attention_backward(bw, scratch_pool(), stream);
    check_cuda(cudaStreamSynchronize(stream), "backward");
    m = check_buffer(grad_q.download(), grad_q.host(), c.q_layout, grads.grad_q, eps, run, true);
    EXPECT_EQ(m.count, 0) << "grad_q: " << m.first;
    m = check_buffer(grad_k.download(), grad_k.host(), c.kv_layout, grads.grad_k, eps, run, true);
    EXPECT_EQ(m.count, 0) << "grad_k: " << m.first;
    m = check_buffer(grad_v.download(), grad_v.host(), c.kv_layout, grads.grad_v, eps, run, true);
    EXPECT_EQ(m.count, 0) << "grad_v: " << m.first;
  }
}

TEST_F(CudnnAttentionTest, ReportsVersion) {
  const int version = gpu::cudnn_runtime_version();
  std::cout << "cuDNN runtime version " << version << "\n";
  EXPECT_GE(version, 90000);
}

TEST_F(CudnnAttentionTest, PackedHeadsFirstBFloat16) {
  run_case({"bf16 [2, 3, 64, 64] packed, non-causal", DType::kBFloat16,
            packed({2, 3, 64, 64}), packed({2, 3, 64, 64}), packed({2, 3, 64}, false)},
           stream_, 1);
}

TEST_F(CudnnAttentionTest, HeadsInsideCausalFloat16) {
  // q/out as [B, L, H, D] storage, k/v packed [B, H, L, D]; L = 77 is no multiple of 64.
  Case c{"fp16 BSHD q, BHSD k/v, L 77, D 128, causal", DType::kFloat16,
         heads_inside(2, 2, 77, 128), packed({2, 2, 77, 128}), packed({2, 2, 77}, false)};
  c.causal = true;
  c.grad_dtype = DType::kFloat16;
  run_case(c, stream_, 2);
}

TEST_F(CudnnAttentionTest, CausalOffsetsWithLqBelowLk) {
  for (int64_t offset : {56, 5}) {
    Case c{"bf16 [3], Lq 40, Lk 96, causal offset " + std::to_string(offset), DType::kBFloat16,
           packed({3, 40, 64}), packed({3, 96, 64}), packed({3, 40}, false)};
    c.causal = true;
    c.causal_offset = offset;
    run_case(c, stream_, 3 + static_cast<uint32_t>(offset));
  }
}

TEST_F(CudnnAttentionTest, NoBatchDimsCustomScale) {
  Case c{"fp16 [33, 128] x [50, 128], causal offset 5, scale 0.3", DType::kFloat16,
         packed({33, 128}), packed({50, 128}), packed({33}, false)};
  c.causal = true;
  c.causal_offset = 5;
  c.scale = 0.3;
  run_case(c, stream_, 4);
}

TEST_F(CudnnAttentionTest, OffsetThatMasksNothingEqualsNonCausal) {
  Case c{"bf16 [2, 48, 64], causal offset 100", DType::kBFloat16, packed({2, 48, 64}),
         packed({2, 48, 64}), packed({2, 48}, false)};
  c.causal = true;
  c.causal_offset = 100;
  run_case(c, stream_, 5);
}

TEST_F(CudnnAttentionTest, DilatedViewsInPlaceCausal) {
  // Heads 1..2 of 4, segments of 16, every 2nd position from 1; the lse selection has
  // sequence stride 2, which cuDNN's stats cannot take, so it goes through scratch.
  const Dilation x{2, 64, 4, 64, 16, 2, 1, 1, 2};
  Case c{"bf16 dilated [B 2, N 64, H 4, D 64], w 16, r 2, o 1, heads 1-2, causal",
         DType::kBFloat16, dilated(x), dilated(x), dilated_lse(x)};
  c.causal = true;
  run_case(c, stream_, 6);
}

TEST_F(CudnnAttentionTest, GradientsWrittenInPlaceWhenTheyStartAtZero) {
  // Dilated selections in q's dtype (written straight by cuDNN) and, in a second case,
  // float32 gradients (which still go through scratch and an add).
  const Dilation x{2, 64, 4, 64, 16, 2, 1, 1, 2};
  Case c{"bf16 dilated, zero gradients in place, causal", DType::kBFloat16, dilated(x),
         dilated(x), dilated_lse(x)};
  c.causal = true;
  c.grad_dtype = DType::kBFloat16;
  c.grads_start_at_zero = true;
  run_case(c, stream_, 8);
  c.name = "bf16 dilated, zero float32 gradients, causal";
  c.grad_dtype = DType::kFloat32;
  run_case(c, stream_, 9);
}

TEST_F(CudnnAttentionTest, DilatedViewsFloat32OutAndGradients) {
  // All 3 heads, segments of 32, every 4th position from 3; a packed lse; the backward gets
  // a float32 out (rounded in scratch) and float32 gradients.
  const Dilation x{1, 96, 3, 128, 32, 4, 3, 0, 3};
  Case c{"fp16 dilated [B 1, N 96, H 3, D 128], w 32, r 4, o 3", DType::kFloat16, dilated(x),
         dilated(x), packed({1, 3, 3, 8}, false)};
  c.float32_out_in_backward = true;
  run_case(c, stream_, 7);
}

TEST_F(CudnnAttentionTest, GraphCacheBuildsOnce) {
  // A shape no other test uses, so the first call must build.
  Buffer q(DType::kBFloat16, 2 * 24 * 64), out(DType::kBFloat16, 2 * 24 * 64);
  Buffer lse(DType::kFloat32, 2 * 24);
  std::mt19937 rng(8);
  q.fill_random(rng, -1, 1);
  AttentionForwardArgs f;
  f.q = f.k = f.v = view_of(q, packed({2, 24, 64}));
  f.out = view_of(out, packed({2, 24, 64}));
  f.lse = view_of(lse, packed({2, 24}, false));
  f.params.scale = 0.125;
  const gpu::CudnnGraphCacheStats before = gpu::cudnn_graph_cache_stats();
  gpu::cudnn_attention_forward(f, scratch_pool(), stream_);
  const gpu::CudnnGraphCacheStats first = gpu::cudnn_graph_cache_stats();
  gpu::cudnn_attention_forward(f, scratch_pool(), stream_);
  const gpu::CudnnGraphCacheStats second = gpu::cudnn_graph_cache_stats();
  sync();
  EXPECT_EQ(first.builds, before.builds + 1);
  EXPECT_EQ(first.failures, before.failures);
  EXPECT_EQ(second.builds, first.builds);
  EXPECT_EQ(second.hits, first.hits + 1);
  EXPECT_GE(second.size, 1);
  EXPECT_LE(second.size, second.capacity);
  // Another scale is another graph.
  f.params.scale = 0.25;
  gpu::cudnn_attention_forward(f, scratch_pool(), stream_);
  sync();
  EXPECT_EQ(gpu::cudnn_graph_cache_stats().builds, second.builds + 1);
}

TEST_F(CudnnAttentionTest, ConcurrentCallersGetCorrectResults) {
  // Four threads, each on its own stream, run the same new shape at once: the cache and
  // handle pool must serve them all, and every result must match the reference.
  const Layout layout = packed({2, 2, 32, 64});
  const Layout lse_layout = packed({2, 2, 32}, false);
  std::vector<std::string> failures(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      try {
        check_cuda(cudaSetDevice(0), "cudaSetDevice");
        cudaStream_t stream = nullptr;
        check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
        {
          gpu::StreamGuard guard(0, stream);
          std::mt19937 rng(100 + t);
          Buffer q(DType::kBFloat16, 8192), k(DType::kBFloat16, 8192), v(DType::kBFloat16, 8192);
          Buffer out(DType::kBFloat16, 8192), lse(DType::kFloat32, 128);
          q.fill_random(rng, -2, 2);
          k.fill_random(rng, -1, 1);
          v.fill_random(rng, -1, 1);
          out.poison();
          lse.poison();
          AttentionForwardArgs f;
          f.q = view_of(q, layout);
          f.k = view_of(k, layout);
          f.v = view_of(v, layout);
          f.out = view_of(out, layout);
          f.lse = view_of(lse, lse_layout);
          f.params.scale = 0.1;
          for (int repeat = 0; repeat < 3; ++repeat) {
            gpu::cudnn_attention_forward(f, scratch_pool(), stream);
          }
          check_cuda(cudaStreamSynchronize(stream), "sync");
          const Operands x{q.host(), k.host(), v.host(), layout, layout, 0.1, false, 0};
          const Mismatches m = check_buffer(out.download(), out.host(), layout,
                                            reference_forward(x).out, storage_eps(DType::kBFloat16));
          if (m.count != 0) failures[t] = m.first;
        }
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}

// ---------------------------------------------------------------------------------------
// Refusals: each names its reason, and the call throws kUnimplemented with it.

class CudnnAttentionRefusalTest : public CudnnAttentionTest {
 protected:
  void SetUp() override {
    CudnnAttentionTest::SetUp();
    if (IsSkipped()) return;
    big_ = std::make_unique<Buffer>(DType::kBFloat16, 8 * 2 * 16 * 72 + 64);
    out_ = std::make_unique<Buffer>(DType::kBFloat16, 2 * 16 * 64);
    lse_ = std::make_unique<Buffer>(DType::kFloat32, 2 * 2 * 2 * 8);
    f32_ = std::make_unique<Buffer>(DType::kFloat32, 2 * 16 * 64);
    std::mt19937 rng(9);
    big_->fill_random(rng, -1, 1);
  }
  // A valid bf16 call [1, 2, 16, 64] over big_ (q, k, v share it) into out_ / lse_.
  AttentionForwardArgs valid() const {
    AttentionForwardArgs f;
    f.q = f.k = f.v = view_of(*big_, packed({1, 2, 16, 64}));
    f.out = view_of(*out_, packed({1, 2, 16, 64}));
    f.lse = view_of(*lse_, packed({1, 2, 16}, false));
    f.params.scale = 0.125;
    return f;
  }
  void expect_refused(const AttentionForwardArgs& f, const std::string& reason) {
    std::string why;
    EXPECT_FALSE(gpu::cudnn_attention_supports(f, &why)) << reason;
    EXPECT_NE(why.find(reason), std::string::npos) << "reason: " << why;
    try {
      gpu::cudnn_attention_forward(f, scratch_pool(), stream_);
      ADD_FAILURE() << "no error for: " << reason;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnimplemented) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }

  // Allocated in SetUp, once a GPU is known to be there.
  std::unique_ptr<Buffer> big_, out_, lse_, f32_;
};

TEST_F(CudnnAttentionRefusalTest, ValidCallIsSupported) {
  std::string why = "unset";
  EXPECT_TRUE(gpu::cudnn_attention_supports(valid(), &why)) << why;
  EXPECT_EQ(why, "");
}

TEST_F(CudnnAttentionRefusalTest, DTypes) {
  AttentionForwardArgs f = valid();
  f.q = f.k = f.v = view_of(*f32_, packed({1, 2, 16, 64}));
  expect_refused(f, "bfloat16 or float16");
  f = valid();
  f.out = view_of(*f32_, packed({1, 2, 16, 64}));
  expect_refused(f, "out is float32");
}

TEST_F(CudnnAttentionRefusalTest, HeadDims) {
  AttentionForwardArgs f = valid();
  for (int64_t head : {20, 264}) {
    f.q = f.k = f.v = view_of(*big_, packed({1, 2, 16, head}));
    f.out = view_of(*big_, packed({1, 2, 16, head}));
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
  AttentionForwardArgs f = valid();
  // Rows 72 elements apart are fine (a multiple of 8); 68 is not.
  Layout rows = packed({1, 2, 16, 64});
  rows.strides = {2 * 16 * 68, 16 * 68, 68, 1};
  f.q = view_of(*big_, rows);
  expect_refused(f, "multiple of 8");
  // A head dim that is not contiguous.
  Layout spread = packed({1, 2, 16, 64});
  spread.strides = {2 * 16 * 128, 16 * 128, 128, 2};
  f = valid();
  f.k = view_of(*big_, spread);
  expect_refused(f, "head-dim stride 2");
  // A pointer one element past a 16-byte boundary.
  f = valid();
  Layout shifted = packed({1, 2, 16, 64});
  shifted.offset = 1;
  f.v = view_of(*big_, shifted);
  expect_refused(f, "aligned");
  // Batch dims [2, 2, 2] laid out in reverse order: no split folds into (B, H).
  Layout reversed{{2, 2, 2, 8, 64}, {8 * 64, 2 * 8 * 64, 4 * 8 * 64, 64, 1}, 0, true};
  f = valid();
  f.q = f.k = f.v = view_of(*big_, reversed);
  f.out = view_of(*big_, packed({2, 2, 2, 8, 64}));
  f.lse = view_of(*lse_, packed({2, 2, 2, 8}, false));
  expect_refused(f, "cannot be folded");
}

TEST_F(CudnnAttentionRefusalTest, BackwardWithGradLse) {
  const AttentionForwardArgs f = valid();
  AttentionBackwardArgs b;
  b.q = b.k = b.v = b.out = b.grad_out = f.q;
  b.grad_q = b.grad_k = b.grad_v = view_of(*f32_, packed({1, 2, 16, 64}));
  b.lse = b.grad_lse = f.lse;
  b.params = f.params;
  std::string why;
  EXPECT_FALSE(gpu::cudnn_attention_supports_backward(b, &why));
  EXPECT_NE(why.find("grad_lse"), std::string::npos) << why;
  EXPECT_THROW(gpu::cudnn_attention_backward(b, scratch_pool(), stream_), Error);
  b.grad_lse = StridedView{};
  EXPECT_TRUE(gpu::cudnn_attention_supports_backward(b, &why)) << why;
}

TEST_F(CudnnAttentionRefusalTest, ShapeMismatchIsTheCallersError) {
  AttentionForwardArgs f = valid();
  f.k = view_of(*big_, packed({1, 2, 16, 32}));
  std::string why;
  EXPECT_FALSE(gpu::cudnn_attention_supports(f, &why));
  EXPECT_NE(why.find("does not match"), std::string::npos) << why;
  try {
    gpu::cudnn_attention_forward(f, scratch_pool(), stream_);
    ADD_FAILURE() << "no error for a k of another head dim";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch) << e.what();
  }
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::kernels
