// Argument checks on StridedViews shared by every backend (see view_checks.h).
#include "ringdilated/kernels/view_checks.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <span>
#include <utility>
#include <vector>

#include "ringdilated/kernels/adamw_update.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels {

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

std::string shape_of(const StridedView& v) {
  return shape_str(std::span<const int64_t>(v.shape.data(), v.ndim));
}

void check_dtype(const char* op, const char* arg, const StridedView& v, DType expected) {
  RD_CHECK(v.dtype == expected, kDTypeMismatch, op, ": argument '", arg, "' has dtype ",
           dtype_name(v.dtype), ", expected ", dtype_name(expected));
}

void check_accumulate_dtypes(const char* op, const StridedView& out, const StridedView& in) {
  RD_CHECK(accumulate_takes(out.dtype, in.dtype), kDTypeMismatch, op, ": argument 'in' has dtype ",
           dtype_name(in.dtype), " but 'out' has ", dtype_name(out.dtype),
           " (in must be out's dtype, or bfloat16/float16 into float32)");
}

void check_same_shape(const char* op, const char* name_a, const StridedView& a, const char* name_b,
                      const StridedView& b) {
  bool same = a.ndim == b.ndim;
  for (int d = 0; same && d < a.ndim; ++d) same = a.shape[d] == b.shape[d];
  RD_CHECK(same, kShapeMismatch, op, ": argument '", name_b, "' has shape ", shape_of(b), " but '",
           name_a, "' has shape ", shape_of(a));
}

void check_dim(const char* op, int dim, const StridedView& v) {
  RD_CHECK(dim >= 0 && dim < v.ndim, kOutOfRange, op, ": argument 'dim' is ", dim,
           " but the tensor has ", v.ndim, " dims");
}

void check_reduce_args(ReduceOp op, const StridedView& out, const StridedView& in,
                       uint32_t dims_mask) {
  const char* name = op_name(op);
  RD_CHECK(in.ndim < 32 && (dims_mask >> in.ndim) == 0, kOutOfRange, "reduce ", name,
           ": dims_mask ", dims_mask, " names dims beyond ndim ", in.ndim);
  bool shapes_ok = out.ndim == in.ndim;
  for (int d = 0; shapes_ok && d < in.ndim; ++d) {
    shapes_ok = out.shape[d] == (((dims_mask >> d) & 1u) ? 1 : in.shape[d]);
  }
  RD_CHECK(shapes_ok, kShapeMismatch, "reduce ", name, ": argument 'out' has shape ", shape_of(out),
           ", expected input shape ", shape_of(in), " with reduced dims (mask ", dims_mask,
           ") of size 1");
  const bool arg = op == ReduceOp::kArgMax || op == ReduceOp::kArgMin;
  if (arg) {
    RD_CHECK(std::popcount(dims_mask) == 1, kInvalidArgument, "reduce ", name,
             ": needs exactly one reduced dim, got dims_mask ", dims_mask);
    RD_CHECK(out.dtype == DType::kInt64, kDTypeMismatch, "reduce ", name,
             ": argument 'out' must be int64, got ", dtype_name(out.dtype));
  }
  if (arg || op == ReduceOp::kMax || op == ReduceOp::kMin) {
    for (int d = 0; d < in.ndim; ++d) {
      RD_CHECK(!((dims_mask >> d) & 1u) || in.shape[d] > 0, kInvalidArgument, "reduce ", name,
               ": cannot reduce over dim ", d, " of size 0 (input shape ", shape_of(in), ")");
    }
  }
  if (op == ReduceOp::kMean || op == ReduceOp::kLogSumExp) {
    RD_CHECK(is_floating(in.dtype), kDTypeMismatch, "reduce: op ", name, " does not support dtype ",
             dtype_name(in.dtype));
  }
}

