// CUDA AdamW over a list of tensors in one launch (a multi-tensor apply), with the CPU
// backend's semantics and rounding.
//
// Every tensor is cut into kChunk-element chunks and block b of the grid updates chunk b of
// the list, found through the chunk table (kernels/cuda/chunk_table.cuh): per tensor its four
// pointers, its numel and the grid index of its first chunk. The parameter limit bounds
// kMaxTensors; a longer list takes one more launch per kMaxTensors tensors (queued back to
// back on the stream).
//
// A tensor whose four pointers are 16-byte aligned is read and written in 16-byte vectors
// (16 / sizeof(T) elements per access to param and grad; the float32 moments of 16-bit
// params take two accesses); a misaligned tensor, and the last (numel % width) elements of
// an aligned one, go one element at a time. Each element goes through adamw_element
// (kernels/adamw_update.h), the CPU kernel's code, with contraction into FMA forbidden and
// IEEE division and square root, so both devices produce the same bits.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>

#include "ringdilated/kernels/adamw_update.h"
#include "ringdilated/kernels/cuda/chunk_table.cuh"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/dtype_dispatch.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

using reduce_util::from_compute;
using reduce_util::to_compute;

constexpr int kBlock = 512;
constexpr int64_t kChunk = 65536;  // elements per block: a multiple of every vector width
constexpr int kMaxTensors = 720;   // tensors per launch, bounded by the parameter limit

struct AdamWLaunch {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  void* exp_avg[kMaxTensors];
  void* exp_avg_sq[kMaxTensors];
  chunk_table::Table<kMaxTensors> table;
  AdamWConstants constants;  // rounded to the compute type in the kernel
};
static_assert(sizeof(AdamWLaunch) <= chunk_table::kMaxKernelParamBytes,
              "AdamWLaunch must fit in one launch's kernel parameters");

// N elements of E at p, 16-byte aligned, as N * sizeof(E) / 16 128-bit accesses.
template <class E, int N>
__device__ __forceinline__ void load_vector(const E* p, E (&out)[N]) {
  constexpr int kWords = static_cast<int>(N * sizeof(E) / 16);
  static_assert(kWords * 16 == N * sizeof(E), "whole 16-byte words only");
  uint4 raw[kWords];
#pragma unroll
  for (int k = 0; k < kWords; ++k) raw[k] = reinterpret_cast<const uint4*>(p)[k];
  memcpy(out, raw, sizeof(raw));
}

template <class E, int N>
__device__ __forceinline__ void store_vector(E* p, const E (&in)[N]) {
  constexpr int kWords = static_cast<int>(N * sizeof(E) / 16);
  uint4 raw[kWords];
  memcpy(raw, in, sizeof(raw));
#pragma unroll
  for (int k = 0; k < kWords; ++k) reinterpret_cast<uint4*>(p)[k] = raw[k];
}

// The pointers of one chunk, offset to its first element.
template <class T>
struct ChunkData {
  T* __restrict__ param;
  const T* __restrict__ grad;
  Compute<T>* __restrict__ exp_avg;
  Compute<T>* __restrict__ exp_avg_sq;
};

// Elements [begin, n) of the chunk, thread by thread.
template <class T>
__device__ __forceinline__ void adamw_scalar(const ChunkData<T>& d, int begin, int n,
                                             const AdamWCoefficients<Compute<T>>& c) {
  for (int i = begin + static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
    Compute<T> p = to_compute(d.param[i]);
    Compute<T> m = d.exp_avg[i];
    Compute<T> v = d.exp_avg_sq[i];
    adamw_element(p, to_compute(d.grad[i]), m, v, c);
    d.param[i] = from_compute<T>(p);
    d.exp_avg[i] = m;
    d.exp_avg_sq[i] = v;
  }
}

