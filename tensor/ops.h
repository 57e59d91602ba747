// Tensor ops, each differentiable where it makes sense. Binary ops broadcast (NumPy rules)
// and promote dtypes; a double operand takes the tensor's dtype. Every op validates its
// inputs and throws rd::Error naming the op, the argument and the offending shapes/values.
#pragma once

#include <optional>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd {

// --- elementwise ---
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a - alpha * b
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor square(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
enum class GeluApproximation { kNone, kTanh };
Tensor gelu(const Tensor& x, GeluApproximation approximation = GeluApproximation::kNone);
Tensor silu(const Tensor& x);
// SwiGLU of a packed projection: gate_up [..., 2H] holds the gate in its first half and
// the up projection in its second; returns silu(gate) * up [..., H]. One kernel each way
// (silu and mul as separate ops take two passes forward and six backward over [..., H]).
Tensor swiglu(const Tensor& gate_up);
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max);
// cond ? a : b, broadcasting all three; cond must be bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, double b);

// Comparisons give bool tensors; not differentiable.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& a);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

// --- reductions: over `dims` (negative allowed; empty means all dims) ---
Tensor sum(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor min(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
// Variance with Bessel's correction by default (correction = 1).
Tensor var(const Tensor& x, std::vector<int64_t> dims = {}, int64_t correction = 1,
           bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);

// --- linear algebra ---
// NumPy matmul: 1-D operands are promoted and the added dim removed; batch dims broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
// [B, n, k] @ [B, k, m] -> [B, n, m]; no broadcasting.
Tensor bmm(const Tensor& a, const Tensor& b);
// x [..., in] @ weight[out, in]^T + bias[out] -> [..., out] (bias may be undefined): one GEMM
// whose epilogue adds the bias, so no second output-sized tensor is written and read.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

// --- neural-network ops ---
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// Normalizes over the trailing dims given by normalized_shape. weight/bias may be undefined.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                double eps = 1e-6);
// Residual add fused with a norm, as in a pre-norm transformer block: sum = x + residual
// and out = layer_norm(sum) (or rms_norm(sum)), computed in one pass over memory. `sum` is
// the new residual stream; gradients reach x and residual through both outputs.
struct AddNormResult {
  Tensor out;
  Tensor sum;
};
AddNormResult add_layer_norm(const Tensor& x, const Tensor& residual,
                             const Shape& normalized_shape, const Tensor& weight = {},
                             const Tensor& bias = {}, double eps = 1e-5);
AddNormResult add_rms_norm(const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
                           const Tensor& weight = {}, double eps = 1e-6);
// Rows of weight [V, E] picked by integer `indices` of any shape -> [..., E].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Rotary position embedding (RoPE) of x [B, T, H, D] (D even, floating), in the
// "rotate_half" convention of GPT-NeoX and Hugging Face Llama: token t sits at position
// p = position_offset + t and, for i < D/2 with angle a = p * base^(-2i/D),
//   out[..., i] = x_i cos a - x_{i+D/2} sin a;  out[..., i+D/2] = x_{i+D/2} cos a + x_i sin a.
// position_offset gives a shard its global positions: a sequence-parallel rank r of P
// holding tokens [r * N / P, (r + 1) * N / P) passes r * N / P. The angle is computed in
// float64 from the integer position (exact up to 2^53), so positions ~1e6 lose nothing
// beyond float64 rounding; cos and sin are then rounded to float32 (float64 for float64 x).
// One fused kernel reads x once and writes out once; the backward pass is the inverse
// rotation (the same kernel).
Tensor rotary_embedding(const Tensor& x, int64_t position_offset = 0, double base = 10000.0);
// rotary_embedding of q and k in a packed qkv [B, T, 3, H, D], v passed through: a new
// packed tensor, for attention that reads q, k and v from one buffer. Two kernels (rotate q
// and k as 2H heads, copy v) and one packed gradient, where rotating q and k apart and
// selecting v costs the backward pass three zeroed [B, T, 3, H, D] buffers.
// The backward pass rotates the incoming gradient in its own buffer when nothing else
// holds it (autograd::is_exclusive_gradient): then v's gradient costs no copy either.
Tensor rotary_embedding_qkv(const Tensor& qkv, int64_t position_offset = 0,
                            double base = 10000.0);
// rotary_embedding_qkv in qkv's own buffer: q and k are rotated in place and v stays where
// it is, so the result aliases qkv and qkv's values are overwritten. For a projection's
// fresh output that nothing else reads (its producer's backward must not need it, as a
// matmul's does not): it saves a packed-sized buffer and the copy of v. qkv may not be a
// leaf that requires grad; a layout whose q and k heads do not merge takes the copying path.
Tensor rotary_embedding_qkv_overwrite(const Tensor& qkv, int64_t position_offset = 0,
                                      double base = 10000.0);
// Rows of a sequence shard that hold consecutive positions, and the first one's position:
// a context-parallel rank of the zigzag layout holds two such runs
// (nn::sequence_pieces). The packed forms below take a list of runs covering dim 1 in
// order; the position_offset forms are one run.
struct PositionRun {
  int64_t rows = 0;
  int64_t first_position = 0;
};
Tensor rotary_embedding_qkv(const Tensor& qkv, const std::vector<PositionRun>& runs,
                            double base = 10000.0);
Tensor rotary_embedding_qkv_overwrite(const Tensor& qkv, const std::vector<PositionRun>& runs,
                                      double base = 10000.0);
// --- Multi-tensor ops: one pass (one launch on CUDA) over a list of contiguous tensors of
// one device and one floating dtype, for an optimizer step's bookkeeping over many small
// tensors (one op per tensor costs ~5 launches a parameter, which the host issues slower than
// the GPU runs them). Not differentiable; errors name the list and the index.
// The sum of the squares of every element of the list: float64 [] on its device (each
// 65536-element chunk summed in float32, float64 for float64 data; the chunks in float64,
// in a fixed order).
Tensor foreach_sum_squares(const std::vector<Tensor>& tensors);
// dst[i] = src[i] * scale (times `device_scale`, one float32 on the device, when defined),
// computed in float32 (float64 when either list is float64) and rounded to dst's dtype once.
// dst[i] may be src[i] itself (then one dtype); shapes must match pairwise.
void foreach_scaled_copy_(const std::vector<Tensor>& dst, const std::vector<Tensor>& src,
                          double scale = 1.0, const Tensor& device_scale = Tensor());

// Zeroes each element with probability p and scales survivors by 1/(1-p), when training.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

// Merges an attention partial into a running result in place, through the log-sum-exp, in
// one fused pass (KernelBackend::attention_merge): acc_out and part_out are [B, N, H, D],
// acc_lse and part_lse [B, H, N], all float32 (float64 for float64 data) on one device,
// except that part_out may be bfloat16 or float16 (read as float32) with float32 acc_out.
// Rows whose LSEs are both -inf keep 0 and -inf. Not differentiable (no autograd node).
void attention_merge_(const Tensor& acc_out, const Tensor& acc_lse, const Tensor& part_out,
                      const Tensor& part_lse);
enum class Reduction { kNone, kMean, kSum };
// logits [N, C], [C] or [N, C, d1, d2, ...] (as PyTorch: classes in dim 1), integer
// targets [N], [] or [N, d1, d2, ...]. Targets equal to ignore_index add nothing; kMean
// divides by the number of targets not ignored (0/0 gives NaN, as PyTorch); kNone returns
// the targets' shape. One fused kernel per direction, reading the logits in their own
// layout (the class stride of the [N, C, d...] form costs no permuted copy); the
// probabilities are never materialized. A CPU target outside [0, C) throws here; on CUDA
// it is found without a host synchronization, raised at the next one (check_async_errors).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::kMean);

// --- joining, splitting and indexing ---
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Pieces of `split_size` along dim (the last may be smaller); views.
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// Copies of x with src written (scatter) or added (scatter_add) at index along dim. With
// scatter, duplicate indices keep an unspecified one of the written values.
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// Keeps elements on and below (tril) / above (triu) the k-th diagonal of the last two dims.
Tensor tril(const Tensor& x, int64_t k = 0);
Tensor triu(const Tensor& x, int64_t k = 0);
Tensor cumsum(const Tensor& x, int64_t dim);

// True when a and b have equal shapes and every |a - b| <= atol + rtol * |b|.
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);

}  // namespace rd
