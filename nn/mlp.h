// MLP: the feed-forward block of a transformer, with a GELU or a SwiGLU hidden layer.
#pragma once

#include <cstdint>
#include <memory>

#include "ringdilated/nn/linear.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/tensor/generator.h"

namespace rd::nn {

enum class MLPActivation {
  kGelu,    // fc2(gelu(fc1(x))), exact (erf) GELU
  kSwiGLU,  // down(silu(gate(x)) * up(x))
};

// [..., dim] -> [..., dim] through a hidden width `hidden`. Children (Linear layers, drawn
// from `generator` in this order):
//   kGelu:   "fc1" dim -> hidden, "fc2" hidden -> dim
//   kSwiGLU: "gate" dim -> hidden, "up" dim -> hidden, "down" hidden -> dim
// so parameters are named e.g. "fc1.weight", "gate.bias" (biases only with `bias`).
class MLP : public UnaryModule {
 public:
  MLP(int64_t dim, int64_t hidden, MLPActivation activation, bool bias, Generator& generator,
      TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  MLPActivation activation() const { return activation_; }

 private:
  MLPActivation activation_;
  // kGelu uses in_ (fc1) and out_ (fc2); kSwiGLU uses gate_, in_ (up) and out_ (down).
  std::shared_ptr<Linear> gate_;
  std::shared_ptr<Linear> in_;
  std::shared_ptr<Linear> out_;
};

}  // namespace rd::nn
