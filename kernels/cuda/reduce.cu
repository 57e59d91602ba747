// CUDA reductions (sum, mean, max, min, argmax, argmin, logsumexp) over any set of dims of
// a strided input, with the CPU backend's semantics.
//
// Plan (host): size-1 dims are dropped; kept dims are ordered by input stride and merged
// where contiguous (in both input and output), reduced dims likewise. Then one of two
// kernels folds each output's reduced positions:
//  - rows: the reduced positions form one contiguous run (stride 1) of >= 32 elements. A
//    warp (runs <= 1024) or a 256-thread block folds each run with 16-byte loads.
//  - columns: anything else. Threads of a block cover neighbouring outputs along x (reads
//    coalesce along the innermost kept dim) and interleaved reduced positions along y
//    (reads coalesce along the innermost reduced dim when few outputs are kept). When the
//    innermost kept dim is contiguous and every offset stays 16-byte aligned (e.g. a sum
//    over the first dim of [N, C]), each x thread instead folds a 16-byte vector of
//    neighbouring outputs per position, so a warp reads 512 contiguous bytes of a row.
// Long runs are cut into `splits` fixed pieces folded by separate blocks into per-piece
// states in scratch memory; a second kernel merges each output's pieces in fixed order.
// Every partition depends on the shapes (and the input's 16-byte alignment) alone, never on
// the device, and no atomics are used: results are bitwise reproducible.
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <span>

#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cuda {
namespace {

using namespace reduce_util;  // NOLINT: this file's device vocabulary

constexpr int kBlock = 256;  // threads per block of every kernel here
constexpr int kWarpsPerBlock = kBlock / kWarp;
// Splits stop growing once a launch has this many blocks (~8 per SM of an H100): enough to
// fill the device, few enough partials to merge.
constexpr int64_t kTargetBlocks = 1024;
constexpr int64_t kRowMinLength = 32;        // shorter runs: one column-kernel thread each
// Longer runs (in bytes): a block (and maybe splits) each. Up to here a warp per run keeps
// several 16-byte loads per lane in flight; a block would get only one or two per thread.
constexpr int64_t kRowWarpMaxBytes = 8192;
constexpr int64_t kRowMinPerSplit = 4096;    // elements a block of the row kernel folds at least
constexpr int64_t kColMinPerThread = 16;     // positions a column-kernel thread folds at least
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

// ---------------------------------------------------------------------------------------
// Reducers: State, init(), add(state, x, position), merge(state, other) and
// store(out, dtype, offset, state). merge() is commutative, so any fixed merge tree gives
// the result the CPU's in-order fold gives (exactly for max/min/arg*/, up to rounding for
// sums).

template <class T>
struct SumReducer {
  using A = Accum<T>;
  using State = A;
  bool mean;
  int64_t count;  // reduced elements per output (for the mean)

  __device__ State init() const { return A(0); }
  __device__ void add(State& s, Compute<T> x, int64_t) const { s += static_cast<A>(x); }
  __device__ void merge(State& s, const State& other) const { s += other; }
  __device__ void store(void* out, DType dtype, int64_t offset, State s) const {
    if constexpr (kIsFloating<T>) {
      if (mean) s /= static_cast<A>(count);  // 0/0 -> NaN for an empty mean, as on the CPU
    }
    store_as(out, dtype, offset, s);
  }
};

// max / min; a NaN wins and then stays.
template <class T>
struct ExtremeReducer {
  using C = Compute<T>;
  using State = C;
  bool is_max;

  __device__ bool wins(C x, C best) const { return is_nan(x) || (is_max ? x > best : x < best); }
  __device__ State init() const { return is_max ? lowest_value<C>() : highest_value<C>(); }
  __device__ void add(State& s, C x, int64_t) const {
    if (wins(x, s)) s = x;
  }
  __device__ void merge(State& s, const State& other) const {
    if (wins(other, s)) s = other;
  }
  __device__ void store(void* out, DType dtype, int64_t offset, State s) const {
    store_as(out, dtype, offset, s);
  }
};

// argmax / argmin: the first NaN if any, else the first extreme value. Candidates are
// ordered totally (NaN first, then value, then lower index), so the merge order is free.
template <class T>
struct ArgReducer {
  using C = Compute<T>;
  struct State {
    C value;
    int64_t index;  // -1: nothing seen
  };
  bool is_max;

