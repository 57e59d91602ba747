// RankPlanCache: a bounded, thread-safe LRU cache of rank plans (nn/rank_plan.h). Every layer
// of a model plans the same call (options, layout, documents) again, and the recomputed
// forward once more; with packed documents a plan has thousands of calls and takes
// milliseconds of host time, paid while the GPU waits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ringdilated/kernels/lru_map.h"
#include "ringdilated/nn/rank_plan.h"

namespace rd::nn {

struct RankPlanCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t entries = 0;
};

// Everything make_rank_plan reads, as one key: every option, the layout, the strategy, the
// element size and the documents' starts.
std::string rank_plan_key(const DilatedAttentionOptions& options, const RankLayout& layout,
                          DistStrategy strategy, int64_t element_bytes,
                          const std::vector<std::vector<int64_t>>* documents);

class RankPlanCache {
 public:
  // Holds at most `max_entries` plans (>= 1); the least recently used go first.
  explicit RankPlanCache(int64_t max_entries = 8);

  // The plan stored under `key` (rank_plan_key), made by `make` on a miss. `make` runs
  // without the lock held, so two threads may both make a missing plan; the first stored
  // wins. Plans are immutable: callers share them.
  std::shared_ptr<const RankPlan> get(const std::string& key,
                                      const std::function<RankPlan()>& make);

  RankPlanCacheStats stats() const;

 private:
  const int64_t max_entries_;
  mutable std::mutex mu_;
  kernels::LruMap<std::string, std::shared_ptr<const RankPlan>> plans_;
  RankPlanCacheStats stats_;
};

}  // namespace rd::nn
