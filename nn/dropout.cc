// Dropout layer (see dropout.h).
#include "ringdilated/nn/dropout.h"


#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

double checked_p(double p) {
  RD_CHECK(p >= 0.0 && p <= 1.0, kInvalidArgument, "Dropout: argument 'p' must be in [0, 1], got ",
           p);
  return p;
}

}  // namespace

Dropout::Dropout(double p, uint64_t seed)
    : p_(checked_p(p)),
      generator_(*this, "generator_state", seed) {}

Dropout::Dropout(double p, Generator& generator) : Dropout(p, split_seed(generator)) {}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p_ == 0.0) return x;
  return generator_.use([&](Generator& generator) {
    return dropout(x, p_, /*training=*/true, generator);
  });
}

}  // namespace rd::nn
