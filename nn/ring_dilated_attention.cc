// Sequence-parallel dilated attention (see ring_dilated_attention.h, docs/distributed.md).
//
// Fixed variant. Rank `me` holds block me of the sequence. plan_block_calls gives, for every
// key block `src`, the attention calls between me's queries and src's keys. Calls with
// src == me read the local k and v in place. The other calls belong to "exchange units", one
// per (pair, head set) whose segments cross a block boundary: a unit's rows in a block are
// its heads at its selected positions (every position == offset mod r under the constant
// offset rule; the whole block under the rotating rule), and only those rows travel, packed
// into one flat buffer per block. Units go around the ring or are all-gathered. The local
// calls run exactly as on one device; each remote step's partials (q's dtype) merge into a
// float32 accumulator of the unit's rows through the log-sum-exp. The backward
// reruns the calls against the final (merged) out and lse, so each call yields exactly its
// share of the gradient; dK/dV of remote keys go back to their owners in float32.
//
// Global variant: every output row may read any key, so each head group all-gathers its
// heads of q, k and v, attends its own rows, and reduce-scatters the gradients.
#include "ringdilated/nn/ring_dilated_attention.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_path.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {

const char* strategy_name(DistStrategy strategy) {
  switch (strategy) {
    case DistStrategy::kRing: return "ring";
    case DistStrategy::kAllGather: return "all_gather";
    case DistStrategy::kAuto: return "auto";
  }
  return "?";
}

namespace {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using kernels::AttentionKernel;
using op_util::options_like;

constexpr const char* kOp = "ring_dilated_attention";
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// kAuto all-gathers a unit when the gathered copy of its rows is at most this many bytes per
// rank: then one collective's latency beats several ring steps, and holding all blocks costs
// little memory. Larger units go around the ring (bounded memory, overlapped transfers).
constexpr int64_t kAutoGatherMaxBytes = int64_t{4} << 20;

kernels::StridedView view_of(const Tensor& t) { return kernel_view(t, kOp); }

// Whether the zigzag layout would make pairs exchange keys that the contiguous one keeps
// local: segments that tile a rank's block but not its half (zigzag pieces of N / 2P).
// Splitting them would cost more traffic and ring steps than the balance gains (measured:
// N = 1M, P = 4, segments of N / P: 60% strong-scaling efficiency against 85%).
bool zigzag_splits_local_segments(const DilatedAttentionOptions& o, int64_t seq_len, int ranks) {
  if (o.variant == DilationVariant::kGlobal) return false;  // no segments to keep local
  const int64_t block = seq_len / ranks, piece = block / 2;
  for (int64_t length : o.segment_lengths) {
    const int64_t w = std::min(length, seq_len);
    const bool local_in_blocks = w <= block && block % w == 0;
    const bool local_in_pieces = w <= piece && piece % w == 0;
    if (local_in_blocks && !local_in_pieces) return true;
  }
  return false;
}

// resolve_layout, its errors naming `op`. `options` may be null for a layout that is not
// kAuto (then only the split is checked).
SequenceLayout resolve_layout_for(const char* op, SequenceLayout layout,
                                  const DilatedAttentionOptions* options, int64_t seq_len,
                                  int ranks) {
  RD_CHECK(ranks >= 1 && seq_len >= 0, kInvalidArgument, op, ": ", ranks,
           " ranks and a sequence of ", seq_len);
  RD_CHECK(seq_len % ranks == 0, kShapeMismatch, op, ": the sequence length ", seq_len,
           " does not split into ", ranks, " equal blocks (N % P = ", seq_len % ranks,
           "); pad the sequence or pick P dividing N");
  const int64_t pieces = 2 * static_cast<int64_t>(ranks);
  const bool zigzag_fits = seq_len % pieces == 0;
  if (layout == SequenceLayout::kAuto) {
    RD_CHECK(options != nullptr, kInvalidArgument, op, ": resolve kAuto first (resolve_layout)");
    const bool zigzag = options->causal && ranks > 1 && zigzag_fits &&
                        !zigzag_splits_local_segments(*options, seq_len, ranks);
    return zigzag ? SequenceLayout::kZigzag : SequenceLayout::kContiguous;
  }
  RD_CHECK(layout != SequenceLayout::kZigzag || zigzag_fits, kShapeMismatch, op,
           ": the zigzag layout needs 2P = ", pieces, " equal pieces, but the sequence length ",
           seq_len, " leaves N % 2P = ", seq_len % pieces,
           "; pad the sequence or use the contiguous layout");
  return layout;
}

// The sequence, its split among the ranks and the tensor dims every rank shares. A rank's
// rows are one piece of the sequence (contiguous layout) or two (zigzag: pieces r and
// 2P - 1 - r of 2P, in that order).
struct Layout {
  int64_t batch = 0, chunk = 0, heads = 0, dim = 0;  // chunk: rows per rank
  int rank = 0, size = 1;
  bool zigzag = false;
  int64_t seq_len() const { return chunk * size; }
  int pieces() const { return zigzag ? 2 : 1; }
  int64_t piece_len() const { return chunk / pieces(); }
  // Global positions of piece `j` of rank `r` (its rows [j * piece_len, + piece_len)).
  Block piece(int r, int j) const {
    const int64_t index = !zigzag ? r : (j == 0 ? r : 2 * size - 1 - r);
    return {index * piece_len(), (index + 1) * piece_len()};
  }
};

// Block-relative positions first, first + stride, ... (count of them).
struct Run {
  int64_t first = 0, stride = 1, count = 0;
};

// The rows of one (pair, head set) that other ranks' calls read: its heads at the positions
// of `stride` (r under the constant offset rule: exactly the positions == offset mod r are
// selected; 1 otherwise: the whole block).
struct ExchangeUnit {
  int pair = 0;
  Heads heads;
  int64_t offset = 0;
  int64_t stride = 1;
  bool gathered = false;  // all-gather rather than ring
  bool remote = false;    // some call reads another rank's block of this unit
  // The ranks that exchange it: the smallest g dividing P such that every call on this
  // unit reads a block of its own aligned run of g ranks [g * (rank / g), + g) (the ranks
  // sharing its segments). P when the segments do not align with the blocks.
  int span = 0;

  // The unit's rows among rank `r`'s rows: one arithmetic run, also over both pieces of the
  // zigzag layout (whose units keep stride r only where r divides the piece length).
  Run run(const Layout& l, int r) const {
    if (stride == 1) return {0, 1, l.chunk};
    const int64_t first = ((offset - l.piece(r, 0).begin) % stride + stride) % stride;
    return {first, stride, first < l.chunk ? (l.chunk - first + stride - 1) / stride : 0};
  }
};

// The [B, count, hc, D] rows of a unit in a [B, C, H, D] block tensor (a strided view).
Tensor unit_rows(const Tensor& t, const ExchangeUnit& u, const Run& run) {
  const Shape& st = t.strides();
  return t.as_strided({t.size(0), run.count, u.heads.hc, t.size(3)},
                      {st[0], run.stride * st[1], u.heads.hs * st[2], st[3]},
                      t.offset() + run.first * st[1] + u.heads.h0 * st[2]);
}

// A call's key selection (block coordinates) in the coordinates of a unit's packed rows.
Selection in_unit(const Selection& s, const ExchangeUnit& u, const Run& run) {
  Selection c = s;
  c.h0 = (s.h0 - u.heads.h0) / u.heads.hs;
  c.hs = s.hs / u.heads.hs;
  c.p0 = (s.p0 - run.first) / run.stride;
  c.ss = s.ss / run.stride;
  c.r = s.r / run.stride;
  return c;
}

// The units exchanged one way (ring or all-gather) and where each block's rows of each sit
// in that block's flat buffer: K rows at offsets[block][i], V rows right after.
struct ExchangeGroup {
  int span = 0;  // all-gathered units: the ranks of each gather group (ExchangeUnit::span)
  std::vector<int> units;
  std::vector<std::vector<int64_t>> offsets;  // [block][i]
  std::vector<int64_t> elements;              // [block]
  int64_t max_elements = 0;
  bool empty() const { return units.empty(); }
};

// A BlockCall between a query piece of this rank and a key piece of rank `src`, its
// selections moved from piece-relative to rank-local rows; q_origin and k_origin are the
// global positions of local row 0 as those selections see it (the dropout numbering).
struct LocalCall : BlockCall {
  int64_t q_origin = 0, k_origin = 0;
  int key_piece = 0;  // which of src's pieces the keys are in
};

struct SpPlan {
  Layout layout;
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

