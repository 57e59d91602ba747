// Elementwise ops: broadcasting, dtype promotion, kernel dispatch and backward formulas.
#include <cmath>

#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd {

using kernels::BinaryOp;
using kernels::UnaryOp;
using kernels::UnaryParams;

namespace {

// Sums `grad` over the dims that broadcasting added to reach it from `shape`.
Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  size_t lead = grad.shape().size() - shape.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < grad.shape().size(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && grad.shape()[i] != 1)) {
      dims.push_back(static_cast<int64_t>(i));
    }
  }
  Tensor reduced = dims.empty() ? grad : sum(grad, dims, /*keepdim=*/true);
  return reduced.reshape(shape);
}

// What a backward needs of an input whose values it does not read. Saving this instead of
// the tensor lets the input's memory go as soon as nothing else holds it: a saved bias-add
// input alone would pin a whole activation until the backward pass.
struct InputMeta {
  Shape shape;
  DType dtype;
};

InputMeta meta_of(const Tensor& t) { return {t.shape(), t.dtype()}; }

// The gradient of an input from an output gradient: reduced to its shape, in its dtype.
Tensor grad_for(const InputMeta& x, const Tensor& grad) {
  return sum_to(grad, x.shape).to(x.dtype);
}

Tensor grad_for(const Tensor& x, const Tensor& grad) { return grad_for(meta_of(x), grad); }

// A bool mask as 0/1 values of `dtype`, for multiplying into gradients.
Tensor mask_as(const Tensor& mask, DType dtype) { return mask.to(dtype); }

// A 0-dim tensor for a double operand: it takes the tensor's dtype, except that a
// fractional value with an integer tensor gives float32.
Tensor scalar_like(const Tensor& t, double value) {
  DType dtype = t.dtype();
  if (!is_floating(dtype) && value != std::floor(value)) dtype = DType::kFloat32;
  if (dtype == DType::kBool && value != 0.0 && value != 1.0) dtype = DType::kInt64;
  return scalar_tensor(value, TensorOptions(dtype).with_device(t.device()));
}

// Runs a binary kernel after broadcasting and promotion; no autograd.
Tensor binary_forward(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = kernels::op_name(op);
  check_same_device({&a, &b}, name);
  DType common = promote_types(a.dtype(), b.dtype());
  if ((op == BinaryOp::kDiv || op == BinaryOp::kPow) && !is_floating(common)) {
    common = DType::kFloat32;  // true division, as in PyTorch
  }
  if (op == BinaryOp::kLogicalAnd) common = DType::kBool;
  DType out_dtype = kernels::is_comparison(op) ? DType::kBool : common;
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor a_in = a.to(common).expand(shape);
  Tensor b_in = b.to(common).expand(shape);
  Tensor out = empty(shape, TensorOptions(out_dtype).with_device(a.device()));
  backend_for(a.device()).binary(op, kernel_view(out, name), kernel_view(a_in, name),
                                 kernel_view(b_in, name));
  return out;
}

Tensor unary_forward(UnaryOp op, const Tensor& x, const char* name, bool floating_only,
                     const UnaryParams& params = {}) {
  if (floating_only) check_floating(x, name, "x");
  Tensor out = empty_like(x);
  backend_for(x.device()).unary(op, kernel_view(out, name), kernel_view(x, name), params);
  return out;
}

