// Device helpers shared by the CUDA reduction-style kernels (reduce.cu, rowwise.cu,
// gemm_epilogue.cu): storage <-> compute conversions, 16-byte chunks and warp/block folds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ringdilated/kernels/dtype_dispatch.h"
#include "ringdilated/kernels/error.h"

// A namespace of its own: other CUDA files may define similar helpers under
// rd::kernels::cuda, and inline functions of one name must not differ between files.
namespace rd::kernels::cuda::reduce_util {

// kIsHalf, kIsFloating, Compute<T> (float for the 16-bit floats, T otherwise) and Accum<T>
// come from kernels/dtype_dispatch.h, shared with the CPU.

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarp = 32;

// Hardware conversions (one instruction each on sm_80+); they round to nearest even like
// the host structs in half.h, which differ only in the bits of a NaN.
template <class T>
__device__ __forceinline__ Compute<T> to_compute(T v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
  } else if constexpr (std::is_same_v<T, Float16>) {
    return __half2float(__ushort_as_half(v.bits));
  } else {
    return v;
  }
}

template <class T>
__device__ __forceinline__ T from_compute(Compute<T> v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  } else if constexpr (std::is_same_v<T, Float16>) {
    return Float16::from_bits(__half_as_ushort(__float2half_rn(v)));
  } else {
    return v;
  }
}

// Converts a computed value to the storage type To the way the CPU's convert() does
// (through float for the 16-bit floats; nonzero -> true for bool).
template <class To, class From>
__device__ __forceinline__ To convert_to(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (kIsHalf<To>) {
    return from_compute<To>(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

// Writes v, converted to `dtype`, as element `offset` of `base`: for once-per-output
// stores of reductions whose output dtype is only known at run time.
template <class V>
__device__ __forceinline__ void store_as(void* base, DType dtype, int64_t offset, V v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[offset] = convert_to<float>(v); break;
    case DType::kFloat64: static_cast<double*>(base)[offset] = convert_to<double>(v); break;
    case DType::kBFloat16: static_cast<BFloat16*>(base)[offset] = convert_to<BFloat16>(v); break;
    case DType::kFloat16: static_cast<Float16*>(base)[offset] = convert_to<Float16>(v); break;
    case DType::kInt32: static_cast<int32_t*>(base)[offset] = convert_to<int32_t>(v); break;
    case DType::kInt64: static_cast<int64_t*>(base)[offset] = convert_to<int64_t>(v); break;
    case DType::kBool: static_cast<bool*>(base)[offset] = convert_to<bool>(v); break;
  }
}

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }
__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_of(double x) { return sqrt(x); }
__device__ __forceinline__ float tanh_of(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_of(double x) { return tanh(x); }
// The larger of a and b, ignoring a NaN b like std::max(a, b) on the CPU.
template <class A>
__device__ __forceinline__ A max_of(A a, A b) {
  return a < b ? b : a;
}

template <class C>
__host__ __device__ constexpr C lowest_value() {
  if constexpr (std::numeric_limits<C>::has_infinity) {
    return -std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::lowest();
  }
}
template <class C>
__host__ __device__ constexpr C highest_value() {
  if constexpr (std::numeric_limits<C>::has_infinity) {
    return std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::max();
  }
}

// W consecutive elements of T, aligned so that a 16-byte chunk is one 128-bit access.
template <class T, int W>
struct alignas(sizeof(T) * W) Chunk {
  T x[W];
};

// Elements of T per 16-byte vector.
template <class T>
inline constexpr int kVecWidth = static_cast<int>(16 / sizeof(T));

// Loads W elements at p, which must be aligned to sizeof(T) * W. A 16-byte chunk is one
// 128-bit load (through uint4, so the compiler cannot split it).
template <class T, int W>
__device__ __forceinline__ Chunk<T, W> load_chunk(const T* p) {
  Chunk<T, W> c;
  if constexpr (sizeof(Chunk<T, W>) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(&c, &raw, sizeof(raw));
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) c.x[j] = p[j];
  }
  return c;
}

template <class T, int W>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, W>& c) {
  if constexpr (sizeof(Chunk<T, W>) == 16) {
    uint4 raw;
    memcpy(&raw, &c, sizeof(raw));
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) p[j] = c.x[j];
  }
}

// Shuffles any trivially copyable value as 32-bit words (for reduction states that are
// small structs).
template <class S>
__device__ __forceinline__ S shfl_xor_any(const S& s, int lane_mask) {
  static_assert(std::is_trivially_copyable_v<S>);
  constexpr int kWords = static_cast<int>((sizeof(S) + 3) / 4);
  uint32_t words[kWords] = {};
  memcpy(words, &s, sizeof(S));
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __shfl_xor_sync(kFullMask, words[i], lane_mask);
  S r;
  memcpy(&r, words, sizeof(S));
  return r;
}

// Folds v over aligned groups of `width` lanes (a power of two <= 32) with the commutative
// `op`; every lane of a group ends with the group's result. In each butterfly step a lane
// and its partner combine the same two values (in mirrored order), so with a commutative op
// all lanes hold bit-identical results, and the combination order is fixed: deterministic.
template <class S, class Op>
__device__ __forceinline__ S group_fold(S v, int width, const Op& op) {
  for (int offset = width / 2; offset > 0; offset /= 2) v = op(v, shfl_xor_any(v, offset));
  return v;
}

// Folds v over a group of `width` threads: aligned lanes of a warp when width <= 32, else
// the whole block (width == blockDim.x, a multiple of 32), through `smem` (blockDim.x / 32
// entries). Every thread of the group gets the result; warps' partials are combined in
// warp order. Must be reached by every thread of the block when width > 32.
template <class S, class Op>
__device__ __forceinline__ S block_fold(S v, int width, S* smem, const Op& op) {
  if (width <= kWarp) return group_fold(v, width, op);
  v = group_fold(v, kWarp, op);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x % kWarp == 0) smem[warp] = v;
  __syncthreads();
  S r = smem[0];
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  for (int i = 1; i < warps; ++i) r = op(r, smem[i]);
  __syncthreads();  // smem may be reused by the next fold
  return r;
}

struct SumOp {
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
};
struct MaxOp {
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return max_of(a, b);
  }
};

}  // namespace rd::kernels::cuda::reduce_util
