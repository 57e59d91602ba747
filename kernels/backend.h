// KernelBackend: the small interface every device implements (the CPU and CUDA).
// It speaks raw StridedViews, never Tensors, so kernels stay below the tensor layer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/strided.h"

namespace rd::kernels {

// Elementwise ops of one input. Float ops accept any floating dtype; kNeg and kAbs also
// accept integers. Output dtype equals input dtype.
enum class UnaryOp : uint8_t {
  kNeg,
  kAbs,
  kExp,
  kLog,
  kSqrt,
  kRsqrt,
  kTanh,
  kSigmoid,
  kRelu,
  kGeluTanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  kGeluErf,   // 0.5 x (1 + erf(x / sqrt(2)))
  kSilu,
  kPowScalar,  // x ^ UnaryParams::scalar
  kClamp,      // min(max(x, lo), hi); either bound may be absent
  kGeluTanhGrad,  // d/dx of kGeluTanh (used by the backward pass)
  kGeluErfGrad,   // d/dx of kGeluErf
};

struct UnaryParams {
  double scalar = 0.0;
  std::optional<double> lo;
  std::optional<double> hi;
};

// Elementwise ops of two inputs, broadcast already applied through zero strides.
// Arithmetic ops: out dtype == input dtype (the tensor layer promotes first).
// Comparisons: inputs share a dtype, out is kBool.
enum class BinaryOp : uint8_t {
  kAdd,
  kSub,
  kMul,
  kDiv,
  kPow,
  kMaximum,
  kMinimum,
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kLogicalAnd,
};

// Op names for error messages, shared by every backend and the tensor layer so that a
// message reads the same whichever device raised it.
constexpr const char* op_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::kNeg: return "neg";
    case UnaryOp::kAbs: return "abs";
    case UnaryOp::kExp: return "exp";
    case UnaryOp::kLog: return "log";
    case UnaryOp::kSqrt: return "sqrt";
    case UnaryOp::kRsqrt: return "rsqrt";
    case UnaryOp::kTanh: return "tanh";
    case UnaryOp::kSigmoid: return "sigmoid";
    case UnaryOp::kRelu: return "relu";
    case UnaryOp::kGeluTanh: return "gelu_tanh";
    case UnaryOp::kGeluErf: return "gelu_erf";
    case UnaryOp::kSilu: return "silu";
    case UnaryOp::kPowScalar: return "pow_scalar";
    case UnaryOp::kClamp: return "clamp";
    case UnaryOp::kGeluTanhGrad: return "gelu_tanh_grad";
    case UnaryOp::kGeluErfGrad: return "gelu_erf_grad";
  }
  return "?";
}

constexpr const char* op_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd: return "add";
    case BinaryOp::kSub: return "sub";
    case BinaryOp::kMul: return "mul";
    case BinaryOp::kDiv: return "div";
    case BinaryOp::kPow: return "pow";
    case BinaryOp::kMaximum: return "maximum";
    case BinaryOp::kMinimum: return "minimum";
    case BinaryOp::kEq: return "eq";
    case BinaryOp::kNe: return "ne";
    case BinaryOp::kLt: return "lt";
    case BinaryOp::kLe: return "le";
    case BinaryOp::kGt: return "gt";
    case BinaryOp::kGe: return "ge";
    case BinaryOp::kLogicalAnd: return "logical_and";
  }
  return "?";
}

constexpr bool is_comparison(BinaryOp op) {
  return op == BinaryOp::kEq || op == BinaryOp::kNe || op == BinaryOp::kLt ||
         op == BinaryOp::kLe || op == BinaryOp::kGt || op == BinaryOp::kGe;
}

// Reductions over the dims whose bit is set in `dims_mask`. The output view has the same
// ndim as the input, with size 1 in every reduced dim.
enum class ReduceOp : uint8_t {
  kSum,
  kMean,
  kMax,
  kMin,
  kArgMax,     // output int64, index along the single reduced dim (first maximum)
  kArgMin,     // output int64, index along the single reduced dim (first minimum)
  kLogSumExp,  // max-shifted; all -inf gives -inf
};

