// CUDA row-wise fused ops on contiguous [rows, cols] data: softmax / log-softmax, layer and
// RMS norm (optionally fused with a residual add), and their backward passes, with the CPU
// backend's semantics.
//
// Rows are split over thread groups as row_tiles.cuh describes. Every thread keeps its
// share of the row in registers, so a row that fits (up to 16K float/bf16/f16 elements, 8K
// float64) is read from memory once and written once. Longer rows are processed as
// register-sized tiles, reading the row again for the output. Statistics are computed in
// float32 (float64 for float64 data) and folded over the group in a fixed order: results
// are bitwise reproducible.
//
// The weight/bias gradients of norm_backward are column sums over rows: a second kernel
// folds fixed blocks of rows per column into float partials in scratch memory, and a third
// adds each column's partials in order (in double). No atomics anywhere.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/row_tiles.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: this file's device vocabulary
using namespace row_tiles;    // NOLINT

// Multiplies slots by weight (if any) and adds bias (if any), elementwise along the row.
template <class T, int W>
__device__ __forceinline__ void apply_affine(const T* weight, const T* bias, const RowThread& r,
                                             int64_t base, Values<T>& v) {
  if (weight == nullptr && bias == nullptr) return;
  for_each_chunk<T, W>(r, base, [&](int q, int64_t e) {
    if (weight != nullptr) {
      const Chunk<T, W> w = load_chunk<T, W>(weight + e);
#pragma unroll
      for (int j = 0; j < W; ++j) v[q * W + j] *= to_compute(w.x[j]);
    }
    if (bias != nullptr) {
      const Chunk<T, W> b = load_chunk<T, W>(bias + e);
#pragma unroll
      for (int j = 0; j < W; ++j) v[q * W + j] += to_compute(b.x[j]);
    }
  });
}

// Two sums folded at once (one round of shuffles / one block barrier pair).
template <class A>
struct Pair {
  A a, b;
};
struct PairSumOp {
  template <class A>
  __device__ __forceinline__ Pair<A> operator()(Pair<A> x, Pair<A> y) const {
    return {x.a + y.a, x.b + y.b};
  }
};

// ---------------------------------------------------------------------------------------
// Softmax.

template <class T, int W>
__device__ void softmax_row(T* out, const T* in, const RowThread& r, bool log,
                            FoldScratch& scratch) {
  using A = Compute<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const T* x = in + r.row * r.cols;
  T* y = out + r.row * r.cols;
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  Values<T> v;
  if (r.cols <= capacity) {  // the row stays in registers: read once
    load_tile<T, W>(x, r, 0, v, kNegInf);
    const A m = block_fold(thread_max<A>(v), r.group, scratch.as<A>(), MaxOp{});
    A sum = 0;
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) {
      const A e = exp_of(v[s] - m);  // padding is -inf: adds 0 (unless m is -inf: NaN row)
      sum += e;
      if (!log) v[s] = e;
    }
    sum = block_fold(sum, r.group, scratch.as<A>(), SumOp{});
    if (log) {
      const A shift = m + log_of(sum);
#pragma unroll
      for (int s = 0; s < kSlots<T>; ++s) v[s] -= shift;
    } else {
      const A inv = A(1) / sum;
#pragma unroll
      for (int s = 0; s < kSlots<T>; ++s) v[s] *= inv;
    }
    store_tile<T, W>(y, r, 0, v);
    return;
  }
  // Long rows: an online (max, sum) per thread over the tiles, one fold, a second read.
  LseState<A> state{kNegInf, 0};
  for (int64_t base = 0; base < r.cols; base += capacity) {
    load_tile<T, W>(x, r, base, v, kNegInf);
    lse_add_tile<T>(state, v);
  }
  state = block_fold(state, r.group, scratch.as<LseState<A>>(), LseMergeOp{});
  const A row_max = state.max, row_sum = state.sum;
  const A shift = row_max + log_of(row_sum);
  const A inv = A(1) / row_sum;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    load_tile<T, W>(x, r, base, v, kNegInf);
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) v[s] = log ? v[s] - shift : exp_of(v[s] - row_max) * inv;
    store_tile<T, W>(y, r, base, v);
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_kernel(T* out, const T* in, int64_t rows, int64_t cols, int group, bool log) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  softmax_row<T, W>(out, in, r, log, scratch);
}

