// SampleRng: the random draws of one synthetic sample, a pure function of (seed, stream,
// sample index), so any sample can be regenerated alone and in any order.
#pragma once

#include <cstdint>

#include "ringdilated/kernels/philox.h"

namespace rd::train {

// Training and held-out samples use different Philox counters, so the two streams never
// share a draw even for the same seed and index.
enum class SampleStream : uint32_t { kTrain = 0, kEval = 1 };

// Philox4x32-10 keyed by the seed; the counter is (index lo, index hi, block, stream), and
// each block gives four 32-bit draws.
class SampleRng {
 public:
  SampleRng(uint64_t seed, SampleStream stream, uint64_t index)
      : seed_(seed), stream_(static_cast<uint32_t>(stream)), index_(index) {}

  uint32_t next_u32() {
    if (used_ == kWordsPerBlock) refill();
    return block_.w[used_++];
  }

  uint64_t next_u64() {
    const uint64_t hi = next_u32();
    return (hi << 32) | next_u32();
  }

  // Uniform in [0, n) for n > 0 (multiply-shift; the bias, below n / 2^64, is negligible).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }

 private:
  static constexpr int kWordsPerBlock = 4;

  void refill() {
    const kernels::Philox4x32 counter = {{static_cast<uint32_t>(index_),
                                          static_cast<uint32_t>(index_ >> 32), block_count_++,
                                          stream_}};
    block_ = kernels::philox4x32_10(counter, static_cast<uint32_t>(seed_),
                                    static_cast<uint32_t>(seed_ >> 32));
    used_ = 0;
  }

  uint64_t seed_;
  uint32_t stream_;
  uint64_t index_;
  uint32_t block_count_ = 0;
  kernels::Philox4x32 block_{};
  int used_ = kWordsPerBlock;
};

}  // namespace rd::train
