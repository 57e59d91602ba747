// Shape arithmetic shared by op implementations.
#include "ringdilated/tensor/shape_util.h"

#include <algorithm>

namespace rd {

int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op) {
  // A 0-dim tensor accepts dim 0 and -1, as in PyTorch.
  int64_t extent = std::max<int64_t>(ndim, 1);
  RD_CHECK(dim >= -extent && dim < extent, kOutOfRange, op, ": dim ", dim,
           " is out of range for a tensor of ", ndim, " dims");
  return dim < 0 ? dim + extent : dim;
}

std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t ndim,
                                    const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) out.push_back(normalize_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  RD_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), kInvalidArgument, op,
           ": dims ", shape_str(dims), " name a dim more than once");
  if (ndim == 0) out.clear();  // dim 0 of a scalar reduces nothing
  return out;
}

int64_t shape_numel(const Shape& shape, const char* op) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t s : shape) {
    RD_CHECK(!__builtin_mul_overflow(n, s, &n), kInvalidArgument, op, ": shape ",
             shape_str(shape), " has more than 2^63 - 1 elements");
  }
  return n;
}

void check_new_shape(const Shape& shape, const char* op) {
  int64_t extent = 1;
  for (int64_t s : shape) {
    RD_CHECK(s >= 0, kInvalidArgument, op, ": sizes must be non-negative, got ", shape_str(shape));
    RD_CHECK(!__builtin_mul_overflow(extent, std::max<int64_t>(s, 1), &extent), kInvalidArgument,
             op, ": shape ", shape_str(shape), " is too large: its sizes multiply past 2^63 - 1");
  }
}

int64_t last_element_offset(const Shape& shape, const Shape& strides, const char* op) {
  if (shape_numel(shape, op) == 0) return -1;
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t step = 0;
    RD_CHECK(!__builtin_mul_overflow(shape[i] - 1, strides[i], &step) &&
                 !__builtin_add_overflow(last, step, &last),
             kInvalidArgument, op, ": shape ", shape_str(shape), " with strides ",
             shape_str(strides), " reaches past element 2^63 - 1");
  }
  return last;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

bool broadcast_compatible(const Shape& a, const Shape& b) {
  for (size_t i = 1; i <= std::min(a.size(), b.size()); ++i) {
    int64_t da = a[a.size() - i], db = b[b.size() - i];
    if (da != db && da != 1 && db != 1) return false;
  }
  return true;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t ndim = std::max(a.size(), b.size());
  Shape out(ndim);
  for (size_t i = 0; i < ndim; ++i) {
    int64_t da = i < ndim - a.size() ? 1 : a[i - (ndim - a.size())];
    int64_t db = i < ndim - b.size() ? 1 : b[i - (ndim - b.size())];
    RD_CHECK(da == db || da == 1 || db == 1, kShapeMismatch, op, ": shapes ", shape_str(a),
             " and ", shape_str(b), " cannot be broadcast together (dim ", i, ": ", da,
             " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

void check_same_device(std::initializer_list<const Tensor*> tensors, const char* op) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (first == nullptr) {
      first = t;
      continue;
    }
    RD_CHECK(t->device() == first->device(), kDeviceMismatch, op,
             ": tensors are on different devices (", first->device().str(), " and ",
             t->device().str(), ")");
  }
}

void check_floating(const Tensor& t, const char* op, const char* argument) {
  RD_CHECK(is_floating(t.dtype()), kDTypeMismatch, op, ": argument '", argument,
           "' must have a floating dtype, got ", dtype_name(t.dtype()));
}

}  // namespace rd
