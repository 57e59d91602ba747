// The language model rd_train trains: a decoder-only transformer whose blocks attend with
// causal dilated attention, on one device or sequence-parallel across ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/dilated_decode.h"
#include "ringdilated/nn/embedding.h"
#include "ringdilated/nn/mlp.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/nn/norm.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/generator.h"

namespace rd::train {

struct ModelConfig {
  int64_t vocab_size = 259;
  int64_t dim = 128;
  int64_t depth = 2;
  int64_t heads = 4;
  // Key/value heads (grouped-query attention: every heads / kv_heads query heads share one);
  // 0 means heads.
  int64_t kv_heads = 0;
  // The MLP's hidden width is mlp_ratio * dim (for SwiGLU, 2/3 of that, as in Llama, so
  // both activations cost about the same), rounded up to a multiple of 8.
  double mlp_ratio = 4.0;
  nn::MLPActivation mlp = nn::MLPActivation::kSwiGLU;
  // Segment lengths, dilation rates, variant, mixing; `causal` is always set. Every segment
  // length must divide the sequence length the model is run on.
  nn::DilatedAttentionOptions attention;
  double rope_base = 10000.0;
  double init_std = 0.02;
  // Recompute each block's activations in the backward instead of keeping them.
  bool recompute = false;
  // With recompute: the MLP (and its norm) runs over chunks of at most this many tokens of
  // the sequence, each recomputed on its own, so its hidden activations (the block's widest
  // tensors, [T, hidden] twice for SwiGLU) exist for one chunk at a time. It costs one more
  // MLP forward per step; 0 runs the whole sequence at once.
  int64_t mlp_chunk_tokens = 0;
};

// Checks a configuration; throws rd::Error naming the field.
void check_model_config(const ModelConfig& config);

// The hidden width of the MLP of `config` (see ModelConfig::mlp_ratio).
int64_t mlp_hidden(const ModelConfig& config);

// The model's attention: the configured pattern, causal.
nn::DilatedAttentionOptions causal_attention(const ModelConfig& config);

// One pre-norm block: x + attn(norm1(x)), then + mlp(norm2(.)). Children "attn_norm",
// "attn" (the multi-head dilated attention, or its sequence-parallel form), "mlp_norm",
// "mlp".
class TransformerBlock : public nn::UnaryModule {
 public:
  // `plans`: the rank plan cache the block's attention shares with the model's other
  // blocks (they plan alike); null: its own.
  TransformerBlock(const ModelConfig& config, Generator& generator, TensorOptions options,
                   std::shared_ptr<dist::Communicator> sequence_comm, nn::DistStrategy strategy,
                   nn::SequenceLayout layout, std::shared_ptr<nn::RankPlanCache> plans = nullptr);
  Tensor forward(const Tensor& x) override { return forward_documents(x, nullptr); }
  // forward() attending within the documents of packed sequences (null: none; see
  // nn::AttentionCallContext::document_starts).
  Tensor forward_documents(const Tensor& x, const nn::DocumentStarts* documents);
  // x [B, T, E] at positions cache.length() .. + T - 1 (see
  // MultiheadDilatedAttention::forward_cached); no recomputation, no MLP chunks.
  Tensor forward_cached(const Tensor& x, nn::DilatedKVCache& cache);
  nn::DilatedKVCache make_cache(int64_t batch, int64_t capacity) const {
    return attn_->make_cache(batch, capacity);
  }

 private:
  // h + mlp(mlp_norm(h)) over sequence chunks of mlp_chunk_tokens_ tokens, each recomputed
  // in the backward pass (long sequences: one chunk's MLP activations at a time).
  Tensor chunked_mlp_residual(const Tensor& h);

  int64_t mlp_chunk_tokens_;
  std::shared_ptr<nn::RMSNorm> attn_norm_;
  std::shared_ptr<nn::MultiheadDilatedAttention> attn_;
  std::shared_ptr<nn::RMSNorm> mlp_norm_;
  std::shared_ptr<nn::MLP> mlp_;
};

// tokens [B, T] -> logits [B, T, vocab]. Children: "embed" (token embedding, also the
// output head: logits = norm(x) embed.weight^T), "blocks.<i>", "norm".
//
// With a sequence communicator of P ranks the model runs context parallel: each rank passes
// its rows of the T tokens under `layout` (nn::SequenceLayout: kAuto is zigzag, the
// attention being causal, when 2P divides T) and gets their logits; attention is the
// sequence-parallel form (rotary positions are global), everything else is per token.
//
// Initialization (GPT-2 style, documented in docs/training.md): every Linear weight and the
// embedding ~ N(0, init_std); the residual projections (attention "out", MLP "fc2"/"down")
// ~ N(0, init_std / sqrt(2 depth)); biases 0; norm weights 1.
class LanguageModel : public nn::Module {
 public:
  LanguageModel(const ModelConfig& config, Generator& generator, TensorOptions options = {},
                std::shared_ptr<dist::Communicator> sequence_comm = nullptr,
                nn::DistStrategy strategy = nn::DistStrategy::kAuto,
                nn::SequenceLayout layout = nn::SequenceLayout::kAuto);

  // `documents`: for packed sequences, per batch row the global positions where its
  // documents start (Batch::documents); attention stays within each document. Null: none.
  Tensor forward(const Tensor& tokens, const nn::DocumentStarts* documents = nullptr);

  // Incremental decoding on one device: one KV cache per block. tokens [B, T] are positions
  // state.length() .. + T - 1; returns their logits [B, T, vocab], equal to those rows of
  // forward() on the whole sequence so far, at a cost per new token bounded by the
  // attention pattern's selected positions rather than the prefix.
  struct DecodeState {
    std::vector<nn::DilatedKVCache> caches;  // one per block
    int64_t length() const { return caches.empty() ? 0 : caches.front().length(); }
  };
  DecodeState start_decoding(int64_t batch, int64_t capacity) const;
  Tensor forward_cached(const Tensor& tokens, DecodeState& state);

  const ModelConfig& config() const { return config_; }
  int64_t num_parameters() const;
  // The rank plans every block's attention shares: the blocks plan alike, so a batch's call
  // is planned once for all of them and their recomputed forwards.
  const nn::RankPlanCache& plan_cache() const { return *plans_; }

 private:
  ModelConfig config_;
  std::shared_ptr<nn::RankPlanCache> plans_ = std::make_shared<nn::RankPlanCache>();
  std::shared_ptr<nn::Embedding> embed_;
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
  std::shared_ptr<nn::RMSNorm> norm_;
};

// Matmul and attention FLOPs of one forward+backward over `tokens_per_sequence` tokens of
// one sequence (3x the forward: matmuls 2 * params-in-matmuls per token, attention
// 4 * D per attended (query, key) pair per head, counting only pairs the pattern visits).
double train_flops_per_sequence(const ModelConfig& config, int64_t seq_len);

}  // namespace rd::train
