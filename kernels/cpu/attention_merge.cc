// The CPU's fused, in-place merge of attention partials (KernelBackend::attention_merge):
// one pass over the outputs that reads both LSEs, then one pass over the LSEs, each skipping
// the partial's rows without keys.
#include <array>

#include "ringdilated/kernels/attention_merge.h"
#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/dtype_dispatch.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels::cpu {
namespace {

// T: the accumulation type; Part: part_out's storage type (T or a 16-bit float).
template <class T, class Part>
void merge(const StridedView& acc_out, const StridedView& acc_lse, const StridedView& part_out,
           const StridedView& part_lse) {
  // Outputs first, while both LSEs still hold their inputs.
  const StridedView acc_row_lse = lse_per_element(acc_lse, acc_out);
  const StridedView part_row_lse = lse_per_element(part_lse, acc_out);
  for_each_run<4>(make_iter<4>({&acc_out, &part_out, &acc_row_lse, &part_row_lse}),
                  [](const StridedIter<4>::Ptrs& p, int64_t n, const StridedIter<4>::Strides& s,
                     int64_t) {
                    for (int64_t k = 0; k < n; ++k) {
                      const T lp = *reinterpret_cast<const T*>(p[3] + k * s[3]);
                      if (!merges_into_acc(lp)) continue;
                      T& acc = *reinterpret_cast<T*>(p[0] + k * s[0]);
                      const T part = convert<T>(*reinterpret_cast<const Part*>(p[1] + k * s[1]));
                      const T la = *reinterpret_cast<const T*>(p[2] + k * s[2]);
                      acc = merged_value(acc, part, la, lp);
                    }
                  });
  for_each_run<2>(make_iter<2>({&acc_lse, &part_lse}),
                  [](const StridedIter<2>::Ptrs& p, int64_t n, const StridedIter<2>::Strides& s,
                     int64_t) {
                    for (int64_t k = 0; k < n; ++k) {
                      const T lp = *reinterpret_cast<const T*>(p[1] + k * s[1]);
                      T& acc = *reinterpret_cast<T*>(p[0] + k * s[0]);
                      if (merges_into_acc(lp)) acc = merged_lse(acc, lp);
                    }
                  });
}

}  // namespace

void CpuBackend::attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                                 const StridedView& part_out, const StridedView& part_lse) {
  check_attention_merge_args(acc_out, acc_lse, part_out, part_lse);
  switch (part_out.dtype) {
    case DType::kFloat64: return merge<double, double>(acc_out, acc_lse, part_out, part_lse);
    case DType::kBFloat16: return merge<float, BFloat16>(acc_out, acc_lse, part_out, part_lse);
    case DType::kFloat16: return merge<float, Float16>(acc_out, acc_lse, part_out, part_lse);
    default: return merge<float, float>(acc_out, acc_lse, part_out, part_lse);
  }
}

}  // namespace rd::kernels::cpu
