// CPU SwiGLU forward and backward over contiguous [rows, 2H] gate_up rows (kernels/swiglu.h),
// computed in Compute<T>, rows in parallel.
#include <cstdint>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/swiglu.h"

namespace rd::kernels::cpu {

void CpuBackend::swiglu(const SwigluArgs& args) {
  check_swiglu_args(args);
  const int64_t hidden = args.hidden;
  dispatch_floating(args.dtype, "swiglu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    T* o = static_cast<T*>(args.out);
    const T* in = static_cast<const T*>(args.gate_up);
    parallel_items(args.rows, 2 * hidden, [&](int64_t row) {
      const T* gate = in + row * 2 * hidden;
      const T* up = gate + hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        o[row * hidden + j] =
            static_cast<T>(swiglu_value(static_cast<A>(gate[j]), static_cast<A>(up[j])));
      }
    });
  });
}

void CpuBackend::swiglu_backward(const SwigluBackwardArgs& args) {
  check_swiglu_backward_args(args);
  const int64_t hidden = args.hidden;
  dispatch_floating(args.dtype, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    T* grad_in = static_cast<T*>(args.grad_gate_up);
    const T* grad = static_cast<const T*>(args.grad_out);
    const T* in = static_cast<const T*>(args.gate_up);
    parallel_items(args.rows, 3 * hidden, [&](int64_t row) {
      const int64_t base = row * 2 * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        const SwigluGrads<A> g = swiglu_grads(static_cast<A>(in[base + j]),
                                              static_cast<A>(in[base + hidden + j]),
                                              static_cast<A>(grad[row * hidden + j]));
        grad_in[base + j] = static_cast<T>(g.gate);
        grad_in[base + hidden + j] = static_cast<T>(g.up);
      }
    });
  });
}

}  // namespace rd::kernels::cpu
