// Overlap, shape and dtype checks on StridedViews (see view_checks.h).
#include "ringdilated/kernels/cpu/view_checks.h"

#include <algorithm>
#include <cstdlib>
#include <span>
#include <utility>
#include <vector>

#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {

bool has_distinct_elements(const StridedView& v) {
  if (v.numel() == 0) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dims with size > 1
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] > 1) dims.emplace_back(std::llabs(v.strides[d]), v.shape[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // largest offset reachable by the dims seen so far
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

void check_dtype(const char* op, const char* arg, const StridedView& v, DType expected) {
  RD_CHECK(v.dtype == expected, kDTypeMismatch, op, ": argument '", arg, "' has dtype ",
           dtype_name(v.dtype), ", expected ", dtype_name(expected));
}

void check_same_shape(const char* op, const char* name_a, const StridedView& a,
                      const char* name_b, const StridedView& b) {
  bool same = a.ndim == b.ndim;
  for (int d = 0; same && d < a.ndim; ++d) same = a.shape[d] == b.shape[d];
  RD_CHECK(same, kShapeMismatch, op, ": argument '", name_b, "' has shape ",
           shape_str(std::span<const int64_t>(b.shape.data(), b.ndim)), " but '", name_a,
           "' has shape ", shape_str(std::span<const int64_t>(a.shape.data(), a.ndim)));
}

}  // namespace rd::kernels::cpu
