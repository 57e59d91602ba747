// The chunk table of the multi-tensor kernels (AdamW, multi_tensor_scale/_sum_squares): each
// tensor of a list is cut into fixed-size chunks and grid block b takes chunk b of the list.
// The host packs up to a launch's worth of tensors into a struct passed by value as a
// __grid_constant__ kernel parameter (CUDA 12.1+ accepts 32764 bytes on sm_70 and newer),
// each with the grid index of its first chunk; a block finds its tensor by binary search.
#pragma once

#include <cstdint>

namespace rd::kernels::cuda::chunk_table {

inline constexpr size_t kMaxKernelParamBytes = 32764;  // CUDA 12.1+, sm_70+
inline constexpr int64_t kMaxGridX = 2147483647;

// The tensor whose chunks hold grid block `block`: the last i with first_chunk[i] <= block
// (first_chunk increasing over num_tensors entries; at most log2(num_tensors) reads).
__device__ __forceinline__ int owner(const int32_t* first_chunk, int num_tensors, int block) {
  int lo = 0, hi = num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Packs the non-empty tensors of `tensors` into launches of at most `max_tensors` tensors
// and kMaxGridX chunks of `chunk` elements: add(slot, tensor, first_chunk) fills slot `slot`
// of the launch being built, and flush(count, chunks) queues it (count > 0), so every tensor
// lies wholly within one launch.
template <class Tensors, class Add, class Flush>
void pack(const Tensors& tensors, int max_tensors, int64_t chunk, Add&& add, Flush&& flush) {
  int count = 0;
  int64_t chunks = 0;
  auto queue = [&] {
    if (count == 0) return;
    flush(count, chunks);
    count = 0;
    chunks = 0;
  };
  for (const auto& t : tensors) {
    if (t.numel == 0) continue;
    const int64_t tensor_chunks = (t.numel + chunk - 1) / chunk;
    if (count == max_tensors || chunks + tensor_chunks > kMaxGridX) queue();
    add(count, t, static_cast<int32_t>(chunks));
    ++count;
    chunks += tensor_chunks;
  }
  queue();
}

}  // namespace rd::kernels::cuda::chunk_table
