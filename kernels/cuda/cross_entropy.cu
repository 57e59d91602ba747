// CUDA fused cross-entropy over contiguous [rows / inner, cols, inner] logits (row-major
// [rows, cols] when inner == 1) and int64 targets, with the CPU backend's semantics: the
// forward pass folds each position into an online (max, sum of exp) state in one read, the
// backward pass writes g * (softmax - onehot) in one read and one write; the probabilities
// are never stored.
//
// Row-major rows are split over thread groups as row_tiles.cuh describes (16-byte chunks
// when the rows are aligned; vocabularies of 256K and more walk the row in register-sized
// tiles). With a class stride (inner > 1, PyTorch's [N, C, d...] form) one thread walks the
// classes of one position: adjacent threads hold adjacent positions, so every load of a
// warp is one coalesced line and no permuted copy of the logits is needed. That path
// parallelizes over positions only, which suits the usual shapes (many positions, e.g.
// [B, V, T]); a few positions with a huge class count run slower than the row-major path.
// Statistics are computed in float32 (float64 for float64 data) in a fixed order: results
// are bitwise reproducible (the two paths round differently from each other).
//
// Targets are read on the device and not checked by the host: an out-of-range target (not
// ignore_index) is recorded in the device's AsyncErrors (raised at the next host
// synchronization) and makes that position's loss and gradient NaN instead of reading
// outside its classes.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "ringdilated/kernels/cuda/async_error.h"
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
  AsyncErrorSink errors;
};

// The loss of a position from its logsumexp: NaN (and a recorded error) for a target
// outside [0, cols), 0 for ignore_index. `logit(t)` reads class t's logit.
template <class A, class Logit>
__device__ __forceinline__ A position_loss(A row_lse, int64_t row, int64_t target,
                                           const CrossEntropyParams& p, const Logit& logit) {
  if (target == p.ignore_index) return A(0);
  if (target < 0 || target >= p.cols) {
    p.errors.report(target, p.cols, row);
    return std::numeric_limits<A>::quiet_NaN();
  }
  return row_lse - logit(target);
}

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
  loss[r.row] = position_loss(row_lse, r.row, targets[r.row], p,
                              [&](int64_t t) { return to_compute(x[t]); });
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
  if (!ignored && !in_range && r.t == 0) p.errors.report(target, r.cols, r.row);
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

// --- a class stride (inner > 1): one thread per position ---

// Classes a thread loads before folding them into its state: one exp per class and one
// rescale per tile.
constexpr int kStridedTile = 8;
constexpr int kStridedThreads = 256;

// Position r = o * inner + i reads class c at (o * cols + c) * inner + i.
struct StridedPositions {
  int64_t rows, inner;
  __device__ __forceinline__ int64_t base(int64_t r, int64_t cols) const {
    return r / inner * cols * inner + r % inner;
  }
};

template <class T>
__global__ void __launch_bounds__(kStridedThreads)
    cross_entropy_strided_kernel(Compute<T>* loss, Compute<T>* lse, const T* logits,
                                 const int64_t* targets, StridedPositions pos,
                                 CrossEntropyParams p) {
  using A = Compute<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < pos.rows;
       r += int64_t{gridDim.x} * blockDim.x) {
    const T* x = logits + pos.base(r, p.cols);
    LseState<A> state{kNegInf, 0};
    for (int64_t c0 = 0; c0 < p.cols; c0 += kStridedTile) {
      A v[kStridedTile];
      A tile_max = kNegInf;
#pragma unroll
      for (int k = 0; k < kStridedTile; ++k) {
        v[k] = c0 + k < p.cols ? to_compute(x[(c0 + k) * pos.inner]) : kNegInf;
        tile_max = max_of(tile_max, v[k]);
      }
      const A new_max = max_of(state.max, tile_max);
      A tile_sum = 0;
#pragma unroll
      for (int k = 0; k < kStridedTile; ++k) tile_sum += exp_shifted(v[k], new_max);
      state.sum = rescale(state.sum, state.max, new_max) + tile_sum;
      state.max = new_max;
    }
    const A row_lse = state.max + log_of(state.sum);
    lse[r] = row_lse;
    loss[r] = position_loss(row_lse, r, targets[r], p,
                            [&](int64_t t) { return to_compute(x[t * pos.inner]); });
  }
}

