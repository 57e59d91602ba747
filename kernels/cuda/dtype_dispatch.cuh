// CUDA-side additions to the shared dtype dispatch (kernels/dtype_dispatch.h): loads of a
// run-time dtype, index loads and atomic adds, usable in device code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cuda {

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

}  // namespace rd::kernels::cuda