constexpr const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kArgMax: return "argmax";
    case ReduceOp::kArgMin: return "argmin";
    case ReduceOp::kLogSumExp: return "logsumexp";
  }
  return "?";
}

// Random fills from a counter-based Philox4x32-10 stream, so that every device produces the
// same numbers for the same (seed, offset). Element i of the logical (row-major) order uses
// counter offset + i.
enum class Distribution : uint8_t {
  kUniform,    // [a, b)
  kNormal,     // mean a, stddev b
  kBernoulli,  // 1 with probability a, else 0
};

// Row-major batched GEMM: C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b].
// op(X) is X or X^T as the trans flag says. Leading dims are row strides of the stored
// (untransposed) matrices; their column stride is 1.
struct GemmArgs {
  DType dtype = DType::kFloat32;  // of A, B and C
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch entries
  double alpha = 1.0;
  double beta = 0.0;
  // Optional epilogue: C = act(alpha * op(A) op(B) + beta * C + bias), with bias (n elements
  // of `dtype`, or null) added to every row of C and act the tanh GELU when `gelu`.
  const void* bias = nullptr;
  bool gelu = false;
  // float32 only: lets the device round A and B to TF32 (10-bit mantissa) inside the
  // product, for speed. Off by default: float32 GEMMs are computed in float32.
  bool allow_tf32 = false;
};

// AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW): with g the gradient and t = step,
//   param *= 1 - lr * weight_decay
//   exp_avg = beta1 * exp_avg + (1 - beta1) * g
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
//   param -= lr * (exp_avg / (1 - beta1^t)) / (sqrt(exp_avg_sq / (1 - beta2^t)) + eps)
// computed in accumulation_dtype(dtype) and rounded to the parameter's dtype once.
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;  // 1-based count of steps taken, including this one
};

// One tensor of an AdamW step: param and grad of the call's dtype, the two moment buffers
// of accumulation_dtype(dtype), all contiguous with `numel` elements, none aliasing.
struct AdamWTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  int64_t numel = 0;
};

// One tensor of multi_tensor_scale: `numel` contiguous elements read from src and written
// to dst (which may be src itself).
struct MultiTensorCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t numel = 0;
};

// One tensor of multi_tensor_sum_squares: `numel` contiguous elements.
struct MultiTensorInput {
  const void* data = nullptr;
  int64_t numel = 0;
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  virtual const char* name() const = 0;

  // --- data movement ---
  // out[i] = value, converted to out's dtype.
  virtual void fill(const StridedView& out, double value) = 0;
  // out[i] = start + i * step in logical order.
  virtual void arange(const StridedView& out, double start, double step) = 0;
  // out[i] = in[i] with dtype conversion; shapes equal, any strides (in may broadcast).
  virtual void copy(const StridedView& out, const StridedView& in) = 0;
  // out[i] += in[i]; out may alias itself (overlapping strides), adds are applied in order.
  virtual void accumulate(const StridedView& out, const StridedView& in) = 0;
  virtual void random(const StridedView& out, Distribution dist, double a, double b,
                      uint64_t seed, uint64_t offset) = 0;

  // --- elementwise ---
  virtual void unary(UnaryOp op, const StridedView& out, const StridedView& in,
                     const UnaryParams& params) = 0;
  virtual void binary(BinaryOp op, const StridedView& out, const StridedView& a,
                      const StridedView& b) = 0;
  // out = cond ? a : b; cond is kBool, a/b/out share a dtype.
  virtual void where(const StridedView& out, const StridedView& cond, const StridedView& a,
                     const StridedView& b) = 0;

