// CPU elementwise math: unary, binary and where. Every op is a small lambda run through the
// shared strided loop (for_each_typed).
#include <algorithm>
#include <cmath>
#include <string_view>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {
namespace {

[[noreturn]] void fail_dtype(std::string_view kernel, std::string_view op, DType dtype) {
  RD_FAIL(kDTypeMismatch, kernel, ": op ", op, " does not support dtype ", dtype_name(dtype));
}

// Max/min that propagate NaN (either operand NaN gives NaN).
template <class C>
C max_nan(C a, C b) {
  return (a > b || is_nan(a)) ? a : b;
}
template <class C>
C min_nan(C a, C b) {
  return (a < b || is_nan(a)) ? a : b;
}

template <class C>
C clamp_value(C x, const UnaryParams& p) {
  // Written so NaN passes through; lo > hi gives hi, as PyTorch.
  if (p.lo && x < static_cast<C>(*p.lo)) x = static_cast<C>(*p.lo);
  if (p.hi && x > static_cast<C>(*p.hi)) x = static_cast<C>(*p.hi);
  return x;
}

// out = f(in) in the compute type of T.
template <class T, class F>
void map_unary(const StridedView& out, const StridedView& in, F f) {
  using C = Compute<T>;
  for_each_typed<T, T>(out, {&in},
                       [f](T& o, const T& x) { o = static_cast<T>(f(static_cast<C>(x))); });
}

template <class T>
void unary_floating(UnaryOp op, const StridedView& out, const StridedView& in,
                    const UnaryParams& p) {
  using C = Compute<T>;
  constexpr C kHalf = C(0.5);
  constexpr C kSqrt2OverPi = C(0.79788456080286535588);  // sqrt(2 / pi)
  constexpr C kGeluCubic = C(0.044715);
  constexpr C kInvSqrt2 = C(0.70710678118654752440);
  constexpr C kInvSqrt2Pi = C(0.39894228040143267794);  // 1 / sqrt(2 pi)
  switch (op) {
    case UnaryOp::kNeg: return map_unary<T>(out, in, [](C x) { return -x; });
    case UnaryOp::kAbs: return map_unary<T>(out, in, [](C x) { return std::abs(x); });
    case UnaryOp::kExp: return map_unary<T>(out, in, [](C x) { return std::exp(x); });
    case UnaryOp::kLog: return map_unary<T>(out, in, [](C x) { return std::log(x); });
    case UnaryOp::kSqrt: return map_unary<T>(out, in, [](C x) { return std::sqrt(x); });
    case UnaryOp::kRsqrt: return map_unary<T>(out, in, [](C x) { return C(1) / std::sqrt(x); });
    case UnaryOp::kTanh: return map_unary<T>(out, in, [](C x) { return std::tanh(x); });
    case UnaryOp::kSigmoid:
      return map_unary<T>(out, in, [](C x) { return C(1) / (C(1) + std::exp(-x)); });
    case UnaryOp::kRelu: return map_unary<T>(out, in, [](C x) { return x < C(0) ? C(0) : x; });
    case UnaryOp::kSilu:
      return map_unary<T>(out, in, [](C x) { return x / (C(1) + std::exp(-x)); });
    case UnaryOp::kGeluTanh:
      return map_unary<T>(out, in, [=](C x) {
        C inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
        return kHalf * x * (C(1) + std::tanh(inner));
      });
    case UnaryOp::kGeluTanhGrad:
      return map_unary<T>(out, in, [=](C x) {
        C inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
        C t = std::tanh(inner);
        C d_inner = kSqrt2OverPi * (C(1) + C(3) * kGeluCubic * x * x);
        return kHalf * (C(1) + t) + kHalf * x * (C(1) - t * t) * d_inner;
      });
    case UnaryOp::kGeluErf:
      return map_unary<T>(out, in,
                          [=](C x) { return kHalf * x * (C(1) + std::erf(x * kInvSqrt2)); });
    case UnaryOp::kGeluErfGrad:
      return map_unary<T>(out, in, [=](C x) {
        C cdf = kHalf * (C(1) + std::erf(x * kInvSqrt2));
        return cdf + x * kInvSqrt2Pi * std::exp(-kHalf * x * x);
      });
    case UnaryOp::kPowScalar: {
      C e = static_cast<C>(p.scalar);
      return map_unary<T>(out, in, [e](C x) { return std::pow(x, e); });
    }
    case UnaryOp::kClamp:
      return map_unary<T>(out, in, [p](C x) { return clamp_value(x, p); });
  }
}

template <class T>
void unary_integral(UnaryOp op, const StridedView& out, const StridedView& in,
                    const UnaryParams& p) {
  switch (op) {
    case UnaryOp::kNeg: return map_unary<T>(out, in, [](T x) { return T(0) - x; });
    case UnaryOp::kAbs: return map_unary<T>(out, in, [](T x) { return x < 0 ? T(0) - x : x; });
    case UnaryOp::kRelu: return map_unary<T>(out, in, [](T x) { return x < 0 ? T(0) : x; });
    case UnaryOp::kClamp: {
      // Bounds round toward the kept range (clamp(x, 0.5, ...) keeps x >= 1) and are
      // limited to values T can hold; NaN bounds are ignored.
      constexpr double kMax = std::is_same_v<T, int32_t> ? 2147483647.0 : 9.2e18;
      UnaryParams q;
      if (p.lo && !std::isnan(*p.lo)) q.lo = std::ceil(std::clamp(*p.lo, -kMax, kMax));
      if (p.hi && !std::isnan(*p.hi)) q.hi = std::floor(std::clamp(*p.hi, -kMax, kMax));
      return map_unary<T>(out, in, [q](T x) { return clamp_value(x, q); });
    }
    default: break;
  }
  RD_FAIL(kInternal, "unary: op ", op_name(op), " reached the integer path");
}

// out = f(a, b) with inputs in the compute type of T and out of type Out.
template <class T, class Out, class F>
void map_binary(const StridedView& out, const StridedView& a, const StridedView& b, F f) {
  using C = Compute<T>;
  for_each_typed<Out, T, T>(out, {&a, &b}, [f](Out& o, const T& x, const T& y) {
    o = static_cast<Out>(f(static_cast<C>(x), static_cast<C>(y)));
  });
}

template <class T>
void compare(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b) {
  using C = Compute<T>;
  switch (op) {
    case BinaryOp::kEq: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x == y; });
    case BinaryOp::kNe: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x != y; });
    case BinaryOp::kLt: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x < y; });
    case BinaryOp::kLe: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x <= y; });
    case BinaryOp::kGt: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x > y; });
    case BinaryOp::kGe: return map_binary<T, bool>(out, a, b, [](C x, C y) { return x >= y; });
    default: break;
  }
  RD_FAIL(kInternal, "binary: ", op_name(op), " is not a comparison");
}

