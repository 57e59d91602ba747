// Row tiles in registers, shared by the CUDA row-wise kernels (rowwise.cu, cross_entropy.cu):
// which threads own a row of contiguous [rows, cols] data, how a thread's share of a tile is
// loaded and stored in 16-byte chunks, the launch shape, and the online (max, sum) fold.
//
// Each row belongs to a group of threads: `group` aligned lanes of a warp (2..32, many rows
// per 256-thread block) for rows of up to 32 * slots elements, else a whole block of
// 64..512 threads. Every thread keeps `slots` values of the row in registers (read in
// 16-byte chunks when the rows are 16-byte aligned); longer rows are walked as tiles of
// slots * group elements. A tile is either Values (kSlots computed values, 32 float
// registers) or a PackedTile (the same 32 registers holding the values as stored, so
// 16-bit rows keep 64 a thread: twice the bytes in flight per thread).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/error.h"

// A namespace of its own, like reduce_util: these inline definitions must not collide with
// similar helpers of other CUDA files.
namespace rd::kernels::cuda::row_tiles {

using namespace reduce_util;  // NOLINT: the device vocabulary these helpers build on

inline constexpr int kGroupBlock = 256;     // threads per block when groups are <= one warp
inline constexpr int kMinRowThreads = 64;   // a block that owns one row has 64..512 threads
inline constexpr int kMaxRowThreads = 512;  // (launch bound 512: up to 128 registers a thread)
inline constexpr int64_t kMaxGridX = 2147483647;

// Row values each thread keeps in registers: 32 floats, or 16 doubles.
template <class T>
inline constexpr int kSlots = sizeof(Compute<T>) == 8 ? 16 : 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t pow2_ceil(int64_t v) {
  return v <= 1 ? 1 : int64_t{1} << (64 - std::countl_zero(static_cast<uint64_t>(v - 1)));
}

// One thread's place in its row.
struct RowThread {
  int64_t row;    // the row (0 for an idle group past the last row)
  int64_t cols;   // the row length (the same for every thread: decisions use it)
  int64_t limit;  // cols, or 0 for an idle group, which then loads and stores nothing
  int t;          // index within the group
  int group;      // threads per row
  bool active;
};

__device__ __forceinline__ RowThread row_thread(int64_t rows, int64_t cols, int group) {
  RowThread r;
  const int per_block = static_cast<int>(blockDim.x) / group;
  r.group = group;
  r.t = static_cast<int>(threadIdx.x) % group;
  r.row = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / group;
  r.active = r.row < rows;
  if (!r.active) r.row = 0;  // idle groups still join their warp's shuffles
  r.cols = cols;
  r.limit = r.active ? cols : 0;
  return r;
}

// Slot q * W + j of thread t holds element base + (t + group * q) * W + j: chunks of W
// consecutive elements (W = 16 bytes' worth when vectorized, else 1) dealt round-robin.
// With W > 1, cols is a multiple of W, so a chunk is either all inside the row or all out.
// A thread's kChunks chunks of one tile: the first's element index, the stride between
// them, and how many lie inside the row (chunks [0, valid) do). Computed once per tile so
// that the unrolled chunk loops need no 64-bit arithmetic per chunk.
template <class T, int W, int kChunks = kSlots<T> / W>
struct TileChunks {
  int64_t first;
  int64_t stride;
  int valid;

  __device__ __forceinline__ TileChunks(const RowThread& r, int64_t base) {
    first = base + static_cast<int64_t>(r.t) * W;
    stride = static_cast<int64_t>(r.group) * W;
    const int64_t left = r.limit - first;
    valid =
        left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(kChunks, (left + stride - 1) / stride));
  }
};

template <class T>
using Values = Compute<T>[kSlots<T>];

// Element j (even: low half) of a pair of 16-bit floats packed in `word`, as float. The asm
// is volatile so that each use converts again: otherwise the compiler keeps a tile's
// converted values live across passes (64 float registers) instead of its 32 packed ones.
template <class T>
__device__ __forceinline__ float unpack_half(uint32_t word, int j) {
  float f;
  if constexpr (std::is_same_v<T, BFloat16>) {
    uint32_t bits;
    if (j % 2 == 0) {
      asm volatile("shl.b32 %0, %1, 16;" : "=r"(bits) : "r"(word));
    } else {
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(bits) : "r"(word));
    }
    f = __uint_as_float(bits);
  } else {
    const unsigned short half = static_cast<unsigned short>(j % 2 == 0 ? word : word >> 16);
    asm volatile("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(half));
  }
  return f;
}

// A thread's share of a row tile kept as stored, converted to Compute<T> on use: 128 bytes
// of registers when vectorized (32 floats, 64 bf16/f16, 16 doubles), kSlots elements
// otherwise. A value written back is rounded to T, so a tile holds inputs or final outputs,
// never float intermediates.
template <class T, int W>
struct PackedTile {
  static constexpr int kSlotsT = W > 1 ? static_cast<int>(128 / sizeof(T)) : kSlots<T>;
  static constexpr int kChunks = kSlotsT / W;
  Chunk<T, W> chunk[kChunks];

