// The fixed variant on one rank (see fixed_attention.h, docs/distributed.md). Each call is
// a strided selection of q, k, v, out and lse, so nothing is gathered. The calls on this
// rank's own rows write its out and lse in place (head groups) or merge per pair through the
// LSE (all heads), exactly as on one device. Each remote block's partials (q's dtype) merge
// into a float32 accumulator of the unit's rows. The backward reruns every call against the
// final (merged) out and lse, so each yields exactly its share of the gradient; dK/dV of
// remote keys go back to their owners in float32 through the exchange.
#include "ringdilated/nn/fixed_attention.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "ringdilated/kernels/view_checks.h"
#include "ringdilated/nn/key_exchange.h"
#include "ringdilated/nn/piece_calls.h"
#include "ringdilated/nn/row_cover.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using op_util::options_like;

// The keys of one call: this rank's k and v, or a unit's packed rows in a block's buffer.
struct Keys {
  Tensor k, v;
  Selection sel;
  Tensor key_order;  // Hilbert order (use_hilbert) or undefined
};

Keys local_keys(const AttentionRunner& runner, const LocalCall& call, const Tensor& k,
                const Tensor& v) {
  return {k, v, call.k, runner.key_order(call.k.count, k.device())};
}

// The keys of `call` in block src's packed rows of `group`'s units, held in `flat`.
Keys exchanged_keys(const AttentionRunner& runner, const RankPlan& plan, const LocalCall& call,
                    int src, const ExchangeGroup& group, const Tensor& flat) {
  const int unit = plan.unit_of(call);
  const ExchangeUnit& u = plan.units[static_cast<size_t>(unit)];
  auto [k, v] = packed_rows(plan, group, group.index_of(unit), flat, src);
  const Selection sel = in_unit(call.k, u.kv_heads, u.rows(plan.layout, src));
  return {k, v, sel, runner.key_order(sel.count, k.device())};
}

// Where a call's results go: out [B, C, H, D] and lse [B, H, C] tensors and the selection
// of the call's rows in them.
struct Target {
  Tensor out, lse;
  Selection sel;
};

// Batch row `row` of t (dim 0) for a call of one row (document masks), else t.
Tensor rows_of(const Tensor& t, int64_t row) { return row < 0 ? t : t.narrow(0, row, 1); }

AttentionForwardArgs forward_args(const AttentionRunner& runner, const RankLayout& layout,
                                  const Tensor& q, const LocalCall& call, const Keys& keys,
                                  const Target& to) {
  const char* op = runner.op();
  const int64_t row = call.batch_row;
  AttentionForwardArgs args;
  args.q = kernel_view(select_bnhd(rows_of(q, row), call.q), op);
  args.k = kernel_view(select_bnhd(rows_of(keys.k, row), keys.sel), op);
  args.v = kernel_view(select_bnhd(rows_of(keys.v, row), keys.sel), op);
  args.out = kernel_view(select_bnhd(rows_of(to.out, row), to.sel), op);
  args.lse = kernel_view(select_bhn(rows_of(to.lse, row), to.sel), op);
  // Numbered by global position: a piece of the call, or another split, draws its mask.
  const kernels::DropoutIndexing indexing =
      runner.dropout()
          ? block_dropout_indexing(call, {call.q_origin, call.q_origin},
                                   {call.k_origin, call.k_origin}, layout.seq_len(), layout.heads)
          : kernels::DropoutIndexing{};
  args.params = runner.call_params(call.pair, call.causal, indexing);
  args.params.shape_follows_data = row >= 0;  // a document piece (one batch row)
  if (row > 0 && runner.dropout()) {
    // A call of one batch row: its batch index 0 is row `row` of the numbering.
    args.params.dropout_indexing.base +=
        static_cast<uint64_t>(row) * static_cast<uint64_t>(indexing.batch_strides[0]);
  }
  if (keys.key_order.defined()) {
    args.params.key_order = static_cast<const int64_t*>(kernel_view(keys.key_order, op).data);
  }
  return args;
}

// A call's backward in pieces of whole segments of at most `piece_elements` q elements
// (AttentionCallContext::backward_piece_elements): cuDNN's backward takes a float32 dQ
// workspace twice the size of its q, which for one large call would sit on top of the
// memory peak. A grouped-query call's q counts every query head. The pieces are as large as
// the bound allows, the last one what is left: cuDNN's backward runs larger calls faster per
// element (H100: 10.0 us per segment and head at 256 of them, 10.3 at 192), so evening the
// pieces out cost more than a short last piece does. A piece numbers its dropout mask by
// global position, as the call does.
std::vector<LocalCall> backward_pieces(const LocalCall& call, const RankLayout& layout,
                                       int64_t piece_elements) {
  const int64_t query_heads = call.q.head_count * call.q.head_repeat;
  const int64_t per_segment = layout.batch * query_heads * call.q.count * layout.head_dim;
  if (per_segment * call.q.segments <= piece_elements) return {call};
  const int64_t segments_per_piece = std::max<int64_t>(1, piece_elements / per_segment);
  std::vector<LocalCall> pieces;
  for (int64_t first = 0; first < call.q.segments; first += segments_per_piece) {
    LocalCall piece = call;
    piece.q.first_position += first * call.q.segment_stride;
    piece.k.first_position += first * call.k.segment_stride;
    piece.q.segments = piece.k.segments = std::min(segments_per_piece, call.q.segments - first);
    pieces.push_back(piece);
  }
  return pieces;
}

// A unit's rows of this rank's result while other ranks' partials merge in: a float32
// (float64) accumulator and a view of the LSE, and scratch for one step's partial. Sized by
// the unit (its heads at its selected positions), never by the whole block.
struct UnitAcc {
  int unit = -1;
  RowRun rows;
  Tensor out, lse;            // [B, n, hc, D] accumulation dtype; [B, hc, n] view of the lse
  Tensor part_out, part_lse;  // q's dtype; the lse's dtype
};

// This rank's forward result as it is built. Head groups: the local calls write `out` (q's
// dtype) and `lse` in place. All heads: pairs merge into the float32 `acc_out`, converted
// into `out` at the end.
struct ForwardState {
  Tensor out, acc_out, lse;
  std::vector<UnitAcc> units;
  // All heads: a pair whose local calls write every row of every head (a rate-1 pair), whose
  // partial is copied into acc_out and lse instead of merged into zeros; -1 where none does.
  int covering_pair = -1;
};

