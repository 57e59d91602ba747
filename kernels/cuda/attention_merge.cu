// The CUDA fused, in-place merge of attention partials (KernelBackend::attention_merge): one
// grid-stride pass over the outputs that reads both LSEs, then one over the LSEs, each
// skipping the partial's rows without keys. The value rule is kernels/attention_merge.h's,
// shared with the CPU.
#include <cuda_runtime.h>

#include "ringdilated/kernels/attention_merge.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/strided_index.cuh"
#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cuda {
namespace {

// acc_out = merged_value(acc_out, part_out, acc_lse, part_lse), element by element; the
// LSE operands are broadcast along D. Part: part_out's storage type (T or a 16-bit float).
template <class T, class Part>
struct MergeOutBody {
  T* acc;
  const Part* part;
  const T* acc_lse;
  const T* part_lse;
  OffsetCalculator<4> calc;
  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<4> o = calc.get(i);
    const T lp = part_lse[o.v[3]];
    if (!merges_into_acc(lp)) return;
    acc[o.v[0]] = merged_value(acc[o.v[0]], convert<T>(part[o.v[1]]), acc_lse[o.v[2]], lp);
  }
};

template <class T>
struct MergeLseBody {
  T* acc_lse;
  const T* part_lse;
  OffsetCalculator<2> calc;
  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<2> o = calc.get(i);
    const T lp = part_lse[o.v[1]];
    if (merges_into_acc(lp)) acc_lse[o.v[0]] = merged_lse(acc_lse[o.v[0]], lp);
  }
};

template <class T, class Part>
void merge(const StridedView& acc_out, const StridedView& acc_lse, const StridedView& part_out,
           const StridedView& part_lse, cudaStream_t stream) {
  const StridedView acc_row_lse = lse_per_element(acc_lse, acc_out);
  const StridedView part_row_lse = lse_per_element(part_lse, acc_out);
  launch_grid_stride(
      acc_out.numel(),
      MergeOutBody<T, Part>{static_cast<T*>(acc_out.data), static_cast<const Part*>(part_out.data),
                      static_cast<const T*>(acc_lse.data), static_cast<const T*>(part_lse.data),
                      make_offset_calculator<4>({&acc_out, &part_out, &acc_row_lse,
                                                 &part_row_lse})},
      stream);
  // Stream order makes the LSE pass wait for the output pass, which still reads them.
  launch_grid_stride(acc_lse.numel(),
                     MergeLseBody<T>{static_cast<T*>(acc_lse.data),
                                     static_cast<const T*>(part_lse.data),
                                     make_offset_calculator<2>({&acc_lse, &part_lse})},
                     stream);
}

}  // namespace

void attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                     const StridedView& part_out, const StridedView& part_lse,
                     cudaStream_t stream) {
  check_attention_merge_args(acc_out, acc_lse, part_out, part_lse);
  switch (part_out.dtype) {
    case DType::kFloat64: return merge<double, double>(acc_out, acc_lse, part_out, part_lse, stream);
    case DType::kBFloat16: return merge<float, BFloat16>(acc_out, acc_lse, part_out, part_lse, stream);
    case DType::kFloat16: return merge<float, Float16>(acc_out, acc_lse, part_out, part_lse, stream);
    default: return merge<float, float>(acc_out, acc_lse, part_out, part_lse, stream);
  }
}

}  // namespace rd::kernels::cuda
