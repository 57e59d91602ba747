// Decoding with a KV cache (see dilated_decode.h): per pair and head set, the new position's
// segment, whether the pattern selects it, and one attention call of its query to the
// selected cached keys at or before it, through the same runner and kernels as the forward.
#include "ringdilated/nn/dilated_decode.h"

#include <algorithm>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_runner.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "dilated_attention_decode_step";
// The selected positions at or before `position` in its segment of pair (w, r) for a head
// set of base offset `offset`: a selection of the cache's rows (heads set by the caller), or
// an empty one when the pattern does not select `position` (then it has no query in this
// pair).
Selection step_keys(const DilatedAttentionOptions& o, int pair, int64_t offset, int64_t position) {
  const int64_t w = o.segment_lengths[static_cast<size_t>(pair)];
  const int64_t r = o.dilation_rates[static_cast<size_t>(pair)];
  const int64_t segment = position / w, start = segment * w;
  // The offset rule numbers segments from the start of the sequence, as the forward does
  // (segment_offset): a short last segment keeps its place's offset.
  const int64_t first = segment_offset(o, offset, segment, r);
  const int64_t into = position - start - first;
  if (into < 0 || into % r != 0) return {};
  return {0, 1, 1, start + first, 0, 1, r, into / r + 1};
}

// The step's call for one head block (kv_head_blocks): `keys` positioned, heads from the
// block (the cache holds key/value heads, q query heads).
kernels::AttentionForwardArgs step_args(const HeadBlock& block, Selection keys, const Tensor& q,
                                        const DilatedKVCache& cache, const Tensor& out,
                                        const Tensor& lse) {
  const Selection query{block.q.first,
                        block.q.stride,
                        block.q.count,
                        0,
                        0,
                        1,
                        1,
                        1,
                        block.repeat,
                        block.repeat == 1 ? 0 : block.repeat_stride};
  keys.first_head = block.kv_first;
  keys.head_stride = block.kv_stride;
  keys.head_count = block.q.count;
  keys.head_repeat = block.repeat;
  keys.repeat_stride = 0;
  kernels::AttentionForwardArgs args;
  args.q = kernel_view(select_bnhd(q, query), kOp);
  args.k = kernel_view(select_bnhd(cache.keys(), keys), kOp);
  args.v = kernel_view(select_bnhd(cache.values(), keys), kOp);
  args.out = kernel_view(select_bnhd(out, query), kOp);
  args.lse = kernel_view(select_bhn(lse, query), kOp);
  return args;
}

}  // namespace

DilatedKVCache::DilatedKVCache(int64_t batch, int64_t capacity, int64_t heads, int64_t head_dim,
                               TensorOptions options) {
  RD_CHECK(batch >= 1 && capacity >= 1 && heads >= 1 && head_dim >= 1, kInvalidArgument,
           "DilatedKVCache: batch, capacity, heads and head_dim must be >= 1, got ", batch, ", ",
           capacity, ", ", heads, ", ", head_dim);
  RD_CHECK(is_floating(options.dtype), kDTypeMismatch,
           "DilatedKVCache: the dtype must be floating, got ", dtype_name(options.dtype));
  keys_ = zeros({batch, capacity, heads, head_dim}, options);
  values_ = zeros({batch, capacity, heads, head_dim}, options);
}

void DilatedKVCache::reserve(int64_t positions) {
  if (positions <= capacity()) return;
  int64_t grown = capacity();
  while (grown < positions) grown *= 2;
  Shape shape = keys_.shape();
  shape[1] = grown;
  Tensor keys = empty(shape, TensorOptions(keys_.dtype()).with_device(keys_.device()));
  Tensor values = empty(shape, TensorOptions(keys_.dtype()).with_device(keys_.device()));
  keys.narrow(1, 0, length_).copy_(keys_.narrow(1, 0, length_));
  values.narrow(1, 0, length_).copy_(values_.narrow(1, 0, length_));
  keys_ = keys;
  values_ = values;
}

void DilatedKVCache::append(const Tensor& k, const Tensor& v) {
  const Shape want{keys_.size(0), -1, keys_.size(2), keys_.size(3)};
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    RD_CHECK(t->defined() && t->dim() == 4 && t->size(0) == want[0] && t->size(2) == want[2] &&
                 t->size(3) == want[3],
             kShapeMismatch, "DilatedKVCache::append: argument '", name, "' must be [", want[0],
             ", T, ", want[2], ", ", want[3], "], got ",
             t->defined() ? shape_str(t->shape()) : std::string("undefined"));
  }
  RD_CHECK(k.size(1) == v.size(1), kShapeMismatch,
           "DilatedKVCache::append: k and v must have one length, got ", k.size(1), " and ",
           v.size(1));
  const int64_t rows = k.size(1);
  reserve(length_ + rows);
  autograd::NoGradGuard no_grad;
  keys_.narrow(1, length_, rows).copy_(k.detach());
  values_.narrow(1, length_, rows).copy_(v.detach());
  length_ += rows;
}