template <class T, int W>
__device__ void softmax_backward_row(T* grad_in, const T* grad_out, const T* out,
                                     const RowThread& r, bool log, FoldScratch& scratch) {
  using A = Compute<T>;
  const int64_t offset = r.row * r.cols;
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  Values<T> g, y;
  // The row statistic: sum(g * y) for softmax, sum(g) for log-softmax.
  auto statistic = [&]() {
    A acc = 0;
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) acc += log ? g[s] : g[s] * y[s];
    return acc;
  };
  auto gradient = [&](A stat) {
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) {
      g[s] = log ? g[s] - exp_of(y[s]) * stat : y[s] * (g[s] - stat);
    }
  };
  const bool cached = r.cols <= capacity;
  A acc = 0;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    load_tile<T, W>(grad_out + offset, r, base, g, A(0));
    load_tile<T, W>(out + offset, r, base, y, A(0));
    acc += statistic();
    if (cached) break;
  }
  const A stat = block_fold(acc, r.group, scratch.as<A>(), SumOp{});
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) {
      load_tile<T, W>(grad_out + offset, r, base, g, A(0));
      load_tile<T, W>(out + offset, r, base, y, A(0));
    }
    gradient(stat);
    store_tile<T, W>(grad_in + offset, r, base, g);
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_backward_kernel(T* grad_in, const T* grad_out, const T* out, int64_t rows, int64_t cols,
                            int group, bool log) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  softmax_backward_row<T, W>(grad_in, grad_out, out, r, log, scratch);
}

// ---------------------------------------------------------------------------------------
// Layer / RMS norm.

struct NormParams {
  float* mean;
  float* rstd;
  const void* residual;  // null: the row normalized is `in` itself
  void* sum;             // in + residual, written when residual is set
  const void* weight;
  const void* bias;
  double eps;
  bool rms;
};

template <class T, int W>
__device__ void norm_row(T* out, const T* in, const RowThread& r, const NormParams& p,
                         FoldScratch& scratch) {
  using A = Compute<T>;
  const int64_t offset = r.row * r.cols;
  const T* x = in + offset;
  T* y = out + offset;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  const bool cached = r.cols <= capacity;
  const A count = static_cast<A>(r.cols);
  Values<T> v;  // padding loads as 0: it adds nothing to the mean
  if (p.residual != nullptr) {
    // The row normalized is the sum as stored (rounded to T), which is what the caller keeps
    // and the backward pass reads. A cached row keeps it in registers; a long row is summed
    // in a pre-pass and read back as `x` by the passes below, each thread reading exactly
    // the elements it wrote, so no barrier is needed.
    const T* residual = static_cast<const T*>(p.residual) + offset;
    T* sum = static_cast<T*>(p.sum) + offset;
    for (int64_t base = 0; base < r.cols; base += capacity) {
      load_tile<T, W>(x, r, base, v, A(0));
      add_tile<T, W>(residual, r, base, v);
#pragma unroll
      for (int s = 0; s < kSlots<T>; ++s) v[s] = to_compute(from_compute<T>(v[s]));
      store_tile<T, W>(sum, r, base, v);
      if (cached) break;
    }
    x = sum;
  } else if (cached) {
    load_tile<T, W>(x, r, 0, v, A(0));
  }
  // Pass 1: the mean (layer norm only).
  A mu = 0;
  if (!p.rms) {
    A total = 0;
    for (int64_t base = 0; base < r.cols; base += capacity) {
      if (!cached) load_tile<T, W>(x, r, base, v, A(0));
#pragma unroll
      for (int s = 0; s < kSlots<T>; ++s) total += v[s];
    }
    mu = block_fold(total, r.group, scratch.as<A>(), SumOp{}) / count;
  }
  // Pass 2: the variance about the mean (two passes: no cancellation), padding excluded.
  A sq = 0;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) load_tile<T, W>(x, r, base, v, A(0));
    for_each_chunk<T, W>(r, base, [&](int q, int64_t) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A d = v[q * W + j] - mu;
        sq += d * d;
      }
    });
  }
  sq = block_fold(sq, r.group, scratch.as<A>(), SumOp{});
  const A rstd = A(1) / sqrt_of(sq / count + static_cast<A>(p.eps));
  if (r.t == 0 && r.active) {
    if (p.mean != nullptr && !p.rms) p.mean[r.row] = static_cast<float>(mu);
    if (p.rstd != nullptr) p.rstd[r.row] = static_cast<float>(rstd);
  }
  // Pass 3: the output.
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) load_tile<T, W>(x, r, base, v, A(0));
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) v[s] = (v[s] - mu) * rstd;
    apply_affine<T, W>(weight, bias, r, base, v);
    store_tile<T, W>(y, r, base, v);
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_kernel(T* out, const T* in, int64_t rows, int64_t cols, int group, NormParams p) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  norm_row<T, W>(out, in, r, p, scratch);
}

