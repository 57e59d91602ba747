// Normalization layers over the last dim: LayerNorm and RMSNorm, around rd::layer_norm and
// rd::rms_norm.
#pragma once

#include <cstdint>

#include "ringdilated/nn/module.h"
#include "ringdilated/tensor/ops.h"  // AddNormResult

namespace rd::nn {

// y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).
// Parameters "weight" (ones) and "bias" (zeros), both [dim]: weight only with
// elementwise_affine, bias only with elementwise_affine and bias.
class LayerNorm : public UnaryModule {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool elementwise_affine = true,
                     bool bias = true, TensorOptions options = {});
  // [..., dim] -> [..., dim].
  Tensor forward(const Tensor& x) override;

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }
  const Tensor* weight() const { return weight_; }  // null without elementwise_affine
  const Tensor* bias() const { return bias_; }       // null without a bias

 private:
  int64_t dim_;
  double eps_;
  Tensor* weight_ = nullptr;
  Tensor* bias_ = nullptr;
};

// y = x / sqrt(mean(x^2) + eps) * weight over the last dim. Parameter "weight" [dim] (ones)
// only with `affine`.
class RMSNorm : public UnaryModule {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6, bool affine = true,
                   TensorOptions options = {});
  // [..., dim] -> [..., dim].
  Tensor forward(const Tensor& x) override;
  // The norm of x + residual and that sum, from one kernel (add_rms_norm): for a pre-norm
  // block, whose residual add feeds the next norm.
  AddNormResult forward_add(const Tensor& x, const Tensor& residual);

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }
  const Tensor* weight() const { return weight_; }  // null without `affine`

 private:
  int64_t dim_;
  double eps_;
  Tensor* weight_ = nullptr;
};

}  // namespace rd::nn
