// CUDA rotary position embedding: one thread per (batch, position, group of adjacent pairs)
// computes the float64 angles and their cos and sin once (kernels/rotary.h) and rotates
// those pairs in every head, so the float64 work is amortized over the H heads. A group is
// 16 bytes of pairs (one vector load and store per half of a head) where the layout allows,
// else one pair; adjacent threads take adjacent groups, so a warp's accesses are coalesced.
// x is read once and out written once.
//
// Precision: the angle p * base^(-2i/D) is formed in float64 from the integer position
// (relative error ~2^-52, i.e. ~5e-10 rad at p = 2^21) and reduced by the float64 sincos;
// for float32 and 16-bit data cos and sin are then rounded to float32, whose rounding
// (~6e-8) dominates. The CPU computes the same float64 angle, so the two differ only in the
// last bits of pow/sincos and in the float rounding of the products.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/rotary.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: to_compute / from_compute

constexpr int kRotaryThreads = 256;

// Element strides of one [B, T, H, D] operand.
struct RotaryStrides {
  int64_t b, t, h, d;
};

struct RotaryParams {
  RotaryShape shape;
  RotaryStrides out, x;
  int64_t position_offset;
  double base;
  double sign;  // -1 for the inverse rotation
};

RotaryStrides strides_of(const StridedView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.strides[3]};
}

// kLanes adjacent elements moved as one load or store.
template <class T, int kLanes>
struct alignas(sizeof(T) * kLanes) Lanes {
  T v[kLanes];
};

// Heads whose loads are issued together (see rotary_kernel).
constexpr int kHeadChunk = 4;

// kLanes adjacent elements at `at`: one 16-byte access when kLanes > 1 (the head dim is
// then unit-stride and `at` aligned).
template <class T, int kLanes>
__device__ __forceinline__ Lanes<T, kLanes> load_lanes(const T* at) {
  return *reinterpret_cast<const Lanes<T, kLanes>*>(at);
}

template <class T, int kLanes>
__device__ __forceinline__ void store_lanes(T* at, const Lanes<T, kLanes>& v) {
  *reinterpret_cast<Lanes<T, kLanes>*>(at) = v;
}

// One thread per (batch, position, kLanes adjacent pairs i..i+kLanes-1): the angles once,
// then every head's pairs rotated with 16-byte loads and stores where kLanes > 1 (then the
// head dim is unit-stride and the pairs start 16-byte aligned; rotary_embedding checks).
template <class T, int kLanes>
__global__ void __launch_bounds__(kRotaryThreads)
    rotary_kernel(T* out, const T* x, RotaryParams p) {
  using A = Compute<T>;
  using L = Lanes<T, kLanes>;
  const int64_t half = p.shape.half;
  const int64_t groups = half / kLanes;
  const int64_t items = p.shape.batch * p.shape.seq * groups;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < items;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i0 = item % groups * kLanes;
    const int64_t bt = item / groups;
    const int64_t t = bt % p.shape.seq, b = bt / p.shape.seq;
    A cos_a[kLanes], sin_a[kLanes];
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      double s = 0, c = 0;
      sincos(rotary_angle(p.position_offset + t, i0 + k, 2 * half, p.base), &s, &c);
      cos_a[k] = static_cast<A>(c);
      sin_a[k] = static_cast<A>(p.sign * s);
    }
    const int64_t x_base = b * p.x.b + t * p.x.t + i0 * p.x.d;
    const int64_t o_base = b * p.out.b + t * p.out.t + i0 * p.out.d;
    // kHeadChunk heads at a time: all their loads are issued before any store. out may be x
    // itself, so the compiler cannot move a later head's loads above an earlier head's
    // stores; without the chunks every head would wait a full memory round trip.
    for (int64_t h0 = 0; h0 < p.shape.heads; h0 += kHeadChunk) {
      const int64_t left = p.shape.heads - h0;
      const int chunk = left < kHeadChunk ? static_cast<int>(left) : kHeadChunk;
      L x1[kHeadChunk], x2[kHeadChunk];
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j) {
        if (j < chunk) {
          const T* xi = x + x_base + (h0 + j) * p.x.h;
          x1[j] = load_lanes<T, kLanes>(xi);
          x2[j] = load_lanes<T, kLanes>(xi + half * p.x.d);
        }
      }
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j) {
        if (j < chunk) {
          L o1, o2;
#pragma unroll
          for (int k = 0; k < kLanes; ++k) {
            const A a1 = to_compute(x1[j].v[k]), a2 = to_compute(x2[j].v[k]);
            o1.v[k] = from_compute<T>(a1 * cos_a[k] - a2 * sin_a[k]);
            o2.v[k] = from_compute<T>(a2 * cos_a[k] + a1 * sin_a[k]);
          }
          T* oi = out + o_base + (h0 + j) * p.out.h;
          store_lanes<T, kLanes>(oi, o1);
          store_lanes<T, kLanes>(oi + half * p.out.d, o2);
        }
      }
    }
  }
}

// Whether the pairs of both operands can move kLanes at a time: unit-stride head dims, and
// every head, position and batch start (hence every group of kLanes pairs) 16-byte aligned.
bool lanes_fit(const StridedView& out, const StridedView& x, const RotaryShape& shape, int lanes) {
  if (shape.half % lanes != 0) return false;
  const auto aligned = [lanes](const StridedView& v) {
    const size_t bytes = static_cast<size_t>(lanes) * dtype_size(v.dtype);
    if (reinterpret_cast<uintptr_t>(v.data) % bytes != 0 || v.strides[3] != 1) return false;
    for (int d = 0; d < 3; ++d) {
      if (v.shape[d] > 1 && v.strides[d] % lanes != 0) return false;
    }
    return true;
  };
  return aligned(out) && aligned(x);
}

}  // namespace

void rotary_embedding(const StridedView& out, const StridedView& x, int64_t position_offset,
                      double base, bool inverse, cudaStream_t stream) {
  constexpr const char* kOp = "rotary_embedding";
  const RotaryShape shape = check_rotary_args(out, x, position_offset, base);
  const int64_t items = shape.batch * shape.seq * shape.half;
  if (items == 0 || shape.heads == 0) return;
  const RotaryParams p{shape, strides_of(out), strides_of(x), position_offset, base,
                       inverse ? -1.0 : 1.0};
  dispatch_floating(x.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kWide = 16 / static_cast<int>(sizeof(T));
    const bool wide = lanes_fit(out, x, shape, kWide);
    const int64_t threads = items / (wide ? kWide : 1);
    const auto blocks = static_cast<unsigned>(
        std::min<int64_t>((threads + kRotaryThreads - 1) / kRotaryThreads, int64_t{1} << 20));
    if (wide) {
      rotary_kernel<T, kWide><<<blocks, kRotaryThreads, 0, stream>>>(out.ptr<T>(), x.ptr<const T>(), p);
    } else {
      rotary_kernel<T, 1><<<blocks, kRotaryThreads, 0, stream>>>(out.ptr<T>(), x.ptr<const T>(), p);
    }
    RD_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace rd::kernels::cuda
