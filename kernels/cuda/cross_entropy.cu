// CUDA fused cross-entropy over contiguous [rows, cols] logits and int64 targets, with the
// CPU backend's semantics: the forward pass folds each row into an online (max, sum of
// exp) state in one read, the backward pass writes g * (softmax - onehot) in one read and
// one write; the probabilities are never stored.
//
// Rows are split over thread groups as row_tiles.cuh describes (16-byte chunks when the
// rows are aligned; vocabularies of 256K and more walk the row in register-sized tiles).
// Statistics are computed in float32 (float64 for float64 data) and folded over the group
// in a fixed order: results are bitwise reproducible.
//
// Targets are read on the device. The tensor layer bounds-checks host targets only, so an
// out-of-range target (not ignore_index) must not be trusted here: it makes its row's loss
// and gradient NaN instead of reading outside the row.
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/row_tiles.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: this file's device vocabulary
using namespace row_tiles;    // NOLINT

struct CrossEntropyParams {
  int64_t rows, cols;
  int64_t ignore_index;
  int group;
};

// lse[r] = logsumexp(logits[r]); loss[r] = lse[r] - logits[r, target], 0 when ignored.
template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_kernel(Compute<T>* loss, Compute<T>* lse, const T* logits,
                         const int64_t* targets, CrossEntropyParams p) {
  using A = Compute<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(p.rows, p.cols, p.group);
  const T* x = logits + r.row * r.cols;
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  Values<T> v;
  LseState<A> state{kNegInf, 0};
  for (int64_t base = 0; base < r.cols; base += capacity) {
    load_tile<T, W>(x, r, base, v, kNegInf);  // padding adds exp(-inf) = 0
    lse_add_tile<T>(state, v);
  }
  state = block_fold(state, r.group, scratch.as<LseState<A>>(), LseMergeOp{});
  if (r.t != 0 || !r.active) return;
  const A row_lse = state.max + log_of(state.sum);
  lse[r.row] = row_lse;
  const int64_t target = targets[r.row];
  A row_loss = 0;
  if (target != p.ignore_index) {
    row_loss = target >= 0 && target < r.cols ? row_lse - to_compute(x[target])
                                              : std::numeric_limits<A>::quiet_NaN();
  }
  loss[r.row] = row_loss;
}

// grad_logits[r, c] = g[r] * (exp(logits[r, c] - lse[r]) - (c == target[r])); 0 on ignored rows.
template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_backward_kernel(T* grad_logits, const Compute<T>* grad_loss,
                                  int64_t grad_loss_stride, const T* logits,
                                  const Compute<T>* lse, const int64_t* targets,
                                  CrossEntropyParams p) {
  using A = Compute<T>;
  const RowThread r = row_thread(p.rows, p.cols, p.group);
  if (!r.active) return;  // no folds below: idle groups can leave
  const int64_t offset = r.row * r.cols;
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  const int64_t target = targets[r.row];
  const bool ignored = target == p.ignore_index;
  const bool in_range = target >= 0 && target < r.cols;
  const A g = in_range ? grad_loss[r.row * grad_loss_stride] : std::numeric_limits<A>::quiet_NaN();
  const A row_lse = lse[r.row];
  Values<T> v;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (ignored) {
#pragma unroll
      for (int s = 0; s < kSlots<T>; ++s) v[s] = 0;
    } else {
      load_tile<T, W>(logits + offset, r, base, v, A(0));
      for_each_chunk<T, W>(r, base, [&](int q, int64_t e) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A onehot = e + j == target ? A(1) : A(0);
          v[q * W + j] = g * (exp_of(v[q * W + j] - row_lse) - onehot);
        }
      });
    }
    store_tile<T, W>(grad_logits + offset, r, base, v);
  }
}

using NamedPointers = std::initializer_list<std::pair<const char*, const void*>>;

// Pointers read or written per row must be set when there are rows; per element, when
// there are elements.
void check_cross_entropy_args(const char* op, int64_t rows, int64_t cols, NamedPointers per_row,
                              NamedPointers per_element) {
  check_rows(op, rows, cols);
  for (const auto& [name, p] : per_row) {
    RD_CHECK(rows == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " rows");
  }
  for (const auto& [name, p] : per_element) {
    RD_CHECK(rows * cols == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " x ", cols, " logits");
  }
}

}  // namespace

void cross_entropy(void* loss, void* lse, const void* logits, const int64_t* targets,
                   DType dtype, int64_t rows, int64_t cols, int64_t ignore_index,
                   cudaStream_t stream) {
  check_cross_entropy_args("cross_entropy", rows, cols,
                           {{"loss", loss}, {"lse", lse}, {"targets", targets}},
                           {{"logits", logits}});
  dispatch_floating(dtype, "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    if (rows == 0) return;  // cols == 0 still writes lse = -inf and the losses
    const RowLaunch l = row_launch<T>("cross_entropy", rows, cols, {logits});
    const CrossEntropyParams p{rows, cols, ignore_index, l.group};
    with_chunk_width<T>(l, [&](auto width) {
      cross_entropy_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<A*>(loss), static_cast<A*>(lse), static_cast<const T*>(logits), targets, p);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_backward(void* grad_logits, const void* grad_loss, int64_t grad_loss_stride,
                            const void* logits, const void* lse, const int64_t* targets,
                            DType dtype, int64_t rows, int64_t cols, int64_t ignore_index,
                            cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy_backward";
  check_cross_entropy_args(kOp, rows, cols,
                           {{"grad_loss", grad_loss}, {"lse", lse}, {"targets", targets}},
                           {{"grad_logits", grad_logits}, {"logits", logits}});
  RD_CHECK(grad_loss_stride >= 0, kInvalidArgument, kOp,
           ": argument 'grad_loss_stride' must be >= 0, got ", grad_loss_stride);
  dispatch_floating(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    if (rows == 0 || cols == 0) return;
    const RowLaunch l = row_launch<T>(kOp, rows, cols, {grad_logits, logits});
    const CrossEntropyParams p{rows, cols, ignore_index, l.group};
    with_chunk_width<T>(l, [&](auto width) {
      cross_entropy_backward_kernel<T, decltype(width)::value>
          <<<l.blocks, l.threads, 0, stream>>>(
              static_cast<T*>(grad_logits), static_cast<const A*>(grad_loss), grad_loss_stride,
              static_cast<const T*>(logits), static_cast<const A*>(lse), targets, p);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace rd::kernels::cuda
