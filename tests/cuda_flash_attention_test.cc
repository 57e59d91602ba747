// GPU tests of the flash-attention kernels (kernels/cuda/flash_attention.h) against a float64
// reference written here, plainly, from the contract of kernels/attention.h: several batch
// dims, head dims 24..256 (every bucket, padded ones too), Lq != Lk, causal offsets
// (positive, zero, negative: fully masked rows), strided dilated views, negative strides and
// unaligned views, float32 outputs, dropout (the mask checked bit for bit against
// philox_bernoulli of kernels/philox.h), and the backward's accumulation (+=) into non-zero
// gradients, with grad_lse and with out/lse merged from two calls.
//
// Outputs are poisoned with NaN bytes before each forward run, so an unwritten element
// fails; elements outside a view must stay poisoned. Tolerances follow the arithmetic:
// terms rounded to the input dtype (P and dS are rounded to bf16/fp16 for the tensor cores)
// are bounded by 4 units of that dtype times the sum of |terms|, plus float32 accumulation and
// exp2 error proportional to the score magnitudes, plus 2 units of the output dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/kernels/philox.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/cuda/flash_attention.h"
#include "testing/cuda_scratch_allocator.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd::kernels {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudaFlashAttentionTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

constexpr double kInf = std::numeric_limits<double>::infinity();

using test::cuda_check;

// ---------------------------------------------------------------------------------------
// Precision of the dtypes.

// Unit of the terms' rounding: float32 products are exact-ish, 16-bit P/dS are rounded.
double term_eps(DType t) {
  switch (t) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}
constexpr double kFloatEps = 5.9604644775390625e-8;  // 2^-24

double round_to(DType t, double v) {
  switch (t) {
    case DType::kFloat32: return static_cast<float>(v);
    case DType::kBFloat16: return static_cast<float>(BFloat16(static_cast<float>(v)));
    case DType::kFloat16: return static_cast<float>(Float16(static_cast<float>(v)));
    default: return v;
  }
}

// ---------------------------------------------------------------------------------------
// Device memory with a float64 mirror of its values on the host.

class Buffer {
 public:
  Buffer(DType dtype, int64_t count) : dtype_(dtype), host_(static_cast<size_t>(count), 0.0) {
    cuda_check(cudaMalloc(&device_, std::max<size_t>(16, bytes())), "cudaMalloc");
  }
  ~Buffer() { cudaFree(device_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  DType dtype() const { return dtype_; }
  int64_t count() const { return static_cast<int64_t>(host_.size()); }
  size_t bytes() const { return host_.size() * dtype_size(dtype_); }
  double& operator[](int64_t i) { return host_[static_cast<size_t>(i)]; }
  double operator[](int64_t i) const { return host_[static_cast<size_t>(i)]; }
  void* device_at(int64_t offset) const {
    return static_cast<char*>(device_) + offset * static_cast<int64_t>(dtype_size(dtype_));
  }

  // Random values in [lo, hi), rounded to the dtype, on both sides.
  void fill_uniform(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (double& x : host_) x = round_to(dtype_, dist(rng));
    upload();
  }
  void upload() {
    std::vector<unsigned char> raw(bytes());
    for (size_t i = 0; i < host_.size(); ++i) encode(raw.data() + i * dtype_size(dtype_), host_[i]);
    cuda_check(cudaMemcpy(device_, raw.data(), raw.size(), cudaMemcpyHostToDevice), "upload");
  }
  void download() {
    std::vector<unsigned char> raw(bytes());
    cuda_check(cudaMemcpy(raw.data(), device_, raw.size(), cudaMemcpyDeviceToHost), "download");
    for (size_t i = 0; i < host_.size(); ++i)
      host_[i] = decode(raw.data() + i * dtype_size(dtype_));
  }
  // NaN bytes (0xff) in every element: a NaN in every float dtype.
  void poison() {
    cuda_check(cudaMemset(device_, 0xff, bytes()), "poison");
    std::fill(host_.begin(), host_.end(), std::numeric_limits<double>::quiet_NaN());
  }

 private:
  void encode(unsigned char* p, double v) const {
    switch (dtype_) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        return;
      }
      case DType::kBFloat16: {
        const uint16_t b = BFloat16(static_cast<float>(v)).bits;
        std::memcpy(p, &b, 2);
        return;
      }
      case DType::kFloat16: {
        const uint16_t b = Float16(static_cast<float>(v)).bits;
        std::memcpy(p, &b, 2);
        return;
      }
      default: std::memcpy(p, &v, 8);
    }
  }
  double decode(const unsigned char* p) const {
    switch (dtype_) {
      case DType::kFloat32: {
        float f;
        std::memcpy(&f, p, 4);
        return f;
      }
      case DType::kBFloat16: {
        uint16_t b;
        std::memcpy(&b, p, 2);
        return static_cast<float>(BFloat16::from_bits(b));
      }
      case DType::kFloat16: {
        uint16_t b;
        std::memcpy(&b, p, 2);
        return static_cast<float>(Float16::from_bits(b));
      }
      default: {
        double d;
        std::memcpy(&d, p, 8);
        return d;
      }
    }
  }

  DType dtype_;
  std::vector<double> host_;
  void* device_ = nullptr;
};

// A view [batch..., rows, cols] (or a statistic [batch..., rows] when cols_dim is false) of a
// Buffer, in elements.
struct View {
  Buffer* buf = nullptr;
  int64_t offset = 0;
  std::vector<int64_t> shape, strides;
  bool statistic = false;

