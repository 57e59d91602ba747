// Shape arithmetic shared by op implementations: dim normalization, contiguous strides,
// broadcasting. Internal to the tensor layer.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {

// Maps a possibly negative dim into [0, ndim); throws kOutOfRange naming `op`.
int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op);

// Normalizes, sorts and de-duplicates dims; empty means "all dims". Throws on repeats.
std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t ndim,
                                    const char* op);

// The number of elements of a shape of non-negative sizes (0 when a size is 0).
// kInvalidArgument naming `op` and the shape when it passes int64 (2^63 - 1), instead of
// wrapping around.
int64_t shape_numel(const Shape& shape, const char* op = "numel");

// Throws kInvalidArgument naming `op` and the shape unless every size is >= 0 and the sizes
// multiply within int64 (a zero size counting as 1, since the contiguous strides of an empty
// tensor multiply the other sizes too): what the shape of a new tensor must satisfy. Then
// shape_numel and contiguous_strides of it cannot overflow.
void check_new_shape(const Shape& shape, const char* op);

// The offset, in elements from element [0, ...], of the last element of a view of `shape`
// with non-negative `strides`, or -1 for an empty view. kInvalidArgument naming `op`, the
// shape and the strides when it passes int64.
int64_t last_element_offset(const Shape& shape, const Shape& strides, const char* op);

Shape contiguous_strides(const Shape& shape);

// Whether two shapes broadcast together (NumPy rules).
bool broadcast_compatible(const Shape& a, const Shape& b);

// The broadcast of two shapes (NumPy rules); throws kShapeMismatch naming `op`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// Throws kDeviceMismatch unless every defined tensor lives on the device of the first.
void check_same_device(std::initializer_list<const Tensor*> tensors, const char* op);

// Throws kDTypeMismatch unless t has a floating dtype.
void check_floating(const Tensor& t, const char* op, const char* argument);

}  // namespace rd
