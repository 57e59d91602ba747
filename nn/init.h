// Parameter initialization shared by the layers: their size check, and values drawn in
// float32 on the CPU from a Generator, then converted, so every device and dtype starts
// from the same values.
#pragma once

#include <cstdint>

#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// `value`, a size the constructor of `layer` takes as argument `arg`; throws rd::Error
// (kInvalidArgument) naming both and the value unless it is >= 1.
int64_t checked_layer_size(int64_t value, const char* layer, const char* arg);

// Uniform in [-bound, bound).
Tensor uniform_init(Shape shape, double bound, Generator& generator, TensorOptions options);
// Normal with mean 0 and standard deviation `stddev`.
Tensor normal_init(Shape shape, double stddev, Generator& generator, TensorOptions options);

}  // namespace rd::nn
