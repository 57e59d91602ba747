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
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

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
}

RankLayout rank_layout(const char* op, const Tensor& q, const DilatedAttentionOptions& options,
                       const SequenceSplit& split) {
  const int ranks = split.comm != nullptr ? split.comm->size() : 1;
  const int rank = split.comm != nullptr ? split.comm->rank() : 0;
  const bool zigzag = ranks > 1 && resolve_layout_for(op, split.layout, &options, q.size(1) * ranks,
                                                      ranks) == SequenceLayout::kZigzag;
  return {q.size(0), q.size(1), q.size(2), q.size(3), rank, ranks, zigzag};
}

// A variant's backward: adds the gradients of q, k and v into the buffers, given the
// forward's results and the gradients arriving at them.
using VariantBackward =
    std::function<void(const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                       const Tensor& grad_lse, const GradBuffers& grads)>;

// The call's one autograd node over `in.differentiated`; its gradients are built in
// `grad_dtype` (q's dtype where calls write disjoint elements, else the accumulation dtype).
void record_node(const char* op, const AttentionInputs& in, const RankAttention& forward,
                 const DilatedAttentionResult& result, DType grad_dtype, VariantBackward backward) {
  if (!autograd::needs_grad(in.differentiated)) return;
  autograd::record(
      {result.out, result.lse}, op, in.differentiated,
      [backward = std::move(backward), packed = in.packed, grad_dtype, out = forward.out.detach(),
       lse = forward.lse.detach()](const std::vector<Tensor>& grads) {
        const Tensor grad_out =
            grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
        const Tensor grad_lse =
            grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
        const GradBuffers buffers =
            GradBuffers::zeroed(out.shape(), grad_dtype, out.device(), packed);
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

RingAttentionResult run_dilated_attention(const char* op, const AttentionInputs& in,
                                          const DilatedAttentionOptions& options,
                                          const AttentionCallContext& context,
                                          const SequenceSplit& split) {
  check_call(op, in, options, context, split);
  const RankLayout layout = rank_layout(op, in.q, options, split);
  auto runner = std::make_shared<AttentionRunner>(op, options, context, in.q, layout.seq_len());
  dist::Communicator* comm = split.comm;
  const DType acc_dtype = accumulation_dtype(in.q.dtype());
  RingAttentionResult result;
  RankAttention forward;
  DType grad_dtype = acc_dtype;
  VariantBackward backward;
  if (options.variant == DilationVariant::kSegmentLocal) {
    auto plan = std::make_shared<const RankPlan>(make_rank_plan(
        options, layout, split.strategy, static_cast<int64_t>(dtype_size(in.q.dtype()))));
    const int64_t before = exchange_bytes_sent(comm, *plan);
    forward = fixed_forward(*runner, *plan, in.q, in.k, in.v, comm);
    result.ring_steps = plan->ring_steps;
    result.ring_pairs = static_cast<int>(plan->ring.units.size());
    result.gathered_pairs = plan->gathered_units();
    result.forward_bytes_sent = exchange_bytes_sent(comm, *plan) - before;
    // Head groups write disjoint elements: q's dtype is exact.
    if (!plan->merged) grad_dtype = in.q.dtype();
    backward = [runner, plan, q = in.q, k = in.k, v = in.v, comm](
                   const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                   const Tensor& grad_lse, const GradBuffers& grads) {
      fixed_backward(*runner, *plan, q, k, v, out, lse, grad_out, grad_lse, comm, grads);
    };
  } else {
    auto plan = std::make_shared<const GlobalPlan>(
        make_global_plan(options, layout, *runner, in.q.device()));
    const int64_t before = comm != nullptr ? comm->stats().bytes_sent : 0;
    forward = global_forward(*runner, *plan, in.q, in.k, in.v, comm);
    if (comm != nullptr) {
      result.gathered_pairs = static_cast<int>(options.segment_lengths.size());
      result.forward_bytes_sent = comm->stats().bytes_sent - before;
    }
    backward = [runner, plan, q = in.q, k = in.k, v = in.v, comm](
                   const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                   const Tensor& grad_lse, const GradBuffers& grads) {
      global_backward(*runner, *plan, q, k, v, out, lse, grad_out, grad_lse, comm, grads);
    };
  }
  result.attention.out = forward.out;
  result.attention.lse = forward.lse.to(DType::kFloat32);  // float64 data keeps float64 inside
  result.attention.path_used = runner->path_used();
  record_node(op, in, forward, result.attention, grad_dtype, std::move(backward));
  return result;
}

}  // namespace rd::nn
