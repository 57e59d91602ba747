// LanguageModel: embedding, pre-norm dilated-attention blocks, final norm, tied head; its
// GPT-2 style initialization and FLOP count.
#include "ringdilated/train/model.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/containers.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/init.h"
#include "ringdilated/nn/ring_dilated_attention_modules.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/recompute.h"

namespace rd::train {
namespace {

constexpr const char* kOp = "LanguageModel";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The projections that write into the residual stream get the smaller GPT-2 init.
bool is_residual_projection(const std::string& name) {
  return ends_with(name, "attn.out.weight") || ends_with(name, "mlp.fc2.weight") ||
         ends_with(name, "mlp.down.weight");
}

}  // namespace

nn::DilatedAttentionOptions causal_attention(const ModelConfig& config) {
  nn::DilatedAttentionOptions o = config.attention;
  o.causal = true;
  return o;
}

void check_model_config(const ModelConfig& c) {
  RD_CHECK(c.vocab_size >= 2, kInvalidArgument, kOp, ": vocab_size must be >= 2, got ",
           c.vocab_size);
  RD_CHECK(c.dim >= 1 && c.heads >= 1 && c.depth >= 1, kInvalidArgument, kOp,
           ": dim, heads and depth must be >= 1, got dim ", c.dim, ", heads ", c.heads, ", depth ",
           c.depth);
  RD_CHECK(c.dim % c.heads == 0, kInvalidArgument, kOp, ": dim ", c.dim,
           " must be a multiple of heads ", c.heads);
  RD_CHECK(c.kv_heads >= 0 && (c.kv_heads == 0 || c.heads % c.kv_heads == 0), kInvalidArgument, kOp,
           ": kv_heads ", c.kv_heads, " must divide heads ", c.heads, " (or be 0: heads)");
  RD_CHECK((c.dim / c.heads) % 2 == 0, kInvalidArgument, kOp,
           ": the head dim dim / heads = ", c.dim / c.heads, " must be even for rotary positions");
  RD_CHECK(c.mlp_ratio > 0 && std::isfinite(c.mlp_ratio), kInvalidArgument, kOp,
           ": mlp_ratio must be > 0, got ", c.mlp_ratio);
  RD_CHECK(c.mlp_chunk_tokens >= 0, kInvalidArgument, kOp, ": mlp_chunk_tokens must be >= 0, got ",
           c.mlp_chunk_tokens);
  RD_CHECK(c.rope_base > 1 && std::isfinite(c.rope_base), kInvalidArgument, kOp,
           ": rope_base must be > 1, got ", c.rope_base);
  RD_CHECK(c.init_std > 0 && std::isfinite(c.init_std), kInvalidArgument, kOp,
           ": init_std must be > 0, got ", c.init_std);
  nn::validate_options(causal_attention(c), c.heads);
}

int64_t mlp_hidden(const ModelConfig& c) {
  double hidden = c.mlp_ratio * static_cast<double>(c.dim);
  if (c.mlp == nn::MLPActivation::kSwiGLU) hidden = hidden * 2.0 / 3.0;
  const auto rounded = static_cast<int64_t>(std::ceil(hidden / 8.0)) * 8;
  return std::max<int64_t>(rounded, 8);
}

TransformerBlock::TransformerBlock(const ModelConfig& config, Generator& generator,
                                   TensorOptions options,
                                   std::shared_ptr<dist::Communicator> sequence_comm,
                                   nn::DistStrategy strategy, nn::SequenceLayout layout,
                                   std::shared_ptr<nn::RankPlanCache> plans) {
  attn_norm_ =
      register_module("attn_norm", std::make_shared<nn::RMSNorm>(config.dim, 1e-6, true, options));
  nn::MultiheadOptions mo;
  mo.bias = false;
  mo.tensor_options = options;
  mo.rope_base = config.rope_base;
  mo.num_kv_heads = config.kv_heads;
  if (sequence_comm) {
    attn_ = register_module("attn", std::make_shared<nn::RingMultiheadDilatedAttention>(
                                        config.dim, config.heads, causal_attention(config),
                                        std::move(sequence_comm), generator, strategy, mo, layout));
  } else {
    attn_ = register_module("attn",
                            std::make_shared<nn::MultiheadDilatedAttention>(
                                config.dim, config.heads, causal_attention(config), generator, mo));
  }
  if (plans != nullptr) attn_->share_plan_cache(std::move(plans));
  mlp_chunk_tokens_ = config.recompute ? config.mlp_chunk_tokens : 0;
  mlp_norm_ =
      register_module("mlp_norm", std::make_shared<nn::RMSNorm>(config.dim, 1e-6, true, options));
  mlp_ =
      register_module("mlp", std::make_shared<nn::MLP>(config.dim, mlp_hidden(config), config.mlp,
                                                       /*bias=*/false, generator, options));
}

Tensor TransformerBlock::forward_documents(const Tensor& x, const nn::DocumentStarts* documents) {
  const Tensor attended = attn_->forward_documents(attn_norm_->forward(x), documents);
  const int64_t tokens = x.size(1);
  if (mlp_chunk_tokens_ > 0 && tokens > mlp_chunk_tokens_) {
    return chunked_mlp_residual(add(x, attended));
  }
  // The residual add and the MLP's norm in one kernel.
  const AddNormResult h = mlp_norm_->forward_add(attended, x);
  return add(h.sum, mlp_->forward(h.out));
}

Tensor TransformerBlock::forward_cached(const Tensor& x, nn::DilatedKVCache& cache) {
  const Tensor attended = attn_->forward_cached(attn_norm_->forward(x), cache);
  const AddNormResult h = mlp_norm_->forward_add(attended, x);
  return add(h.sum, mlp_->forward(h.out));
}

Tensor TransformerBlock::chunked_mlp_residual(const Tensor& h) {
  const auto mlp_of = [this](const Tensor& t) { return mlp_->forward(mlp_norm_->forward(t)); };
  const int64_t tokens = h.size(1);
  // The MLP acts on each token alone, so chunks of the sequence give the same result.
  const bool keep_graph = autograd::grad_enabled();
  // Every chunk reads the same weights: their gradients leave through the chunks' nodes, so
  // the pass sums them and each weight's gradient arrives once (one all-reduce per step).
  std::vector<Tensor> weights = mlp_norm_->parameters();
  for (const Tensor& w : mlp_->parameters()) weights.push_back(w);
  std::vector<Tensor> parts;
  for (int64_t start = 0; start < tokens; start += mlp_chunk_tokens_) {
    const Tensor piece = h.narrow(1, start, std::min(mlp_chunk_tokens_, tokens - start));
    if (!keep_graph) {
      parts.push_back(mlp_of(piece));
      continue;
    }
    parts.push_back(recompute(
        [mlp_of](const std::vector<Tensor>& in) { return std::vector<Tensor>{mlp_of(in[0])}; },
        {piece}, {}, weights)[0]);
  }
  return add(h, cat(parts, 1));
}

LanguageModel::LanguageModel(const ModelConfig& config, Generator& generator, TensorOptions options,
                             std::shared_ptr<dist::Communicator> sequence_comm,
                             nn::DistStrategy strategy, nn::SequenceLayout layout)
    : config_(config) {
  check_model_config(config);
  embed_ = register_module(
      "embed", std::make_shared<nn::Embedding>(config.vocab_size, config.dim, generator, options));
  auto blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < config.depth; ++i) {
    blocks_.push_back(blocks->push_back(std::make_shared<TransformerBlock>(
        config, generator, options, sequence_comm, strategy, layout, plans_)));
  }
  norm_ = register_module("norm", std::make_shared<nn::RMSNorm>(config.dim, 1e-6, true, options));
  // GPT-2 initialization, drawn after construction in parameter order (one generator
  // reproduces the model).
  const double residual_std = config.init_std / std::sqrt(2.0 * static_cast<double>(config.depth));
  for (auto& [name, param] : named_parameters()) {
    if (param.dim() < 2) continue;  // norm weights keep 1; the model has no biases
    const double std = is_residual_projection(name) ? residual_std : config.init_std;
    Tensor p = param;
    autograd::NoGradGuard no_grad;
    p.copy_(nn::normal_init(param.shape(), std, generator,
                            TensorOptions(param.dtype()).with_device(param.device())));
  }
}