  int unit_of(const BlockCall& c) const {
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].pair == c.pair && units[u].heads.h0 == c.k.h0) return static_cast<int>(u);
    }
    RD_FAIL(kInternal, kOp, ": no exchange unit for pair ", c.pair, " head ", c.k.h0);
  }
};

int64_t unit_elements(const Layout& l, const ExchangeUnit& u, int rank) {
  return l.batch * u.run(l, rank).count * u.heads.hc * l.dim;
}

// The units that travel around the ring (span 0), or the all-gathered units of one span.
ExchangeGroup make_group(const Layout& l, const std::vector<ExchangeUnit>& units, int span) {
  ExchangeGroup g;
  g.span = span;
  for (size_t u = 0; u < units.size(); ++u) {
    const ExchangeUnit& unit = units[u];
    if (unit.remote && (span == 0 ? !unit.gathered : unit.gathered && unit.span == span)) {
      g.units.push_back(static_cast<int>(u));
    }
  }
  for (int b = 0; b < l.size; ++b) {
    std::vector<int64_t> offsets;
    int64_t at = 0;
    for (int u : g.units) {
      offsets.push_back(at);
      at += 2 * unit_elements(l, units[static_cast<size_t>(u)], b);
    }
    g.offsets.push_back(offsets);
    g.elements.push_back(at);
    g.max_elements = std::max(g.max_elements, at);
  }
  return g;
}

// The smallest g dividing `size` such that every (query block, key block) read stays within
// one aligned run of g ranks: the ranks that share the segments and so exchange its rows.
int exchange_span(const std::vector<std::pair<int, int>>& reads, int size) {
  for (int g = 2; g < size; ++g) {
    if (size % g != 0) continue;
    const bool aligned = std::all_of(reads.begin(), reads.end(), [g](const std::pair<int, int>& r) {
      return r.first / g == r.second / g;
    });
    if (aligned) return g;
  }
  return size;
}

// The calls between piece i of rank a's queries and piece j of rank b's keys, in the ranks'
// local rows.
std::vector<LocalCall> piece_calls(const DilatedAttentionOptions& o, const Layout& l, int a,
                                   int i, int b, int j) {
  const Block qb = l.piece(a, i), kb = l.piece(b, j);
  const int64_t q_shift = i * l.piece_len(), k_shift = j * l.piece_len();
  std::vector<LocalCall> result;
  for (const BlockCall& c : plan_block_calls(o, l.seq_len(), l.heads, qb, kb)) {
    LocalCall lc;
    static_cast<BlockCall&>(lc) = c;
    lc.q.p0 += q_shift;
    lc.k.p0 += k_shift;
    lc.q_origin = qb.begin - q_shift;
    lc.k_origin = kb.begin - k_shift;
    lc.key_piece = j;
    result.push_back(lc);
  }
  return result;
}

// Every rank plans every (query piece, key piece), so all agree on the units and the ring.
// Returns, per unit, the (query rank, key rank) of every call through it.
std::vector<std::vector<std::pair<int, int>>> plan_calls(const DilatedAttentionOptions& o,
                                                         SpPlan& plan) {
  const Layout& l = plan.layout;
  plan.calls.resize(static_cast<size_t>(l.size));
  std::vector<std::vector<std::pair<int, int>>> reads(plan.units.size());
  for (int a = 0; a < l.size; ++a) {
    for (int b = 0; b < l.size; ++b) {
      for (int i = 0; i < l.pieces(); ++i) {
        for (int j = 0; j < l.pieces(); ++j) {
          const bool same_piece = a == b && i == j;
          for (LocalCall& c : piece_calls(o, l, a, i, b, j)) {
            if (!same_piece) {
              const int unit = plan.unit_of(c);
              plan.units[static_cast<size_t>(unit)].remote = true;
              reads[static_cast<size_t>(unit)].push_back({a, b});
            }
            if (a != l.rank) continue;
            (same_piece ? plan.local_calls : plan.calls[static_cast<size_t>(b)]).push_back(c);
          }
        }
      }
    }
  }
  return reads;
}

// Ring or all-gather per exchanged unit, and the ring's span and steps.
void choose_exchange(const std::vector<std::vector<std::pair<int, int>>>& reads,
                     DistStrategy strategy, int64_t element_bytes, SpPlan& plan) {
  const Layout& l = plan.layout;
  std::vector<int> spans;
  for (size_t i = 0; i < plan.units.size(); ++i) {
    ExchangeUnit& u = plan.units[i];
    if (!u.remote) continue;
    u.span = exchange_span(reads[i], l.size);
    if (strategy == DistStrategy::kAuto) {
      int64_t largest = 0;
      for (int b = 0; b < l.size; ++b) largest = std::max(largest, unit_elements(l, u, b));
      u.gathered = 2 * largest * element_bytes * u.span <= kAutoGatherMaxBytes;
    } else {
      u.gathered = strategy == DistStrategy::kAllGather;
    }
    if (!u.gathered) plan.ring_span = std::lcm(plan.ring_span, u.span);
    if (u.gathered && std::find(spans.begin(), spans.end(), u.span) == spans.end()) {
      spans.push_back(u.span);
    }
  }
  for (size_t i = 0; i < plan.units.size(); ++i) {
    if (!plan.units[i].remote || plan.units[i].gathered) continue;
    for (auto [a, b] : reads[i]) {
      plan.ring_steps = std::max(plan.ring_steps, (a - b + plan.ring_span) % plan.ring_span);
    }
  }
  plan.ring = make_group(l, plan.units, /*span=*/0);
  std::sort(spans.begin(), spans.end());  // every rank visits the sub-groups in one order
  for (int span : spans) plan.gathers.push_back(make_group(l, plan.units, span));
}

SpPlan make_plan(const DilatedAttentionOptions& o, const Layout& l, DistStrategy strategy,
                 int64_t element_bytes) {
  SpPlan plan;
  plan.layout = l;
  plan.merged = o.mixing == HeadMixing::kAllHeads;
  plan.num_pairs = static_cast<int>(o.segment_lengths.size());
  for (int pair = 0; pair < static_cast<int>(o.segment_lengths.size()); ++pair) {
    const int64_t r = o.dilation_rates[static_cast<size_t>(pair)];
    // A unit's rows form one run over a rank's rows when r divides the zigzag pieces;
    // otherwise whole rows of its heads travel.
    const bool strided = o.offset_rule == OffsetRule::kConstant &&
                         (!l.zigzag || l.piece_len() % r == 0);
    for (const PairHeads& ph : fixed_pair_heads(o, l.heads, pair)) {
      plan.units.push_back({pair, ph.heads, ph.offset, strided ? r : 1});
    }
  }
  choose_exchange(plan_calls(o, plan), strategy, element_bytes, plan);
  return plan;
}

int gathered_units(const SpPlan& p) {
  int n = 0;
  for (const ExchangeGroup& g : p.gathers) n += static_cast<int>(g.units.size());
  return n;
}

// The communicator of this rank's gather group of `span` ranks: the whole group, or the
// sub-group of ranks [span * (rank / span), + span), split once and kept by `comm`. The
// color names the span too: ranks 0 and 1 are group 0 of spans 2 and 4 alike, and a cache
// keyed by rank / span alone would hand the span-4 call the span-2 group.
dist::Communicator& gather_comm(dist::Communicator& comm, int span) {
  if (span == comm.size()) return comm;
  return *comm.cached_split(span * comm.size() + comm.rank() / span, comm.rank());
}

