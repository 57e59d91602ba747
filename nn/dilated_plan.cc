// The dilated-attention planner (see dilated_plan.h): head sets, whole-sequence selections
// and the calls between two blocks of a split sequence.
#include "ringdilated/nn/dilated_plan.h"

#include <algorithm>
#include <set>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/hilbert.h"

namespace rd::nn {

Tensor select_bnhd(const Tensor& t, const Selection& s) {
  const Shape& st = t.strides();
  const int64_t offset = t.offset() + s.first_head * st[2] + s.first_position * st[1];
  if (s.head_repeat == 1) {
    return t.as_strided(
        {t.size(0), s.segments, s.head_count, s.count, t.size(3)},
        {st[0], s.segment_stride * st[1], s.head_stride * st[2], s.rate * st[1], st[3]}, offset);
  }
  return t.as_strided({t.size(0), s.segments, s.head_count, s.head_repeat, s.count, t.size(3)},
                      {st[0], s.segment_stride * st[1], s.head_stride * st[2],
                       s.repeat_stride * st[2], s.rate * st[1], st[3]},
                      offset);
}

Tensor select_bhn(const Tensor& t, const Selection& s) {
  const Shape& st = t.strides();
  const int64_t offset = t.offset() + s.first_head * st[1] + s.first_position * st[2];
  if (s.head_repeat == 1) {
    return t.as_strided({t.size(0), s.segments, s.head_count, s.count},
                        {st[0], s.segment_stride * st[2], s.head_stride * st[1], s.rate * st[2]},
                        offset);
  }
  return t.as_strided({t.size(0), s.segments, s.head_count, s.head_repeat, s.count},
                      {st[0], s.segment_stride * st[2], s.head_stride * st[1],
                       s.repeat_stride * st[1], s.rate * st[2]},
                      offset);
}

bool same_heads(const Selection& x, const Selection& y) {
  return x.first_head == y.first_head && x.head_stride == y.head_stride &&
         x.head_count == y.head_count && x.head_repeat == y.head_repeat &&
         x.repeat_stride == y.repeat_stride;
}

Selection without_repeat(const Selection& s) {
  Selection distinct = s;
  distinct.head_repeat = 1;
  distinct.repeat_stride = 0;
  return distinct;
}

std::vector<HeadBlock> kv_head_blocks(const Heads& q, int64_t group) {
  if (q.count == 0) return {};
  if (q.stride % group == 0) {  // every query head has its own key/value head
    return {{q, 1, 0, q.first / group, q.stride / group}};
  }
  // The query heads that share each key/value head (non-decreasing in the head index).
  struct Share {
    int64_t first_head, count, kv;
  };
  std::vector<Share> shares;
  for (int64_t t = 0; t < q.count; ++t) {
    const int64_t head = q.first + q.stride * t, kv = head / group;
    if (!shares.empty() && shares.back().kv == kv) {
      ++shares.back().count;
    } else {
      shares.push_back({head, 1, kv});
    }
  }
  // Consecutive shares of one size on consecutive key/value heads: one block.
  std::vector<HeadBlock> blocks;
  for (const Share& share : shares) {
    if (!blocks.empty()) {
      // Blocks built here have q.stride = q.stride * repeat and kv_stride 1 from the start.
      HeadBlock& b = blocks.back();
      const int64_t next_head = b.q.first + b.q.stride * b.q.count;
      const int64_t next_kv = b.kv_first + b.q.count;
      if (share.count == b.repeat && share.first_head == next_head && share.kv == next_kv) {
        ++b.q.count;
        continue;
      }
    }
    blocks.push_back(
        {{share.first_head, q.stride * share.count, 1}, share.count, q.stride, share.kv, 1});
  }
  return blocks;
}

Heads kv_heads_of(const Heads& q, int64_t group) {
  if (q.count == 0) return {};
  if (q.stride % group == 0) return {q.first / group, q.stride / group, q.count};
  const int64_t first = q.first / group, last = (q.first + q.stride * (q.count - 1)) / group;
  return {first, 1, last - first + 1};
}

Tensor hilbert_indices(PatternCache& cache, int64_t n, Device device) {
  return cache.get(str_cat("hilbert/n=", n, "/", device.str()),
                   [&] { return from_vector<int64_t>(hilbert_order(n), {n}).to(device); });
}

std::vector<Heads> head_groups(int64_t num_heads, int64_t groups, bool extra_to_first) {
  std::vector<Heads> result;
  const int64_t base = num_heads / groups, extra = num_heads % groups;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const bool gets_extra = extra_to_first ? g < extra : g >= groups - extra;
    const int64_t count = base + (gets_extra ? 1 : 0);
    result.push_back({start, 1, count});
    start += count;
  }
  return result;
}

