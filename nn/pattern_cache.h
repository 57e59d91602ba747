// PatternCache: a bounded, thread-safe LRU cache of index tensors (the original variant's
// cycled index lists, Hilbert orders, ring schedules), computed once per key and device.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "ringdilated/kernels/lru_map.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

struct PatternCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  int64_t entries = 0;
  int64_t bytes = 0;  // storage bytes of the cached tensors
};

class PatternCache {
 public:
  // Holds at most `max_entries` patterns and `max_bytes` bytes of them; the least recently
  // used go first. A pattern larger than max_bytes is computed but not kept.
  explicit PatternCache(int64_t max_entries = 256, int64_t max_bytes = int64_t{256} << 20);

  // The pattern stored under `key` (which must name everything the pattern depends on,
  // device included), computing it with `compute` on a miss. `compute` runs without the lock
  // held, so two threads may both compute a missing pattern; the first stored wins. A
  // computed device pattern is complete (its stream synchronized) before it is returned or
  // stored, so threads on other streams may read it at once.
  Tensor get(const std::string& key, const std::function<Tensor()>& compute);

  PatternCacheStats stats() const;
  void clear();

 private:
  void evict_over_limits();  // requires mu_

  const int64_t max_entries_;
  const int64_t max_bytes_;
  mutable std::mutex mu_;
  kernels::LruMap<std::string, Tensor> patterns_;
  PatternCacheStats stats_;
};

// The process-wide cache that modules without one of their own share (patterns depend only
// on their key, so sharing them across modules is safe).
PatternCache& global_pattern_cache();

}  // namespace rd::nn
