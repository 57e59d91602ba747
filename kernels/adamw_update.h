// The AdamW update of one element and its per-step constants, host+device, so the CPU and
// CUDA kernels round identically (bit for bit). The formula is on AdamWStep in backend.h.
#pragma once

#include <cmath>
#include <span>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels {

// Throws rd::Error naming "adamw", the argument and the tensor index for a call that breaks
// the contract of KernelBackend::adamw (defined in view_checks.cc with the other checks).
void check_adamw_args(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step);

// The per-step constants, derived on the host in double (bias corrections included). Plain
// data, so a CUDA launch can carry it as a kernel parameter.
struct AdamWConstants {
  double decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
      bias_correction2_sqrt, eps;

  static AdamWConstants from(const AdamWStep& s) {
    const double t = static_cast<double>(s.step);
    return {1.0 - s.lr * s.weight_decay,
            s.beta1,
            1.0 - s.beta1,
            s.beta2,
            1.0 - s.beta2,
            s.lr / (1.0 - std::pow(s.beta1, t)),
            std::sqrt(1.0 - std::pow(s.beta2, t)),
            s.eps};
  }
};

// The constants rounded once to the compute type A.
template <class A>
struct AdamWCoefficients {
  A decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps;

  RD_HOST_DEVICE explicit AdamWCoefficients(const AdamWConstants& k)
      : decay(static_cast<A>(k.decay)),
        beta1(static_cast<A>(k.beta1)),
        one_minus_beta1(static_cast<A>(k.one_minus_beta1)),
        beta2(static_cast<A>(k.beta2)),
        one_minus_beta2(static_cast<A>(k.one_minus_beta2)),
        step_size(static_cast<A>(k.step_size)),
        bias_correction2_sqrt(static_cast<A>(k.bias_correction2_sqrt)),
        eps(static_cast<A>(k.eps)) {}
};

namespace adamw_detail {
// Correctly rounded operations the compiler may not fuse: nvcc contracts a * b + c into an
// FMA by default, the host compiler (x86-64 without -mfma) never does.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double root(double a) { return __dsqrt_rn(a); }
#else
template <class A>
inline A add(A a, A b) { return a + b; }
template <class A>
inline A sub(A a, A b) { return a - b; }
template <class A>
inline A mul(A a, A b) { return a * b; }
template <class A>
inline A div(A a, A b) { return a / b; }
template <class A>
inline A root(A a) { return std::sqrt(a); }
#endif
}  // namespace adamw_detail

// One element in the compute type: p, m and v are updated in place from gradient g.
template <class A>
RD_HOST_DEVICE inline void adamw_element(A& p, A g, A& m, A& v, const AdamWCoefficients<A>& c) {
  using namespace adamw_detail;  // NOLINT: the rounded operations above
  const A decayed = mul(p, c.decay);
  m = add(mul(c.beta1, m), mul(c.one_minus_beta1, g));
  v = add(mul(c.beta2, v), mul(mul(c.one_minus_beta2, g), g));
  const A denom = add(div(root(v), c.bias_correction2_sqrt), c.eps);
  p = sub(decayed, mul(c.step_size, div(m, denom)));
}

}  // namespace rd::kernels
