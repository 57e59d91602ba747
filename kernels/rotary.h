// The rotary position embedding's shared rules (KernelBackend::rotary_embedding): argument
// checks and the angle of a (position, pair), so that every backend rotates alike.
#pragma once

#include <cmath>
#include <cstdint>

#include "ringdilated/kernels/half.h"  // RD_HOST_DEVICE
#include "ringdilated/kernels/strided.h"

namespace rd::kernels {

// Positions must stay exact in float64: position_offset + T <= 2^53.
inline constexpr int64_t kMaxRotaryPosition = int64_t{1} << 53;

// The dims of a [B, T, H, D] rotary call; `half` = D / 2 pairs per head.
struct RotaryShape {
  int64_t batch = 0, seq = 0, heads = 0, half = 0;
};

// Throws rd::Error naming rotary_embedding unless x and out are [B, T, H, D] views of one
// floating dtype and shape with D even, base is finite and > 0 and the positions
// [position_offset, position_offset + T) lie in [0, 2^53].
RotaryShape check_rotary_args(const StridedView& out, const StridedView& x,
                              int64_t position_offset, double base);

// The angle of pair i (< D/2) at `position`: position * base^(-2i / D), in float64 from the
// integer position (exact below 2^53), so that even at positions ~1e6 the angle carries
// only float64 rounding (~1e-10 rad) before its cos and sin are rounded to the compute type.
RD_HOST_DEVICE inline double rotary_angle(int64_t position, int64_t i, int64_t dim, double base) {
  return static_cast<double>(position) * pow(base, -2.0 * static_cast<double>(i) /
                                                      static_cast<double>(dim));
}

}  // namespace rd::kernels
