// DilatedAttention and MultiheadDilatedAttention (see dilated_attention_modules.h), on one
// device or over a communicator's ranks.
#include "ringdilated/nn/dilated_attention_modules.h"

#include <cmath>
#include <string>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

TensorOptions module_tensor_options(const MultiheadOptions& o) {
  TensorOptions t = o.tensor_options;
  if (o.use_recommended_dtype) t.dtype = recommended_dtype(t.device);
  return t;
}

// Throws rd::Error naming `module` unless rope_base is 0 or > 1 with an even head dim.
void check_rope(double rope_base, int64_t head_dim, const char* module) {
  RD_CHECK(rope_base == 0.0 || (rope_base > 1.0 && std::isfinite(rope_base)), kInvalidArgument,
           module, ": rope_base must be 0 (no rotary positions) or > 1, got ", rope_base);
  RD_CHECK(rope_base == 0.0 || head_dim % 2 == 0, kInvalidArgument, module,
           ": rotary positions need an even head dim, got ", head_dim);
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
    : DilatedAttention(std::move(options), dropout_seed, nullptr, DistStrategy::kAuto,
                       SequenceLayout::kAuto) {}

DilatedAttention::DilatedAttention(DilatedAttentionOptions options, uint64_t dropout_seed,
                                   std::shared_ptr<dist::Communicator> comm, DistStrategy strategy,
                                   SequenceLayout layout)
    : options_(std::move(options)),
      comm_(std::move(comm)),
      strategy_(strategy),
      layout_(layout),
      dropout_generator_(*this, "dropout_state", dropout_seed) {
  // Head counts are only known per call; check what can be checked now.
  validate_options(options_, static_cast<int64_t>(options_.segment_lengths.size()));
}

RingAttentionResult DilatedAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const DocumentStarts* documents) {
  return with_context([&](AttentionCallContext context) {
    context.document_starts = documents;
    if (comm_ != nullptr) {
      return ring_dilated_attention_with_lse(q, k, v, options_, *comm_, strategy_, context,
                                             layout_);
    }
    return RingAttentionResult{dilated_attention_with_lse(q, k, v, options_, context)};
  });
}

RingAttentionResult DilatedAttention::attend_packed(const Tensor& qkv,
                                                    const DocumentStarts* documents) {
  return with_context([&](AttentionCallContext context) {
    context.document_starts = documents;
    if (comm_ != nullptr) {
      return ring_dilated_attention_qkv_with_lse(qkv, options_, *comm_, strategy_, context,
                                                 layout_);
    }
    return RingAttentionResult{dilated_attention_qkv_with_lse(qkv, options_, context)};
  });
}

void DilatedAttention::share_plan_cache(std::shared_ptr<RankPlanCache> plans) {
  RD_CHECK(plans != nullptr, kInvalidArgument,
           "DilatedAttention::share_plan_cache: argument 'plans' is null");
  plans_ = std::move(plans);
}

std::vector<Block> DilatedAttention::pieces_for(int64_t seq_len) const {
  if (comm_ == nullptr) return {{0, seq_len}};
  return sequence_pieces(resolve_layout(layout_, options_, seq_len, comm_->size()), seq_len,
                         comm_->rank(), comm_->size());
}

MultiheadDilatedAttention::MultiheadDilatedAttention(int64_t embed_dim, int64_t num_heads,
                                                     DilatedAttentionOptions options,
                                                     Generator& generator,
                                                     const MultiheadOptions& module_options)
    : MultiheadDilatedAttention(
          "MultiheadDilatedAttention", embed_dim, num_heads, options, generator, module_options,
          [&options](uint64_t seed) { return std::make_shared<DilatedAttention>(options, seed); }) {
}

MultiheadDilatedAttention::MultiheadDilatedAttention(const char* name, int64_t embed_dim,
                                                     int64_t num_heads,
                                                     const DilatedAttentionOptions& options,
                                                     Generator& generator,
                                                     const MultiheadOptions& module_options,
                                                     const AttentionFactory& make_attention)
    : name_(name),
      embed_dim_(embed_dim),
      num_heads_(num_heads),
      num_kv_heads_(module_options.num_kv_heads > 0 ? module_options.num_kv_heads : num_heads),
      rope_base_(module_options.rope_base) {
  RD_CHECK(embed_dim >= 1 && num_heads >= 1 && embed_dim % num_heads == 0, kInvalidArgument, name,
           ": embed_dim (", embed_dim, ") must be a positive multiple of num_heads (", num_heads,
           ")");
  RD_CHECK(module_options.num_kv_heads >= 0 && num_heads % num_kv_heads_ == 0, kInvalidArgument,
           name, ": num_kv_heads (", module_options.num_kv_heads, ") must divide num_heads (",
           num_heads, "), or be 0 for num_heads");
  check_rope(rope_base_, embed_dim / num_heads, name);
  validate_options(options, num_heads);
  const TensorOptions t = module_tensor_options(module_options);
  const int64_t head_dim = embed_dim / num_heads;
  qkv_ = register_module(
      "qkv", std::make_shared<Linear>(embed_dim, (num_heads + 2 * num_kv_heads_) * head_dim,
                                      module_options.bias, generator, t));
  attention_ = register_module("attention", make_attention(split_seed(generator)));
  out_ = register_module(
      "out", std::make_shared<Linear>(embed_dim, embed_dim, module_options.bias, generator, t));
}

