// SwiGLU's math, shared by every backend (KernelBackend::swiglu): a row of gate_up [2H]
// holds the gate in its first half and the up projection in its second, and gives
// out = silu(gate) * up [H]; the backward pass writes both halves of the row's gradient.
#pragma once

#include <cmath>

#include "ringdilated/kernels/half.h"  // RD_HOST_DEVICE

namespace rd::kernels {

template <class A>
RD_HOST_DEVICE inline A swiglu_sigmoid(A x) {
#if defined(__CUDA_ARCH__)
  return A(1) / (A(1) + exp(-x));
#else
  return A(1) / (A(1) + std::exp(-x));
#endif
}

// silu(gate) * up = gate * sigmoid(gate) * up.
template <class A>
RD_HOST_DEVICE inline A swiglu_value(A gate, A up) {
  return gate * swiglu_sigmoid(gate) * up;
}

// d/d gate = grad * up * s * (1 + gate * (1 - s)) and d/d up = grad * silu(gate), s the
// sigmoid of gate.
template <class A>
struct SwigluGrads {
  A gate, up;
};

template <class A>
RD_HOST_DEVICE inline SwigluGrads<A> swiglu_grads(A gate, A up, A grad) {
  const A s = swiglu_sigmoid(gate);
  return {grad * up * s * (A(1) + gate * (A(1) - s)), grad * gate * s};
}

}  // namespace rd::kernels