Tensor LanguageModel::forward(const Tensor& tokens, const nn::DocumentStarts* documents) {
  RD_CHECK(tokens.defined() && tokens.dim() == 2, kShapeMismatch, kOp,
           ": argument 'tokens' must be [B, T] integers, got ",
           tokens.defined() ? shape_str(tokens.shape()) : std::string("undefined"));
  Tensor x = embed_->forward(tokens);
  // The recomputing backward runs after this call returns: it keeps its own copy.
  const auto kept_documents =
      documents != nullptr ? std::make_shared<const nn::DocumentStarts>(*documents) : nullptr;
  for (const std::shared_ptr<TransformerBlock>& block : blocks_) {
    if (config_.recompute && is_training() && autograd::grad_enabled()) {
      TransformerBlock* b = block.get();
      // The block's parameters get their gradients through the recompute node (once per
      // step, whatever the block recomputes inside), as gradient buckets require.
      x = recompute(
          [b, kept_documents](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{b->forward_documents(in[0], kept_documents.get())};
          },
          {x}, {}, b->parameters())[0];
    } else {
      x = block->forward_documents(x, documents);
    }
  }
  return linear(norm_->forward(x), embed_->weight());
}

LanguageModel::DecodeState LanguageModel::start_decoding(int64_t batch, int64_t capacity) const {
  DecodeState state;
  for (const std::shared_ptr<TransformerBlock>& block : blocks_) {
    state.caches.push_back(block->make_cache(batch, capacity));
  }
  return state;
}

