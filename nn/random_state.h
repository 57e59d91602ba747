// Random state of modules: a Generator mirrored into a module buffer, so that state_dict()
// saves its position and a resumed run draws the same masks, and split_seed(), which gives
// each layer its own stream from one model-wide Generator.
#pragma once

#include <cstdint>
#include <string>

#include "ringdilated/nn/module.h"
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

// A layer's random stream. The Generator is the live state (hand it to rd::checkpoint,
// which rewinds it for the replay); after every use its state is written to a host buffer
// of the owning module, which state_dict() saves, and the owner's on_state_loaded() calls
// reload() to adopt a loaded buffer. A change made directly through generator() reaches
// the buffer at the next use. Not thread-safe (as a Generator is not).
class BufferedGenerator {
 public:
  // Registers the buffer `name` on `owner` (kHost), seeded with `seed`, offset 0.
  BufferedGenerator(Module& owner, const std::string& name, uint64_t seed);

  // Returns fn(generator()) and stores the generator's advanced state in the buffer.
  template <class F>
  auto use(F&& fn) {
    auto result = fn(generator_);
    write_generator_state(buffer_, generator_.state());
    return result;
  }
  void reload() { generator_.set_state(read_generator_state(buffer_)); }
  Generator& generator() { return generator_; }
  Generator::State state() const { return generator_.state(); }

 private:
  Generator generator_;
  Tensor& buffer_;
};

}  // namespace rd::nn
