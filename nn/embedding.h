// Embedding: a lookup table of learned vectors, rows of "weight" picked by integer indices.
#pragma once

#include <cstdint>

#include "ringdilated/nn/module.h"
#include "ringdilated/tensor/generator.h"

namespace rd::nn {

class Embedding : public UnaryModule {
 public:
  // Parameter "weight" [num_embeddings, embedding_dim] drawn from the standard normal
  // (PyTorch's default), created with `options` (dtype and device).
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& generator,
            TensorOptions options = {});

  // int32 or int64 indices of any shape, each in [0, num_embeddings) -> [..., embedding_dim].
  Tensor forward(const Tensor& indices) override;

  const Tensor& weight() const { return weight_; }
  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t embedding_dim() const { return embedding_dim_; }

 private:
  int64_t num_embeddings_;
  int64_t embedding_dim_;
  Tensor& weight_;
};

}  // namespace rd::nn