  __device__ bool better(const State& a, const State& b) const {
    const bool a_nan = is_nan(a.value), b_nan = is_nan(b.value);
    if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
    if (a.value == b.value) return a.index < b.index;
    return is_max ? a.value > b.value : a.value < b.value;
  }
  __device__ State init() const { return {C(0), -1}; }
  __device__ void add(State& s, C x, int64_t position) const { merge(s, State{x, position}); }
  __device__ void merge(State& s, const State& other) const {
    if (other.index >= 0 && (s.index < 0 || better(other, s))) s = other;
  }
  __device__ void store(void* out, DType, int64_t offset, const State& s) const {
    static_cast<int64_t*>(out)[offset] = s.index;  // out is int64 (checked on the host)
  }
};

// logsumexp as a running (max, sum of exp(x - max)). max = -inf: nothing but -inf seen;
// a max of +inf or NaN is final and is the result (NaN beats +inf), as on the CPU.
template <class T>
struct LogSumExpReducer {
  using A = Compute<T>;
  struct State {
    A max;
    A sum;
  };

  __device__ State init() const { return {-std::numeric_limits<A>::infinity(), A(0)}; }
  __device__ void add(State& s, A x, int64_t) const {
    constexpr A kInf = std::numeric_limits<A>::infinity();
    if (isnan(s.max)) return;
    if (isnan(x) || x == kInf) {
      if (isnan(x) || s.max != kInf) s = {x, A(0)};
      return;
    }
    if (s.max == kInf || x == -kInf) return;
    if (x > s.max) {  // also from max = -inf, where sum is 0 and exp(-inf) is 0
      s.sum = s.sum * exp_of(s.max - x) + A(1);
      s.max = x;
    } else {
      s.sum += exp_of(x - s.max);
    }
  }
  __device__ void merge(State& s, const State& other) const {
    A m = (other.max > s.max || isnan(other.max)) ? other.max : s.max;
    if (isnan(s.max)) m = s.max;
    if (!isfinite(m)) {
      s = {m, A(0)};
      return;
    }
    s.sum = s.sum * exp_of(s.max - m) + other.sum * exp_of(other.max - m);
    s.max = m;
  }
  __device__ void store(void* out, DType dtype, int64_t offset, const State& s) const {
    store_as(out, dtype, offset, isfinite(s.max) ? s.max + log_of(s.sum) : s.max);
  }
};

// ---------------------------------------------------------------------------------------
// The plan: passed by value to every kernel.

// Dims innermost first.
struct Dims {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t stride[kMaxDims];  // input element strides
};

struct Plan {
  int kept_ndim;  // kept dims, innermost first
  int64_t kept_shape[kMaxDims];
  int64_t kept_in[kMaxDims];   // input element strides
  int64_t kept_out[kMaxDims];  // output element strides
  Dims red;                    // reduced dims
  int64_t outputs;             // product of kept sizes
  int64_t reduced;             // positions per output (0 for an empty reduction)
  int64_t splits;              // pieces each output's positions are cut into
  int64_t chunk;               // positions per piece (the last may be shorter)
};

// Input and output element offsets of output `o` (row-major over the kept dims).
__device__ __forceinline__ void kept_offsets(const Plan& p, int64_t o, int64_t& in_offset,
                                             int64_t& out_offset) {
  in_offset = 0;
  out_offset = 0;
#pragma unroll
  for (int d = 0; d < kMaxDims; ++d) {
    if (d < p.kept_ndim) {
      const int64_t i = o % p.kept_shape[d];
      o /= p.kept_shape[d];
      in_offset += i * p.kept_in[d];
      out_offset += i * p.kept_out[d];
    }
  }
}

// Walks reduced positions, tracking their input offset. Fully unrolled loops keep the
// index array in registers.
struct Walker {
  int64_t index[kMaxDims];
  int64_t offset;

