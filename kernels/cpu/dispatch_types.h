// DType -> C++ type dispatch for CPU kernels, the compute/accumulate type of each storage
// type, and value conversion between any two of them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels::cpu {

template <class T>
struct TypeTag {
  using type = T;
};

template <class T>
inline constexpr bool kIsHalf = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;
template <class T>
inline constexpr bool kIsFloating = kIsHalf<T> || std::is_floating_point_v<T>;

// Arithmetic happens in Compute<T>: float for the 16-bit floats, T otherwise.
template <class T>
using Compute = std::conditional_t<kIsHalf<T>, float, T>;

// Sums accumulate in Accum<T>: float32 for 32/16-bit floats, double for float64, int64 for
// integers and bool.
template <class T>
using Accum = std::conditional_t<kIsFloating<T>, Compute<T>, int64_t>;

// Converts between storage/compute types; nonzero -> true for bool, via float for 16-bit.
template <class To, class From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    return static_cast<Compute<From>>(v) != Compute<From>(0);
  } else if constexpr (kIsHalf<To>) {
    return To(static_cast<float>(static_cast<Compute<From>>(v)));
  } else {
    return static_cast<To>(static_cast<Compute<From>>(v));
  }
}

// o += x in the compute type of T (logical or for bool).
template <class T>
inline void add_into(T& o, const T& x) {
  if constexpr (std::is_same_v<T, bool>) {
    o = o || x;
  } else {
    o = static_cast<T>(static_cast<Compute<T>>(o) + static_cast<Compute<T>>(x));
  }
}

// Calls f(TypeTag<T>{}) with T the storage type of `dtype`.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(TypeTag<float>{});
    case DType::kFloat64: return f(TypeTag<double>{});
    case DType::kBFloat16: return f(TypeTag<BFloat16>{});
    case DType::kFloat16: return f(TypeTag<Float16>{});
    case DType::kInt32: return f(TypeTag<int32_t>{});
    case DType::kInt64: return f(TypeTag<int64_t>{});
    case DType::kBool: return f(TypeTag<bool>{});
  }
  RD_FAIL(kInternal, "dispatch_dtype: unknown dtype ", static_cast<int>(dtype));
}

// As dispatch_dtype, for the four floating dtypes only; others throw kDTypeMismatch naming
// `op`.
template <class F>
decltype(auto) dispatch_floating(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(TypeTag<float>{});
    case DType::kFloat64: return f(TypeTag<double>{});
    case DType::kBFloat16: return f(TypeTag<BFloat16>{});
    case DType::kFloat16: return f(TypeTag<Float16>{});
    default: break;
  }
  RD_FAIL(kDTypeMismatch, op, ": requires a floating dtype, got ", dtype_name(dtype));
}

// Calls f(TypeTag<U>{}) with U an unsigned integer of dtype's size: for ops that only move
// bytes (gathers, scatters without arithmetic).
template <class F>
decltype(auto) dispatch_by_size(DType dtype, F&& f) {
  switch (dtype_size(dtype)) {
    case 1: return f(TypeTag<uint8_t>{});
    case 2: return f(TypeTag<uint16_t>{});
    case 4: return f(TypeTag<uint32_t>{});
    case 8: return f(TypeTag<uint64_t>{});
  }
  RD_FAIL(kInternal, "dispatch_by_size: unknown dtype ", static_cast<int>(dtype));
}

// Calls f(TypeTag<I>{}) for an index dtype (int64 or int32); others throw kDTypeMismatch.
template <class F>
decltype(auto) dispatch_index(DType dtype, std::string_view op, F&& f) {
  if (dtype == DType::kInt64) return f(TypeTag<int64_t>{});
  if (dtype == DType::kInt32) return f(TypeTag<int32_t>{});
  RD_FAIL(kDTypeMismatch, op, ": argument 'index' must be int64 or int32, got ",
          dtype_name(dtype));
}

// Writes `v` converted to `dtype` at p: for once-per-output stores, not inner loops.
template <class V>
inline void store_as(void* p, DType dtype, V v) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    *static_cast<T*>(p) = convert<T>(v);
  });
}

// NaN test that is false for integer and bool types.
template <class C>
inline bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return std::isnan(v);
  } else {
    return false;
  }
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