std::vector<Heads> heads_by_offset(int64_t num_heads, int64_t r) {
  std::vector<Heads> result;
  for (int64_t o = 0; o < std::min(r, num_heads); ++o) {
    result.push_back({o, r, (num_heads - o + r - 1) / r});
  }
  return result;
}

std::vector<PairHeads> fixed_pair_heads(const DilatedAttentionOptions& options, int64_t num_heads,
                                        int pair) {
  const int64_t pairs = static_cast<int64_t>(options.segment_lengths.size());
  const int64_t r = options.dilation_rates[static_cast<size_t>(pair)];
  std::vector<PairHeads> result;
  if (options.mixing == HeadMixing::kAllHeads) {
    for (const Heads& h : heads_by_offset(num_heads, r)) result.push_back({h, h.first});
  } else {
    result.push_back(
        {head_groups(num_heads, pairs, /*extra_to_first=*/true)[static_cast<size_t>(pair)],
         pair % r});
  }
  return result;
}

int64_t max_pairs_per_kv_head(const DilatedAttentionOptions& options, int64_t num_heads,
                              int64_t kv_group) {
  std::vector<std::set<int>> readers(static_cast<size_t>(num_heads / kv_group));
  for (int pair = 0; pair < static_cast<int>(options.segment_lengths.size()); ++pair) {
    for (const PairHeads& set : fixed_pair_heads(options, num_heads, pair)) {
      for (int64_t t = 0; t < set.heads.count; ++t) {
        readers[static_cast<size_t>((set.heads.first + set.heads.stride * t) / kv_group)].insert(
            pair);
      }
    }
  }
  size_t most = 0;
  for (const std::set<int>& pairs : readers) most = std::max(most, pairs.size());
  return static_cast<int64_t>(most);
}

int64_t segment_offset(const DilatedAttentionOptions& options, int64_t base, int64_t segment,
                       int64_t r) {
  return options.offset_rule == OffsetRule::kConstant ? base : (base + segment) % r;
}

int64_t selected_count(int64_t length, int64_t o, int64_t r) {
  return length > o ? (length - o + r - 1) / r : 0;
}

std::vector<Selection> fixed_selections(int64_t seq_len, int64_t w, int64_t r, const Heads& h,
                                        int64_t o, OffsetRule rule) {
  std::vector<Selection> out;
  const int64_t full = seq_len / w;
  auto add = [&](int64_t p0, int64_t ss, int64_t segments, int64_t n) {
    Selection s{h.first, h.stride, h.count, p0, ss, segments, r, n};
    if (!s.empty()) out.push_back(s);
  };
  if (rule == OffsetRule::kConstant) {
    add(o, w, full, w / r);
  } else {
    // Segment s uses (o + s) mod r: the segments c, c + r, c + 2r, ... share one offset.
    for (int64_t c = 0; c < std::min(r, full); ++c) {
      add(c * w + (o + c) % r, r * w, (full - c + r - 1) / r, w / r);
    }
  }
  if (seq_len % w != 0) {
    const int64_t start = full * w;
    const int64_t o_last = rule == OffsetRule::kConstant ? o : (o + full) % r;
    add(start + o_last, w, 1, selected_count(seq_len - start, o_last, r));
  }
  return out;
}

