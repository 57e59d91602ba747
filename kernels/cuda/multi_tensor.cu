// CUDA multi-tensor ops (KernelBackend::multi_tensor_scale / multi_tensor_sum_squares): one
// launch per list (kernels/cuda/chunk_table.cuh), block b taking chunk b of
// kMultiTensorChunk elements, with the CPU backend's rounding (kernels/multi_tensor.h).
// These serve an optimizer step's bookkeeping (gradient norm, clipping, float32 master
// copies), where one op per tensor would cost ~5 launches per parameter, which the host
// issues slower than the GPU runs them.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>

#include "ringdilated/kernels/cuda/chunk_table.cuh"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/dtype_dispatch.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/multi_tensor.h"

namespace rd::kernels::cuda {
namespace {

using reduce_util::convert_to;
using reduce_util::to_compute;

constexpr int kBlock = 512;
constexpr int kMaxTensors = 1024;  // tensors per launch, bounded by the parameter limit

struct ScaleLaunch {
  const void* src[kMaxTensors];
  void* dst[kMaxTensors];
  chunk_table::Table<kMaxTensors> table;
  double scale;
  const float* device_scale;  // or null
};
static_assert(sizeof(ScaleLaunch) <= chunk_table::kMaxKernelParamBytes);

struct SumSquaresLaunch {
  const void* data[kMaxTensors];
  chunk_table::Table<kMaxTensors> table;
  double* partials;  // this launch's first chunk's partial
};
static_assert(sizeof(SumSquaresLaunch) <= chunk_table::kMaxKernelParamBytes);

template <class S, class D>
__global__ void __launch_bounds__(kBlock) scale_kernel(const __grid_constant__ ScaleLaunch l) {
  using A = ScaleCompute<S, D>;
  const chunk_table::BlockChunk c = chunk_table::block_chunk(l.table, kMultiTensorChunk);
  const S* src = static_cast<const S*>(l.src[c.tensor]) + c.begin;
  D* dst = static_cast<D*>(l.dst[c.tensor]) + c.begin;
  // The factor as the CPU forms it: scale, then times the device scalar, in A.
  const A factor =
      static_cast<A>(l.scale) * (l.device_scale != nullptr ? static_cast<A>(*l.device_scale) : A(1));
  for (int i = static_cast<int>(threadIdx.x); i < c.n; i += kBlock) {
    const A v = static_cast<A>(to_compute(src[i])) * factor;
    dst[i] = convert_to<D>(v);
  }
}

template <class T>
__global__ void __launch_bounds__(kBlock)
    sum_squares_kernel(const __grid_constant__ SumSquaresLaunch l) {
  using A = Accum<T>;
  __shared__ A warp_sums[kBlock / reduce_util::kWarp];
  const chunk_table::BlockChunk c = chunk_table::block_chunk(l.table, kMultiTensorChunk);
  const T* data = static_cast<const T*>(l.data[c.tensor]) + c.begin;
  A total = 0;
  for (int i = static_cast<int>(threadIdx.x); i < c.n; i += kBlock) {
    const A v = static_cast<A>(to_compute(data[i]));
    total += v * v;
  }
  // Threads in a fixed order: the same bits on every run.
  total = reduce_util::block_fold(total, kBlock, warp_sums, reduce_util::SumOp{});
  if (threadIdx.x == 0) l.partials[blockIdx.x] = static_cast<double>(total);
}

}  // namespace

void multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                        DType dst_dtype, double scale, const float* device_scale,
                        cudaStream_t stream) {
  constexpr const char* kOp = "multi_tensor_scale";
  check_multi_tensor_scale_args(tensors, src_dtype, dst_dtype, scale);
  chunk_table::check_fits_one_grid(tensors, kMultiTensorChunk, kOp);
  auto launch = std::make_unique<ScaleLaunch>();  // ~29 KB: not for the stack
  launch->scale = scale;
  launch->device_scale = device_scale;
  dispatch_floating(src_dtype, kOp, [&](auto src_tag) {
    dispatch_floating(dst_dtype, kOp, [&](auto dst_tag) {
      using S = typename decltype(src_tag)::type;
      using D = typename decltype(dst_tag)::type;
      chunk_table::pack(
          tensors, launch->table, kMultiTensorChunk,
          [&](int slot, const MultiTensorCopy& t) {
            launch->src[slot] = t.src;
            launch->dst[slot] = t.dst;
          },
          [&](int64_t chunks) {
            scale_kernel<S, D><<<static_cast<unsigned>(chunks), kBlock, 0, stream>>>(*launch);
            RD_CUDA_CHECK_LAUNCH();
          });
    });
  });
}

void multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                              double* partials, cudaStream_t stream) {
  constexpr const char* kOp = "multi_tensor_sum_squares";
  check_multi_tensor_sum_squares_args(tensors, dtype, partials);
  chunk_table::check_fits_one_grid(tensors, kMultiTensorChunk, kOp);
  auto launch = std::make_unique<SumSquaresLaunch>();
  int64_t done = 0;  // partials written by earlier launches
  dispatch_floating(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    chunk_table::pack(
        tensors, launch->table, kMultiTensorChunk,
        [&](int slot, const MultiTensorInput& t) { launch->data[slot] = t.data; },
        [&](int64_t chunks) {
          launch->partials = partials + done;
          sum_squares_kernel<T><<<static_cast<unsigned>(chunks), kBlock, 0, stream>>>(*launch);
          RD_CUDA_CHECK_LAUNCH();
          done += chunks;
        });
  });
}

}  // namespace rd::kernels::cuda
