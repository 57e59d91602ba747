// RingDilatedAttention and RingMultiheadDilatedAttention (see ring_dilated_attention_modules.h).
#include "ringdilated/nn/ring_dilated_attention_modules.h"

#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {

RingDilatedAttention::RingDilatedAttention(DilatedAttentionOptions options,
                                           std::shared_ptr<dist::Communicator> comm,
                                           DistStrategy strategy, uint64_t dropout_seed,
                                           SequenceLayout layout)
    : options_(std::move(options)),
      comm_(std::move(comm)),
      strategy_(strategy),
      layout_(layout),
      dropout_generator_(*this, "dropout_state", dropout_seed) {
  RD_CHECK(comm_ != nullptr, kInvalidArgument, "RingDilatedAttention: argument 'comm' is null");
  validate_options(options_, static_cast<int64_t>(options_.segment_lengths.size()));
}

RingAttentionResult RingDilatedAttention::forward_with_lse(const Tensor& q, const Tensor& k,
                                                           const Tensor& v) {
  return with_context([&](const AttentionCallContext& context) {
    return ring_dilated_attention_with_lse(q, k, v, options_, *comm_, strategy_, context, layout_);
  });
}

RingAttentionResult RingDilatedAttention::forward_packed(const Tensor& qkv) {
  return with_context([&](const AttentionCallContext& context) {
    return ring_dilated_attention_qkv_with_lse(qkv, options_, *comm_, strategy_, context, layout_);
  });
}

SequenceLayout RingDilatedAttention::layout_for(int64_t seq_len) const {
  return resolve_layout(layout_, options_, seq_len, comm_->size());
}

std::vector<Block> RingDilatedAttention::pieces_for(int64_t seq_len) const {
  return sequence_pieces(layout_for(seq_len), seq_len, comm_->rank(), comm_->size());
}

RingMultiheadDilatedAttention::RingMultiheadDilatedAttention(
    int64_t embed_dim, int64_t num_heads, DilatedAttentionOptions options,
    std::shared_ptr<dist::Communicator> comm, Generator& generator, DistStrategy strategy,
    const MultiheadOptions& module_options, SequenceLayout layout)
    : embed_dim_(embed_dim), num_heads_(num_heads), rope_base_(module_options.rope_base) {
  RD_CHECK(embed_dim >= 1 && num_heads >= 1 && embed_dim % num_heads == 0, kInvalidArgument,
           "RingMultiheadDilatedAttention: embed_dim (", embed_dim,
           ") must be a positive multiple of num_heads (", num_heads, ")");
  attention_modules_internal::check_rope(rope_base_, embed_dim / num_heads,
                                         "RingMultiheadDilatedAttention");
  validate_options(options, num_heads);
  TensorOptions t = module_options.tensor_options;
  if (module_options.use_recommended_dtype) t.dtype = recommended_dtype(t.device);
  // The same draws in the same order as MultiheadDilatedAttention: one generator state
  // gives the same weights in both, so a one-rank module is the single-device one.
  qkv_ = register_module("qkv", std::make_shared<Linear>(embed_dim, 3 * embed_dim,
                                                          module_options.bias, generator, t));
  attention_ = register_module("attention", std::make_shared<RingDilatedAttention>(
                                                std::move(options), std::move(comm), strategy,
                                                split_seed(generator), layout));
  out_ = register_module("out", std::make_shared<Linear>(embed_dim, embed_dim,
                                                          module_options.bias, generator, t));
}

Tensor RingMultiheadDilatedAttention::forward(const Tensor& x) {
  RD_CHECK(x.defined() && x.dim() == 3 && x.size(2) == embed_dim_, kShapeMismatch,
           "RingMultiheadDilatedAttention: input must be this rank's block [B, N / P, ",
           embed_dim_, "], got shape ",
           x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  const int64_t batch = x.size(0), block = x.size(1);
  const Tensor qkv =
      qkv_->forward(x).view({batch, block, 3, num_heads_, embed_dim_ / num_heads_});
  // Global positions: the runs of the sequence this rank holds under the layout.
  std::vector<PositionRun> positions;
  for (const Block& b : attention_->pieces_for(block * attention_->communicator().size())) {
    positions.push_back({b.size(), b.begin});
  }
  const Tensor attended =
      attention_
          ->forward_packed(attention_modules_internal::rotated_qkv(qkv, rope_base_, positions))
          .attention.out;
  return out_->forward(attended.reshape({batch, block, embed_dim_}));
}

}  // namespace rd::nn