Tensor LanguageModel::forward_cached(const Tensor& tokens, DecodeState& state) {
  RD_CHECK(tokens.defined() && tokens.dim() == 2, kShapeMismatch, kOp,
           ": argument 'tokens' must be [B, T] integers, got ",
           tokens.defined() ? shape_str(tokens.shape()) : std::string("undefined"));
  RD_CHECK(state.caches.size() == blocks_.size(), kInvalidArgument, kOp,
           ": the decoding state has ", state.caches.size(), " caches for ", blocks_.size(),
           " blocks (make it with start_decoding)");
  Tensor x = embed_->forward(tokens);
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward_cached(x, state.caches[i]);
  return linear(norm_->forward(x), embed_->weight());
}

int64_t LanguageModel::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

double train_flops_per_sequence(const ModelConfig& c, int64_t seq_len) {
  const double n = static_cast<double>(seq_len), d = static_cast<double>(c.dim);
  const double hidden = static_cast<double>(mlp_hidden(c));
  const double mlp_mats = c.mlp == nn::MLPActivation::kSwiGLU ? 3.0 : 2.0;
  // Per token and layer: QKV (d^2 + 2 d kv_width) + out (d^2) + MLP; then the head
  // (vocab x d). kv_width = d under plain attention, d kv_heads / heads under grouped-query.
  const double kv_width =
      c.kv_heads > 0 ? d * static_cast<double>(c.kv_heads) / static_cast<double>(c.heads) : d;
  const double matmul_params =
      static_cast<double>(c.depth) * (2.0 * d * d + 2.0 * d * kv_width + mlp_mats * d * hidden) +
      static_cast<double>(c.vocab_size) * d;
  const double matmul = 2.0 * matmul_params * n;
  // Attended (query, key) pairs per head and layer, causal: per pair i, segments of w_i
  // (the whole sequence for the global variant's cycled list) hold w_i / r_i selected
  // rows, each attending to those at or before it.
  const nn::DilatedAttentionOptions& a = c.attention;
  const double heads = static_cast<double>(c.heads);
  const double groups = static_cast<double>(a.segment_lengths.size());
  double pairs = 0;  // summed over heads
  for (size_t i = 0; i < a.segment_lengths.size(); ++i) {
    const double r = static_cast<double>(a.dilation_rates[i]);
    const bool global = a.variant == nn::DilationVariant::kGlobal;
    const double w = global ? n : std::min(n, static_cast<double>(a.segment_lengths[i]));
    const double rows = global ? w : w / r;  // the global list is N rows long
    const double per_head = (n / w) * rows * (rows + 1.0) / 2.0;
    const double heads_on_pair = a.mixing == nn::HeadMixing::kAllHeads ? heads : heads / groups;
    pairs += per_head * heads_on_pair;
  }
  const double head_dim = d / heads;
  const double attention = 4.0 * head_dim * pairs * static_cast<double>(c.depth);
  return 3.0 * (matmul + attention);
}

}  // namespace rd::train
