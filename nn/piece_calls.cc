// Document pieces as one call (see piece_calls.h).
#include "ringdilated/nn/piece_calls.h"

#include <algorithm>
#include <functional>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/tensor/dispatch.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "dilated_attention";

// The stride between a selection's heads (1 for one head, whose stride says nothing).
int64_t head_step(const Selection& s) { return s.head_count == 1 ? 1 : s.head_stride; }

// A call with full heads: its keys' heads are its queries' (no grouped-query sharing).
bool full_heads(const LocalCall& c) {
  return c.q.head_repeat == 1 && c.k.head_repeat == 1 && c.q.first_head == c.k.first_head &&
         c.q.head_count == c.k.head_count && head_step(c.q) == head_step(c.k);
}

// Whether two calls can share a group: everything but their batch row and where their rows
// start and how many, and, with full heads, their head set: the head sets of one pair (all
// heads: one per offset, r of them at rate r) then run as one call, each piece at its own
// heads (AttentionPieces::q_head). Distinct head sets have distinct heads, so with full heads
// their pieces write distinct gradient rows; grouped-query head sets may share key/value
// heads, so each stays a group of its own.
bool one_group(const LocalCall& x, const LocalCall& y) {
  if (x.pair != y.pair || x.causal != y.causal || x.key_piece != y.key_piece ||
      x.q.rate != y.q.rate) {
    return false;
  }
  if (x.head_set == y.head_set && same_heads(x.q, y.q) && same_heads(x.k, y.k)) return true;
  return full_heads(x) && full_heads(y) && x.q.head_count == y.q.head_count &&
         head_step(x.q) == head_step(y.q);
}

// Grouped-query blocks group where their query heads are one run (each key/value head's
// query heads follow the previous one's), the layout cuDNN's grouped-query calls take.
bool groupable(const LocalCall& c) {
  const Selection& q = c.q;
  const bool one_run =
      q.head_repeat == 1 || q.head_count == 1 || q.head_stride == q.head_repeat * q.repeat_stride;
  return c.batch_row >= 0 && q.segments == 1 && c.k.segments == 1 && one_run;
}

// The heads a group's views start from: its calls' own where they share them, else (head
// sets of one pair) the lowest first query and key heads, each piece then at its own.
struct GroupHeads {
  Selection q, k;
  bool per_piece = false;
};

GroupHeads group_heads(const std::vector<const LocalCall*>& group) {
  GroupHeads heads{group.front()->q, group.front()->k};
  for (const LocalCall* c : group) {
    heads.per_piece = heads.per_piece || c->q.first_head != heads.q.first_head ||
                      c->k.first_head != heads.k.first_head;
  }
  if (!heads.per_piece) return heads;
  for (Selection* s : {&heads.q, &heads.k}) s->head_stride = head_step(*s);
  for (const LocalCall* c : group) {
    heads.q.first_head = std::min(heads.q.first_head, c->q.first_head);
    heads.k.first_head = std::min(heads.k.first_head, c->k.first_head);
  }
  return heads;
}

// The [B, hc, 1, D] view of t's heads of `sel` at position 0 ([B, hc, 1] for an lse [B, H, C];
// grouped-query selections [B, hc, repeat, 1, D] and [B, hc, repeat, 1]): where a call over
// pieces counts its rows from.
kernels::StridedView base_view(const Tensor& t, const Selection& sel, bool lse) {
  Selection base = sel;
  base.first_position = 0;
  base.segment_stride = 0;
  base.segments = 1;
  base.count = 1;
  return kernel_view((lse ? select_bhn(t, base) : select_bnhd(t, base)).select(1, 0), kOp);
}

kernels::AttentionPieces pieces_of(const std::vector<const LocalCall*>& group,
                                   const GroupHeads& heads) {
  kernels::AttentionPieces pieces;
  pieces.step = group.front()->q.rate;
  for (const LocalCall* c : group) {
    pieces.batch_row.push_back(c->batch_row);
    pieces.q_position.push_back(c->q.first_position);
    pieces.q_rows.push_back(c->q.count);
    pieces.k_position.push_back(c->k.first_position);
    pieces.k_rows.push_back(c->k.count);
    if (heads.per_piece) {
      pieces.q_head.push_back(c->q.first_head - heads.q.first_head);
      pieces.k_head.push_back(c->k.first_head - heads.k.first_head);
    }
  }
  if (heads.per_piece) {
    pieces.q_head_step = heads.q.head_stride;
    pieces.k_head_step = heads.k.head_stride;
  }
  return pieces;
}

kernels::AttentionForwardArgs forward_args(const AttentionRunner& runner,
                                           const std::vector<const LocalCall*>& group,
                                           const GroupHeads& heads,
                                           const kernels::AttentionPieces& pieces, const Tensor& q,
                                           const Tensor& k, const Tensor& v, const Tensor& out,
                                           const Tensor& lse) {
  const LocalCall& first = *group.front();
  kernels::AttentionForwardArgs args;
  args.q = base_view(q, heads.q, false);
  args.k = base_view(k, heads.k, false);
  args.v = base_view(v, heads.k, false);
  args.out = base_view(out, heads.q, false);
  args.lse = base_view(lse, heads.q, true);
  args.params = runner.call_params(first.pair, first.causal, {});
  args.pieces = &pieces;
  return args;
}

}  // namespace