// Bytes this rank has sent through `comm` and the sub-groups `p` gathers in.
int64_t bytes_sent(dist::Communicator& comm, const SpPlan& p) {
  int64_t bytes = comm.stats().bytes_sent;
  for (const ExchangeGroup& g : p.gathers) {
    if (g.span != comm.size()) bytes += gather_comm(comm, g.span).stats().bytes_sent;
  }
  return bytes;
}

// What a pass needs besides the plan: the kernel parameters and candidates.
struct Exec {
  std::shared_ptr<const SpPlan> plan;
  kernels::AttentionParams params;
  std::vector<AttentionKernel> kernels;
  bool forced = false;
  bool hilbert = false;
  PatternCache* patterns = nullptr;
  int64_t seq_len = 0;  // N, over every rank
  // With dropout: each pair's first Philox counter (every rank draws the same ones), and the
  // mask is numbered by global (batch, head, query, key) positions, as on one device.
  std::vector<uint64_t> pair_offsets;
};

// The keys of one call: the local block, or a unit's packed rows in a block's flat buffer.
struct Keys {
  Tensor k, v;
  Selection sel;
  Tensor key_order;  // Hilbert order (use_hilbert) or undefined
};

// The K and V of unit `u` of `group` in block `block`'s flat buffer (and the unit's run).
std::pair<Tensor, Tensor> packed_rows(const SpPlan& p, const ExchangeGroup& group, size_t i,
                                      const Tensor& flat, int block) {
  const Layout& l = p.layout;
  const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
  const int64_t n = u.run(l, block).count;
  const int64_t len = l.batch * n * u.heads.hc * l.dim;
  const int64_t at = group.offsets[static_cast<size_t>(block)][i];
  const Shape shape{l.batch, n, u.heads.hc, l.dim};
  return {flat.narrow(0, at, len).view(shape), flat.narrow(0, at + len, len).view(shape)};
}

size_t index_in_group(const ExchangeGroup& group, int unit) {
  return static_cast<size_t>(std::find(group.units.begin(), group.units.end(), unit) -
                             group.units.begin());
}

// Keys of call `c`: this rank's k and v (a local call: `group` is null), else src's rows of
// `group`'s units in the flat buffer `flat`.
Keys keys_of(const Exec& ex, const LocalCall& c, int src, const Tensor& k, const Tensor& v,
             const ExchangeGroup* group, const Tensor& flat) {
  const SpPlan& p = *ex.plan;
  Keys keys;
  if (group == nullptr) {
    keys = {k, v, c.k, Tensor()};
  } else {
    const int unit = p.unit_of(c);
    const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
    auto [kc, vc] = packed_rows(p, *group, index_in_group(*group, unit), flat, src);
    keys = {kc, vc, in_unit(c.k, u, u.run(p.layout, src)), Tensor()};
  }
  if (ex.hilbert) keys.key_order = hilbert_indices(*ex.patterns, keys.sel.n, keys.k.device());
  return keys;
}

// The [B, hc, count] view of a unit's rows in a [B, H, C] row statistic (an LSE).
Tensor unit_stat(const Tensor& t, const ExchangeUnit& u, const Run& run) {
  const Shape& st = t.strides();
  return t.as_strided({t.size(0), u.heads.hc, run.count},
                      {st[0], u.heads.hs * st[1], run.stride * st[2]},
                      t.offset() + u.heads.h0 * st[1] + run.first * st[2]);
}

// target += addend (float32 or float64 data), stored in target's dtype: one rounding when
// that is a 16-bit float.
void add_into(const Tensor& target, const Tensor& addend) {
  if (target.dtype() == addend.dtype()) {
    backend_for(target.device()).accumulate(view_of(target), view_of(addend));
  } else {
    target.detach().copy_(add(target.to(addend.dtype()), addend));
  }
}

// Where a call's results go: out [B, N, H, D] and lse [B, H, N] tensors and the selection of
// the call's rows in them.
struct Target {
  Tensor out, lse;
  Selection sel;
};

AttentionForwardArgs forward_args(const Exec& ex, const Tensor& q, const LocalCall& c,
                                  const Keys& keys, const Target& to) {
  AttentionForwardArgs a;
  a.q = view_of(select_bnhd(q, c.q));
  a.k = view_of(select_bnhd(keys.k, keys.sel));
  a.v = view_of(select_bnhd(keys.v, keys.sel));
  a.out = view_of(select_bnhd(to.out, to.sel));
  a.lse = view_of(select_bhn(to.lse, to.sel));
  a.params = ex.params;
  a.params.causal = c.causal;
  a.params.key_order =
      keys.key_order.defined() ? static_cast<const int64_t*>(view_of(keys.key_order).data) : nullptr;
  if (a.params.dropout > 0) {
    const Layout& l = ex.plan->layout;
    a.params.offset = ex.pair_offsets[static_cast<size_t>(c.pair)];
    a.params.dropout_indexing = block_dropout_indexing(c, {c.q_origin, c.q_origin},
                                                       {c.k_origin, c.k_origin}, l.seq_len(), l.heads);
  }
  return a;
}

AttentionKernel run_forward(const Exec& ex, const Tensor& q, const LocalCall& c, const Keys& keys,
                            const Target& to) {
  kernels::KernelBackend& backend = backend_for(q.device());
  const AttentionForwardArgs args = forward_args(ex, q, c, keys, to);
  return run_with_fallback(backend, ex.kernels, args, /*backward=*/nullptr, ex.forced, kOp,
                           [&](AttentionKernel kk) { backend.attention_forward(kk, args); });
}

// The calls of `calls` that read keys of unit `unit`.
std::vector<const LocalCall*> calls_of_unit(const SpPlan& p, const std::vector<LocalCall>& calls,
                                            int unit) {
  std::vector<const LocalCall*> result;
  for (const LocalCall& c : calls) {
    if (p.unit_of(c) == unit) result.push_back(&c);
  }
  return result;
}

// A unit's rows of this rank's result while other ranks' partials merge in: a float32
// (float64) accumulator and a view of the LSE, and scratch for one step's partial. Sized by
// the unit (its heads at its selected positions), never by the whole block.
struct UnitAcc {
  int unit = -1;
  Run rows;
  Tensor out, lse;            // [B, n, hc, D] accumulation dtype; [B, hc, n] view of the lse
  Tensor part_out, part_lse;  // q's dtype; the lse's dtype
};

// This rank's forward result as it is built. Head groups: the local calls write `out` (q's
// dtype) and `lse` in place, as on one device. All heads: pairs merge into the float32
// `acc_out` as on one device, converted into `out` at the end.
struct ForwardState {
  Tensor out, acc_out, lse;
  std::vector<UnitAcc> units;
  AttentionKernel slowest = AttentionKernel::kCudnn;
};

UnitAcc& unit_acc(const SpPlan& p, ForwardState& st, int unit, DType q_dtype) {
  for (UnitAcc& ua : st.units) {
    if (ua.unit == unit) return ua;
  }
  const Layout& l = p.layout;
  const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
  UnitAcc ua;
  ua.unit = unit;
  ua.rows = u.run(l, l.rank);
  // Head groups start from the local calls' (rounded) rows; all heads merge in place.
  ua.out = p.merged ? unit_rows(st.acc_out, u, ua.rows)
                    : unit_rows(st.out, u, ua.rows).to(st.lse.dtype()).contiguous();
  ua.lse = unit_stat(st.lse, u, ua.rows);
  const TensorOptions opts = TensorOptions(q_dtype).with_device(st.lse.device());
  ua.part_out = empty({l.batch, ua.rows.count, u.heads.hc, l.dim}, opts);
  ua.part_lse = empty({l.batch, u.heads.hc, ua.rows.count}, options_like(st.lse));
  st.units.push_back(std::move(ua));
  return st.units.back();
}