void DilatedKVCache::truncate(int64_t length) {
  RD_CHECK(length >= 0 && length <= length_, kInvalidArgument,
           "DilatedKVCache::truncate: length must be in [0, ", length_, "], got ", length);
  length_ = length;
}

DilatedAttentionResult dilated_attention_decode_step(const Tensor& q, const DilatedKVCache& cache,
                                                     const DilatedAttentionOptions& options,
                                                     const AttentionCallContext& context) {
  const int64_t kv_heads = cache.keys().size(2);
  RD_CHECK(q.defined() && q.dim() == 4 && q.size(1) == 1 && q.size(0) == cache.keys().size(0) &&
               q.size(2) % kv_heads == 0 && q.size(3) == cache.keys().size(3),
           kShapeMismatch, kOp, ": argument 'q' must be [", cache.keys().size(0), ", 1, H, ",
           cache.keys().size(3), "] with H a multiple of the cache's ", kv_heads,
           " key/value heads, got ", q.defined() ? shape_str(q.shape()) : std::string("undefined"));
  RD_CHECK(q.dtype() == cache.keys().dtype() && q.device() == cache.keys().device(), kDTypeMismatch,
           kOp, ": q (", dtype_name(q.dtype()), " on ", q.device().str(),
           ") must match the cache (", dtype_name(cache.keys().dtype()), " on ",
           cache.keys().device().str(), ")");
  RD_CHECK(cache.length() >= 1, kInvalidArgument, kOp,
           ": the cache is empty; append the new position's key and value first");
  validate_options(options, q.size(2));
  RD_CHECK(options.causal, kInvalidArgument, kOp,
           ": decoding needs causal attention (option 'causal'); a non-causal row reads keys "
           "that do not exist yet");
  RD_CHECK(options.variant == DilationVariant::kSegmentLocal, kUnimplemented, kOp,
           ": the global variant has no incremental form (its cycled index lists change with "
           "N); decode it by recomputing the prefix");
  autograd::NoGradGuard no_grad;
  AttentionCallContext eval = context;
  eval.training = false;  // no dropout when decoding
  const Tensor qd = q.detach();
  AttentionRunner runner(kOp, options, eval, qd, cache.length());
  const int64_t position = cache.length() - 1, heads = q.size(2), group = heads / kv_heads;
  const TensorOptions acc_options =
      TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device());
  const bool merged = options.mixing == HeadMixing::kAllHeads;
  Tensor out = zeros(q.shape(), TensorOptions(q.dtype()).with_device(q.device()));
  Tensor lse = full({q.size(0), heads, 1}, kEmptyLse, acc_options);
  Tensor acc_out = merged ? zeros(q.shape(), acc_options) : Tensor();
  Tensor part = merged ? empty_like(out) : out, part_lse = merged ? empty_like(lse) : lse;
  for (int pair = 0; pair < static_cast<int>(options.segment_lengths.size()); ++pair) {
    if (merged) part_lse.fill_(kEmptyLse);  // the merge skips rows left at -inf, unread
    for (const PairHeads& ph : fixed_pair_heads(options, heads, pair)) {
      const Selection keys = step_keys(options, pair, ph.offset, position);
      if (keys.empty()) continue;
      const Tensor order = runner.key_order(keys.count, q.device());
      for (const HeadBlock& block : kv_head_blocks(ph.heads, group)) {
        kernels::AttentionForwardArgs args = step_args(block, keys, qd, cache, part, part_lse);
        // Every selected key is at or before the query: no mask.
        args.params = runner.call_params(pair, /*causal=*/false, {});
        args.params.shape_follows_data = true;  // one more key at every step
        if (order.defined()) {
          args.params.key_order = static_cast<const int64_t*>(kernel_view(order, kOp).data);
        }
        runner.forward(args);
      }
    }
    if (merged) attention_merge_(acc_out, lse, part, part_lse);
  }
  DilatedAttentionResult result;
  result.out = merged ? acc_out.to(q.dtype()) : out;
  result.lse = lse.to(DType::kFloat32);
  result.path_used = runner.path_used();
  return result;
}

}  // namespace rd::nn
