// Accurate, deterministic summation for CPU kernels: blocked pairwise (cascade) summation,
// so that float32 sums of millions of terms keep ~1e-7 relative error.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace rd::kernels::cpu {

// Sums values as they arrive: plain sums of 128-term blocks, combined pairwise like a binary
// counter. The error grows with log2(n / 128) rather than n. The result depends only on the
// sequence of added values.
template <class A>
class CascadeSum {
 public:
  void add(A x) {
    block_ += x;
    if (++count_ == kBlock) flush();
  }

  // Adds load(0), ..., load(n - 1) in order; the same result as n add() calls, with a
  // tighter inner loop.
  template <class Load>
  void add_many(int64_t n, const Load& load) {
    for (int64_t k = 0; k < n;) {
      const int64_t m = std::min<int64_t>(n - k, kBlock - count_);
      A b = block_;
      for (int64_t i = 0; i < m; ++i) b += load(k + i);
      block_ = b;
      count_ += static_cast<int>(m);
      k += m;
      if (count_ == kBlock) flush();
    }
  }

  A value() const {
    A total = 0;
    for (int level = kLevels - 1; level >= 0; --level) {
      if ((blocks_ >> level) & 1u) total += levels_[level];
    }
    return total + block_;
  }

 private:
  static constexpr int kBlock = 128;
  static constexpr int kLevels = 57;  // 2^57 blocks of 128 exceed any int64 count

  // Like incrementing a binary counter: full levels merge upward.
  void flush() {
    A v = block_;
    int level = 0;
    for (; (blocks_ >> level) & 1u; ++level) v = levels_[level] + v;
    levels_[level] = v;
    ++blocks_;
    block_ = 0;
    count_ = 0;
  }

  A block_ = 0;
  int count_ = 0;
  uint64_t blocks_ = 0;
  A levels_[kLevels];
};

// kLanes independent CascadeSums fed one row (a value per lane) at a time, all lanes in
// lockstep, so the per-lane loops are simple. Lane j's result equals a CascadeSum fed the
// same values, as long as at most 128 * 2^(kLevels - 1) rows are added.
template <class A, int kLevels>
class CascadeSumLanes {
 public:
  static constexpr int kLanes = 64;
  static constexpr int64_t kMaxRows = int64_t{128} << (kLevels - 1);

  CascadeSumLanes() {
    for (A& b : block_) b = 0;
  }
  // The row being added: add into lanes [0, kLanes), then call end_row().
  A* row() { return block_; }
  void end_row() {
    if (++count_ == kBlock) flush();
  }
  A value(int lane) const {
    A total = 0;
    for (int level = kLevels - 1; level >= 0; --level) {
      if ((blocks_ >> level) & 1u) total += levels_[level][lane];
    }
    return total + block_[lane];
  }

 private:
  static constexpr int kBlock = 128;

  void flush() {
    int level = 0;
    for (; (blocks_ >> level) & 1u; ++level) {
      for (int j = 0; j < kLanes; ++j) block_[j] = levels_[level][j] + block_[j];
    }
    for (int j = 0; j < kLanes; ++j) {
      levels_[level][j] = block_[j];
      block_[j] = 0;
    }
    ++blocks_;
    count_ = 0;
  }

  A block_[kLanes];
  int count_ = 0;
  uint64_t blocks_ = 0;
  A levels_[kLevels][kLanes];
};

// The plain running sum, for integers (exact, so nothing to gain from cascading).
template <class A>
class PlainSum {
 public:
  void add(A x) { total_ += x; }
  template <class Load>
  void add_many(int64_t n, const Load& load) {
    for (int64_t i = 0; i < n; ++i) total_ += load(i);
  }
  A value() const { return total_; }

 private:
  A total_ = 0;
};

template <class A>
using Summer = std::conditional_t<std::is_floating_point_v<A>, CascadeSum<A>, PlainSum<A>>;

}  // namespace rd::kernels::cpu
