// CPU fused cross-entropy over contiguous [rows / inner, cols, inner] logits (row-major
// [rows, cols] when inner == 1) and int64 targets: per position a one-pass blocked
// logsumexp (the probabilities are never stored) and the backward g * (softmax - onehot).
// Positions run in parallel, adjacent ones together when classes are strided; each is
// computed in float32 (float64 for float64 data), in the same order whatever the layout.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {
namespace {

// An online logsumexp: the max of the values seen and the sum of exp(x - max). NaN inputs
// are skipped by the max and make the sum NaN; -inf inputs add exactly 0.
template <class A>
struct LseState {
  A max = -std::numeric_limits<A>::infinity();
  A sum = 0;
};

// exp(x - m), with x == -inf giving 0 even when m is -inf (an all -inf block).
template <class A>
A exp_shifted(A x, A m) {
  return x == -std::numeric_limits<A>::infinity() ? A(0) : std::exp(x - m);
}

// A sum taken relative to max `from`, rescaled to max `to` >= from (unchanged while `from`
// is -inf: it is then 0, or NaN from a NaN input).
template <class A>
A rescale(A sum, A from, A to) {
  return from == -std::numeric_limits<A>::infinity() ? sum : sum * std::exp(from - to);
}

template <class A>
LseState<A> merge(const LseState<A>& a, const LseState<A>& b) {
  const A m = std::max(a.max, b.max);
  return {m, rescale(a.sum, a.max, m) + rescale(b.sum, b.max, m)};
}

// Positions whose classes lie `stride` apart (the class stride of [N, C, d1, ...] logits)
// are taken `lanes` at a time: lane l of class j is x[j * stride + l], so the inner loops run
// over adjacent memory. kLanes > 0 fixes the lane count at compile time (1 for row-major
// [rows, cols] logits, where the lane loops vanish); kLanes == 0 reads it from `lanes`.
template <int kLanes>
struct LaneCount {
  int runtime;
  constexpr int get() const { return kLanes > 0 ? kLanes : runtime; }
};

// Positions processed together when classes are strided: their states fit in L1.
constexpr int kMaxLanes = 16;

// The logsumexp over `cols` classes of each lane, read once: each block of kBlock classes
// (in L1 after its max is taken) becomes a state, and states merge pairwise like a binary
// counter, so the rounding error grows with log2(cols / kBlock), not with cols. Every lane
// follows the order a single row-major row would, so results do not depend on the layout.
template <class T, int kLanes>
void lanes_logsumexp(const T* x, int64_t cols, int64_t stride, LaneCount<kLanes> lane_count,
                     Compute<T>* out) {
  using A = Compute<T>;
  constexpr int64_t kBlock = 128;
  constexpr int kLevels = 57;  // 2^57 blocks exceed any int64 column count
  const int lanes = lane_count.get();
  LseState<A> levels[kLevels][kLanes > 0 ? kLanes : kMaxLanes];
  LseState<A> block[kLanes > 0 ? kLanes : kMaxLanes];
  uint64_t blocks = 0;
  for (int64_t start = 0; start < cols; start += kBlock) {
    const int64_t end = std::min(cols, start + kBlock);
    for (int l = 0; l < lanes; ++l) block[l] = LseState<A>{};
    for (int64_t j = start; j < end; ++j) {
      for (int l = 0; l < lanes; ++l) {
        block[l].max = std::max(block[l].max, static_cast<A>(x[j * stride + l]));
      }
    }
    for (int64_t j = start; j < end; ++j) {
      for (int l = 0; l < lanes; ++l) {
        block[l].sum += exp_shifted(static_cast<A>(x[j * stride + l]), block[l].max);
      }
    }
    int level = 0;
    for (; (blocks >> level) & 1u; ++level) {
      for (int l = 0; l < lanes; ++l) block[l] = merge(levels[level][l], block[l]);
    }
    for (int l = 0; l < lanes; ++l) levels[level][l] = block[l];
    ++blocks;
  }
  for (int l = 0; l < lanes; ++l) {
    LseState<A> total;
    for (int level = kLevels - 1; level >= 0; --level) {
      if ((blocks >> level) & 1u) total = merge(total, levels[level][l]);
    }
    out[l] = total.max + std::log(total.sum);
  }
}

// Logits of `rows` positions over `cols` classes, laid out [rows / inner, cols, inner]: the
// classes of position r lie `inner` apart. inner == 1 is the row-major [rows, cols] case.
// Work is split into tiles of up to kMaxLanes adjacent positions of one outer index.
struct ClassLayout {
  int64_t rows, cols, inner;