// Records a one-input op whose gradient is grad * derivative(x, y).
template <class DerivativeFn>
Tensor unary_with_grad(UnaryOp op, const Tensor& x, const char* name, DerivativeFn derivative,
                       const UnaryParams& params = {}) {
  Tensor out = unary_forward(op, x, name, /*floating_only=*/op != UnaryOp::kNeg &&
                                              op != UnaryOp::kAbs, params);
  if (autograd::needs_grad({&x})) {
    Tensor saved_x = x.detach();
    Tensor saved_y = out.detach();
    autograd::record(out, name, {x}, [=](const Tensor& g) -> std::vector<Tensor> {
      return {mul(g, derivative(saved_x, saved_y))};
    });
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Binary arithmetic

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  Tensor scaled_b = alpha == 1.0 ? b : mul(b, alpha);
  Tensor out = binary_forward(BinaryOp::kAdd, a, scaled_b);
  if (autograd::needs_grad({&a, &scaled_b})) {
    autograd::record(out, "add", {a, scaled_b},
                     [ma = meta_of(a), mb = meta_of(b)](const Tensor& g) -> std::vector<Tensor> {
      return {grad_for(ma, g), grad_for(mb, g)};
    });
  }
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b, double alpha) {
  Tensor scaled_b = alpha == 1.0 ? b : mul(b, alpha);
  Tensor out = binary_forward(BinaryOp::kSub, a, scaled_b);
  if (autograd::needs_grad({&a, &scaled_b})) {
    autograd::record(out, "sub", {a, scaled_b},
                     [ma = meta_of(a), mb = meta_of(b)](const Tensor& g) -> std::vector<Tensor> {
      return {grad_for(ma, g), grad_for(mb, neg(g))};
    });
  }
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::kMul, a, b);
  if (autograd::needs_grad({&a, &b})) {
    bool need_a = a.requires_grad(), need_b = b.requires_grad();
    // Each input's gradient reads only the other input's values.
    Tensor sa = need_b ? a.detach() : Tensor(), sb = need_a ? b.detach() : Tensor();
    autograd::record(out, "mul", {a, b},
                     [=, ma = meta_of(a), mb = meta_of(b)](const Tensor& g) -> std::vector<Tensor> {
      return {need_a ? grad_for(ma, mul(g, sb)) : Tensor(),
              need_b ? grad_for(mb, mul(g, sa)) : Tensor()};
    });
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::kDiv, a, b);
  if (autograd::needs_grad({&a, &b})) {
    bool need_b = b.requires_grad();
    Tensor sa = need_b ? a.detach() : Tensor(), sb = b.detach();
    autograd::record(out, "div", {a, b},
                     [=, ma = meta_of(a), mb = meta_of(b)](const Tensor& g) -> std::vector<Tensor> {
      Tensor grad_a = div(g, sb);
      Tensor grad_b = need_b ? neg(div(mul(grad_a, sa), sb)) : Tensor();
      return {grad_for(ma, grad_a), need_b ? grad_for(mb, grad_b) : Tensor()};
    });
  }
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::kPow, a, b);
  if (autograd::needs_grad({&a, &b})) {
    Tensor sa = a.detach(), sb = b.detach(), sy = out.detach();
    bool need_b = b.requires_grad();
    autograd::record(out, "pow", {a, b}, [=](const Tensor& g) -> std::vector<Tensor> {
      // d/da a^b = b a^(b-1); d/db a^b = a^b log(a).
      Tensor grad_a = mul(g, mul(sb, pow(sa, sub(sb, 1.0))));
      Tensor grad_b = need_b ? mul(g, mul(sy, log(sa))) : Tensor();
      return {grad_for(sa, grad_a), need_b ? grad_for(sb, grad_b) : Tensor()};
    });
  }
  return out;
}

Tensor pow(const Tensor& a, double exponent) {
  UnaryParams params;
  params.scalar = exponent;
  return unary_with_grad(UnaryOp::kPowScalar, a, "pow",
                         [exponent](const Tensor& x, const Tensor&) {
                           return mul(pow(x, exponent - 1.0), exponent);
                         },
                         params);
}

