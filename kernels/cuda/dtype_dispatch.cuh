// Storage types of CUDA kernels: host-side DType -> C++ type dispatch (shared with the CPU
// backend), the compute/accumulate type of each storage type, conversions between any two of
// them with exactly the CPU's semantics, and atomic adds, all usable in device code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels::cuda {

// Host-side dispatch is the CPU backend's: the same dtype -> type table and error messages.
using cpu::dispatch_by_size;
using cpu::dispatch_dtype;
using cpu::dispatch_floating;
using cpu::dispatch_index;
using cpu::TypeTag;

template <class T>
inline constexpr bool kIsHalf = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;
template <class T>
inline constexpr bool kIsFloating = kIsHalf<T> || std::is_floating_point_v<T>;

// Arithmetic happens in Compute<T>: float for the 16-bit floats, T otherwise (as on the CPU).
template <class T>
using Compute = std::conditional_t<kIsHalf<T>, float, T>;

// Sums accumulate in Accum<T>: float32 for 32/16-bit floats, double for float64, int64 for
// integers and bool (as on the CPU).
template <class T>
using Accum = std::conditional_t<kIsFloating<T>, Compute<T>, int64_t>;

// Converts between storage/compute types exactly like cpu::convert: nonzero -> true for bool,
// through float for 16-bit floats, otherwise one static_cast from the source's compute type
// (so int64 -> float32 rounds once, never through double). Out-of-range float -> int
// conversions are undefined in C++; the GPU saturates (NaN -> 0) while x86 gives INT_MIN.
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

// Reads element `offset` of `data`, whose dtype is only known at run time, converted to To.
// The switch is uniform across a launch, so it costs a few predictable branches per element
// while keeping one kernel per destination type instead of one per (source, destination).
template <class To>
RD_HOST_DEVICE inline To load_converted(const void* data, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat32: return convert<To>(static_cast<const float*>(data)[offset]);
    case DType::kFloat64: return convert<To>(static_cast<const double*>(data)[offset]);
    case DType::kBFloat16: return convert<To>(static_cast<const BFloat16*>(data)[offset]);
    case DType::kFloat16: return convert<To>(static_cast<const Float16*>(data)[offset]);
    case DType::kInt32: return convert<To>(static_cast<const int32_t*>(data)[offset]);
    case DType::kInt64: return convert<To>(static_cast<const int64_t*>(data)[offset]);
    case DType::kBool: return convert<To>(static_cast<const bool*>(data)[offset]);
  }
  return To{};
}

// Reads an index element of an int64 or int32 index tensor (the host has checked the dtype).
RD_HOST_DEVICE inline int64_t load_index(const void* data, bool is_int64, int64_t offset) {
  return is_int64 ? static_cast<const int64_t*>(data)[offset]
                  : static_cast<int64_t>(static_cast<const int32_t*>(data)[offset]);
}

// o += x in the compute type of T (logical or for bool), like cpu::add_into.
template <class T>
RD_HOST_DEVICE inline void add_into(T& o, T x) {
  if constexpr (std::is_same_v<T, bool>) {
    o = o || x;
  } else {
    o = static_cast<T>(static_cast<Compute<T>>(o) + static_cast<Compute<T>>(x));
  }
}

// *p += x atomically, for outputs that several threads may update. Each add rounds like
// add_into (16-bit floats: float sum rounded to nearest even), only the order is free, so
// integer and bool results are exact and float results may differ from an in-order sum by
// rounding. Bool only ever stores true, so plain racing stores are already correct. The host
// version (for running kernel bodies on the host) is a plain add_into.
template <class T>
RD_HOST_DEVICE inline void atomic_add_into(T* p, T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, bool>) {
    if (x) *p = true;
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    atomicAdd(p, x);
  } else if constexpr (std::is_same_v<T, int32_t>) {
    atomicAdd(reinterpret_cast<int*>(p), static_cast<int>(x));
  } else if constexpr (std::is_same_v<T, int64_t>) {
    // Two's complement: unsigned wrap-around addition is signed addition.
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(x));
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = x.bits;
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __nv_bfloat16(raw));
  } else {
    static_assert(std::is_same_v<T, Float16>, "atomic_add_into: unsupported type");
    __half_raw raw;
    raw.x = x.bits;
    atomicAdd(reinterpret_cast<__half*>(p), __half(raw));
  }
#else
  add_into(*p, x);
#endif
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

// start + step * i in double with the multiply and the add rounded separately, as the CPU
// (which never contracts to FMA on x86-64) computes it; nvcc would contract by default.
RD_HOST_DEVICE inline double affine_no_fma(double start, double step, double i) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(start, __dmul_rn(step, i));
#else
  volatile double product = step * i;  // volatile: forbid contraction into an FMA
  return start + product;
#endif
}

}  // namespace rd::kernels::cuda
