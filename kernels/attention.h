// Scaled-dot-product attention over strided views: the kernel-level primitive every attention
// path (math, flash, cuDNN) implements and every dilated or ring layout is built from. A
// dilated selection is just a strided view, so no path ever gathers or scatters a copy.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/kernels/strided.h"

namespace rd::kernels {

// The implementations of the primitive a backend may offer: the reference (every device),
// our flash kernels and cuDNN's fused SDPA (CUDA).
enum class AttentionKernel : uint8_t { kMath, kFlash, kCudnn };

constexpr const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kMath: return "math";
    case AttentionKernel::kFlash: return "flash";
    case AttentionKernel::kCudnn: return "cudnn";
  }
  return "?";
}

// Layout of every view: q [batch..., Lq, D]; k, v [batch..., Lk, D] with the same batch dims
// as q; out like q; lse [batch..., Lq]. The batch dims (0 to kMaxDims - 2 of them) are
// flattened in row-major order into one batch index b; any strides are allowed (including
// negative and zero ones for inputs), but outputs must not overlap themselves.
//
// For batch b and query row i (scores in float32, float64 for float64 data):
//   s[i, j] = scale * q[b, i] . k[b, j]  for the visible keys j (all, or j <= i + causal_offset)
//   lse[b, i] = logsumexp_j s[i, j]      (-inf when no key is visible)
//   p[i, j] = exp(s[i, j] - lse[b, i])   then dropout: p * keep(b, i, j) / (1 - dropout)
//   out[b, i] = sum_j p[i, j] v[b, j]    (0 when no key is visible: never NaN)
// keep(b, i, j) is philox_bernoulli(1 - dropout) of the Philox block of element number
// e(b, i, j) of the stream (seed, offset): the same mask on every device. By default
// e = (b * Lq + i) * Lk + j; a custom DropoutIndexing numbers the elements by their place in
// a larger attention the call is a block of (see below).
//
// key_order, when set, changes only the order in which a query row visits its keys (step t
// visits key key_order[t]): the mask, the dropout mask and hence the result are those of
// the natural order, up to float rounding of the sums. It is how dilated attention's
// Hilbert ordering reaches the kernels. Only the math kernels implement it (a flash tile or
// a cuDNN graph reads keys through strides); the others report it as unsupported.
// The dropout element numbering of a call. With `custom`, element (b, i, j) is number
//   e = base + sum_d b_d * batch_strides[d] + i * row_stride + j * col_stride  (mod 2^64)
// where b_0, ..., b_{n-1} are the indices of the call's n batch dims (the flattened batch
// index b unravelled over q's batch shape, row-major) and the arithmetic wraps around in
// uint64. So a block of a split attention (some rows, some keys, some heads) draws exactly
// the mask the whole attention draws for those elements: give it the whole one's strides
// and, as base, the number of its first element. Without `custom` the numbering is the
// default above, which is this formula with base 0, row-major batch strides times Lq * Lk,
// row_stride Lk and col_stride 1 (kernels/attention_dropout.h resolves it so).
struct DropoutIndexing {
  bool custom = false;
  uint64_t base = 0;
  int64_t batch_strides[kMaxDims - 2] = {};
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

struct AttentionParams {
  double scale = 1.0;
  bool causal = false;
  int64_t causal_offset = 0;  // key j is visible to query i iff j <= i + causal_offset
  double dropout = 0.0;       // probability of dropping; 0 disables (no mask is drawn)
  uint64_t seed = 0;
  uint64_t offset = 0;
  // Optional [Lk] int64 permutation of 0..Lk-1 in the kernel's device memory (host memory
  // on the CPU); nullptr visits keys in their natural order. Not checked by the kernels:
  // the caller guarantees it is a permutation.
  const int64_t* key_order = nullptr;
  // How the dropout mask numbers its elements (only read when dropout > 0).
  DropoutIndexing dropout_indexing;
  // The caller's word that this call's shape follows the data (a document piece, a decoding
  // step), so that it changes from input to input. Kernels ignore it; the path choice
  // (nn's AttentionRunner) does not give such calls to a kernel that builds state per shape
  // (cuDNN: a graph per shape, tens of milliseconds each) unless that path is forced.
  bool shape_follows_data = false;
};

// A call over pieces: variable-length runs of rows, each an attention of its own (document
// masks: a piece is one document's part of a segment). With pieces the views' row dims
// (Lq, Lk) are ignored (give 1): piece p reads query rows
//   position = q_position[p] + step * t,  t < q_rows[p]
// of batch row batch_row[p] of q, out, lse (and grad_out, grad_q), and key rows
// k_position[p] + step * u, u < k_rows[p], of k and v (and grad_k, grad_v); a view's row at
// `position` lies position * (its row stride / step) elements after its data for batch row
// 0, plus batch_row times its batch stride (the views are [B, H, 1, D], lse [B, H, 1]). One
// call instead of one per piece; only cuDNN runs it (ragged offsets), the other kernels
// report it unsupported and the caller runs each piece alone.
// Pieces may also start at heads of their own (several head sets of one pair in one call):
// where q_head and k_head are given (both or neither), piece p's query-side views start
// q_head[p] heads after their data and its key-side views k_head[p] heads after theirs, a
// head being (head stride / q_head_step) elements, (head stride / k_head_step) on the key
// side, just as rows count in units of (row stride / step).
struct AttentionPieces {
  int64_t step = 1;
  std::vector<int64_t> batch_row, q_position, q_rows, k_position, k_rows;
  int64_t q_head_step = 1, k_head_step = 1;
  std::vector<int64_t> q_head, k_head;  // empty: every piece at its views' first head
  int64_t count() const { return static_cast<int64_t>(batch_row.size()); }
  bool has_heads() const { return !q_head.empty(); }
};

// Why a kernel other than cuDNN refuses a call over pieces.
inline constexpr const char* kPiecesUnsupported =
    "a call over pieces (document masks) runs on cuDNN only; run each piece as its own call";

struct AttentionForwardArgs {
  StridedView q, k, v;  // one floating dtype
  StridedView out;      // q's dtype, or float32 for partial results merged later in float32
  // [batch..., Lq], float32 or (float64 inputs only) float64; data == nullptr: not written
  StridedView lse;
  AttentionParams params;
  const AttentionPieces* pieces = nullptr;  // a call over pieces (see AttentionPieces)
};

// Gradients of one forward call, ACCUMULATED into grad_q, grad_k and grad_v (+=) unless the
// call overwrites them (below), so that calls over overlapping selections (several dilation
// pairs, ring blocks) add up. `out` and `lse` are those of the final result the loss saw: for
// a result merged from several calls through the log-sum-exp, pass the merged out and lse to
// each call's backward, which is then exactly that call's share of the gradient.
struct AttentionBackwardArgs {
  StridedView q, k, v;
  StridedView out;                     // the (merged) forward output, q's dtype or float32
  StridedView lse;                     // the (merged) forward log-sum-exp, dtype as in the forward
  StridedView grad_out;                // like out
  StridedView grad_lse;                // like lse, or data == nullptr when the lse was not used
  StridedView grad_q, grad_k, grad_v;  // like q, k, v (q's dtype or float32)
  // grad_k and grad_v may also read, through stride 0, exactly the batch dims that k and v
  // read so (grouped-query attention: query heads sharing a key/value head): each element
  // then receives the sum over those dims. Only cuDNN takes such gradients (the other kernels
  // report them unsupported: attention_grads_shared).
  AttentionParams params;
  // The call stores its gradients instead of adding them: every element of grad_q, grad_k
  // and grad_v that it computes (over pieces: the pieces' rows) is overwritten, whatever it
  // held. The caller guarantees that no other contribution is meant to be there (each element
  // is this call's alone, or the buffer is fresh), so the buffers need no zeros beforehand.
  // cuDNN writes straight into them (no scratch, no add); kernels that only accumulate zero
  // them first (overwritten_grads).
  bool overwrite_grads = false;
  // The same for grad_q alone (grouped-query attention: each query head's rows are one
  // call's, while key/value heads that several calls share accumulate).
  bool overwrite_grad_q = false;
  const AttentionPieces* pieces = nullptr;  // as the forward's
};

// Whether the call overwrites grad_q: overwrite_grads says so for all three gradients,
// overwrite_grad_q for grad_q alone.
inline bool overwrites_grad_q(const AttentionBackwardArgs& args) {
  return args.overwrite_grads || args.overwrite_grad_q;
}

// The gradients a call overwrites (what a kernel that only accumulates zeroes first).
inline std::vector<const StridedView*> overwritten_grads(const AttentionBackwardArgs& args) {
  std::vector<const StridedView*> grads;
  if (overwrites_grad_q(args)) grads.push_back(&args.grad_q);
  if (args.overwrite_grads) {
    grads.push_back(&args.grad_k);
    grads.push_back(&args.grad_v);
  }
  return grads;
}

}  // namespace rd::kernels

