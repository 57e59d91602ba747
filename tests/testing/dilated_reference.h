// Naive float64 reference of dilated attention, written from docs/dilated-attention.md alone:
// every output row is a plain softmax over an explicit list of key positions, then merged.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/nn/dilated_attention.h"

namespace rd::test {

// A dense row-major [B, N, H, D] array of doubles (batch, sequence, heads, head dim).
struct HeadsArray {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t heads = 0;
  int64_t dim = 0;
  std::vector<double> values;

  static HeadsArray zeros(int64_t batch, int64_t seq, int64_t heads, int64_t dim);
  int64_t index(int64_t b, int64_t n, int64_t h, int64_t d) const {
    return ((b * seq + n) * heads + h) * dim + d;
  }
  double at(int64_t b, int64_t n, int64_t h, int64_t d) const { return values[index(b, n, h, d)]; }
  double& at(int64_t b, int64_t n, int64_t h, int64_t d) { return values[index(b, n, h, d)]; }
};

// A [B, N, H, D] tensor's values (any floating dtype, on the CPU) as a HeadsArray.
HeadsArray heads_array_of(const Tensor& t);

struct DilatedReferenceResult {
  HeadsArray out;           // [B, N, H, D]
  std::vector<double> lse;  // [B, H, N]; -inf where a row attended to no key
  double lse_at(int64_t b, int64_t h, int64_t n) const {
    return lse[(b * out.heads + h) * out.seq + n];
  }
};

// One computation a head takes part in: dilation pair `pair` with base offset `offset`.
struct PairJob {
  int64_t pair = 0;
  int64_t offset = 0;
};

// What one output row receives from one PairJob: the attention of query position `query`
// over the key (and value) positions `keys`, a multiset in visiting order. query == -1: the
// row receives nothing (out 0, lse -inf).
struct RowPlan {
  int64_t query = -1;
  std::vector<int64_t> keys;
};

// Sizes of G contiguous head groups over H heads; the H % G extra heads go to the first
// groups (fixed variant) or to the last ones (global variant).
std::vector<int64_t> head_group_sizes(int64_t heads, int64_t groups, bool extra_to_first);

// Fixed variant: the selected positions P_s of every segment s of a pair (w, r) with base
// offset o, under the offset rule. Segments that select nothing give an empty list.
std::vector<std::vector<int64_t>> segment_selections(int64_t seq, int64_t segment_length,
                                                     int64_t rate, int64_t offset,
                                                     nn::OffsetRule rule);

// Global variant: P[j] = base[j mod |base|] for j = 0 .. N-1, base = (o, o + r, ... < N).
// Empty when base is empty (o >= N).
std::vector<int64_t> cycled_index_list(int64_t seq, int64_t rate, int64_t offset);

// The PairJobs of head `head` out of `heads` under the options' variant and mixing.
std::vector<PairJob> head_jobs(int64_t head, int64_t heads, const nn::DilatedAttentionOptions& options);

// The plan of every output row n = 0 .. N-1 for one PairJob (causal masking included).
std::vector<RowPlan> row_plans(int64_t seq, const PairJob& job,
                               const nn::DilatedAttentionOptions& options);

// The whole operation. Dropout, use_hilbert and path are ignored (eval mode; the Hilbert
// order does not change the math). Throws std::invalid_argument on shapes or options the
// specification rejects.
// `document_starts` (optional, one list per batch row): a query keeps only the keys of its own
// document, the positions from one start to the next.
DilatedReferenceResult dilated_attention_reference(
    const HeadsArray& q, const HeadsArray& k, const HeadsArray& v,
    const nn::DilatedAttentionOptions& options,
    const std::vector<std::vector<int64_t>>* document_starts = nullptr);

}  // namespace rd::test