  __device__ __forceinline__ void seek(const Dims& d, int64_t position) {
    offset = 0;
#pragma unroll
    for (int i = 0; i < kMaxDims; ++i) {
      index[i] = 0;
      if (i < d.ndim) {
        index[i] = position % d.shape[i];
        position /= d.shape[i];
        offset += index[i] * d.stride[i];
      }
    }
  }
  // Moves `step` positions on; the division only runs when the innermost dim wraps.
  __device__ __forceinline__ void advance(const Dims& d, int64_t step) {
    int64_t carry = step;
#pragma unroll
    for (int i = 0; i < kMaxDims; ++i) {
      if (i < d.ndim && carry != 0) {
        const int64_t v = index[i] + carry;
        if (v < d.shape[i]) {
          offset += carry * d.stride[i];
          index[i] = v;
          carry = 0;
        } else {
          const int64_t q = v / d.shape[i];
          const int64_t r = v - q * d.shape[i];
          offset += (r - index[i]) * d.stride[i];
          index[i] = r;
          carry = q;
        }
      }
    }
  }
};

template <class Red, class S>
__device__ __forceinline__ S warp_merge(const Red& red, S s) {
  return group_fold(s, kWarp, [&](S a, const S& b) {
    red.merge(a, b);
    return a;
  });
}

// Folds positions [begin, end) of the contiguous run at `run`: thread t of a group of g
// takes the unaligned head element t, then 16-byte vectors t, t + g, ... (four loads in
// flight), then tail element t.
template <class Red, class T>
__device__ typename Red::State fold_run(const Red& red, const T* run, int64_t begin, int64_t end,
                                        int t, int g) {
  constexpr int V = kVecWidth<T>;
  constexpr int kUnroll = 4;
  typename Red::State s = red.init();
  const T* p = run + begin;
  const int64_t n = end - begin;
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  // Elements not even naturally aligned can never reach a 16-byte boundary: then everything
  // goes through the scalar tail loop.
  const bool vectorizable = address % sizeof(T) == 0;
  int64_t head = 0;
  if (vectorizable && address % 16 != 0) {
    head = std::min<int64_t>(n, (16 - static_cast<int64_t>(address % 16)) / sizeof(T));
  }
  if (t < head) red.add(s, to_compute(p[t]), begin + t);  // head < V <= 16 < g
  const int64_t vectors = vectorizable ? (n - head) / V : 0;
  const T* body = p + head;
  const int64_t body_position = begin + head;
  int64_t i = t;
  for (; i + (kUnroll - 1) * int64_t{g} < vectors; i += kUnroll * int64_t{g}) {
    Chunk<T, V> c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) c[u] = load_chunk<T, V>(body + (i + u * int64_t{g}) * V);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        red.add(s, to_compute(c[u].x[j]), body_position + (i + u * int64_t{g}) * V + j);
      }
    }
  }
  for (; i < vectors; i += g) {
    const Chunk<T, V> c = load_chunk<T, V>(body + i * V);
#pragma unroll
    for (int j = 0; j < V; ++j) red.add(s, to_compute(c.x[j]), body_position + i * V + j);
  }
  for (int64_t k = head + vectors * V + t; k < n; k += g) red.add(s, to_compute(p[k]), begin + k);
  return s;
}

// Rows kernel: task = (output, split). group == 32: a warp per task, 8 tasks per block;
// group == kBlock: the block is one task. With partial != nullptr the states go to
// partial[task] for the merge kernel, else straight to the output.
template <class Red, class T>
__global__ void __launch_bounds__(kBlock)
    reduce_rows_kernel(const Red red, const T* in, const __grid_constant__ Plan p, void* out,
                       DType out_dtype, typename Red::State* partial, int group) {
  using State = typename Red::State;
  __shared__ alignas(16) unsigned char smem_raw[kWarpsPerBlock * sizeof(State)];
  State* smem = reinterpret_cast<State*>(smem_raw);
  const int64_t task =
      group == kBlock ? static_cast<int64_t>(blockIdx.x)
                      : static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  // Only whole warps of the warp mode can fall off the end (the block mode's grid is exact),
  // and the warp mode never synchronizes the block: returning is safe.
  if (task >= p.outputs * p.splits) return;
  const int64_t o = task / p.splits;
  const int64_t split = task % p.splits;
  int64_t in_offset, out_offset;
  kept_offsets(p, o, in_offset, out_offset);
  const int64_t begin = split * p.chunk;
  const int64_t end = std::min(begin + p.chunk, p.reduced);
  const int t = static_cast<int>(threadIdx.x) % group;
  State s = fold_run(red, in + in_offset, begin, end, t, group);
  s = block_fold(s, group, smem, [&](State a, const State& b) {
    red.merge(a, b);
    return a;
  });
  if (t != 0) return;
  if (partial != nullptr) {
    partial[task] = s;
  } else {
    red.store(out, out_dtype, out_offset, s);
  }
}

