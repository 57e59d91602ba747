// LayerNorm and RMSNorm (see norm.h).
#include "ringdilated/nn/norm.h"

#include <cmath>
#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/init.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

double checked_eps(double eps, const char* layer) {
  RD_CHECK(std::isfinite(eps) && eps >= 0.0, kInvalidArgument, layer,
           ": argument 'eps' must be finite and >= 0, got ", eps);
  return eps;
}

void check_input(const Tensor& x, int64_t dim, const char* layer) {
  RD_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == dim, kShapeMismatch, layer,
           ": input must be [..., ", dim, "], got ",
           x.defined() ? shape_str(x.shape()) : std::string("an undefined tensor"));
}

Tensor optional(const Tensor* t) { return t != nullptr ? *t : Tensor(); }

}  // namespace

LayerNorm::LayerNorm(int64_t dim, double eps, bool elementwise_affine, bool bias,
                     TensorOptions options)
    : dim_(checked_layer_size(dim, "LayerNorm", "dim")), eps_(checked_eps(eps, "LayerNorm")) {
  if (!elementwise_affine) return;
  weight_ = &register_parameter("weight", ones({dim}, options));
  if (bias) bias_ = &register_parameter("bias", zeros({dim}, options));
}

Tensor LayerNorm::forward(const Tensor& x) {
  check_input(x, dim_, "LayerNorm");
  return layer_norm(x, {dim_}, optional(weight_), optional(bias_), eps_);
}

RMSNorm::RMSNorm(int64_t dim, double eps, bool affine, TensorOptions options)
    : dim_(checked_layer_size(dim, "RMSNorm", "dim")), eps_(checked_eps(eps, "RMSNorm")) {
  if (affine) weight_ = &register_parameter("weight", ones({dim}, options));
}

Tensor RMSNorm::forward(const Tensor& x) {
  check_input(x, dim_, "RMSNorm");
  return rms_norm(x, {dim_}, optional(weight_), eps_);
}

AddNormResult RMSNorm::forward_add(const Tensor& x, const Tensor& residual) {
  check_input(x, dim_, "RMSNorm");
  return add_rms_norm(x, residual, {dim_}, optional(weight_), eps_);
}

}  // namespace rd::nn
