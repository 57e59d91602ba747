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

// The kernels take kernels/rowwise.h's NormArgs by value, the struct the CPU backend reads.
template <class T, int W>
__device__ void norm_row(const RowThread& r, const NormArgs& p, FoldScratch& scratch) {
  using A = Compute<T>;
  using Tile = PackedTile<T, W>;
  constexpr int kChunks = Tile::kChunks;
  const int64_t offset = r.row * r.cols;
  const T* x = static_cast<const T*>(p.in) + offset;
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
  T* y = static_cast<T*>(p.out) + offset;
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
    norm_kernel(NormArgs p, int group) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(p.rows, p.cols, group);
  norm_row<T, W>(r, p, scratch);
}

// Vectorized 16-bit rows fit in 80 registers a thread without spilling (the bound above
// lets the compiler take ~88): three 256-thread blocks an SM instead of two.
template <class T, int W>
__global__ void __maxnreg__(80)
    norm_packed_half_kernel(NormArgs p, int group) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(p.rows, p.cols, group);
  norm_row<T, W>(r, p, scratch);
}

// ---------------------------------------------------------------------------------------
// Norm backward.

// grad_in = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_sum with
// g = grad_out * weight, xhat = (x - mean) * rstd (mean(g) dropped for RMS norm, grad_sum
// when absent). The unfused path: any alignment, any row length.
template <class T, int W>
__device__ void norm_backward_row(const RowThread& r, const NormBackwardArgs& p,
                                  FoldScratch& scratch) {
  using A = Compute<T>;
  T* grad_in = static_cast<T*>(p.grad_in);
  const T* grad_out = static_cast<const T*>(p.grad_out);
  const T* in = static_cast<const T*>(p.in);
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
    norm_backward_kernel(NormBackwardArgs p, int group) {
  __shared__ FoldScratch scratch;
  const RowThread r = row_thread(p.rows, p.cols, group);
  norm_backward_row<T, W>(r, p, scratch);
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

// Adds each column's [blocks][cols] partials in block order into the float output, for the
// weight's partials (blockIdx.y 0) and the bias's (1) in one launch: block (x: kSumCols
// columns, y: kSumLanes lanes), lane y takes partials y, y + kSumLanes, ... (in double),
// then a fixed tree in shared memory. Few columns a block and many lanes: the sums of two
// [blocks, 1024] partials still spread over 256 blocks (with many loads in flight), where
// 32 columns a block (64 blocks) left most multiprocessors idle and took ~10 us a sum.
constexpr int kSumCols = 8;    // 32-byte row segments: whole sectors
constexpr int kSumLanes = 64;

struct ColumnSums {
  const void* partial[2];  // Compute<T> [blocks][cols]; null: that output is not wanted
  float* out[2];
};

template <class A>
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    column_partials_sum_kernel(ColumnSums c, int64_t blocks, int64_t cols) {
  __shared__ double sums[kSumLanes][kSumCols];
  const A* partial = static_cast<const A*>(c.partial[blockIdx.y]);
  if (partial == nullptr) return;  // the whole block: no barrier is skipped by only some
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kSumCols + tx;
  double s = 0;
  if (col < cols) {
#pragma unroll 4
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
  if (ty == 0 && col < cols) c.out[blockIdx.y][col] = static_cast<float>(sums[0][tx]);
}

// The fused path. A block owns whole rows, one at a time (rows blockIdx.x, + gridDim.x, ...):
// thread t holds chunks k = 0..K-1 of each, at elements (k * blockDim.x + t) * W. It adds
// grad_out * xhat and grad_out of its elements into column partials that only it touches
// (shared memory: no barrier), and the block writes them as row blockIdx.x of
// [gridDim.x, cols] partials.
//
// Every block has up to 1024 threads, so up to 64 registers each, for every type: with the
// partials in shared memory (8 bytes a column, 128 KiB for 16K columns: one block a
// multiprocessor), only blocks of 32 warps an SM hide the latency of a row's loads and
// barrier. (16-bit rows on blocks of 512 threads with 128 registers each, 16 warps an SM,
// reached 53-63% of the copy bandwidth on an H100; now 80-87%.)
// The next row is read while the current one is folded, in one of two ways:
// - double-buffered (K <= 2: two rows' chunks fit in registers): its chunks are loaded
//   before the current row's first pass;
// - in place (K = 4): pass 2 reloads each chunk with the next row's as soon as it is done
//   with it, so the loads overlap the rest of pass 2 at no register cost.
// 16-bit chunks stay packed in 32-bit words and are converted on each use (one instruction
// an element), which keeps a row's share at 8 registers a chunk for every type, and the
// instructions an element low: the kernel issued at 47-66% of the peak rate before (58
// instructions an element for 16-bit rows), nearly instruction-bound.
constexpr int kFusedMaxThreads = 1024;
constexpr int kFusedMaxChunks = 4;

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

// A thread's K 16-byte chunks of one row of the input and grad_out, as loaded, with the
// row's statistics.
template <int K>
struct RowShare {
  uint4 x[K];
  uint4 g[K];
  float mean;
  float rstd;
};

__device__ __forceinline__ uint4 load16(const void* p) {
  return *static_cast<const uint4*>(p);
}

// Element j of a 16-byte chunk of T, as Compute<T> (16-bit values through unpack_half: one
// instruction, converted again on each use rather than kept as floats).
template <class T>
__device__ __forceinline__ Compute<T> chunk_value(const uint4& c, int j) {
  uint32_t words[4];
  memcpy(words, &c, sizeof(c));
  if constexpr (kIsHalf<T>) {
    return unpack_half<T>(words[j / 2], j % 2);
  } else {
    T v;
    memcpy(&v, reinterpret_cast<const char*>(words) + j * sizeof(T), sizeof(T));
    return v;
  }
}

// Rounds v[0..n) to T into elements [j, j + n) of chunk c (j and n even for 16-bit types:
// pairs convert in one instruction).
template <class T, int n>
__device__ __forceinline__ void chunk_set(uint4& c, int j, const Compute<T> (&v)[n]) {
  uint32_t words[4];
  memcpy(words, &c, sizeof(c));
  if constexpr (kIsHalf<T>) {
    static_assert(n % 2 == 0);
#pragma unroll
    for (int i = 0; i < n; i += 2) {
      if constexpr (std::is_same_v<T, BFloat16>) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[i], v[i + 1]);
        memcpy(&words[(j + i) / 2], &pair, sizeof(pair));
      } else {
        const __half2 pair = __floats2half2_rn(v[i], v[i + 1]);
        memcpy(&words[(j + i) / 2], &pair, sizeof(pair));
      }
    }
  } else {
    memcpy(reinterpret_cast<char*>(words) + j * sizeof(T), v, sizeof(v));
  }
  memcpy(&c, words, sizeof(c));
}

template <class T, int K>
__device__ __forceinline__ void load_share(const FusedBackwardParams& p, int64_t row,
                                           RowShare<K>& s) {
  constexpr int W = kVecWidth<T>;
  const int64_t offset = row * p.cols;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * W;
    if (e < p.cols) {
      s.x[k] = load16(static_cast<const T*>(p.in) + offset + e);
      s.g[k] = load16(static_cast<const T*>(p.grad_out) + offset + e);
    }
  }
  s.mean = p.rms ? 0.0f : p.mean[row];
  s.rstd = p.rstd[row];
}

