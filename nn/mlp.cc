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
  // One GEMM for the gate and the up projection (their weights stacked, a small copy), then
  // one fused SwiGLU kernel each way: the [tokens, hidden] activations are the largest
  // tensors of a block, and separate silu and mul ops would pass over them eight times.
  const Tensor weight = cat({gate_->weight(), in_->weight()}, 0);
  const Tensor bias = gate_->bias() ? cat({*gate_->bias(), *in_->bias()}, 0) : Tensor();
  return out_->forward(swiglu(linear(x, weight, bias)));
}

}  // namespace rd::nn