// The calls on this rank's own keys, exactly as dilated_attention runs them on one device.
void local_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v,
                   ForwardState& st) {
  const SpPlan& p = *ex.plan;
  const std::vector<LocalCall>& calls = p.local_calls;
  auto keys = [&](const LocalCall& c) { return keys_of(ex, c, p.layout.rank, k, v, nullptr, Tensor()); };
  if (!p.merged) {
    for (const LocalCall& c : calls) {
      st.slowest = slower(st.slowest, run_forward(ex, q, c, keys(c), {st.out, st.lse, c.q}));
    }
    return;
  }
  Tensor part = empty_like(st.out), part_lse = empty_like(st.lse);
  for (int pair = 0; pair < p.num_pairs; ++pair) {
    part.zero_();
    part_lse.fill_(kNegInf);
    for (const LocalCall& c : calls) {
      if (c.pair != pair) continue;
      st.slowest = slower(st.slowest, run_forward(ex, q, c, keys(c), {part, part_lse, c.q}));
    }
    attention_merge_(st.acc_out, st.lse, part, part_lse);
  }
}

// The calls on block `src`'s keys of the units `group` exchanges, held in `flat`: per unit,
// one partial merged into the unit's accumulator.
void remote_forward(const Exec& ex, int src, const Tensor& q, const ExchangeGroup& group,
                    const Tensor& flat, ForwardState& st) {
  const SpPlan& p = *ex.plan;
  const std::vector<LocalCall>& calls = p.calls[static_cast<size_t>(src)];
  for (int unit : group.units) {
    const std::vector<const LocalCall*> mine = calls_of_unit(p, calls, unit);
    if (mine.empty()) continue;
    UnitAcc& ua = unit_acc(p, st, unit, q.dtype());
    const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
    // One partial per key piece: within one the calls write disjoint query rows (a row
    // meets a piece in one segment per pair), across the two pieces of the zigzag layout
    // they may not.
    for (int piece = 0; piece < p.layout.pieces(); ++piece) {
      ua.part_out.zero_();
      ua.part_lse.fill_(kNegInf);
      bool any = false;
      for (const LocalCall* c : mine) {
        if (c->key_piece != piece) continue;
        const Keys keys = keys_of(ex, *c, src, Tensor(), Tensor(), &group, flat);
        st.slowest = slower(st.slowest, run_forward(ex, q, *c, keys,
                                                    {ua.part_out, ua.part_lse, in_unit(c->q, u, ua.rows)}));
        any = true;
      }
      if (any) attention_merge_(ua.out, ua.lse, ua.part_out, ua.part_lse);
    }
  }
}

// Copies this rank's rows of `group`'s units from k and v into `flat`.
void pack(const SpPlan& p, const ExchangeGroup& group, const Tensor& flat, const Tensor& k,
          const Tensor& v) {
  for (size_t i = 0; i < group.units.size(); ++i) {
    const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
    const Run mine = u.run(p.layout, p.layout.rank);
    auto [kc, vc] = packed_rows(p, group, i, flat, p.layout.rank);
    kc.copy_(unit_rows(k, u, mine));
    vc.copy_(unit_rows(v, u, mine));
  }
}

// Adds this rank's packed dK/dV rows of `group` (in `flat`) into grad_k and grad_v.
void unpack_add(const SpPlan& p, const ExchangeGroup& group, const Tensor& flat,
                const Tensor& grad_k, const Tensor& grad_v) {
  for (size_t i = 0; i < group.units.size(); ++i) {
    const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
    const Run mine = u.run(p.layout, p.layout.rank);
    auto [dk, dv] = packed_rows(p, group, i, flat, p.layout.rank);
    add_into(unit_rows(grad_k, u, mine), dk);
    add_into(unit_rows(grad_v, u, mine), dv);
  }
}

// The rank `delta` places after `rank` on its ring: the aligned run of `span` ranks that
// holds it, closed into a cycle.
int ring_peer(int rank, int delta, int span) {
  const int first = rank - rank % span;
  return first + ((rank - first + delta) % span + span) % span;
}

// The first `elements` of a flat buffer.
Tensor prefix(const Tensor& flat, int64_t elements) { return flat.narrow(0, 0, elements); }

// What a pass does with the exchanged rows: `local()` runs the calls on this rank's own
// keys; `visit(src, group, flat)` the calls on block src's packed rows of `group`'s units;
// the backward also gets, in `grads`, a float32 buffer laid out like `flat` for src's dK/dV,
// and `home(group, mine)` with this rank's own dK/dV once every rank has added to them.
struct ExchangeVisitor {
  std::function<void()> local;
  std::function<void(int src, const ExchangeGroup& group, const Tensor& flat, const Tensor& grads)> visit;
  std::function<void(const ExchangeGroup& group, const Tensor& mine)> home;
  bool backward = false;
};

// The dK/dV accumulators of the ring's blocks, one step behind their K/V: step t adds this
// rank's share of block (me - t) into a zeroed buffer while that block's accumulator, summed
// by the ranks before, is in flight from rank me - 1; then adds it in and sends the sum on to
// me + 1, so each transfer overlaps the next step's calls. Three buffers: the one being
// written, the one being sent and the one being received.
class GradientRing {
 public:
  // Only the buffer written first starts at zero: the others are sent or received into
  // before they are read, and zeroed when they become the one written.
  GradientRing(const SpPlan& p, dist::Communicator& comm, const TensorOptions& acc_opts)
      : p_(p),
        comm_(comm),
        work_(zeros({p.ring.max_elements}, acc_opts)),
        outgoing_(empty({p.ring.max_elements}, acc_opts)),
        incoming_(empty({p.ring.max_elements}, acc_opts)) {}

  // The buffer step t's calls add into.
  const Tensor& work() const { return work_; }

  // After step t's calls on block src: adds the accumulator that arrived for it (t > 0) and,
  // before the last step, sends the sum on and starts receiving next_src's.
  void pass_on(int t, int src, int next_src) {
    if (t > 0) {
      inflight_->wait();
      add_into(prefix(work_, length(src)), prefix(incoming_, length(src)));
    }
    if (t == p_.ring_steps) return;
    std::swap(outgoing_, work_);  // the old outgoing buffer was sent by the wait above
    inflight_ = comm_.isendrecv(prefix(outgoing_, length(src)), peer(1),
                                prefix(incoming_, length(next_src)), peer(-1));
    work_.zero_();
  }

  // After the last step: the last block's sums go back to its owner, and this rank's own
  // arrive from the rank that visited it last.
  Tensor finish() {
    if (p_.ring_steps == 0) return work_;  // only this rank's own rows were read
    const int owner = peer(-p_.ring_steps);
    dist::send_recv(comm_, prefix(work_, length(owner)), owner,
                    prefix(incoming_, length(p_.layout.rank)), peer(p_.ring_steps));
    return incoming_;
  }

 private:
  int peer(int delta) const { return ring_peer(p_.layout.rank, delta, p_.ring_span); }
  int64_t length(int block) const { return p_.ring.elements[static_cast<size_t>(block)]; }

  const SpPlan& p_;
  dist::Communicator& comm_;
  Tensor work_, outgoing_, incoming_;
  std::unique_ptr<dist::Request> inflight_;
};

