// Parameter initialization (see init.h).
#include "ringdilated/nn/init.h"

#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

// Where every draw happens: float32 on the CPU, whatever the target.
const TensorOptions kDrawOptions(DType::kFloat32);

Tensor placed(const Tensor& drawn, TensorOptions options) {
  return drawn.to(options.dtype).to(options.device);
}

}  // namespace

int64_t checked_layer_size(int64_t value, const char* layer, const char* arg) {
  RD_CHECK(value >= 1, kInvalidArgument, layer, ": argument '", arg, "' must be >= 1, got ", value);
  return value;
}

Tensor uniform_init(Shape shape, double bound, Generator& generator, TensorOptions options) {
  Tensor u = rand(std::move(shape), generator, kDrawOptions);
  return placed((u * 2.0 - 1.0) * bound, options);
}

Tensor normal_init(Shape shape, double stddev, Generator& generator, TensorOptions options) {
  return placed(randn(std::move(shape), generator, kDrawOptions) * stddev, options);
}

}  // namespace rd::nn
