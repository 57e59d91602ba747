// The fewest bytes a rank must send per forward of sequence-parallel dilated attention
// (docs/distributed.md, "Traffic"), shared by the benches that compare against it.
#pragma once

#include <cstdint>

#include "ringdilated/nn/dilated_attention.h"

namespace rd::bench {

// For each pair whose segments span g = w / C > 1 blocks of C = N / P tokens (the benches'
// pairs align with blocks), the K and V rows it selects (C / r per block) for its heads
// (head groups: H / pairs, the first H % pairs groups one more), to each of the g - 1 other
// blocks of its segment. Averaged over ranks this is also the fewest each must receive.
inline int64_t minimum_bytes_per_rank(const nn::DilatedAttentionOptions& o, int64_t seq_len,
                                      int64_t ranks, int64_t heads, int64_t head_dim,
                                      int64_t element_bytes) {
  const int64_t chunk = seq_len / ranks;
  const auto pairs = static_cast<int64_t>(o.segment_lengths.size());
  int64_t bytes = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t w = o.segment_lengths[static_cast<size_t>(i)] < seq_len
                          ? o.segment_lengths[static_cast<size_t>(i)]
                          : seq_len;
    const int64_t r = o.dilation_rates[static_cast<size_t>(i)];
    if (w <= chunk) continue;
    const int64_t pair_heads = heads / pairs + (i < heads % pairs ? 1 : 0);
    bytes += (w / chunk - 1) * (chunk / r) * pair_heads * head_dim * 2 /*K, V*/ * element_bytes;
  }
  return bytes;
}

}  // namespace rd::bench