namespace {

// Selected positions first, first + r, ... (count of them) of one segment inside a block.
struct Run {
  int64_t first = 0, count = 0;
};

// The positions seg_start + o_s + r * t (< seg_start + seg_len) that lie in `block`.
Run clipped_run(int64_t seg_start, int64_t seg_len, int64_t o_s, int64_t r, Block block) {
  const int64_t start = seg_start + o_s;
  const int64_t lo = std::max(start, block.begin);
  const int64_t hi = std::min(seg_start + seg_len, block.end);
  if (lo >= hi) return {};
  const int64_t first = start + (lo - start + r - 1) / r * r;
  if (first >= hi) return {};
  return {first, (hi - first + r - 1) / r};
}

// Appends one segment's call, extending an earlier call of the same shape when the new
// segment continues its stride (so whole segments batch into one call, as on one device).
class CallBatcher {
 public:
  explicit CallBatcher(std::vector<BlockCall>* calls) : calls_(calls) {}

  void add(const BlockCall& call, int64_t offset_class) {
    for (Open& open : open_) {
      BlockCall& b = (*calls_)[open.index];
      if (open.offset_class != offset_class || b.pair != call.pair ||
          b.q.first_head != call.q.first_head || b.q.count != call.q.count ||
          b.k.count != call.k.count) {
        continue;
      }
      const int64_t dq = call.q.first_position - b.q.first_position,
                    dk = call.k.first_position - b.k.first_position;
      const bool extends = b.q.segments == 1 ? dq == dk && dq > 0
                                             : dq == dk && dq == b.q.segment_stride * b.q.segments;
      if (extends) {
        if (b.q.segments == 1) b.q.segment_stride = b.k.segment_stride = dq;
        ++b.q.segments;
        ++b.k.segments;
        return;
      }
      open.index = calls_->size();  // a new batch of this shape starts here
      calls_->push_back(call);
      return;
    }
    open_.push_back({calls_->size(), offset_class});
    calls_->push_back(call);
  }

 private:
  struct Open {
    size_t index;
    int64_t offset_class;
  };
  std::vector<BlockCall>* calls_;
  std::vector<Open> open_;
};

}  // namespace

namespace {

// A call's query and key selections for one head block, positions set by the caller.
void set_heads(const HeadBlock& block, Selection* q, Selection* k) {
  q->first_head = block.q.first;
  q->head_stride = block.q.stride;
  q->head_count = block.q.count;
  q->head_repeat = block.repeat;
  q->repeat_stride = block.repeat == 1 ? 0 : block.repeat_stride;
  k->first_head = block.kv_first;
  k->head_stride = block.kv_stride;
  k->head_count = block.q.count;
  k->head_repeat = block.repeat;
  k->repeat_stride = 0;
}

}  // namespace

