// CUDA row-wise fused ops on contiguous [rows, cols] data: softmax / log-softmax, layer and
// RMS norm (optionally fused with a residual add), and their backward passes, with the CPU
// backend's semantics.
//
// Rows are split over thread groups as row_tiles.cuh describes. Every thread keeps its
// share of the row in registers, so a row that fits (up to 16K float elements, 32K bf16/f16
// for the norms, 8K float64) is read from memory once and written once. Longer rows are
// processed as register-sized tiles, reading the row again for the output. The norms keep
// their tiles as stored (PackedTile): 16-bit rows then have as many bytes in flight per
// thread as float rows. Statistics are computed in float32 (float64 for float64 data) and
// folded over the group in a fixed order: results are bitwise reproducible.
//
// norm_backward folds the weight/bias gradients (column sums over rows) into the grad_in
// pass when the row fits a block's registers: each block walks many rows and keeps its own
// column partials, which a second kernel adds up per column in block order (in double), so
// grad_out and the input are read once. Other shapes take a separate column-sum kernel over
// fixed blocks of rows. No atomics anywhere.
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

// exp(x - m) for a softmax. 16-bit outputs keep 8 or 11 bits, so they take the hardware's
// 2^x on (x - m) * log2(e) folded into one FMA (a few float ulps, growing with |x - m| where
// the result is tiny): expf's range reduction would be most of the kernel's instructions.
// -inf and NaN behave as with expf (-inf gives 0; m = -inf gives NaN).
template <class T>
__device__ __forceinline__ Compute<T> softmax_exp(Compute<T> x, Compute<T> m) {
  if constexpr (kIsHalf<T>) {
    constexpr float kLog2E = 1.4426950408889634f;
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(x, kLog2E, -m * kLog2E)));
    return r;
  } else {
    return exp_of(x - m);
  }
}

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
    const A m = row_fold(thread_max<A>(v), r.group, scratch.as<A>(), MaxOp{}, kNegInf);
    A sum = 0;
#pragma unroll
    for (int s = 0; s < kSlots<T>; ++s) {
      const A e = softmax_exp<T>(v[s], m);  // padding is -inf: adds 0 (unless m is -inf: NaN row)
      sum += e;
      if (!log) v[s] = e;
    }
    sum = row_fold(sum, r.group, scratch.as<A>(), SumOp{}, A(0));
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
  const LseState<A> empty{kNegInf, 0};  // the merge's identity
  state = row_fold(state, r.group, scratch.as<LseState<A>>(), LseMergeOp{}, empty);
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
  const A stat = row_fold(acc, r.group, scratch.as<A>(), SumOp{}, A(0));
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
  using Tile = PackedTile<T, W>;
  constexpr int kChunks = Tile::kChunks;
  const int64_t offset = r.row * r.cols;
  const T* x = in + offset;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t capacity = int64_t{Tile::kSlotsT} * r.group;
  const bool cached = r.cols <= capacity;
  const A count = static_cast<A>(r.cols);
  Tile v;  // padding loads as 0: it adds nothing to the mean
  if (p.residual != nullptr) {
    // The row normalized is the sum as stored (rounded to T), which is what the caller keeps
    // and the backward pass reads. A cached row keeps it in registers; a long row is summed
    // in a pre-pass and read back as `x` by the passes below, each thread reading exactly
    // the elements it wrote, so no barrier is needed.
    const T* residual = static_cast<const T*>(p.residual) + offset;
    T* sum = static_cast<T*>(p.sum) + offset;
    for (int64_t base = 0; base < r.cols; base += capacity) {
      load_tile<T, W>(x, r, base, v, A(0));
      // Every residual chunk is loaded before the first sum chunk is stored: a store in
      // between (sum may alias residual, as far as the compiler knows) would serialize them.
      for_each_chunk<T, W, kChunks>(r, base, [&](int q, int64_t e) {
        const Chunk<T, W> add = load_chunk<T, W>(residual + e);
#pragma unroll
        for (int j = 0; j < W; ++j) v.set(q * W + j, v[q * W + j] + to_compute(add.x[j]));
      });
      for_each_chunk<T, W, kChunks>(
          r, base, [&](int q, int64_t e) { store_chunk<T, W>(sum + e, v.chunk[q]); });
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
      for (int s = 0; s < Tile::kSlotsT; ++s) total += v[s];
    }
    mu = row_fold(total, r.group, scratch.as<A>(), SumOp{}, A(0)) / count;
  }
  // Pass 2: the variance about the mean (two passes: no cancellation), padding excluded.
  A sq = 0;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) load_tile<T, W>(x, r, base, v, A(0));
    for_each_chunk<T, W, kChunks>(r, base, [&](int q, int64_t) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A d = v[q * W + j] - mu;
        sq += d * d;
      }
    });
  }
  sq = row_fold(sq, r.group, scratch.as<A>(), SumOp{}, A(0));
  const A rstd = A(1) / sqrt_of(sq / count + static_cast<A>(p.eps));
  if (r.t == 0 && r.active) {
    if (p.mean != nullptr && !p.rms) p.mean[r.row] = static_cast<float>(mu);
    if (p.rstd != nullptr) p.rstd[r.row] = static_cast<float>(rstd);
  }
  // Pass 3: the output, (x - mean) * rstd * weight + bias, a chunk at a time. (Storing each
  // chunk as it is done measured faster here than completing the tile first: the weight and
  // bias loads hit the cache, and the whole tile's outputs need not stay live.)
  T* y = out + offset;
  for (int64_t base = 0; base < r.cols; base += capacity) {
    if (!cached) load_tile<T, W>(x, r, base, v, A(0));
    for_each_chunk<T, W, kChunks>(r, base, [&](int q, int64_t e) {
      Chunk<T, W> w, b, o;
      if (weight != nullptr) w = load_chunk<T, W>(weight + e);
      if (bias != nullptr) b = load_chunk<T, W>(bias + e);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        A val = (v[q * W + j] - mu) * rstd;
        if (weight != nullptr) val *= to_compute(w.x[j]);
        if (bias != nullptr) val += to_compute(b.x[j]);
        o.x[j] = from_compute<T>(val);
      }
      store_chunk<T, W>(y + e, o);
    });
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_kernel(T* out, const T* in, int64_t rows, int64_t cols, int group, NormParams p) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  norm_row<T, W>(out, in, r, p, scratch);
}

