// Modules around dilated attention: DilatedAttention (no projections) and
// MultiheadDilatedAttention (QKV and output projections), on one device or, built by their
// Ring* forms (ring_dilated_attention_modules.h), over a communicator's ranks; plus the
// compute-dtype advice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_decode.h"
#include "ringdilated/nn/linear.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/nn/random_state.h"
#include "ringdilated/nn/rank_plan_cache.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {

// The dtype to compute attention in on `device`: bfloat16 on sm_80 and newer, float16 on
// sm_70/sm_75, float32 on the CPU and older GPUs.
DType recommended_dtype(Device device);

namespace attention_modules_internal {

// Runs call(context) with `training`, `patterns`, `plans` and, when dropout is active
// (training and dropout > 0), the module's generator, whose state is then stored in its
// buffer. Without dropout neither is touched, so concurrent eval calls may share a module.
template <class Call>
auto with_attention_context(bool training, double dropout, BufferedGenerator& generator,
                            PatternCache* patterns, RankPlanCache* plans, Call&& call) {
  if (!training || dropout == 0.0) {
    return call(AttentionCallContext{training, nullptr, patterns, plans});
  }
  return generator.use([&](Generator& live) {
    return call(AttentionCallContext{training, &live, patterns, plans});
  });
}

}  // namespace attention_modules_internal

// Dilated attention of [B, N, H, D] q, k, v; dropout draws, in training mode, from the
// module's generator, seeded by `dropout_seed` and mirrored into the host buffer
// "dropout_state" (see BufferedGenerator), so state_dict() saves its position. Index
// patterns (cycled lists, Hilbert orders) live in the module's own cache, so one module's
// working set cannot evict another's. RingDilatedAttention is this module over the ranks of
// a communicator (one engine: a module of one rank is this one).
class DilatedAttention : public Module {
 public:
  explicit DilatedAttention(DilatedAttentionOptions options, uint64_t dropout_seed = 0);
  // `documents`: document masks for packed sequences (AttentionCallContext::document_starts).
  DilatedAttentionResult forward_with_lse(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const DocumentStarts* documents = nullptr) {
    return attend(q, k, v, documents).attention;
  }
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v) {
    return attend(q, k, v).attention.out;
  }
  // The output for q, k, v packed as one [B, N, 3, H, D] tensor (see
  // dilated_attention_qkv_with_lse).
  Tensor forward_packed(const Tensor& qkv, const DocumentStarts* documents = nullptr) {
    return attend_packed(qkv, documents).attention.out;
  }
  const DilatedAttentionOptions& options() const { return options_; }
  // The path the last forward took.
  AttentionPath last_path() const { return last_path_; }
  // The module's pattern cache (thread-safe; its stats show hits and misses).
  PatternCache& pattern_cache() const { return *patterns_; }
  // The cache of rank plans the module's calls reuse (thread-safe), its own unless shared:
  // layers that attend alike (one model's blocks) share one, so that a step plans each
  // batch's documents once (share_plan_cache).
  RankPlanCache& plan_cache() const { return *plans_; }
  void share_plan_cache(std::shared_ptr<RankPlanCache> plans);
  // The live dropout generator, e.g. for rd::checkpoint's list of generators to rewind.
  Generator& dropout_generator() { return dropout_generator_.generator(); }
  // The ranks that split the sequence (1 on one device), and the global positions of this
  // rank's rows of a sequence of seq_len positions, in the order it holds them.
  int ranks() const { return comm_ != nullptr ? comm_->size() : 1; }
  std::vector<Block> pieces_for(int64_t seq_len) const;

 protected:
  // The module over the ranks of `comm` (see RingDilatedAttention).
  DilatedAttention(DilatedAttentionOptions options, uint64_t dropout_seed,
                   std::shared_ptr<dist::Communicator> comm, DistStrategy strategy,
                   SequenceLayout layout);
  void on_state_loaded() override { dropout_generator_.reload(); }
  RingAttentionResult attend(const Tensor& q, const Tensor& k, const Tensor& v,
                             const DocumentStarts* documents = nullptr);
  RingAttentionResult attend_packed(const Tensor& qkv, const DocumentStarts* documents = nullptr);

  DilatedAttentionOptions options_;
  std::shared_ptr<dist::Communicator> comm_;  // null: one device
  DistStrategy strategy_ = DistStrategy::kAuto;
  SequenceLayout layout_ = SequenceLayout::kAuto;

 private:
  template <class Call>
  RingAttentionResult with_context(Call&& call) {
    RingAttentionResult result = attention_modules_internal::with_attention_context(
        is_training(), options_.dropout, dropout_generator_, patterns_.get(), plans_.get(), call);
    last_path_ = result.attention.path_used;
    return result;
  }

  BufferedGenerator dropout_generator_;
  AttentionPath last_path_ = AttentionPath::kAuto;
  std::unique_ptr<PatternCache> patterns_ = std::make_unique<PatternCache>();
  std::shared_ptr<RankPlanCache> plans_ = std::make_shared<RankPlanCache>();
};