Tensor MultiheadDilatedAttention::projected_qkv(const Tensor& x,
                                                const std::vector<PositionRun>& positions) {
  // [B, C, 3E] viewed as [B, C, 3, H, D]: q, k and v are strided views of one buffer (after
  // the rotation, a new one), and their gradient is written into one packed buffer.
  const Tensor qkv =
      qkv_->forward(x).view({x.size(0), x.size(1), 3, num_heads_, embed_dim_ / num_heads_});
  // The projection's fresh output: rotated in place (rotary_embedding_qkv_overwrite).
  return rope_base_ > 0 ? rotary_embedding_qkv_overwrite(qkv, positions, rope_base_) : qkv;
}

Tensor MultiheadDilatedAttention::projected_gqa(const Tensor& x,
                                                const std::vector<PositionRun>& positions) {
  const int64_t head_dim = embed_dim_ / num_heads_;
  const Tensor projected =
      qkv_->forward(x).view({x.size(0), x.size(1), num_heads_ + 2 * num_kv_heads_, head_dim});
  if (rope_base_ == 0) return projected;
  // q's and k's heads rotate alike: as one [B, T, H + H_kv, D] tensor, run by run.
  const Tensor qk = projected.narrow(2, 0, num_heads_ + num_kv_heads_);
  std::vector<Tensor> rotated;
  int64_t row = 0;
  for (const PositionRun& run : positions) {
    rotated.push_back(
        rotary_embedding(qk.narrow(1, row, run.rows), run.first_position, rope_base_));
    row += run.rows;
  }
  const Tensor v = projected.narrow(2, num_heads_ + num_kv_heads_, num_kv_heads_);
  return cat({rotated.size() == 1 ? rotated[0] : cat(rotated, 1), v}, 2);
}

Tensor MultiheadDilatedAttention::attend_gqa(const Tensor& projected,
                                             const DocumentStarts* documents) {
  return attention_
      ->forward_with_lse(projected.narrow(2, 0, num_heads_),
                         projected.narrow(2, num_heads_, num_kv_heads_),
                         projected.narrow(2, num_heads_ + num_kv_heads_, num_kv_heads_), documents)
      .out;
}

Tensor MultiheadDilatedAttention::forward_documents(const Tensor& x,
                                                    const DocumentStarts* documents) {
  const bool split = attention_->ranks() > 1;
  RD_CHECK(x.defined() && x.dim() == 3 && x.size(2) == embed_dim_, kShapeMismatch, name_,
           ": input must be ", split ? "this rank's block [B, N / P, " : "[B, N, ", embed_dim_,
           "], got shape ", x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  const int64_t batch = x.size(0), rows = x.size(1);
  // Global positions: the runs of the sequence this rank holds under the layout.
  std::vector<PositionRun> positions;
  for (const Block& b : attention_->pieces_for(rows * attention_->ranks())) {
    positions.push_back({b.size(), b.begin});
  }
  const Tensor attended = num_kv_heads_ == num_heads_
                              ? attention_->forward_packed(projected_qkv(x, positions), documents)
                              : attend_gqa(projected_gqa(x, positions), documents);
  return out_->forward(attended.reshape({batch, rows, embed_dim_}));
}

DilatedKVCache MultiheadDilatedAttention::make_cache(int64_t batch, int64_t capacity) const {
  const Tensor& weight = qkv_->weight();
  return DilatedKVCache(batch, capacity, num_kv_heads_, embed_dim_ / num_heads_,
                        TensorOptions(weight.dtype()).with_device(weight.device()));
}

Tensor MultiheadDilatedAttention::forward_cached(const Tensor& x, DilatedKVCache& cache) {
  RD_CHECK(attention_->ranks() == 1, kUnimplemented, name_,
           ": decoding with a KV cache runs on one device (the sequence is not split)");
  RD_CHECK(x.defined() && x.dim() == 3 && x.size(2) == embed_dim_, kShapeMismatch, name_,
           ": forward_cached input must be [B, T, ", embed_dim_, "], got shape ",
           x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  const int64_t batch = x.size(0), rows = x.size(1), start = cache.length();
  // q, k and v of x's rows: views of the packed projection ([B, T, 3, H, D], or
  // [B, T, H + 2 H_kv, D] under grouped-query attention).
  const bool grouped = num_kv_heads_ != num_heads_;
  const Tensor projected =
      grouped ? projected_gqa(x, {{rows, start}}) : projected_qkv(x, {{rows, start}});
  auto part = [&](const Tensor& rows_of, int which) {
    if (!grouped) return rows_of.select(2, which);
    const int64_t first = which == 0 ? 0 : num_heads_ + (which - 1) * num_kv_heads_;
    return rows_of.narrow(2, first, which == 0 ? num_heads_ : num_kv_heads_);
  };
  Tensor attended;
  if (start == 0 && rows > 1) {
    // A prompt: one forward over it, exactly the rows the steps would give.
    attended = grouped ? attend_gqa(projected) : attention_->forward_packed(projected);
    cache.append(part(projected, 1), part(projected, 2));
  } else {
    std::vector<Tensor> steps;
    for (int64_t t = 0; t < rows; ++t) {
      const Tensor row = projected.narrow(1, t, 1);
      cache.append(part(row, 1), part(row, 2));
      steps.push_back(
          dilated_attention_decode_step(part(row, 0), cache, attention_->options()).out);
    }
    attended = rows == 1 ? steps[0] : cat(steps, 1);
  }
  return out_->forward(attended.reshape({batch, rows, embed_dim_}));
}

}  // namespace rd::nn