// Vectorized 16-bit rows fit in 80 registers a thread without spilling (the bound above
// lets the compiler take ~88): three 256-thread blocks an SM instead of two.
template <class T, int W>
__global__ void __maxnreg__(80)
    norm_packed_half_kernel(T* out, const T* in, int64_t rows, int64_t cols, int group,
                            NormParams p) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(rows, cols, group);
  norm_row<T, W>(out, in, r, p, scratch);
}

// ---------------------------------------------------------------------------------------
// Norm backward.

struct NormBackwardParams {
  const float* mean;
  const float* rstd;
  const void* weight;
  const void* grad_sum;  // may be null
  bool rms;
};

// grad_in = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_sum with
// g = grad_out * weight, xhat = (x - mean) * rstd (mean(g) dropped for RMS norm, grad_sum
// when absent). The unfused path: any alignment, any row length.
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
    if (weight == nullptr) return;
    for_each_chunk<T, W>(r, base, [&](int q, int64_t e) {
      const Chunk<T, W> w = load_chunk<T, W>(weight + e);
#pragma unroll
      for (int j = 0; j < W; ++j) g[q * W + j] *= to_compute(w.x[j]);
    });
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
  sums = row_fold(sums, r.group, scratch.as<Pair<A>>(), PairSumOp{}, Pair<A>{0, 0});
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

// Weight/bias gradients of the unfused path: column sums over rows of grad_out * xhat and
// grad_out.
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

// Adds each column's [blocks][cols] partials in block order into the float output: block
// (x: kSumCols columns, y: kSumLanes lanes), lane y takes partials y, y + kSumLanes, ... (in
// double), then a fixed tree in shared memory.
constexpr int kSumCols = 32;
constexpr int kSumLanes = 16;

template <class A>
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    column_partials_sum_kernel(const A* partial, int64_t blocks, int64_t cols, float* out) {
  __shared__ double sums[kSumLanes][kSumCols];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kSumCols + tx;
  double s = 0;
  if (col < cols) {
    for (int64_t b = ty; b < blocks; b += kSumLanes) {
      s += static_cast<double>(partial[b * cols + col]);
    }
  }
  sums[ty][tx] = s;
  __syncthreads();
  for (int half = kSumLanes / 2; half > 0; half /= 2) {
    if (ty < half) sums[ty][tx] += sums[ty + half][tx];
    __syncthreads();
  }
  if (ty == 0 && col < cols) out[col] = static_cast<float>(sums[0][tx]);
}

