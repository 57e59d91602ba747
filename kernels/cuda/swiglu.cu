// CUDA SwiGLU forward and backward (kernels/swiglu.h) over contiguous [rows, 2H] gate_up
// rows: one thread per kLanes adjacent columns of one row, loading 16 bytes of gate and up
// (and of the gradient) at a time when H and the pointers allow, else one column per
// thread. The forward reads gate_up once and writes out once; the backward reads grad_out
// and gate_up once and writes both halves of the gradient once: memory-bound, at the
// bandwidth of a copy of those bytes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/swiglu.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: to_compute / from_compute

constexpr int kSwigluThreads = 256;
constexpr int kVectorBytes = 16;

// kLanes adjacent elements moved as one load or store.
template <class T, int kLanes>
struct alignas(sizeof(T) * kLanes) Lanes {
  T v[kLanes];
};

struct SwigluShape {
  int64_t rows, hidden;
  RD_HOST_DEVICE int64_t items() const { return rows * hidden; }
};

template <class T, int kLanes>
__global__ void __launch_bounds__(kSwigluThreads)
    swiglu_kernel(T* out, const T* gate_up, SwigluShape shape) {
  using L = Lanes<T, kLanes>;
  const int64_t items = shape.items() / kLanes;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < items;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = item * kLanes / shape.hidden, col = item * kLanes % shape.hidden;
    const T* gate = gate_up + row * 2 * shape.hidden + col;
    const L g = *reinterpret_cast<const L*>(gate);
    const L u = *reinterpret_cast<const L*>(gate + shape.hidden);
    L o;
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      o.v[k] = from_compute<T>(swiglu_value(to_compute(g.v[k]), to_compute(u.v[k])));
    }
    *reinterpret_cast<L*>(out + row * shape.hidden + col) = o;
  }
}

template <class T, int kLanes>
__global__ void __launch_bounds__(kSwigluThreads)
    swiglu_backward_kernel(T* grad_gate_up, const T* grad_out, const T* gate_up, SwigluShape shape) {
  using L = Lanes<T, kLanes>;
  const int64_t items = shape.items() / kLanes;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < items;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = item * kLanes / shape.hidden, col = item * kLanes % shape.hidden;
    const int64_t gate_at = row * 2 * shape.hidden + col, up_at = gate_at + shape.hidden;
    const L g = *reinterpret_cast<const L*>(gate_up + gate_at);
    const L u = *reinterpret_cast<const L*>(gate_up + up_at);
    const L d = *reinterpret_cast<const L*>(grad_out + row * shape.hidden + col);
    L grad_gate, grad_up;
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      const SwigluGrads<Compute<T>> r =
          swiglu_grads(to_compute(g.v[k]), to_compute(u.v[k]), to_compute(d.v[k]));
      grad_gate.v[k] = from_compute<T>(r.gate);
      grad_up.v[k] = from_compute<T>(r.up);
    }
    *reinterpret_cast<L*>(grad_gate_up + gate_at) = grad_gate;
    *reinterpret_cast<L*>(grad_gate_up + up_at) = grad_up;
  }
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

// Launches launch(lanes_tag, blocks) with 16-byte lanes when every row half starts on a
// 16-byte boundary, else one element per thread.
template <class T, class Launch>
void launch_swiglu(SwigluShape shape, std::initializer_list<const void*> pointers, Launch&& launch) {
  constexpr int kWide = kVectorBytes / static_cast<int>(sizeof(T));
  const bool wide = kWide > 1 && shape.hidden % kWide == 0 &&
                    std::all_of(pointers.begin(), pointers.end(), aligned);
  const int lanes = wide ? kWide : 1;
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>(
      (shape.items() / lanes + kSwigluThreads - 1) / kSwigluThreads, 1, int64_t{1} << 20));
  if (wide) {
    launch(std::integral_constant<int, kWide>{}, blocks);
  } else {
    launch(std::integral_constant<int, 1>{}, blocks);
  }
}

}  // namespace

void swiglu(const SwigluArgs& a, cudaStream_t stream) {
  check_swiglu_args(a);
  const SwigluShape shape{a.rows, a.hidden};
  if (shape.items() == 0) return;
  dispatch_floating(a.dtype, "swiglu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_swiglu<T>(shape, {a.out, a.gate_up}, [&](auto lanes, unsigned blocks) {
      swiglu_kernel<T, decltype(lanes)::value><<<blocks, kSwigluThreads, 0, stream>>>(
          static_cast<T*>(a.out), static_cast<const T*>(a.gate_up), shape);
      RD_CUDA_CHECK_LAUNCH();
    });
  });
}

void swiglu_backward(const SwigluBackwardArgs& a, cudaStream_t stream) {
  check_swiglu_backward_args(a);
  const SwigluShape shape{a.rows, a.hidden};
  if (shape.items() == 0) return;
  dispatch_floating(a.dtype, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_swiglu<T>(shape, {a.grad_gate_up, a.grad_out, a.gate_up},
                     [&](auto lanes, unsigned blocks) {
                       swiglu_backward_kernel<T, decltype(lanes)::value>
                           <<<blocks, kSwigluThreads, 0, stream>>>(
                               static_cast<T*>(a.grad_gate_up), static_cast<const T*>(a.grad_out),
                               static_cast<const T*>(a.gate_up), shape);
                       RD_CUDA_CHECK_LAUNCH();
                     });
  });
}

}  // namespace rd::kernels::cuda