UnitAcc& unit_acc(const RankPlan& plan, ForwardState& state, int unit, DType q_dtype) {
  for (UnitAcc& acc : state.units) {
    if (acc.unit == unit) return acc;
  }
  const RankLayout& l = plan.layout;
  const ExchangeUnit& u = plan.units[static_cast<size_t>(unit)];
  UnitAcc acc;
  acc.unit = unit;
  acc.rows = u.rows(l, l.rank);
  // Head groups start from the local calls' (rounded) rows; all heads merge in place.
  acc.out = plan.merged
                ? unit_rows(state.acc_out, u.heads, acc.rows)
                : unit_rows(state.out, u.heads, acc.rows).to(state.lse.dtype()).contiguous();
  acc.lse = unit_stat(state.lse, u.heads, acc.rows);
  acc.part_out = empty({l.batch, acc.rows.count, u.heads.count, l.head_dim},
                       TensorOptions(q_dtype).with_device(state.lse.device()));
  acc.part_lse = empty({l.batch, u.heads.count, acc.rows.count}, options_like(state.lse));
  state.units.push_back(std::move(acc));
  return state.units.back();
}

// Head groups: zeroes `out` where no local call writes (positions no pair of a head's group
// selects); the calls write the rest (a document piece its batch row's). Remote partials
// merge into rows the calls wrote.
void zero_unwritten_out(const RankPlan& plan, Tensor out) {
  RowCover written(out.size(0), plan.layout.heads, plan.layout.rows_per_rank);
  for (const LocalCall& call : plan.local_calls) written.add(call.q, call.batch_row);
  written.zero_rest(out);
}

// All heads: the first pair whose local calls write every row of every head in every batch
// row (ForwardState::covering_pair), or -1.
int covering_pair(const RankPlan& plan, const Tensor& acc_out) {
  for (int pair = 0; pair < plan.num_pairs; ++pair) {
    RowCover written(acc_out.size(0), plan.layout.heads, plan.layout.rows_per_rank);
    for (const LocalCall& call : plan.local_calls) {
      if (call.pair == pair) written.add(call.q, call.batch_row);
    }
    if (written.covers_everything()) return pair;
  }
  return -1;
}

// A region of a [B, rows, H, D] tensor: heads and rows (unit_rows, unit_stat).
struct Region {
  Heads heads;
  RowRun rows;
};

// Heads first + stride * a, a < count; a single head's stride is 1 (in_unit divides by it).
Heads run_of(int64_t first, int64_t stride, int64_t count) {
  return Heads{first, count == 1 ? 1 : stride, count};
}

// The query heads of a selection as one run (grouped-query blocks: head_repeat heads
// repeat_stride apart per key/value head, the blocks one after another), or none (count 0)
// where they are not one.
Heads query_head_run(const Selection& q) {
  if (q.head_repeat == 1) return run_of(q.first_head, q.head_stride, q.head_count);
  if (q.repeat_stride < 1 ||
      (q.head_count > 1 && q.head_stride != q.repeat_stride * q.head_repeat)) {
    return Heads{};
  }
  return run_of(q.first_head, q.repeat_stride, q.head_count * q.head_repeat);
}

// All heads: the regions of the accumulator a pair's local calls write, one per set of query
// heads: the rows of its calls' residue (first_position mod rate), or every row where a call
// is not on one. The pair's merge runs over these alone (its partial holds 1/r of the rows;
// merged over every row, most of the merge went to finding the rows to skip). Every row and
// head as one region where the sets overlap but on rows of distinct residues.
std::vector<Region> merge_regions(const RankPlan& plan, int pair) {
  const int64_t rows = plan.layout.rows_per_rank;
  const std::vector<Region> whole = {{Heads{0, 1, plan.layout.heads}, RowRun{0, 1, rows}}};
  std::vector<Region> regions;
  for (const LocalCall& call : plan.local_calls) {
    if (call.pair != pair || call.q.empty()) continue;
    const Selection& q = call.q;
    Region region{query_head_run(q), RowRun{0, 1, rows}};
    if (region.heads.count == 0) return whole;
    if (q.rate > 1 && (q.segments == 1 || q.segment_stride % q.rate == 0)) {
      const int64_t first = q.first_position % q.rate;
      region.rows = RowRun{first, q.rate, (rows - first + q.rate - 1) / q.rate};
    }
    auto same = [&](const Region& r) {
      return r.heads.first == region.heads.first && r.heads.stride == region.heads.stride &&
             r.heads.count == region.heads.count && r.rows.first == region.rows.first &&
             r.rows.stride == region.rows.stride;
    };
    if (region.rows.count > 0 && std::none_of(regions.begin(), regions.end(), same)) {
      regions.push_back(region);
    }
  }
  auto shares_a_head = [](const Heads& x, const Heads& y) {
    for (int64_t a = 0; a < x.count; ++a) {
      const int64_t head = x.first + x.stride * a;
      if (head >= y.first && (head - y.first) % y.stride == 0 &&
          (head - y.first) / y.stride < y.count) {
        return true;
      }
    }
    return false;
  };
  for (size_t i = 0; i < regions.size(); ++i) {
    for (size_t j = i + 1; j < regions.size(); ++j) {
      const Region &x = regions[i], &y = regions[j];
      const bool distinct_residues =
          x.rows.stride == y.rows.stride && x.rows.stride > 1 && x.rows.first != y.rows.first;
      if (shares_a_head(x.heads, y.heads) && !distinct_residues) return whole;
    }
  }
  return regions;
}

// The calls on this rank's own keys, in place.
void local_forward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q, const Tensor& k,
                   const Tensor& v, ForwardState& state) {
  auto run = [&](const LocalCall& call, const Tensor& out, const Tensor& lse) {
    runner.forward(forward_args(runner, plan.layout, q, call, local_keys(runner, call, k, v),
                                {out, lse, call.q}));
  };
  // The calls `wanted` picks; document pieces as one call per group where a kernel takes it.
  auto run_calls = [&](const std::function<bool(const LocalCall&)>& wanted, const Tensor& out,
                       const Tensor& lse) {
    const PieceGroups calls = group_piece_calls(plan.local_calls, wanted);
    for (const LocalCall* call : calls.singles) run(*call, out, lse);
    for (const std::vector<const LocalCall*>& group : calls.groups) {
      if (forward_piece_group(runner, group, q, k, v, out, lse)) continue;
      for (const LocalCall* call : group) run(*call, out, lse);
    }
  };
  if (!plan.merged) {
    // Head groups: every (position, head) belongs to at most one call, which writes it.
    run_calls([](const LocalCall&) { return true; }, state.out, state.lse);
    return;
  }
  // All heads: each pair's partial in q's dtype (what every kernel, cuDNN included, writes;
  // rounded once), merged through the LSE into the float32 accumulator. The merge reads a
  // partial only in rows its calls wrote (finite lse), so only the lse is reset per pair. A
  // pair that writes every row goes first and is copied: merging it into an empty
  // accumulator would give its partial and lse exactly.
  Tensor part = empty(state.acc_out.shape(), options_like(q)), part_lse = empty_like(state.lse);
  std::vector<int> order;
  if (state.covering_pair >= 0) order.push_back(state.covering_pair);
  for (int pair = 0; pair < plan.num_pairs; ++pair) {
    if (pair != state.covering_pair) order.push_back(pair);
  }
  for (int pair : order) {
    const bool first_covers = pair == state.covering_pair;
    if (!first_covers) part_lse.fill_(kEmptyLse);
    run_calls([pair](const LocalCall& call) { return call.pair == pair; }, part, part_lse);
    if (first_covers) {
      state.acc_out.copy_(part);
      state.lse.copy_(part_lse);
      continue;
    }
    for (const Region& r : merge_regions(plan, pair)) {
      attention_merge_(unit_rows(state.acc_out, r.heads, r.rows),
                       unit_stat(state.lse, r.heads, r.rows), unit_rows(part, r.heads, r.rows),
                       unit_stat(part_lse, r.heads, r.rows));
    }
  }
}

