// The argument checks of the attention primitive (kernels/attention.h), shared by every
// backend so that a bad call fails with the same message whichever device runs it.
#include "ringdilated/kernels/attention.h"

#include <cmath>
#include <utility>

#include "ringdilated/kernels/attention_merge.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels {
namespace {

// The dims of a [batch..., rows, D] view before its last two.
int batch_dims(const StridedView& v) { return v.ndim - 2; }

bool same_dims(const StridedView& a, const StridedView& b, int count) {
  for (int d = 0; d < count; ++d) {
    if (a.shape[d] != b.shape[d]) return false;
  }
  return true;
}

void check_data(const char* op, const char* name, const StridedView& v) {
  RD_CHECK(v.data != nullptr || v.numel() == 0, kInvalidArgument, op, ": argument '", name,
           "' has no data but shape ", shape_of(v));
}

void check_distinct(const char* op, const char* name, const StridedView& v) {
  RD_CHECK(has_distinct_elements(v), kInvalidArgument, op, ": output '", name,
           "' overlaps itself (shape ", shape_of(v), "): its elements must be distinct");
}

// q [batch..., Lq, D], k and v [batch..., Lk, D]: one floating dtype, same batch dims and D.
void check_qkv(const char* op, const StridedView& q, const StridedView& k, const StridedView& v) {
  RD_CHECK(q.ndim >= 2 && q.ndim <= kMaxDims, kShapeMismatch, op, ": argument 'q' must have 2 to ",
           kMaxDims, " dims ([batch..., Lq, D]), got shape ", shape_of(q));
  RD_CHECK(is_floating(q.dtype), kDTypeMismatch, op,
           ": argument 'q' must have a floating dtype, got ", dtype_name(q.dtype));
  check_dtype(op, "k", k, q.dtype);
  check_dtype(op, "v", v, q.dtype);
  for (const auto& [name, view] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    const bool ok = view->ndim == q.ndim && same_dims(*view, q, batch_dims(q)) &&
                    view->shape[q.ndim - 1] == q.shape[q.ndim - 1];
    RD_CHECK(ok, kShapeMismatch, op, ": argument '", name, "' has shape ", shape_of(*view),
             " but 'q' has shape ", shape_of(q), ": they need the same batch dims and D");
  }
  RD_CHECK(v.shape[v.ndim - 2] == k.shape[k.ndim - 2], kShapeMismatch, op,
           ": argument 'v' has shape ", shape_of(v), " but 'k' has shape ", shape_of(k),
           ": they need the same number of keys");
  check_data(op, "q", q);
  check_data(op, "k", k);
  check_data(op, "v", v);
}

// An output or gradient shaped like `like` (argument `like_name`), in q's dtype or float32.
void check_like(const char* op, const char* name, const StridedView& view, const char* like_name,
                const StridedView& like, DType q_dtype) {
  check_same_shape(op, like_name, like, name, view);
  RD_CHECK(view.dtype == q_dtype || view.dtype == DType::kFloat32, kDTypeMismatch, op,
           ": argument '", name, "' has dtype ", dtype_name(view.dtype), ", expected ",
           dtype_name(q_dtype), " (q's) or float32");
  check_data(op, name, view);
}

// A [batch..., Lq] statistic of the rows of q (lse, grad_lse): float32, or float64 for
// float64 inputs (whose merges through the lse must keep float64 accuracy).
void check_row_statistic(const char* op, const char* name, const StridedView& view,
                         const StridedView& q) {
  RD_CHECK(view.dtype == DType::kFloat32 || view.dtype == accumulation_dtype(q.dtype),
           kDTypeMismatch, op, ": argument '", name, "' has dtype ", dtype_name(view.dtype),
           ", expected float32", q.dtype == DType::kFloat64 ? " or float64" : "");
  const bool ok = view.ndim == q.ndim - 1 && same_dims(view, q, q.ndim - 1);
  RD_CHECK(ok, kShapeMismatch, op, ": argument '", name, "' has shape ", shape_of(view),
           " but 'q' has shape ", shape_of(q), ", which needs [batch..., Lq]");
  check_data(op, name, view);
}

void check_params(const char* op, const AttentionParams& p) {
  RD_CHECK(std::isfinite(p.scale), kInvalidArgument, op, ": argument 'scale' must be finite, got ",
           p.scale);
  // Written as !(0 <= dropout < 1) so that NaN fails too.
  RD_CHECK(p.dropout >= 0 && p.dropout < 1, kInvalidArgument, op,
           ": argument 'dropout' must be in [0, 1), got ", p.dropout);
}

}  // namespace

