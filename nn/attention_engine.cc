// The one dilated-attention engine (see attention_engine.h, docs/dilated-attention.md,
// docs/distributed.md).
#include "ringdilated/nn/attention_engine.h"

#include <functional>
#include <memory>
#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_runner.h"
#include "ringdilated/nn/fixed_attention.h"
#include "ringdilated/nn/global_attention.h"
#include "ringdilated/nn/key_exchange.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/nn/rank_plan_cache.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

using op_util::options_like;

// Document starts: one list per batch row, each strictly increasing from 0 and below N.
void check_documents(const char* op, const std::vector<std::vector<int64_t>>* documents,
                     const DilatedAttentionOptions& options, int64_t batch, int64_t seq_len) {
  if (documents == nullptr) return;
  RD_CHECK(options.variant == DilationVariant::kSegmentLocal, kUnimplemented, op,
           ": document masks need the segment-local variant (the global variant's cycled "
           "lists mix positions of every document)");
  RD_CHECK(static_cast<int64_t>(documents->size()) == batch, kInvalidArgument, op,
           ": context's document_starts has ", documents->size(), " rows for a batch of ", batch);
  for (size_t row = 0; row < documents->size(); ++row) {
    const std::vector<int64_t>& starts = (*documents)[row];
    for (size_t d = 0; d < starts.size(); ++d) {
      const bool ok = d == 0 ? starts[0] == 0 : starts[d] > starts[d - 1] && starts[d] < seq_len;
      RD_CHECK(ok, kInvalidArgument, op, ": document_starts of batch row ", row,
               " must rise strictly from 0 below N = ", seq_len, "; entry ", d, " is ", starts[d]);
    }
  }
}

void check_call(const char* op, const AttentionInputs& in, const DilatedAttentionOptions& options,
                const AttentionCallContext& context, const SequenceSplit& split) {
  check_qkv_inputs(in.q, in.k, in.v, op,
                   split.comm != nullptr ? "this rank's block [B, N / P, H, D]" : "[B, N, H, D]");
  if (split.comm != nullptr) {
    RD_CHECK(in.q.device() == split.comm->device(), kDeviceMismatch, op, ": q is on ",
             in.q.device().str(), " but the communicator (", split.comm->backend_name(),
             ") moves data on ", split.comm->device().str());
  }
  validate_options(options, in.q.size(2));
  RD_CHECK(context.backward_piece_elements >= 1, kInvalidArgument, op,
           ": context's backward_piece_elements must be >= 1, got ",
           context.backward_piece_elements);
  RD_CHECK(!(context.training && options.dropout > 0) || context.generator != nullptr,
           kInvalidArgument, op, ": dropout in training needs a generator in the call context");
  check_documents(op, context.document_starts, options, in.q.size(0),
                  in.q.size(1) * (split.comm != nullptr ? split.comm->size() : 1));
}

RankLayout rank_layout(const char* op, const Tensor& q, const DilatedAttentionOptions& options,
                       const SequenceSplit& split) {
  const int ranks = split.comm != nullptr ? split.comm->size() : 1;
  const int rank = split.comm != nullptr ? split.comm->rank() : 0;
  const bool zigzag = ranks > 1 && resolve_layout_for(op, split.layout, &options, q.size(1) * ranks,
                                                      ranks) == SequenceLayout::kZigzag;
  return {q.size(0), q.size(1), q.size(2), q.size(3), rank, ranks, zigzag, 0};
}

// A variant's backward: builds the gradients of q, k and v in the buffers (uninitialized:
// it zeroes what its calls do not store), given the forward's results and the gradients
// arriving at them.
using VariantBackward =
    std::function<void(const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                       const Tensor& grad_lse, const GradBuffers& grads)>;