  int batch_dims() const { return static_cast<int>(shape.size()) - (statistic ? 1 : 2); }
  int64_t batch_count() const {
    int64_t n = 1;
    for (int d = 0; d < batch_dims(); ++d) n *= shape[d];
    return n;
  }
  int64_t rows() const { return shape[batch_dims()]; }
  // Element offset of (flattened batch b, row, col).
  int64_t index(int64_t b, int64_t row, int64_t col = 0) const {
    int64_t off = offset;
    for (int d = batch_dims() - 1; d >= 0; --d) {
      off += (b % shape[d]) * strides[d];
      b /= shape[d];
    }
    off += row * strides[batch_dims()];
    if (!statistic) off += col * strides[batch_dims() + 1];
    return off;
  }
  double get(int64_t b, int64_t row, int64_t col = 0) const { return (*buf)[index(b, row, col)]; }
  StridedView strided() const {
    StridedView v;
    if (buf == nullptr) return v;
    v.data = buf->device_at(offset);
    v.dtype = buf->dtype();
    v.ndim = static_cast<int>(shape.size());
    for (int d = 0; d < v.ndim; ++d) {
      v.shape[d] = shape[d];
      v.strides[d] = strides[d];
    }
    return v;
  }
};

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
  return strides;
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t n = 1;
  for (int64_t x : v) n *= x;
  return n;
}

// Owns the buffers of one test and hands out contiguous views of fresh ones.
class Arena {
 public:
  Buffer& buffer(DType dtype, int64_t count) {
    buffers_.push_back(std::make_unique<Buffer>(dtype, count));
    return *buffers_.back();
  }
  View contiguous(DType dtype, std::vector<int64_t> shape, bool statistic = false) {
    View v;
    v.buf = &buffer(dtype, product(shape));
    v.strides = row_major_strides(shape);
    v.shape = std::move(shape);
    v.statistic = statistic;
    return v;
  }

 private:
  std::vector<std::unique_ptr<Buffer> > buffers_;
};

std::vector<int64_t> with(std::vector<int64_t> batch, std::initializer_list<int64_t> tail) {
  batch.insert(batch.end(), tail.begin(), tail.end());
  return batch;
}

// ---------------------------------------------------------------------------------------
// The float64 reference, straight from kernels/attention.h.

bool visible(const AttentionParams& p, int64_t i, int64_t j) {
  return !p.causal || j <= i + p.causal_offset;
}

// keep(b, i, j) / (1 - dropout), or 1 without dropout.
double dropout_factor(const AttentionParams& p, int64_t b, int64_t lq, int64_t lk, int64_t i,
                      int64_t j) {
  if (p.dropout <= 0.0) return 1.0;
  const uint64_t element = (static_cast<uint64_t>(b) * lq + i) * lk + j;
  const bool keep =
      philox_bernoulli(1.0 - p.dropout, philox_for_element(p.seed, p.offset, element));
  return keep ? 1.0 / (1.0 - p.dropout) : 0.0;
}

struct Inputs {
  View q, k, v;
  AttentionParams params;
  int64_t batch() const { return q.batch_count(); }
  int64_t lq() const { return q.rows(); }
  int64_t lk() const { return k.rows(); }
  int64_t d() const { return q.shape.back(); }
  double score(int64_t b, int64_t i, int64_t j) const {
    double s = 0;
    for (int64_t c = 0; c < d(); ++c) s += q.get(b, i, c) * k.get(b, j, c);
    return params.scale * s;
  }
  double score_abs(int64_t b, int64_t i, int64_t j) const {
    double s = 0;
    for (int64_t c = 0; c < d(); ++c) s += std::abs(q.get(b, i, c) * k.get(b, j, c));
    return std::abs(params.scale) * s;
  }
};

struct ForwardReference {
  std::vector<double> out, out_err;  // [b][i][c]: the value and the sum of |terms|
  std::vector<double> lse;           // [b][i]
  double score_abs = 0;              // the largest |scale| * sum |q k| and |lse|
};

ForwardReference reference_forward(const Inputs& in) {
  const int64_t nb = in.batch(), lq = in.lq(), lk = in.lk(), d = in.d();
  ForwardReference r;
  r.out.assign(nb * lq * d, 0.0);
  r.out_err.assign(nb * lq * d, 0.0);
  r.lse.assign(nb * lq, -kInf);
  std::vector<double> s(lk);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      double m = -kInf;
      for (int64_t j = 0; j < lk; ++j) {
        s[j] = visible(in.params, i, j) ? in.score(b, i, j) : -kInf;
        m = std::max(m, s[j]);
        if (visible(in.params, i, j)) r.score_abs = std::max(r.score_abs, in.score_abs(b, i, j));
      }
      if (m == -kInf) continue;  // nothing visible: out 0, lse -inf
      double l = 0;
      for (int64_t j = 0; j < lk; ++j) l += std::exp(s[j] - m);
      const double lse = m + std::log(l);
      r.lse[b * lq + i] = lse;
      r.score_abs = std::max(r.score_abs, std::abs(lse));
      for (int64_t j = 0; j < lk; ++j) {
        if (s[j] == -kInf) continue;
        const double p = std::exp(s[j] - lse) * dropout_factor(in.params, b, lq, lk, i, j);
        for (int64_t c = 0; c < d; ++c) {
          const double term = p * in.v.get(b, j, c);
          r.out[(b * lq + i) * d + c] += term;
          r.out_err[(b * lq + i) * d + c] += std::abs(term);
        }
      }
    }
  }
  return r;
}

struct BackwardReference {
  std::vector<double> dq, dq_err, dk, dk_err, dv, dv_err;  // [b][row][c]
  double score_abs = 0;
};

