// The global (original) variant on one rank of a split sequence, one device being the split
// with one rank: every output row may read any key, so each head group gathers its heads of
// q, k and v over the whole sequence (all-gathered across ranks), attends its own rows along
// the cycled index list, and reduce-scatters the gradients back to their owners.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/attention_runner.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/sequence_layout.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// One head group's share for one piece of this rank's rows (two under the zigzag layout):
// the cycled rows of the piece's queries and of the keys they may see, as indices into the
// whole sequence, and where the piece sits.
struct GlobalGroup {
  int pair = 0;
  Heads heads;
  Tensor query_rows, key_rows;  // int64 indices into the whole sequence
  int64_t causal_offset = 0;    // the global position of the piece's first row
  int64_t local_row = 0;        // the piece's first row in this rank's tensors
};

struct GlobalPlan {
  RankLayout layout;
  std::vector<GlobalGroup> groups;  // in pair order, a pair's pieces together
};

// The plan of rank layout.rank; the index lists are cached in the runner's pattern cache.
GlobalPlan make_global_plan(const DilatedAttentionOptions& options, const RankLayout& layout,
                            const AttentionRunner& runner, Device device);

// This rank's rows of the attention. `comm` may be null for one rank.
RankAttention global_forward(AttentionRunner& runner, const GlobalPlan& plan, const Tensor& q,
                             const Tensor& k, const Tensor& v, dist::Communicator* comm);

// Adds the gradients of this rank's q, k and v into `grads` (zeros, the accumulation dtype).
void global_backward(AttentionRunner& runner, const GlobalPlan& plan, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& grad_out, const Tensor& grad_lse, dist::Communicator* comm,
                     const GradBuffers& grads);

}  // namespace rd::nn
