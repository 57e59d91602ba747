// Dropout: zeroes each element with probability p and scales the rest by 1 / (1 - p) in
// training mode; its random stream is a buffer, so checkpoints resume the same masks.
#pragma once

#include <cstdint>

#include "ringdilated/nn/module.h"
#include "ringdilated/nn/random_state.h"
#include "ringdilated/tensor/generator.h"

namespace rd::nn {

class Dropout : public UnaryModule {
 public:
  // p in [0, 1]. The layer owns a generator seeded with `seed`, mirrored into the host
  // buffer "generator_state" (int64 [2]: seed and offset, each uint64 bit-cast), which
  // state_dict() saves and load_state_dict() restores (see BufferedGenerator).
  Dropout(double p, uint64_t seed);
  // Seeded by split_seed(generator) (nn/random_state.h): layers built from one model-wide
  // generator get distinct streams that one seed reproduces.
  Dropout(double p, Generator& generator);

  // x itself in eval mode or with p == 0; otherwise a new tensor (any shape, floating).
  Tensor forward(const Tensor& x) override;

  double p() const { return p_; }
  Generator::State generator_state() const { return generator_.state(); }
  // The live generator, e.g. for rd::checkpoint's list of generators to rewind.
  Generator& generator() { return generator_.generator(); }

 protected:
  void on_state_loaded() override { generator_.reload(); }

 private:
  double p_;
  BufferedGenerator generator_;
};

}  // namespace rd::nn
