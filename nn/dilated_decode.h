// Decoding with a KV cache: the keys and values of the positions decoded so far, held in a
// preallocated buffer, and the step that attends one new position to the cached keys its
// pattern selects. The step is the last row of causal dilated attention over the sequence
// so far (segment-local variant), at a cost bounded by the selected positions of the new
// position's segments, not by the prefix (docs/dilated-attention.md, "Decoding").
#pragma once

#include <cstdint>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// K and V rows [B, capacity, H, D] of positions 0 .. length() - 1. Appending past the
// capacity doubles it (one copy of the prefix per doubling, never one per step).
class DilatedKVCache {
 public:
  // An empty cache for `batch` sequences of `heads` heads of `head_dim`, room for
  // `capacity` positions before it grows. Throws rd::Error naming the argument when a size
  // is < 1 or the dtype is not floating.
  DilatedKVCache(int64_t batch, int64_t capacity, int64_t heads, int64_t head_dim,
                 TensorOptions options);

  // Appends k and v rows [B, T, H, D] (any strides) at positions length() .. length() + T - 1.
  void append(const Tensor& k, const Tensor& v);
  void clear() { length_ = 0; }
  // Forgets the positions from `length` on (e.g. to roll a draft back); keeps the capacity.
  void truncate(int64_t length);

  int64_t length() const { return length_; }
  int64_t capacity() const { return keys_.size(1); }
  // [B, capacity, H, D]: rows beyond length() hold stale values.
  const Tensor& keys() const { return keys_; }
  const Tensor& values() const { return values_; }

 private:
  void reserve(int64_t positions);

  Tensor keys_, values_;
  int64_t length_ = 0;
};

// The attention of the cache's last position p = cache.length() - 1, whose query is q
// [B, 1, H, D] (its key and value already appended; the cache may hold fewer key/value heads,
// a divisor of H: grouped-query attention), to positions 0 .. p: equal to row p of
// dilated_attention_with_lse(q, k, v, options) over the whole sequence so far, options
// causal (required), segment-local variant (kGlobal is kUnimplemented: its cycled lists
// change with N, so decode by recomputing the prefix). A pair whose pattern does not select
// p gives p nothing (its heads 0 under head groups; no share under all-heads mixing); a row
// no pair selects is 0 with lse -inf, never NaN. Not differentiable (inference).
DilatedAttentionResult dilated_attention_decode_step(const Tensor& q, const DilatedKVCache& cache,
                                                     const DilatedAttentionOptions& options,
                                                     const AttentionCallContext& context = {});

}  // namespace rd::nn