  __device__ __forceinline__ Compute<T> operator[](int s) const {
    if constexpr (kIsHalf<T> && W % 2 == 0) {
      uint32_t word;
      memcpy(&word, &chunk[s / W].x[s % W - s % 2], sizeof(word));
      return unpack_half<T>(word, s % 2);
    } else {
      return to_compute(chunk[s / W].x[s % W]);
    }
  }
  __device__ __forceinline__ void set(int s, Compute<T> v) {
    chunk[s / W].x[s % W] = from_compute<T>(v);
  }
};

// Elements a thread keeps of a row: PackedTile's capacity when `packed`, else kSlots.
template <class T>
int64_t slots_per_thread(bool packed, bool vec) {
  return packed && vec ? static_cast<int64_t>(128 / sizeof(T)) : int64_t{kSlots<T>};
}

// Calls f(q, e) for each of this thread's kChunks chunks of the tile at `base` that lie
// inside the row: q is the chunk (slots q * W .. q * W + W - 1), e the row index of its
// first element.
template <class T, int W, int kChunks = kSlots<T> / W, class F>
__device__ __forceinline__ void for_each_chunk(const RowThread& r, int64_t base, F&& f) {
  const TileChunks<T, W, kChunks> c(r, base);
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    if (q < c.valid) f(q, c.first + q * c.stride);
  }
}

// Loads this thread's chunks of the tile at `base` of `row`; chunks past the row get `fill`.
template <class T, int W>
__device__ __forceinline__ void load_tile(const T* row, const RowThread& r, int64_t base,
                                          PackedTile<T, W>& v, Compute<T> fill) {
  constexpr int kChunks = PackedTile<T, W>::kChunks;
  const TileChunks<T, W, kChunks> c(r, base);
  const T* p = row + c.first;
  Chunk<T, W> padding;
#pragma unroll
  for (int j = 0; j < W; ++j) padding.x[j] = from_compute<T>(fill);
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    v.chunk[q] = q < c.valid ? load_chunk<T, W>(p + q * c.stride) : padding;
  }
}

// Loads this thread's slots of the tile at `base` of `row` (slots past the row get `fill`).
template <class T, int W>
__device__ __forceinline__ void load_tile(const T* row, const RowThread& r, int64_t base,
                                          Values<T>& v, Compute<T> fill) {
  const TileChunks<T, W> c(r, base);
  const T* p = row + c.first;
#pragma unroll
  for (int q = 0; q < kSlots<T> / W; ++q) {
    if (q < c.valid) {
      const Chunk<T, W> chunk = load_chunk<T, W>(p + q * c.stride);
#pragma unroll
      for (int j = 0; j < W; ++j) v[q * W + j] = to_compute(chunk.x[j]);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) v[q * W + j] = fill;
    }
  }
}

template <class T, int W>
__device__ __forceinline__ void store_tile(T* row, const RowThread& r, int64_t base,
                                           const Values<T>& v) {
  const TileChunks<T, W> c(r, base);
  T* p = row + c.first;
#pragma unroll
  for (int q = 0; q < kSlots<T> / W; ++q) {
    if (q < c.valid) {
      Chunk<T, W> chunk;
#pragma unroll
      for (int j = 0; j < W; ++j) chunk.x[j] = from_compute<T>(v[q * W + j]);
      store_chunk<T, W>(p + q * c.stride, chunk);
    }
  }
}

// Adds the tile at `base` of `row` into this thread's slots, a chunk at a time (so that no
// second register tile is needed); slots past the row are left as they are.
template <class T, int W>
__device__ __forceinline__ void add_tile(const T* row, const RowThread& r, int64_t base,
                                         Values<T>& v) {
  for_each_chunk<T, W>(r, base, [&](int q, int64_t e) {
    const Chunk<T, W> chunk = load_chunk<T, W>(row + e);
#pragma unroll
    for (int j = 0; j < W; ++j) v[q * W + j] += to_compute(chunk.x[j]);
  });
}

template <class A>
__device__ __forceinline__ A thread_max(const A (&v)[sizeof(A) == 8 ? 16 : 32]) {
  A m = -std::numeric_limits<A>::infinity();
#pragma unroll
  for (int s = 0; s < static_cast<int>(sizeof(v) / sizeof(A)); ++s) m = max_of(m, v[s]);
  return m;
}

// Shared memory for block folds of up to 16-byte states (Pair<double>, LseState<double>).
struct alignas(16) FoldScratch {
  unsigned char bytes[(kMaxRowThreads / kWarp) * 2 * sizeof(double)];
  template <class S>
  __device__ S* as() {
    static_assert(sizeof(S) <= 2 * sizeof(double));
    return reinterpret_cast<S*>(bytes);
  }
};