PieceGroups group_piece_calls(const std::vector<LocalCall>& calls,
                              const std::function<bool(const LocalCall&)>& wanted) {
  PieceGroups result;
  // one_group is an equivalence (equal fields), so a call belongs to at most one group. A
  // plan lists a group's calls mostly one after another: the last group joined is tried
  // first, which keeps plans of thousands of pieces linear.
  size_t last = 0;
  for (const LocalCall& call : calls) {
    if (!wanted(call)) continue;
    if (!groupable(call)) {
      result.singles.push_back(&call);
      continue;
    }
    size_t g = last;
    if (g >= result.groups.size() || !one_group(*result.groups[g].front(), call)) {
      g = 0;
      while (g < result.groups.size() && !one_group(*result.groups[g].front(), call)) ++g;
      if (g == result.groups.size()) result.groups.emplace_back();
    }
    result.groups[g].push_back(&call);
    last = g;
  }
  return result;
}

std::vector<std::vector<const LocalCall*>> split_shared_keys(
    const std::vector<const LocalCall*>& group) {
  auto first_key = [](const LocalCall* c) { return c->k.first_position; };
  auto key_end = [](const LocalCall* c) {
    return c->k.first_position + (c->k.count - 1) * c->k.rate + 1;
  };
  std::vector<const LocalCall*> sorted = group;
  std::stable_sort(sorted.begin(), sorted.end(), [&](const LocalCall* x, const LocalCall* y) {
    return x->batch_row != y->batch_row ? x->batch_row < y->batch_row : first_key(x) < first_key(y);
  });
  // Sorted by row, then first key, a call overlaps a part's calls of its row exactly when it
  // starts before the farthest end among them.
  struct Part {
    std::vector<const LocalCall*> calls;
    int64_t row = -1, end = 0;
  };
  std::vector<Part> parts;
  for (const LocalCall* call : sorted) {
    size_t p = 0;
    while (p < parts.size() && parts[p].row == call->batch_row && parts[p].end > first_key(call)) {
      ++p;
    }
    if (p == parts.size()) parts.emplace_back();
    Part& part = parts[p];
    part.end = part.row == call->batch_row ? std::max(part.end, key_end(call)) : key_end(call);
    part.row = call->batch_row;
    part.calls.push_back(call);
  }
  std::vector<std::vector<const LocalCall*>> result;
  for (Part& part : parts) result.push_back(std::move(part.calls));
  return result;
}

bool forward_piece_group(AttentionRunner& runner, const std::vector<const LocalCall*>& group,
                         const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                         const Tensor& lse) {
  const GroupHeads heads = group_heads(group);
  const kernels::AttentionPieces pieces = pieces_of(group, heads);
  return runner.forward_if_supported(forward_args(runner, group, heads, pieces, q, k, v, out, lse));
}

namespace {

// Builds the group's backward arguments (storing its gradients) and hands them to `use`.
bool with_backward_args(AttentionRunner& runner, const std::vector<const LocalCall*>& group,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& grad_out, const Tensor& grad_q,
                        const Tensor& grad_k, const Tensor& grad_v,
                        const std::function<bool(const kernels::AttentionForwardArgs&,
                                                 const kernels::AttentionBackwardArgs&)>& use) {
  const GroupHeads heads = group_heads(group);
  const kernels::AttentionPieces pieces = pieces_of(group, heads);
  const kernels::AttentionForwardArgs fwd =
      forward_args(runner, group, heads, pieces, q, k, v, out, lse);
  kernels::AttentionBackwardArgs args = backward_of(fwd);
  args.grad_out = base_view(grad_out, heads.q, false);
  args.grad_q = base_view(grad_q, heads.q, false);
  args.grad_k = base_view(grad_k, heads.k, false);
  args.grad_v = base_view(grad_v, heads.k, false);
  args.overwrite_grads = true;
  return use(fwd, args);
}

}  // namespace

bool backward_piece_group(AttentionRunner& runner, const std::vector<const LocalCall*>& group,
                          const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& grad_out, const Tensor& grad_q,
                          const Tensor& grad_k, const Tensor& grad_v) {
  return with_backward_args(
      runner, group, q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v,
      [&](const auto& fwd, const auto& args) { return runner.backward_if_supported(fwd, args); });
}

bool backward_piece_group_supported(AttentionRunner& runner,
                                    const std::vector<const LocalCall*>& group, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& grad_out, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v) {
  return with_backward_args(
      runner, group, q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v,
      [&](const auto& fwd, const auto& args) { return runner.backward_supported(fwd, args); });
}

}  // namespace rd::nn
