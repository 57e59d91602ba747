// Module random state in buffers and seed splitting (see random_state.h).
#include "ringdilated/nn/random_state.h"

#include <bit>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

constexpr int64_t kSeedSlot = 0;
constexpr int64_t kOffsetSlot = 1;
constexpr int64_t kStateSize = 2;

// SplitMix64's output function: a bijection of uint64 whose outputs for nearby inputs look
// independent, so consecutive counters give unrelated seeds.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void check_state_buffer(const Tensor& buffer) {
  RD_CHECK(buffer.defined() && buffer.dtype() == DType::kInt64 &&
               buffer.shape() == Shape{kStateSize} && buffer.device().is_cpu(),
           kInvalidArgument,
           "generator state: expected an int64 [2] cpu tensor (seed, offset), got ",
           buffer.defined() ? buffer.str() : std::string("an undefined tensor"));
}

}  // namespace

uint64_t split_seed(Generator& generator) {
  const uint64_t counter = generator.advance(1);
  return mix64(mix64(generator.seed()) + counter);
}

Tensor generator_state_tensor(Generator::State state) {
  Tensor buffer = zeros({kStateSize}, DType::kInt64);
  write_generator_state(buffer, state);
  return buffer;
}

Generator::State read_generator_state(const Tensor& buffer) {
  check_state_buffer(buffer);
  const std::vector<int64_t> values = buffer.to_vector<int64_t>();
  return {std::bit_cast<uint64_t>(values[kSeedSlot]),
          std::bit_cast<uint64_t>(values[kOffsetSlot])};
}

BufferedGenerator::BufferedGenerator(Module& owner, const std::string& name, uint64_t seed)
    : generator_(seed),
      buffer_(owner.register_buffer(name, generator_state_tensor(generator_.state()),
                                    BufferDevice::kHost)) {}

void write_generator_state(const Tensor& buffer, Generator::State state) {
  check_state_buffer(buffer);
  Tensor values = from_vector<int64_t>(
      {std::bit_cast<int64_t>(state.seed), std::bit_cast<int64_t>(state.offset)}, {kStateSize});
  Tensor target = buffer;
  target.copy_(values);
}

}  // namespace rd::nn