// The ring: step t attends block (me - t) while block (me - t - 1) is in flight; step 0 is
// `local()` and this rank's own rows (the zigzag layout's calls between its pieces).
void ring_exchange(const Exec& ex, const Tensor& k, const Tensor& v, dist::Communicator& comm,
                   const ExchangeVisitor& visitor) {
  const SpPlan& p = *ex.plan;
  const int me = p.layout.rank;
  auto peer = [&](int delta) { return ring_peer(me, delta, p.ring_span); };
  auto length = [&](int block) { return p.ring.elements[static_cast<size_t>(block)]; };
  const bool ring = !p.ring.empty();
  Tensor cur, nxt;
  std::optional<GradientRing> grads;
  if (ring) {
    cur = empty({p.ring.max_elements}, options_like(k));
    nxt = empty({p.ring.max_elements}, options_like(k));
    pack(p, p.ring, prefix(cur, length(me)), k, v);
    if (visitor.backward) {
      grads.emplace(p, comm,
                    TensorOptions(accumulation_dtype(k.dtype())).with_device(k.device()));
    }
  }
  for (int t = 0; t <= p.ring_steps; ++t) {
    const int src = peer(-t), next_src = peer(-t - 1);
    std::unique_ptr<dist::Request> step;
    if (t < p.ring_steps) {
      step = comm.isendrecv(prefix(cur, length(src)), peer(1), prefix(nxt, length(next_src)),
                            peer(-1));
    }
    if (t == 0) visitor.local();
    if (ring) visitor.visit(src, p.ring, cur, grads ? grads->work() : Tensor());
    if (grads) grads->pass_on(t, src, next_src);
    if (!step) continue;
    step->wait();
    std::swap(cur, nxt);
  }
  if (grads) visitor.home(p.ring, grads->finish());
}

// The all-gathered units: each gather group's rows, visited block by block (this rank's
// own too: the zigzag layout's calls between its pieces); the backward reduce-scatters
// their dK/dV to their owners.
void gather_exchange(const Exec& ex, const Tensor& k, const Tensor& v, dist::Communicator& comm,
                     const ExchangeVisitor& visitor) {
  const SpPlan& p = *ex.plan;
  const int me = p.layout.rank;
  const TensorOptions acc_opts =
      TensorOptions(accumulation_dtype(k.dtype())).with_device(k.device());
  for (const ExchangeGroup& group : p.gathers) {
    dist::Communicator& gc = gather_comm(comm, group.span);
    const int first = me - gc.rank();  // the group's ranks: first, ..., first + span - 1
    Tensor mine = empty({group.max_elements}, options_like(k));
    pack(p, group, mine, k, v);
    Tensor all = empty({group.span, group.max_elements}, options_like(k));
    gc.all_gather(all, mine);
    const Tensor all_grads =
        visitor.backward ? zeros({group.span, group.max_elements}, acc_opts) : Tensor();
    for (int i = 0; i < group.span; ++i) {
      visitor.visit(first + i, group, all.select(0, i),
                    visitor.backward ? all_grads.select(0, i) : Tensor());
    }
    if (visitor.backward) {
      Tensor summed = empty({group.max_elements}, acc_opts);
      gc.reduce_scatter(summed, all_grads);
      visitor.home(group, summed);
    }
  }
}

// Every block this rank needs, the ring's then the all-gathered ones.
void exchange(const Exec& ex, const Tensor& k, const Tensor& v, dist::Communicator& comm,
              const ExchangeVisitor& visitor) {
  ring_exchange(ex, k, v, comm, visitor);
  gather_exchange(ex, k, v, comm, visitor);
}

// The forward of the fixed variant on this rank. Returns out (q's dtype) and lse.
ForwardState fixed_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v,
                           dist::Communicator& comm) {
  const SpPlan& p = *ex.plan;
  const Layout& l = p.layout;
  const TensorOptions acc_opts =
      TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device());
  ForwardState st;
  st.out = zeros({l.batch, l.chunk, l.heads, l.dim}, options_like(q));
  st.lse = full({l.batch, l.heads, l.chunk}, kNegInf, acc_opts);
  if (p.merged) st.acc_out = zeros(st.out.shape(), acc_opts);
  ExchangeVisitor visitor;
  visitor.local = [&] { local_forward(ex, q, k, v, st); };
  visitor.visit = [&](int src, const ExchangeGroup& group, const Tensor& flat, const Tensor&) {
    remote_forward(ex, src, q, group, flat, st);
  };
  exchange(ex, k, v, comm, visitor);
  if (p.merged) {
    st.out = st.acc_out.to(q.dtype());
  } else {
    for (const UnitAcc& ua : st.units) {
      unit_rows(st.out, p.units[static_cast<size_t>(ua.unit)], ua.rows).copy_(ua.out);
    }
  }
  return st;
}

struct QkvGrads {
  Tensor q, k, v;
};

// The gradients of q, k and v on this rank. Head groups: the local calls write q-dtype
// gradients in place (disjoint selections of zeros), as on one device; contributions from
// and to other ranks accumulate in float32 per unit and are added once at the end. All
// heads: float32 gradients throughout, as on one device.
QkvGrads fixed_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                        const Tensor& grad_lse, dist::Communicator& comm) {
  const SpPlan& p = *ex.plan;
  const Layout& l = p.layout;
  const int me = l.rank;
  const DType acc_dtype = accumulation_dtype(q.dtype());
  const TensorOptions acc_opts = TensorOptions(acc_dtype).with_device(q.device());
  const TensorOptions grad_opts = p.merged ? acc_opts : options_like(q);
  QkvGrads g{zeros(q.shape(), grad_opts), zeros(q.shape(), grad_opts), zeros(q.shape(), grad_opts)};
  kernels::KernelBackend& backend = backend_for(q.device());
  auto run_backward = [&](const LocalCall& c, const Keys& keys, const Tensor& gq,
                          const Selection& q_sel, const Tensor& gk, const Tensor& gv,
                          bool start_at_zero) {
    const AttentionForwardArgs fwd = forward_args(ex, q, c, keys, {out, lse, c.q});
    AttentionBackwardArgs b = backward_args(
        kOp, fwd, select_bnhd(grad_out, c.q),
        grad_lse.defined() ? select_bhn(grad_lse, c.q) : Tensor(), select_bnhd(gq, q_sel),
        select_bnhd(gk, keys.sel), select_bnhd(gv, keys.sel));
    b.grads_start_at_zero = start_at_zero;
    run_with_fallback(backend, ex.kernels, fwd, &b, ex.forced, kOp,
                      [&](AttentionKernel kk) { backend.attention_backward(kk, b); });
  };
  auto local = [&] {
    for (const LocalCall& c : p.local_calls) {
      run_backward(c, keys_of(ex, c, me, k, v, nullptr, Tensor()), g.q, c.q, g.k, g.v,
                   /*start_at_zero=*/!p.merged);
    }
  };
  // dQ of this rank's rows from remote keys, per unit, in the accumulation dtype.
  std::vector<std::pair<int, Tensor>> unit_dq;
  auto dq_of = [&](int unit, const Run& rows) -> Tensor& {
    for (auto& [id, dq] : unit_dq) {
      if (id == unit) return dq;
    }
    const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
    unit_dq.push_back({unit, zeros({l.batch, rows.count, u.heads.hc, l.dim}, acc_opts)});
    return unit_dq.back().second;
  };
  ExchangeVisitor remote;
  remote.backward = true;
  remote.local = local;
  remote.visit = [&](int src, const ExchangeGroup& group, const Tensor& flat, const Tensor& grads) {
    const std::vector<LocalCall>& calls = p.calls[static_cast<size_t>(src)];
    for (int unit : group.units) {
      const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
      const Run rows = u.run(l, me);
      for (const LocalCall* c : calls_of_unit(p, calls, unit)) {
        const Keys keys = keys_of(ex, *c, src, Tensor(), Tensor(), &group, flat);
        auto [gk, gv] = packed_rows(p, group, index_in_group(group, unit), grads, src);
        run_backward(*c, keys, dq_of(unit, rows), in_unit(c->q, u, rows), gk, gv,
                     /*start_at_zero=*/false);
      }
    }
  };
  remote.home = [&](const ExchangeGroup& group, const Tensor& mine) {
    unpack_add(p, group, mine, g.k, g.v);
  };
  exchange(ex, k, v, comm, remote);
  for (const auto& [unit, dq] : unit_dq) {
    const ExchangeUnit& u = p.units[static_cast<size_t>(unit)];
    add_into(unit_rows(g.q, u, u.run(l, me)), dq);
  }
  return g;
}

// ---------------------------------------------------------------------------------------
// The global (original) variant.

