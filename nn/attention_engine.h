// The one dilated-attention engine. It validates a call, lays its sequence out over the ranks
// (one device is one rank of one), plans this rank's share, runs the fixed or global variant
// and records one autograd node. dilated_attention and ring_dilated_attention are thin
// fronts over it, so a change to attention semantics is made here once.
#pragma once

#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/nn/sequence_layout.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// The tensors of one call: q, k and v (detached views), and the autograd inputs they came
// from: q, k and v themselves, or the packed [B, N, 3, H, D] qkv they are selections of
// (whose gradient is then built in one packed buffer).
struct AttentionInputs {
  Tensor q, k, v;
  std::vector<Tensor> differentiated;
  bool packed = false;
};

// q, k and v as given.
AttentionInputs separate_inputs(const Tensor& q, const Tensor& k, const Tensor& v);

// The q, k and v selections of a packed [B, N, 3, H, D] qkv (`shape` names that shape in the
// error when it is not one).
AttentionInputs packed_inputs(const Tensor& qkv, const char* op, const char* shape);

// How a call's sequence is split: over the ranks of `comm` (null: one device holds it all),
// rows laid out by `layout`, keys exchanged by `strategy`.
struct SequenceSplit {
  dist::Communicator* comm = nullptr;
  DistStrategy strategy = DistStrategy::kAuto;
  SequenceLayout layout = SequenceLayout::kAuto;
};

// This rank's rows of dilated attention (see dilated_attention.h, ring_dilated_attention.h),
// errors naming `op`. Differentiable in inputs.differentiated.
RingAttentionResult run_dilated_attention(const char* op, const AttentionInputs& inputs,
                                          const DilatedAttentionOptions& options,
                                          const AttentionCallContext& context,
                                          const SequenceSplit& split);

}  // namespace rd::nn