template <class T>
__global__ void __launch_bounds__(kStridedThreads)
    cross_entropy_strided_backward_kernel(T* grad_logits, const Compute<T>* grad_loss,
                                          int64_t grad_loss_stride, const T* logits,
                                          const Compute<T>* lse, const int64_t* targets,
                                          StridedPositions pos, CrossEntropyParams p) {
  using A = Compute<T>;
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < pos.rows;
       r += int64_t{gridDim.x} * blockDim.x) {
    const int64_t offset = pos.base(r, p.cols);
    const int64_t target = targets[r];
    const bool ignored = target == p.ignore_index;
    const bool in_range = target >= 0 && target < p.cols;
    if (!ignored && !in_range) p.errors.report(target, p.cols, r);
    const A g = ignored ? A(0)
                : in_range ? grad_loss[r * grad_loss_stride]
                           : std::numeric_limits<A>::quiet_NaN();
    const A row_lse = lse[r];
    for (int64_t c = 0; c < p.cols; ++c) {
      const int64_t e = offset + c * pos.inner;
      const A onehot = c == target ? A(1) : A(0);
      grad_logits[e] =
          from_compute<T>(ignored ? A(0) : g * (exp_of(to_compute(logits[e]) - row_lse) - onehot));
    }
  }
}

unsigned strided_blocks(int64_t rows) {
  return static_cast<unsigned>(
      std::min<int64_t>((rows + kStridedThreads - 1) / kStridedThreads, int64_t{1} << 20));
}

}  // namespace

// Targets are not read on the host (KernelBackend::cross_entropy, "Bad targets"): the
// kernels report a bad one through the sink.
void cross_entropy(const CrossEntropyArgs& a, AsyncErrors& errors, cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy";
  check_cross_entropy_args(a);
  const AsyncErrorSink sink = errors.sink(AsyncErrorOp::kCrossEntropy);
  dispatch_floating(a.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    if (a.rows == 0) return;  // cols == 0 still writes lse = -inf and the losses
    auto* loss = static_cast<A*>(a.loss);
    auto* lse = static_cast<A*>(a.lse);
    const auto* logits = static_cast<const T*>(a.logits);
    if (a.inner > 1) {
      const CrossEntropyParams p{a.rows, a.cols, a.ignore_index, 0, sink};
      cross_entropy_strided_kernel<T><<<strided_blocks(a.rows), kStridedThreads, 0, stream>>>(
          loss, lse, logits, a.targets, StridedPositions{a.rows, a.inner}, p);
      RD_CUDA_CHECK_LAUNCH();
      return;
    }
    const RowLaunch l = row_launch<T>(kOp, a.rows, a.cols, {a.logits});
    const CrossEntropyParams p{a.rows, a.cols, a.ignore_index, l.group, sink};
    with_chunk_width<T>(l, [&](auto width) {
      cross_entropy_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          loss, lse, logits, a.targets, p);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_backward(const CrossEntropyBackwardArgs& a, AsyncErrors& errors,
                            cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy_backward";
  check_cross_entropy_backward_args(a);
  const AsyncErrorSink sink = errors.sink(AsyncErrorOp::kCrossEntropyBackward);
  dispatch_floating(a.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Compute<T>;
    if (a.rows == 0 || a.cols == 0) return;
    auto* grad_logits = static_cast<T*>(a.grad_logits);
    const auto* grad_loss = static_cast<const A*>(a.grad_loss);
    const auto* logits = static_cast<const T*>(a.logits);
    const auto* lse = static_cast<const A*>(a.lse);
    if (a.inner > 1) {
      const CrossEntropyParams p{a.rows, a.cols, a.ignore_index, 0, sink};
      cross_entropy_strided_backward_kernel<T>
          <<<strided_blocks(a.rows), kStridedThreads, 0, stream>>>(
              grad_logits, grad_loss, a.grad_loss_stride, logits, lse, a.targets,
              StridedPositions{a.rows, a.inner}, p);
      RD_CUDA_CHECK_LAUNCH();
      return;
    }
    const RowLaunch l = row_launch<T>(kOp, a.rows, a.cols, {a.grad_logits, a.logits});
    const CrossEntropyParams p{a.rows, a.cols, a.ignore_index, l.group, sink};
    with_chunk_width<T>(l, [&](auto width) {
      cross_entropy_backward_kernel<T, decltype(width)::value>
          <<<l.blocks, l.threads, 0, stream>>>(grad_logits, grad_loss, a.grad_loss_stride,
                                               logits, lse, a.targets, p);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace rd::kernels::cuda
