// DilatedAttention and MultiheadDilatedAttention (see dilated_attention_modules.h).
#include "ringdilated/nn/dilated_attention_modules.h"

#include <cmath>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

int64_t checked_head_dim(int64_t embed_dim, int64_t num_heads) {
  RD_CHECK(embed_dim >= 1 && num_heads >= 1 && embed_dim % num_heads == 0, kInvalidArgument,
           "MultiheadDilatedAttention: embed_dim (", embed_dim,
           ") must be a positive multiple of num_heads (", num_heads, ")");
  return embed_dim / num_heads;
}

TensorOptions module_tensor_options(const MultiheadOptions& o) {
  TensorOptions t = o.tensor_options;
  if (o.use_recommended_dtype) t.dtype = recommended_dtype(t.device);
  return t;
}

}  // namespace

DType recommended_dtype(Device device) {
  if (device.is_cpu()) return DType::kFloat32;
  const int capability = cuda_compute_capability(device);
  if (capability >= 80) return DType::kBFloat16;
  if (capability >= 70) return DType::kFloat16;
  return DType::kFloat32;
}

DilatedAttention::DilatedAttention(DilatedAttentionOptions options, uint64_t dropout_seed)
    : options_(std::move(options)),
      dropout_generator_(*this, "dropout_state", dropout_seed) {
  // Head counts are only known per call; check what can be checked now.
  validate_options(options_, static_cast<int64_t>(options_.segment_lengths.size()));
}

DilatedAttentionResult DilatedAttention::forward_with_lse(const Tensor& q, const Tensor& k,
                                                          const Tensor& v) {
  DilatedAttentionResult result = with_context([&](const AttentionCallContext& context) {
    return dilated_attention_with_lse(q, k, v, options_, context);
  });
  last_path_ = result.path_used;
  return result;
}

Tensor DilatedAttention::forward_packed(const Tensor& qkv) {
  DilatedAttentionResult result = with_context([&](const AttentionCallContext& context) {
    return dilated_attention_qkv_with_lse(qkv, options_, context);
  });
  last_path_ = result.path_used;
  return result.out;
}

MultiheadDilatedAttention::MultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads,
                                                     DilatedAttentionOptions options,
                                                     Generator& generator,
                                                     const MultiheadOptions& module_options)
    : embed_dim_(embed_dim), num_heads_(num_heads), rope_base_(module_options.rope_base) {
  checked_head_dim(embed_dim, num_heads);
  attention_modules_internal::check_rope(rope_base_, embed_dim / num_heads, "MultiheadDilatedAttention");
  validate_options(options, num_heads);
  const TensorOptions t = module_tensor_options(module_options);
  qkv_ = register_module("qkv", std::make_shared<Linear>(embed_dim, 3 * embed_dim,
                                                          module_options.bias, generator, t));
  attention_ = register_module(
      "attention", std::make_shared<DilatedAttention>(std::move(options), split_seed(generator)));
  out_ = register_module("out", std::make_shared<Linear>(embed_dim, embed_dim,
                                                          module_options.bias, generator, t));
}

namespace attention_modules_internal {

void check_rope(double rope_base, int64_t head_dim, const char* module) {
  RD_CHECK(rope_base == 0.0 || (rope_base > 1.0 && std::isfinite(rope_base)), kInvalidArgument,
           module, ": rope_base must be 0 (no rotary positions) or > 1, got ", rope_base);
  RD_CHECK(rope_base == 0.0 || head_dim % 2 == 0, kInvalidArgument, module,
           ": rotary positions need an even head dim, got ", head_dim);
}

Tensor rotated_qkv(const Tensor& qkv, double rope_base, int64_t position_offset) {
  return rope_base > 0 ? rotary_embedding_qkv_overwrite(qkv, position_offset, rope_base) : qkv;
}

Tensor rotated_qkv(const Tensor& qkv, double rope_base, const std::vector<PositionRun>& positions) {
  return rope_base > 0 ? rotary_embedding_qkv_overwrite(qkv, positions, rope_base) : qkv;
}

}  // namespace attention_modules_internal

Tensor MultiheadDilatedAttention::forward(const Tensor& x) {
  RD_CHECK(x.defined() && x.dim() == 3 && x.size(2) == embed_dim_, kShapeMismatch,
           "MultiheadDilatedAttention: input must be [B, N, ", embed_dim_, "], got shape ",
           x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  const int64_t batch = x.size(0), seq_len = x.size(1);
  const int64_t head_dim = embed_dim_ / num_heads_;
  // [B, N, 3E] viewed as [B, N, 3, H, D]: q, k and v are strided views of one buffer (after
  // the rotation, a new one), and their gradient is written into one packed buffer.
  const Tensor qkv = qkv_->forward(x).view({batch, seq_len, 3, num_heads_, head_dim});
  const Tensor attended =
      attention_->forward_packed(attention_modules_internal::rotated_qkv(qkv, rope_base_, 0));
  return out_->forward(attended.reshape({batch, seq_len, embed_dim_}));
}

}  // namespace rd::nn
