// CPU multi-tensor ops (KernelBackend::multi_tensor_scale / multi_tensor_sum_squares): the
// list's tensors cut into kMultiTensorChunk-element chunks that run in parallel.
#include <cstdint>
#include <span>
#include <vector>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/multi_tensor.h"

namespace rd::kernels::cpu {

void CpuBackend::multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                                    DType dst_dtype, double scale, const float* device_scale) {
  constexpr const char* kOp = "multi_tensor_scale";
  check_multi_tensor_scale_args(tensors, src_dtype, dst_dtype, scale);
  const std::vector<TensorChunk> chunks = tensor_chunks(tensors, kMultiTensorChunk);
  dispatch_floating(src_dtype, kOp, [&](auto src_tag) {
    dispatch_floating(dst_dtype, kOp, [&](auto dst_tag) {
      using S = typename decltype(src_tag)::type;
      using D = typename decltype(dst_tag)::type;
      using A = ScaleCompute<S, D>;
      const A factor = static_cast<A>(scale) *
                       (device_scale != nullptr ? static_cast<A>(*device_scale) : A(1));
      parallel_items(static_cast<int64_t>(chunks.size()), kMultiTensorChunk, [&](int64_t k) {
        const TensorChunk& c = chunks[static_cast<size_t>(k)];
        const auto* src = static_cast<const S*>(tensors[c.tensor].src);
        auto* dst = static_cast<D*>(tensors[c.tensor].dst);
        for (int64_t i = c.begin; i < c.end; ++i) {
          dst[i] = convert<D>(static_cast<A>(convert<A>(src[i]) * factor));
        }
      });
    });
  });
}

void CpuBackend::multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                                          double* partials) {
  constexpr const char* kOp = "multi_tensor_sum_squares";
  check_multi_tensor_sum_squares_args(tensors, dtype, partials);
  const std::vector<TensorChunk> chunks = tensor_chunks(tensors, kMultiTensorChunk);
  dispatch_floating(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Accum<T>;
    parallel_items(static_cast<int64_t>(chunks.size()), kMultiTensorChunk, [&](int64_t k) {
      const TensorChunk& c = chunks[static_cast<size_t>(k)];
      const auto* data = static_cast<const T*>(tensors[c.tensor].data);
      A total = 0;
      for (int64_t i = c.begin; i < c.end; ++i) {
        const A v = convert<A>(data[i]);
        total += v * v;
      }
      partials[k] = static_cast<double>(total);
    });
  });
}

}  // namespace rd::kernels::cpu