namespace rd::kernels {

// The argument checks every backend runs first (kernels/attention.cc): ndim >= 2, q/k/v of
// one floating dtype with the same batch dims and D, k and v with the same Lk, out/grad
// views shaped like their inputs in q's dtype or float32, lse [batch..., Lq] in float32 (or
// float64 for float64 inputs),
// dropout in [0, 1), a finite scale, outputs that do not overlap themselves. A violation is
// an rd::Error naming "attention" (or "attention_backward"), the argument and the shapes.
void check_attention_forward_args(const AttentionForwardArgs& args);
void check_attention_backward_args(const AttentionBackwardArgs& args);

// Whether grad_k and grad_v read k's and v's stride-0 batch dims through stride 0 too, so
// that they sum over the query heads sharing a key/value head (AttentionBackwardArgs).
bool attention_grads_shared(const AttentionBackwardArgs& args);

// Why a kernel other than cuDNN refuses shared gradients (its threads would race on them).
inline constexpr const char* kSharedGradsUnsupported =
    "grad_k and grad_v are shared by query heads (stride 0); only cuDNN sums them natively";

// v with its stride-0 batch dims (of size > 1) cut to size 1: each element it addresses, once.
StridedView without_broadcast_dims(const StridedView& v);

}  // namespace rd::kernels
