// CUDA rotary position embedding: one thread per (batch, position, pair i) computes the
// float64 angle and its cos and sin once (kernels/rotary.h) and rotates that pair in every
// head, so the float64 work is amortized over the H heads; adjacent threads take adjacent
// pairs, so the loads and stores of a warp are coalesced for contiguous [B, T, H, D] data.
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

template <class T>
__global__ void __launch_bounds__(kRotaryThreads)
    rotary_kernel(T* out, const T* x, RotaryParams p) {
  using A = Compute<T>;
  const int64_t half = p.shape.half;
  const int64_t items = p.shape.batch * p.shape.seq * half;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < items;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = item % half;
    const int64_t bt = item / half;
    const int64_t t = bt % p.shape.seq, b = bt / p.shape.seq;
    double s = 0, c = 0;
    sincos(rotary_angle(p.position_offset + t, i, 2 * half, p.base), &s, &c);
    const A cos_a = static_cast<A>(c);
    const A sin_a = static_cast<A>(p.sign * s);
    const int64_t x_base = b * p.x.b + t * p.x.t + i * p.x.d;
    const int64_t o_base = b * p.out.b + t * p.out.t + i * p.out.d;
    for (int64_t h = 0; h < p.shape.heads; ++h) {
      const int64_t xi = x_base + h * p.x.h;
      const int64_t oi = o_base + h * p.out.h;
      const A x1 = to_compute(x[xi]);
      const A x2 = to_compute(x[xi + half * p.x.d]);
      out[oi] = from_compute<T>(x1 * cos_a - x2 * sin_a);
      out[oi + half * p.out.d] = from_compute<T>(x2 * cos_a + x1 * sin_a);
    }
  }
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
  const auto blocks = static_cast<unsigned>(
      std::min<int64_t>((items + kRotaryThreads - 1) / kRotaryThreads, int64_t{1} << 20));
  dispatch_floating(x.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rotary_kernel<T><<<blocks, kRotaryThreads, 0, stream>>>(out.ptr<T>(), x.ptr<const T>(), p);
    RD_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace rd::kernels::cuda
