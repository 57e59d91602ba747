// Shared machinery of the CUDA elementwise-style kernels: the N-d element -> memory offset
// computation for strided operands (dims collapsed on the host, fast 32-bit division on the
// device), aligned vector types for 16-byte loads and stores, and the one grid-stride launch
// every kernel goes through.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/kernels/strided.h"

// `RD_UNROLL for (...)`: unrolls a loop in device code; nothing in host code, whose compiler
// would warn about the unknown pragma.
#if defined(__CUDA_ARCH__)
#define RD_UNROLL _Pragma("unroll")
#else
#define RD_UNROLL
#endif

namespace rd::kernels::cuda {

// Division by a fixed divisor d in [1, 2^31] of dividends n in [0, 2^31): a multiply-high, an
// add and a shift instead of a ~20-instruction integer division. With s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1 (< 2^32), n / d == (umulhi(n, m) + n) >> s; the sum
// stays below 2^32 because umulhi(n, m) < n < 2^31.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    const uint64_t numerator = (uint64_t{1} << 32) * ((uint64_t{1} << shift) - d);
    multiplier = static_cast<uint32_t>(numerator / d + 1);
  }

  RD_HOST_DEVICE uint32_t quotient(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return (high + n) >> shift;
  }
};

// Element offsets of one logical element in each of N operands.
template <int N>
struct Offsets {
  int64_t v[N];
};

// Maps the logical (row-major) index of an element to its element offset in each of N
// operands that share one shape. Built on the host by make_offset_calculator, passed to
// kernels by value. Dims are stored innermost first, so that the device loop, fully unrolled
// over kMaxDims with an early exit, indexes the arrays with constants only (a dynamic index
// into a kernel parameter would copy it to local memory).
template <int N>
struct OffsetCalculator {
  int ndim = 1;         // >= 1 after collapsing
  bool index32 = true;  // numel < 2^31: use FastDivmod instead of 64-bit division
  int64_t sizes[kMaxDims] = {};
  FastDivmod divmods[kMaxDims] = {};  // valid only when index32
  int64_t strides[kMaxDims][N] = {};  // element strides, [dim][operand]

  RD_HOST_DEVICE Offsets<N> get(int64_t linear) const {
    Offsets<N> out;
    RD_UNROLL
    for (int k = 0; k < N; ++k) out.v[k] = 0;
    if (index32) {
      uint32_t rest = static_cast<uint32_t>(linear);
      RD_UNROLL
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        uint32_t idx = rest;  // the outermost dim takes what is left
        if (d + 1 < ndim) {
          const uint32_t q = divmods[d].quotient(rest);
          idx = rest - q * divmods[d].divisor;
          rest = q;
        }
        RD_UNROLL
        for (int k = 0; k < N; ++k) out.v[k] += static_cast<int64_t>(idx) * strides[d][k];
      }
    } else {
      int64_t rest = linear;
      RD_UNROLL
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        int64_t idx = rest;
        if (d + 1 < ndim) {
          const int64_t q = rest / sizes[d];
          idx = rest - q * sizes[d];
          rest = q;
        }
        RD_UNROLL
        for (int k = 0; k < N; ++k) out.v[k] += idx * strides[d][k];
      }
    }
    return out;
  }
};

// Builds the calculator over views[0]'s shape, which every view must have (strides may
// differ, 0 for broadcast). Size-1 dims are dropped and adjacent dims merged where every
// operand allows it, as the CPU's make_iter does; the logical order is never changed, so the
// linear index stays the row-major position in the original shape.
template <int N>
OffsetCalculator<N> make_offset_calculator(const std::array<const StridedView*, N>& views) {
  const StridedView& first = *views[0];
  // Collapsed dims, outermost first.
  std::array<int64_t, kMaxDims> sizes{};
  std::array<std::array<int64_t, N>, kMaxDims> strides{};
  int nd = 0;
  for (int d = 0; d < first.ndim; ++d) {
    if (first.shape[d] == 1) continue;
    std::array<int64_t, N> s{};
    for (int k = 0; k < N; ++k) s[k] = views[k]->strides[d];
    bool mergeable = nd > 0;
    for (int k = 0; k < N && mergeable; ++k) {
      mergeable = strides[nd - 1][k] == s[k] * first.shape[d];
    }
    if (mergeable) {
      sizes[nd - 1] *= first.shape[d];
      strides[nd - 1] = s;
    } else {
      sizes[nd] = first.shape[d];
      strides[nd] = s;
      ++nd;
    }
  }
  OffsetCalculator<N> calc;
  if (nd == 0) {  // a scalar, or all dims of size 1
    calc.ndim = 1;
    calc.sizes[0] = 1;
    return calc;
  }
  const int64_t numel = first.numel();
  calc.ndim = nd;
  calc.index32 = numel <= std::numeric_limits<int32_t>::max();
  for (int d = 0; d < nd; ++d) {
    const int src = nd - 1 - d;  // innermost first
    calc.sizes[d] = sizes[src];
    if (calc.index32) calc.divmods[d] = FastDivmod(static_cast<uint32_t>(sizes[src]));
    for (int k = 0; k < N; ++k) calc.strides[d][k] = strides[src][k];
  }
  return calc;
}

