// Linear layer (see linear.h).
#include "ringdilated/nn/linear.h"

#include <cmath>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/init.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

double init_bound(int64_t in_features) { return 1.0 / std::sqrt(static_cast<double>(in_features)); }

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& generator,
               TensorOptions options)
    : in_features_(checked_layer_size(in_features, "Linear", "in_features")),
      out_features_(checked_layer_size(out_features, "Linear", "out_features")),
      has_bias_(bias),
      weight_(register_parameter(
          "weight",
          uniform_init({out_features, in_features}, init_bound(in_features), generator, options))) {
  if (bias) {
    bias_ = &register_parameter(
        "bias", uniform_init({out_features}, init_bound(in_features), generator, options));
  }
}

Tensor Linear::forward(const Tensor& x) {
  RD_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features_, kShapeMismatch,
           "Linear: input must be [..., ", in_features_, "], got shape ",
           x.defined() ? shape_str(x.shape()) : std::string("(undefined)"));
  return linear(x, weight_, has_bias_ ? *bias_ : Tensor());
}

}  // namespace rd::nn
