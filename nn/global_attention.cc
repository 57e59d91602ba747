// The global variant on one rank (see global_attention.h, docs/dilated-attention.md): per
// head group, attention over the gathered cycled rows, written to row j (never scattered
// back); the gradients of the gathered copies are index-added back to their positions.
#include "ringdilated/nn/global_attention.h"

#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using op_util::options_like;

// P[j] = o + r * (j mod |base|), base = (o, o + r, ... < N), for j in [begin, end): cached.
Tensor cycled_rows(PatternCache& cache, int64_t seq_len, int64_t r, int64_t o, int64_t begin,
                   int64_t end, Device device) {
  const std::string key = str_cat("cycled/N=", seq_len, "/r=", r, "/o=", o, "/rows=", begin, "-",
                                  end, "/", device.str());
  return cache.get(key, [&] {
    const int64_t base = (seq_len - o + r - 1) / r;
    std::vector<int64_t> rows;
    for (int64_t j = begin; j < end; ++j) rows.push_back(o + r * (j % base));
    return from_vector<int64_t>(rows, {end - begin}).to(device);
  });
}

// [B, N, hc, D] tensors of q, k and v of the group's heads over the whole sequence: views
// for one rank, an all-gather across several.
std::vector<Tensor> gather_group_heads(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Heads& h, const RankLayout& l,
                                       dist::Communicator* comm) {
  if (comm == nullptr)
    return {q.narrow(2, h.first, h.count), k.narrow(2, h.first, h.count),
            v.narrow(2, h.first, h.count)};
  const Tensor mine = stack({q.narrow(2, h.first, h.count), k.narrow(2, h.first, h.count),
                             v.narrow(2, h.first, h.count)});  // [3, B, C, hc, D]
  Shape all_shape{l.ranks};
  for (int64_t d : mine.shape()) all_shape.push_back(d);
  Tensor all = empty(all_shape, options_like(q));
  comm->all_gather(all, mine);
  // [P, 3, B, C, hc, D] -> 3 x [B, N, hc, D]
  std::vector<Tensor> blocks;
  for (int r = 0; r < l.ranks; ++r) blocks.push_back(all.select(0, r));
  const Tensor full = join_rank_rows(blocks, l, /*dim=*/2);
  return {full.select(0, 0), full.select(0, 1), full.select(0, 2)};
}

// The forward call of one group on the gathered heads `qkv`; the gathered copies it reads
// are kept alive in `keep`.
AttentionForwardArgs global_args(const AttentionRunner& runner, const RankLayout& l,
                                 const GlobalGroup& g, const std::vector<Tensor>& qkv,
                                 const Tensor& out, const Tensor& lse, std::vector<Tensor>* keep) {
  const char* op = runner.op();
  keep->push_back(index_select(qkv[0], 1, g.query_rows).permute({0, 2, 1, 3}));
  keep->push_back(index_select(qkv[1], 1, g.key_rows).permute({0, 2, 1, 3}));
  keep->push_back(index_select(qkv[2], 1, g.key_rows).permute({0, 2, 1, 3}));
  const Tensor key_order = runner.key_order(g.key_rows.numel(), out.device());
  AttentionForwardArgs a;
  a.q = kernel_view((*keep)[0], op);
  a.k = kernel_view((*keep)[1], op);
  a.v = kernel_view((*keep)[2], op);
  const int64_t rows = g.query_rows.numel();
  const Heads& h = g.heads;
  a.out = kernel_view(
      out.narrow(1, g.local_row, rows).narrow(2, h.first, h.count).permute({0, 2, 1, 3}), op);
  a.lse = kernel_view(lse.narrow(1, h.first, h.count).narrow(2, g.local_row, rows), op);
  const kernels::DropoutIndexing indexing =
      runner.dropout()
          ? global_dropout_indexing(h.first, /*first_row=*/g.causal_offset, l.seq_len(), l.heads)
          : kernels::DropoutIndexing{};
  a.params = runner.call_params(g.pair, runner.causal(), indexing);
  a.params.causal_offset = g.causal_offset;
  if (key_order.defined()) {
    keep->push_back(key_order);
    a.params.key_order = static_cast<const int64_t*>(kernel_view(key_order, op).data);
  }
  return a;
}

// Adds one piece's gradients of q, k and v into `targets` ([B, N, hc, D] each, whole-sequence
// positions): its call's backward on the gathered rows, each row added back at its position.
void global_piece_backward(AttentionRunner& runner, const RankLayout& l, const GlobalGroup& g,
                           const std::vector<Tensor>& qkv, const Tensor& out, const Tensor& lse,
                           const Tensor& grad_out, const Tensor& grad_lse,
                           const std::vector<Tensor>& targets) {
  kernels::KernelBackend& backend = backend_for(out.device());
  const char* op = runner.op();
  const TensorOptions acc = options_like(targets[0]);
  std::vector<Tensor> keep;
  const AttentionForwardArgs fwd = global_args(runner, l, g, qkv, out, lse, &keep);
  const int64_t nq = g.query_rows.numel(), nk = g.key_rows.numel();
  const Heads& h = g.heads;
  const Shape q_shape{l.batch, h.count, nq, l.head_dim}, k_shape{l.batch, h.count, nk, l.head_dim};
  // Overwritten whole by the call.
  std::vector<Tensor> gathered{empty(q_shape, acc), empty(k_shape, acc), empty(k_shape, acc)};
  AttentionBackwardArgs b = backward_args(
      op, fwd,
      grad_out.narrow(1, g.local_row, nq).narrow(2, h.first, h.count).permute({0, 2, 1, 3}),
      grad_lse.defined() ? grad_lse.narrow(1, h.first, h.count).narrow(2, g.local_row, nq)
                         : Tensor(),
      gathered[0], gathered[1], gathered[2]);
  b.overwrite_grads = true;  // fresh buffers, one call each
  runner.backward(fwd, b);
  // Row m of a gathered copy came from position P[m]: add it back there.
  const Tensor* rows[3] = {&g.query_rows, &g.key_rows, &g.key_rows};
  for (int t = 0; t < 3; ++t) {
    backend.index_add(kernel_view(targets[static_cast<size_t>(t)], op), 1,
                      kernel_view(*rows[t], op),
                      kernel_view(gathered[static_cast<size_t>(t)].permute({0, 2, 1, 3}), op));
  }
}

}  // namespace