struct MultiheadOptions {
  bool bias = true;
  // Parameters' dtype and device. With use_recommended_dtype, the projections and attention
  // run in recommended_dtype(device) instead of `dtype`.
  TensorOptions tensor_options{};
  bool use_recommended_dtype = false;
  // Rotary position embedding (rd::rotary_embedding) of q and k with this base (10000 in
  // most models); 0: none. Positions are global: the sequence-parallel module offsets its
  // block's positions by rank x block length.
  double rope_base = 0.0;
  // Grouped-query attention: key/value heads, dividing num_heads (1: multi-query); 0 means
  // num_heads. The QKV projection is then E -> (H + 2 H_kv) E / H wide.
  int64_t num_kv_heads = 0;
};

// [B, N, E] -> [B, N, E]: x -> (q, k, v) = split(x W_qkv^T + b) into H heads of E / H ->
// dilated attention -> output projection. q, k and v are strided views of the one QKV
// projection output, read in place by the attention kernels.
//
// Children "qkv" (Linear E -> 3E), "attention" (DilatedAttention) and "out" (Linear E -> E).
// Initialization draws from `generator`, in this order: the qkv weights, the attention's
// dropout seed (split_seed), the out weights. Layers built one after another from one
// generator differ, and one seed reproduces the whole model. RingMultiheadDilatedAttention
// is this module over a communicator's ranks, with the same draws.
class MultiheadDilatedAttention : public UnaryModule {
 public:
  MultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads, DilatedAttentionOptions options,
                            Generator& generator, const MultiheadOptions& module_options = {});

  Tensor forward(const Tensor& x) override { return forward_documents(x, nullptr); }
  // forward() with document masks for packed sequences: `documents` (global starts per batch
  // row, AttentionCallContext::document_starts; null: none).
  Tensor forward_documents(const Tensor& x, const DocumentStarts* documents);
  // Incremental decoding (one device, causal options): x [B, T, E] holds positions
  // cache.length() .. + T - 1 of a sequence whose earlier keys and values are in `cache`;
  // appends this layer's keys and values of them and returns their outputs, equal to the
  // rows of forward() over the whole sequence so far. A prompt into an empty cache runs the
  // whole forward once; later rows are decoding steps (dilated_attention_decode_step).
  Tensor forward_cached(const Tensor& x, DilatedKVCache& cache);
  // An empty cache for this layer: `batch` sequences, room for `capacity` positions.
  DilatedKVCache make_cache(int64_t batch, int64_t capacity) const;
  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  const DilatedAttentionOptions& options() const { return attention_->options(); }
  AttentionPath last_path() const { return attention_->last_path(); }
  PatternCache& pattern_cache() const { return attention_->pattern_cache(); }
  RankPlanCache& plan_cache() const { return attention_->plan_cache(); }
  void share_plan_cache(std::shared_ptr<RankPlanCache> plans) {
    attention_->share_plan_cache(std::move(plans));
  }

 protected:
  // Builds the attention child with `make_attention(dropout_seed)` between the two
  // projections (the draw order above); `name` names the module in errors.
  using AttentionFactory = std::function<std::shared_ptr<DilatedAttention>(uint64_t dropout_seed)>;
  MultiheadDilatedAttention(const char* name, int64_t embed_dim, int64_t num_heads,
                            const DilatedAttentionOptions& options, Generator& generator,
                            const MultiheadOptions& module_options,
                            const AttentionFactory& make_attention);
  const DilatedAttention& attention_module() const { return *attention_; }

 private:
  // The packed [B, T, 3, H, D] projection of x, q and k rotated for the global positions
  // `positions` (rows of x in order).
  Tensor projected_qkv(const Tensor& x, const std::vector<PositionRun>& positions);
  // Grouped-query attention: the [B, T, H + 2 H_kv, D] projection, q and k rotated; q, k and
  // v are its head ranges [0, H), [H, H + H_kv), [H + H_kv, H + 2 H_kv).
  Tensor projected_gqa(const Tensor& x, const std::vector<PositionRun>& positions);
  // The attention's output [B, T, H, D] of a GQA projection (projected_gqa).
  Tensor attend_gqa(const Tensor& projected, const DocumentStarts* documents = nullptr);

  const char* name_;
  int64_t embed_dim_;
  int64_t num_heads_;
  int64_t num_kv_heads_;
  std::shared_ptr<Linear> qkv_;
  std::shared_ptr<DilatedAttention> attention_;
  std::shared_ptr<Linear> out_;
  double rope_base_;
};

}  // namespace rd::nn
