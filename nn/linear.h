// Linear: y = x W^T + b over the last dim, the projection layer of the attention modules.
#pragma once

#include <cstdint>

#include "ringdilated/nn/module.h"
#include "ringdilated/tensor/generator.h"

namespace rd::nn {

class Linear : public UnaryModule {
 public:
  // Parameters "weight" [out, in] and "bias" [out] drawn uniformly from +-1/sqrt(in)
  // (PyTorch's default), created with `options` (dtype and device).
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& generator,
         TensorOptions options = {});

  // [..., in] -> [..., out].
  Tensor forward(const Tensor& x) override;

  const Tensor& weight() const { return weight_; }
  const Tensor* bias() const { return has_bias_ ? bias_ : nullptr; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  int64_t in_features_;
  int64_t out_features_;
  bool has_bias_;
  Tensor& weight_;
  Tensor* bias_ = nullptr;
};

}  // namespace rd::nn