void check_random_args(const StridedView& out, Distribution dist, double a, double b) {
  switch (dist) {
    case Distribution::kUniform:
      RD_CHECK(std::isfinite(a) && std::isfinite(b) && a <= b, kInvalidArgument,
               "random uniform: needs finite a <= b, got a=", a, " b=", b);
      break;
    case Distribution::kNormal:
      RD_CHECK(std::isfinite(a) && std::isfinite(b) && b >= 0, kInvalidArgument,
               "random normal: needs a finite mean and stddev >= 0, got mean=", a, " stddev=", b);
      break;
    case Distribution::kBernoulli:
      RD_CHECK(a >= 0 && a <= 1, kInvalidArgument,
               "random bernoulli: probability must be in [0, 1], got ", a);
      break;
  }
  if (dist != Distribution::kBernoulli) {
    RD_CHECK(is_floating(out.dtype), kDTypeMismatch,
             "random: uniform and normal fills need a floating dtype, got ", dtype_name(out.dtype));
  }
}

void check_where_args(const StridedView& out, const StridedView& cond, const StridedView& a,
                      const StridedView& b) {
  check_same_shape("where", "out", out, "cond", cond);
  check_same_shape("where", "out", out, "a", a);
  check_same_shape("where", "out", out, "b", b);
  check_dtype("where", "cond", cond, DType::kBool);
  check_dtype("where", "a", a, out.dtype);
  check_dtype("where", "b", b, out.dtype);
}

void check_cumsum_args(const StridedView& out, const StridedView& in, int dim) {
  check_same_shape("cumsum", "out", out, "in", in);
  RD_CHECK(dim >= 0 && dim < in.ndim, kOutOfRange, "cumsum: argument 'dim' is ", dim,
           " but the input has ", in.ndim, " dims");
  RD_CHECK(out.dtype == in.dtype, kDTypeMismatch, "cumsum: argument 'out' has dtype ",
           dtype_name(out.dtype), " but 'in' has ", dtype_name(in.dtype));
  RD_CHECK(in.dtype != DType::kBool, kDTypeMismatch, "cumsum: does not support dtype bool");
}

StoredMatrix gemm_stored_matrix(const char* name, int64_t rows, int64_t cols, int64_t ld) {
  StoredMatrix s{rows, cols, ld};
  if (rows <= 1 || cols == 0) {
    s.ld = std::max<int64_t>(cols, 1);
    return s;
  }
  RD_CHECK(ld >= std::max<int64_t>(cols, 1), kInvalidArgument, "gemm: argument '", name, "' is ",
           ld, " but the stored ", rows, "x", cols, " matrix needs at least ",
           std::max<int64_t>(cols, 1));
  return s;
}

void check_adamw_args(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step) {
  RD_CHECK(is_floating(dtype), kDTypeMismatch,
           "adamw: argument 'dtype' must be a floating dtype, got ", dtype_name(dtype));
  RD_CHECK(step.step >= 1, kInvalidArgument, "adamw: argument 'step' must be >= 1 (1-based), got ",
           step.step);
  RD_CHECK(std::isfinite(step.lr) && step.lr >= 0, kInvalidArgument,
           "adamw: argument 'lr' must be finite and >= 0, got ", step.lr);
  RD_CHECK(std::isfinite(step.eps) && step.eps >= 0, kInvalidArgument,
           "adamw: argument 'eps' must be finite and >= 0, got ", step.eps);
  RD_CHECK(std::isfinite(step.weight_decay) && step.weight_decay >= 0, kInvalidArgument,
           "adamw: argument 'weight_decay' must be finite and >= 0, got ", step.weight_decay);
  // Written as !(0 <= b < 1) so that NaN fails too.
  RD_CHECK(step.beta1 >= 0 && step.beta1 < 1, kInvalidArgument,
           "adamw: argument 'beta1' must be in [0, 1), got ", step.beta1);
  RD_CHECK(step.beta2 >= 0 && step.beta2 < 1, kInvalidArgument,
           "adamw: argument 'beta2' must be in [0, 1), got ", step.beta2);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    RD_CHECK(t.numel >= 0, kInvalidArgument, "adamw: argument 'tensors[", i,
             "].numel' must be >= 0, got ", t.numel);
    if (t.numel == 0) continue;
    const char* null_pointer = t.param == nullptr        ? "param"
                               : t.grad == nullptr       ? "grad"
                               : t.exp_avg == nullptr    ? "exp_avg"
                               : t.exp_avg_sq == nullptr ? "exp_avg_sq"
                                                         : nullptr;
    RD_CHECK(null_pointer == nullptr, kInvalidArgument, "adamw: argument 'tensors[", i, "].",
             null_pointer, "' is null but numel is ", t.numel);
  }
}