// P[j] = o + r * (j mod |base|), base = (o, o + r, ... < N), for j in [begin, end).
Tensor cycled_rows(int64_t seq_len, int64_t r, int64_t o, int64_t begin, int64_t end,
                   Device device) {
  const int64_t base = (seq_len - o + r - 1) / r;
  std::vector<int64_t> rows;
  for (int64_t j = begin; j < end; ++j) rows.push_back(o + r * (j % base));
  return from_vector<int64_t>(rows, {end - begin}).to(device);
}

// One head group's share of the global variant for one piece of this rank's rows (two under
// the zigzag layout): its heads of q, k and v for the whole sequence (all-gathered), the
// cycled rows of the piece's queries and of the keys they may see, and the attention call
// between them.
struct GlobalGroup {
  int pair = 0;
  Heads heads;
  Tensor q_rows, key_rows;  // int64 indices into the full sequence
  int64_t causal_offset = 0;  // the global position of the piece's first row
  int64_t local_row = 0;      // the piece's first row in this rank's tensors
};

std::vector<GlobalGroup> global_groups(const DilatedAttentionOptions& o, const Layout& l,
                                       Device device) {
  const int64_t pairs = static_cast<int64_t>(o.dilation_rates.size());
  const std::vector<Heads> groups = head_groups(l.heads, pairs, /*extra_to_first=*/false);
  std::vector<GlobalGroup> result;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = o.dilation_rates[static_cast<size_t>(i)], offset = i % r;
    for (int j = 0; j < l.pieces(); ++j) {
      const Block mine = l.piece(l.rank, j);
      // Causal: row j sees list entries m <= j only, so keys past the piece never count.
      const int64_t key_end = o.causal ? mine.end : l.seq_len();
      result.push_back({static_cast<int>(i), groups[static_cast<size_t>(i)],
                        cycled_rows(l.seq_len(), r, offset, mine.begin, mine.end, device),
                        cycled_rows(l.seq_len(), r, offset, 0, key_end, device), mine.begin,
                        j * l.piece_len()});
    }
  }
  return result;
}

// The whole sequence along `dim` from every rank's rows (blocks[r]: rank r's, in order).
Tensor join_blocks(const std::vector<Tensor>& blocks, const Layout& l, int64_t dim) {
  if (!l.zigzag) return cat(blocks, dim);
  std::vector<Tensor> pieces(static_cast<size_t>(2 * l.size));
  for (int r = 0; r < l.size; ++r) {
    for (int j = 0; j < 2; ++j) {
      pieces[static_cast<size_t>(l.piece(r, j).begin / l.piece_len())] =
          blocks[static_cast<size_t>(r)].narrow(dim, j * l.piece_len(), l.piece_len());
    }
  }
  return cat(pieces, dim);
}

// Rank r's rows, along `dim`, of a tensor over the whole sequence.
Tensor rank_rows(const Tensor& full, const Layout& l, int r, int64_t dim) {
  std::vector<Tensor> pieces;
  for (int j = 0; j < l.pieces(); ++j) {
    const Block b = l.piece(r, j);
    pieces.push_back(full.narrow(dim, b.begin, b.size()));
  }
  return pieces.size() == 1 ? pieces[0] : cat(pieces, dim);
}

// [B, N, hc, D] tensors of q, k and v of the group's heads over the whole sequence.
std::vector<Tensor> gather_group_heads(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Heads& h, const Layout& l, dist::Communicator& comm) {
  const Tensor mine = stack({q.narrow(2, h.h0, h.hc), k.narrow(2, h.h0, h.hc),
                             v.narrow(2, h.h0, h.hc)});  // [3, B, C, hc, D]
  Shape all_shape{l.size};
  for (int64_t d : mine.shape()) all_shape.push_back(d);
  Tensor all = empty(all_shape, TensorOptions(q.dtype()).with_device(q.device()));
  comm.all_gather(all, mine);
  // [P, 3, B, C, hc, D] -> 3 x [B, N, hc, D]
  std::vector<Tensor> blocks;
  for (int r = 0; r < l.size; ++r) blocks.push_back(all.select(0, r));
  const Tensor full = join_blocks(blocks, l, /*dim=*/2);
  return {full.select(0, 0), full.select(0, 1), full.select(0, 2)};
}

AttentionForwardArgs global_args(const Exec& ex, const GlobalGroup& g, const std::vector<Tensor>& qkv,
                                 const Tensor& out, const Tensor& lse, std::vector<Tensor>* keep) {
  keep->push_back(index_select(qkv[0], 1, g.q_rows).permute({0, 2, 1, 3}));
  keep->push_back(index_select(qkv[1], 1, g.key_rows).permute({0, 2, 1, 3}));
  keep->push_back(index_select(qkv[2], 1, g.key_rows).permute({0, 2, 1, 3}));
  if (ex.hilbert) keep->push_back(hilbert_indices(*ex.patterns, g.key_rows.numel(), out.device()));
  AttentionForwardArgs a;
  a.q = view_of((*keep)[0]);
  a.k = view_of((*keep)[1]);
  a.v = view_of((*keep)[2]);
  const int64_t rows = g.q_rows.numel();
  a.out = view_of(out.narrow(1, g.local_row, rows).narrow(2, g.heads.h0, g.heads.hc).permute({0, 2, 1, 3}));
  a.lse = view_of(lse.narrow(1, g.heads.h0, g.heads.hc).narrow(2, g.local_row, rows));
  a.params = ex.params;
  a.params.causal_offset = g.causal_offset;
  if (ex.hilbert) a.params.key_order = static_cast<const int64_t*>(view_of((*keep)[3]).data);
  if (a.params.dropout > 0) {
    a.params.offset = ex.pair_offsets[static_cast<size_t>(g.pair)];
    a.params.dropout_indexing = global_dropout_indexing(
        g.heads.h0, /*first_row=*/g.causal_offset, ex.seq_len, out.size(2));
  }
  return a;
}

struct GlobalForward {
  Tensor out, lse;
  AttentionKernel slowest = AttentionKernel::kCudnn;
};

// The global variant's forward: per pair, its head group gathered once over the whole
// sequence, then one call per piece of this rank's rows.
GlobalForward global_forward(const Exec& ex, const Layout& l, const std::vector<GlobalGroup>& groups,
                             const Tensor& q, const Tensor& k, const Tensor& v,
                             dist::Communicator& comm) {
  GlobalForward f;
  f.out = zeros(q.shape(), options_like(q));
  f.lse = full({l.batch, l.heads, l.chunk}, kNegInf,
               TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device()));
  kernels::KernelBackend& backend = backend_for(q.device());
  std::vector<Tensor> qkv;
  for (size_t i = 0; i < groups.size(); ++i) {
    const GlobalGroup& g = groups[i];
    if (i == 0 || groups[i - 1].pair != g.pair) qkv = gather_group_heads(q, k, v, g.heads, l, comm);
    std::vector<Tensor> keep;
    const AttentionForwardArgs args = global_args(ex, g, qkv, f.out, f.lse, &keep);
    f.slowest = slower(f.slowest, run_with_fallback(backend, ex.kernels, args, nullptr, ex.forced, kOp,
                                                    [&](AttentionKernel kk) { backend.attention_forward(kk, args); }));
  }
  return f;
}

