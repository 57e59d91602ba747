// CUDA random fills: uniform, normal and Bernoulli from the Philox4x32-10 stream, following
// the element -> counter -> value mapping of kernels/philox.h bit for bit, so that a seed
// gives the same tensor on every device. Uniform and Bernoulli samples equal the CPU's
// exactly; normal samples go through the device's double log/cos/sqrt (precise versions, not
// intrinsics), which may differ from the host's in the last double ulp, so float64 normals
// can differ from the CPU's in the last bits and float32/16-bit normals very rarely
// (~2^-29 per element) by one ulp.
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "ringdilated/kernels/cuda/dtype_dispatch.cuh"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/strided_index.cuh"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/philox.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cuda {
namespace {

// Element i (logical row-major order) of out uses Philox counter offset + i.
template <class T>
struct RandomBody {
  T* out;
  OffsetCalculator<1> calc;
  Distribution dist;
  double a;
  double b;
  uint64_t seed;
  uint64_t offset;

  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Philox4x32 r = philox_for_element(seed, offset, static_cast<uint64_t>(i));
    T& o = out[calc.get(i).v[0]];
    if (dist == Distribution::kBernoulli) {
      o = convert<T>(philox_bernoulli(a, r) ? 1 : 0);
    } else if constexpr (kIsFloating<T>) {
      o = philox_sample<T>(dist == Distribution::kNormal, a, b, r);
    }
  }
};

}  // namespace

void random(const StridedView& out, Distribution dist, double a, double b, uint64_t seed,
            uint64_t offset, cudaStream_t stream) {
  check_random_args(out, dist, a, b);
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // A contiguous out collapses to one dim: its offsets need no division.
    launch_grid_stride(n,
                       RandomBody<T>{static_cast<T*>(out.data), make_offset_calculator<1>({&out}),
                                     dist, a, b, seed, offset},
                       stream);
  });
}

}  // namespace rd::kernels::cuda
