// Document pieces as one call: the calls of one document piece each (BlockCall::batch_row
// >= 0) that differ only in where their rows start and how many, grouped so that a kernel
// taking calls over pieces (kernels::AttentionPieces: cuDNN's ragged offsets) runs each
// group as one call instead of one per piece. Where none takes it, the caller runs each.
#pragma once

#include <functional>
#include <vector>

#include "ringdilated/nn/attention_runner.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

struct PieceGroups {
  std::vector<const LocalCall*> singles;              // run one call each
  std::vector<std::vector<const LocalCall*>> groups;  // each tried as one call over pieces
};

// The calls of `calls` that `wanted` accepts: document-piece calls of one pair, dilation and
// mask grouped, with full heads those of all the pair's head sets of one head count and
// stride (each piece then at its own heads), grouped-query blocks per head set and heads
// (where their query heads are one run), the rest single.
PieceGroups group_piece_calls(const std::vector<LocalCall>& calls,
                              const std::function<bool(const LocalCall&)>& wanted);

// `group` split into parts in none of which two calls read the same key rows of one batch
// row. A call over pieces stores each piece's dK/dV rather than adding them, so pieces that
// share keys must run in separate calls whose gradients are added: the zigzag layout's two
// query pieces of a rank reading one key piece of another rank within one document. Calls
// keep their order by batch row and first key position within a part.
std::vector<std::vector<const LocalCall*>> split_shared_keys(
    const std::vector<const LocalCall*>& group);

// The group's forward as one call over pieces on this rank's q, k, v [B, C, H(_kv), D],
// writing its rows of out [B, C, H, D] and lse [B, H, C] in place. False, with nothing run,
// where no kernel takes it.
bool forward_piece_group(AttentionRunner& runner, const std::vector<const LocalCall*>& group,
                         const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                         const Tensor& lse);

// The group's backward as one call over pieces, against the final out and lse, storing
// (overwriting) its pieces' rows of grad_q, grad_k and grad_v (head groups whose key/value
// heads no other pair writes first). False, with nothing run, where no kernel takes it.
bool backward_piece_group(AttentionRunner& runner, const std::vector<const LocalCall*>& group,
                          const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& grad_out, const Tensor& grad_q,
                          const Tensor& grad_k, const Tensor& grad_v);
// Whether backward_piece_group would find a kernel, as far as kernels tell before running
// (AttentionRunner::backward_supported).
bool backward_piece_group_supported(AttentionRunner& runner,
                                    const std::vector<const LocalCall*>& group, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& grad_out, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v);

}  // namespace rd::nn
