// Sequence-parallel modules: RingDilatedAttention and RingMultiheadDilatedAttention are
// DilatedAttention and MultiheadDilatedAttention over this rank's block of the sequence and
// a communicator (one engine); with one rank they are the single-device modules.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/ring_dilated_attention.h"

namespace rd::nn {

// Dilated attention of this rank's [B, N / P, H, D] blocks of q, k and v (see
// ring_dilated_attention_with_lse). Every rank builds one with the same options and seed.
// Dropout's generator is mirrored into the host buffer "dropout_state", as in
// DilatedAttention. The communicator must outlive the module and every backward through it.
class RingDilatedAttention : public DilatedAttention {
 public:
  // `layout`: how the ranks split the sequence (SequenceLayout; kAuto: zigzag for causal
  // attention when 2P divides N). Callers split their inputs with layout_for / pieces_for.
  RingDilatedAttention(DilatedAttentionOptions options, std::shared_ptr<dist::Communicator> comm,
                       DistStrategy strategy = DistStrategy::kAuto, uint64_t dropout_seed = 0,
                       SequenceLayout layout = SequenceLayout::kAuto);
  RingAttentionResult forward_with_lse(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const DocumentStarts* documents = nullptr) {
    return attend(q, k, v, documents);
  }
  // This rank's [B, N / P, 3, H, D] block of packed q, k and v.
  RingAttentionResult forward_packed(const Tensor& qkv, const DocumentStarts* documents = nullptr) {
    return attend_packed(qkv, documents);
  }
  DistStrategy strategy() const { return strategy_; }
  // The resolved layout for a sequence of seq_len positions.
  SequenceLayout layout_for(int64_t seq_len) const;
  dist::Communicator& communicator() const { return *comm_; }
};

// [B, N / P, E] -> [B, N / P, E] on this rank's rows (split by `layout`, whose pieces also
// give the rotary positions): QKV projection, sequence-parallel dilated attention, output
// projection. Children and draws from `generator` are those of MultiheadDilatedAttention, so
// ranks whose generators hold one state build the same weights and dropout stream, and a
// one-rank module equals the single-device one.
class RingMultiheadDilatedAttention : public MultiheadDilatedAttention {
 public:
  RingMultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads,
                                DilatedAttentionOptions options,
                                std::shared_ptr<dist::Communicator> comm, Generator& generator,
                                DistStrategy strategy = DistStrategy::kAuto,
                                const MultiheadOptions& module_options = {},
                                SequenceLayout layout = SequenceLayout::kAuto);
  const RingDilatedAttention& attention() const {
    return static_cast<const RingDilatedAttention&>(attention_module());
  }
  SequenceLayout layout_for(int64_t seq_len) const { return attention().layout_for(seq_len); }
};

}  // namespace rd::nn
