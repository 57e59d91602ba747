// Argument checks of the rotary position embedding, shared by every backend.
#include "ringdilated/kernels/rotary.h"

#include <cmath>

#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels {

RotaryShape check_rotary_args(const StridedView& out, const StridedView& x,
                              int64_t position_offset, double base) {
  constexpr const char* kOp = "rotary_embedding";
  RD_CHECK(x.ndim == 4, kShapeMismatch, kOp, ": argument 'x' must be [B, T, H, D], got shape ",
           shape_of(x));
  RD_CHECK(is_floating(x.dtype), kDTypeMismatch, kOp,
           ": argument 'x' must be floating, got ", dtype_name(x.dtype));
  check_dtype(kOp, "out", out, x.dtype);
  check_same_shape(kOp, "out", out, "x", x);
  RD_CHECK(x.shape[3] % 2 == 0, kShapeMismatch, kOp,
           ": the head dim D (last) must be even to rotate pairs, got shape ", shape_of(x));
  RD_CHECK(std::isfinite(base) && base > 0.0, kInvalidArgument, kOp,
           ": argument 'base' must be finite and > 0, got ", base);
  RD_CHECK(position_offset >= 0 && position_offset <= kMaxRotaryPosition - x.shape[1],
           kInvalidArgument, kOp, ": positions [", position_offset, ", ", position_offset,
           " + T) with T = ", x.shape[1], " must lie in [0, 2^53] (exact in float64)");
  return {x.shape[0], x.shape[1], x.shape[2], x.shape[3] / 2};
}

}  // namespace rd::kernels