  // --- reductions and scans ---
  virtual void reduce(ReduceOp op, const StridedView& out, const StridedView& in,
                      uint32_t dims_mask) = 0;
  // Inclusive prefix sum along `dim`; reverse=true scans from the end.
  virtual void cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse) = 0;

  // --- linear algebra ---
  virtual void gemm(const GemmArgs& args) = 0;

  // --- row-wise fused ops on contiguous [rows, cols] data ---
  // Softmax (or log-softmax when `log`) of each row.
  virtual void softmax(void* out, const void* in, DType dtype, int64_t rows, int64_t cols,
                       bool log) = 0;
  // grad_in = y * (g - sum(g*y)) for softmax; g - exp(y) * sum(g) for log-softmax.
  virtual void softmax_backward(void* grad_in, const void* grad_out, const void* out,
                                DType dtype, int64_t rows, int64_t cols, bool log) = 0;
  // Layer norm (rms=false) or RMS norm (rms=true) over each row. weight/bias may be null.
  // mean (unused for rms) and rstd are float32 [rows] outputs kept for the backward pass.
  // Residual fusion: when `residual` is not null the normalized row is in + residual, and
  // that sum is also written to `sum` (the transformer's new residual stream), so the add
  // costs no extra pass over memory. `sum` must be non-null exactly when `residual` is.
  virtual void norm(void* out, float* mean, float* rstd, const void* in, const void* residual,
                    void* sum, const void* weight, const void* bias, DType dtype, int64_t rows,
                    int64_t cols, double eps, bool rms) = 0;
  // Backward of norm(); `in` is what was normalized (the sum when a residual was fused).
  // grad_weight/grad_bias are float32 [cols] and may be null; they are overwritten, not
  // accumulated. grad_sum (may be null) is the gradient reaching the fused `sum` output
  // from elsewhere; it is added into grad_in, which is then the gradient of both the input
  // and the residual.
  virtual void norm_backward(void* grad_in, float* grad_weight, float* grad_bias,
                             const void* grad_out, const void* grad_sum, const void* in,
                             const float* mean, const float* rstd, const void* weight,
                             DType dtype, int64_t rows, int64_t cols, bool rms) = 0;

  // Cross-entropy over `rows` positions of `cols` classes, never materializing the
  // probabilities. Logits are contiguous [rows / inner, cols, inner] (PyTorch's [N, C, d...]
  // with inner = d1 * d2 * ...; inner == 1 is row-major [rows, cols]): class c of position
  // r = o * inner + i is logits[(o * cols + c) * inner + i]. Targets are int64 [rows], in
  // position order. lse[r] = logsumexp over the classes of r and
  // loss[r] = lse[r] - logit(r, targets[r]), or 0 when targets[r] == ignore_index.
  // loss and lse are of accumulation_dtype(dtype). The CPU throws kOutOfRange for a target
  // outside [0, cols) (other than ignore_index); a device records it as an asynchronous
  // error (raise_async_error) and makes that position's loss NaN, never reading outside it.
  virtual void cross_entropy(void* loss, void* lse, const void* logits, const int64_t* targets,
                             DType dtype, int64_t rows, int64_t cols, int64_t inner,
                             int64_t ignore_index) = 0;
  // grad_logits(r, c) = grad_loss[r * grad_loss_stride] * (exp(logit(r, c) - lse[r]) -
  // (c == targets[r])), and 0 at ignored positions; same layout as the logits. grad_loss
  // (accumulation_dtype(dtype)) may broadcast one value with stride 0, which is how a mean
  // or sum reduction arrives.
  virtual void cross_entropy_backward(void* grad_logits, const void* grad_loss,
                                      int64_t grad_loss_stride, const void* logits,
                                      const void* lse, const int64_t* targets, DType dtype,
                                      int64_t rows, int64_t cols, int64_t inner,
                                      int64_t ignore_index) = 0;

  // --- rotary position embedding (kernels/rotary.h) ---
  // Rotates the pairs (i, i + D/2) of x [B, T, H, D] (any strides, D even, a floating dtype)
  // by position, in the "rotate_half" convention of GPT-NeoX and Hugging Face Llama: with
  // p = position_offset + t and a = rotary_angle(p, i, D, base) for i < D/2,
  //   out[..., i] = x_i cos a - x_{i+D/2} sin a;  out[..., i+D/2] = x_{i+D/2} cos a + x_i sin a,
  // or the rotation by -a when `inverse` (the backward pass). cos and sin come from the
  // float64 angle, rounded to accumulation_dtype(dtype), where the rotation is computed. x is
  // read once and out written once; out has x's shape and dtype and may be x itself.
  virtual void rotary_embedding(const StridedView& out, const StridedView& x,
                                int64_t position_offset, double base, bool inverse) = 0;

  // --- SwiGLU (kernels/swiglu.h) ---
  // out [rows, H] = silu(gate) * up for contiguous gate_up rows [rows, 2H] (gate first, then
  // up), computed in accumulation_dtype(dtype); the backward pass writes grad_gate_up
  // [rows, 2H] from grad_out [rows, H] and gate_up, reading each once. One pass each way,
  // where silu and mul as separate ops take two forward and six backward.
  virtual void swiglu(void* out, const void* gate_up, DType dtype, int64_t rows,
                      int64_t hidden) = 0;
  virtual void swiglu_backward(void* grad_gate_up, const void* grad_out, const void* gate_up,
                               DType dtype, int64_t rows, int64_t hidden) = 0;

  // --- attention (the primitive of kernels/attention.h) ---
  // Whether `kernel` can run this call on this device; when not, *why_not says why (for the
  // fallback log). `backward` is null for a forward call. The math kernel runs every valid
  // call; the CPU has no other. A kernel that finds it cannot serve a call only while
  // running throws kUnimplemented, and only before it queued any work: callers fall back to
  // another kernel on that code alone (a backward may already have accumulated otherwise).
  virtual bool attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                                  const AttentionBackwardArgs* backward,
                                  std::string* why_not) = 0;
  virtual void attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args) = 0;
  virtual void attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args) = 0;
  // Merges a partial attention result into a running one, in place, in one pass per
  // element, computed in acc_out's dtype (float32, or float64 for float64 data):
  //   m = logaddexp(acc_lse, part_lse)   (-inf when both are -inf: never NaN)
  //   acc_out = exp(acc_lse - m) * acc_out + exp(part_lse - m) * part_out;  acc_lse = m
  // Views and dtypes as check_attention_merge_args (kernels/attention_merge.h) says; the
  // value rule is merged_value / merged_lse there, so every backend rounds alike.
  virtual void attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                               const StridedView& part_out, const StridedView& part_lse) = 0;

  // --- optimizers ---
  // One AdamW step over many tensors in a single pass (one launch on CUDA); see AdamWStep.
  virtual void adamw(std::span<const AdamWTensor> tensors, DType dtype,
                     const AdamWStep& step) = 0;

  // --- multi-tensor ops (kernels/multi_tensor.h): an optimizer step's bookkeeping over many
  // small tensors in one pass (one launch on CUDA) rather than one op per tensor ---
  // dst = src * scale * (*device_scale) for every tensor of the list, computed in float32
  // (float64 when either dtype is float64; the factor scale * *device_scale first, in that
  // type), rounded to dst_dtype. device_scale points at one float32 on the backend's device,
  // or is null (a factor of 1). dst may be src itself; no other overlap.
  virtual void multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                                  DType dst_dtype, double scale, const float* device_scale) = 0;
  // partials[c] = the sum of the squares of chunk c's elements, where each tensor of the list
  // is cut into chunks of kMultiTensorChunk elements, numbered in list order
  // (multi_tensor_chunks counts them; empty tensors have none). Each chunk is summed in
  // accumulation_dtype(dtype) in an order fixed by its size alone; partials are float64 on
  // the backend's device.
  virtual void multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                                        double* partials) = 0;

  // --- indexing ---
  // out.select(dim, i) = in.select(dim, index[i]); index is int64 1-D. Bounds are checked by
  // the caller.
  virtual void index_select(const StridedView& out, const StridedView& in, int dim,
                            const StridedView& index) = 0;
  // out.select(dim, index[i]) += src.select(dim, i).
  virtual void index_add(const StridedView& out, int dim, const StridedView& index,
                         const StridedView& src) = 0;
  // out[..., i_dim, ...] = in[..., index[..., i_dim, ...], ...]; index has out's shape.
  virtual void gather(const StridedView& out, const StridedView& in, int dim,
                      const StridedView& index) = 0;
  // out[..., index[i], ...] = src[i] (accumulate=false) or += src[i] (accumulate=true),
  // for every element i of index; src has index's shape.
  virtual void scatter(const StridedView& out, int dim, const StridedView& index,
                       const StridedView& src, bool accumulate) = 0;
};

// The CPU implementation (kernels/cpu). Always available.
KernelBackend& cpu_backend();

}  // namespace rd::kernels