// A unit's calls on block src's keys, re-based into the unit's own rows: query selections
// in this rank's rows of the unit (q, out and lse seen through unit_rows), key selections in
// the unit's packed rows. In these coordinates the unit's document pieces run as calls over
// pieces (piece_calls.h) on the exchanged keys.
struct UnitCalls {
  std::vector<LocalCall> rebased;       // parallel to `calls`
  std::vector<const LocalCall*> calls;  // the plan's own
  const LocalCall* original(const LocalCall* rebased_call) const {
    return calls[static_cast<size_t>(rebased_call - rebased.data())];
  }
};

// `calls` with their query selections in the rows `q_rows` of heads `q_heads` and their key
// selections in the rows `k_rows` of heads `k_heads` (in_unit).
UnitCalls rebased_calls(const std::vector<const LocalCall*>& calls, const Heads& q_heads,
                        const RowRun& q_rows, const Heads& k_heads, const RowRun& k_rows) {
  UnitCalls result{{}, calls};
  for (const LocalCall* call : calls) {
    LocalCall c = *call;
    c.q = in_unit(call->q, q_heads, q_rows);
    c.k = in_unit(call->k, k_heads, k_rows);
    result.rebased.push_back(c);
  }
  return result;
}

UnitCalls unit_calls(const RankPlan& plan, const std::vector<const LocalCall*>& calls, int unit,
                     int src) {
  const RankLayout& l = plan.layout;
  const ExchangeUnit& u = plan.units[static_cast<size_t>(unit)];
  return rebased_calls(calls, u.heads, u.rows(l, l.rank), u.kv_heads, u.rows(l, src));
}

// The calls on block src's keys of the units `group` exchanges, held in `flat`: per unit and
// key piece, one partial merged into the unit's accumulator. A unit's document pieces run as
// one call over pieces per group where a kernel takes it (cuDNN), else one call each.
void remote_forward(AttentionRunner& runner, const RankPlan& plan, int src, const Tensor& q,
                    const ExchangeGroup& group, const Tensor& flat, ForwardState& state) {
  const std::vector<LocalCall>& calls = plan.calls[static_cast<size_t>(src)];
  for (int unit : group.units) {
    const std::vector<const LocalCall*> mine = plan.calls_of_unit(calls, unit);
    if (mine.empty()) continue;
    UnitAcc& acc = unit_acc(plan, state, unit, q.dtype());
    const ExchangeUnit& u = plan.units[static_cast<size_t>(unit)];
    const UnitCalls unit_view = unit_calls(plan, mine, unit, src);
    const Tensor unit_q = unit_rows(q, u.heads, acc.rows);
    const auto [unit_k, unit_v] = packed_rows(plan, group, group.index_of(unit), flat, src);
    auto run_one = [&](const LocalCall& call) {
      const Keys keys = exchanged_keys(runner, plan, call, src, group, flat);
      runner.forward(
          forward_args(runner, plan.layout, q, call, keys,
                       {acc.part_out, acc.part_lse, in_unit(call.q, u.heads, acc.rows)}));
    };
    // One partial per key piece: within one the calls write disjoint query rows (a row
    // meets a piece in one segment per pair), across the two pieces of the zigzag layout
    // they may not.
    for (int piece = 0; piece < plan.layout.pieces(); ++piece) {
      const PieceGroups piece_calls = group_piece_calls(
          unit_view.rebased, [piece](const LocalCall& c) { return c.key_piece == piece; });
      if (piece_calls.singles.empty() && piece_calls.groups.empty()) continue;
      acc.part_lse.fill_(kEmptyLse);  // the merge skips rows left at -inf, unread
      for (const LocalCall* call : piece_calls.singles) run_one(*unit_view.original(call));
      for (const std::vector<const LocalCall*>& pieces : piece_calls.groups) {
        if (forward_piece_group(runner, pieces, unit_q, unit_k, unit_v, acc.part_out,
                                acc.part_lse)) {
          continue;
        }
        for (const LocalCall* call : pieces) run_one(*unit_view.original(call));
      }
      attention_merge_(acc.out, acc.lse, acc.part_out, acc.part_lse);
    }
  }
}

}  // namespace

RankAttention fixed_forward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q,
                            const Tensor& k, const Tensor& v, dist::Communicator* comm) {
  const RankLayout& l = plan.layout;
  const TensorOptions acc_opts =
      TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device());
  ForwardState state;
  const Shape out_shape{l.batch, l.rows_per_rank, l.heads, l.head_dim};
  state.lse = full({l.batch, l.heads, l.rows_per_rank}, kEmptyLse, acc_opts);
  if (plan.merged) {
    state.acc_out = empty(out_shape, acc_opts);
    state.covering_pair = covering_pair(plan, state.acc_out);
    if (state.covering_pair < 0) state.acc_out.zero_();
  } else {
    state.out = empty(out_shape, options_like(q));
    zero_unwritten_out(plan, state.out);
  }
  ExchangeVisitor visitor;
  visitor.local = [&] { local_forward(runner, plan, q, k, v, state); };
  visitor.visit = [&](int src, const ExchangeGroup& group, const Tensor& flat, const Tensor&) {
    remote_forward(runner, plan, src, q, group, flat, state);
  };
  exchange_keys(plan, k, v, comm, visitor);
  if (plan.merged) {
    state.out = state.acc_out.to(q.dtype()).contiguous();
  } else {
    for (const UnitAcc& acc : state.units) {
      unit_rows(state.out, plan.units[static_cast<size_t>(acc.unit)].heads, acc.rows)
          .copy_(acc.out);
    }
  }
  return {state.out, state.lse.contiguous()};
}