// The fused path. A block owns whole rows, one at a time (rows blockIdx.x, + gridDim.x, ...):
// thread t holds chunks k = 0..K-1 of each, at elements (k * blockDim.x + t) * W, and loads
// its next row while it folds the current one (when two rows' chunks fit half its
// registers). It adds grad_out * xhat and grad_out of its elements into column partials
// that only it touches (shared memory: no barrier), and the block writes them as row
// blockIdx.x of [gridDim.x, cols] partials.
//
// Threads a block: up to 1024 (64 registers each), but 16-bit chunks hold twice the
// elements, whose float values do not fit that: their blocks stop at 512 threads (128
// registers), and longer rows take more chunks a thread.
template <class T>
inline constexpr int kFusedMaxThreads = sizeof(T) == 2 ? 512 : 1024;
constexpr int kFusedMaxChunks = 4;
constexpr int kRegisterFile = 65536;  // 32-bit registers of a multiprocessor

struct FusedBackwardParams {
  const void* grad_out;
  const void* in;
  const void* weight;    // may be null
  const void* grad_sum;  // may be null
  void* grad_in;         // may be null
  const float* mean;
  const float* rstd;
  void* weight_partial;  // Compute<T> [gridDim.x][cols], or null when not wanted
  void* bias_partial;
  int64_t rows, cols;
  bool rms;
};

// A thread's K chunks of one row of the input and grad_out, with the row's statistics.
template <class T, int K>
struct RowShare {
  Chunk<T, kVecWidth<T>> x[K];
  Chunk<T, kVecWidth<T>> g[K];
  float mean;
  float rstd;
};

template <class T, int K>
__device__ __forceinline__ RowShare<T, K> load_share(const FusedBackwardParams& p, int64_t row) {
  constexpr int W = kVecWidth<T>;
  RowShare<T, K> s{};
  const int64_t offset = row * p.cols;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * W;
    if (e < p.cols) {
      s.x[k] = load_chunk<T, W>(static_cast<const T*>(p.in) + offset + e);
      s.g[k] = load_chunk<T, W>(static_cast<const T*>(p.grad_out) + offset + e);
    }
  }
  s.mean = p.rms ? 0.0f : p.mean[row];
  s.rstd = p.rstd[row];
  return s;
}

