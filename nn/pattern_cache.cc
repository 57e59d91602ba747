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
    auto it = index_.find(key);
    if (it != index_.end()) {
      ++stats_.hits;
      lru_.splice(lru_.begin(), lru_, it->second);  // now the most recent
      return it->second->pattern;
    }
    ++stats_.misses;
  }
  Tensor pattern = compute();
  // Other threads read a cached pattern on their own streams, which do not wait for this
  // thread's: the pattern's copy to the device must be finished before anyone can see it.
  if (pattern.defined()) Stream::current(pattern.device()).synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) return it->second->pattern;  // another thread stored it first
  if (storage_bytes(pattern) > max_bytes_) return pattern;
  lru_.push_front({key, pattern});
  index_.emplace(key, lru_.begin());
  ++stats_.entries;
  stats_.bytes += storage_bytes(pattern);
  evict_over_limits();
  return pattern;
}

void PatternCache::evict_over_limits() {
  while (stats_.entries > max_entries_ || stats_.bytes > max_bytes_) {
    const Entry& oldest = lru_.back();
    stats_.bytes -= storage_bytes(oldest.pattern);
    --stats_.entries;
    ++stats_.evictions;
    index_.erase(oldest.key);
    lru_.pop_back();
  }
}

PatternCacheStats PatternCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PatternCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  lru_.clear();
  index_.clear();
  stats_.entries = 0;
  stats_.bytes = 0;
}

PatternCache& global_pattern_cache() {
  // Created on first use and never destroyed: tensors in it may outlive static teardown order.
  static PatternCache* const cache = new PatternCache();
  return *cache;
}

}  // namespace rd::nn
