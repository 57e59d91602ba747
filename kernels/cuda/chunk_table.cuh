// The chunk table of the multi-tensor kernels (AdamW, multi_tensor_scale/_sum_squares): each
// tensor of a list is cut into fixed-size chunks and grid block b takes chunk b of the list.
// The host packs up to a launch's worth of tensors into a struct passed by value as a
// __grid_constant__ kernel parameter (CUDA 12.1+ accepts 32764 bytes on sm_70 and newer):
// the kernel's pointers per tensor, and this table of sizes and first chunks, through which
// a block finds its tensor by binary search.
#pragma once

#include <cstdint>

#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda::chunk_table {

inline constexpr size_t kMaxKernelParamBytes = 32764;  // CUDA 12.1+, sm_70+
inline constexpr int64_t kMaxGridX = 2147483647;

// The part of a launch struct every multi-tensor kernel shares: per tensor its numel and
// the grid index of its first chunk (increasing), for N tensors at most.
template <int N>
struct Table {
  int64_t numel[N];
  int32_t first_chunk[N];
  int32_t num_tensors;
};

// This block's chunk: its tensor's slot in the launch, its first element and its length.
struct BlockChunk {
  int tensor;
  int64_t begin;
  int n;
};

// The chunk of grid block blockIdx.x: the tensor is the last slot whose first chunk is <=
// the block (at most log2(num_tensors) reads of the table).
template <int N>
__device__ __forceinline__ BlockChunk block_chunk(const Table<N>& table, int64_t chunk) {
  const int block = static_cast<int>(blockIdx.x);
  int lo = 0, hi = table.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_chunk[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = static_cast<int64_t>(block - table.first_chunk[lo]) * chunk;
  const int64_t left = table.numel[lo] - begin;
  return {lo, begin, static_cast<int>(left < chunk ? left : chunk)};
}

// Throws rd::Error naming `op` unless every tensor of the list fits in one grid of `chunk`-
// element blocks; called before anything is queued.
template <class Tensors>
void check_fits_one_grid(const Tensors& tensors, int64_t chunk, const char* op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    RD_CHECK(tensors[i].numel <= kMaxGridX * chunk, kInvalidArgument, op, ": argument 'tensors[",
             i, "].numel' is too large for one launch: ", tensors[i].numel, " elements");
  }
}

// Packs the non-empty tensors of `tensors` into launches of at most N tensors and kMaxGridX
// chunks of `chunk` elements: fills `table`, calls add(slot, tensor) for the kernel's own
// pointers of each, and flush(chunks) to queue a launch (with at least one tensor), so that
// every tensor lies wholly within one launch.
template <int N, class Tensors, class Add, class Flush>
void pack(const Tensors& tensors, Table<N>& table, int64_t chunk, Add&& add, Flush&& flush) {
  int count = 0;
  int64_t chunks = 0;
  auto queue = [&] {
    if (count == 0) return;
    table.num_tensors = count;
    flush(chunks);
    count = 0;
    chunks = 0;
  };
  for (const auto& t : tensors) {
    if (t.numel == 0) continue;
    const int64_t tensor_chunks = (t.numel + chunk - 1) / chunk;
    if (count == N || chunks + tensor_chunks > kMaxGridX) queue();
    table.numel[count] = t.numel;
    table.first_chunk[count] = static_cast<int32_t>(chunks);
    add(count, t);
    ++count;
    chunks += tensor_chunks;
  }
  queue();
}

}  // namespace rd::kernels::cuda::chunk_table