// Arithmetic binary ops; returns false if `op` does not apply to T.
template <class T>
bool arithmetic(BinaryOp op, const StridedView& out, const StridedView& a,
                const StridedView& b) {
  using C = Compute<T>;
  constexpr bool kFloat = kIsFloating<T>;
  constexpr bool kBool = std::is_same_v<T, bool>;
  switch (op) {
    case BinaryOp::kMaximum:
      map_binary<T, T>(out, a, b, [](C x, C y) { return max_nan(x, y); });
      return true;
    case BinaryOp::kMinimum:
      map_binary<T, T>(out, a, b, [](C x, C y) { return min_nan(x, y); });
      return true;
    case BinaryOp::kLogicalAnd:
      if constexpr (kBool) {
        map_binary<T, T>(out, a, b, [](C x, C y) { return x && y; });
        return true;
      }
      return false;
    default: break;
  }
  if constexpr (kBool) {
    return false;
  } else {
    switch (op) {
      case BinaryOp::kAdd: map_binary<T, T>(out, a, b, [](C x, C y) { return x + y; }); return true;
      case BinaryOp::kSub: map_binary<T, T>(out, a, b, [](C x, C y) { return x - y; }); return true;
      case BinaryOp::kMul: map_binary<T, T>(out, a, b, [](C x, C y) { return x * y; }); return true;
      default: break;
    }
    if constexpr (kFloat) {
      switch (op) {
        case BinaryOp::kDiv:
          map_binary<T, T>(out, a, b, [](C x, C y) { return x / y; });
          return true;
        case BinaryOp::kPow:
          map_binary<T, T>(out, a, b, [](C x, C y) { return std::pow(x, y); });
          return true;
        default: break;
      }
    }
    return false;
  }
}

}  // namespace

void CpuBackend::unary(UnaryOp op, const StridedView& out, const StridedView& in,
                       const UnaryParams& params) {
  check_same_shape("unary", "out", out, "in", in);
  check_dtype("unary", "out", out, in.dtype);
  if (is_floating(in.dtype)) {
    dispatch_floating(in.dtype, "unary", [&](auto tag) {
      unary_floating<typename decltype(tag)::type>(op, out, in, params);
    });
    return;
  }
  bool integral_op = op == UnaryOp::kNeg || op == UnaryOp::kAbs || op == UnaryOp::kRelu ||
                     op == UnaryOp::kClamp;
  if (!integral_op || !is_integral(in.dtype)) fail_dtype("unary", op_name(op), in.dtype);
  if (in.dtype == DType::kInt32) {
    unary_integral<int32_t>(op, out, in, params);
  } else {
    unary_integral<int64_t>(op, out, in, params);
  }
}

void CpuBackend::binary(BinaryOp op, const StridedView& out, const StridedView& a,
                        const StridedView& b) {
  check_same_shape("binary", "out", out, "a", a);
  check_same_shape("binary", "out", out, "b", b);
  check_dtype("binary", "b", b, a.dtype);
  if (is_comparison(op)) {
    check_dtype("binary", "out", out, DType::kBool);
    dispatch_dtype(a.dtype,
                   [&](auto tag) { compare<typename decltype(tag)::type>(op, out, a, b); });
    return;
  }
  check_dtype("binary", "out", out, a.dtype);
  bool done = dispatch_dtype(a.dtype, [&](auto tag) {
    return arithmetic<typename decltype(tag)::type>(op, out, a, b);
  });
  if (!done) fail_dtype("binary", op_name(op), a.dtype);
}

void CpuBackend::where(const StridedView& out, const StridedView& cond, const StridedView& a,
                       const StridedView& b) {
  check_where_args(out, cond, a, b);
  dispatch_by_size(out.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    for_each_typed<U, bool, U, U>(
        out, {&cond, &a, &b}, [](U& o, const bool& c, const U& x, const U& y) { o = c ? x : y; });
  });
}

}  // namespace rd::kernels::cpu