// The first n / W * W elements of the chunk in W-element vectors (16 bytes of param);
// returns where the scalar tail starts.
template <class T>
__device__ __forceinline__ int adamw_vectors(const ChunkData<T>& d, int n,
                                             const AdamWCoefficients<Compute<T>>& c) {
  using A = Compute<T>;
  constexpr int W = static_cast<int>(16 / sizeof(T));
  const int vectors = n / W;
  for (int k = static_cast<int>(threadIdx.x); k < vectors; k += static_cast<int>(blockDim.x)) {
    const int i = k * W;
    T p[W], g[W];
    A m[W], v[W];
    load_vector(d.param + i, p);
    load_vector(d.grad + i, g);
    load_vector(d.exp_avg + i, m);
    load_vector(d.exp_avg_sq + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      A pj = to_compute(p[j]);
      adamw_element(pj, to_compute(g[j]), m[j], v[j], c);
      p[j] = from_compute<T>(pj);
    }
    store_vector(d.param + i, p);
    store_vector(d.exp_avg + i, m);
    store_vector(d.exp_avg_sq + i, v);
  }
  return vectors * W;
}

// Launch bounds: two blocks per SM (at most 64 registers; the 16-bit types need 71
// otherwise, which would leave one block per SM), without spills.
template <class T>
__global__ void __launch_bounds__(kBlock, 2)
    adamw_kernel(const __grid_constant__ AdamWLaunch l) {
  using A = Compute<T>;
  const chunk_table::BlockChunk chunk = chunk_table::block_chunk(l.table, kChunk);
  const int lo = chunk.tensor, n = chunk.n;
  const int64_t begin = chunk.begin;
  const ChunkData<T> d{static_cast<T*>(l.param[lo]) + begin,
                       static_cast<const T*>(l.grad[lo]) + begin,
                       static_cast<A*>(l.exp_avg[lo]) + begin,
                       static_cast<A*>(l.exp_avg_sq[lo]) + begin};
  const AdamWCoefficients<A> c(l.constants);
  // Chunks start at multiples of kChunk elements, so an aligned tensor has aligned chunks.
  const bool aligned = ((reinterpret_cast<uintptr_t>(l.param[lo]) |
                         reinterpret_cast<uintptr_t>(l.grad[lo]) |
                         reinterpret_cast<uintptr_t>(l.exp_avg[lo]) |
                         reinterpret_cast<uintptr_t>(l.exp_avg_sq[lo])) %
                        16) == 0;
  const int tail = aligned ? adamw_vectors(d, n, c) : 0;
  adamw_scalar(d, tail, n, c);
}

// Queues the launches for the non-empty tensors of the list, kMaxTensors at a time.
template <class T>
void launch_all(std::span<const AdamWTensor> tensors, AdamWLaunch& launch, cudaStream_t stream) {
  chunk_table::pack(
      tensors, launch.table, kChunk,
      [&](int slot, const AdamWTensor& t) {
        launch.param[slot] = t.param;
        launch.grad[slot] = t.grad;
        launch.exp_avg[slot] = t.exp_avg;
        launch.exp_avg_sq[slot] = t.exp_avg_sq;
      },
      [&](int64_t chunks) {
        // The parameters are copied when the launch is queued, so `launch` can be refilled.
        adamw_kernel<T><<<static_cast<unsigned>(chunks), kBlock, 0, stream>>>(launch);
        RD_CUDA_CHECK_LAUNCH();
      });
}

}  // namespace

void adamw(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step,
           cudaStream_t stream) {
  check_adamw_args(tensors, dtype, step);
  chunk_table::check_fits_one_grid(tensors, kChunk, "adamw");
  auto launch = std::make_unique<AdamWLaunch>();  // ~32 KB: not for the stack
  launch->constants = AdamWConstants::from(step);
  dispatch_floating(dtype, "adamw", [&](auto tag) {
    launch_all<typename decltype(tag)::type>(tensors, *launch, stream);
  });
}

}  // namespace rd::kernels::cuda