// Sums v over the block: butterflies within each warp, then lane i of every warp takes warp
// i's sum from shared memory and those are folded the same way over `width` lanes (a power
// of two >= the warps; lanes past the last warp add 0) and broadcast from lane 0: a fixed
// order, and every thread gets the same bits. `scratch` holds a sum per warp. The caller
// alternates two scratch buffers between rows, so one barrier a row suffices: a buffer is
// written again only after every thread has passed the barrier of the row in between, so
// after every thread has read it.
template <class A>
__device__ __forceinline__ Pair<A> block_pair_sum(Pair<A> v, Pair<A>* scratch, int width) {
  v = group_fold(v, kWarp, PairSumOp{});
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  if (warps == 1) return v;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (lane == 0) scratch[threadIdx.x / kWarp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : Pair<A>{0, 0};
  v = group_fold(v, width, PairSumOp{});
  return {__shfl_sync(kFullMask, v.a, 0), __shfl_sync(kFullMask, v.b, 0)};
}

template <class T, int K>
__global__ void __launch_bounds__(kFusedMaxThreads)
    norm_backward_fused_kernel(FusedBackwardParams p) {
  using A = Compute<T>;
  constexpr int W = kVecWidth<T>;
  constexpr bool kDoubleBuffer = K <= 2;  // two rows' chunks fit the 64 registers
  // Partials live in 16-byte units of A, laid out [which][k][unit][thread] so that a warp's
  // accesses are contiguous: which = 0 for the weight's, 1 for the bias's.
  constexpr int kPerUnit = static_cast<int>(16 / sizeof(A));
  constexpr int kUnits = W / kPerUnit;
  using Unit = Chunk<A, kPerUnit>;
  extern __shared__ __align__(16) unsigned char fused_smem[];  // one name for every <T, K>
  Unit* partials = reinterpret_cast<Unit*>(fused_smem);
  __shared__ Pair<A> fold_scratch[2][kFusedMaxThreads / kWarp];
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
  T* grad_in = static_cast<T*>(p.grad_in);
  const bool want_grad_in = grad_in != nullptr;
  // 1 / cols once: a multiply a row instead of two divisions.
  const A inv_count = A(1) / static_cast<A>(p.cols);
  int fold_width = 1;
  while (fold_width < threads / kWarp) fold_width *= 2;
  uint4 ones;  // the weight's chunk when there is none
  {
    A one[W];
#pragma unroll
    for (int j = 0; j < W; ++j) one[j] = A(1);
    chunk_set<T>(ones, 0, one);
  }
  auto element = [&](int k) { return (static_cast<int64_t>(k) * threads + t) * W; };
  auto weight_chunk = [&](int64_t e) { return weight != nullptr ? load16(weight + e) : ones; };

  // One row: pass 1 takes its two sums, pass 2 writes grad_in and adds to the partials. With
  // reload >= 0, pass 2 refills `s` with row `reload`, chunk by chunk as it is done with it.
  int parity = 0;
  auto backward_row = [&](RowShare<K>& s, int64_t row, int64_t reload) {
    const A mu = static_cast<A>(s.mean), rstd = static_cast<A>(s.rstd);
    if (reload >= 0) {
      s.mean = p.rms ? 0.0f : p.mean[reload];
      s.rstd = p.rstd[reload];
    }
    A c1 = 0, c2 = 0;  // mean(g * xhat), mean(g) with g = grad_out * weight
    if (want_grad_in) {
      Pair<A> sums{0, 0};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t e = element(k);
        if (e >= p.cols) continue;
        const uint4 w = weight_chunk(e);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A g = chunk_value<T>(s.g[k], j) * chunk_value<T>(w, j);
          sums.a += g * ((chunk_value<T>(s.x[k], j) - mu) * rstd);
          sums.b += g;
        }
      }
      sums = block_pair_sum(sums, fold_scratch[parity], fold_width);
      parity ^= 1;
      c1 = sums.a * inv_count;
      c2 = p.rms ? A(0) : sums.b * inv_count;
    }
    const int64_t offset = row * p.cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t e = element(k);
      if (e >= p.cols) continue;
      uint4 w{}, add{}, out{};
      if (want_grad_in) {
        w = weight_chunk(e);
        if (grad_sum != nullptr) add = load16(grad_sum + offset + e);
      }
      // A unit (16 bytes of partials) at a time: few float temporaries live at once.
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        A xhat[kPerUnit], go[kPerUnit];
#pragma unroll
        for (int i = 0; i < kPerUnit; ++i) {
          const int j = u * kPerUnit + i;
          xhat[i] = (chunk_value<T>(s.x[k], j) - mu) * rstd;
          go[i] = chunk_value<T>(s.g[k], j);
        }
        if (want_grad_in) {
          A gi[kPerUnit];
#pragma unroll
          for (int i = 0; i < kPerUnit; ++i) {
            const int j = u * kPerUnit + i;
            gi[i] = rstd * (go[i] * chunk_value<T>(w, j) - c2 - xhat[i] * c1);
            if (grad_sum != nullptr) gi[i] += chunk_value<T>(add, j);
          }
          chunk_set<T>(out, u * kPerUnit, gi);
        }
        if (want_partials) {
          // Both units are read before either is written: as references, every store
          // would force the other's loads after it (the compiler cannot rule out aliasing).
          Unit dw = unit(0, k, u), db = unit(1, k, u);
#pragma unroll
          for (int i = 0; i < kPerUnit; ++i) {
            dw.x[i] += go[i] * xhat[i];
            db.x[i] += go[i];
          }
          unit(0, k, u) = dw;
          unit(1, k, u) = db;
        }
      }
      if (want_grad_in) *reinterpret_cast<uint4*>(grad_in + offset + e) = out;
      if (reload >= 0) {
        s.x[k] = load16(static_cast<const T*>(p.in) + reload * p.cols + e);
        s.g[k] = load16(static_cast<const T*>(p.grad_out) + reload * p.cols + e);
      }
    }
  };

  const int64_t step = gridDim.x;
  int64_t row = blockIdx.x;
  RowShare<K> current{};
  if (row < p.rows) load_share<T, K>(p, row, current);
  for (; row < p.rows; row += step) {
    const int64_t next = row + step < p.rows ? row + step : -1;
    if constexpr (kDoubleBuffer) {
      RowShare<K> ahead{};
      if (next >= 0) load_share<T, K>(p, next, ahead);
      backward_row(current, row, -1);
      current = ahead;
    } else {
      backward_row(current, row, next);
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

// grad_weight and grad_bias (either may be null) from [blocks][cols] partials.
template <class A>
void sum_column_partials(const void* weight_partial, const void* bias_partial, int64_t blocks,
                         int64_t cols, float* grad_weight, float* grad_bias,
                         cudaStream_t stream) {
  const ColumnSums c{{grad_weight != nullptr ? weight_partial : nullptr,
                      grad_bias != nullptr ? bias_partial : nullptr},
                     {grad_weight, grad_bias}};
  if (c.partial[0] == nullptr && c.partial[1] == nullptr) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kSumCols)), 2);
  column_partials_sum_kernel<A><<<grid, dim3(kSumCols, kSumLanes), 0, stream>>>(c, blocks, cols);
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
  sum_column_partials<A>(a.weight_partial, a.bias_partial, row_blocks, cols, grad_weight,
                         grad_bias, stream);
}

