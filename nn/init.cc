// Parameter initialization (see init.h).
#include "ringdilated/nn/init.h"

#include <utility>

#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

// Where every draw happens: float32 on the CPU, whatever the target.
const TensorOptions kDrawOptions(DType::kFloat32);

Tensor placed(const Tensor& drawn, TensorOptions options) {
  return drawn.to(options.dtype).to(options.device);
}

}  // namespace

Tensor uniform_init(Shape shape, double bound, Generator& generator, TensorOptions options) {
  Tensor u = rand(std::move(shape), generator, kDrawOptions);
  return placed((u * 2.0 - 1.0) * bound, options);
}

Tensor normal_init(Shape shape, double stddev, Generator& generator, TensorOptions options) {
  return placed(randn(std::move(shape), generator, kDrawOptions) * stddev, options);
}

}  // namespace rd::nn
