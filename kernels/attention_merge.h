// Merging attention partials through the log-sum-exp: the value rule every backend's fused,
// in-place merge uses (host+device, so CPU and CUDA round alike) and its argument check.
#pragma once

#include <cmath>

#include "ringdilated/kernels/half.h"  // RD_HOST_DEVICE
#include "ringdilated/kernels/strided.h"

namespace rd::kernels {

// logaddexp(a, b) that is -inf when both are -inf (never NaN) and exact when one is.
template <class T>
RD_HOST_DEVICE inline T merged_lse(T a, T b) {
  if (a == -INFINITY) return b;
  if (b == -INFINITY) return a;
  const T hi = a > b ? a : b, lo = a > b ? b : a;
  return hi + log1p(exp(lo - hi));
}

// Whether a partial's row takes part in a merge: one with no key (lse -inf) leaves the
// accumulator exactly as it is (merged_value and merged_lse return acc), so the kernels skip
// it without reading its output, which callers need not initialize there. (A dilated pair's
// partial covers 1/r of the rows: the skip saves most of its merge's traffic.)
template <class T>
RD_HOST_DEVICE inline bool merges_into_acc(T part_lse) {
  return part_lse != -INFINITY;
}

// One element of the merged output: acc and part weighted by their softmax denominators,
// exp(lse - merged). A side whose weight is 0 (its lse is -inf) contributes exactly 0, even if
// its value is not finite; a row with no key on either side keeps acc.
template <class T>
RD_HOST_DEVICE inline T merged_value(T acc, T part, T acc_lse, T part_lse) {
  const T m = merged_lse(acc_lse, part_lse);
  if (m == -INFINITY) return acc;
  const T wa = exp(acc_lse - m), wp = exp(part_lse - m);
  return (wa != T(0) ? wa * acc : T(0)) + (wp != T(0) ? wp * part : T(0));
}

// A [rows...] LSE view as [rows..., D] with stride 0 along D, so that each element of a
// [rows..., D] output reads its row's LSE (how both backends walk the merge elementwise).
inline StridedView lse_per_element(const StridedView& lse, const StridedView& out) {
  StridedView v = lse;
  v.ndim = out.ndim;
  v.shape[out.ndim - 1] = out.shape[out.ndim - 1];
  v.strides[out.ndim - 1] = 0;
  return v;
}

// The merge's arguments: acc_out and part_out [rows..., D], acc_lse and part_lse [rows...]
// (the same leading dims; any strides, e.g. a [B, H, N] lse permuted to [B, N, H] beside a
// [B, N, H, D] output). acc_out, acc_lse and part_lse share one dtype, float32 or float64;
// part_out has it too or, with float32, is bfloat16 or float16 (an attention kernel's
// output in q's dtype, converted as it is read). part_out is not read in rows whose part_lse
// is -inf (merges_into_acc). The acc views must not overlap themselves. A violation is an
// rd::Error naming "attention_merge", the argument and shapes.
void check_attention_merge_args(const StridedView& acc_out, const StridedView& acc_lse,
                                const StridedView& part_out, const StridedView& part_lse);

}  // namespace rd::kernels