// The gradients of one call given the (merged) out and lse the loss saw.
BackwardReference reference_backward(const Inputs& in, const View& out, const View& lse,
                                     const View& grad_out, const View* grad_lse) {
  const int64_t nb = in.batch(), lq = in.lq(), lk = in.lk(), d = in.d();
  const double scale = in.params.scale;
  BackwardReference r;
  r.dq.assign(nb * lq * d, 0.0);
  r.dq_err = r.dq;
  r.dk.assign(nb * lk * d, 0.0);
  r.dk_err = r.dk;
  r.dv = r.dk;
  r.dv_err = r.dk;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      const double row_lse = lse.get(b, i);
      r.score_abs = std::max(r.score_abs, std::isfinite(row_lse) ? std::abs(row_lse) : 0.0);
      double delta = 0;
      for (int64_t c = 0; c < d; ++c) delta += grad_out.get(b, i, c) * out.get(b, i, c);
      if (grad_lse != nullptr) delta -= grad_lse->get(b, i);
      for (int64_t j = 0; j < lk; ++j) {
        if (!visible(in.params, i, j) || row_lse == -kInf) continue;
        r.score_abs = std::max(r.score_abs, in.score_abs(b, i, j));
        const double p = std::exp(in.score(b, i, j) - row_lse);
        const double keep = dropout_factor(in.params, b, lq, lk, i, j);
        double dz = 0, dz_abs = 0;
        for (int64_t c = 0; c < d; ++c) {
          dz += grad_out.get(b, i, c) * in.v.get(b, j, c);
          dz_abs += std::abs(grad_out.get(b, i, c) * in.v.get(b, j, c));
        }
        const double ds = p * (dz * keep - delta);
        // Bounds the rounding of dS and of its inputs (dO may be rounded to q's dtype).
        const double ds_abs = p * (dz_abs * keep + std::abs(delta));
        for (int64_t c = 0; c < d; ++c) {
          const int64_t qi = (b * lq + i) * d + c, kj = (b * lk + j) * d + c;
          r.dv[kj] += p * keep * grad_out.get(b, i, c);
          r.dv_err[kj] += std::abs(p * keep * grad_out.get(b, i, c));
          r.dk[kj] += scale * ds * in.q.get(b, i, c);
          r.dk_err[kj] += std::abs(scale) * ds_abs * std::abs(in.q.get(b, i, c));
          r.dq[qi] += scale * ds * in.k.get(b, j, c);
          r.dq_err[qi] += std::abs(scale) * ds_abs * std::abs(in.k.get(b, j, c));
        }
      }
    }
  }
  return r;
}

// The bound on |got - want| for a value of the given error scale (sum of |terms|).
double tolerance(DType in_dtype, DType out_dtype, double err, double want, double score_abs,
                 int64_t d, double extra = 0) {
  const double rel = 4 * term_eps(in_dtype) + kFloatEps * (64 + 4.0 * d * score_abs);
  const double tiny = out_dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 1e-30;
  return rel * err + 2 * term_eps(out_dtype) * (std::abs(want) + extra) + tiny;
}

// Counts mismatches and remembers the worst one for the failure message.
class Mismatches {
 public:
  explicit Mismatches(std::string what) : what_(std::move(what)) {}
  void check(double got, double want, double tol, const std::string& where) {
    ++checked_;
    const bool ok = (std::isinf(want) && got == want) || std::abs(got - want) <= tol;
    if (ok) return;
    ++count_;
    const double excess = std::isnan(got) ? kInf : std::abs(got - want) / std::max(tol, 1e-300);
    if (excess > worst_) {
      worst_ = excess;
      detail_ = str_cat(where, ": got ", got, ", want ", want, ", tolerance ", tol);
    }
  }
  void expect_none() const {
    EXPECT_GT(checked_, 0) << what_ << ": nothing was checked";
    EXPECT_EQ(count_, 0) << what_ << ": " << count_ << " of " << checked_ << " elements off; worst "
                         << detail_;
  }

 private:
  std::string what_;
  int64_t count_ = 0, checked_ = 0;
  double worst_ = 0;
  std::string detail_;
};

// ---------------------------------------------------------------------------------------
// Fixture and runners.

// The backward's scratch comes from a plain cudaMalloc/cudaFree allocator with exact stats,
// so a test sees that every block was returned.
class CudaFlashAttentionTest : public test::CudaStreamTest {
 protected:

  // Random q/k/v of one dtype, contiguous [batch..., L, d], default scale 1/sqrt(d).
  Inputs make_inputs(Arena& arena, DType dtype, const std::vector<int64_t>& batch, int64_t lq,
                     int64_t lk, int64_t d, double range = 1.0) {
    Inputs in;
    in.q = arena.contiguous(dtype, with(batch, {lq, d}));
    in.k = arena.contiguous(dtype, with(batch, {lk, d}));
    in.v = arena.contiguous(dtype, with(batch, {lk, d}));
    in.q.buf->fill_uniform(rng_, -range, range);
    in.k.buf->fill_uniform(rng_, -range, range);
    in.v.buf->fill_uniform(rng_, -1.0, 1.0);
    in.params.scale = 1.0 / std::sqrt(static_cast<double>(d));
    return in;
  }

