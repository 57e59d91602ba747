// StridedView: a raw pointer plus dtype, shape and element strides; what every kernel takes.
#pragma once

#include <array>
#include <cstdint>

#include "ringdilated/kernels/dtype.h"

namespace rd::kernels {

// The most dims a tensor may have. Fixed so that views stay trivially copyable and can be
// passed by value to CUDA kernels.
inline constexpr int kMaxDims = 8;

struct StridedView {
  void* data = nullptr;  // points at element [0, ..., 0] (offset already applied)
  DType dtype = DType::kFloat32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements; 0 for broadcast dims

  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expected) return false;
      expected *= shape[d];
    }
    return true;
  }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// v with `dim` running backwards: its element i along dim is v's element shape[dim] - 1 - i
// (a reverse scan is a forward scan of such views). v must not be empty.
inline StridedView flipped(StridedView v, int dim) {
  v.data = static_cast<char*>(v.data) +
           (v.shape[dim] - 1) * v.strides[dim] * static_cast<int64_t>(dtype_size(v.dtype));
  v.strides[dim] = -v.strides[dim];
  return v;
}

}  // namespace rd::kernels