// True when every element of v is the same memory element (a broadcast scalar).
inline bool is_broadcast_scalar(const StridedView& v) {
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] != 1 && v.strides[d] != 0) return false;
  }
  return true;
}

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// kLanes elements of T loaded or stored as one aligned access (16 bytes at most).
template <class T, int kLanes>
struct alignas(sizeof(T) * kLanes) AlignedVec {
  T v[kLanes];
};

// Whether `v` holds its innermost dim in whole aligned vectors of `lanes` elements: stride 1
// there, a multiple of `lanes` long, and every other dim's stride a multiple of `lanes` from
// an aligned start (the rows of a dilated selection: [..., n, D] with D contiguous).
inline bool rows_of_vectors(const StridedView& v, int64_t lanes) {
  if (v.ndim == 0) return false;
  const int last = v.ndim - 1;
  if (v.strides[last] != 1 || v.shape[last] % lanes != 0) return false;
  if (!is_aligned(v.data, dtype_size(v.dtype) * static_cast<size_t>(lanes))) return false;
  for (int d = 0; d < last; ++d) {
    if (v.shape[d] > 1 && v.strides[d] % lanes != 0) return false;
  }
  return true;
}

// `v` with its innermost dim counted in vectors of `lanes` elements (offsets stay in elements).
inline StridedView in_vectors(StridedView v, int64_t lanes) {
  v.shape[v.ndim - 1] /= lanes;
  v.strides[v.ndim - 1] = lanes;
  return v;
}

// --- launching ---

inline constexpr int kThreadsPerBlock = 256;
// Grids stop growing here; grid-stride loops cover the rest. 2^16 blocks of 256 threads keep
// every SM of current GPUs busy for many waves.
inline constexpr int64_t kMaxBlocks = int64_t{1} << 16;

inline unsigned blocks_for(int64_t items) {
  const int64_t blocks = (items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kMaxBlocks));
}

// Calls body(i) for every i in [0, n): each thread walks the range with a stride of the
// whole grid, in 64-bit arithmetic, so any n and any grid size are covered.
template <class Body>
__global__ void __launch_bounds__(kThreadsPerBlock) grid_stride_kernel(int64_t n, Body body) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    body(i);
  }
}

// Launches grid_stride_kernel over n items on `stream` (nothing for n <= 0). `serial` runs
// every item in order on a single thread: for updates whose order matters. Defining
// RD_CUDA_HOST_EMULATION runs the bodies on the host instead, in order, so that kernel logic
// can be checked on a machine without a GPU (bodies are __host__ __device__ for this).
template <class Body>
void launch_grid_stride(int64_t n, const Body& body, cudaStream_t stream, bool serial = false) {
  if (n <= 0) return;
#if defined(RD_CUDA_HOST_EMULATION)
  (void)stream;
  (void)serial;
  for (int64_t i = 0; i < n; ++i) body(i);
#else
  const unsigned blocks = serial ? 1u : blocks_for(n);
  const unsigned threads = serial ? 1u : static_cast<unsigned>(kThreadsPerBlock);
  grid_stride_kernel<Body><<<blocks, threads, 0, stream>>>(n, body);
  RD_CUDA_CHECK_LAUNCH();
#endif
}

}  // namespace rd::kernels::cuda
