// The fixed variant's plan for one rank (see rank_plan.h, docs/distributed.md).
#include "ringdilated/nn/rank_plan.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {

RowRun ExchangeUnit::rows(const RankLayout& l, int r) const {
  if (stride == 1) return {0, 1, l.rows_per_rank};
  const int64_t first = ((offset - l.piece(r, 0).begin) % stride + stride) % stride;
  return {first, stride,
          first < l.rows_per_rank ? (l.rows_per_rank - first + stride - 1) / stride : 0};
}

size_t ExchangeGroup::index_of(int unit) const {
  return static_cast<size_t>(std::find(units.begin(), units.end(), unit) - units.begin());
}

int RankPlan::unit_of(const BlockCall& c) const {
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].pair == c.pair && units[u].head_set == c.head_set) return static_cast<int>(u);
  }
  RD_FAIL(kInternal, "rank plan: no exchange unit for pair ", c.pair, " head set ", c.head_set);
}

int RankPlan::gathered_units() const {
  int n = 0;
  for (const ExchangeGroup& g : gathers) n += static_cast<int>(g.units.size());
  return n;
}

std::vector<const LocalCall*> RankPlan::calls_of_unit(const std::vector<LocalCall>& of,
                                                      int unit) const {
  std::vector<const LocalCall*> result;
  for (const LocalCall& c : of) {
    if (unit_of(c) == unit) result.push_back(&c);
  }
  return result;
}

// The [B, count, hc, D] rows of a unit in a [B, C, H, D] block tensor (a strided view).
Tensor unit_rows(const Tensor& t, const Heads& heads, const RowRun& run) {
  const Shape& st = t.strides();
  return t.as_strided({t.size(0), run.count, heads.count, t.size(3)},
                      {st[0], run.stride * st[1], heads.stride * st[2], st[3]},
                      t.offset() + run.first * st[1] + heads.first * st[2]);
}

// A call's key selection (block coordinates) in the coordinates of a unit's packed rows.
Selection in_unit(const Selection& s, const Heads& heads, const RowRun& run) {
  Selection c = s;
  c.first_head = (s.first_head - heads.first) / heads.stride;
  c.head_stride = s.head_stride / heads.stride;
  c.repeat_stride = s.repeat_stride / heads.stride;
  c.first_position = (s.first_position - run.first) / run.stride;
  c.segment_stride = s.segment_stride / run.stride;
  c.rate = s.rate / run.stride;
  return c;
}

