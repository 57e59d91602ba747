// kernels::LruMap (the bookkeeping of the graph, pattern and rank plan caches) against a
// naive reference: a vector in use order, searched linearly.
#include "ringdilated/kernels/lru_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace rd::kernels {
namespace {

// Most recently used first, as LruMap promises to keep it.
class NaiveLru {
 public:
  const int* find(const std::string& key) {
    const auto it = position(key);
    if (it == entries_.end()) return nullptr;
    std::rotate(entries_.begin(), it, it + 1);
    return &entries_.front().second;
  }
  std::pair<int, bool> insert(const std::string& key, int value) {
    if (const auto it = position(key); it != entries_.end()) return {it->second, false};
    entries_.insert(entries_.begin(), {key, value});
    return {value, true};
  }
  int oldest() const { return entries_.back().second; }
  void pop_oldest() { entries_.pop_back(); }
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::pair<std::string, int>>::iterator position(const std::string& key) {
    return std::find_if(entries_.begin(), entries_.end(),
                        [&](const auto& entry) { return entry.first == key; });
  }
  std::vector<std::pair<std::string, int>> entries_;
};

TEST(LruMap, EvictsTheLeastRecentlyUsed) {
  LruMap<std::string, int> map;
  map.insert("a", 1);
  map.insert("b", 2);
  map.insert("c", 3);
  ASSERT_NE(map.find("a"), nullptr);  // a becomes the most recent: b is now the oldest
  EXPECT_EQ(map.oldest(), 2);
  map.pop_oldest();
  EXPECT_EQ(map.find("b"), nullptr);
  EXPECT_EQ(map.oldest(), 3);
  EXPECT_EQ(map.size(), 2u);
}

TEST(LruMap, TheFirstStoredValueWins) {
  LruMap<std::string, int> map;
  const auto [first, first_inserted] = map.insert("key", 1);
  EXPECT_TRUE(first_inserted);
  EXPECT_EQ(*first, 1);
  const auto [stored, inserted] = map.insert("key", 2);
  EXPECT_FALSE(inserted);
  EXPECT_EQ(*stored, 1);
  EXPECT_EQ(map.size(), 1u);
}

TEST(LruMap, ClearEmptiesItAndKeysCanReturn) {
  LruMap<std::vector<int64_t>, int> map;  // the graph cache's key type
  map.insert({1, 2}, 7);
  map.clear();
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(map.find({1, 2}), nullptr);
  EXPECT_TRUE(map.insert({1, 2}, 8).second);
  EXPECT_EQ(*map.find({1, 2}), 8);
}

// Random finds, inserts (new and present keys) and evictions under a bound, as the caches
// use it; every result and the eviction order match the reference.
TEST(LruMap, MatchesANaiveReferenceUnderRandomUse) {
  std::mt19937 rng(11);
  LruMap<std::string, int> map;
  NaiveLru reference;
  constexpr size_t kBound = 5;
  for (int step = 0; step < 4000; ++step) {
    const std::string key = "k" + std::to_string(rng() % 12);
    if (rng() % 2 == 0) {
      const int* expected = reference.find(key);
      const int* got = map.find(key);
      ASSERT_EQ(got == nullptr, expected == nullptr) << "step " << step << " find " << key;
      if (got != nullptr) {
        ASSERT_EQ(*got, *expected) << "step " << step;
      }
    } else {
      const auto [expected, expected_inserted] = reference.insert(key, step);
      const auto [got, inserted] = map.insert(key, step);
      ASSERT_EQ(inserted, expected_inserted) << "step " << step << " insert " << key;
      ASSERT_EQ(*got, expected) << "step " << step;
    }
    while (map.size() > kBound) {
      ASSERT_EQ(map.oldest(), reference.oldest()) << "step " << step;
      map.pop_oldest();
      reference.pop_oldest();
    }
    ASSERT_EQ(map.size(), reference.size());
  }
}

}  // namespace
}  // namespace rd::kernels
