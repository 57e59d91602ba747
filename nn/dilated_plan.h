// The planner of dilated attention: which heads and positions each attention call covers,
// for a whole sequence on one device and for one (query block, key block) of a split one,
// and how each call numbers its dropout elements so that every split draws one mask.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// A set of heads: first, first + stride, ... (count of them).
struct Heads {
  int64_t first = 0, stride = 1, count = 0;
};

// One attention call's share of a [B, N, H, D] tensor: heads
// first_head + head_stride * a + repeat_stride * b (a < head_count, b < head_repeat) and, in
// each of `segments` segments, positions first_position + s * segment_stride + rate * u
// (u < count). head_repeat > 1 only under grouped-query attention: a query selection's
// head_repeat heads that share one key/value head, and the key selection of the same call
// with repeat_stride 0 (each key head read head_repeat times, never copied). On one device
// queries and keys use the same positions, so the causal mask is the kernel's plain j <= i.
struct Selection {
  int64_t first_head = 0, head_stride = 1, head_count = 0;
  int64_t first_position = 0, segment_stride = 0, segments = 0, rate = 1, count = 0;
  int64_t head_repeat = 1, repeat_stride = 0;
  bool empty() const { return head_count == 0 || segments == 0 || count == 0; }
};

// The [B, S, head_count, n, D] view of a selection of a [B, N, H, D] tensor
// ([B, S, head_count, head_repeat, n, D] when head_repeat > 1), and the [B, S, head_count,
// (head_repeat,) n] view of the same selection of a [B, H, N] row statistic (an LSE): no
// copies.
Tensor select_bnhd(const Tensor& t, const Selection& s);
Tensor select_bhn(const Tensor& t, const Selection& s);

// The selection's heads without the repeat (a key selection's distinct heads: what its
// gradient adds into).
Selection without_repeat(const Selection& s);

// Whether two selections read the same heads (first, stride, count and repeat).
bool same_heads(const Selection& x, const Selection& y);

// Grouped-query attention: how the query heads `q` (every `group` consecutive query heads
// share one key/value head: query head h reads key/value head h / group) cut into blocks that
// are each one call: query heads first + stride * a + repeat_stride * b, key/value heads
// kv_first + kv_stride * a (a < count, b < repeat). One block with repeat 1 when group is 1
// or divides q.stride; otherwise blocks of the query heads that share a key/value head,
// consecutive ones of one size merged.
struct HeadBlock {
  Heads q;  // first, stride (between blocks' first heads), count
  int64_t repeat = 1, repeat_stride = 0;
  int64_t kv_first = 0, kv_stride = 1;
};
std::vector<HeadBlock> kv_head_blocks(const Heads& q, int64_t group);

// The key/value heads the query heads `q` read (group as above): an arithmetic run that
// covers them (stride q.stride / group when group divides q.stride, else 1).
Heads kv_heads_of(const Heads& q, int64_t group);

// The Hilbert order of n keys (nn/hilbert.h) as an int64 tensor on `device`, cached per
// (n, device) in `cache`.
Tensor hilbert_indices(PatternCache& cache, int64_t n, Device device);

// Contiguous head groups of sizes H / G, the extra H % G heads going to the first groups
// (head mixing of the fixed variant) or the last ones (the original variant).
std::vector<Heads> head_groups(int64_t num_heads, int64_t groups, bool extra_to_first);

// Every head h runs pair (w, r) with offset h mod r: heads o, o + r, o + 2r, ... share one.
std::vector<Heads> heads_by_offset(int64_t num_heads, int64_t r);

// A set of heads and the base offset o they use for one pair.
struct PairHeads {
  Heads heads;
  int64_t offset = 0;
};

// The head sets of pair i of the fixed variant: its head group with offset i mod r_i, or
// (all-heads mixing) every head, grouped by offset h mod r_i.
std::vector<PairHeads> fixed_pair_heads(const DilatedAttentionOptions& options, int64_t num_heads,
                                        int pair);

// The most pairs of the fixed variant whose head sets read one key/value head (query head h
// reads key/value head h / kv_group): 1 for head groups without grouped-query attention,
// every pair under all-heads mixing.
int64_t max_pairs_per_kv_head(const DilatedAttentionOptions& options, int64_t num_heads,
                              int64_t kv_group);

// The offset of segment `segment` (numbered from the start of the sequence) for a head set
// of base offset `base` under pair rate r: `base`, or (base + segment) mod r under the
// rotating rule. Every plan (whole calls, blocks, decoding steps) takes offsets from here.
int64_t segment_offset(const DilatedAttentionOptions& options, int64_t base, int64_t segment,
                       int64_t r);

// Number of positions o, o + r, ... below `length`.
int64_t selected_count(int64_t length, int64_t o, int64_t r);