namespace {

// kAuto all-gathers a unit when the gathered copy of its rows is at most this many bytes per
// rank: then one collective's latency beats several ring steps, and holding all blocks costs
// little memory. Larger units go around the ring (bounded memory, overlapped transfers).
constexpr int64_t kAutoGatherMaxBytes = int64_t{4} << 20;

int64_t unit_elements(const RankLayout& l, const ExchangeUnit& u, int rank) {
  return l.batch * u.rows(l, rank).count * u.kv_heads.count * l.head_dim;
}

// The units that travel around the ring (span 0), or the all-gathered units of one span.
ExchangeGroup make_group(const RankLayout& l, const std::vector<ExchangeUnit>& units, int span) {
  ExchangeGroup g;
  g.span = span;
  for (size_t u = 0; u < units.size(); ++u) {
    const ExchangeUnit& unit = units[u];
    if (unit.remote && (span == 0 ? !unit.gathered : unit.gathered && unit.span == span)) {
      g.units.push_back(static_cast<int>(u));
    }
  }
  for (int b = 0; b < l.ranks; ++b) {
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
std::vector<LocalCall> piece_calls(const DilatedAttentionOptions& o, const RankLayout& l, int a,
                                   int i, int b, int j,
                                   const std::vector<std::vector<int64_t>>* documents) {
  const Block qb = l.piece(a, i), kb = l.piece(b, j);
  const int64_t q_shift = i * l.piece_len(), k_shift = j * l.piece_len();
  std::vector<LocalCall> result;
  for (const BlockCall& c :
       plan_block_calls(o, l.seq_len(), l.heads, qb, kb, l.kv_group(), documents)) {
    LocalCall lc;
    static_cast<BlockCall&>(lc) = c;
    lc.q.first_position += q_shift;
    lc.k.first_position += k_shift;
    lc.q_origin = qb.begin - q_shift;
    lc.k_origin = kb.begin - k_shift;
    lc.key_piece = j;
    result.push_back(lc);
  }
  return result;
}

// A call of rank a on rank b's keys, and whether it runs in place: within one piece of a
// (its query rows get no other call of its pair and heads, so it writes them directly).
struct PlannedCall {
  LocalCall call;
  bool in_place = false;
};

bool same_selection(const Selection& x, const Selection& y) {
  return same_heads(x, y) && x.first_position == y.first_position &&
         x.segment_stride == y.segment_stride && x.segments == y.segments && x.rate == y.rate &&
         x.count == y.count;
}

// Whether y's positions continue x's (one segment each, same rate and heads): x then y is
// one arithmetic run of local rows.
bool continues(const Selection& x, const Selection& y) {
  return same_heads(x, y) && x.segments == 1 && y.segments == 1 && x.rate == y.rate &&
         y.first_position == x.first_position + x.count * x.rate;
}

Selection joined(Selection x, const Selection& y) {
  x.count += y.count;
  return x;
}

// Whether two calls serve the same pair, head set and batch rows.
bool same_target(const LocalCall& x, const LocalCall& y) {
  return x.pair == y.pair && x.head_set == y.head_set && x.batch_row == y.batch_row;
}

bool same_call_family(const PlannedCall& x, const PlannedCall& y) {
  return same_target(x.call, y.call) && x.in_place == y.in_place;
}

// x and y as one call when their rows continue each other: the queries of both pieces on
// the same keys, or one piece's queries on keys of both pieces (neither masked).
std::optional<PlannedCall> join_two(const PlannedCall& x, const PlannedCall& y) {
  if (!same_call_family(x, y) || x.call.causal || y.call.causal) return std::nullopt;
  PlannedCall result = x;
  if (x.call.key_piece == y.call.key_piece && same_selection(x.call.k, y.call.k) &&
      continues(x.call.q, y.call.q)) {
    result.call.q = joined(x.call.q, y.call.q);
    return result;
  }
  if (same_selection(x.call.q, y.call.q) && continues(x.call.k, y.call.k)) {
    result.call.k = joined(x.call.k, y.call.k);
    return result;
  }
  return std::nullopt;
}

// Zigzag layout, rank a on its own keys: the causal calls of its two pieces (queries and keys
// the same rows) and the second piece's queries on the first piece's keys are, since a
// rank's rows run in global order, one causal call over both pieces' rows, run in place.
bool join_diagonal(std::vector<PlannedCall>& calls) {
  for (size_t first = 0; first < calls.size(); ++first) {
    const PlannedCall& x = calls[first];
    if (!x.in_place || !x.call.causal) continue;
    for (size_t second = 0; second < calls.size(); ++second) {
      const PlannedCall& y = calls[second];
      if (second == first || !same_call_family(x, y) || !y.call.causal ||
          !continues(x.call.q, y.call.q) || !continues(x.call.k, y.call.k)) {
        continue;
      }
      const auto cross = std::find_if(calls.begin(), calls.end(), [&](const PlannedCall& z) {
        return !z.in_place && !z.call.causal && same_target(z.call, x.call) &&
               same_selection(z.call.q, y.call.q) && same_selection(z.call.k, x.call.k);
      });
      if (cross == calls.end()) continue;
      PlannedCall both = x;
      both.call.q = joined(x.call.q, y.call.q);
      both.call.k = joined(x.call.k, y.call.k);
      const size_t cross_at = static_cast<size_t>(cross - calls.begin());
      std::vector<PlannedCall> kept;
      for (size_t c = 0; c < calls.size(); ++c) {
        if (c != first && c != second && c != cross_at) kept.push_back(calls[c]);
      }
      kept.push_back(both);
      calls = std::move(kept);
      return true;
    }
  }
  return false;
}

// Fewer, larger calls under the zigzag layout: the piece-by-piece calls of a pair whose
// segments span both of a rank's pieces join where their rows continue (same results;
// larger calls fill the GPU better). Not with dropout (a joined call's global positions are
// not one run, which its mask numbering needs) or documents (calls split per document).
void join_piece_calls(std::vector<PlannedCall>& calls) {
  while (join_diagonal(calls)) {
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t x = 0; x < calls.size() && !changed; ++x) {
      for (size_t y = 0; y < calls.size() && !changed; ++y) {
        if (x == y) continue;
        if (std::optional<PlannedCall> both = join_two(calls[x], calls[y])) {
          calls[x] = *both;
          calls.erase(calls.begin() + static_cast<std::ptrdiff_t>(y));
          changed = true;
        }
      }
    }
  }
}

// The calls of rank a's queries on rank b's keys, over every (query piece, key piece).
std::vector<PlannedCall> rank_pair_calls(const DilatedAttentionOptions& o, const RankLayout& l,
                                         int a, int b,
                                         const std::vector<std::vector<int64_t>>* documents) {
  std::vector<PlannedCall> calls;
  for (int i = 0; i < l.pieces(); ++i) {
    for (int j = 0; j < l.pieces(); ++j) {
      for (LocalCall& c : piece_calls(o, l, a, i, b, j, documents)) {
        calls.push_back({c, a == b && i == j});
      }
    }
  }
  if (l.zigzag && o.dropout == 0.0 && documents == nullptr) join_piece_calls(calls);
  return calls;
}

// Every rank plans every (query rank, key rank), so all agree on the units and the ring.
// Returns, per unit, the (query rank, key rank) of every call through it.
std::vector<std::vector<std::pair<int, int>>> plan_calls(
    const DilatedAttentionOptions& o, RankPlan& plan,
    const std::vector<std::vector<int64_t>>* documents) {
  const RankLayout& l = plan.layout;
  plan.calls.resize(static_cast<size_t>(l.ranks));
  std::vector<std::vector<std::pair<int, int>>> reads(plan.units.size());
  for (int a = 0; a < l.ranks; ++a) {
    for (int b = 0; b < l.ranks; ++b) {
      for (PlannedCall& c : rank_pair_calls(o, l, a, b, documents)) {
        if (!c.in_place) {
          const int unit = plan.unit_of(c.call);
          plan.units[static_cast<size_t>(unit)].remote = true;
          reads[static_cast<size_t>(unit)].push_back({a, b});
        }
        if (a != l.rank) continue;
        (c.in_place ? plan.local_calls : plan.calls[static_cast<size_t>(b)]).push_back(c.call);
      }
    }
  }
  return reads;
}

// Ring or all-gather per exchanged unit, and the ring's span and steps.
void choose_exchange(const std::vector<std::vector<std::pair<int, int>>>& reads,
                     DistStrategy strategy, int64_t element_bytes, RankPlan& plan) {
  const RankLayout& l = plan.layout;
  std::vector<int> spans;
  for (size_t i = 0; i < plan.units.size(); ++i) {
    ExchangeUnit& u = plan.units[i];
    if (!u.remote) continue;
    u.span = exchange_span(reads[i], l.ranks);
    if (strategy == DistStrategy::kAuto) {
      int64_t largest = 0;
      for (int b = 0; b < l.ranks; ++b) largest = std::max(largest, unit_elements(l, u, b));
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

}  // namespace

RankPlan make_rank_plan(const DilatedAttentionOptions& o, const RankLayout& l,
                        DistStrategy strategy, int64_t element_bytes,
                        const std::vector<std::vector<int64_t>>* documents) {
  RankPlan plan;
  plan.layout = l;
  plan.merged = o.mixing == HeadMixing::kAllHeads;
  plan.num_pairs = static_cast<int>(o.segment_lengths.size());
  for (int pair = 0; pair < static_cast<int>(o.segment_lengths.size()); ++pair) {
    const int64_t r = o.dilation_rates[static_cast<size_t>(pair)];
    // A unit's rows form one run over a rank's rows when r divides the zigzag pieces;
    // otherwise whole rows of its heads travel.
    const bool strided =
        o.offset_rule == OffsetRule::kConstant && (!l.zigzag || l.piece_len() % r == 0);
    const std::vector<PairHeads> head_sets = fixed_pair_heads(o, l.heads, pair);
    for (size_t set = 0; set < head_sets.size(); ++set) {
      ExchangeUnit unit;
      unit.pair = pair;
      unit.heads = head_sets[set].heads;
      unit.offset = head_sets[set].offset;
      unit.stride = strided ? r : 1;
      unit.head_set = static_cast<int>(set);
      unit.kv_heads = kv_heads_of(unit.heads, l.kv_group());
      plan.units.push_back(unit);
    }
  }
  choose_exchange(plan_calls(o, plan, documents), strategy, element_bytes, plan);
  return plan;
}

// The K and V of unit `u` of `group` in block `block`'s flat buffer (and the unit's run).
std::pair<Tensor, Tensor> packed_rows(const RankPlan& p, const ExchangeGroup& group, size_t i,
                                      const Tensor& flat, int block) {
  const RankLayout& l = p.layout;
  const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
  const int64_t n = u.rows(l, block).count;
  const int64_t len = l.batch * n * u.kv_heads.count * l.head_dim;
  const int64_t at = group.offsets[static_cast<size_t>(block)][i];
  const Shape shape{l.batch, n, u.kv_heads.count, l.head_dim};
  return {flat.narrow(0, at, len).view(shape), flat.narrow(0, at + len, len).view(shape)};
}

// The [B, hc, count] view of a unit's rows in a [B, H, C] row statistic (an LSE).
Tensor unit_stat(const Tensor& t, const Heads& heads, const RowRun& run) {
  const Shape& st = t.strides();
  return t.as_strided({t.size(0), heads.count, run.count},
                      {st[0], heads.stride * st[1], run.stride * st[2]},
                      t.offset() + heads.first * st[1] + run.first * st[2]);
}

}  // namespace rd::nn