  // Runs the forward into poisoned out (and lse when lse.buf is set) and checks every element
  // of the views against the reference, and that no element outside them was written.
  void check_forward(const Inputs& in, const View& out, const View& lse, const std::string& name) {
    out.buf->poison();
    if (lse.buf != nullptr) lse.buf->poison();
    AttentionForwardArgs args;
    args.q = in.q.strided();
    args.k = in.k.strided();
    args.v = in.v.strided();
    args.out = out.strided();
    args.lse = lse.strided();
    args.params = in.params;
    std::string why_not;
    ASSERT_TRUE(cuda::flash_attention_supports(args, &why_not)) << name << ": " << why_not;
    cuda::flash_attention_forward(args, stream());
    sync();
    out.buf->download();
    if (lse.buf != nullptr) lse.buf->download();

    const ForwardReference ref = reference_forward(in);
    const int64_t nb = in.batch(), lq = in.lq(), d = in.d();
    const DType dtype = in.q.buf->dtype(), out_dtype = out.buf->dtype();
    Mismatches out_check(name + " out"), lse_check(name + " lse");
    std::vector<bool> inside_out(out.buf->count(), false), inside_lse;
    if (lse.buf != nullptr) inside_lse.assign(lse.buf->count(), false);
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t c = 0; c < d; ++c) {
          const int64_t e = (b * lq + i) * d + c;
          out_check.check(out.get(b, i, c), ref.out[e],
                          tolerance(dtype, out_dtype, ref.out_err[e], ref.out[e], ref.score_abs, d),
                          str_cat("b=", b, " i=", i, " c=", c));
          inside_out[out.index(b, i, c)] = true;
        }
        if (lse.buf != nullptr) {
          const double want = ref.lse[b * lq + i];
          const double tol = kFloatEps * (16 * std::abs(want) + 4.0 * d * ref.score_abs + 16);
          lse_check.check(lse.get(b, i), want, tol, str_cat("b=", b, " i=", i));
          inside_lse[lse.index(b, i)] = true;
        }
      }
    }
    out_check.expect_none();
    if (lse.buf != nullptr) lse_check.expect_none();
    expect_untouched(*out.buf, inside_out, name + " out");
    if (lse.buf != nullptr) expect_untouched(*lse.buf, inside_lse, name + " lse");
  }

  // Elements of a poisoned buffer outside the view must still be NaN.
  static void expect_untouched(const Buffer& buf, const std::vector<bool>& inside,
                               const std::string& name) {
    int64_t written = 0;
    for (int64_t e = 0; e < buf.count(); ++e) {
      if (!inside[e] && !std::isnan(buf[e])) ++written;
    }
    EXPECT_EQ(written, 0) << name << ": elements outside the view were written";
  }

  // Fills out and lse with the float64 reference forward (rounded to their dtypes), so the
  // backward sees the result of its inputs, and returns it.
  ForwardReference write_reference_forward(const Inputs& in, const View& out, const View& lse) {
    const ForwardReference ref = reference_forward(in);
    const int64_t lq = in.lq(), d = in.d();
    for (int64_t b = 0; b < in.batch(); ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t c = 0; c < d; ++c) {
          (*out.buf)[out.index(b, i, c)] =
              round_to(out.buf->dtype(), ref.out[(b * lq + i) * d + c]);
        }
        (*lse.buf)[lse.index(b, i)] = round_to(DType::kFloat32, ref.lse[b * lq + i]);
      }
    }
    out.buf->upload();
    lse.buf->upload();
    return ref;
  }

  struct Grads {
    View dq, dk, dv;
  };

  // Runs the backward into gradients holding `initial` values (already on the device) and
  // checks initial + reference on every element of the views.
  void check_backward(const Inputs& in, const View& out, const View& lse, const View& grad_out,
                      const View* grad_lse, const Grads& g, const std::string& name) {
    const View* grads[] = {&g.dq, &g.dk, &g.dv};
    std::vector<std::vector<double> > initial;
    for (const View* v : grads) {
      initial.emplace_back(v->buf->count());
      for (int64_t e = 0; e < v->buf->count(); ++e) initial.back()[e] = (*v->buf)[e];
    }
    run_backward(in, out, lse, grad_out, grad_lse, g);
    for (const View* v : grads) v->buf->download();

    const BackwardReference ref = reference_backward(in, out, lse, grad_out, grad_lse);
    const DType dtype = in.q.buf->dtype();
    const int64_t d = in.d();
    const struct {
      const char* label;
      const View* view;
      const std::vector<double>* want;
      const std::vector<double>* err;
      int64_t rows;
    } parts[] = {{"grad_q", &g.dq, &ref.dq, &ref.dq_err, in.lq()},
                 {"grad_k", &g.dk, &ref.dk, &ref.dk_err, in.lk()},
                 {"grad_v", &g.dv, &ref.dv, &ref.dv_err, in.lk()}};
    for (size_t p = 0; p < 3; ++p) {
      const auto& part = parts[p];
      Mismatches check(name + " " + part.label);
      for (int64_t b = 0; b < in.batch(); ++b) {
        for (int64_t row = 0; row < part.rows; ++row) {
          for (int64_t c = 0; c < d; ++c) {
            const int64_t e = (b * part.rows + row) * d + c;
            const double init = initial[p][part.view->index(b, row, c)];
            const double want = init + (*part.want)[e];
            const double tol = tolerance(dtype, part.view->buf->dtype(), (*part.err)[e], want,
                                         ref.score_abs, d, std::abs(init));
            check.check(part.view->get(b, row, c), want, tol,
                        str_cat("b=", b, " row=", row, " c=", c));
          }
        }
      }
      check.expect_none();
    }
  }

  void run_backward(const Inputs& in, const View& out, const View& lse, const View& grad_out,
                    const View* grad_lse, const Grads& g) {
    AttentionBackwardArgs args;
    args.q = in.q.strided();
    args.k = in.k.strided();
    args.v = in.v.strided();
    args.out = out.strided();
    args.lse = lse.strided();
    args.grad_out = grad_out.strided();
    if (grad_lse != nullptr) args.grad_lse = grad_lse->strided();
    args.grad_q = g.dq.strided();
    args.grad_k = g.dk.strided();
    args.grad_v = g.dv.strided();
    args.params = in.params;
    std::string why_not;
    ASSERT_TRUE(cuda::flash_attention_supports_backward(args, &why_not)) << why_not;
    cuda::flash_attention_backward(args, scratch_, stream());
    sync();
    EXPECT_EQ(scratch_.stats().allocated_bytes, 0) << "scratch memory was not returned";
  }

  // Gradient views shaped like q, k, v in `dtype`, holding random initial values.
  Grads make_grads(Arena& arena, const Inputs& in, DType dtype) {
    Grads g{arena.contiguous(dtype, in.q.shape), arena.contiguous(dtype, in.k.shape),
            arena.contiguous(dtype, in.v.shape)};
    for (View* v : {&g.dq, &g.dk, &g.dv}) v->buf->fill_uniform(rng_, -0.5, 0.5);
    return g;
  }

  // The whole backward check on contiguous views: out/lse from the reference forward.
  void backward_case(DType dtype, DType grad_dtype, const std::vector<int64_t>& batch, int64_t lq,
                     int64_t lk, int64_t d, const AttentionParams& params, bool with_grad_lse,
                     const std::string& name) {
    Arena arena;
    Inputs in = make_inputs(arena, dtype, batch, lq, lk, d);
    const double scale = in.params.scale;
    in.params = params;
    if (in.params.scale == 0) in.params.scale = scale;
    const View out = arena.contiguous(grad_dtype, in.q.shape);
    const View lse = arena.contiguous(DType::kFloat32, with(batch, {lq}), true);
    write_reference_forward(in, out, lse);
    const View grad_out = arena.contiguous(grad_dtype, in.q.shape);
    grad_out.buf->fill_uniform(rng_, -1.0, 1.0);
    View grad_lse;
    if (with_grad_lse) {
      grad_lse = arena.contiguous(DType::kFloat32, with(batch, {lq}), true);
      grad_lse.buf->fill_uniform(rng_, -1.0, 1.0);
    }
    const Grads g = make_grads(arena, in, grad_dtype);
    check_backward(in, out, lse, grad_out, with_grad_lse ? &grad_lse : nullptr, g, name);
  }

  std::mt19937_64 rng_{20240917};
  test::CudaTestAllocator scratch_;
};

