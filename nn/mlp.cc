// MLP block (see mlp.h).
#include "ringdilated/nn/mlp.h"

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {

MLP::MLP(int64_t dim, int64_t hidden, MLPActivation activation, bool bias, Generator& generator,
         TensorOptions options)
    : activation_(activation) {
  RD_CHECK(dim >= 1 && hidden >= 1, kInvalidArgument,
           "MLP: arguments 'dim' and 'hidden' must be >= 1, got ", dim, " and ", hidden);
  auto linear_layer = [&](int64_t in, int64_t out) {
    return std::make_shared<Linear>(in, out, bias, generator, options);
  };
  switch (activation) {
    case MLPActivation::kGelu:
      in_ = register_module("fc1", linear_layer(dim, hidden));
      out_ = register_module("fc2", linear_layer(hidden, dim));
      return;
    case MLPActivation::kSwiGLU:
      gate_ = register_module("gate", linear_layer(dim, hidden));
      in_ = register_module("up", linear_layer(dim, hidden));
      out_ = register_module("down", linear_layer(hidden, dim));
      return;
  }
  RD_FAIL(kInvalidArgument, "MLP: unknown activation ", static_cast<int>(activation));
}

Tensor MLP::forward(const Tensor& x) {
  if (activation_ == MLPActivation::kGelu) return out_->forward(gelu(in_->forward(x)));
  return out_->forward(silu(gate_->forward(x)) * in_->forward(x));
}

}  // namespace rd::nn
