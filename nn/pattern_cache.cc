// PatternCache: a bounded LRU of index tensors (see pattern_cache.h).
#include "ringdilated/nn/pattern_cache.h"

#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/stream.h"

namespace rd::nn {
namespace {

int64_t storage_bytes(const Tensor& t) {
  return t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
}

}  // namespace

PatternCache::PatternCache(int64_t max_entries, int64_t max_bytes)
    : max_entries_(max_entries), max_bytes_(max_bytes) {
  RD_CHECK(max_entries >= 1 && max_bytes >= 0, kInvalidArgument,
           "PatternCache: needs max_entries >= 1 and max_bytes >= 0, got ", max_entries, " and ",
           max_bytes);
}

Tensor PatternCache::get(const std::string& key, const std::function<Tensor()>& compute) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const Tensor* pattern = patterns_.find(key)) {
      ++stats_.hits;
      return *pattern;
    }
    ++stats_.misses;
  }
  Tensor pattern = compute();
  // Other threads read a cached pattern on their own streams, which do not wait for this
  // thread's: the pattern's copy to the device must be finished before anyone can see it.
  if (pattern.defined()) Stream::current(pattern.device()).synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  if (storage_bytes(pattern) > max_bytes_) return pattern;
  const auto [stored, inserted] = patterns_.insert(key, pattern);
  if (!inserted) return *stored;  // another thread stored it first
  stats_.bytes += storage_bytes(pattern);
  evict_over_limits();
  return pattern;
}

void PatternCache::evict_over_limits() {
  while (static_cast<int64_t>(patterns_.size()) > max_entries_ || stats_.bytes > max_bytes_) {
    stats_.bytes -= storage_bytes(patterns_.oldest());
    ++stats_.evictions;
    patterns_.pop_oldest();
  }
}

PatternCacheStats PatternCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PatternCacheStats stats = stats_;
  stats.entries = static_cast<int64_t>(patterns_.size());
  return stats;
}

void PatternCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  patterns_.clear();
  stats_.bytes = 0;
}

PatternCache& global_pattern_cache() {
  // Created on first use and never destroyed: tensors in it may outlive static teardown order.
  static PatternCache* const cache = new PatternCache();
  return *cache;
}

}  // namespace rd::nn
