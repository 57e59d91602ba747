// The fixed variant's plan for one rank of a split sequence (one device is one rank of one):
// the calls on its own rows, the calls on other ranks' keys, and the exchange units that
// bring those keys (the ring or all-gather, and who exchanges with whom).
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/nn/sequence_layout.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Rank-local rows first, first + stride, ... (count of them).
struct RowRun {
  int64_t first = 0, stride = 1, count = 0;
};

// The rows of one (pair, head set) that other ranks' calls read: its heads at the positions
// of `stride` (r under the constant offset rule: exactly the positions == offset mod r are
// selected; 1 otherwise: the whole block).
struct ExchangeUnit {
  int pair = 0;
  Heads heads;  // the query heads (this rank's out, lse and dQ rows of the unit)
  int64_t offset = 0;
  int64_t stride = 1;
  bool gathered = false;  // all-gather rather than ring
  bool remote = false;    // some call reads another rank's block of this unit
  // The ranks that exchange it: the smallest g dividing P such that every call on this
  // unit reads a block of its own aligned run of g ranks [g * (rank / g), + g) (the ranks
  // sharing its segments). P when the segments do not align with the blocks.
  int span = 0;
  int head_set = 0;  // which of the pair's head sets (fixed_pair_heads)
  // The key/value heads its calls read: `heads` without grouped-query attention, else those
  // the query heads share (kv_heads_of). Only these rows travel.
  Heads kv_heads;

  // The unit's rows among rank `r`'s rows: one arithmetic run, also over both pieces of the
  // zigzag layout (whose units keep stride r only where r divides the piece length).
  RowRun rows(const RankLayout& layout, int r) const;
};

// The units exchanged one way (ring or all-gather) and where each block's rows of each sit
// in that block's flat buffer: K rows at offsets[block][i], V rows right after.
struct ExchangeGroup {
  int span = 0;  // all-gathered units: the ranks of each gather group (ExchangeUnit::span)
  std::vector<int> units;
  std::vector<std::vector<int64_t>> offsets;  // [block][i]
  std::vector<int64_t> elements;              // [block]
  int64_t max_elements = 0;
  bool empty() const { return units.empty(); }
  size_t index_of(int unit) const;
};

// A BlockCall between a query piece of this rank and a key piece of rank `src`, its
// selections moved from piece-relative to rank-local rows; q_origin and k_origin are the
// global positions of local row 0 as those selections see it (the dropout numbering).
struct LocalCall : BlockCall {
  int64_t q_origin = 0, k_origin = 0;
  int key_piece = 0;  // which of src's pieces the keys are in
};

struct RankPlan {
  RankLayout layout;
  bool merged = false;  // all-heads mixing: merge per pair
  int num_pairs = 0;
  // Calls within one piece of this rank: run in place, exactly as on one device.
  std::vector<LocalCall> local_calls;
  // [src]: this rank's other calls on src's keys, through exchange units (src == rank: the
  // zigzag layout's queries of one piece on keys of its other piece).
  std::vector<std::vector<LocalCall>> calls;
  std::vector<ExchangeUnit> units;
  ExchangeGroup ring;
  std::vector<ExchangeGroup> gathers;  // one per span, each all-gathered in its sub-groups
  // The ring runs within aligned runs of ring_span ranks (the least common multiple of its
  // units' spans) and takes ring_steps steps: the farthest block back, within the run, that
  // any call reads.
  int ring_span = 1;
  int ring_steps = 0;

  int unit_of(const BlockCall& call) const;
  // The calls of `calls` that read keys of unit `unit`.
  std::vector<const LocalCall*> calls_of_unit(const std::vector<LocalCall>& calls, int unit) const;
  int gathered_units() const;
};

// The plan of rank layout.rank for `options` (validated), choosing ring or all-gather per
// unit by `strategy` for elements of `element_bytes`. Every rank plans every (query piece,
// key piece), so all agree on the units and the ring.
RankPlan make_rank_plan(const DilatedAttentionOptions& options, const RankLayout& layout,
                        DistStrategy strategy, int64_t element_bytes,
                        const std::vector<std::vector<int64_t>>* documents = nullptr);

// The [B, count, hc, D] rows of heads `heads` (a unit's query or key/value heads) in a
// [B, C, H, D] block tensor, and the [B, hc, count] rows of a [B, H, C] row statistic (an
// LSE): strided views.
Tensor unit_rows(const Tensor& t, const Heads& heads, const RowRun& rows);
Tensor unit_stat(const Tensor& t, const Heads& heads, const RowRun& rows);

// A call's selection (rank-local rows) in the coordinates of a unit's rows of `heads`: its
// query selection in the unit's query heads, its key selection in its key/value heads.
Selection in_unit(const Selection& s, const Heads& heads, const RowRun& rows);

// The K and V rows [B, count, hc, D] of the i-th unit of `group` in block `block`'s flat
// buffer `flat`.
std::pair<Tensor, Tensor> packed_rows(const RankPlan& plan, const ExchangeGroup& group, size_t i,
                                      const Tensor& flat, int block);

}  // namespace rd::nn
