// CPU-side additions to the shared dtype dispatch (kernels/dtype_dispatch.h): stores of a
// run-time dtype and the identities of max/min.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cpu {

// Writes `v` converted to `dtype` at p: for once-per-output stores, not inner loops.
template <class V>
inline void store_as(void* p, DType dtype, V v) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    *static_cast<T*>(p) = convert<T>(v);
  });
}

// The smallest value of C (-inf for floats), the identity of max.
template <class C>
constexpr C lowest_value() {
  if constexpr (std::numeric_limits<C>::has_infinity) {
    return -std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::lowest();
  }
}
template <class C>
constexpr C highest_value() {
  if constexpr (std::numeric_limits<C>::has_infinity) {
    return std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::max();
  }
}

}  // namespace rd::kernels::cpu