// Columns kernel: x covers blockDim.x neighbouring outputs, y interleaves the positions of
// split blockIdx.y (thread y takes begin + y, begin + y + blockDim.y, ...); the y partials
// are merged by a fixed tree in shared memory. blockDim.y is a power of two.
template <class Red, class T>
__global__ void __launch_bounds__(kBlock)
    reduce_columns_kernel(const Red red, const T* in, const __grid_constant__ Plan p, void* out,
                          DType out_dtype, typename Red::State* partial) {
  using State = typename Red::State;
  __shared__ alignas(16) unsigned char smem_raw[kBlock * sizeof(State)];
  State* states = reinterpret_cast<State*>(smem_raw);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int bx = static_cast<int>(blockDim.x), by = static_cast<int>(blockDim.y);
  const int64_t o = static_cast<int64_t>(blockIdx.x) * bx + tx;
  const int64_t split = blockIdx.y;
  State s = red.init();
  int64_t out_offset = 0;
  if (o < p.outputs) {
    int64_t in_offset;
    kept_offsets(p, o, in_offset, out_offset);
    const int64_t end = std::min((split + 1) * p.chunk, p.reduced);
    int64_t r = split * p.chunk + ty;
    if (r < end) {
      const T* base = in + in_offset;
      Walker w;
      w.seek(p.red, r);
      while (true) {
        red.add(s, to_compute(base[w.offset]), r);
        r += by;
        if (r >= end) break;
        w.advance(p.red, by);
      }
    }
  }
  states[ty * bx + tx] = s;
  __syncthreads();
  for (int half = by / 2; half > 0; half /= 2) {
    if (ty < half) red.merge(states[ty * bx + tx], states[(ty + half) * bx + tx]);
    __syncthreads();
  }
  if (ty != 0 || o >= p.outputs) return;
  if (partial != nullptr) {
    partial[split * p.outputs + o] = states[tx];
  } else {
    red.store(out, out_dtype, out_offset, states[tx]);
  }
}

// Vector columns kernel: like the columns kernel, but thread x folds the V = 16 / sizeof(T)
// neighbouring outputs o, ..., o + V - 1 of one contiguous 16-byte vector per reduced
// position (the plan guarantees alignment and a single reduced dim), four loads in flight.
// The y partials of each of the V outputs are merged by the same fixed tree.
template <class Red, class T>
__global__ void __launch_bounds__(kBlock)
    reduce_columns_vec_kernel(const Red red, const T* in, const __grid_constant__ Plan p,
                              void* out, DType out_dtype, typename Red::State* partial) {
  using State = typename Red::State;
  constexpr int V = kVecWidth<T>;
  constexpr int kUnroll = 4;
  __shared__ alignas(16) unsigned char smem_raw[kBlock * sizeof(State)];
  State* states = reinterpret_cast<State*>(smem_raw);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int bx = static_cast<int>(blockDim.x), by = static_cast<int>(blockDim.y);
  const int64_t o = (static_cast<int64_t>(blockIdx.x) * bx + tx) * V;  // outputs % V == 0
  const int64_t split = blockIdx.y;
  State s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = red.init();
  int64_t out_offset = 0;
  if (o < p.outputs) {
    int64_t in_offset;
    kept_offsets(p, o, in_offset, out_offset);
    const T* base = in + in_offset;
    const int64_t stride = p.red.stride[0];
    const int64_t end = std::min((split + 1) * p.chunk, p.reduced);
    int64_t r = split * p.chunk + ty;
    for (; r + (kUnroll - 1) * int64_t{by} < end; r += kUnroll * int64_t{by}) {
      Chunk<T, V> c[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) c[u] = load_chunk<T, V>(base + (r + u * by) * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < V; ++j) red.add(s[j], to_compute(c[u].x[j]), r + u * by);
      }
    }
    for (; r < end; r += by) {
      const Chunk<T, V> c = load_chunk<T, V>(base + r * stride);
#pragma unroll
      for (int j = 0; j < V; ++j) red.add(s[j], to_compute(c.x[j]), r);
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    states[ty * bx + tx] = s[j];
    __syncthreads();
    for (int half = by / 2; half > 0; half /= 2) {
      if (ty < half) red.merge(states[ty * bx + tx], states[(ty + half) * bx + tx]);
      __syncthreads();
    }
    if (ty == 0 && o < p.outputs) {
      if (partial != nullptr) {
        partial[split * p.outputs + o + j] = states[tx];
      } else {
        red.store(out, out_dtype, out_offset + j * p.kept_out[0], states[tx]);
      }
    }
    __syncthreads();  // states is rewritten for the next output
  }
}

