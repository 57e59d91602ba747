// Sequence-parallel dilated attention (see ring_dilated_attention.h, docs/distributed.md):
// the functional forms as fronts over the one engine (attention_engine.h) with the ranks of
// a communicator. The plan, the key exchange and the variants live in rank_plan.h,
// key_exchange.h, fixed_attention.h and global_attention.h.
#include "ringdilated/nn/ring_dilated_attention.h"

#include "ringdilated/nn/attention_engine.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "ring_dilated_attention";

// One rank is one device: no communicator, exactly the single-device call.
SequenceSplit split_over(dist::Communicator& comm, DistStrategy strategy, SequenceLayout layout) {
  return {comm.size() > 1 ? &comm : nullptr, strategy, layout};
}

}  // namespace

const char* strategy_name(DistStrategy strategy) {
  switch (strategy) {
    case DistStrategy::kRing: return "ring";
    case DistStrategy::kAllGather: return "all_gather";
    case DistStrategy::kAuto: return "auto";
  }
  return "?";
}

RingAttentionResult ring_dilated_attention_with_lse(const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const DilatedAttentionOptions& options,
                                                    dist::Communicator& comm, DistStrategy strategy,
                                                    const AttentionCallContext& context,
                                                    SequenceLayout layout) {
  return run_dilated_attention(kOp, separate_inputs(q, k, v), options, context,
                               split_over(comm, strategy, layout));
}

RingAttentionResult ring_dilated_attention_qkv_with_lse(
    const Tensor& qkv, const DilatedAttentionOptions& options, dist::Communicator& comm,
    DistStrategy strategy, const AttentionCallContext& context, SequenceLayout layout) {
  return run_dilated_attention(kOp,
                               packed_inputs(qkv, kOp, "this rank's block [B, N / P, 3, H, D]"),
                               options, context, split_over(comm, strategy, layout));
}

Tensor ring_dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const DilatedAttentionOptions& options, dist::Communicator& comm,
                              DistStrategy strategy, const AttentionCallContext& context,
                              SequenceLayout layout) {
  return ring_dilated_attention_with_lse(q, k, v, options, comm, strategy, context, layout)
      .attention.out;
}

}  // namespace rd::nn
