// CPU fused cross-entropy over contiguous [rows, cols] logits and int64 targets: per row a
// one-pass online logsumexp (the probabilities are never stored) and the backward
// g * (softmax - onehot). Rows run in parallel; each is computed in float32 (float64 for
// float64 data).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

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

// The logsumexp of a row, read once: each block of kBlock values (in L1 after its max is
// taken) becomes a state, and states merge pairwise like a binary counter, so the rounding
// error grows with log2(cols / kBlock), not with cols.
template <class T>
Compute<T> row_logsumexp(const T* x, int64_t cols) {
  using A = Compute<T>;
  constexpr int64_t kBlock = 128;
  constexpr int kLevels = 57;  // 2^57 blocks exceed any int64 column count
  LseState<A> levels[kLevels];
  uint64_t blocks = 0;
  for (int64_t start = 0; start < cols; start += kBlock) {
    const int64_t end = std::min(cols, start + kBlock);
    LseState<A> block;
    for (int64_t j = start; j < end; ++j) block.max = std::max(block.max, static_cast<A>(x[j]));
    for (int64_t j = start; j < end; ++j) block.sum += exp_shifted(static_cast<A>(x[j]), block.max);
    int level = 0;
    for (; (blocks >> level) & 1u; ++level) block = merge(levels[level], block);
    levels[level] = block;
    ++blocks;
  }
  LseState<A> total;
  for (int level = kLevels - 1; level >= 0; --level) {
    if ((blocks >> level) & 1u) total = merge(total, levels[level]);
  }
  return total.max + std::log(total.sum);
}

using NamedPointers = std::initializer_list<std::pair<const char*, const void*>>;

// Rows run in parallel bodies that must not throw, so every check happens before them.
// Pointers read or written per row must be set when there are rows; per element, when
// there are elements.
void check_args(const char* op, int64_t rows, int64_t cols, const int64_t* targets,
                int64_t ignore_index, NamedPointers per_row, NamedPointers per_element) {
  RD_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, op,
           ": rows and cols must be non-negative, got rows=", rows, " cols=", cols);
  RD_CHECK(rows == 0 || targets != nullptr, kInvalidArgument, op,
           ": argument 'targets' must not be null for ", rows, " rows");
  for (const auto& [name, p] : per_row) {
    RD_CHECK(rows == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " rows");
  }
  for (const auto& [name, p] : per_element) {
    RD_CHECK(rows * cols == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " x ", cols, " logits");
  }
  // The caller bounds-checks too; this O(rows) pass keeps a bad target from reading outside
  // its row here.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = targets[r];
    RD_CHECK(t == ignore_index || (t >= 0 && t < cols), kOutOfRange, op, ": target ", t,
             " of row ", r, " is out of range for ", cols, " classes (ignore_index ",
             ignore_index, ")");
  }
}

template <class T>
void cross_entropy_rows(Compute<T>* loss, Compute<T>* lse, const T* logits,
                        const int64_t* targets, int64_t rows, int64_t cols,
                        int64_t ignore_index) {
  using A = Compute<T>;
  parallel_items(rows, cols, [&](int64_t r) {
    const T* x = logits + r * cols;
    const A row_lse = row_logsumexp(x, cols);
    lse[r] = row_lse;
    const int64_t t = targets[r];
    loss[r] = t == ignore_index ? A(0) : row_lse - static_cast<A>(x[t]);
  });
}

template <class T>
void cross_entropy_backward_rows(T* grad_logits, const Compute<T>* grad_loss,
                                 int64_t grad_loss_stride, const T* logits, const Compute<T>* lse,
                                 const int64_t* targets, int64_t rows, int64_t cols,
                                 int64_t ignore_index) {
  using A = Compute<T>;
  parallel_items(rows, cols, [&](int64_t r) {
    const T* x = logits + r * cols;
    T* gx = grad_logits + r * cols;
    const int64_t t = targets[r];
    if (t == ignore_index) {
      std::fill(gx, gx + cols, static_cast<T>(A(0)));
      return;
    }
    const A g = grad_loss[r * grad_loss_stride];
    const A row_lse = lse[r];
    for (int64_t j = 0; j < cols; ++j) {
      gx[j] = static_cast<T>(g * std::exp(static_cast<A>(x[j]) - row_lse));
    }
    gx[t] = static_cast<T>(g * (std::exp(static_cast<A>(x[t]) - row_lse) - A(1)));
  });
}

}  // namespace

void CpuBackend::cross_entropy(void* loss, void* lse, const void* logits, const int64_t* targets,
                               DType dtype, int64_t rows, int64_t cols, int64_t ignore_index) {
  constexpr const char* kOp = "cross_entropy";
  check_args(kOp, rows, cols, targets, ignore_index, {{"loss", loss}, {"lse", lse}},
             {{"logits", logits}});
  dispatch_floating(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    cross_entropy_rows(static_cast<A*>(loss), static_cast<A*>(lse), static_cast<const T*>(logits),
                       targets, rows, cols, ignore_index);
  });
}

void CpuBackend::cross_entropy_backward(void* grad_logits, const void* grad_loss,
                                        int64_t grad_loss_stride, const void* logits,
                                        const void* lse, const int64_t* targets, DType dtype,
                                        int64_t rows, int64_t cols, int64_t ignore_index) {
  constexpr const char* kOp = "cross_entropy_backward";
  check_args(kOp, rows, cols, targets, ignore_index, {{"grad_loss", grad_loss}, {"lse", lse}},
             {{"grad_logits", grad_logits}, {"logits", logits}});
  RD_CHECK(grad_loss_stride >= 0, kInvalidArgument, kOp,
           ": argument 'grad_loss_stride' must be >= 0, got ", grad_loss_stride);
  dispatch_floating(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    cross_entropy_backward_rows(static_cast<T*>(grad_logits), static_cast<const A*>(grad_loss),
                                grad_loss_stride, static_cast<const T*>(logits),
                                static_cast<const A*>(lse), targets, rows, cols, ignore_index);
  });
}

}  // namespace rd::kernels::cpu