std::string case_name(DType dtype, int64_t d, const char* what) {
  return str_cat(dtype_name(dtype), " D=", d, " ", what);
}

const DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const int64_t kHeadDims[] = {32, 64, 128, 256};

// ---------------------------------------------------------------------------------------
// Forward.

TEST_F(CudaFlashAttentionTest, ForwardMatchesReferenceEveryDTypeAndBucket) {
  for (DType dtype : kDTypes) {
    for (int64_t d : kHeadDims) {
      Arena arena;
      // Two batch dims, Lq != Lk, neither a multiple of a tile.
      Inputs in = make_inputs(arena, dtype, {2, 3}, 77, 131, d);
      const View out = arena.contiguous(dtype, in.q.shape);
      const View lse = arena.contiguous(DType::kFloat32, {2, 3, 77}, true);
      check_forward(in, out, lse, case_name(dtype, d, "dense"));
    }
  }
}

TEST_F(CudaFlashAttentionTest, ForwardCausalWithOffsets) {
  for (DType dtype : kDTypes) {
    for (int64_t d : kHeadDims) {
      // Bottom-right alignment (offset Lk - Lq) with more keys than rows.
      Arena arena;
      Inputs in = make_inputs(arena, dtype, {3}, 77, 131, d);
      in.params.causal = true;
      in.params.causal_offset = 131 - 77;
      const View out = arena.contiguous(dtype, in.q.shape);
      const View lse = arena.contiguous(DType::kFloat32, {3, 77}, true);
      check_forward(in, out, lse, case_name(dtype, d, "causal +54"));
      // A negative offset with fewer keys than rows: rows 0..4 see nothing (out 0, lse -inf),
      // and the later rows see every key.
      Inputs in2 = make_inputs(arena, dtype, {2}, 150, 90, d);
      in2.params.causal = true;
      in2.params.causal_offset = -5;
      const View out2 = arena.contiguous(dtype, in2.q.shape);
      const View lse2 = arena.contiguous(DType::kFloat32, {2, 150}, true);
      check_forward(in2, out2, lse2, case_name(dtype, d, "causal -5"));
    }
  }
}

TEST_F(CudaFlashAttentionTest, ForwardFullyMaskedRowsAreZeroWithLseMinusInfinity) {
  Arena arena;
  Inputs in = make_inputs(arena, DType::kBFloat16, {2}, 40, 64, 64);
  in.params.causal = true;
  in.params.causal_offset = -1000;  // nothing visible anywhere
  const View out = arena.contiguous(DType::kBFloat16, in.q.shape);
  const View lse = arena.contiguous(DType::kFloat32, {2, 40}, true);
  check_forward(in, out, lse, "all rows masked");
  for (int64_t e = 0; e < out.buf->count(); ++e) ASSERT_EQ((*out.buf)[e], 0.0);
  for (int64_t e = 0; e < lse.buf->count(); ++e) ASSERT_EQ((*lse.buf)[e], -kInf);

  // No keys at all (Lk = 0).
  Inputs empty = make_inputs(arena, DType::kFloat32, {3}, 20, 0, 32);
  const View out2 = arena.contiguous(DType::kFloat32, empty.q.shape);
  const View lse2 = arena.contiguous(DType::kFloat32, {3, 20}, true);
  check_forward(empty, out2, lse2, "no keys");
}

