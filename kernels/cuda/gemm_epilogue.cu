// The standalone GEMM epilogue kernel: C = act(scale * C + bias), one thread an element.
#include "ringdilated/kernels/cuda/gemm_epilogue.h"

#include <algorithm>

#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: conversions and dtype dispatch

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535 * 16;  // grid-stride beyond this

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): cuBLASLt's GELU (the tanh form).
template <class A>
__device__ __forceinline__ A gelu_tanh(A x) {
  const A kBeta = A(0.7978845608028654);  // sqrt(2 / pi)
  const A kKappa = A(0.044715);
  return A(0.5) * x * (A(1) + tanh_of(kBeta * (x + kKappa * x * x * x)));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    gemm_epilogue_kernel(T* c, const T* bias, int64_t m, int64_t n, int64_t ldc, int64_t stride_c,
                         int64_t total, Compute<T> scale, bool gelu) {
  using A = Compute<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t col = i % n;
    const int64_t row = (i / n) % m;
    const int64_t entry = i / (n * m);
    T* p = c + entry * stride_c + row * ldc + col;
    A v = scale == A(0) ? A(0) : scale * to_compute(*p);
    if (bias != nullptr) v += to_compute(bias[col]);
    if (gelu) v = gelu_tanh(v);
    *p = from_compute<T>(v);
  }
}

}  // namespace

void gemm_epilogue(const GemmEpilogueArgs& a, cudaStream_t stream) {
  const int64_t total = a.batch * a.m * a.n;
  if (total == 0) return;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (total + kThreads - 1) / kThreads));
  dispatch_floating(a.dtype, "gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gemm_epilogue_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<T*>(a.c), static_cast<const T*>(a.bias), a.m, a.n, a.ldc, a.stride_c, total,
        static_cast<Compute<T>>(a.scale), a.gelu);
  });
  RD_CUDA_CHECK_LAUNCH();
}

}  // namespace rd::kernels::cuda