GlobalPlan make_global_plan(const DilatedAttentionOptions& o, const RankLayout& l,
                            const AttentionRunner& runner, Device device) {
  const int64_t pairs = static_cast<int64_t>(o.dilation_rates.size());
  const std::vector<Heads> groups = head_groups(l.heads, pairs, /*extra_to_first=*/false);
  GlobalPlan plan{l, {}};
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = o.dilation_rates[static_cast<size_t>(i)], offset = i % r;
    if (groups[static_cast<size_t>(i)].count == 0) continue;
    for (int j = 0; j < l.pieces(); ++j) {
      const Block mine = l.piece(l.rank, j);
      // Causal: row j sees list entries m <= j only, so keys past the piece never count.
      const int64_t key_end = o.causal ? mine.end : l.seq_len();
      const Tensor query_rows =
          cycled_rows(runner.patterns(), l.seq_len(), r, offset, mine.begin, mine.end, device);
      // One device (causal or not): the queries' list is the keys' list.
      const bool same_rows = mine.begin == 0 && mine.end == key_end;
      plan.groups.push_back(
          {static_cast<int>(i), groups[static_cast<size_t>(i)], query_rows,
           same_rows ? query_rows
                     : cycled_rows(runner.patterns(), l.seq_len(), r, offset, 0, key_end, device),
           mine.begin, j * l.piece_len()});
    }
  }
  return plan;
}

RankAttention global_forward(AttentionRunner& runner, const GlobalPlan& plan, const Tensor& q,
                             const Tensor& k, const Tensor& v, dist::Communicator* comm) {
  const RankLayout& l = plan.layout;
  RankAttention result;
  result.out = zeros(q.shape(), options_like(q));
  result.lse = full({l.batch, l.heads, l.rows_per_rank}, kEmptyLse,
                    TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device()));
  std::vector<Tensor> qkv;
  for (size_t i = 0; i < plan.groups.size(); ++i) {
    const GlobalGroup& g = plan.groups[i];
    // Each pair's head group is gathered once, for all its pieces.
    if (i == 0 || plan.groups[i - 1].pair != g.pair) {
      qkv = gather_group_heads(q, k, v, g.heads, l, comm);
    }
    std::vector<Tensor> keep;
    runner.forward(global_args(runner, l, g, qkv, result.out, result.lse, &keep));
  }
  return result;
}

void global_backward(AttentionRunner& runner, const GlobalPlan& plan, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& grad_out, const Tensor& grad_lse, dist::Communicator* comm,
                     const GradBuffers& grads) {
  const RankLayout& l = plan.layout;
  kernels::KernelBackend& backend = backend_for(out.device());
  const TensorOptions acc = options_like(grads.qkv[0]);
  const std::vector<GlobalGroup>& groups = plan.groups;
  for (size_t first = 0; first < groups.size();) {
    const Heads& heads = groups[first].heads;
    const std::vector<Tensor> qkv = gather_group_heads(q, k, v, heads, l, comm);
    // One rank: straight into its gradients. Several: the whole sequence's gradients of the
    // group, then one reduce-scatter sums the ranks' shares and leaves each its own rows.
    const Tensor full_grads =
        comm == nullptr ? Tensor() : zeros({3, l.batch, l.seq_len(), heads.count, l.head_dim}, acc);
    std::vector<Tensor> targets;
    for (size_t t = 0; t < 3; ++t) {
      targets.push_back(comm == nullptr ? grads.qkv[t].narrow(2, heads.first, heads.count)
                                        : full_grads.select(0, static_cast<int64_t>(t)));
    }
    size_t end = first;
    for (; end < groups.size() && groups[end].pair == groups[first].pair; ++end) {
      global_piece_backward(runner, l, groups[end], qkv, out, lse, grad_out, grad_lse, targets);
    }
    if (comm != nullptr) {
      // [3, B, N, hc, D] -> [P, 3, B, C, hc, D], rank-major.
      std::vector<Tensor> per_rank;
      for (int r = 0; r < l.ranks; ++r) per_rank.push_back(rank_rows(full_grads, l, r, 2));
      Tensor mine = empty({3, l.batch, l.rows_per_rank, heads.count, l.head_dim}, acc);
      comm->reduce_scatter(mine, stack(per_rank));
      for (int t = 0; t < 3; ++t) {
        const Tensor own = grads.qkv[static_cast<size_t>(t)].narrow(2, heads.first, heads.count);
        backend.accumulate(kernel_view(own, runner.op()),
                           kernel_view(mine.select(0, t), runner.op()));
      }
    }
    first = end;
  }
}

}  // namespace rd::nn
