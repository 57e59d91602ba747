// Seeded random CPU tensors for tests that work on Tensors directly (optimizers, copies).
#pragma once

#include <random>

#include "ringdilated/tensor/tensor.h"

namespace rd::test {

// Random values of magnitude [0.1, 2] and random sign (so never near 0), drawn in float64
// and rounded to `dtype`, in a new contiguous CPU tensor.
Tensor random_nonzero_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng);

}  // namespace rd::test