namespace {
// maximum/minimum: the gradient goes to the selected input; ties split it evenly.
Tensor extremum(BinaryOp op, const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(op, a, b);
  if (autograd::needs_grad({&a, &b})) {
    Tensor sa = a.detach(), sb = b.detach();
    autograd::record(out, kernels::op_name(op), {a, b}, [=](const Tensor& g) -> std::vector<Tensor> {
      DType dtype = g.dtype();
      Tensor a_wins = mask_as(op == BinaryOp::kMaximum ? gt(sa, sb) : lt(sa, sb), dtype);
      Tensor tie = mul(mask_as(eq(sa, sb), dtype), 0.5);
      Tensor share_a = add(a_wins, tie);
      Tensor share_b = 1.0 - share_a;
      return {grad_for(sa, mul(g, share_a)), grad_for(sb, mul(g, share_b))};
    });
  }
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::kMaximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::kMinimum, a, b); }

Tensor add(const Tensor& a, double b) { return add(a, scalar_like(a, b)); }
Tensor sub(const Tensor& a, double b) { return sub(a, scalar_like(a, b)); }
Tensor mul(const Tensor& a, double b) { return mul(a, scalar_like(a, b)); }
Tensor div(const Tensor& a, double b) { return div(a, scalar_like(a, b)); }

// ---------------------------------------------------------------------------------------
// Unary

Tensor neg(const Tensor& x) {
  RD_CHECK(x.dtype() != DType::kBool, kDTypeMismatch,
           "neg: argument 'x' is bool; use logical_not");
  return unary_with_grad(UnaryOp::kNeg, x, "neg",
                         [](const Tensor& x, const Tensor&) { return full_like(x, -1.0); });
}

Tensor abs(const Tensor& x) {
  return unary_with_grad(UnaryOp::kAbs, x, "abs", [](const Tensor& x, const Tensor&) {
    return sub(mask_as(gt(x, 0.0), x.dtype()), mask_as(lt(x, 0.0), x.dtype()));
  });
}

Tensor exp(const Tensor& x) {
  return unary_with_grad(UnaryOp::kExp, x, "exp",
                         [](const Tensor&, const Tensor& y) { return y; });
}

Tensor log(const Tensor& x) {
  return unary_with_grad(UnaryOp::kLog, x, "log",
                         [](const Tensor& x, const Tensor&) { return 1.0 / x; });
}

Tensor sqrt(const Tensor& x) {
  return unary_with_grad(UnaryOp::kSqrt, x, "sqrt",
                         [](const Tensor&, const Tensor& y) { return 0.5 / y; });
}

Tensor rsqrt(const Tensor& x) {
  return unary_with_grad(UnaryOp::kRsqrt, x, "rsqrt", [](const Tensor&, const Tensor& y) {
    return mul(pow(y, 3.0), -0.5);
  });
}

Tensor square(const Tensor& x) { return mul(x, x); }

Tensor tanh(const Tensor& x) {
  return unary_with_grad(UnaryOp::kTanh, x, "tanh", [](const Tensor&, const Tensor& y) {
    return 1.0 - mul(y, y);
  });
}

Tensor sigmoid(const Tensor& x) {
  return unary_with_grad(UnaryOp::kSigmoid, x, "sigmoid", [](const Tensor&, const Tensor& y) {
    return mul(y, 1.0 - y);
  });
}

Tensor relu(const Tensor& x) {
  return unary_with_grad(UnaryOp::kRelu, x, "relu", [](const Tensor& x, const Tensor&) {
    return mask_as(gt(x, 0.0), x.dtype());
  });
}

Tensor gelu(const Tensor& x, GeluApproximation approximation) {
  bool tanh_form = approximation == GeluApproximation::kTanh;
  UnaryOp op = tanh_form ? UnaryOp::kGeluTanh : UnaryOp::kGeluErf;
  UnaryOp grad_op = tanh_form ? UnaryOp::kGeluTanhGrad : UnaryOp::kGeluErfGrad;
  return unary_with_grad(op, x, "gelu", [grad_op](const Tensor& x, const Tensor&) {
    return unary_forward(grad_op, x, "gelu_backward", /*floating_only=*/true);
  });
}

