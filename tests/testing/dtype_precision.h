// How precisely each dtype stores values and the kernels compute with them: the unit
// roundoffs that the kernel tests derive their tolerances from.
#pragma once

#include <cmath>

#include "ringdilated/kernels/dtype.h"

namespace rd::test {

// Unit roundoff (half an ulp, relative) of a dtype's storage; 0 for the exact types
// (integers and bool).
inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::kFloat32: return std::ldexp(1.0, -24);
    case DType::kFloat64: return std::ldexp(1.0, -53);
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return 0.0;
  }
}

// Unit roundoff of the type kernels compute in: float32, float64 for float64 data.
inline double compute_roundoff(DType t) {
  return t == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}

// Absolute rounding of the smallest values a stored result may have: the subnormal step of
// float16 (the other float dtypes reach far smaller values than any test produces).
inline double tiny_step(DType t) { return t == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0; }

}  // namespace rd::test
