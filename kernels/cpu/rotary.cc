// CPU rotary position embedding: each (batch, position) computes the cos and sin of its
// D/2 angles once, in float64, and rotates the pairs of all H heads with them, reading x
// once and writing out once.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/rotary.h"

namespace rd::kernels::cpu {
namespace {

template <class T>
void rotate(const StridedView& out, const StridedView& x, const RotaryShape& s,
            int64_t position_offset, double base, bool inverse) {
  using A = Compute<T>;
  const int64_t dim = 2 * s.half;
  const double sign = inverse ? -1.0 : 1.0;  // the inverse rotates by -angle
  T* o = out.ptr<T>();
  const T* in = x.ptr<T>();
  parallel_items(s.batch * s.seq, s.heads * dim, [&](int64_t bt) {
    const int64_t b = bt / s.seq, t = bt % s.seq;
    const int64_t position = position_offset + t;
    const int64_t x_row = b * x.strides[0] + t * x.strides[1];
    const int64_t o_row = b * out.strides[0] + t * out.strides[1];
    for (int64_t i = 0; i < s.half; ++i) {
      const double angle = rotary_angle(position, i, dim, base);
      const A c = static_cast<A>(std::cos(angle));
      const A sn = static_cast<A>(sign * std::sin(angle));
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t xi = x_row + h * x.strides[2] + i * x.strides[3];
        const int64_t oi = o_row + h * out.strides[2] + i * out.strides[3];
        const A x1 = static_cast<A>(in[xi]);
        const A x2 = static_cast<A>(in[xi + s.half * x.strides[3]]);
        o[oi] = static_cast<T>(x1 * c - x2 * sn);
        o[oi + s.half * out.strides[3]] = static_cast<T>(x2 * c + x1 * sn);
      }
    }
  });
}

}  // namespace

void CpuBackend::rotary_embedding(const StridedView& out, const StridedView& x,
                                  int64_t position_offset, double base, bool inverse) {
  constexpr const char* kOp = "rotary_embedding";
  const RotaryShape s = check_rotary_args(out, x, position_offset, base);
  dispatch_floating(x.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rotate<T>(out, x, s, position_offset, base, inverse);
  });
}

}  // namespace rd::kernels::cpu