TEST_F(CudaFlashAttentionTest, ForwardPaddedHeadDimsAndUnalignedViews) {
  // Head dims between buckets (zero-padded in shared memory); 36 and 200 are not whole
  // 16-byte chunks in 16-bit types, so those rows load element by element.
  for (DType dtype : kDTypes) {
    for (int64_t d : {24, 36, 72, 200}) {
      Arena arena;
      Inputs in = make_inputs(arena, dtype, {2}, 65, 97, d);
      in.params.causal = d == 72;
      const View out = arena.contiguous(dtype, in.q.shape);
      const View lse = arena.contiguous(DType::kFloat32, {2, 65}, true);
      check_forward(in, out, lse, case_name(dtype, d, "padded"));
    }
  }
  // A view one element past an aligned start (no 16-byte rows), and k stored in reverse
  // (negative row stride), no batch dims at all.
  for (DType dtype : kDTypes) {
    Arena arena;
    const int64_t lq = 50, lk = 70, d = 64;
    Buffer& qbuf = arena.buffer(dtype, lq * d + 1);
    Buffer& kbuf = arena.buffer(dtype, lk * d);
    qbuf.fill_uniform(rng_, -1, 1);
    kbuf.fill_uniform(rng_, -1, 1);
    Inputs in;
    in.q = View{&qbuf, 1, {lq, d}, {d, 1}};
    in.k = View{&kbuf, (lk - 1) * d, {lk, d}, {-d, 1}};
    in.v = arena.contiguous(dtype, {lk, d});
    in.v.buf->fill_uniform(rng_, -1, 1);
    in.params.scale = 0.3;
    const View out = arena.contiguous(dtype, {lq, d});
    const View lse = arena.contiguous(DType::kFloat32, {lq}, true);
    check_forward(in, out, lse, case_name(dtype, d, "unaligned, reversed k"));
  }
}

TEST_F(CudaFlashAttentionTest, ForwardFloat32OutNoLseAndPeakedSoftmax) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Arena arena;
    Inputs in = make_inputs(arena, dtype, {2, 2}, 100, 100, 128);
    const View out = arena.contiguous(DType::kFloat32, in.q.shape);  // partials for a merge
    check_forward(in, out, View{}, case_name(dtype, 128, "float32 out, no lse"));
  }
  // Large scores: a nearly one-hot softmax must neither overflow nor lose the lse.
  Arena arena;
  Inputs in = make_inputs(arena, DType::kBFloat16, {2}, 64, 96, 64, /*range=*/2.0);
  in.params.scale = 1.0;
  const View out = arena.contiguous(DType::kBFloat16, in.q.shape);
  const View lse = arena.contiguous(DType::kFloat32, {2, 64}, true);
  check_forward(in, out, lse, "peaked softmax");
}

// A dilated selection of a contiguous [B, N, H, D] tensor, read and written in place:
// segments of w = 128 with rate r = 4 and offset o = 1, heads 1..2 of 4 (a head group), as
// the view [B, segments, heads, w / r, D] with sequence stride r * H * D.
struct DilatedLayout {
  int64_t batch = 2, n = 384, heads = 4, d = 64, w = 128, r = 4, o = 1, h0 = 1, hg = 2;
  int64_t segments() const { return n / w; }
  int64_t rows() const { return w / r; }
  View rows_view(Buffer& buf) const {  // [B, S, Hg, w/r, D] of a [B, N, H, D] buffer
    return View{&buf,
                (o * heads + h0) * d,
                {batch, segments(), hg, rows(), d},
                {n * heads * d, w * heads * d, d, r * heads * d, 1}};
  }
  View stat_view(Buffer& buf) const {  // [B, S, Hg, w/r] of a [B, N, H] buffer
    return View{&buf,
                o * heads + h0,
                {batch, segments(), hg, rows()},
                {n * heads, w * heads, 1, r * heads},
                true};
  }
};

