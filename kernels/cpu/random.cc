// CPU random fills: uniform, normal and Bernoulli from the Philox4x32-10 stream, following
// the element -> counter -> value mapping documented in kernels/philox.h bit for bit.
#include <cmath>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/philox.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cpu {

void CpuBackend::random(const StridedView& out, Distribution dist, double a, double b,
                        uint64_t seed, uint64_t offset) {
  check_random_args(out, dist, a, b);
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const StridedIter<1> it = make_iter<1>({&out});
    for_each_run(it, [&](const auto& p, int64_t n, const auto& s, int64_t linear) {
      for (int64_t k = 0; k < n; ++k) {
        Philox4x32 r = philox_for_element(seed, offset, static_cast<uint64_t>(linear + k));
        T& o = *reinterpret_cast<T*>(p[0] + k * s[0]);
        if (dist == Distribution::kBernoulli) {
          o = convert<T>(philox_bernoulli(a, r) ? 1 : 0);
        } else if constexpr (kIsFloating<T>) {
          o = philox_sample<T>(dist == Distribution::kNormal, a, b, r);
        }
      }
    });
  });
}

}  // namespace rd::kernels::cpu