// The selections of one pair (w, r) for the given heads and base offset o, fixed variant,
// over a whole sequence: full segments in as few calls as the offset rule allows, then the
// short last segment.
std::vector<Selection> fixed_selections(int64_t seq_len, int64_t w, int64_t r, const Heads& h,
                                        int64_t o, OffsetRule rule);

// ---------------------------------------------------------------------------------------
// A sequence split into blocks (sequence parallelism).

// Positions [begin, end) of the global sequence.
struct Block {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// The attention of some queries of a query block to some keys of a key block, fixed
// variant. `q` and `k` select the same heads with the same segments, segment stride and
// rate; their positions are relative to their block. `causal` asks for the kernel's
// j <= i mask: only when both select the same positions (the diagonal block); a key block
// entirely before the query block needs no mask, one after it is never planned.
struct BlockCall {
  Selection q, k;
  int pair = 0;
  int head_set = 0;  // which of the pair's head sets (fixed_pair_heads) the call serves
  bool causal = false;
  // Document masks: the batch row the call is for (its selections lie in one document of
  // that row), or -1 for every row.
  int64_t batch_row = -1;
};

// The calls of the fixed variant between query block `qb` and key block `kb` of a sequence
// of `seq_len` positions: every segment that has selected positions in both, the segments
// of equal shape batched into one call as on one device. Empty when the blocks share no
// segment (or, causal, when kb comes after qb). With kv_group > 1 (grouped-query attention:
// num_heads / kv_group key/value heads) the key selections name key/value heads
// (kv_head_blocks).
std::vector<BlockCall> plan_block_calls(
    const DilatedAttentionOptions& options, int64_t seq_len, int64_t num_heads, Block qb, Block kb,
    int64_t kv_group = 1, const std::vector<std::vector<int64_t>>* documents = nullptr);

// Document masks (AttentionCallContext::document_starts): a segment that holds a document
// start of some batch row (other than at its own start) is planned per row, one call per
// document piece of its selected positions, so keys of other documents are never computed;
// segments without one run for every row at once, exactly as without documents.

// Whether query block qb needs anything from key block kb: plan_block_calls is not empty.
bool blocks_interact(const DilatedAttentionOptions& options, int64_t seq_len, int64_t num_heads,
                     Block qb, Block kb);

// ---------------------------------------------------------------------------------------
// Dropout numbering (docs/dilated-attention.md): pair i draws from its own Philox offset, the
// generator advanced by dropout_counters_per_pair once per pair in pair order, and numbers
// element (batch b, head h, query position p, key position m) by its GLOBAL place,
//   ((b * H + h) * N + p) * N + m,
// so a call, a piece of one, or a block of a split sequence draws the whole call's mask.

// B * H * N * N: the numbers one pair spans. kUnimplemented when that passes 2^64 (distinct
// elements would then share numbers).
uint64_t dropout_counters_per_pair(int64_t batch, int64_t num_heads, int64_t seq_len);

// Advances `generator` once per pair, in pair order, by dropout_counters_per_pair and returns
// each pair's first counter: the AttentionParams::offset of every call of that pair (with
// the generator's seed). Every rank of a split sequence, holding an identically seeded
// generator, draws the same offsets.
std::vector<uint64_t> draw_dropout_pair_offsets(Generator& generator, int num_pairs, int64_t batch,
                                                int64_t num_heads, int64_t seq_len);

// The numbering of the call whose queries are `q` and whose keys are `k`, both in GLOBAL
// positions of a sequence of seq_len positions with num_heads heads (same heads and
// segments): its q view is [B, segments, head_count, q.count, D], so element (b, s, t, i, j)
// is query p = q.first_position + s q.segment_stride + i q.rate, key
// m = k.first_position + s k.segment_stride + j k.rate, head h = q.first_head + t q.head_stride.
kernels::DropoutIndexing dropout_indexing(const Selection& q, const Selection& k, int64_t seq_len,
                                          int64_t num_heads);

// The numbering of a BlockCall between query block qb and key block kb (its selections are
// relative to the blocks; this shifts them to global positions first). Sequence-parallel
// callers pass it to the kernel as it is, whatever coordinates the keys are read from.
kernels::DropoutIndexing block_dropout_indexing(const BlockCall& call, Block qb, Block kb,
                                                int64_t seq_len, int64_t num_heads);

// The global variant's numbering for the rows [first_row, first_row + Lq) of the head group
// starting at head first_head (its call's scores are [B, hc, Lq, Lk] in list positions): query row
// j and key list index m of head h are number ((b * H + h) * N + j) * N + m.
kernels::DropoutIndexing global_dropout_indexing(int64_t first_head, int64_t first_row,
                                                 int64_t seq_len, int64_t num_heads);

}  // namespace rd::nn