Tensor silu(const Tensor& x) {
  return unary_with_grad(UnaryOp::kSilu, x, "silu", [](const Tensor& x, const Tensor&) {
    // d/dx x s(x) = s(x) (1 + x (1 - s(x)))
    Tensor s = sigmoid(x);
    return mul(s, add(mul(x, 1.0 - s), 1.0));
  });
}

Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  RD_CHECK(!(min && max) || *min <= *max, kInvalidArgument, "clamp: min ", min.value_or(0),
           " is greater than max ", max.value_or(0));
  UnaryParams params;
  params.lo = min;
  params.hi = max;
  return unary_with_grad(
      UnaryOp::kClamp, x, "clamp",
      [min, max](const Tensor& x, const Tensor&) {
        Tensor inside = ones_like(x);
        if (min) inside = mul(inside, mask_as(ge(x, *min), x.dtype()));
        if (max) inside = mul(inside, mask_as(le(x, *max), x.dtype()));
        return inside;
      },
      params);
}

// ---------------------------------------------------------------------------------------
// where, comparisons, logic

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  RD_CHECK(cond.dtype() == DType::kBool, kDTypeMismatch, "where: argument 'cond' must be bool, got ",
           dtype_name(cond.dtype()));
  check_same_device({&cond, &a, &b}, "where");
  DType dtype = promote_types(a.dtype(), b.dtype());
  Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(),
                                 "where");
  Tensor out = empty(shape, TensorOptions(dtype).with_device(a.device()));
  backend_for(a.device()).where(kernel_view(out, "where"),
                                kernel_view(cond.expand(shape), "where"),
                                kernel_view(a.to(dtype).expand(shape), "where"),
                                kernel_view(b.to(dtype).expand(shape), "where"));
  if (autograd::needs_grad({&a, &b})) {
    Tensor sc = cond.detach();
    autograd::record(out, "where", {a, b},
                     [sc, ma = meta_of(a), mb = meta_of(b)](const Tensor& g) -> std::vector<Tensor> {
      Tensor zero = zeros({}, TensorOptions(g.dtype()).with_device(g.device()));
      return {grad_for(ma, where(sc, g, zero)), grad_for(mb, where(sc, zero, g))};
    });
  }
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, double b) {
  return where(cond, a, scalar_like(a, b));
}

Tensor eq(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kEq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kNe, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kLt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kLe, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kGt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::kGe, a, b); }
Tensor eq(const Tensor& a, double b) { return eq(a, scalar_like(a, b)); }
Tensor ne(const Tensor& a, double b) { return ne(a, scalar_like(a, b)); }
Tensor lt(const Tensor& a, double b) { return lt(a, scalar_like(a, b)); }
Tensor le(const Tensor& a, double b) { return le(a, scalar_like(a, b)); }
Tensor gt(const Tensor& a, double b) { return gt(a, scalar_like(a, b)); }
Tensor ge(const Tensor& a, double b) { return ge(a, scalar_like(a, b)); }

Tensor logical_and(const Tensor& a, const Tensor& b) {
  return binary_forward(BinaryOp::kLogicalAnd, a.to(DType::kBool), b.to(DType::kBool));
}
Tensor logical_not(const Tensor& a) { return eq(a.to(DType::kBool), 0.0); }

// ---------------------------------------------------------------------------------------
// Operators

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& x) { return neg(x); }
Tensor operator+(const Tensor& a, double b) { return add(a, b); }
Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return div(a, b); }
Tensor operator+(double a, const Tensor& b) { return add(b, a); }
Tensor operator-(double a, const Tensor& b) { return sub(scalar_like(b, a), b); }
Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
Tensor operator/(double a, const Tensor& b) { return div(scalar_like(b, a), b); }

// ---------------------------------------------------------------------------------------

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (a.shape() != b.shape()) return false;
  autograd::NoGradGuard no_grad;
  std::vector<double> x = a.to_vector<double>();
  std::vector<double> y = b.to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return false;
    if (x[i] == y[i]) continue;  // equal infinities
    if (std::abs(x[i] - y[i]) > atol + rtol * std::abs(y[i])) return false;
  }
  return true;
}

}  // namespace rd