template <class T, int K>
__global__ void __launch_bounds__(kFusedMaxThreads<T>)
    norm_backward_fused_kernel(FusedBackwardParams p) {
  using A = Compute<T>;
  constexpr int W = kVecWidth<T>;
  // Partials live in 16-byte units of A, laid out [which][k][unit][thread] so that a warp's
  // accesses are contiguous: which = 0 for the weight's, 1 for the bias's.
  constexpr int kPerUnit = static_cast<int>(16 / sizeof(A));
  constexpr int kUnits = W / kPerUnit;
  using Unit = Chunk<A, kPerUnit>;
  extern __shared__ __align__(16) unsigned char fused_smem[];  // one name for every <T, K>
  Unit* partials = reinterpret_cast<Unit*>(fused_smem);
  __shared__ Pair<A> fold_scratch[kFusedMaxThreads<T> / kWarp];
  const int threads = static_cast<int>(blockDim.x), t = static_cast<int>(threadIdx.x);
  auto unit = [&](int which, int k, int u) -> Unit& {
    return partials[((which * K + k) * kUnits + u) * threads + t];
  };
  const bool want_partials = p.weight_partial != nullptr || p.bias_partial != nullptr;
  if (want_partials) {
#pragma unroll
    for (int which = 0; which < 2; ++which) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int u = 0; u < kUnits; ++u) unit(which, k, u) = Unit{};
      }
    }
  }
  const T* weight = static_cast<const T*>(p.weight);
  const T* grad_sum = static_cast<const T*>(p.grad_sum);
  const A count = static_cast<A>(p.cols);
  auto element = [&](int k) { return (static_cast<int64_t>(k) * threads + t) * W; };
  auto weight_chunk = [&](int64_t e) {
    Chunk<T, W> w;
    if (weight != nullptr) return load_chunk<T, W>(weight + e);
#pragma unroll
    for (int j = 0; j < W; ++j) w.x[j] = from_compute<T>(A(1));
    return w;
  };

  // One row: pass 1 takes its two sums, pass 2 writes grad_in and adds to the partials.
  auto backward_row = [&](const RowShare<T, K>& s, int64_t row) {
    const A mu = static_cast<A>(s.mean), rstd = static_cast<A>(s.rstd);
    const bool want_grad_in = p.grad_in != nullptr;
    A c1 = 0, c2 = 0;  // mean(g * xhat), mean(g) with g = grad_out * weight
    if (want_grad_in) {
      Pair<A> sums{0, 0};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t e = element(k);
        if (e >= p.cols) continue;
        const Chunk<T, W> w = weight_chunk(e);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A g = to_compute(s.g[k].x[j]) * to_compute(w.x[j]);
          sums.a += g * ((to_compute(s.x[k].x[j]) - mu) * rstd);
          sums.b += g;
        }
      }
      sums = row_fold(sums, threads, fold_scratch, PairSumOp{}, Pair<A>{0, 0});
      c1 = sums.a / count;
      c2 = p.rms ? A(0) : sums.b / count;
    }
    const int64_t offset = row * p.cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t e = element(k);
      if (e >= p.cols) continue;
      A xhat[W], go[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        xhat[j] = (to_compute(s.x[k].x[j]) - mu) * rstd;
        go[j] = to_compute(s.g[k].x[j]);
      }
      if (want_grad_in) {
        const Chunk<T, W> w = weight_chunk(e);
        Chunk<T, W> add, out;
        if (grad_sum != nullptr) add = load_chunk<T, W>(grad_sum + offset + e);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          A gi = rstd * (go[j] * to_compute(w.x[j]) - c2 - xhat[j] * c1);
          if (grad_sum != nullptr) gi += to_compute(add.x[j]);
          out.x[j] = from_compute<T>(gi);
        }
        store_chunk<T, W>(static_cast<T*>(p.grad_in) + offset + e, out);
      }
      if (!want_partials) continue;
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        Unit& dw = unit(0, k, u);
        Unit& db = unit(1, k, u);
#pragma unroll
        for (int i = 0; i < kPerUnit; ++i) {
          dw.x[i] += go[u * kPerUnit + i] * xhat[u * kPerUnit + i];
          db.x[i] += go[u * kPerUnit + i];
        }
      }
    }
  };

  // A row's share takes 8 registers a chunk (16 bytes of x and of grad_out).
  constexpr bool kPrefetch = 2 * K * 8 <= kRegisterFile / kFusedMaxThreads<T> / 2;
  const int64_t step = gridDim.x;
  int64_t row = blockIdx.x;
  RowShare<T, K> current{};
  if (row < p.rows) current = load_share<T, K>(p, row);
  for (; row < p.rows; row += step) {
    const bool more = row + step < p.rows;
    if constexpr (kPrefetch) {
      RowShare<T, K> next{};
      if (more) next = load_share<T, K>(p, row + step);
      backward_row(current, row);
      current = next;
    } else {
      backward_row(current, row);
      if (more) current = load_share<T, K>(p, row + step);
    }
  }
  if (!want_partials) return;
  const int64_t partial_row = static_cast<int64_t>(blockIdx.x) * p.cols;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    A* dst = static_cast<A*>(which == 0 ? p.weight_partial : p.bias_partial);
    if (dst == nullptr) continue;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t e = element(k);
      if (e >= p.cols) continue;
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        store_chunk<A, kPerUnit>(dst + partial_row + e + u * kPerUnit, unit(which, k, u));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

template <class A>
void sum_column_partials(const void* partial, int64_t blocks, int64_t cols, float* out,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kSumCols)));
  column_partials_sum_kernel<A><<<grid, dim3(kSumCols, kSumLanes), 0, stream>>>(
      static_cast<const A*>(partial), blocks, cols, out);
  RD_CUDA_CHECK_LAUNCH();
}

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
  if (grad_weight != nullptr) {
    sum_column_partials<A>(a.weight_partial, row_blocks, cols, grad_weight, stream);
  }
  if (grad_bias != nullptr) {
    sum_column_partials<A>(a.bias_partial, row_blocks, cols, grad_bias, stream);
  }
}

