// CPU AdamW over a list of tensors (KernelBackend::adamw). Every tensor is cut into
// kGrain-element chunks, and the chunks of the whole list run in parallel; each element goes
// through adamw_element (kernels/adamw_update.h), as on CUDA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "ringdilated/kernels/adamw_update.h"
#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {

namespace {

// Updates elements [begin, end) of one tensor.
template <class T>
void adamw_range(const AdamWTensor& t, int64_t begin, int64_t end,
                 const AdamWCoefficients<Compute<T>>& c) {
  using A = Compute<T>;
  T* param = static_cast<T*>(t.param);
  const T* grad = static_cast<const T*>(t.grad);
  A* exp_avg = static_cast<A*>(t.exp_avg);
  A* exp_avg_sq = static_cast<A*>(t.exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    A p = convert<A>(param[i]);
    adamw_element(p, convert<A>(grad[i]), exp_avg[i], exp_avg_sq[i], c);
    param[i] = convert<T>(p);
  }
}

}  // namespace

void CpuBackend::adamw(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step) {
  check_adamw_args(tensors, dtype, step);
  const std::vector<TensorChunk> chunks = tensor_chunks(tensors, kGrain);
  dispatch_floating(dtype, "adamw", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const AdamWCoefficients<Compute<T>> coefficients(AdamWConstants::from(step));
    parallel_items(static_cast<int64_t>(chunks.size()), kGrain, [&](int64_t k) {
      const TensorChunk& chunk = chunks[static_cast<size_t>(k)];
      adamw_range<T>(tensors[chunk.tensor], chunk.begin, chunk.end, coefficients);
    });
  });
}

}  // namespace rd::kernels::cpu
