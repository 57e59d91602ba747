// The CUDA fused, in-place merge of attention partials (KernelBackend::attention_merge): one
// grid-stride pass over the outputs (by 16-byte vectors of a row where the layout allows)
// that reads both LSEs, then one over the LSEs, each skipping the partial's rows without
// keys. The value rule is kernels/attention_merge.h's, shared with the CPU.
#include <cuda_runtime.h>

#include "ringdilated/kernels/attention_merge.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/strided_index.cuh"
#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cuda {
namespace {

// acc_out = merged_value(acc_out, part_out, acc_lse, part_lse) over items of kLanes
// consecutive elements of a row (1, or a 16-byte vector of acc_out where both outputs hold D
// contiguously: rows_of_vectors); offsets and the skip test once per item, the LSEs broadcast
// along D. Part: part_out's storage type (T or a 16-bit float).
template <int kLanes, class T, class Part>
struct MergeOutBody {
  T* acc;
  const Part* part;
  const T* acc_lse;
  const T* part_lse;
  OffsetCalculator<4> calc;  // over the views counted in items
  RD_HOST_DEVICE void operator()(int64_t item) const {
    const Offsets<4> o = calc.get(item);
    const T lp = part_lse[o.v[3]];
    if (!merges_into_acc(lp)) return;
    const T la = acc_lse[o.v[2]];
    auto* acc_item = reinterpret_cast<AlignedVec<T, kLanes>*>(acc + o.v[0]);
    AlignedVec<T, kLanes> a = *acc_item;
    const AlignedVec<Part, kLanes> p =
        *reinterpret_cast<const AlignedVec<Part, kLanes>*>(part + o.v[1]);
    RD_UNROLL
    for (int j = 0; j < kLanes; ++j) a.v[j] = merged_value(a.v[j], convert<T>(p.v[j]), la, lp);
    *acc_item = a;
  }
};

// The output pass over items of kLanes elements: acc_out and part_out counted in items
// (in_vectors), and an LSE view per item (lse_per_element, its stride-0 last dim shortened).
template <int kLanes, class T, class Part>
void launch_merge_out(const StridedView& acc_out, const StridedView& acc_lse,
                      const StridedView& part_out, const StridedView& part_lse,
                      cudaStream_t stream) {
  auto items = [](const StridedView& v) { return kLanes == 1 ? v : in_vectors(v, kLanes); };
  auto lse_items = [&](const StridedView& lse) {
    StridedView v = lse_per_element(lse, acc_out);
    v.shape[v.ndim - 1] /= kLanes;
    return v;
  };
  const StridedView views[] = {items(acc_out), items(part_out), lse_items(acc_lse),
                               lse_items(part_lse)};
  launch_grid_stride(acc_out.numel() / kLanes,
                     MergeOutBody<kLanes, T, Part>{
                         static_cast<T*>(acc_out.data), static_cast<const Part*>(part_out.data),
                         static_cast<const T*>(acc_lse.data), static_cast<const T*>(part_lse.data),
                         make_offset_calculator<4>({&views[0], &views[1], &views[2], &views[3]})},
                     stream);
}

// By 16-byte vectors where both outputs hold their rows in aligned vectors, else element by
// element.
template <class T, class Part>
void merge_out(const StridedView& acc_out, const StridedView& acc_lse, const StridedView& part_out,
               const StridedView& part_lse, cudaStream_t stream) {
  constexpr int kLanes = static_cast<int>(16 / sizeof(T));
  if (rows_of_vectors(acc_out, kLanes) && rows_of_vectors(part_out, kLanes)) {
    launch_merge_out<kLanes, T, Part>(acc_out, acc_lse, part_out, part_lse, stream);
  } else {
    launch_merge_out<1, T, Part>(acc_out, acc_lse, part_out, part_lse, stream);
  }
}

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
  merge_out<T, Part>(acc_out, acc_lse, part_out, part_lse, stream);
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
