// The attention primitive's dropout mask (kernels/attention.h): the element numbering and the
// keep test, one definition for every kernel so that a mask is bit for bit the same on every
// device.
#pragma once

#include <cstdint>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/philox.h"

namespace rd::kernels {

inline constexpr int kMaxDropoutBatchDims = kMaxDims - 2;

// The numbering the kernels of one call use, in the affine form of DropoutIndexing: `given`
// when it is custom, else the default (b * lq + i) * lk + j written in that form for q's
// batch shape (its first `batch_dims` entries): row-major batch strides times lq * lk, row
// stride lk, column stride 1. Both agree mod 2^64, so the default stays bit for bit what it
// was. Host side, once per call.
inline DropoutIndexing resolve_dropout_indexing(const DropoutIndexing& given,
                                                const int64_t* batch_shape, int batch_dims,
                                                int64_t lq, int64_t lk) {
  if (given.custom) return given;
  DropoutIndexing r;
  r.custom = true;
  uint64_t stride = static_cast<uint64_t>(lq) * static_cast<uint64_t>(lk);
  for (int d = batch_dims - 1; d >= 0; --d) {
    r.batch_strides[d] = static_cast<int64_t>(stride);  // modular: C++20 defines the wrap
    stride *= static_cast<uint64_t>(batch_shape[d]);
  }
  r.row_stride = lk;
  r.col_stride = 1;
  return r;
}

// The number of element (b, 0, 0) under a resolved numbering: base plus the batch strides of
// the indices of flattened batch b, unravelled row-major over the `batch_dims` dims of
// batch_shape. Divides, so kernels call it once per batch or row, not per element.
RD_HOST_DEVICE inline uint64_t dropout_batch_base(const DropoutIndexing& ix,
                                                  const int64_t* batch_shape, int batch_dims,
                                                  int64_t b) {
  uint64_t e = ix.base;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int d = kMaxDropoutBatchDims - 1; d >= 0; --d) {
    if (d < batch_dims) {
      e += static_cast<uint64_t>(b % batch_shape[d]) * static_cast<uint64_t>(ix.batch_strides[d]);
      b /= batch_shape[d];
    }
  }
  return e;
}

// The number of element (b, i, j), given b's dropout_batch_base: two multiply-adds.
RD_HOST_DEVICE inline uint64_t dropout_element(const DropoutIndexing& ix, uint64_t batch_base,
                                               int64_t i, int64_t j) {
  return batch_base + static_cast<uint64_t>(i) * static_cast<uint64_t>(ix.row_stride) +
         static_cast<uint64_t>(j) * static_cast<uint64_t>(ix.col_stride);
}

// Whether element number `element` survives dropout: philox_bernoulli of its Philox block
// in the stream (seed, offset).
RD_HOST_DEVICE inline bool attention_keeps(uint64_t seed, uint64_t offset, double keep_probability,
                                           uint64_t element) {
  return philox_bernoulli(keep_probability, philox_for_element(seed, offset, element));
}

}  // namespace rd::kernels