struct NormBackwardParams {
  const float* mean;
  const float* rstd;
  const void* weight;
  const void* grad_sum;  // may be null
  bool rms;
};

// grad_in = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_sum with
// g = grad_out * weight, xhat = (x - mean) * rstd (mean(g) dropped for RMS norm, grad_sum
// when absent).
template <class T, int W>
__device__ void norm_backward_row(T* grad_in, const T* grad_out, const T* in, const RowThread& r,
                                  const NormBackwardParams& p, FoldScratch& scratch) {
  using A = Compute<T>;
  const int64_t offset = r.row * r.cols;
  const T* weight = static_cast<const T*>(p.weight);
  const T* grad_sum = static_cast<const T*>(p.grad_sum);
  const int64_t capacity = int64_t{kSlots<T>} * r.group;
  const bool cached = r.cols <= capacity;
  const A count = static_cast<A>(r.cols);
  const A mu = p.rms ? A(0) : static_cast<A>(p.mean[r.row]);
  const A rstd = static_cast<A>(p.rstd[r.row]);
  Values<T> xhat, g;
  // Loads a tile as xhat and g (padding: g = 0, so it adds nothing to either sum).
  auto load = [&](int64_t base) {
    load_tile<T, W>(in + offset, r, base, xhat, A(0));
    load_tile<T, W>(grad_out + offset, r, base, g, A(0));
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) xhat[s] = (xhat[s] - mu) * rstd;
    apply_affine<T, W>(weight, nullptr, r, base, g);
  };
  Pair<A> sums{0, 0};  // sum(g * xhat), sum(g)
  for (int64_t base = 0; base < r.cols; base += capacity) {
    load(base);
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) {
      sums.a += g[s] * xhat[s];
      sums.b += g[s];
    }
  }
  sums = block_fold(sums, r.group, scratch.as<Pair<A>>(), PairSumOp{});
  const A c1 = sums.a / count;
  const A c2 = p.rms ? A(0) : sums.b / count;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) load(base);
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) g[s] = rstd * (g[s] - c2 - xhat[s] * c1);
    if (grad_sum != nullptr) add_tile<T, W>(grad_sum + offset, r, base, g);
    store_tile<T, W>(grad_in + offset, r, base, g);
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_backward_kernel(T* grad_in, const T* grad_out, const T* in, int64_t rows, int64_t cols,
                         int group, NormBackwardParams p) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  norm_backward_row<T, W>(grad_in, grad_out, in, r, p, scratch);
}

// Weight/bias gradients: column sums over rows of grad_out * xhat and grad_out.
constexpr int kParamCols = 32;         // columns per block (one warp-wide row segment)
constexpr int kParamRowLanes = 8;      // threads per column, interleaving rows
constexpr int64_t kParamMinRows = 64;  // rows a block folds at least
constexpr int64_t kParamTargetBlocks = 2048;

struct ParamGradArgs {
  const float* mean;
  const float* rstd;
  int64_t rows, cols;
  int64_t rows_per_block;
  bool rms;
  float* grad_weight;  // final outputs (used when there is a single row block)
  float* grad_bias;
  void* weight_partial;  // Compute<T> [row_blocks][cols] (used otherwise)
  void* bias_partial;
};

