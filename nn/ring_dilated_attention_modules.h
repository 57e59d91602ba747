// Sequence-parallel modules: RingDilatedAttention and RingMultiheadDilatedAttention take
// this rank's block of the sequence and a communicator; with one rank they are
// DilatedAttention and MultiheadDilatedAttention.
#pragma once

#include <cstdint>
#include <memory>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/ring_dilated_attention.h"

namespace rd::nn {

// Dilated attention of this rank's [B, N / P, H, D] blocks of q, k and v (see
// ring_dilated_attention_with_lse). Every rank builds one with the same options and seed.
// Dropout's generator is mirrored into the host buffer "dropout_state", as in
// DilatedAttention.
// The communicator must outlive the module and every backward through it.
class RingDilatedAttention : public Module {
 public:
  // `layout`: how the ranks split the sequence (SequenceLayout; kAuto: zigzag for causal
  // attention when 2P divides N). Callers split their inputs with layout_for / pieces_for.
  RingDilatedAttention(DilatedAttentionOptions options, std::shared_ptr<dist::Communicator> comm,
                       DistStrategy strategy = DistStrategy::kAuto, uint64_t dropout_seed = 0,
                       SequenceLayout layout = SequenceLayout::kAuto);
  RingAttentionResult forward_with_lse(const Tensor& q, const Tensor& k, const Tensor& v);
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v) {
    return forward_with_lse(q, k, v).attention.out;
  }
  // This rank's [B, N / P, 3, H, D] block of packed q, k and v.
  RingAttentionResult forward_packed(const Tensor& qkv);
  const DilatedAttentionOptions& options() const { return options_; }
  DistStrategy strategy() const { return strategy_; }
  // The resolved layout for a sequence of seq_len positions, and this rank's pieces of it.
  SequenceLayout layout_for(int64_t seq_len) const;
  std::vector<Block> pieces_for(int64_t seq_len) const;
  dist::Communicator& communicator() const { return *comm_; }
  PatternCache& pattern_cache() const { return *patterns_; }
  // The live dropout generator, e.g. for rd::checkpoint's list of generators to rewind.
  Generator& dropout_generator() { return dropout_generator_.generator(); }

 protected:
  void on_state_loaded() override { dropout_generator_.reload(); }

 private:
  template <class Call>
  auto with_context(Call&& call) {
    return attention_modules_internal::with_attention_context(
        is_training(), options_.dropout, dropout_generator_, patterns_.get(), call);
  }

  DilatedAttentionOptions options_;
  std::shared_ptr<dist::Communicator> comm_;
  DistStrategy strategy_;
  SequenceLayout layout_;
  BufferedGenerator dropout_generator_;
  std::unique_ptr<PatternCache> patterns_ = std::make_unique<PatternCache>();
};

// [B, N / P, E] -> [B, N / P, E] on this rank's rows (split by `layout`, whose pieces also
// give the rotary positions): QKV projection, sequence-parallel dilated attention, output
// projection. Children and draws from `generator` are those of
// MultiheadDilatedAttention, so ranks whose generators hold one state build the same
// weights and dropout stream, and a one-rank module equals the single-device one.
class RingMultiheadDilatedAttention : public UnaryModule {
 public:
  RingMultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads,
                                DilatedAttentionOptions options,
                                std::shared_ptr<dist::Communicator> comm, Generator& generator,
                                DistStrategy strategy = DistStrategy::kAuto,
                                const MultiheadOptions& module_options = {},
                                SequenceLayout layout = SequenceLayout::kAuto);
  Tensor forward(const Tensor& x) override;
  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  const RingDilatedAttention& attention() const { return *attention_; }
  SequenceLayout layout_for(int64_t seq_len) const { return attention_->layout_for(seq_len); }

 private:
  int64_t embed_dim_;
  int64_t num_heads_;
  std::shared_ptr<Linear> qkv_;
  std::shared_ptr<RingDilatedAttention> attention_;
  std::shared_ptr<Linear> out_;
  double rope_base_;
};

}  // namespace rd::nn
