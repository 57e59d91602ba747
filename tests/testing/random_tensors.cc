// Seeded random CPU tensors.
#include "testing/random_tensors.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace rd::test {

Tensor random_nonzero_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> magnitude(0.1, 2.0);
  std::bernoulli_distribution negative(0.5);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> values(static_cast<size_t>(n));
  for (double& v : values) v = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return from_vector<double>(std::move(values), shape).to(dtype);
}

}  // namespace rd::test