// Runs the fused backward when the rows suit it: 16-byte aligned, at most
// kFusedMaxThreads * kFusedMaxChunks chunks long, and the device has room for a block (its
// partials fit the shared memory a block may opt in to).
// Returns false, having done nothing, otherwise. Chunks a thread: 1 for short rows (blocks
// of <= 512 threads leave room for several a multiprocessor), then 2, then 4, each as long
// as the block stays within kFusedMaxThreads. The grid is the number of blocks the device
// holds at once, so the partial sums (and their order) are fixed for a given device.
template <class T>
bool norm_backward_fused(const NormBackwardArgs& a, Allocator& scratch, cudaStream_t stream) {
  using A = Compute<T>;
  const int64_t rows = a.rows, cols = a.cols;
  float* grad_weight = a.grad_weight;
  float* grad_bias = a.grad_bias;
  constexpr int64_t W = kVecWidth<T>;
  bool aligned = (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  for (const void* ptr : {static_cast<const void*>(a.grad_in), a.grad_out, a.grad_sum, a.in,
                          a.weight}) {
    if (ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 != 0) aligned = false;
  }
  const int64_t chunks = cols / W;
  const int64_t max_threads = kFusedMaxThreads;
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
    int per_sm = 0, device = 0, sms = 0, smem_optin = 0;
    RD_CUDA_CHECK(cudaGetDevice(&device));
    RD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    RD_CUDA_CHECK(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attributes{};
    RD_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    // 16-bit rows near 32K columns want more partials than a block may hold (256 KiB at 1024
    // threads): they take the unfused path rather than fail to launch.
    if (smem + attributes.sharedSizeBytes > static_cast<size_t>(smem_optin)) return;
    RD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    RD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    if (per_sm == 0) return;
    const int64_t blocks = std::min<int64_t>(rows, int64_t{per_sm} * sms);
    const size_t partial_bytes = static_cast<size_t>(blocks * cols) * sizeof(A);
    ScratchBuffer weight_partial(scratch, grad_weight != nullptr ? partial_bytes : 0);
    ScratchBuffer bias_partial(scratch, grad_bias != nullptr ? partial_bytes : 0);
    const FusedBackwardParams p{a.grad_out, a.in,   a.weight, a.grad_sum,
                                a.grad_in,  a.mean, a.rstd,   weight_partial.get(),
                                bias_partial.get(), rows, cols, a.rms};
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
    RD_CUDA_CHECK_LAUNCH();
    sum_column_partials<A>(weight_partial.get(), bias_partial.get(), blocks, cols, grad_weight,
                           grad_bias, stream);
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

void softmax(const SoftmaxArgs& a, cudaStream_t stream) {
  check_softmax_args(a);
  dispatch_floating(a.dtype, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.rows == 0 || a.cols == 0) return;
    const RowLaunch l = row_launch<T>("softmax", a.rows, a.cols, {a.out, a.in});
    with_chunk_width<T>(l, [&](auto width) {
      softmax_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<T*>(a.out), static_cast<const T*>(a.in), a.rows, a.cols, l.group, a.log);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward(const SoftmaxBackwardArgs& a, cudaStream_t stream) {
  check_softmax_backward_args(a);
  dispatch_floating(a.dtype, "softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.rows == 0 || a.cols == 0) return;
    const RowLaunch l =
        row_launch<T>("softmax_backward", a.rows, a.cols, {a.grad_in, a.grad_out, a.out});
    with_chunk_width<T>(l, [&](auto width) {
      softmax_backward_kernel<T, decltype(width)::value><<<l.blocks, l.threads, 0, stream>>>(
          static_cast<T*>(a.grad_in), static_cast<const T*>(a.grad_out),
          static_cast<const T*>(a.out), a.rows, a.cols, l.group, a.log);
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void norm(const NormArgs& a, cudaStream_t stream) {
  check_norm_args(a);
  dispatch_floating(a.dtype, "norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.rows == 0) return;  // cols == 0 still writes each row's (NaN) mean and rstd
    const RowLaunch l = row_launch<T>("norm", a.rows, a.cols,
                                      {a.out, a.in, a.residual, a.sum, a.weight, a.bias},
                                      /*packed=*/true);
    with_chunk_width<T>(l, [&](auto width) {
      constexpr int W = decltype(width)::value;
      auto run = [&](auto* kernel) { kernel<<<l.blocks, l.threads, 0, stream>>>(a, l.group); };
      if constexpr (kIsHalf<T> && W > 1) {
        run(norm_packed_half_kernel<T, W>);
      } else {
        run(norm_kernel<T, W>);
      }
    });
    RD_CUDA_CHECK_LAUNCH();
  });
}

void norm_backward(const NormBackwardArgs& a, Allocator& scratch, cudaStream_t stream) {
  check_norm_backward_args(a);
  dispatch_floating(a.dtype, "norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.cols == 0) return;
    if (a.rows == 0) {  // the gradients are overwritten: sums over no rows are 0
      for (float* g : {a.grad_weight, a.grad_bias}) {
        if (g != nullptr) RD_CUDA_CHECK(cudaMemsetAsync(g, 0, a.cols * sizeof(float), stream));
      }
      return;
    }
    if (norm_backward_fused<T>(a, scratch, stream)) return;
    if (a.grad_in != nullptr) {
      const RowLaunch l = row_launch<T>("norm_backward", a.rows, a.cols,
                                        {a.grad_in, a.grad_out, a.grad_sum, a.in, a.weight});
      with_chunk_width<T>(l, [&](auto width) {
        norm_backward_kernel<T, decltype(width)::value>
            <<<l.blocks, l.threads, 0, stream>>>(a, l.group);
      });
      RD_CUDA_CHECK_LAUNCH();
    }
    if (a.grad_weight != nullptr || a.grad_bias != nullptr) {
      norm_param_grads<T>(a.grad_weight, a.grad_bias, static_cast<const T*>(a.grad_out),
                          static_cast<const T*>(a.in), a.mean, a.rstd, a.rows, a.cols, a.rms,
                          scratch, stream);
    }
  });
}

}  // namespace rd::kernels::cuda
