// Random state of modules: a generator's (seed, offset) kept in a module buffer, so that
// state_dict() saves it and a resumed run draws the same masks, and split_seed(), which
// gives each layer its own stream from one model-wide Generator.
#pragma once

#include <cstdint>

#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Reserves one counter of `generator` and returns a seed mixed from its (seed, counter)
// (the SplitMix64 finalizer): every call gives a new, well-spread seed, and the same
// generator seed gives the same sequence of seeds.
uint64_t split_seed(Generator& generator);

// A new int64 [2] CPU tensor holding (seed, offset), each a uint64 bit-cast to int64.
Tensor generator_state_tensor(Generator::State state);
// The state held by such a tensor; throws rd::Error when `buffer` is not int64 [2] on the
// CPU (e.g. a state dict entry of the wrong form).
Generator::State read_generator_state(const Tensor& buffer);
// Writes `state` into such a tensor in place.
void write_generator_state(const Tensor& buffer, Generator::State state);

// Runs fn(generator) with a generator loaded from `buffer`, then stores the advanced state
// back, so the buffer is the only copy of the stream's position. Not thread-safe for one
// buffer (as a Generator is not).
template <class F>
auto with_generator_from(const Tensor& buffer, F&& fn) {
  Generator generator;
  generator.set_state(read_generator_state(buffer));
  auto result = fn(generator);
  write_generator_state(buffer, generator.state());
  return result;
}

}  // namespace rd::nn