TEST_F(CudaFlashAttentionTest, ForwardDilatedStridedViewsInPlace) {
  const DilatedLayout lay;
  for (DType dtype : kDTypes) {
    for (bool causal : {false, true}) {
      Arena arena;
      const int64_t full = lay.batch * lay.n * lay.heads * lay.d;
      Inputs in;
      for (View* v : {&in.q, &in.k, &in.v}) {
        Buffer& buf = arena.buffer(dtype, full);
        buf.fill_uniform(rng_, -1, 1);
        *v = lay.rows_view(buf);
      }
      in.params.scale = 0.125;
      in.params.causal = causal;
      // float32 partial output for 16-bit inputs, as the all-heads merge asks for.
      const DType out_dtype = dtype == DType::kFloat32 ? dtype : DType::kFloat32;
      const View out = lay.rows_view(arena.buffer(out_dtype, full));
      const View lse = lay.stat_view(arena.buffer(DType::kFloat32, lay.batch * lay.n * lay.heads));
      check_forward(in, out, lse, case_name(dtype, lay.d, causal ? "dilated causal" : "dilated"));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dropout.

// With v one-hot (v[j] = e_j), out[i, j] = p_ij * keep(b, i, j) / (1 - dropout): the mask
// shows element by element and must be exactly philox_bernoulli's.
TEST_F(CudaFlashAttentionTest, DropoutMaskIsPhiloxBernoulliBitForBit) {
  for (DType dtype : kDTypes) {
    Arena arena;
    const int64_t nb = 3, lq = 100, lk = 64, d = 64;
    Inputs in = make_inputs(arena, dtype, {nb}, lq, lk, d);
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t j = 0; j < lk; ++j) {
        for (int64_t c = 0; c < d; ++c) (*in.v.buf)[in.v.index(b, j, c)] = j == c ? 1.0 : 0.0;
      }
    }
    in.v.buf->upload();
    in.params.dropout = 0.3;
    in.params.seed = 0x1234abcd5678ull;
    in.params.offset = 977;
    const View out = arena.contiguous(dtype, in.q.shape);
    const View lse = arena.contiguous(DType::kFloat32, {nb, lq}, true);
    check_forward(in, out, lse, case_name(dtype, d, "dropout one-hot"));
    int64_t mismatches = 0, dropped = 0;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t j = 0; j < lk; ++j) {
          const bool keep = dropout_factor(in.params, b, lq, lk, i, j) != 0.0;
          dropped += keep ? 0 : 1;
          if ((out.get(b, i, j) != 0.0) != keep) ++mismatches;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << dtype_name(dtype);
    // About 30% dropped: the mask is live.
    EXPECT_NEAR(static_cast<double>(dropped) / (nb * lq * lk), 0.3, 0.02);
  }
}

TEST_F(CudaFlashAttentionTest, DropoutForwardMatchesReference) {
  for (DType dtype : kDTypes) {
    Arena arena;
    Inputs in = make_inputs(arena, dtype, {2, 2}, 90, 140, 128);
    in.params.dropout = 0.1;
    in.params.seed = 42;
    in.params.offset = 1ull << 40;
    in.params.causal = true;
    in.params.causal_offset = 50;
    const View out = arena.contiguous(dtype, in.q.shape);
    const View lse = arena.contiguous(DType::kFloat32, {2, 2, 90}, true);
    check_forward(in, out, lse, case_name(dtype, 128, "dropout causal"));
  }
}

// ---------------------------------------------------------------------------------------
// Backward.

TEST_F(CudaFlashAttentionTest, BackwardAccumulatesEveryDTypeAndBucket) {
  for (DType dtype : kDTypes) {
    for (int64_t d : kHeadDims) {
      AttentionParams p;
      backward_case(dtype, dtype, {2}, 70, 100, d, p, /*with_grad_lse=*/true,
                    case_name(dtype, d, "dense, grad_lse"));
      p.causal = true;
      p.causal_offset = 30;
      backward_case(dtype, dtype, {2}, 70, 100, d, p, false, case_name(dtype, d, "causal +30"));
    }
  }
}

TEST_F(CudaFlashAttentionTest, BackwardFloat32GradientsPaddedDimsDropoutMaskedRows) {
  AttentionParams p;
  // bf16 inputs with float32 out/grad_out/gradients (dQ atomics straight into grad_q).
  backward_case(DType::kBFloat16, DType::kFloat32, {2, 2}, 90, 60, 128, p, true,
                "bf16 with float32 gradients");
  backward_case(DType::kFloat16, DType::kFloat16, {3}, 50, 80, 36, p, false, "f16 D=36");
  backward_case(DType::kFloat32, DType::kFloat32, {2}, 50, 80, 30, p, true, "f32 D=30");
  backward_case(DType::kBFloat16, DType::kFloat32, {2}, 50, 80, 30, p, false, "bf16 D=30");
  backward_case(DType::kBFloat16, DType::kBFloat16, {2}, 50, 80, 200, p, true, "bf16 D=200");
  AttentionParams drop;
  drop.dropout = 0.2;
  drop.seed = 7;
  drop.offset = 123456789;
  drop.causal = true;
  for (DType dtype : kDTypes) {
    backward_case(dtype, dtype, {2}, 80, 80, 64, drop, true, case_name(dtype, 64, "dropout"));
  }
  AttentionParams masked;
  masked.causal = true;
  masked.causal_offset = -7;  // rows 0..6 see nothing (lse -inf): they add nothing
  backward_case(DType::kFloat32, DType::kFloat32, {2}, 90, 70, 64, masked, true, "masked rows");
  backward_case(DType::kBFloat16, DType::kBFloat16, {2}, 90, 70, 64, masked, false,
                "bf16 masked rows");
}

TEST_F(CudaFlashAttentionTest, BackwardDilatedStridedViewsInPlace) {
  const DilatedLayout lay;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Arena arena;
    const int64_t full = lay.batch * lay.n * lay.heads * lay.d;
    auto strided_buffer = [&](DType t, double range) {
      Buffer& buf = arena.buffer(t, full);
      buf.fill_uniform(rng_, -range, range);
      return lay.rows_view(buf);
    };
    Inputs in;
    in.q = strided_buffer(dtype, 1.0);
    in.k = strided_buffer(dtype, 1.0);
    in.v = strided_buffer(dtype, 1.0);
    in.params.scale = 0.125;
    in.params.causal = true;
    const View out = strided_buffer(dtype, 1.0);
    const View lse = lay.stat_view(arena.buffer(DType::kFloat32, lay.batch * lay.n * lay.heads));
    write_reference_forward(in, out, lse);
    const View grad_out = strided_buffer(dtype, 1.0);
    const Grads g{strided_buffer(dtype, 0.5), strided_buffer(dtype, 0.5),
                  strided_buffer(dtype, 0.5)};
    check_backward(in, out, lse, grad_out, nullptr, g, str_cat(dtype_name(dtype), " dilated"));
  }
}