// The call's one autograd node over `in.differentiated`; its gradients are built in
// `grad_dtypes` (GradDtypes).
void record_node(const char* op, const AttentionInputs& in, const RankAttention& forward,
                 const DilatedAttentionResult& result, GradDtypes grad_dtypes,
                 VariantBackward backward) {
  if (!autograd::needs_grad(in.differentiated)) return;
  autograd::record(
      {result.out, result.lse}, op, in.differentiated,
      [backward = std::move(backward), packed = in.packed, grad_dtypes, kv_heads = in.k.size(2),
       out = forward.out.detach(), lse = forward.lse.detach()](const std::vector<Tensor>& grads) {
        const Tensor grad_out =
            grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
        const Tensor grad_lse =
            grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
        const GradBuffers buffers =
            GradBuffers::uninitialized(out.shape(), kv_heads, grad_dtypes, out.device(), packed);
        backward(out, lse, grad_out, grad_lse, buffers);
        return buffers.input_grads(out.dtype());
      });
}

}  // namespace

AttentionInputs separate_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  return {q.defined() ? q.detach() : q,
          k.defined() ? k.detach() : k,
          v.defined() ? v.detach() : v,
          {q, k, v},
          false};
}

AttentionInputs packed_inputs(const Tensor& qkv, const char* op, const char* shape) {
  RD_CHECK(qkv.defined(), kInvalidArgument, op, ": argument 'qkv' is undefined");
  RD_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, kShapeMismatch, op, ": argument 'qkv' must be ",
           shape, ", got shape ", shape_str(qkv.shape()));
  // The selections are taken of a detached base: the node differentiates qkv itself.
  const Tensor base = qkv.detach();
  return {base.select(2, 0), base.select(2, 1), base.select(2, 2), {qkv}, true};
}