// Block (x: kParamCols columns, y: kParamRowLanes lanes) folds rows
// [blockIdx.y * rows_per_block, +rows_per_block) of each column; lane y takes rows y, y + 8,
// ..., then a fixed tree in shared memory.
template <class T>
__global__ void __launch_bounds__(kParamCols* kParamRowLanes)
    norm_param_grads_kernel(const T* grad_out, const T* in, ParamGradArgs a) {
  using A = Compute<T>;
  __shared__ Pair<A> sums[kParamRowLanes][kParamCols];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kParamCols + tx;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * a.rows_per_block;
  const int64_t last = std::min(a.rows, first + a.rows_per_block);
  const bool want_weight = a.grad_weight != nullptr;
  Pair<A> s{0, 0};  // sum(grad_out * xhat), sum(grad_out)
  if (col < a.cols) {
    for (int64_t row = first + ty; row < last; row += kParamRowLanes) {
      const A go = to_compute(grad_out[row * a.cols + col]);
      if (want_weight) {
        const A mu = a.rms ? A(0) : static_cast<A>(a.mean[row]);
        s.a += go * ((to_compute(in[row * a.cols + col]) - mu) * static_cast<A>(a.rstd[row]));
      }
      s.b += go;
    }
  }
  sums[ty][tx] = s;
  __syncthreads();
  for (int half = kParamRowLanes / 2; half > 0; half /= 2) {
    if (ty < half) sums[ty][tx] = PairSumOp{}(sums[ty][tx], sums[ty + half][tx]);
    __syncthreads();
  }
  if (ty != 0 || col >= a.cols) return;
  s = sums[0][tx];
  if (gridDim.y == 1) {
    if (a.grad_weight != nullptr) a.grad_weight[col] = static_cast<float>(s.a);
    if (a.grad_bias != nullptr) a.grad_bias[col] = static_cast<float>(s.b);
    return;
  }
  const int64_t at = static_cast<int64_t>(blockIdx.y) * a.cols + col;
  if (a.weight_partial != nullptr) static_cast<A*>(a.weight_partial)[at] = s.a;
  if (a.bias_partial != nullptr) static_cast<A*>(a.bias_partial)[at] = s.b;
}

// Adds each column's row-block partials in block order (in double) into the float output.
template <class A>
__global__ void __launch_bounds__(256)
    column_partials_sum_kernel(const A* partial, int64_t blocks, int64_t cols, float* out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  double s = 0;
  for (int64_t b = 0; b < blocks; ++b) s += static_cast<double>(partial[b * cols + col]);
  out[col] = static_cast<float>(s);
}

// ---------------------------------------------------------------------------------------
// Host side.

