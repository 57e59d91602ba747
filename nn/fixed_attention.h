// The fixed (segment-local) variant on one rank of a split sequence, one device being the
// split with one rank: the forward and backward over a RankPlan. The calls on the rank's own
// rows run in place; those on other ranks' keys run as the key exchange brings them.
#pragma once

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/attention_runner.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// This rank's rows of the attention. `comm` may be null when the plan exchanges nothing.
RankAttention fixed_forward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q,
                            const Tensor& k, const Tensor& v, dist::Communicator* comm);

// Adds the gradients of this rank's q, k and v into `grads` (zeros: q's dtype for head groups,
// whose calls write disjoint elements; the accumulation dtype for all heads). `out` and
// `lse` are the forward's (merged) results, which makes each call's share exact.
void fixed_backward(AttentionRunner& runner, const RankPlan& plan, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& grad_out,
                    const Tensor& grad_lse, dist::Communicator* comm, const GradBuffers& grads);

}  // namespace rd::nn
