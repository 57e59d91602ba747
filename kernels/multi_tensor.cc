// Argument checks and the chunk count of the multi-tensor ops, shared by every backend.
#include "ringdilated/kernels/multi_tensor.h"

#include <cmath>

#include "ringdilated/kernels/error.h"

namespace rd::kernels {
namespace {

void check_numel(const char* op, size_t index, int64_t numel) {
  RD_CHECK(numel >= 0, kInvalidArgument, op, ": argument 'tensors[", index,
           "].numel' must be >= 0, got ", numel);
}

void check_floating_dtype(const char* op, const char* arg, DType dtype) {
  RD_CHECK(is_floating(dtype), kDTypeMismatch, op, ": argument '", arg,
           "' must be a floating dtype, got ", dtype_name(dtype));
}

}  // namespace

int64_t multi_tensor_chunks(std::span<const MultiTensorInput> tensors) {
  int64_t chunks = 0;
  for (const MultiTensorInput& t : tensors) chunks += multi_tensor_chunks(t.numel);
  return chunks;
}

void check_multi_tensor_scale_args(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                                   DType dst_dtype, double scale) {
  constexpr const char* kOp = "multi_tensor_scale";
  check_floating_dtype(kOp, "src_dtype", src_dtype);
  check_floating_dtype(kOp, "dst_dtype", dst_dtype);
  RD_CHECK(std::isfinite(scale), kInvalidArgument, kOp, ": argument 'scale' must be finite, got ",
           scale);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const MultiTensorCopy& t = tensors[i];
    check_numel(kOp, i, t.numel);
    RD_CHECK(t.numel == 0 || (t.src != nullptr && t.dst != nullptr), kInvalidArgument, kOp,
             ": tensors[", i, "] has ", t.numel, " elements but a null ",
             t.src == nullptr ? "src" : "dst", " pointer");
    RD_CHECK(t.numel == 0 || t.src != t.dst || src_dtype == dst_dtype, kInvalidArgument, kOp,
             ": tensors[", i, "] is scaled in place (src == dst), which needs one dtype, got ",
             dtype_name(src_dtype), " -> ", dtype_name(dst_dtype));
  }
}

void check_multi_tensor_sum_squares_args(std::span<const MultiTensorInput> tensors, DType dtype,
                                         const double* partials) {
  constexpr const char* kOp = "multi_tensor_sum_squares";
  check_floating_dtype(kOp, "dtype", dtype);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_numel(kOp, i, tensors[i].numel);
    RD_CHECK(tensors[i].numel == 0 || tensors[i].data != nullptr, kInvalidArgument, kOp,
             ": tensors[", i, "] has ", tensors[i].numel, " elements but a null data pointer");
  }
  RD_CHECK(partials != nullptr || multi_tensor_chunks(tensors) == 0, kInvalidArgument, kOp,
           ": argument 'partials' is null");
}

}  // namespace rd::kernels
