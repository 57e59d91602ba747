// Reductions over sets of dims (sum, mean, max, min, logsumexp, var, argmax, argmin).
#include <cmath>

#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd {

using kernels::ReduceOp;

namespace {

struct ReducePlan {
  std::vector<int64_t> dims;  // normalized, sorted
  Shape keep_shape;           // input shape with reduced dims set to 1
  Shape out_shape;            // keep_shape, or with reduced dims removed
  uint32_t mask = 0;
  int64_t count = 1;          // elements folded into each output
};

ReducePlan plan_reduction(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                          const char* op) {
  ReducePlan plan;
  plan.dims = normalize_dims(dims, x.dim(), op);
  plan.keep_shape = x.shape();
  for (int64_t d : plan.dims) {
    plan.count *= x.shape()[d];
    plan.keep_shape[d] = 1;
    plan.mask |= 1u << d;
  }
  for (size_t d = 0; d < x.shape().size(); ++d) {
    bool reduced = (plan.mask >> d) & 1u;
    if (keepdim || !reduced) plan.out_shape.push_back(plan.keep_shape[d]);
  }
  return plan;
}

// Runs the kernel into a keepdim-shaped tensor of `out_dtype`.
Tensor reduce_kernel(ReduceOp op, const Tensor& x, const ReducePlan& plan, DType out_dtype,
                     const char* name) {
  Tensor out = empty(plan.keep_shape, TensorOptions(out_dtype).with_device(x.device()));
  backend_for(x.device()).reduce(op, kernel_view(out, name), kernel_view(x, name), plan.mask);
  return out;
}

// Shapes a keepdim result as the caller asked and records `backward` on it. `backward`
// gets the output gradient in keepdim shape.
template <class BackwardFn>
Tensor finish(const Tensor& keep, const Tensor& x, const ReducePlan& plan, const char* name,
              BackwardFn backward) {
  Tensor out = keep.detach().view(plan.out_shape);
  if (autograd::needs_grad({&x})) {
    Shape keep_shape = plan.keep_shape;
    autograd::record(out, name, {x}, [=](const Tensor& g) -> std::vector<Tensor> {
      return {backward(g.reshape(keep_shape))};
    });
  }
  return out;
}

void check_nonempty(const Tensor& x, const ReducePlan& plan, const char* op) {
  RD_CHECK(plan.count > 0 || x.numel() == 0, kInvalidArgument, op,
           ": cannot reduce over an empty dim (shape ", shape_str(x.shape()), ")");
  RD_CHECK(plan.count > 0, kInvalidArgument, op, ": cannot reduce over an empty dim (shape ",
           shape_str(x.shape()), ")");
}

}  // namespace

Tensor sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  ReducePlan plan = plan_reduction(x, dims, keepdim, "sum");
  // Integer and bool sums widen to int64, as in PyTorch.
  Tensor input = is_floating(x.dtype()) ? x : x.to(DType::kInt64);
  Tensor keep = reduce_kernel(ReduceOp::kSum, input, plan, input.dtype(), "sum");
  Shape in_shape = x.shape();
  return finish(keep, x, plan, "sum", [in_shape](const Tensor& g) { return g.expand(in_shape); });
}

Tensor mean(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  check_floating(x, "mean", "x");
  ReducePlan plan = plan_reduction(x, dims, keepdim, "mean");
  Tensor keep = reduce_kernel(ReduceOp::kMean, x, plan, x.dtype(), "mean");
  Shape in_shape = x.shape();
  double count = static_cast<double>(plan.count);
  return finish(keep, x, plan, "mean",
                [in_shape, count](const Tensor& g) { return div(g, count).expand(in_shape); });
}

namespace {
// max/min: the gradient is shared evenly among the elements equal to the extremum.
Tensor extremum_reduce(ReduceOp op, const Tensor& x, std::vector<int64_t> dims, bool keepdim,
                       const char* name) {
  ReducePlan plan = plan_reduction(x, dims, keepdim, name);
  check_nonempty(x, plan, name);
  Tensor keep = reduce_kernel(op, x, plan, x.dtype(), name);
  Tensor sx = x.detach(), sk = keep.detach();
  std::vector<int64_t> reduced = plan.dims;
  return finish(keep, x, plan, name, [sx, sk, reduced](const Tensor& g) {
    Tensor hits = eq(sx, sk).to(g.dtype());
    Tensor count = sum(hits, reduced, /*keepdim=*/true);
    return mul(hits, div(g, count));
  });
}
}  // namespace

Tensor max(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  return extremum_reduce(ReduceOp::kMax, x, std::move(dims), keepdim, "max");
}

Tensor min(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  return extremum_reduce(ReduceOp::kMin, x, std::move(dims), keepdim, "min");
}

Tensor logsumexp(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  check_floating(x, "logsumexp", "x");
  ReducePlan plan = plan_reduction(x, dims, keepdim, "logsumexp");
  Tensor keep = reduce_kernel(ReduceOp::kLogSumExp, x, plan, x.dtype(), "logsumexp");
  Tensor sx = x.detach(), sk = keep.detach();
  return finish(keep, x, plan, "logsumexp",
                [sx, sk](const Tensor& g) { return mul(g, exp(sub(sx, sk))); });
}

Tensor var(const Tensor& x, std::vector<int64_t> dims, int64_t correction, bool keepdim) {
  check_floating(x, "var", "x");
  RD_CHECK(correction >= 0, kInvalidArgument, "var: correction must be non-negative, got ",
           correction);
  ReducePlan plan = plan_reduction(x, dims, keepdim, "var");
  // Composed from differentiable ops, so autograd needs nothing extra.
  Tensor centered = sub(x, mean(x, plan.dims, /*keepdim=*/true));
  Tensor squares = sum(mul(centered, centered), plan.dims, keepdim);
  return div(squares, static_cast<double>(plan.count - correction));
}

namespace {
Tensor arg_extremum(ReduceOp op, const Tensor& x, int64_t dim, bool keepdim, const char* name) {
  RD_CHECK(x.dtype() != DType::kBool, kDTypeMismatch, name, ": bool tensors are not supported");
  ReducePlan plan = plan_reduction(x, {normalize_dim(dim, x.dim(), name)}, keepdim, name);
  check_nonempty(x, plan, name);
  Tensor keep = reduce_kernel(op, x, plan, DType::kInt64, name);
  return keep.view(plan.out_shape);
}
}  // namespace

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return arg_extremum(ReduceOp::kArgMax, x, dim, keepdim, "argmax");
}

Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) {
  return arg_extremum(ReduceOp::kArgMin, x, dim, keepdim, "argmin");
}

}  // namespace rd
