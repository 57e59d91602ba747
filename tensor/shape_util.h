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

int64_t shape_numel(const Shape& shape);
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