// Adds one piece's gradients of q, k and v into `full_grads` [3, B, N, hc, D] (whole-sequence
// positions): its call's backward on the gathered rows, each row added back at its position.
void global_piece_backward(const Exec& ex, const Layout& l, const GlobalGroup& g,
                           const std::vector<Tensor>& qkv, const Tensor& out, const Tensor& lse,
                           const Tensor& grad_out, const Tensor& grad_lse, const Tensor& full_grads) {
  kernels::KernelBackend& be = backend_for(out.device());
  const TensorOptions acc = options_like(full_grads);
  std::vector<Tensor> keep;
  const AttentionForwardArgs fwd = global_args(ex, g, qkv, out, lse, &keep);
  const int64_t nq = g.q_rows.numel(), nk = g.key_rows.numel();
  const Shape q_shape{l.batch, g.heads.hc, nq, l.dim}, k_shape{l.batch, g.heads.hc, nk, l.dim};
  std::vector<Tensor> gathered{zeros(q_shape, acc), zeros(k_shape, acc), zeros(k_shape, acc)};
  AttentionBackwardArgs b = backward_args(
      kOp, fwd,
      grad_out.narrow(1, g.local_row, nq).narrow(2, g.heads.h0, g.heads.hc).permute({0, 2, 1, 3}),
      grad_lse.defined() ? grad_lse.narrow(1, g.heads.h0, g.heads.hc).narrow(2, g.local_row, nq)
                         : Tensor(),
      gathered[0], gathered[1], gathered[2]);
  b.grads_start_at_zero = true;
  run_with_fallback(be, ex.kernels, fwd, &b, ex.forced, kOp,
                    [&](AttentionKernel kk) { be.attention_backward(kk, b); });
  const Tensor* rows[3] = {&g.q_rows, &g.key_rows, &g.key_rows};
  for (int t = 0; t < 3; ++t) {
    be.index_add(view_of(full_grads.select(0, t)), 1, view_of(*rows[t]),
                 view_of(gathered[static_cast<size_t>(t)].permute({0, 2, 1, 3})));
  }
}

// The global variant's backward: per pair, every piece's gradients over the whole sequence,
// then one reduce-scatter that sums the ranks' shares and leaves each its own rows.
std::vector<Tensor> global_backward(const Exec& ex, const Layout& l,
                                    const std::vector<GlobalGroup>& groups,
                                    const std::vector<Tensor>& qkv_local, const Tensor& out,
                                    const Tensor& lse, const Tensor& grad_out,
                                    const Tensor& grad_lse, dist::Communicator& comm) {
  kernels::KernelBackend& be = backend_for(out.device());
  const TensorOptions acc = TensorOptions(accumulation_dtype(out.dtype())).with_device(out.device());
  std::vector<Tensor> result{zeros(out.shape(), acc), zeros(out.shape(), acc), zeros(out.shape(), acc)};
  for (size_t first = 0; first < groups.size();) {
    const GlobalGroup& g = groups[first];
    const std::vector<Tensor> qkv =
        gather_group_heads(qkv_local[0], qkv_local[1], qkv_local[2], g.heads, l, comm);
    const Tensor full_grads = zeros({3, l.batch, l.seq_len(), g.heads.hc, l.dim}, acc);
    size_t end = first;
    for (; end < groups.size() && groups[end].pair == g.pair; ++end) {
      global_piece_backward(ex, l, groups[end], qkv, out, lse, grad_out, grad_lse, full_grads);
    }
    // [3, B, N, hc, D] -> [P, 3, B, C, hc, D], rank-major for reduce_scatter.
    std::vector<Tensor> per_rank;
    for (int r = 0; r < l.size; ++r) per_rank.push_back(rank_rows(full_grads, l, r, 2));
    Tensor mine = empty({3, l.batch, l.chunk, g.heads.hc, l.dim}, acc);
    comm.reduce_scatter(mine, stack(per_rank));
    for (int t = 0; t < 3; ++t) {
      be.accumulate(view_of(result[static_cast<size_t>(t)].narrow(2, g.heads.h0, g.heads.hc)),
                    view_of(mine.select(0, t)));
    }
    first = end;
  }
  return result;
}

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                  const DilatedAttentionOptions& options, const dist::Communicator& comm,
                  const AttentionCallContext& context) {
  check_qkv_inputs(q, k, v, kOp, "this rank's block [B, N / P, H, D]");
  RD_CHECK(q.device() == comm.device(), kDeviceMismatch, kOp, ": q is on ", q.device().str(),
           " but the communicator (", comm.backend_name(), ") moves data on ",
           comm.device().str());
  validate_options(options, q.size(2));
  RD_CHECK(!(context.training && options.dropout > 0) || context.generator != nullptr,
           kInvalidArgument, kOp, ": dropout in training needs a generator in the call context");
}

// The forward of both public forms, and its one autograd node over `inputs`: q, k and v,
// or (packed) the qkv tensor they are selections of, whose gradient is then one tensor.
RingAttentionResult attend(const Tensor& q, const Tensor& k, const Tensor& v,
                           const std::vector<Tensor>& inputs, bool packed,
                           const DilatedAttentionOptions& options, dist::Communicator& comm,
                           DistStrategy strategy, const AttentionCallContext& context,
                           SequenceLayout layout) {
  RingAttentionResult result;
  if (comm.size() == 1) {  // one rank: exactly the single-device call, no communication
    result.attention = packed ? dilated_attention_qkv_with_lse(inputs[0], options, context)
                              : dilated_attention_with_lse(q, k, v, options, context);
    return result;
  }
  check_inputs(q, k, v, options, comm, context);
  const SequenceLayout resolved =
      resolve_layout_for(kOp, layout, &options, q.size(1) * comm.size(), comm.size());
  Layout l{q.size(0), q.size(1), q.size(2), q.size(3), comm.rank(), comm.size(),
           resolved == SequenceLayout::kZigzag};
  Exec ex;
  ex.params.scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(l.dim)));
  const AttentionPath requested = requested_path(options.path, kOp);
  ex.kernels = candidate_kernels(requested, q.device());
  ex.forced = requested != AttentionPath::kAuto;
  ex.hilbert = options.use_hilbert;
  ex.patterns = context.patterns != nullptr ? context.patterns : &global_pattern_cache();
  ex.seq_len = l.seq_len();
  if (context.training && options.dropout > 0) {
    ex.params.dropout = options.dropout;
    ex.params.seed = context.generator->seed();
    ex.pair_offsets = draw_dropout_pair_offsets(
        *context.generator, static_cast<int>(options.segment_lengths.size()), l.batch, l.heads,
        l.seq_len());
  }
  const Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  const bool grad = autograd::needs_grad(inputs);
  // The gradients of q, k and v (accumulation or q's dtype) as the node's input gradients.
  auto input_grads = [packed](std::vector<Tensor> g, DType dtype) {
    for (Tensor& t : g) t = t.to(dtype);
    return packed ? std::vector<Tensor>{stack(g, 2)} : g;
  };

  if (options.variant == DilationVariant::kSegmentLocal) {
    ex.params.causal = options.causal;
    ex.plan = std::make_shared<const SpPlan>(
        make_plan(options, l, strategy, static_cast<int64_t>(dtype_size(q.dtype()))));
    const int64_t before = bytes_sent(comm, *ex.plan);
    const ForwardState st = fixed_forward(ex, qd, kd, vd, comm);
    result.attention.out = st.out;
    result.attention.lse = st.lse.to(DType::kFloat32);
    result.attention.path_used = path_of(st.slowest);
    result.ring_steps = ex.plan->ring_steps;
    result.ring_pairs = static_cast<int>(ex.plan->ring.units.size());
    result.gathered_pairs = gathered_units(*ex.plan);
    result.forward_bytes_sent = bytes_sent(comm, *ex.plan) - before;
    if (grad) {
      autograd::record(
          {result.attention.out, result.attention.lse}, kOp, inputs,
          [ex, qd, kd, vd, input_grads, comm = &comm, out = result.attention.out.detach(),
           lse = st.lse.detach()](const std::vector<Tensor>& grads) {
            const Tensor grad_out =
                grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
            const Tensor grad_lse =
                grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
            QkvGrads g = fixed_backward(ex, qd, kd, vd, out, lse, grad_out, grad_lse, *comm);
            return input_grads({g.q, g.k, g.v}, out.dtype());
          });
    }
  } else {
    const std::vector<GlobalGroup> groups = global_groups(options, l, q.device());
    ex.params.causal = options.causal;
    const int64_t before = comm.stats().bytes_sent;
    GlobalForward fwd = global_forward(ex, l, groups, qd, kd, vd, comm);
    result.attention.out = fwd.out;
    result.attention.lse = fwd.lse.to(DType::kFloat32);
    result.attention.path_used = path_of(fwd.slowest);
    result.gathered_pairs = static_cast<int>(options.segment_lengths.size());
    result.forward_bytes_sent = comm.stats().bytes_sent - before;
    if (grad) {
      autograd::record(
          {result.attention.out, result.attention.lse}, kOp, inputs,
          [ex, groups, l, qd, kd, vd, input_grads, comm = &comm, out = fwd.out.detach(),
           lse = fwd.lse.detach()](const std::vector<Tensor>& grads) {
            const Tensor grad_out =
                grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
            const Tensor grad_lse =
                grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
            return input_grads(global_backward(ex, l, groups, {qd, kd, vd}, out, lse, grad_out,
                                               grad_lse, *comm),
                               out.dtype());
          });
    }
  }
  return result;
}

}  // namespace