template <class T>
void norm_param_grads(float* grad_weight, float* grad_bias, const T* grad_out, const T* in,
                      const float* mean, const float* rstd, int64_t rows, int64_t cols, bool rms,
                      Allocator& scratch, cudaStream_t stream) {
  using A = Compute<T>;
  const int64_t col_blocks = ceil_div(cols, kParamCols);
  RD_CHECK(col_blocks <= kMaxGridX, kInvalidArgument, "norm_backward: ", cols,
           " cols exceed the CUDA grid limit");
  // A row partition fixed by the shape alone (never by the device).
  int64_t row_blocks = std::clamp<int64_t>(
      ceil_div(rows, kParamMinRows), 1,
      std::min<int64_t>(65535, std::max<int64_t>(1, kParamTargetBlocks / col_blocks)));
  const int64_t rows_per_block = ceil_div(rows, row_blocks);
  row_blocks = ceil_div(rows, rows_per_block);
  ParamGradArgs a{mean, rstd,        rows,      cols,    rows_per_block,
                  rms,  grad_weight, grad_bias, nullptr, nullptr};
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  const dim3 block(kParamCols, kParamRowLanes);
  if (row_blocks == 1) {
    norm_param_grads_kernel<T><<<grid, block, 0, stream>>>(grad_out, in, a);
    RD_CUDA_CHECK_LAUNCH();
    return;
  }
  const size_t bytes = static_cast<size_t>(row_blocks * cols) * sizeof(A);
  ScratchBuffer weight_partial(scratch, grad_weight != nullptr ? bytes : 0);
  ScratchBuffer bias_partial(scratch, grad_bias != nullptr ? bytes : 0);
  a.weight_partial = weight_partial.get();
  a.bias_partial = bias_partial.get();
  norm_param_grads_kernel<T><<<grid, block, 0, stream>>>(grad_out, in, a);
  RD_CUDA_CHECK_LAUNCH();
  const unsigned sum_blocks = static_cast<unsigned>(ceil_div(cols, 256));
  if (grad_weight != nullptr) {
    column_partials_sum_kernel<A><<<sum_blocks, 256, 0, stream>>>(
        static_cast<const A*>(a.weight_partial), row_blocks, cols, grad_weight);
    RD_CUDA_CHECK_LAUNCH();
  }
  if (grad_bias != nullptr) {
    column_partials_sum_kernel<A><<<sum_blocks, 256, 0, stream>>>(
        static_cast<const A*>(a.bias_partial), row_blocks, cols, grad_bias);
    RD_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void softmax(void* out, const void* in, DType dtype, int64_t rows, int64_t cols, bool log,
             cudaStream_t stream) {
  check_rows("softmax", rows, cols);
  dispatch_floating(dtype, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0 || cols == 0) return;
    const RowLaunch l = row_launch<T>("softmax", rows, cols, {out, in});
    with_chunk_width<T>(l, [&](auto width) {
      softmax_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(in), rows, cols, l.group, log);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward(void* grad_in, const void* grad_out, const void* out, DType dtype,
                      int64_t rows, int64_t cols, bool log, cudaStream_t stream) {
  check_rows("softmax_backward", rows, cols);
  dispatch_floating(dtype, "softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0 || cols == 0) return;
    const RowLaunch l = row_launch<T>("softmax_backward", rows, cols, {grad_in, grad_out, out});
    with_chunk_width<T>(l, [&](auto width) {
      softmax_backward_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<T*>(grad_in), static_cast<const T*>(grad_out), static_cast<const T*>(out),
          rows, cols, l.group, log);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void norm(void* out, float* mean, float* rstd, const void* in, const void* residual, void* sum,
          const void* weight, const void* bias, DType dtype, int64_t rows, int64_t cols,
          double eps, bool rms, cudaStream_t stream) {
  check_rows("norm", rows, cols);
  RD_CHECK((residual == nullptr) == (sum == nullptr), kInvalidArgument,
           "norm: arguments 'residual' and 'sum' must be both null or both set, got residual ",
           residual == nullptr ? "null" : "set", " and sum ", sum == nullptr ? "null" : "set");
  dispatch_floating(dtype, "norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0) return;  // cols == 0 still writes each row's (NaN) mean and rstd
    const RowLaunch l = row_launch<T>("norm", rows, cols, {out, in, residual, sum, weight, bias});
    const NormParams p{mean, rstd, residual, sum, weight, bias, eps, rms};
    with_chunk_width<T>(l, [&](auto width) {
      norm_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(in), rows, cols, l.group, p);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void norm_backward(void* grad_in, float* grad_weight, float* grad_bias, const void* grad_out,
                   const void* grad_sum, const void* in, const float* mean, const float* rstd,
                   const void* weight, DType dtype, int64_t rows, int64_t cols, bool rms,
                   Allocator& scratch, cudaStream_t stream) {
  check_rows("norm_backward", rows, cols);
  RD_CHECK(rstd && (rms || mean), kInvalidArgument,
           "norm_backward: arguments 'rstd' (and 'mean' for layer norm) must not be null");
  dispatch_floating(dtype, "norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (cols == 0) return;
    if (rows == 0) {  // the gradients are overwritten: sums over no rows are 0
      for (float* g : {grad_weight, grad_bias}) {
        if (g != nullptr) RD_CUDA_CHECK(cudaMemsetAsync(g, 0, cols * sizeof(float), stream));
      }
      return;
    }
    if (grad_in != nullptr) {
      const RowLaunch l =
          row_launch<T>("norm_backward", rows, cols, {grad_in, grad_out, grad_sum, in, weight});
      const NormBackwardParams p{mean, rstd, weight, grad_sum, rms};
      with_chunk_width<T>(l, [&](auto width) {
        norm_backward_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
            static_cast<T*>(grad_in), static_cast<const T*>(grad_out), static_cast<const T*>(in),
            rows, cols, l.group, p);
      });
      RD_CUDA_CHECK_LAUNCH();
    }
    if (grad_weight != nullptr || grad_bias != nullptr) {
      norm_param_grads<T>(grad_weight, grad_bias, static_cast<const T*>(grad_out),
                          static_cast<const T*>(in), mean, rstd, rows, cols, rms, scratch, stream);
    }
  });
}

}  // namespace rd::kernels::cuda
