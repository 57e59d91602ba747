// The attention primitive's dropout mask (kernels/attention.h), one definition for every
// kernel so that a mask is bit for bit the same on every device.
#pragma once

#include <cstdint>

#include "ringdilated/kernels/philox.h"

namespace rd::kernels {

// Whether p[b, i, j] of an [batch, lq, lk] attention survives dropout: philox_bernoulli of
// the Philox block of element (b * lq + i) * lk + j of the stream (seed, offset).
RD_HOST_DEVICE inline bool attention_keeps(uint64_t seed, uint64_t offset, double keep_probability,
                                           int64_t lq, int64_t lk, int64_t b, int64_t i,
                                           int64_t j) {
  const uint64_t element = (static_cast<uint64_t>(b) * static_cast<uint64_t>(lq) +
                            static_cast<uint64_t>(i)) * static_cast<uint64_t>(lk) +
                           static_cast<uint64_t>(j);
  return philox_bernoulli(keep_probability, philox_for_element(seed, offset, element));
}

}  // namespace rd::kernels
