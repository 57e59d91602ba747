// RankPlanCache: plans keyed by everything make_rank_plan reads, in a bounded LRU.
#include "ringdilated/nn/rank_plan_cache.h"

#include <cstring>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

// Appends the bytes of a trivially copyable value.
template <class T>
void append(std::string& key, const T& value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  key.append(bytes, sizeof(T));
}

// A vector as its length, then its elements: no two vectors give the same bytes.
void append(std::string& key, const std::vector<int64_t>& values) {
  append(key, static_cast<int64_t>(values.size()));
  for (int64_t v : values) append(key, v);
}

}  // namespace

std::string rank_plan_key(const DilatedAttentionOptions& o, const RankLayout& l,
                          DistStrategy strategy, int64_t element_bytes,
                          const std::vector<std::vector<int64_t>>* documents) {
  std::string key;
  append(key, o.segment_lengths);
  append(key, o.dilation_rates);
  append(key, static_cast<int>(o.variant));
  append(key, static_cast<int>(o.mixing));
  append(key, static_cast<int>(o.offset_rule));
  append(key, o.causal);
  append(key, o.dropout);
  append(key, o.scale.has_value());
  append(key, o.scale.value_or(0.0));
  append(key, o.use_hilbert);
  append(key, static_cast<int>(o.path));
  for (int64_t v : {l.batch, l.rows_per_rank, l.heads, l.head_dim, l.kv_heads}) append(key, v);
  for (int v : {l.rank, l.ranks}) append(key, v);
  append(key, l.zigzag);
  append(key, static_cast<int>(strategy));
  append(key, element_bytes);
  // Null and empty documents plan alike; telling them apart costs at most one more plan.
  append(key, documents != nullptr);
  if (documents != nullptr) {
    append(key, static_cast<int64_t>(documents->size()));
    for (const std::vector<int64_t>& starts : *documents) append(key, starts);
  }
  return key;
}

RankPlanCache::RankPlanCache(int64_t max_entries) : max_entries_(max_entries) {
  RD_CHECK(max_entries >= 1, kInvalidArgument,
           "RankPlanCache: argument 'max_entries' must be >= 1, got ", max_entries);
}

std::shared_ptr<const RankPlan> RankPlanCache::get(const std::string& key,
                                                   const std::function<RankPlan()>& make) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto* plan = plans_.find(key)) {
      ++stats_.hits;
      return *plan;
    }
    ++stats_.misses;
  }
  auto made = std::make_shared<const RankPlan>(make());
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<const RankPlan> plan = *plans_.insert(key, std::move(made)).first;
  while (static_cast<int64_t>(plans_.size()) > max_entries_) plans_.pop_oldest();
  return plan;
}

RankPlanCacheStats RankPlanCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RankPlanCacheStats stats = stats_;
  stats.entries = static_cast<int64_t>(plans_.size());
  return stats;
}

}  // namespace rd::nn
