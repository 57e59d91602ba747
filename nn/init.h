// Parameter initialization shared by the layers: values drawn in float32 on the CPU from a
// Generator, then converted, so every device and dtype starts from the same values.
#pragma once

#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Uniform in [-bound, bound).
Tensor uniform_init(Shape shape, double bound, Generator& generator, TensorOptions options);
// Normal with mean 0 and standard deviation `stddev`.
Tensor normal_init(Shape shape, double stddev, Generator& generator, TensorOptions options);

}  // namespace rd::nn