RingAttentionResult ring_dilated_attention_with_lse(const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const DilatedAttentionOptions& options,
                                                    dist::Communicator& comm,
                                                    DistStrategy strategy,
                                                    const AttentionCallContext& context,
                                                    SequenceLayout layout) {
  return attend(q, k, v, {q, k, v}, false, options, comm, strategy, context, layout);
}

RingAttentionResult ring_dilated_attention_qkv_with_lse(const Tensor& qkv,
                                                        const DilatedAttentionOptions& options,
                                                        dist::Communicator& comm,
                                                        DistStrategy strategy,
                                                        const AttentionCallContext& context,
                                                        SequenceLayout layout) {
  RD_CHECK(qkv.defined() && qkv.dim() == 5 && qkv.size(2) == 3, kShapeMismatch, kOp,
           ": argument 'qkv' must be this rank's block [B, N / P, 3, H, D], got ",
           qkv.defined() ? shape_str(qkv.shape()) : std::string("undefined"));
  const Tensor base = qkv.detach();
  return attend(base.select(2, 0), base.select(2, 1), base.select(2, 2), {qkv}, true, options,
                comm, strategy, context, layout);
}

const char* layout_name(SequenceLayout layout) {
  switch (layout) {
    case SequenceLayout::kAuto: return "auto";
    case SequenceLayout::kContiguous: return "contiguous";
    case SequenceLayout::kZigzag: return "zigzag";
  }
  return "?";
}

SequenceLayout resolve_layout(SequenceLayout layout, const DilatedAttentionOptions& options,
                              int64_t seq_len, int ranks) {
  return resolve_layout_for("resolve_layout", layout, &options, seq_len, ranks);
}

std::vector<Block> sequence_pieces(SequenceLayout layout, int64_t seq_len, int rank, int size) {
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "sequence_pieces: rank ",
           rank, " is not in a group of ", size);
  const bool zigzag =
      resolve_layout_for("sequence_pieces", layout, nullptr, seq_len, size) == SequenceLayout::kZigzag;
  const Layout l{0, seq_len / size, 0, 0, rank, size, zigzag};
  std::vector<Block> pieces;
  for (int j = 0; j < l.pieces(); ++j) pieces.push_back(l.piece(rank, j));
  return pieces;
}

namespace {

// Pairs attended by the queries of `piece` in the global variant: query row p of a head
// group reads list entries m <= p under the causal mask, else all N.
int64_t global_piece_pairs(const DilatedAttentionOptions& o, int64_t seq_len, int64_t heads,
                           const Block& piece) {
  const std::vector<Heads> groups =
      head_groups(heads, static_cast<int64_t>(o.segment_lengths.size()), false);
  // sum of p + 1 over [begin, end), or N per row.
  const int64_t per_head = o.causal ? (piece.end * (piece.end + 1) - piece.begin * (piece.begin + 1)) / 2
                                    : piece.size() * seq_len;
  int64_t pairs = 0;
  for (const Heads& g : groups) pairs += per_head * g.hc;
  return pairs;
}

// Pairs attended by the calls of the fixed variant between two pieces.
int64_t fixed_piece_pairs(const DilatedAttentionOptions& o, int64_t seq_len, int64_t heads,
                          const Block& qb, const Block& kb) {
  int64_t pairs = 0;
  for (const BlockCall& c : plan_block_calls(o, seq_len, heads, qb, kb)) {
    const int64_t per_segment = c.causal ? c.q.n * (c.q.n + 1) / 2 : c.q.n * c.k.n;
    pairs += per_segment * c.q.segments * c.q.hc;
  }
  return pairs;
}

}  // namespace

std::vector<int64_t> attended_pairs_per_rank(const DilatedAttentionOptions& options,
                                             int64_t seq_len, int64_t num_heads, int ranks,
                                             SequenceLayout layout) {
  validate_options(options, num_heads);
  const SequenceLayout resolved =
      resolve_layout_for("attended_pairs_per_rank", layout, &options, seq_len, ranks);
  std::vector<std::vector<Block>> pieces;
  for (int r = 0; r < ranks; ++r) pieces.push_back(sequence_pieces(resolved, seq_len, r, ranks));
  std::vector<int64_t> work(static_cast<size_t>(ranks), 0);
  for (int a = 0; a < ranks; ++a) {
    for (const Block& qb : pieces[static_cast<size_t>(a)]) {
      if (options.variant == DilationVariant::kGlobal) {
        work[static_cast<size_t>(a)] += global_piece_pairs(options, seq_len, num_heads, qb);
        continue;
      }
      for (const std::vector<Block>& key_pieces : pieces) {
        for (const Block& kb : key_pieces) {
          work[static_cast<size_t>(a)] += fixed_piece_pairs(options, seq_len, num_heads, qb, kb);
        }
      }
    }
  }
  return work;
}

Tensor sequence_block(const Tensor& sequence, int rank, int size, SequenceLayout layout,
                      int64_t dim) {
  RD_CHECK(sequence.defined() && dim >= 0 && sequence.dim() > dim, kShapeMismatch,
           "sequence_block: argument 'sequence' must have the sequence in dim ", dim, ", got ",
           sequence.defined() ? shape_str(sequence.shape()) : std::string("undefined"));
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "sequence_block: rank ",
           rank, " is not in a group of ", size);
  const int64_t n = sequence.size(dim);
  const bool zigzag =
      resolve_layout_for("sequence_block", layout, nullptr, n, size) == SequenceLayout::kZigzag;
  return rank_rows(sequence, Layout{0, n / size, 0, 0, rank, size, zigzag}, rank, dim);
}

Tensor sequence_from_blocks(const std::vector<Tensor>& blocks, SequenceLayout layout,
                            int64_t dim) {
  RD_CHECK(!blocks.empty() && blocks[0].defined() && dim >= 0 && blocks[0].dim() > dim,
           kShapeMismatch, "sequence_from_blocks: needs every rank's block, the sequence in dim ",
           dim);
  const auto size = static_cast<int>(blocks.size());
  const int64_t chunk = blocks[0].size(dim);
  for (const Tensor& b : blocks) {
    RD_CHECK(b.defined() && b.shape() == blocks[0].shape(), kShapeMismatch,
             "sequence_from_blocks: every block must have the shape ", shape_str(blocks[0].shape()),
             ", got ", b.defined() ? shape_str(b.shape()) : std::string("undefined"));
  }
  const bool zigzag = resolve_layout_for("sequence_from_blocks", layout, nullptr, chunk * size,
                                         size) == SequenceLayout::kZigzag;
  return join_blocks(blocks, Layout{0, chunk, 0, 0, 0, size, zigzag}, dim);
}

Tensor ring_dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const DilatedAttentionOptions& options, dist::Communicator& comm,
                              DistStrategy strategy, const AttentionCallContext& context,
                              SequenceLayout layout) {
  return ring_dilated_attention_with_lse(q, k, v, options, comm, strategy, context, layout)
      .attention.out;
}

}  // namespace rd::nn