void check_attention_forward_args(const AttentionForwardArgs& args) {
  constexpr const char* kOp = "attention";
  check_qkv(kOp, args.q, args.k, args.v);
  check_like(kOp, "out", args.out, "q", args.q, args.q.dtype);
  check_distinct(kOp, "out", args.out);
  if (args.lse.data != nullptr) {
    check_row_statistic(kOp, "lse", args.lse, args.q);
    check_distinct(kOp, "lse", args.lse);
  }
  check_params(kOp, args.params);
}

void check_attention_backward_args(const AttentionBackwardArgs& args) {
  constexpr const char* kOp = "attention_backward";
  const DType dtype = args.q.dtype;
  check_qkv(kOp, args.q, args.k, args.v);
  check_like(kOp, "out", args.out, "q", args.q, dtype);
  check_like(kOp, "grad_out", args.grad_out, "q", args.q, dtype);
  check_row_statistic(kOp, "lse", args.lse, args.q);
  if (args.grad_lse.data != nullptr) check_row_statistic(kOp, "grad_lse", args.grad_lse, args.q);
  check_like(kOp, "grad_q", args.grad_q, "q", args.q, dtype);
  check_like(kOp, "grad_k", args.grad_k, "k", args.k, dtype);
  check_like(kOp, "grad_v", args.grad_v, "v", args.v, dtype);
  check_distinct(kOp, "grad_q", args.grad_q);
  // Shared gradients (grouped-query attention) repeat elements along k's broadcast dims only.
  const bool shared = attention_grads_shared(args);
  check_distinct(kOp, "grad_k", shared ? without_broadcast_dims(args.grad_k) : args.grad_k);
  check_distinct(kOp, "grad_v", shared ? without_broadcast_dims(args.grad_v) : args.grad_v);
  check_params(kOp, args.params);
}

StridedView without_broadcast_dims(const StridedView& v) {
  StridedView r = v;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] > 1 && v.strides[d] == 0) r.shape[d] = 1;
  }
  return r;
}

bool attention_grads_shared(const AttentionBackwardArgs& args) {
  const StridedView &k = args.k, &v = args.v, &grad_k = args.grad_k, &grad_v = args.grad_v;
  if (v.ndim != k.ndim || grad_k.ndim != k.ndim || grad_v.ndim != k.ndim) return false;
  bool any = false;
  for (int d = 0; d < batch_dims(k); ++d) {
    if (k.shape[d] <= 1) continue;
    const bool inputs = k.strides[d] == 0 && v.strides[d] == 0;
    const bool grads = grad_k.strides[d] == 0 && grad_v.strides[d] == 0;
    if (inputs != grads) return false;
    any = any || grads;
  }
  return any;
}

void check_attention_merge_args(const StridedView& acc_out, const StridedView& acc_lse,
                                const StridedView& part_out, const StridedView& part_lse) {
  constexpr const char* kOp = "attention_merge";
  RD_CHECK(acc_out.ndim >= 1 && acc_out.ndim <= kMaxDims, kShapeMismatch, kOp,
           ": argument 'acc_out' must be [rows..., D], got shape ", shape_of(acc_out));
  RD_CHECK(acc_out.dtype == DType::kFloat32 || acc_out.dtype == DType::kFloat64, kDTypeMismatch,
           kOp, ": argument 'acc_out' must be float32 or float64, got ", dtype_name(acc_out.dtype));
  check_dtype(kOp, "acc_lse", acc_lse, acc_out.dtype);
  const bool half_part = acc_out.dtype == DType::kFloat32 &&
                         (part_out.dtype == DType::kBFloat16 || part_out.dtype == DType::kFloat16);
  RD_CHECK(part_out.dtype == acc_out.dtype || half_part, kDTypeMismatch, kOp,
           ": argument 'part_out' has dtype ", dtype_name(part_out.dtype), ", expected ",
           dtype_name(acc_out.dtype), " (acc_out's)",
           acc_out.dtype == DType::kFloat32 ? ", bfloat16 or float16" : "");
  check_dtype(kOp, "part_lse", part_lse, acc_out.dtype);
  check_same_shape(kOp, "acc_out", acc_out, "part_out", part_out);
  check_same_shape(kOp, "acc_lse", acc_lse, "part_lse", part_lse);
  const bool rows_match =
      acc_lse.ndim == acc_out.ndim - 1 && same_dims(acc_lse, acc_out, acc_lse.ndim);
  RD_CHECK(rows_match, kShapeMismatch, kOp, ": argument 'acc_lse' has shape ", shape_of(acc_lse),
           " but 'acc_out' has shape ", shape_of(acc_out), ", which needs [rows...]");
  for (const auto& [name, view] :
       {std::pair{"acc_out", &acc_out}, std::pair{"acc_lse", &acc_lse},
        std::pair{"part_out", &part_out}, std::pair{"part_lse", &part_lse}}) {
    check_data(kOp, name, *view);
  }
  check_distinct(kOp, "acc_out", acc_out);
  check_distinct(kOp, "acc_lse", acc_lse);
}

}  // namespace rd::kernels
