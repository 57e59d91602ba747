// Argument checks on StridedViews shared by every backend, so that a bad call fails with the
// same message whichever device runs it: memory overlap, shape and dtype agreement, and the
// per-op checks of reductions and index ops.
#pragma once

#include <cstdint>
#include <string>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/strided.h"

namespace rd::kernels {

// True when the elements of `v` occupy distinct memory. Conservative: false may be a false
// alarm (the check sorts dims by stride and requires each stride to clear the reach of the
// smaller ones), true is certain. Size-1 dims are ignored.
bool has_distinct_elements(const StridedView& v);

// "[2, 3]": the shape of a view, for messages.
std::string shape_of(const StridedView& v);

// Throws kDTypeMismatch unless v (argument `arg` of `op`) has dtype `expected`.
void check_dtype(const char* op, const char* arg, const StridedView& v, DType expected);

// The dtypes KernelBackend::accumulate takes: in has out's dtype, or out is float32 and in a
// 16-bit float (read widened). Throws kDTypeMismatch naming `op` otherwise.
void check_accumulate_dtypes(const char* op, const StridedView& out, const StridedView& in);

// Throws kShapeMismatch unless a and b have the same shape.
void check_same_shape(const char* op, const char* name_a, const StridedView& a,
                      const char* name_b, const StridedView& b);

// Throws kOutOfRange unless 0 <= dim < v.ndim.
void check_dim(const char* op, int dim, const StridedView& v);

// The checks of KernelBackend::reduce: dims_mask within ndim, out shaped like in with the
// reduced dims of size 1, arg reductions over one dim into int64, no max/min/arg over an
// empty dim, mean/logsumexp on floating dtypes only.
void check_reduce_args(ReduceOp op, const StridedView& out, const StridedView& in,
                       uint32_t dims_mask);

// The checks of KernelBackend::random: finite a <= b (uniform), finite mean and stddev >= 0
// (normal), probability in [0, 1] (Bernoulli); uniform and normal need a floating out.
void check_random_args(const StridedView& out, Distribution dist, double a, double b);

// The checks of KernelBackend::where (cond bool, a/b/out one dtype, one shape) and cumsum.
void check_where_args(const StridedView& out, const StridedView& cond, const StridedView& a,
                      const StridedView& b);
void check_cumsum_args(const StridedView& out, const StridedView& in, int dim);

// A stored (untransposed) GEMM operand: rows x cols with row stride ld.
struct StoredMatrix {
  int64_t rows = 0, cols = 0, ld = 0;
};
// Validates leading dim `name` (lda/ldb) of a stored operand. With a single row (or no
// columns) the row stride is never used, so any value is accepted and replaced by one
// every BLAS takes.
StoredMatrix gemm_stored_matrix(const char* name, int64_t rows, int64_t cols, int64_t ld);

// The shape and dtype checks of the index ops of KernelBackend (index values are checked
// separately, on the device that holds them).
void check_index_select_args(const StridedView& out, const StridedView& in, int dim,
                             const StridedView& index);
void check_gather_args(const StridedView& out, const StridedView& in, int dim,
                       const StridedView& index);
void check_index_add_args(const StridedView& out, int dim, const StridedView& index,
                          const StridedView& src);
void check_scatter_args(const StridedView& out, int dim, const StridedView& index,
                        const StridedView& src);

}  // namespace rd::kernels
