// Modules around dilated_attention(): DilatedAttention (no projections) and
// MultiheadDilatedAttention (QKV and output projections), plus the compute-dtype advice.
#pragma once

#include <cstdint>
#include <memory>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/linear.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/generator.h"

namespace rd::nn {

// The dtype to compute attention in on `device`: bfloat16 on sm_80 and newer, float16 on
// sm_70/sm_75, float32 on the CPU and older GPUs.
DType recommended_dtype(Device device);

// Dilated attention of [B, N, H, D] q, k, v; dropout draws from the module's generator
// (seeded by `dropout_seed`) in training mode. Index patterns (cycled lists, Hilbert orders)
// live in the module's own cache, so one module's working set cannot evict another's.
class DilatedAttention : public Module {
 public:
  explicit DilatedAttention(DilatedAttentionOptions options, uint64_t dropout_seed = 0);
  DilatedAttentionResult forward_with_lse(const Tensor& q, const Tensor& k, const Tensor& v);
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v) {
    return forward_with_lse(q, k, v).out;
  }
  // The output for q, k, v packed as one [B, N, 3, H, D] tensor (see
  // dilated_attention_qkv_with_lse).
  Tensor forward_packed(const Tensor& qkv);
  const DilatedAttentionOptions& options() const { return options_; }
  // The path the last forward took.
  AttentionPath last_path() const { return last_path_; }
  // The module's pattern cache (thread-safe; its stats show hits and misses).
  PatternCache& pattern_cache() const { return *patterns_; }

 private:
  DilatedAttentionOptions options_;
  Generator dropout_generator_;
  AttentionPath last_path_ = AttentionPath::kAuto;
  std::unique_ptr<PatternCache> patterns_ = std::make_unique<PatternCache>();
};

struct MultiheadOptions {
  bool bias = true;
  // Parameters' dtype and device. With use_recommended_dtype, the projections and attention
  // run in recommended_dtype(device) instead of `dtype`.
  TensorOptions tensor_options{};
  bool use_recommended_dtype = false;
  uint64_t seed = 0;  // parameter init and dropout
};

// [B, N, E] -> [B, N, E]: x -> (q, k, v) = split(x W_qkv^T + b) into H heads of E / H ->
// dilated attention -> output projection. q, k and v are strided views of the one QKV
// projection output, read in place by the attention kernels.
class MultiheadDilatedAttention : public Module {
 public:
  MultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads, DilatedAttentionOptions options,
                            bool bias = true);
  MultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads, DilatedAttentionOptions options,
                            const MultiheadOptions& module_options);

  Tensor forward(const Tensor& x);
  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  const DilatedAttentionOptions& options() const { return attention_->options(); }
  AttentionPath last_path() const { return attention_->last_path(); }
  PatternCache& pattern_cache() const { return attention_->pattern_cache(); }

 private:
  int64_t embed_dim_;
  int64_t num_heads_;
  std::shared_ptr<Linear> qkv_;
  std::shared_ptr<DilatedAttention> attention_;
  std::shared_ptr<Linear> out_;
};

}  // namespace rd::nn
