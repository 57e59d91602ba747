// KernelBackend: the small interface every device implements (the CPU and CUDA).
// It speaks raw StridedViews and plain argument structs, never Tensors, so kernels stay
// below the tensor layer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/rowwise.h"
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
  // in has out's dtype, or is bfloat16/float16 into a float32 out: read widened, so that a
  // float32 gradient takes a 16-bit partial without a widened copy.
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

  // --- row-wise fused ops on contiguous rows (kernels/rowwise.h) ---
  // Each takes one argument struct, whose comment in kernels/rowwise.h is the op's contract;
  // every backend runs the shared check_*_args there first, so bad sizes or missing pointers
  // raise the same rd::Error on every device, before any work is queued.
  virtual void softmax(const SoftmaxArgs& args) = 0;
  virtual void softmax_backward(const SoftmaxBackwardArgs& args) = 0;
  virtual void norm(const NormArgs& args) = 0;
  virtual void norm_backward(const NormBackwardArgs& args) = 0;

  // Bad targets: a target outside [0, cols) other than ignore_index is reported on every
  // backend as rd::Error kOutOfRange with cross_entropy_target_message (the op, the target,
  // its row and the class count); no backend reads outside a position's classes. When it is
  // reported differs, by design:
  //  - host backends (the CPU) check every target before any work and throw from the call,
  //    writing nothing: the targets are in host memory, so the O(rows) pass costs no sync;
  //  - device backends (CUDA) read targets only on the device: checking before the launch
  //    would take a device-to-host copy and a host wait, which a training step must not
  //    make. The kernel records the first bad target in the device's AsyncErrors, makes that
  //    position's loss (and, in the backward, its gradient row) NaN, computes the others, and
  //    the error is raised at the next synchronization the library makes with the device
  //    (rd::synchronize, a device-to-host copy, rd::check_async_errors, ...), then cleared.
  // The tensor layer's rd::cross_entropy checks targets in host memory before either call, so
  // through it only device tensors ever reach the deferred path.
  virtual void cross_entropy(const CrossEntropyArgs& args) = 0;
  virtual void cross_entropy_backward(const CrossEntropyBackwardArgs& args) = 0;

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

  // --- SwiGLU (kernels/swiglu.h; arguments in kernels/rowwise.h) ---
  // One pass each way, where silu and mul as separate ops take two forward and six backward.
  virtual void swiglu(const SwigluArgs& args) = 0;
  virtual void swiglu_backward(const SwigluBackwardArgs& args) = 0;

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
