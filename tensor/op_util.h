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
// `ignore`. `bound_desc` says what bounds it, e.g. "num_embeddings". CPU values are read
// directly. Device values are checked with two reductions (min and max) whose results come
// back to the host, costing one synchronization; only when they fail are the values copied
// to find the first offending one for the message. Ops whose device kernels check indices
// themselves (the index kernels do) pass check_device = false to skip that cost.
inline void check_index_bounds(const Tensor& index, int64_t bound, std::string_view op,
                               std::string_view arg, std::string_view bound_desc,
                               std::optional<int64_t> ignore = std::nullopt,
                               bool check_device = false) {
  if (index.numel() == 0) return;
  if (!index.device().is_cpu()) {
    if (!check_device) return;
    const Tensor considered =
        ignore.has_value() ? where(ne(index, static_cast<double>(*ignore)), index, 0.0) : index;
    const Tensor extremes = stack({min(considered), max(considered)}).to(Device::cpu());
    const std::vector<int64_t> lo_hi = extremes.to_vector<int64_t>();
    if (lo_hi[0] >= 0 && lo_hi[1] < bound) return;
    check_index_bounds(index.to(Device::cpu()), bound, op, arg, bound_desc, ignore);
    return;
  }
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
