// CPU random fills: uniform, normal and Bernoulli from the Philox4x32-10 stream, following
// the element -> counter -> value mapping documented in kernels/philox.h bit for bit.
#include <cmath>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/philox.h"

namespace rd::kernels::cpu {
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
T round_sample(double v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return T(static_cast<float>(v));
  }
}

template <class T>
T sample(Distribution dist, double a, double b, const Philox4x32& r) {
  constexpr bool kDouble = std::is_same_v<T, double>;
  switch (dist) {
    case Distribution::kUniform: {
      double u = kDouble ? philox_unit53(r.w[0], r.w[1]) : philox_unit(r.w[0], uniform_bits<T>());
      T v = round_sample<T>(philox_affine(a, b - a, u));
      // Rounding may reach b; keep the range half-open.
      return (a < b && static_cast<double>(v) >= b) ? round_sample<T>(a) : v;
    }
    case Distribution::kNormal: {
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
    case Distribution::kBernoulli: break;  // handled by the caller for every dtype
  }
  return T{};
}

}  // namespace

void CpuBackend::random(const StridedView& out, Distribution dist, double a, double b,
                        uint64_t seed, uint64_t offset) {
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
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const StridedIter<1> it = make_iter<1>({&out});
    for_each_run(it, [&](const auto& p, int64_t n, const auto& s, int64_t linear) {
      for (int64_t k = 0; k < n; ++k) {
        Philox4x32 r = philox_for_element(seed, offset, static_cast<uint64_t>(linear + k));
        T& o = *reinterpret_cast<T*>(p[0] + k * s[0]);
        if (dist == Distribution::kBernoulli) {
          o = convert<T>(philox_unit(r.w[0], 24) < a ? 1 : 0);
        } else if constexpr (kIsFloating<T>) {
          o = sample<T>(dist, a, b, r);
        }
      }
    });
  });
}

}  // namespace rd::kernels::cpu