// Runs the fused backward when the rows suit it: 16-byte aligned, at most
// kFusedMaxThreads * kFusedMaxChunks chunks long, and the device has room for a block.
// Returns false, having done nothing, otherwise. Chunks a thread: 1 for short rows (blocks
// of <= 512 threads, or 256 for 16-bit data, leave room for several a multiprocessor), then
// 2, then 4, each as long as the block stays within kFusedMaxThreads. The grid is the number
// of blocks the device holds at once, so the partial sums (and their order) are fixed for a
// given device.
template <class T>
bool norm_backward_fused(void* grad_in, float* grad_weight, float* grad_bias,
                         const void* grad_out, const void* grad_sum, const void* in,
                         const float* mean, const float* rstd, const void* weight, int64_t rows,
                         int64_t cols, bool rms, Allocator& scratch, cudaStream_t stream) {
  using A = Compute<T>;
  constexpr int64_t W = kVecWidth<T>;
  bool aligned = (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  for (const void* ptr : {static_cast<const void*>(grad_in), grad_out, grad_sum, in, weight}) {
    if (ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 != 0) aligned = false;
  }
  const int64_t chunks = cols / W;
  const int64_t max_threads = kFusedMaxThreads<T>;
  if (!aligned || chunks > max_threads * kFusedMaxChunks) return false;
  const int per_thread = chunks <= max_threads / 2 ? 1 : chunks <= 2 * max_threads ? 2 : 4;
  const int threads = static_cast<int>(ceil_div(ceil_div(chunks, per_thread), kWarp) * kWarp);
  const bool want_partials = grad_weight != nullptr || grad_bias != nullptr;
  const size_t smem =
      want_partials ? 2 * static_cast<size_t>(per_thread) * W * threads * sizeof(A) : 0;
  bool launched = false;
  auto launch = [&](auto chunks_per_thread) {
    constexpr int K = decltype(chunks_per_thread)::value;
    auto* kernel = norm_backward_fused_kernel<T, K>;
    RD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    int per_sm = 0, device = 0, sms = 0;
    RD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    RD_CUDA_CHECK(cudaGetDevice(&device));
    RD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (per_sm == 0) return;
    const int64_t blocks = std::min<int64_t>(rows, int64_t{per_sm} * sms);
    const size_t partial_bytes = static_cast<size_t>(blocks * cols) * sizeof(A);
    ScratchBuffer weight_partial(scratch, grad_weight != nullptr ? partial_bytes : 0);
    ScratchBuffer bias_partial(scratch, grad_bias != nullptr ? partial_bytes : 0);
    const FusedBackwardParams p{grad_out, in,   weight, grad_sum, grad_in, mean, rstd,
                                weight_partial.get(), bias_partial.get(), rows, cols, rms};
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
    RD_CUDA_CHECK_LAUNCH();
    if (grad_weight != nullptr) {
      sum_column_partials<A>(weight_partial.get(), blocks, cols, grad_weight, stream);
    }
    if (grad_bias != nullptr) {
      sum_column_partials<A>(bias_partial.get(), blocks, cols, grad_bias, stream);
    }
    launched = true;
  };
  switch (per_thread) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    default: launch(std::integral_constant<int, kFusedMaxChunks>{}); break;
  }
  return launched;
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
    const RowLaunch l = row_launch<T>("norm", rows, cols, {out, in, residual, sum, weight, bias},
                                      /*packed=*/true);
    const NormParams p{mean, rstd, residual, sum, weight, bias, eps, rms};
    with_chunk_width<T>(l, [&](auto width) {
      constexpr int W = decltype(width)::value;
      auto run = [&](auto* kernel) {
        kernel<<<l.blocks, l.threads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(in),
                                                   rows, cols, l.group, p);
      };
      if constexpr (kIsHalf<T> && W > 1) {
        run(norm_packed_half_kernel<T, W>);
      } else {
        run(norm_kernel<T, W>);
      }
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
    if (norm_backward_fused<T>(grad_in, grad_weight, grad_bias, grad_out, grad_sum, in, mean,
                               rstd, weight, rows, cols, rms, scratch, stream)) {
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
