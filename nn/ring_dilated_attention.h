// Sequence-parallel dilated attention: the sequence is split into equal blocks, one per rank
// of a communicator (sequence_layout.h); each rank holds its block of q, k and v, computes
// only its own output rows, and gets the keys it needs from other ranks around a ring or by
// all-gather. docs/distributed.md describes the algorithms, the exchange and the cost model.
#pragma once

#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/sequence_layout.h"

namespace rd::nn {

// How keys reach the ranks that need them, per dilation pair whose segments cross a block
// boundary (pairs whose segments all fit in one block never communicate):
//   kRing       blocks of selected keys travel around the ring, one step per block distance
//               that any rank needs, in two preallocated buffers; the backward sends the
//               float32 dK/dV accumulators around with them.
//   kAllGather  every rank all-gathers the pair's selected keys (the LongNet paper's
//               algorithm); the backward reduce-scatters dK/dV.
//   kAuto       per pair, by the cost model of docs/distributed.md.
enum class DistStrategy { kRing, kAllGather, kAuto };

const char* strategy_name(DistStrategy strategy);

// What a call did: its result, the strategy each crossing pair used, and its traffic.
struct RingAttentionResult {
  DilatedAttentionResult attention;  // this rank's rows: out [B, N/P, H, D], lse [B, H, N/P]
  int ring_steps = 0;                // ring steps taken (0: no ring exchange)
  int gathered_pairs = 0;            // (pair, head set)s exchanged by all-gather
  int ring_pairs = 0;                // (pair, head set)s exchanged around the ring
  int64_t forward_bytes_sent = 0;    // by this rank in the forward
};

// q, k, v: this rank's rows [B, N / P, H, D] of a sequence of N = P * (N / P) positions,
// split by `layout` (kAuto: zigzag when causal and 2P divides N, else contiguous; see
// SequenceLayout). Every rank of `comm` must call it with the same options, shapes and
// layout; the backward communicates too, so every rank must run it. The result equals this
// rank's rows (sequence_block) of dilated_attention_with_lse on the whole sequence, for
// every variant, mixing mode, offset rule and causal setting; with P = 1 it is that call.
// Differentiable in q, k and v.
RingAttentionResult ring_dilated_attention_with_lse(const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const DilatedAttentionOptions& options,
                                                    dist::Communicator& comm,
                                                    DistStrategy strategy = DistStrategy::kAuto,
                                                    const AttentionCallContext& context = {},
                                                    SequenceLayout layout = SequenceLayout::kAuto);

// The same on q, k and v packed as this rank's [B, N / P, 3, H, D] block (a QKV projection's
// output): differentiable in `qkv`, with one packed gradient (see
// dilated_attention_qkv_with_lse).
RingAttentionResult ring_dilated_attention_qkv_with_lse(const Tensor& qkv,
                                                        const DilatedAttentionOptions& options,
                                                        dist::Communicator& comm,
                                                        DistStrategy strategy = DistStrategy::kAuto,
                                                        const AttentionCallContext& context = {},
                                                        SequenceLayout layout = SequenceLayout::kAuto);


// The output only.
Tensor ring_dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const DilatedAttentionOptions& options, dist::Communicator& comm,
                              DistStrategy strategy = DistStrategy::kAuto,
                              const AttentionCallContext& context = {},
                              SequenceLayout layout = SequenceLayout::kAuto);

}  // namespace rd::nn