// exp(x - m) with exact -inf inputs contributing 0 even when m is -inf (an online fold's
// start); NaN stays NaN.
template <class A>
__device__ __forceinline__ A exp_shifted(A x, A m) {
  return x == -std::numeric_limits<A>::infinity() ? A(0) : exp_of(x - m);
}

// A running sum taken relative to max `from`, rescaled to max `to` >= from. While `from` is
// -inf the sum is 0, or NaN from a NaN input: either passes through unchanged.
template <class A>
__device__ __forceinline__ A rescale(A sum, A from, A to) {
  return from == -std::numeric_limits<A>::infinity() ? sum : sum * exp_of(from - to);
}

// An online logsumexp: sum of exp(x - max) over the values seen, with their max (NaN inputs
// are ignored by the max and make the sum NaN). logsumexp = max + log(sum).
template <class A>
struct LseState {
  A max;
  A sum;
};

// Merges two online states; commutative bit for bit (both terms are rescaled the same way
// and added), as block_fold requires.
struct LseMergeOp {
  template <class A>
  __device__ __forceinline__ LseState<A> operator()(LseState<A> a, LseState<A> b) const {
    const A m = max_of(a.max, b.max);
    return {m, rescale(a.sum, a.max, m) + rescale(b.sum, b.max, m)};
  }
};

// Folds this thread's slots (padding must be -inf) into its online state.
template <class T>
__device__ __forceinline__ void lse_add_tile(LseState<Compute<T>>& state, const Values<T>& v) {
  using A = Compute<T>;
  const A new_max = max_of(state.max, thread_max<A>(v));
  A tile_sum = 0;
#pragma unroll
  for (int s = 0; s < kSlots<T>; ++s) tile_sum += exp_shifted(v[s], new_max);
  state.sum = rescale(state.sum, state.max, new_max) + tile_sum;
  state.max = new_max;
}

// Folds v over a group of `width` threads like block_fold (aligned lanes of a warp, or the
// whole block), with one barrier pair for a block: after the warps' results meet in shared
// memory, every warp folds them again in its lanes (lane i takes warp i's result, lanes past
// the last warp take `identity`, which op must leave unchanged), so no thread walks them
// serially. The order is fixed, and every thread gets the same bits.
template <class S, class Op>
__device__ __forceinline__ S row_fold(S v, int width, S* smem, const Op& op, S identity) {
  if (width <= kWarp) return group_fold(v, width, op);
  v = group_fold(v, kWarp, op);
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (lane == 0) smem[threadIdx.x / kWarp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  v = group_fold(lane < warps ? smem[lane] : identity, kWarp, op);
  __syncthreads();  // smem may be reused by the next fold
  return v;
}

// ---------------------------------------------------------------------------------------
// Host side.

struct RowLaunch {
  int group;    // threads per row
  int threads;  // per block
  unsigned blocks;
  bool vec;  // 16-byte chunks
};

// Picks the group size: small rows get ~2 chunks per lane (idle lanes would waste warps),
// or fill a lane's PackedTile when `packed` (its slots cost the registers anyway, and more
// bytes in flight per thread is what keeps HBM busy); long rows get a block just large
// enough to hold the row in the slots of a thread (a PackedTile's when `packed`, else
// kSlots). The pointers are those read or written in chunks: any misaligned one turns
// vectors off.
template <class T>
RowLaunch row_launch(const char* op, int64_t rows, int64_t cols,
                     std::initializer_list<const void*> pointers, bool packed = false) {
  constexpr int64_t V = kVecWidth<T>;
  RowLaunch l{};
  l.vec = (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) l.vec = false;
  }
  const int64_t slots = slots_per_thread<T>(packed, l.vec);
  int64_t blocks;
  if (cols <= kWarp * slots) {
    const int64_t per_lane = packed ? slots : 2 * V;
    l.group = static_cast<int>(std::clamp<int64_t>(pow2_ceil(ceil_div(cols, per_lane)), 1, kWarp));
    l.threads = kGroupBlock;
    blocks = ceil_div(rows, kGroupBlock / l.group);
  } else {
    l.group = static_cast<int>(
        std::clamp<int64_t>(pow2_ceil(ceil_div(cols, slots)), kMinRowThreads, kMaxRowThreads));
    l.threads = l.group;
    blocks = rows;
  }
  RD_CHECK(blocks <= kMaxGridX, kInvalidArgument, op, ": ", rows,
           " rows exceed the CUDA grid limit");
  l.blocks = static_cast<unsigned>(blocks);
  return l;
}

// Calls f(std::integral_constant<int, W>{}) with W the chunk width the launch uses: a
// 16-byte vector's worth of T, or 1.
template <class T, class F>
void with_chunk_width(const RowLaunch& l, F&& f) {
  if (l.vec) {
    f(std::integral_constant<int, kVecWidth<T>>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace rd::kernels::cuda::row_tiles
