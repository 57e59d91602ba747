// Finite-difference gradient checks: analytic gradients from the autograd engine against
// float64 central differences, with a random non-zero upstream gradient.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::test {

using MultiOutputFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
using SingleOutputFn = std::function<Tensor(const std::vector<Tensor>&)>;

struct GradcheckOptions {
  double eps = 1e-6;   // central-difference step
  double rtol = 1e-5;  // |analytic - numeric| <= atol + rtol * |numeric|
  double atol = 1e-6;
  uint64_t seed = 0x5eed;  // for the upstream gradients
};

// Checks, for every float64 input x, d/dx of L = sum_j sum(outputs_j * w_j), with fixed
// random non-zero w_j, against central differences of L. Other inputs (indices, masks) pass
// through untouched. Inputs may be non-contiguous views: each logical element is perturbed
// in its storage slot, so views that overlap themselves (stride 0) are refused, and an input
// must not share memory with another. fn must be deterministic (re-seed any Generator
// inside it).
::testing::AssertionResult gradcheck(const MultiOutputFn& fn, const std::vector<Tensor>& inputs,
                                     const GradcheckOptions& options = {});
::testing::AssertionResult gradcheck(const SingleOutputFn& fn, const std::vector<Tensor>& inputs,
                                     const GradcheckOptions& options = {});

// The random upstream gradients gradcheck uses for `outputs` (undefined for outputs that
// are not floating point).
std::vector<Tensor> upstream_gradients(const std::vector<Tensor>& outputs, uint64_t seed);

// The analytic gradients of L (see gradcheck) w.r.t. each input, computed by fresh leaves
// that share the inputs' memory; undefined for inputs that are not float64 or got no
// gradient. Used to compare devices against the CPU.
std::vector<Tensor> analytic_gradients(const MultiOutputFn& fn, const std::vector<Tensor>& inputs,
                                       uint64_t seed);

}  // namespace rd::test