namespace {

// index_select and index_add copy whole slices along `dim` between `sliced` (one slice per
// entry of the 1-D `index`) and `whole`: `dim` must be one of whole's, the dtypes must match,
// and sliced must have whole's shape except along `dim`, where it has one per index.
void check_slices_by_index(const char* op, const char* sliced_name, const StridedView& sliced,
                           const char* whole_name, const StridedView& whole, int dim,
                           const StridedView& index) {
  check_dim(op, dim, whole);
  check_dtype(op, sliced_name, sliced, whole.dtype);
  RD_CHECK(index.ndim == 1, kShapeMismatch, op, ": argument 'index' must be 1-D, got shape ",
           shape_of(index));
  const int64_t count = index.shape[0];
  bool ok = sliced.ndim == whole.ndim;
  for (int d = 0; ok && d < whole.ndim; ++d) {
    ok = sliced.shape[d] == (d == dim ? count : whole.shape[d]);
  }
  RD_CHECK(ok, kShapeMismatch, op, ": argument '", sliced_name, "' has shape ", shape_of(sliced),
           " but '", whole_name, "' ", shape_of(whole), " with ", count, " indices along dim ", dim,
           " needs the same shape with size ", count, " in dim ", dim);
}

}  // namespace

void check_index_select_args(const StridedView& out, const StridedView& in, int dim,
                             const StridedView& index) {
  check_slices_by_index("index_select", "out", out, "in", in, dim, index);
}

void check_gather_args(const StridedView& out, const StridedView& in, int dim,
                       const StridedView& index) {
  constexpr const char* kOp = "gather";
  check_dim(kOp, dim, in);
  check_dtype(kOp, "out", out, in.dtype);
  check_same_shape(kOp, "out", out, "index", index);
  bool shapes_ok = in.ndim == out.ndim;
  for (int d = 0; shapes_ok && d < in.ndim; ++d) {
    shapes_ok = d == dim || index.shape[d] <= in.shape[d];
  }
  RD_CHECK(shapes_ok, kShapeMismatch, kOp, ": argument 'index' has shape ", shape_of(index),
           ", larger than 'in' ", shape_of(in), " outside dim ", dim);
}

void check_index_add_args(const StridedView& out, int dim, const StridedView& index,
                          const StridedView& src) {
  check_slices_by_index("index_add", "src", src, "out", out, dim, index);
}

void check_scatter_args(const StridedView& out, int dim, const StridedView& index,
                        const StridedView& src) {
  constexpr const char* kOp = "scatter";
  check_dim(kOp, dim, out);
  check_dtype(kOp, "src", src, out.dtype);
  bool shapes_ok = index.ndim == out.ndim && src.ndim == out.ndim;
  for (int d = 0; shapes_ok && d < out.ndim; ++d) {
    shapes_ok = src.shape[d] >= index.shape[d] && (d == dim || index.shape[d] <= out.shape[d]);
  }
  RD_CHECK(shapes_ok, kShapeMismatch, kOp, ": argument 'index' has shape ", shape_of(index),
           ", which must fit in 'src' ", shape_of(src), " and, outside dim ", dim, ", in 'out' ",
           shape_of(out));
}

}  // namespace rd::kernels
