// The multi-tensor ops' shared rules (KernelBackend::multi_tensor_scale and
// multi_tensor_sum_squares): the chunk size, the chunk count and the argument checks.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>

#include "ringdilated/kernels/backend.h"

namespace rd::kernels {

// Elements per chunk: the unit of parallel work, and of the sum of squares' partials.
inline constexpr int64_t kMultiTensorChunk = 65536;

// The chunks of one tensor, and of a list (the length multi_tensor_sum_squares's partials
// must have).
inline int64_t multi_tensor_chunks(int64_t numel) {
  return (numel + kMultiTensorChunk - 1) / kMultiTensorChunk;
}
int64_t multi_tensor_chunks(std::span<const MultiTensorInput> tensors);

// multi_tensor_scale computes in float64 when either dtype is float64, else in float32.
template <class Src, class Dst>
using ScaleCompute = std::conditional_t<std::is_same_v<Src, double> || std::is_same_v<Dst, double>,
                                        double, float>;

// Throw rd::Error naming the op, the argument and the tensor's index for a call that breaks
// the contract in backend.h.
void check_multi_tensor_scale_args(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                                   DType dst_dtype, double scale);
void check_multi_tensor_sum_squares_args(std::span<const MultiTensorInput> tensors, DType dtype,
                                         const double* partials);

}  // namespace rd::kernels
