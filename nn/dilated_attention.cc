// Dilated attention on one device (see dilated_attention.h, docs/dilated-attention.md): the
// argument checks, and the functional forms as fronts over the one engine with one rank.
#include "ringdilated/nn/dilated_attention.h"

#include <cmath>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_engine.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "dilated_attention";

}  // namespace

void check_qkv_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op,
                      const char* layout) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    RD_CHECK(t->defined(), kInvalidArgument, op, ": argument '", name, "' is undefined");
    RD_CHECK(t->dim() == 4, kShapeMismatch, op, ": argument '", name, "' must be ", layout,
             ", got shape ", shape_str(t->shape()));
    RD_CHECK(is_floating(t->dtype()), kDTypeMismatch, op, ": argument '", name,
             "' must be floating, got ", dtype_name(t->dtype()));
  }
  // Grouped-query attention: k and v may have fewer heads, a divisor of q's.
  const bool same_but_heads = k.shape() == v.shape() && k.size(0) == q.size(0) &&
                              k.size(1) == q.size(1) && k.size(3) == q.size(3);
  RD_CHECK(same_but_heads && k.size(2) >= 1 && q.size(2) % k.size(2) == 0, kShapeMismatch, op,
           ": q must be [B, N, H, D] and k and v [B, N, H_kv, D] of one shape with H_kv dividing "
           "H, got ",
           shape_str(q.shape()), ", ", shape_str(k.shape()), " and ", shape_str(v.shape()));
  RD_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(), kDTypeMismatch, op,
           ": q, k and v must have one dtype, got ", dtype_name(q.dtype()), ", ",
           dtype_name(k.dtype()), " and ", dtype_name(v.dtype()));
  check_same_device({&q, &k, &v}, op);
}

void validate_options(const DilatedAttentionOptions& o, int64_t num_heads) {
  const size_t pairs = o.segment_lengths.size();
  RD_CHECK(pairs > 0 && pairs == o.dilation_rates.size(), kInvalidArgument, kOp,
           ": options 'segment_lengths' (", pairs, " values) and 'dilation_rates' (",
           o.dilation_rates.size(), " values) must be non-empty and of equal length");
  for (size_t i = 0; i < pairs; ++i) {
    const int64_t w = o.segment_lengths[i], r = o.dilation_rates[i];
    RD_CHECK(w >= 1 && r >= 1 && w % r == 0, kInvalidArgument, kOp, ": pair ", i,
             " (segment_lengths[", i, "] = ", w, ", dilation_rates[", i, "] = ", r,
             ") needs w >= 1, r >= 1 and w % r == 0");
  }
  RD_CHECK(o.dropout >= 0 && o.dropout < 1, kInvalidArgument, kOp,
           ": option 'dropout' must be in [0, 1), got ", o.dropout);
  RD_CHECK(!o.scale.has_value() || (std::isfinite(*o.scale) && *o.scale > 0), kInvalidArgument, kOp,
           ": option 'scale' must be finite and positive, got ", o.scale.value_or(0.0));
  RD_CHECK(o.variant != DilationVariant::kGlobal || o.mixing == HeadMixing::kHeadGroups,
           kInvalidArgument, kOp,
           ": option 'mixing' must be kHeadGroups with variant kGlobal (the original "
           "implementation it reproduces has head groups only)");
  const bool groups = o.mixing == HeadMixing::kHeadGroups || o.variant == DilationVariant::kGlobal;
  RD_CHECK(!groups || num_heads >= static_cast<int64_t>(pairs), kInvalidArgument, kOp,
           ": head groups need at least one head per pair, got ", num_heads, " heads for ", pairs,
           " pairs");
}

DilatedAttentionResult dilated_attention_with_lse(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const DilatedAttentionOptions& options,
                                                  const AttentionCallContext& context) {
  return run_dilated_attention(kOp, separate_inputs(q, k, v), options, context, {}).attention;
}

Tensor dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const DilatedAttentionOptions& options,
                         const AttentionCallContext& context) {
  return dilated_attention_with_lse(q, k, v, options, context).out;
}

DilatedAttentionResult dilated_attention_qkv_with_lse(const Tensor& qkv,
                                                      const DilatedAttentionOptions& options,
                                                      const AttentionCallContext& context) {
  return run_dilated_attention(kOp, packed_inputs(qkv, kOp, "[B, N, 3, H, D]"), options, context,
                               {})
      .attention;
}

}  // namespace rd::nn
