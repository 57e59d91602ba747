// Helpers shared by the nn and index op implementations (ops_nn.cc, ops_index.cc): index
// tensor validation and raw pointers of contiguous buffers. Internal, not for users. Dim
// normalization and device/dtype checks live in shape_util.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::op_util {

// Checks that `index` holds integers and returns it, detached, as int64 (what kernels take).
inline Tensor int64_index(const Tensor& index, std::string_view op, std::string_view arg) {
  RD_CHECK(index.defined(), kInvalidArgument, op, ": argument '", arg, "' is undefined");
  RD_CHECK(is_integral(index.dtype()), kDTypeMismatch, op, ": argument '", arg,
           "' must be int32 or int64, got ", dtype_name(index.dtype()));
  return index.detach().to(DType::kInt64);
}

// Checks every value of the int64 tensor `index` lies in [0, bound), except values equal to
// `ignore`. `bound_desc` says what bounds it, e.g. "num_embeddings". Only CPU values are
// checked here, synchronously. Device values are not read back (that would cost a host
// synchronization per call): the device kernels check them as they run, never reading or
// writing out of bounds, and record the first bad one as an asynchronous error that the
// next synchronization raises (see check_async_errors in tensor/device.h).
inline void check_index_bounds(const Tensor& index, int64_t bound, std::string_view op,
                               std::string_view arg, std::string_view bound_desc,
                               std::optional<int64_t> ignore = std::nullopt) {
  if (index.numel() == 0 || !index.device().is_cpu()) return;
  for (int64_t v : index.to_vector<int64_t>()) {
    if (ignore.has_value() && v == *ignore) continue;
    RD_CHECK(v >= 0 && v < bound, kOutOfRange, op, ": argument '", arg, "' holds index ", v,
             ", out of range for ", bound_desc, " = ", bound, " (valid: [0, ", bound, "))");
  }
}

// The device pointer of a contiguous buffer, for the fused row-wise kernels that take raw
// pointers rather than StridedViews.
inline void* contiguous_data(const Tensor& t, std::string_view op) {
  RD_CHECK(t.is_contiguous(), kInternal, op, ": expected a contiguous buffer, got ", t.str());
  return t.raw_data();
}

// Options for a new tensor on t's device, with t's dtype or the given one.
inline TensorOptions options_like(const Tensor& t, DType dtype) {
  return TensorOptions(dtype).with_device(t.device());
}
inline TensorOptions options_like(const Tensor& t) { return options_like(t, t.dtype()); }

}  // namespace rd::op_util