namespace {

// Whether [B, N, H, D] views of one storage share no element in the form of a packed
// projection's q, k and v: the same strides, each a band of heads within the same rows, the
// bands apart. Any other sharing (the same tensor passed twice) counts as overlapping.
bool disjoint_bands(std::vector<const Tensor*> views) {
  const Tensor& front = *views.front();
  const int64_t pitch = front.stride(1);
  std::sort(views.begin(), views.end(),
            [](const Tensor* x, const Tensor* y) { return x->offset() < y->offset(); });
  int64_t band_end = views.front()->offset();
  for (const Tensor* t : views) {
    if (t->dim() != 4 || t->strides() != front.strides() || t->size(0) != front.size(0) ||
        t->size(1) != front.size(1) || t->offset() < band_end) {
      return false;
    }
    band_end = t->offset() + (t->size(2) - 1) * t->stride(2) + (t->size(3) - 1) * t->stride(3) + 1;
  }
  return band_end - views.front()->offset() <= pitch;
}

// Empty tensors laid out exactly like `views`: the same shapes, strides and offsets from one
// another, in one buffer per storage the views share (q, k and v of one packed projection
// take one buffer of the projection's size). None where a view has a negative stride or
// repeats elements, where views of one storage overlap (disjoint_bands), or where the
// buffers would hold more than `max_elements`: scratch laid out so would alias.
std::vector<Tensor> laid_out_like(const std::vector<Tensor>& views, int64_t max_elements) {
  struct Extent {
    const Storage* storage;
    int64_t begin, end;
    std::vector<const Tensor*> views;
    Tensor buffer;
  };
  std::vector<Extent> extents;
  for (const Tensor& t : views) {
    int64_t end = t.offset() + 1;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.stride(d) < 0 || t.size(d) < 1) return {};
      end += (t.size(d) - 1) * t.stride(d);
    }
    if (!kernels::has_distinct_elements(kernel_view(t))) return {};
    auto it = std::find_if(extents.begin(), extents.end(),
                           [&](const Extent& e) { return e.storage == t.storage().get(); });
    if (it == extents.end()) {
      extents.push_back({t.storage().get(), t.offset(), end, {&t}, Tensor()});
    } else {
      it->begin = std::min(it->begin, t.offset());
      it->end = std::max(it->end, end);
      it->views.push_back(&t);
    }
  }
  int64_t elements = 0;
  for (const Extent& e : extents) {
    if (e.views.size() > 1 && !disjoint_bands(e.views)) return {};
    elements += e.end - e.begin;
  }
  if (elements > max_elements) return {};
  for (Extent& e : extents) e.buffer = empty({e.end - e.begin}, options_like(views.front()));
  std::vector<Tensor> laid;
  for (const Tensor& t : views) {
    const Extent& e = *std::find_if(extents.begin(), extents.end(), [&](const Extent& x) {
      return x.storage == t.storage().get();
    });
    laid.push_back(e.buffer.as_strided(t.shape(), t.strides(), t.offset() - e.begin));
  }
  return laid;
}

// Which local calls (head groups) may store their dK/dV rather than add them, in the order
// they run: a call of pair p stores into key/value heads that no call of another pair wrote
// before it. Calls of one pair write disjoint rows of a head (its segments, row pieces and
// document pieces do not overlap, and the pair's head group has one offset), so only another
// pair's writes (grouped-query attention: a key/value head whose query heads two head groups
// split) make a call add.
class KeyGradStores {
 public:
  explicit KeyGradStores(int64_t kv_heads) : writer_(static_cast<size_t>(kv_heads), kNone) {}

  // Whether `call` may store; records its pair as a writer of its key/value heads.
  bool may_store(const LocalCall& call) {
    bool store = true;
    for (int64_t t = 0; t < call.k.head_count; ++t) {
      int& writer = writer_[static_cast<size_t>(call.k.first_head + call.k.head_stride * t)];
      if (writer == kNone) {
        writer = call.pair;
      } else if (writer != call.pair) {
        writer = kSeveral;
      }
      store = store && writer == call.pair;
    }
    return store;
  }

 private:
  static constexpr int kNone = -1, kSeveral = -2;
  std::vector<int> writer_;  // per key/value head: the one pair that wrote it, or kNone/kSeveral
};

// Which gradients a call stores rather than adds (AttentionBackwardArgs' overwrite flags).
struct Stores {
  bool grad_q = false, grad_kv = false;
};

