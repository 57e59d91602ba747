// Linear layer (see linear.h).
#include "ringdilated/nn/linear.h"

#include <cmath>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

// Uniform in [-bound, bound), drawn in float32 on the CPU so that every device and dtype
// starts from the same values, then converted.
Tensor uniform(Shape shape, double bound, Generator& generator, TensorOptions options) {
  Tensor u = rand(std::move(shape), generator, TensorOptions(DType::kFloat32));
  return ((u * 2.0 - 1.0) * bound).to(options.dtype).to(options.device);
}

int64_t checked_features(int64_t value, const char* name) {
  RD_CHECK(value >= 1, kInvalidArgument, "Linear: argument '", name, "' must be >= 1, got ",
           value);
  return value;
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& generator,
               TensorOptions options)
    : in_features_(checked_features(in_features, "in_features")),
      out_features_(checked_features(out_features, "out_features")),
      has_bias_(bias),
      weight_(register_parameter(
          "weight", uniform({out_features, in_features},
                            1.0 / std::sqrt(static_cast<double>(in_features)), generator,
                            options))) {
  if (bias) {
    bias_ = &register_parameter(
        "bias", uniform({out_features}, 1.0 / std::sqrt(static_cast<double>(in_features)),
                        generator, options));
  }
}

Tensor Linear::forward(const Tensor& x) const {
  RD_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features_, kShapeMismatch,
           "Linear: input must be [..., ", in_features_, "], got shape ",
           x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  return linear(x, weight_, has_bias_ ? *bias_ : Tensor());
}

}  // namespace rd::nn
