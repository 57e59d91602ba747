// Checks on StridedViews shared by the CPU kernels (and tested directly): memory overlap,
// shape and dtype agreement.
#pragma once

#include "ringdilated/kernels/strided.h"

namespace rd::kernels::cpu {

// True when the elements of `v` occupy distinct memory. Conservative: false may be a false
// alarm (the check sorts dims by stride and requires each stride to clear the reach of the
// smaller ones), true is certain. Size-1 dims are ignored.
bool has_distinct_elements(const StridedView& v);

// Throws kDTypeMismatch unless v (argument `arg` of `op`) has dtype `expected`.
void check_dtype(const char* op, const char* arg, const StridedView& v, DType expected);

// Throws kShapeMismatch unless a and b have the same shape.
void check_same_shape(const char* op, const char* name_a, const StridedView& a,
                      const char* name_b, const StridedView& b);

}  // namespace rd::kernels::cpu