// The backward of one pass: runs each call's backward into the gradient buffers. Head groups:
// the local calls store q-dtype gradients in place (disjoint selections, zeroed elsewhere);
// contributions from and to other ranks accumulate in float32 per unit and are added once at
// the end. All heads: float32 gradients throughout.
class FixedBackward {
 public:
  FixedBackward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q, const Tensor& out,
                const Tensor& lse, const Tensor& grad_out, const Tensor& grad_lse,
                const GradBuffers& grads)
      : runner_(runner),
        plan_(plan),
        q_(q),
        out_(out),
        lse_(lse),
        grad_out_(grad_out),
        grad_lse_(grad_lse),
        grads_(grads) {}

  // The calls on this rank's own keys, in pieces (backward_pieces). They run first: the
  // buffers, uninitialized until now, are zeroed here except the rows the calls will store.
  // Groups of document pieces run first, as one call each where a kernel takes them (no lse
  // gradient); the calls of a group none takes run after the single calls, one by one.
  void local(const Tensor& k, const Tensor& v) {
    const PieceGroups calls =
        group_piece_calls(plan_.local_calls, [](const LocalCall&) { return true; });
    std::vector<const LocalCall*> singles = calls.singles;
    KeyGradStores stores(plan_.layout.kv_heads);
    std::vector<PieceGroupRun> groups;
    for (const std::vector<const LocalCall*>& group : calls.groups) {
      if (grad_lse_.defined()) {
        singles.insert(singles.end(), group.begin(), group.end());
      } else {
        groups.push_back(plan_piece_group(group, k, v, stores));
      }
    }
    std::vector<Stores> stored = single_stores(singles, stores);
    for (const PieceGroupRun& group : groups) {
      for (const HeadSetCalls& set : group.sets) {
        laid_budget_ = std::max(laid_budget_, compact_scratch_elements(set.region, group.store_q));
        laid_has_q_ = laid_has_q_ || !group.store_q;
      }
    }
    const bool region_stores = store_first_covering_group(groups, k);
    if (!region_stores) zero_unstored(groups, singles, stored);
    for (PieceGroupRun& group : groups) {
      const std::vector<const LocalCall*> left = run_piece_group(group, k, v);
      if (left.empty()) continue;
      if (group.stores_region) grads_.zero();  // it stored nothing: the calls add to zeros
      for (const LocalCall* call : left) {
        singles.push_back(call);
        stored.push_back(single_stores({call}, stores).front());
      }
    }
    laid_.clear();  // not held through the exchange's calls, which size their own
    for (size_t i = 0; i < singles.size(); ++i) {
      for (const LocalCall& piece :
           backward_pieces(*singles[i], plan_.layout, runner_.backward_piece_elements())) {
        run(piece, local_keys(runner_, piece, k, v), grads_.qkv[0], piece.q, grads_.qkv[1],
            grads_.qkv[2], stored[i]);
      }
    }
  }

  // The calls on block src's packed rows of `group`; their dK/dV go into `key_grads`.
  void remote(int src, const ExchangeGroup& group, const Tensor& flat, const Tensor& key_grads) {
    const RankLayout& l = plan_.layout;
    for (int unit : group.units) {
      const ExchangeUnit& u = plan_.units[static_cast<size_t>(unit)];
      const RowRun rows = u.rows(l, l.rank);
      const std::vector<const LocalCall*> calls =
          plan_.calls_of_unit(plan_.calls[static_cast<size_t>(src)], unit);
      if (calls.empty()) continue;
      const size_t index = group.index_of(unit);
      auto [grad_k, grad_v] = packed_rows(plan_, group, index, key_grads, src);
      const std::vector<const LocalCall*> singles =
          remote_piece_groups(unit_calls(plan_, calls, unit, src),
                              packed_rows(plan_, group, index, flat, src), grad_k, grad_v);
      for (const LocalCall* call : singles) {
        const Keys keys = exchanged_keys(runner_, plan_, *call, src, group, flat);
        run(*call, keys, unit_dq(unit, rows), in_unit(call->q, u.heads, rows), grad_k, grad_v,
            Stores{});
      }
    }
  }

  // Adds the remote calls' dQ of each unit into this rank's dQ.
  void finish() {
    for (const auto& [unit, dq] : unit_dq_) {
      const ExchangeUnit& u = plan_.units[static_cast<size_t>(unit)];
      add_into(unit_rows(grads_.qkv[0], u.heads, u.rows(plan_.layout, plan_.layout.rank)), dq);
    }
  }

 private:
  // What each of the local single calls stores, in run order. Head groups: each call's dQ
  // rows are its own, its dK/dV too unless another pair shares its key/value heads
  // (grouped-query attention: KeyGradStores). All heads: every pair adds.
  std::vector<Stores> single_stores(const std::vector<const LocalCall*>& singles,
                                    KeyGradStores& stores) const {
    const bool head_groups = !plan_.merged;
    std::vector<Stores> stored;
    for (const LocalCall* call : singles) {
      stored.push_back({head_groups, head_groups && stores.may_store(*call)});
    }
    return stored;
  }

  // A group of document pieces (one pair, head set and heads) as one call over pieces, and
  // what it stores in place. Head groups: its dQ (q's dtype) in every case (directly, or its
  // calls one by one where no kernel takes the group); its dK/dV where `direct`: its pair
  // writes its key/value heads first (KeyGradStores) and a kernel takes the buffers as they
  // lie. What is not stored (all heads: every pair adds into float32 gradients) goes through
  // zeroed scratch in q's dtype, added after.
  // Where a group over pieces lies once re-based to its own query heads and rows and its own
  // key heads and rows, so that its scratch is sized by the group, not by the tensors it lies
  // in (views of a wider projection).
  struct GroupRegion {
    Heads q_heads, k_heads;
    RowRun q_rows, k_rows;
  };

  // The calls of one head set of a group (with full heads a group holds all its pair's head
  // sets of one head count) and their region.
  struct HeadSetCalls {
    std::vector<const LocalCall*> calls;
    GroupRegion region;
  };

  struct PieceGroupRun {
    const std::vector<const LocalCall*>* calls = nullptr;
    bool store_q = false, direct = false;
    bool stores_region = false;      // through scratch, stored over its whole region (first)
    std::vector<HeadSetCalls> sets;  // where not direct
  };

  // A group's calls by head set, in the order the sets first appear; with their regions where
  // `k` is given.
  std::vector<HeadSetCalls> head_sets_of(const std::vector<const LocalCall*>& group,
                                         const Tensor* k) const {
    std::vector<HeadSetCalls> sets;
    for (const LocalCall* call : group) {
      auto it = std::find_if(sets.begin(), sets.end(), [&](const HeadSetCalls& set) {
        return set.calls.front()->head_set == call->head_set;
      });
      if (it == sets.end()) {
        sets.push_back({{call}, {}});
      } else {
        it->calls.push_back(call);
      }
    }
    if (k != nullptr) {
      for (HeadSetCalls& set : sets) set.region = region_of(set.calls, *k);
    }
    return sets;
  }

  // Lets a group through scratch whose region is every row and head of q, k and v (all heads:
  // the rate-1 pair's document pieces) run first and store its scratch into the gradient
  // buffers (a conversion) instead of adding it to zeros: the buffers' zero fill and that
  // group's add go. Its scratch holds zeros where its pieces write nothing, which the other
  // calls then add to. True where such a group was found (and moved to the front).
  bool store_first_covering_group(std::vector<PieceGroupRun>& groups, const Tensor& k) const {
    auto covers = [&](const Heads& heads, const RowRun& rows, const Tensor& t) {
      return heads.first == 0 && heads.stride == 1 && heads.count == t.size(2) && rows.first == 0 &&
             rows.stride == 1 && rows.count == t.size(1);
    };
    for (size_t i = 0; i < groups.size(); ++i) {
      if (groups[i].direct || groups[i].store_q || groups[i].sets.size() != 1) continue;
      const GroupRegion& r = groups[i].sets.front().region;
      if (covers(r.q_heads, r.q_rows, q_) && covers(r.k_heads, r.k_rows, k)) {
        groups[i].stores_region = true;
        std::rotate(groups.begin(), groups.begin() + static_cast<std::ptrdiff_t>(i),
                    groups.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        return true;
      }
    }
    return false;
  }

  PieceGroupRun plan_piece_group(const std::vector<const LocalCall*>& group, const Tensor& k,
                                 const Tensor& v, KeyGradStores& stores) {
    PieceGroupRun run;
    run.calls = &group;
    run.store_q = !plan_.merged && grads_.qkv[0].dtype() == q_.dtype();
    // The calls of a head set share their pair and heads: one answer (and record) per set.
    // Every set records its writes, whatever the dtypes say.
    bool store_kv = !plan_.merged;
    if (store_kv) {
      for (const HeadSetCalls& set : head_sets_of(group, nullptr)) {
        store_kv = stores.may_store(*set.calls.front()) && store_kv;
      }
    }
    store_kv = store_kv && grads_.qkv[1].dtype() == q_.dtype();
    run.direct = run.store_q && store_kv &&
                 backward_piece_group_supported(runner_, group, q_, k, v, out_, lse_, grad_out_,
                                                grads_.qkv[0], grads_.qkv[1], grads_.qkv[2]);
    if (!run.direct) run.sets = head_sets_of(group, &k);
    return run;
  }

  // Zeroes the gradient buffers except the rows the calls will store: the groups' dQ rows
  // (PieceGroupRun) and their dK/dV rows where direct, the single calls' by `stored`
  // (parallel to `singles`), each in its batch row (a document piece's) or in all.
  void zero_unstored(const std::vector<PieceGroupRun>& groups,
                     const std::vector<const LocalCall*>& singles,
                     const std::vector<Stores>& stored) const {
    const int64_t batch = grads_.qkv[0].size(0), rows = plan_.layout.rows_per_rank;
    RowCover q_rows(batch, grads_.qkv[0].size(2), rows);
    RowCover kv_rows(batch, grads_.qkv[1].size(2), rows);
    auto cover = [&](const LocalCall& call, Stores s) {
      if (s.grad_q) q_rows.add(call.q, call.batch_row);
      if (s.grad_kv) kv_rows.add(without_repeat(call.k), call.batch_row);
    };
    for (const PieceGroupRun& group : groups) {
      for (const LocalCall* call : *group.calls) cover(*call, {group.store_q, group.direct});
    }
    for (size_t i = 0; i < singles.size(); ++i) cover(*singles[i], stored[i]);
    q_rows.zero_rest(grads_.qkv[0]);
    kv_rows.zero_rest(grads_.qkv[1]);
    kv_rows.zero_rest(grads_.qkv[2]);
  }

  // Runs a group of plan_piece_group as calls over pieces, directly into the gradients or
  // through scratch: through scratch laid out like q, k and v its head sets run as one call,
  // through compact scratch one call each. Returns the calls no kernel took, to run one by
  // one (none added anything).
  std::vector<const LocalCall*> run_piece_group(PieceGroupRun& run, const Tensor& k,
                                                const Tensor& v) {
    const std::vector<const LocalCall*>& group = *run.calls;
    if (run.direct) {
      if (backward_piece_group(runner_, group, q_, k, v, out_, lse_, grad_out_, grads_.qkv[0],
                               grads_.qkv[1], grads_.qkv[2])) {
        return {};
      }
      // The kernel that said it takes the group refused it when run (a graph cuDNN could not
      // build): the dK/dV rows left unzeroed for it to store are zeroed for the adds below.
      for (const LocalCall* call : group) {
        for (const Tensor& grad : {grads_.qkv[1], grads_.qkv[2]}) {
          select_bnhd(rows_of(grad, call->batch_row), without_repeat(call->k)).zero_();
        }
      }
      run.sets = head_sets_of(group, &k);
    }
    if (scratch_refused_) return group;
    const std::vector<Tensor>& like = laid_like(k, v);
    const bool laid = !like.empty() && (run.store_q || like[0].defined());
    if (laid && run.sets.size() > 1) {
      return sets_via_laid_scratch(run, k, v, like) ? std::vector<const LocalCall*>{} : group;
    }
    std::vector<const LocalCall*> left;
    for (const HeadSetCalls& set : run.sets) {
      if (!scratch_refused_ && set_via_scratch(set, run, k, v, laid)) continue;
      left.insert(left.end(), set.calls.begin(), set.calls.end());
    }
    return left;
  }

  // A group's head sets as one call over pieces on q, k and v as they lie, into the scratch
  // laid out like them (`like`): each set's region zeroed first, added (run.store_q: but dQ,
  // stored in place) after. False, with nothing added, where no kernel takes the group.
  bool sets_via_laid_scratch(const PieceGroupRun& run, const Tensor& k, const Tensor& v,
                             const std::vector<Tensor>& like) {
    for (const HeadSetCalls& set : run.sets) {
      const GroupRegion& r = set.region;
      if (!run.store_q) unit_rows(like[0], r.q_heads, r.q_rows).zero_();
      unit_rows(like[1], r.k_heads, r.k_rows).zero_();
      unit_rows(like[2], r.k_heads, r.k_rows).zero_();
    }
    const Tensor& dq = run.store_q ? grads_.qkv[0] : like[0];
    if (!backward_piece_group(runner_, *run.calls, q_, k, v, out_, lse_, grad_out_, dq, like[1],
                              like[2])) {
      scratch_refused_ = true;
      return false;
    }
    for (const HeadSetCalls& set : run.sets) {
      const GroupRegion& r = set.region;
      if (!run.store_q) {
        add_into(unit_rows(grads_.qkv[0], r.q_heads, r.q_rows),
                 unit_rows(like[0], r.q_heads, r.q_rows));
      }
      for (int i : {1, 2}) {
        add_into(unit_rows(grads_.qkv[i], r.k_heads, r.k_rows),
                 unit_rows(like[i], r.k_heads, r.k_rows));
      }
    }
    return true;
  }

  // One head set of a group through scratch (laid out like q, k and v where `laid`, else
  // compact), the set re-based to its region. False, with nothing added, where no kernel
  // takes it.
  bool set_via_scratch(const HeadSetCalls& set, const PieceGroupRun& run, const Tensor& k,
                       const Tensor& v, bool laid_scratch) {
    const GroupRegion& r = set.region;
    const UnitCalls unit_view = rebased_calls(set.calls, r.q_heads, r.q_rows, r.k_heads, r.k_rows);
    const UnitInputs in{
        unit_rows(q_, r.q_heads, r.q_rows),   unit_rows(out_, r.q_heads, r.q_rows),
        unit_stat(lse_, r.q_heads, r.q_rows), unit_rows(grad_out_, r.q_heads, r.q_rows),
        unit_rows(k, r.k_heads, r.k_rows),    unit_rows(v, r.k_heads, r.k_rows)};
    GradScratch laid;
    if (laid_scratch) {
      const std::vector<Tensor>& like = laid_like(k, v);
      laid = {like[0].defined() ? unit_rows(like[0], r.q_heads, r.q_rows) : Tensor(),
              unit_rows(like[1], r.k_heads, r.k_rows), unit_rows(like[2], r.k_heads, r.k_rows)};
    }
    const Tensor grad_q = unit_rows(grads_.qkv[0], r.q_heads, r.q_rows);
    return via_scratch(pointers_to(unit_view.rebased), in, laid, run.store_q ? grad_q : Tensor(),
                       {grad_q, unit_rows(grads_.qkv[1], r.k_heads, r.k_rows),
                        unit_rows(grads_.qkv[2], r.k_heads, r.k_rows)},
                       run.stores_region);
  }

  GroupRegion region_of(const std::vector<const LocalCall*>& group, const Tensor& k) const {
    const LocalCall& first = *group.front();
    GroupRegion r{query_head_run(first.q),
                  run_of(first.k.first_head, first.k.head_stride, first.k.head_count),
                  written_rows(group, &LocalCall::q, q_.size(1)),
                  written_rows(group, &LocalCall::k, k.size(1))};
    if (r.q_rows.stride != r.k_rows.stride) {  // one step for both sides' pieces
      r.q_rows = RowRun{0, 1, q_.size(1)};
      r.k_rows = RowRun{0, 1, k.size(1)};
    }
    return r;
  }

  // What via_scratch allocates for a group in compact scratch: dQ (unless stored in place),
  // dK and dV, and the copies of k and v that full heads need.
  int64_t compact_scratch_elements(const GroupRegion& r, bool store_q) const {
    const int64_t per_row = q_.size(0) * q_.size(3);
    const int64_t kv = r.k_heads.count * r.k_rows.count * per_row;
    return (store_q ? 0 : r.q_heads.count * r.q_rows.count * per_row) + 4 * kv;
  }

  // Scratch gradients laid out exactly like q, k and v (laid_out_like), made on first use in
  // this pass where they take no more memory than the largest group's compact scratch
  // (laid_budget_; all heads: the rate-1 pair's group spans every row and head): cuDNN's
  // ragged backward with full heads then runs on k and v as they lie instead of on copies.
  // Empty where they would take more.
  // q's part only where a group needs a dQ scratch (laid_has_q_); the q it returns is then
  // undefined.
  const std::vector<Tensor>& laid_like(const Tensor& k, const Tensor& v) {
    if (!laid_tried_) {
      laid_tried_ = true;
      laid_ = laid_out_like(laid_has_q_ ? std::vector<Tensor>{q_, k, v} : std::vector<Tensor>{k, v},
                            laid_budget_);
      if (!laid_.empty() && !laid_has_q_) laid_.insert(laid_.begin(), Tensor());
    }
    return laid_;
  }

  // The inputs of a group over pieces run through scratch, in its re-based coordinates: q,
  // out, lse and grad_out over its query heads and rows, k and v over its key heads and rows.
  struct UnitInputs {
    Tensor q, out, lse, grad_out, k, v;
  };

  // Scratch gradients of a group in q's dtype, shaped and laid out like its q, k and v.
  struct GradScratch {
    Tensor q, k, v;
  };

  // Runs `group` (re-based to `in`) into zeroed scratch in q's dtype, then adds the scratch
  // into `grads` (dQ, dK, dV shaped like in.q and in.k), or stores it there with `store`; dQ
  // goes straight into `store_q` where defined. The scratch is `laid` where defined (laid out
  // like in.q, in.k, in.v), else compact; cuDNN's ragged backward with full heads writes
  // dK/dV where k and v lie, so k and v then run from compact copies. False, with nothing
  // added, where no kernel takes the group; then no later group of this pass tries.
  bool via_scratch(const std::vector<const LocalCall*>& group, UnitInputs in,
                   const GradScratch& laid, const Tensor& store_q, const GradScratch& grads,
                   bool store = false) {
    GradScratch scratch = laid;
    if (scratch.k.defined()) {
      if (!store_q.defined()) scratch.q.zero_();
      scratch.k.zero_();
      scratch.v.zero_();
    } else {
      if (group.front()->q.head_repeat == 1) {
        // Strides exactly those of the zeros below (is_contiguous() allows any stride on a
        // size-1 dim, which would give k and its gradient different graph layouts).
        for (Tensor* t : {&in.k, &in.v}) {
          if (t->strides() != contiguous_strides(t->shape())) *t = t->clone();
        }
      }
      const TensorOptions opts = options_like(q_);
      scratch = {store_q.defined() ? Tensor() : zeros(in.q.shape(), opts),
                 zeros(in.k.shape(), opts), zeros(in.v.shape(), opts)};
    }
    const Tensor dq = store_q.defined() ? store_q : scratch.q;
    const Tensor &dk = scratch.k, &dv = scratch.v;
    if (!backward_piece_group(runner_, group, in.q, in.k, in.v, in.out, in.lse, in.grad_out, dq, dk,
                              dv)) {
      // No kernel takes calls over pieces in this pass (a forced flash or math path, dropout):
      // later groups go straight to single calls rather than allocate scratch again.
      scratch_refused_ = true;
      return false;
    }
    auto into = [store](const Tensor& grad, const Tensor& part) {
      if (store) {
        Tensor(grad).copy_(part);
      } else {
        add_into(grad, part);
      }
    };
    if (!store_q.defined()) into(grads.q, dq);
    into(grads.k, dk);
    into(grads.v, dv);
    return true;
  }

  static std::vector<const LocalCall*> pointers_to(const std::vector<LocalCall>& calls) {
    std::vector<const LocalCall*> pointers;
    for (const LocalCall& call : calls) pointers.push_back(&call);
    return pointers;
  }

  // The document pieces of a unit's calls on block src's keys (packed `keys`: k and v) as
  // calls over pieces where a kernel takes them: into zeroed q-dtype scratch, added after to
  // the unit's dQ and the packed dK/dV (which accumulate in float32 across blocks). Returns
  // the calls left to run one by one.
  std::vector<const LocalCall*> remote_piece_groups(const UnitCalls& unit_view,
                                                    const std::pair<Tensor, Tensor>& keys,
                                                    const Tensor& grad_k, const Tensor& grad_v) {
    if (grad_lse_.defined() || scratch_refused_) return unit_view.calls;
    const PieceGroups groups =
        group_piece_calls(unit_view.rebased, [](const LocalCall&) { return true; });
    std::vector<const LocalCall*> singles;
    for (const LocalCall* call : groups.singles) singles.push_back(unit_view.original(call));
    if (groups.groups.empty()) return singles;
    const int unit = plan_.unit_of(*unit_view.calls.front());
    for (const std::vector<const LocalCall*>& group : groups.groups) {
      // Pieces that share key rows (the zigzag layout's two query pieces) in separate calls.
      for (const std::vector<const LocalCall*>& part : split_shared_keys(group)) {
        if (!scratch_refused_ && remote_piece_group(unit, part, keys, grad_k, grad_v)) continue;
        for (const LocalCall* call : part) singles.push_back(unit_view.original(call));
      }
    }
    return singles;
  }

  // One group of remote_piece_groups (re-based calls of unit `unit`). False, with nothing
  // added, where no kernel takes it; then no later group of this pass tries.
  bool remote_piece_group(int unit, const std::vector<const LocalCall*>& group,
                          const std::pair<Tensor, Tensor>& keys, const Tensor& grad_k,
                          const Tensor& grad_v) {
    const ExchangeUnit& u = plan_.units[static_cast<size_t>(unit)];
    const RowRun rows = u.rows(plan_.layout, plan_.layout.rank);
    const UnitInputs in{unit_rows(q_, u.heads, rows),
                        unit_rows(out_, u.heads, rows),
                        unit_stat(lse_, u.heads, rows),
                        unit_rows(grad_out_, u.heads, rows),
                        keys.first,
                        keys.second};
    return via_scratch(group, in, GradScratch{}, Tensor(), {unit_dq(unit, rows), grad_k, grad_v});
  }

  // The rows of a block (of `block_rows`) that a group's calls write through selection
  // `side` (their q or k): those of its dilation's residue where every piece starts on it
  // (one pair's head group has one offset), else all.
  static RowRun written_rows(const std::vector<const LocalCall*>& group, Selection BlockCall::*side,
                             int64_t block_rows) {
    const Selection& front = group.front()->*side;
    const int64_t rate = front.rate;
    const int64_t first = front.first_position % rate;
    for (const LocalCall* call : group) {
      if ((call->*side).first_position % rate != first) return RowRun{0, 1, block_rows};
    }
    return RowRun{first, rate, (block_rows - first + rate - 1) / rate};
  }

  void run(const LocalCall& call, const Keys& keys, const Tensor& grad_q, const Selection& q_sel,
           const Tensor& grad_k, const Tensor& grad_v, Stores stored) {
    const AttentionForwardArgs fwd =
        forward_args(runner_, plan_.layout, q_, call, keys, {out_, lse_, call.q});
    const int64_t row = call.batch_row;
    const Tensor grad_out = select_bnhd(rows_of(grad_out_, row), call.q);
    const Tensor grad_lse =
        grad_lse_.defined() ? select_bhn(rows_of(grad_lse_, row), call.q) : Tensor();
    const Tensor dq = select_bnhd(rows_of(grad_q, row), q_sel);
    auto args_into = [&](const Tensor& into_k, const Tensor& into_v) {
      AttentionBackwardArgs args =
          backward_args(runner_.op(), fwd, grad_out, grad_lse, dq, into_k, into_v);
      args.overwrite_grads = stored.grad_q && stored.grad_kv;
      args.overwrite_grad_q = stored.grad_q;
      return args;
    };
    const AttentionBackwardArgs direct = args_into(select_bnhd(rows_of(grad_k, row), keys.sel),
                                                   select_bnhd(rows_of(grad_v, row), keys.sel));
    if (keys.sel.head_repeat == 1) {
      runner_.backward(fwd, direct);
      return;
    }
    // Grouped-query attention: head_repeat query heads read each key/value head through a
    // zero stride, and `direct` passes the gradients through the same zero stride. cuDNN sums
    // their dK/dV into the shared head itself; the other kernels would race on such
    // gradients, so each query head's dK/dV go to scratch, then add up into the shared head's
    // rows.
    if (runner_.backward_if_supported(fwd, direct)) return;
    const TensorOptions acc_opts =
        TensorOptions(accumulation_dtype(q_.dtype())).with_device(q_.device());
    const Shape key_shape = select_bnhd(rows_of(keys.k, row), keys.sel).shape();
    const Tensor scratch_k = zeros(key_shape, acc_opts), scratch_v = zeros(key_shape, acc_opts);
    runner_.backward(fwd, args_into(scratch_k, scratch_v));
    const Selection distinct = without_repeat(keys.sel);
    // Stored where the call stores (as cuDNN would), so a wrong decision shows here too.
    for (const auto& [grad, scratch] : {std::pair{&grad_k, &scratch_k}, {&grad_v, &scratch_v}}) {
      Tensor target = select_bnhd(rows_of(*grad, row), distinct);
      if (stored.grad_kv) {
        target.copy_(sum(*scratch, {3}));
      } else {
        add_into(target, sum(*scratch, {3}));
      }
    }
  }

  // dQ of this rank's rows of `unit` from remote keys, in the accumulation dtype.
  Tensor& unit_dq(int unit, const RowRun& rows) {
    for (auto& [id, dq] : unit_dq_) {
      if (id == unit) return dq;
    }
    const RankLayout& l = plan_.layout;
    const ExchangeUnit& u = plan_.units[static_cast<size_t>(unit)];
    const TensorOptions acc_opts =
        TensorOptions(accumulation_dtype(q_.dtype())).with_device(q_.device());
    unit_dq_.push_back({unit, zeros({l.batch, rows.count, u.heads.count, l.head_dim}, acc_opts)});
    return unit_dq_.back().second;
  }

  AttentionRunner& runner_;
  const RankPlan& plan_;
  const Tensor &q_, &out_, &lse_, &grad_out_, &grad_lse_;
  const GradBuffers& grads_;
  std::vector<std::pair<int, Tensor>> unit_dq_;
  bool scratch_refused_ = false;  // a group's call over pieces into scratch found no kernel
  int64_t laid_budget_ = 0;       // elements: the largest compact scratch of this pass's groups
  bool laid_tried_ = false;
  bool laid_has_q_ = false;   // a group through scratch needs a dQ scratch
  std::vector<Tensor> laid_;  // laid_like's q (or undefined), k and v, or empty
};

}  // namespace

void fixed_backward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                    const Tensor& grad_lse, dist::Communicator* comm, const GradBuffers& grads) {
  FixedBackward pass(runner, plan, q, out, lse, grad_out, grad_lse, grads);
  ExchangeVisitor visitor;
  visitor.backward = true;
  visitor.local = [&] { pass.local(k, v); };
  visitor.visit = [&](int src, const ExchangeGroup& group, const Tensor& flat,
                      const Tensor& key_grads) { pass.remote(src, group, flat, key_grads); };
  visitor.home = [&](const ExchangeGroup& group, const Tensor& mine) {
    unpack_key_grads(plan, group, mine, grads.qkv[1], grads.qkv[2]);
  };
  exchange_keys(plan, k, v, comm, visitor);
  pass.finish();
}

}  // namespace rd::nn
