// Embedding layer (see embedding.h).
#include "ringdilated/nn/embedding.h"

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/init.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& generator,
                     TensorOptions options)
    : num_embeddings_(checked_layer_size(num_embeddings, "Embedding", "num_embeddings")),
      embedding_dim_(checked_layer_size(embedding_dim, "Embedding", "embedding_dim")),
      weight_(register_parameter(
          "weight", normal_init({num_embeddings, embedding_dim}, 1.0, generator, options))) {}

Tensor Embedding::forward(const Tensor& indices) {
  RD_CHECK(
      indices.defined() && (indices.dtype() == DType::kInt32 || indices.dtype() == DType::kInt64),
      kDTypeMismatch, "Embedding: argument 'indices' must be int32 or int64, got ",
      indices.defined() ? indices.str() : std::string("an undefined tensor"));
  // rd::embedding checks that every index is in [0, num_embeddings).
  return embedding(weight_, indices);
}

}  // namespace rd::nn