namespace {

// Whether some row's document starts inside [begin, end) (after `begin`).
bool splits_documents(const std::vector<std::vector<int64_t>>* documents, int64_t begin,
                      int64_t end) {
  if (documents == nullptr) return false;
  for (const std::vector<int64_t>& starts : *documents) {
    const auto it = std::upper_bound(starts.begin(), starts.end(), begin);
    if (it != starts.end() && *it < end) return true;
  }
  return false;
}

// The documents of one row that meet [begin, end), each clipped to it.
std::vector<Block> document_pieces(const std::vector<int64_t>& starts, int64_t seq_len,
                                   int64_t begin, int64_t end) {
  std::vector<Block> pieces;
  for (size_t d = 0; d < std::max<size_t>(starts.size(), 1); ++d) {
    const int64_t ds = starts.empty() ? 0 : starts[d];
    const int64_t de = d + 1 < starts.size() ? starts[d + 1] : seq_len;
    const int64_t lo = std::max(ds, begin), hi = std::min(de, end);
    if (lo < hi) pieces.push_back({lo, hi});
  }
  return pieces;
}

Block intersect(Block a, Block b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

}  // namespace

std::vector<BlockCall> plan_block_calls(const DilatedAttentionOptions& options, int64_t seq_len,
                                        int64_t num_heads, Block qb, Block kb, int64_t kv_group,
                                        const std::vector<std::vector<int64_t>>* documents) {
  const bool diagonal = qb.begin == kb.begin && qb.end == kb.end;
  RD_CHECK(diagonal || qb.end <= kb.begin || kb.end <= qb.begin, kInvalidArgument,
           "plan_block_calls: blocks [", qb.begin, ", ", qb.end, ") and [", kb.begin, ", ", kb.end,
           ") must be equal or disjoint");
  RD_CHECK(kv_group >= 1 && num_heads % kv_group == 0, kInvalidArgument,
           "plan_block_calls: kv_group ", kv_group, " must divide the ", num_heads, " heads");
  std::vector<BlockCall> calls;
  if (qb.size() <= 0 || kb.size() <= 0) return calls;
  if (options.causal && kb.begin > qb.begin) return calls;  // keys all after the queries
  for (int pair = 0; pair < static_cast<int>(options.segment_lengths.size()); ++pair) {
    const int64_t w = options.segment_lengths[static_cast<size_t>(pair)];
    const int64_t r = options.dilation_rates[static_cast<size_t>(pair)];
    const int64_t s_lo = std::max(qb.begin, kb.begin) / w;
    const int64_t s_hi = (std::min(qb.end, kb.end) - 1) / w;
    const std::vector<PairHeads> head_sets = fixed_pair_heads(options, num_heads, pair);
    for (size_t set = 0; set < head_sets.size(); ++set) {
      const PairHeads& ph = head_sets[set];
      for (const HeadBlock& block : kv_head_blocks(ph.heads, kv_group)) {
        CallBatcher batcher(&calls);
        for (int64_t s = s_lo; s <= s_hi; ++s) {
          const int64_t start = s * w, length = std::min(w, seq_len - start);
          const int64_t o_s = segment_offset(options, ph.offset, s, r);
          // One call for every row, or (a segment some document starts inside) one per row
          // and document piece, never batched.
          auto add_call = [&](Block q_range, Block k_range, int64_t row) {
            const Run qr = clipped_run(start, length, o_s, r, q_range);
            const Run kr = clipped_run(start, length, o_s, r, k_range);
            if (qr.count == 0 || kr.count == 0) return;
            BlockCall call;
            call.q = {0, 1, 0, qr.first - qb.begin, 0, 1, r, qr.count};
            call.k = {0, 1, 0, kr.first - kb.begin, 0, 1, r, kr.count};
            set_heads(block, &call.q, &call.k);
            call.pair = pair;
            call.head_set = static_cast<int>(set);
            call.causal = options.causal && diagonal;
            call.batch_row = row;
            if (row < 0) {
              batcher.add(call, o_s);
            } else {
              calls.push_back(call);
            }
          };
          if (!splits_documents(documents, start, start + length)) {
            add_call(qb, kb, -1);
            continue;
          }
          for (size_t row = 0; row < documents->size(); ++row) {
            for (const Block& doc :
                 document_pieces((*documents)[row], seq_len, start, start + length)) {
              add_call(intersect(qb, doc), intersect(kb, doc), static_cast<int64_t>(row));
            }
          }
        }
      }
    }
  }
  return calls;
}

uint64_t dropout_counters_per_pair(int64_t batch, int64_t num_heads, int64_t seq_len) {
  uint64_t count = 1;
  for (int64_t factor : {batch, num_heads, seq_len, seq_len}) {
    RD_CHECK(factor >= 0, kInvalidArgument, "dilated_attention: dropout numbering of B = ", batch,
             ", H = ", num_heads, ", N = ", seq_len, " needs non-negative sizes");
    RD_CHECK(!__builtin_mul_overflow(count, static_cast<uint64_t>(factor), &count), kUnimplemented,
             "dilated_attention: dropout numbers B * H * N * N of B = ", batch, ", H = ", num_heads,
             ", N = ", seq_len, " pass 2^64 (one Philox counter each)");
  }
  return count;
}

std::vector<uint64_t> draw_dropout_pair_offsets(Generator& generator, int num_pairs, int64_t batch,
                                                int64_t num_heads, int64_t seq_len) {
  const uint64_t per_pair = dropout_counters_per_pair(batch, num_heads, seq_len);
  std::vector<uint64_t> offsets;
  for (int i = 0; i < num_pairs; ++i) offsets.push_back(generator.advance(per_pair));
  return offsets;
}

kernels::DropoutIndexing dropout_indexing(const Selection& q, const Selection& k, int64_t seq_len,
                                          int64_t num_heads) {
  RD_CHECK(
      q.head_count == k.head_count && q.head_repeat == k.head_repeat && q.segments == k.segments,
      kInvalidArgument,
      "dropout_indexing: q and k must select as many heads in the same blocks and "
      "segments, got ",
      q.head_count, " x ", q.head_repeat, " heads x ", q.segments, " and ", k.head_count, " x ",
      k.head_repeat, " x ", k.segments);
  // Elements are numbered by the QUERY head (a key/value head shared by several query heads
  // under grouped-query attention draws each query head's own mask). uint64 arithmetic
  // wraps around, as the kernels' does.
  const auto n = static_cast<uint64_t>(seq_len);
  const uint64_t head_stride = n * n;
  kernels::DropoutIndexing ix;
  ix.custom = true;
  ix.base = static_cast<uint64_t>(q.first_head) * head_stride +
            static_cast<uint64_t>(q.first_position) * n + static_cast<uint64_t>(k.first_position);
  ix.batch_strides[0] = static_cast<int64_t>(static_cast<uint64_t>(num_heads) * head_stride);
  ix.batch_strides[1] = static_cast<int64_t>(static_cast<uint64_t>(q.segment_stride) * n +
                                             static_cast<uint64_t>(k.segment_stride));
  ix.batch_strides[2] = static_cast<int64_t>(static_cast<uint64_t>(q.head_stride) * head_stride);
  if (q.head_repeat > 1) {
    ix.batch_strides[3] =
        static_cast<int64_t>(static_cast<uint64_t>(q.repeat_stride) * head_stride);
  }
  ix.row_stride = static_cast<int64_t>(static_cast<uint64_t>(q.rate) * n);
  ix.col_stride = k.rate;
  return ix;
}

kernels::DropoutIndexing block_dropout_indexing(const BlockCall& call, Block qb, Block kb,
                                                int64_t seq_len, int64_t num_heads) {
  Selection q = call.q, k = call.k;
  q.first_position += qb.begin;
  k.first_position += kb.begin;
  return dropout_indexing(q, k, seq_len, num_heads);
}

bool blocks_interact(const DilatedAttentionOptions& options, int64_t seq_len, int64_t num_heads,
                     Block qb, Block kb) {
  return !plan_block_calls(options, seq_len, num_heads, qb, kb).empty();
}

kernels::DropoutIndexing global_dropout_indexing(int64_t first_head, int64_t first_row,
                                                 int64_t seq_len, int64_t num_heads) {
  const auto n = static_cast<uint64_t>(seq_len), heads = static_cast<uint64_t>(num_heads);
  kernels::DropoutIndexing ix;
  ix.custom = true;
  ix.base = static_cast<uint64_t>(first_head) * n * n + static_cast<uint64_t>(first_row) * n;
  ix.batch_strides[0] = static_cast<int64_t>(heads * n * n);
  ix.batch_strides[1] = static_cast<int64_t>(n * n);
  ix.row_stride = static_cast<int64_t>(n);
  ix.col_stride = 1;
  return ix;
}

}  // namespace rd::nn