  int64_t tiles_per_outer() const {
    return inner == 1 ? 1 : (inner + kMaxLanes - 1) / kMaxLanes;
  }
  int64_t tiles() const { return inner == 1 ? rows : rows / inner * tiles_per_outer(); }
  // The first position of a tile and its number of positions.
  int64_t first(int64_t tile) const {
    if (inner == 1) return tile;
    return tile / tiles_per_outer() * inner + tile % tiles_per_outer() * kMaxLanes;
  }
  int lanes(int64_t tile) const {
    if (inner == 1) return 1;
    const int64_t start = tile % tiles_per_outer() * kMaxLanes;
    return static_cast<int>(std::min<int64_t>(kMaxLanes, inner - start));
  }
  // The offset of class 0 of position r.
  int64_t base(int64_t r) const { return r / inner * cols * inner + r % inner; }
};

// Runs body(first, lanes_of_tile) on every tile in parallel, with the lane count fixed at
// compile time for row-major logits (body is a generic lambda over LaneCount<k>).
template <class Body>
void for_each_tile(const ClassLayout& layout, const Body& body) {
  if (layout.inner == 1) {
    parallel_items(layout.rows, layout.cols, [&](int64_t r) { body(r, LaneCount<1>{1}); });
    return;
  }
  parallel_items(layout.tiles(), layout.cols * kMaxLanes, [&](int64_t tile) {
    body(layout.first(tile), LaneCount<0>{layout.lanes(tile)});
  });
}

// The host-side target check (KernelBackend::cross_entropy, "Bad targets"): every target is
// checked before any work, so a bad one throws from the call with nothing written. Rows run
// in parallel bodies that must not throw, which is another reason to check first.
void check_targets(const char* op, const int64_t* targets, int64_t rows, int64_t cols,
                   int64_t ignore_index) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = targets[r];
    if (t != ignore_index && (t < 0 || t >= cols)) {
      RD_FAIL(kOutOfRange, cross_entropy_target_message(op, t, r, cols));
    }
  }
}

template <class T>
void cross_entropy_rows(Compute<T>* loss, Compute<T>* lse, const T* logits,
                        const int64_t* targets, const ClassLayout& layout,
                        int64_t ignore_index) {
  using A = Compute<T>;
  for_each_tile(layout, [&](int64_t first, auto lane_count) {
    const T* x = logits + layout.base(first);
    lanes_logsumexp(x, layout.cols, layout.inner, lane_count, lse + first);
    for (int l = 0; l < lane_count.get(); ++l) {
      const int64_t t = targets[first + l];
      loss[first + l] =
          t == ignore_index ? A(0) : lse[first + l] - static_cast<A>(x[t * layout.inner + l]);
    }
  });
}

template <class T>
void cross_entropy_backward_rows(T* grad_logits, const Compute<T>* grad_loss,
                                 int64_t grad_loss_stride, const T* logits, const Compute<T>* lse,
                                 const int64_t* targets, const ClassLayout& layout,
                                 int64_t ignore_index) {
  using A = Compute<T>;
  for_each_tile(layout, [&](int64_t first, auto lane_count) {
    const int lanes = lane_count.get();
    const int64_t offset = layout.base(first);
    const T* x = logits + offset;
    T* gx = grad_logits + offset;
    // Ignored positions get g = 0 (and an exact 0 gradient, even for non-finite logits).
    A g[kMaxLanes];
    bool ignored[kMaxLanes];
    for (int l = 0; l < lanes; ++l) {
      ignored[l] = targets[first + l] == ignore_index;
      g[l] = ignored[l] ? A(0) : grad_loss[(first + l) * grad_loss_stride];
    }
    for (int64_t j = 0; j < layout.cols; ++j) {
      for (int l = 0; l < lanes; ++l) {
        const int64_t e = j * layout.inner + l;
        const A onehot = j == targets[first + l] ? A(1) : A(0);
        const A p = std::exp(static_cast<A>(x[e]) - lse[first + l]);
        gx[e] = static_cast<T>(ignored[l] ? A(0) : g[l] * (p - onehot));
      }
    }
  });
}

}  // namespace

void CpuBackend::cross_entropy(const CrossEntropyArgs& a) {
  constexpr const char* kOp = "cross_entropy";
  check_cross_entropy_args(a);
  check_targets(kOp, a.targets, a.rows, a.cols, a.ignore_index);
  const ClassLayout layout{a.rows, a.cols, a.inner};
  dispatch_floating(a.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    cross_entropy_rows(static_cast<A*>(a.loss), static_cast<A*>(a.lse),
                       static_cast<const T*>(a.logits), a.targets, layout, a.ignore_index);
  });
}

void CpuBackend::cross_entropy_backward(const CrossEntropyBackwardArgs& a) {
  constexpr const char* kOp = "cross_entropy_backward";
  check_cross_entropy_backward_args(a);
  check_targets(kOp, a.targets, a.rows, a.cols, a.ignore_index);
  const ClassLayout layout{a.rows, a.cols, a.inner};
  dispatch_floating(a.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    cross_entropy_backward_rows(static_cast<T*>(a.grad_logits), static_cast<const A*>(a.grad_loss),
                                a.grad_loss_stride, static_cast<const T*>(a.logits),
                                static_cast<const A*>(a.lse), a.targets, layout, a.ignore_index);
  });
}

}  // namespace rd::kernels::cpu
