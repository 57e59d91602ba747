// LruMap: the bookkeeping of a bounded least-recently-used cache (a list in use order and an
// index into it), shared by the cuDNN graph cache and nn's pattern and rank plan caches.
#pragma once

#include <cstddef>
#include <functional>
#include <list>
#include <unordered_map>
#include <utility>

#include "absl/hash/hash.h"

namespace rd::kernels {

// A map that knows which entry was used least recently. It neither locks nor evicts: each
// cache keeps its own lock, limits (entries, bytes) and statistics, and calls pop_oldest()
// while over them. Each key is stored once (the index refers to the list's copy).
template <class Key, class Value, class Hash = absl::Hash<Key>>
class LruMap {
 public:
  LruMap() = default;
  // A copy's index would refer into the original's list; moves keep the list's nodes.
  LruMap(const LruMap&) = delete;
  LruMap& operator=(const LruMap&) = delete;
  LruMap(LruMap&&) = default;
  LruMap& operator=(LruMap&&) = default;

  // The value under `key`, which becomes the most recently used; nullptr when absent.
  Value* find(const Key& key) {
    const auto it = index_.find(std::cref(key));
    if (it == index_.end()) return nullptr;
    entries_.splice(entries_.begin(), entries_, it->second);
    return &it->second->second;
  }

  // Stores `value` under `key` as the most recently used, unless `key` is present: then the
  // present value stays (the first stored wins, as when two threads made the same entry).
  // Returns the value under `key` and whether this call stored it.
  std::pair<Value*, bool> insert(const Key& key, Value value) {
    if (const auto it = index_.find(std::cref(key)); it != index_.end()) {
      return {&it->second->second, false};
    }
    entries_.emplace_front(key, std::move(value));
    try {
      index_.emplace(std::cref(entries_.front().first), entries_.begin());
    } catch (...) {
      entries_.pop_front();  // no entry the index does not know
      throw;
    }
    return {&entries_.front().second, true};
  }

  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }

  // The least recently used value (not empty()), for the caller's accounting before it goes.
  const Value& oldest() const { return entries_.back().second; }
  Value& oldest() { return entries_.back().second; }
  // Removes the least recently used entry (not empty()).
  void pop_oldest() {
    index_.erase(std::cref(entries_.back().first));
    entries_.pop_back();
  }

  void clear() {
    index_.clear();
    entries_.clear();
  }

 private:
  using Entries = std::list<std::pair<Key, Value>>;  // most recently used first
  using KeyRef = std::reference_wrapper<const Key>;
  struct RefHash {
    size_t operator()(KeyRef key) const { return Hash{}(key.get()); }
  };
  struct RefEqual {
    bool operator()(KeyRef a, KeyRef b) const { return a.get() == b.get(); }
  };

  Entries entries_;
  std::unordered_map<KeyRef, typename Entries::iterator, RefHash, RefEqual> index_;
};

}  // namespace rd::kernels