// Second pass: a warp per output merges its p.splits partial states (lane l takes pieces
// l, l + 32, ..., then a fixed butterfly) and stores the result.
template <class Red>
__global__ void __launch_bounds__(kBlock)
    reduce_merge_kernel(const Red red, const typename Red::State* partial,
                        const __grid_constant__ Plan p, int64_t split_stride, int64_t output_stride,
                        void* out, DType out_dtype) {
  using State = typename Red::State;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (o >= p.outputs) return;  // whole warps; no block synchronization here
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  State s = red.init();
  for (int64_t i = lane; i < p.splits; i += kWarp) {
    red.merge(s, partial[o * output_stride + i * split_stride]);
  }
  s = warp_merge(red, s);
  if (lane != 0) return;
  int64_t in_offset, out_offset;
  kept_offsets(p, o, in_offset, out_offset);
  red.store(out, out_dtype, out_offset, s);
}

// ---------------------------------------------------------------------------------------
// Host side.

// One dim of the plan while it is being built (outermost first).
struct HostDim {
  int64_t shape, in_stride, out_stride;
};

// Orders dims by decreasing |input stride| (stable, so ties keep their order) and merges
// neighbours that are contiguous in the input (and, with `match_out`, in the output).
int sort_and_merge(std::array<HostDim, kMaxDims>& dims, int n, bool match_out) {
  auto magnitude = [](int64_t s) { return s < 0 ? -s : s; };
  std::stable_sort(dims.begin(), dims.begin() + n, [&](const HostDim& a, const HostDim& b) {
    return magnitude(a.in_stride) > magnitude(b.in_stride);
  });
  int m = 0;
  for (int i = 0; i < n; ++i) {
    if (m > 0) {
      HostDim& outer = dims[m - 1];
      const HostDim& inner = dims[i];
      if (outer.in_stride == inner.in_stride * inner.shape &&
          (!match_out || outer.out_stride == inner.out_stride * inner.shape)) {
        outer = {outer.shape * inner.shape, inner.in_stride, inner.out_stride};
        continue;
      }
    }
    dims[m++] = dims[i];
  }
  return m;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t pow2_ceil(int64_t v) {
  return v <= 1 ? 1 : int64_t{1} << (64 - std::countl_zero(uint64_t(v - 1)));
}

Plan make_plan(const StridedView& out, const StridedView& in, uint32_t dims_mask) {
  Plan p{};
  std::array<HostDim, kMaxDims> kept{}, red{};
  int n_kept = 0, n_red = 0;
  p.outputs = 1;
  p.reduced = 1;
  for (int d = 0; d < in.ndim; ++d) {
    if ((dims_mask >> d) & 1u) {
      p.reduced *= in.shape[d];
      if (in.shape[d] != 1) red[n_red++] = {in.shape[d], in.strides[d], 0};
    } else {
      p.outputs *= in.shape[d];
      if (in.shape[d] != 1) kept[n_kept++] = {in.shape[d], in.strides[d], out.strides[d]};
    }
  }
  if (p.reduced == 0) n_red = 0;  // nothing to walk; every output gets the empty fold
  n_kept = sort_and_merge(kept, n_kept, true);
  n_red = sort_and_merge(red, n_red, false);
  p.kept_ndim = n_kept;
  for (int i = 0; i < n_kept; ++i) {  // reversed: innermost first
    const HostDim& d = kept[n_kept - 1 - i];
    p.kept_shape[i] = d.shape;
    p.kept_in[i] = d.in_stride;
    p.kept_out[i] = d.out_stride;
  }
  p.red.ndim = n_red;
  for (int i = 0; i < n_red; ++i) {
    p.red.shape[i] = red[n_red - 1 - i].shape;
    p.red.stride[i] = red[n_red - 1 - i].in_stride;
  }
  return p;
}

struct Launch {
  const void* in;
  DType in_dtype;
  void* out;
  DType out_dtype;
  Allocator* scratch;
  cudaStream_t stream;
};

template <class Red>
void launch_merge(const Red& red, const typename Red::State* partial, const Plan& p,
                  int64_t split_stride, int64_t output_stride, const Launch& l) {
  const int64_t blocks = ceil_div(p.outputs, kWarpsPerBlock);
  RD_CHECK(blocks <= kMaxGridX, kInvalidArgument, "reduce: ", p.outputs,
           " outputs exceed the CUDA grid limit");
  reduce_merge_kernel<Red><<<static_cast<unsigned>(blocks), kBlock, 0, l.stream>>>(
      red, partial, p, split_stride, output_stride, l.out, l.out_dtype);
  RD_CUDA_CHECK_LAUNCH();
}

template <class Red, class T>
void launch_rows(const Red& red, Plan p, const Launch& l) {
  using State = typename Red::State;
  int group = kWarp;
  p.splits = 1;
  p.chunk = p.reduced;
  if (p.reduced * static_cast<int64_t>(sizeof(T)) > kRowWarpMaxBytes) {
    group = kBlock;
    const int64_t max_splits = std::max<int64_t>(1, kTargetBlocks / p.outputs);
    p.splits = std::clamp<int64_t>(ceil_div(p.reduced, kRowMinPerSplit), 1, max_splits);
    // Whole 16-element steps keep every piece as 16-byte aligned as the run's start.
    p.chunk = ceil_div(ceil_div(p.reduced, p.splits), 16) * 16;
    p.splits = ceil_div(p.reduced, p.chunk);
  }
  const int64_t tasks = p.outputs * p.splits;
  const int64_t blocks = group == kBlock ? tasks : ceil_div(tasks, kWarpsPerBlock);
  RD_CHECK(blocks <= kMaxGridX, kInvalidArgument, "reduce: ", p.outputs,
           " outputs exceed the CUDA grid limit");
  const T* in = static_cast<const T*>(l.in);
  if (p.splits == 1) {
    reduce_rows_kernel<Red, T><<<static_cast<unsigned>(blocks), kBlock, 0, l.stream>>>(
        red, in, p, l.out, l.out_dtype, nullptr, group);
    RD_CUDA_CHECK_LAUNCH();
    return;
  }
  ScratchBuffer partial(*l.scratch, static_cast<size_t>(tasks) * sizeof(State));
  State* states = static_cast<State*>(partial.get());
  reduce_rows_kernel<Red, T><<<static_cast<unsigned>(blocks), kBlock, 0, l.stream>>>(
      red, in, p, l.out, l.out_dtype, states, group);
  RD_CUDA_CHECK_LAUNCH();
  launch_merge(red, states, p, /*split_stride=*/1, /*output_stride=*/p.splits, l);
}

// Whether the vector columns kernel applies: floating input (other dtypes keep the scalar
// kernel, which also keeps compile times down), a contiguous innermost kept dim whose size
// and every other stride are whole vectors, one reduced dim and a 16-byte aligned input.
template <class T>
bool columns_vectorizable(const Plan& p, const void* in) {
  if constexpr (!kIsFloating<T>) {
    return false;
  } else {
    constexpr int64_t V = kVecWidth<T>;
    if (p.kept_ndim < 1 || p.kept_in[0] != 1 || p.kept_shape[0] % V != 0) return false;
    if (p.red.ndim != 1 || p.red.stride[0] % V != 0) return false;
    for (int d = 1; d < p.kept_ndim; ++d) {
      if (p.kept_in[d] % V != 0) return false;
    }
    return reinterpret_cast<uintptr_t>(in) % 16 == 0;
  }
}

template <class Red, class T>
void launch_columns(const Red& red, Plan p, const Launch& l) {
  using State = typename Red::State;
  const bool vec = columns_vectorizable<T>(p, l.in);
  // x threads cover `lanes` columns: single outputs, or V-output vectors.
  const int64_t lanes = vec ? p.outputs / kVecWidth<T> : p.outputs;
  const int64_t outputs_pow2 = pow2_ceil(lanes);
  int64_t bx = std::min<int64_t>(kWarp, outputs_pow2);
  int64_t by = 1;
  // y threads while each still folds >= kColMinPerThread positions, then x takes the rest.
  while (bx * by * 2 <= kBlock && p.reduced / (by * 2) >= kColMinPerThread) by *= 2;
  while (bx * by * 2 <= kBlock && bx < outputs_pow2) bx *= 2;
  const int64_t blocks_x = ceil_div(lanes, bx);
  RD_CHECK(blocks_x <= kMaxGridX, kInvalidArgument, "reduce: ", p.outputs,
           " outputs exceed the CUDA grid limit");
  const int64_t max_splits =
      std::min<int64_t>(kMaxGridY, std::max<int64_t>(1, kTargetBlocks / blocks_x));
  p.splits = std::clamp<int64_t>(ceil_div(p.reduced, by * kColMinPerThread), 1, max_splits);
  p.chunk = std::max<int64_t>(1, ceil_div(p.reduced, p.splits));
  p.splits = std::max<int64_t>(1, ceil_div(p.reduced, p.chunk));
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(p.splits));
  const dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  const T* in = static_cast<const T*>(l.in);
  auto kernel = reduce_columns_kernel<Red, T>;
  if constexpr (kIsFloating<T>) {
    if (vec) kernel = reduce_columns_vec_kernel<Red, T>;
  }
  if (p.splits == 1) {
    kernel<<<grid, block, 0, l.stream>>>(red, in, p, l.out, l.out_dtype, nullptr);
    RD_CUDA_CHECK_LAUNCH();
    return;
  }
  ScratchBuffer partial(*l.scratch, static_cast<size_t>(p.splits * p.outputs) * sizeof(State));
  State* states = static_cast<State*>(partial.get());
  kernel<<<grid, block, 0, l.stream>>>(red, in, p, l.out, l.out_dtype, states);
  RD_CUDA_CHECK_LAUNCH();
  launch_merge(red, states, p, /*split_stride=*/p.outputs, /*output_stride=*/1, l);
}

