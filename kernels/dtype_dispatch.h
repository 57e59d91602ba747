// DType -> C++ type dispatch and the value rules every backend shares: the compute and
// accumulate type of each storage type, conversion between any two of them and in-type
// accumulation. The value functions are host+device, so CPU and CUDA kernels round alike.
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels {

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

// Converts between storage/compute types: nonzero -> true for bool, through float for
// 16-bit floats, otherwise one static_cast from the source's compute type (so int64 ->
// float32 rounds once, never through double). Out-of-range float -> int conversions are
// undefined in C++; the GPU saturates (NaN -> 0) while x86 gives INT_MIN.
template <class To, class From>
RD_HOST_DEVICE inline To convert(From v) {
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
RD_HOST_DEVICE inline void add_into(T& o, const T& x) {
  if constexpr (std::is_same_v<T, bool>) {
    o = o || x;
  } else {
    o = static_cast<T>(static_cast<Compute<T>>(o) + static_cast<Compute<T>>(x));
  }
}

// NaN test that is false for integer and bool types.
template <class C>
RD_HOST_DEVICE inline bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return v != v;
  } else {
    return false;
  }
}

// a + scale * x in double with the multiply and the add rounded separately, so that nvcc
// (which contracts to FMA by default) gives the same bits as the host compiler (which
// doesn't on x86-64): arange and the random samplers depend on it.
RD_HOST_DEVICE inline double affine_no_fma(double a, double scale, double x) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, __dmul_rn(scale, x));
#else
  volatile double product = scale * x;  // volatile: forbid contraction into an FMA
  return a + product;
#endif
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

}  // namespace rd::kernels