namespace {

// One variant's forward on this rank, the dtypes its gradients are built in, and its
// backward (for the autograd node).
struct VariantRun {
  RankAttention forward;
  GradDtypes grad_dtypes;
  VariantBackward backward;
};

VariantRun run_fixed(const DilatedAttentionOptions& options, const RankLayout& layout,
                     const std::shared_ptr<AttentionRunner>& runner, const AttentionInputs& in,
                     const SequenceSplit& split, const std::vector<std::vector<int64_t>>* documents,
                     RingAttentionResult* result) {
  dist::Communicator* comm = split.comm;
  const auto element_bytes = static_cast<int64_t>(dtype_size(in.q.dtype()));
  auto make = [&] {
    return make_rank_plan(options, layout, split.strategy, element_bytes, documents);
  };
  const std::shared_ptr<const RankPlan> plan =
      runner->plans() != nullptr
          ? runner->plans()->get(
                rank_plan_key(options, layout, split.strategy, element_bytes, documents), make)
          : std::make_shared<const RankPlan>(make());
  const int64_t before = exchange_bytes_sent(comm, *plan);
  VariantRun run;
  run.forward = fixed_forward(*runner, *plan, in.q, in.k, in.v, comm);
  result->ring_steps = plan->ring_steps;
  result->ring_pairs = static_cast<int>(plan->ring.units.size());
  result->gathered_pairs = plan->gathered_units();
  result->forward_bytes_sent = exchange_bytes_sent(comm, *plan) - before;
  // Head groups write disjoint elements of dQ: q's dtype is exact. Likewise dK/dV where each
  // key/value head is one pair's. Where two pairs share one (grouped-query attention), the
  // second adds to the first's stored values in float32 and rounds once: the float32 sum of
  // the two, rounded. More sharers, and all-heads mixing, accumulate in float32.
  const DType exact = in.q.dtype(), accumulated = accumulation_dtype(in.q.dtype());
  const bool two_sharers_at_most =
      max_pairs_per_kv_head(options, layout.heads, layout.kv_group()) <= 2;
  run.grad_dtypes.q = plan->merged ? accumulated : exact;
  run.grad_dtypes.kv = !plan->merged && two_sharers_at_most ? exact : accumulated;
  run.backward = [runner, plan, q = in.q, k = in.k, v = in.v, comm](
                     const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                     const Tensor& grad_lse, const GradBuffers& grads) {
    fixed_backward(*runner, *plan, q, k, v, out, lse, grad_out, grad_lse, comm, grads);
  };
  return run;
}

// The key/value head of each query head, as an int64 index on `device`.
Tensor kv_head_index(int64_t heads, int64_t group, Device device) {
  std::vector<int64_t> index;
  for (int64_t h = 0; h < heads; ++h) index.push_back(h / group);
  return from_vector<int64_t>(index, {heads}).to(device);
}

// The global variant gathers copies of its rows anyway: under grouped-query attention it
// reads key/value heads repeated to the query heads (a copy), and folds their gradients back.
VariantRun run_global(const DilatedAttentionOptions& options, const RankLayout& layout,
                      const std::shared_ptr<AttentionRunner>& runner, const AttentionInputs& in,
                      const SequenceSplit& split, RingAttentionResult* result) {
  dist::Communicator* comm = split.comm;
  const int64_t group = layout.kv_group();
  const Tensor kv_index = group > 1 ? kv_head_index(layout.heads, group, in.q.device()) : Tensor();
  const Tensor k = group > 1 ? index_select(in.k, 2, kv_index) : in.k;
  const Tensor v = group > 1 ? index_select(in.v, 2, kv_index) : in.v;
  auto plan =
      std::make_shared<const GlobalPlan>(make_global_plan(options, layout, *runner, in.q.device()));
  const int64_t before = comm != nullptr ? comm->stats().bytes_sent : 0;
  VariantRun run;
  run.forward = global_forward(*runner, *plan, in.q, k, v, comm);
  if (comm != nullptr) {
    result->gathered_pairs = static_cast<int>(options.segment_lengths.size());
    result->forward_bytes_sent = comm->stats().bytes_sent - before;
  }
  run.grad_dtypes = {accumulation_dtype(in.q.dtype()), accumulation_dtype(in.q.dtype())};
  run.backward = [runner, plan, q = in.q, k, v, kv_index, comm](
                     const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                     const Tensor& grad_lse, const GradBuffers& grads) {
    grads.zero();  // every call adds (gathered copies added back by position)
    if (!kv_index.defined()) {
      global_backward(*runner, *plan, q, k, v, out, lse, grad_out, grad_lse, comm, grads);
      return;
    }
    // q's gradient goes straight into its buffer; k's and v's, repeated to the query heads,
    // into H-head buffers folded back below.
    const Tensor repeated_kv = zeros(q.shape(), options_like(grads.qkv[1]));
    GradBuffers repeated;
    repeated.qkv = {grads.qkv[0], repeated_kv, zeros_like(repeated_kv)};
    global_backward(*runner, *plan, q, k, v, out, lse, grad_out, grad_lse, comm, repeated);
    kernels::KernelBackend& backend = backend_for(q.device());
    for (size_t t = 1; t < 3; ++t) {
      backend.index_add(kernel_view(grads.qkv[t], runner->op()), 2,
                        kernel_view(kv_index, runner->op()),
                        kernel_view(repeated.qkv[t], runner->op()));
    }
  };
  return run;
}

}  // namespace

RingAttentionResult run_dilated_attention(const char* op, const AttentionInputs& in,
                                          const DilatedAttentionOptions& options,
                                          const AttentionCallContext& context,
                                          const SequenceSplit& split) {
  check_call(op, in, options, context, split);
  RankLayout layout = rank_layout(op, in.q, options, split);
  layout.kv_heads = in.k.size(2);
  auto runner = std::make_shared<AttentionRunner>(op, options, context, in.q, layout.seq_len());
  RingAttentionResult result;
  VariantRun run =
      options.variant == DilationVariant::kSegmentLocal
          ? run_fixed(options, layout, runner, in, split, context.document_starts, &result)
          : run_global(options, layout, runner, in, split, &result);
  result.attention.out = run.forward.out;
  result.attention.lse = run.forward.lse.to(DType::kFloat32);  // float64 data keeps float64
  result.attention.path_used = runner->path_used();
  record_node(op, in, run.forward, result.attention, run.grad_dtypes, std::move(run.backward));
  return result;
}

}  // namespace rd::nn
