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

namespace rd::kernels::cuda {
namespace {

// Significand precision of T: the uniform draw's bit count, so u is exact in T.
template <class T>
constexpr int uniform_bits() {
  if constexpr (std::is_same_v<T, BFloat16>) return 8;
  if constexpr (std::is_same_v<T, Float16>) return 11;
  return 24;
}

// Rounds a double sample to T: to float32 first, then to the storage type.
template <class T>
RD_HOST_DEVICE T round_sample(double v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return T(static_cast<float>(v));
  }
}

template <class T>
RD_HOST_DEVICE double as_double(T v) {
  return static_cast<double>(static_cast<Compute<T>>(v));
}

// One uniform or normal sample from the element's Philox block (the CPU's `sample`).
template <class T>
RD_HOST_DEVICE T sample(Distribution dist, double a, double b, const Philox4x32& r) {
  constexpr bool kDouble = std::is_same_v<T, double>;
  if (dist == Distribution::kUniform) {
    const double u =
        kDouble ? philox_unit53(r.w[0], r.w[1]) : philox_unit(r.w[0], uniform_bits<T>());
    const T v = round_sample<T>(philox_affine(a, b - a, u));
    // Rounding may reach b; keep the range half-open.
    return (a < b && as_double(v) >= b) ? round_sample<T>(a) : v;
  }
  double u1, u2;
  if constexpr (kDouble) {
    u1 = philox_unit53(r.w[0], r.w[1]) + 1.0 / 9007199254740992.0;  // (0, 1]
    u2 = philox_unit53(r.w[2], r.w[3]);
  } else {
    u1 = philox_unit(r.w[0], 24) + 1.0 / 16777216.0;  // (0, 1]
    u2 = philox_unit(r.w[1], 24);
  }
  return round_sample<T>(philox_affine(a, b, philox_box_muller(u1, u2)));
}

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
      o = convert<T>(philox_unit(r.w[0], 24) < a ? 1 : 0);
    } else if constexpr (kIsFloating<T>) {
      o = sample<T>(dist, a, b, r);
    }
  }
};

}  // namespace

void random(const StridedView& out, Distribution dist, double a, double b, uint64_t seed,
            uint64_t offset, cudaStream_t stream) {
  switch (dist) {
    case Distribution::kUniform:
      RD_CHECK(std::isfinite(a) && std::isfinite(b) && a <= b, kInvalidArgument,
               "random uniform: needs finite a <= b, got a=", a, " b=", b);
      break;
    case Distribution::kNormal:
      RD_CHECK(std::isfinite(a) && std::isfinite(b) && b >= 0, kInvalidArgument,
               "random normal: needs a finite mean and stddev >= 0, got mean=", a, " stddev=", b);
      break;
    case Distribution::kBernoulli:
      RD_CHECK(a >= 0 && a <= 1, kInvalidArgument,
               "random bernoulli: probability must be in [0, 1], got ", a);
      break;
  }
  if (dist != Distribution::kBernoulli) {
    RD_CHECK(is_floating(out.dtype), kDTypeMismatch,
             "random: uniform and normal fills need a floating dtype, got ",
             dtype_name(out.dtype));
  }
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