template <class Red, class T>
void launch(const Red& red, const Plan& p, const Launch& l) {
  const bool contiguous_run = p.red.ndim == 1 && p.red.stride[0] == 1 && p.reduced >= kRowMinLength;
  if (contiguous_run) {
    launch_rows<Red, T>(red, p, l);
  } else {
    launch_columns<Red, T>(red, p, l);
  }
}

template <class T>
void reduce_typed(ReduceOp op, const Plan& p, const Launch& l) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return launch<SumReducer<T>, T>(SumReducer<T>{op == ReduceOp::kMean, p.reduced}, p, l);
    case ReduceOp::kMax:
    case ReduceOp::kMin:
      return launch<ExtremeReducer<T>, T>(ExtremeReducer<T>{op == ReduceOp::kMax}, p, l);
    case ReduceOp::kArgMax:
    case ReduceOp::kArgMin:
      return launch<ArgReducer<T>, T>(ArgReducer<T>{op == ReduceOp::kArgMax}, p, l);
    case ReduceOp::kLogSumExp:
      if constexpr (kIsFloating<T>) {
        return launch<LogSumExpReducer<T>, T>(LogSumExpReducer<T>{}, p, l);
      }
      break;
  }
  RD_FAIL(kDTypeMismatch, "reduce: op ", op_name(op), " does not support dtype ",
          dtype_name(l.in_dtype));
}

}  // namespace

void reduce(ReduceOp op, const StridedView& out, const StridedView& in, uint32_t dims_mask,
            Allocator& scratch, cudaStream_t stream) {
  check_reduce_args(op, out, in, dims_mask);
  const Plan plan = make_plan(out, in, dims_mask);
  if (plan.outputs == 0) return;
  const Launch l{in.data, in.dtype, out.data, out.dtype, &scratch, stream};
  switch (in.dtype) {
    case DType::kFloat32: return reduce_typed<float>(op, plan, l);
    case DType::kFloat64: return reduce_typed<double>(op, plan, l);
    case DType::kBFloat16: return reduce_typed<BFloat16>(op, plan, l);
    case DType::kFloat16: return reduce_typed<Float16>(op, plan, l);
    case DType::kInt32: return reduce_typed<int32_t>(op, plan, l);
    case DType::kInt64: return reduce_typed<int64_t>(op, plan, l);
    case DType::kBool: return reduce_typed<bool>(op, plan, l);
  }
  RD_FAIL(kInternal, "reduce: unknown dtype ", static_cast<int>(in.dtype));
}

}  // namespace rd::kernels::cuda
