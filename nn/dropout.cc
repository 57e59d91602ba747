// Dropout layer (see dropout.h).
#include "ringdilated/nn/dropout.h"


#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/random_state.h"
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
      generator_state_(register_buffer("generator_state",
                                       generator_state_tensor(Generator(seed).state()),
                                       BufferDevice::kHost)) {}

Dropout::Dropout(double p, Generator& generator) : Dropout(p, split_seed(generator)) {}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p_ == 0.0) return x;
  return with_generator_from(generator_state_, [&](Generator& generator) {
    return dropout(x, p_, /*training=*/true, generator);
  });
}

Generator::State Dropout::generator_state() const {
  return read_generator_state(generator_state_);
}

}  // namespace rd::nn