// Keys split in two calls whose results are merged through the lse: each call's backward,
// given the merged out and lse, adds its share, and the shares sum to the full gradient.
TEST_F(CudaFlashAttentionTest, BackwardOfMergedCallsSumsToTheFullGradient) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Arena arena;
    const int64_t lq = 70, lk = 120, half = 56, d = 64;
    Inputs full = make_inputs(arena, dtype, {2}, lq, lk, d);
    full.params.causal = true;
    full.params.causal_offset = 60;
    Inputs parts[2] = {full, full};
    parts[0].k.shape[1] = parts[0].v.shape[1] = half;
    parts[1].k.shape[1] = parts[1].v.shape[1] = lk - half;
    parts[1].k.offset = parts[1].v.offset = half * d;
    parts[1].params.causal_offset = full.params.causal_offset - half;  // keys start at `half`

    // Forward of the two parts into float32 partials, merged here through their lse.
    View part_out[2], part_lse[2];
    for (int c = 0; c < 2; ++c) {
      part_out[c] = arena.contiguous(DType::kFloat32, full.q.shape);
      part_lse[c] = arena.contiguous(DType::kFloat32, {2, lq}, true);
      check_forward(parts[c], part_out[c], part_lse[c], str_cat("part ", c));
    }
    const View out = arena.contiguous(dtype, full.q.shape);
    const View lse = arena.contiguous(DType::kFloat32, {2, lq}, true);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        const double l0 = part_lse[0].get(b, i), l1 = part_lse[1].get(b, i);
        const double m = std::max(l0, l1);
        const double merged = m + std::log(std::exp(l0 - m) + std::exp(l1 - m));
        (*lse.buf)[lse.index(b, i)] = merged;
        for (int64_t c = 0; c < d; ++c) {
          const double o = std::exp(l0 - merged) * part_out[0].get(b, i, c) +
                           std::exp(l1 - merged) * part_out[1].get(b, i, c);
          (*out.buf)[out.index(b, i, c)] = round_to(dtype, o);
        }
      }
    }
    out.buf->upload();
    lse.buf->upload();
    // The merge equals the full attention.
    const ForwardReference ref = reference_forward(full);
    Mismatches merge_check(str_cat(dtype_name(dtype), " merged forward"));
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t c = 0; c < d; ++c) {
          const int64_t e = (b * lq + i) * d + c;
          merge_check.check(out.get(b, i, c), ref.out[e],
                            tolerance(dtype, dtype, ref.out_err[e], ref.out[e], ref.score_abs, d),
                            str_cat("b=", b, " i=", i, " c=", c));
        }
      }
    }
    merge_check.expect_none();

    const View grad_out = arena.contiguous(dtype, full.q.shape);
    grad_out.buf->fill_uniform(rng_, -1, 1);
    const Grads g = make_grads(arena, full, dtype);
    std::vector<double> initial[3];
    const View* grads[] = {&g.dq, &g.dk, &g.dv};
    for (int p = 0; p < 3; ++p) {
      for (int64_t e = 0; e < grads[p]->buf->count(); ++e)
        initial[p].push_back((*grads[p]->buf)[e]);
    }
    for (int c = 0; c < 2; ++c) {
      Grads part_g = g;  // grad_k/grad_v of part c are the rows of its keys
      for (View* v : {&part_g.dk, &part_g.dv}) {
        v->shape[1] = parts[c].k.shape[1];
        v->offset = parts[c].k.offset;
      }
      run_backward(parts[c], out, lse, grad_out, nullptr, part_g);
    }
    for (const View* v : grads) v->buf->download();
    const BackwardReference want = reference_backward(full, out, lse, grad_out, nullptr);
    const std::vector<double>* wants[] = {&want.dq, &want.dk, &want.dv};
    const std::vector<double>* errs[] = {&want.dq_err, &want.dk_err, &want.dv_err};
    for (int p = 0; p < 3; ++p) {
      Mismatches check(str_cat(dtype_name(dtype), " merged backward ", p));
      const int64_t rows = p == 0 ? lq : lk;
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t row = 0; row < rows; ++row) {
          for (int64_t c = 0; c < d; ++c) {
            const int64_t e = (b * rows + row) * d + c;
            const double w = initial[p][grads[p]->index(b, row, c)] + (*wants[p])[e];
            check.check(grads[p]->get(b, row, c), w,
                        tolerance(dtype, dtype, (*errs[p])[e], w, want.score_abs, d, 0.5),
                        str_cat("b=", b, " row=", row, " c=", c));
          }
        }
      }
      check.expect_none();
    }
  }
}

// ---------------------------------------------------------------------------------------
// What the path refuses, with reasons.

TEST_F(CudaFlashAttentionTest, RefusesWithReasons) {
  Arena arena;
  Inputs in = make_inputs(arena, DType::kBFloat16, {2}, 16, 16, 300);
  const View out = arena.contiguous(DType::kBFloat16, in.q.shape);
  AttentionForwardArgs args;
  args.q = in.q.strided();
  args.k = in.k.strided();
  args.v = in.v.strided();
  args.out = out.strided();
  args.params.scale = 0.1;
  std::string why_not;
  EXPECT_FALSE(cuda::flash_attention_supports(args, &why_not));
  EXPECT_NE(why_not.find("300"), std::string::npos) << why_not;
  try {
    cuda::flash_attention_forward(args, stream());
    ADD_FAILURE() << "D = 300 ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnimplemented);
  }

  // A head dim that is not unit-stride: every other element of a [16, 128] buffer.
  Inputs in2 = make_inputs(arena, DType::kFloat16, {}, 16, 16, 128);
  args.q = in2.q.strided();
  args.q.shape[1] = 64;
  args.q.strides[1] = 2;
  args.k = args.v = args.q;
  const View out2 = arena.contiguous(DType::kFloat16, {16, 64});
  args.out = out2.strided();
  EXPECT_FALSE(cuda::flash_attention_supports(args, &why_not));
  EXPECT_NE(why_not.find("head-dim stride"), std::string::npos) << why_not;

  // The forward needs a positive scale.
  args.params.scale = 0.0;
  EXPECT_FALSE(cuda::flash_attention_supports(args, &why_not));
  EXPECT_NE(why_not.find("positive scale"), std::string::npos) << why_not;
  args.params.scale = 0.1;

  // float64 belongs to the math path.
  Arena arena64;
  const View q64 = arena64.contiguous(DType::kFloat64, {8, 32});
  args.q = args.k = args.v = args.out = q64.strided();
  EXPECT_FALSE(cuda::flash_attention_supports(args, &why_not));
  EXPECT_NE(why_not.find("float64"), std::string::npos) << why_not;
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::kernels
