// Op conformance suite: every op case is declared once in a table and checked (a) forward
// against the float64 reference for each dtype and memory layout, and (b) backward against
// float64 central differences. Each check runs on a Device; on a non-CPU device the result
// is compared with the CPU's instead of the reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/gradcheck.h"
#include "testing/reference.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

using Ts = std::vector<Tensor>;
using Rs = std::vector<RefArray>;

// ---------------------------------------------------------------------------------------
// The case description.

// How one input of a case gets its values and dtype.
struct InputSpec {
  enum class Kind {
    kData,   // the case's dtype (the dtype axis of the suite)
    kFixed,  // a fixed dtype, e.g. the other operand of a promotion case
    kIndex,  // integer indices (fixed dtype), drawn by `draw`
    kMask,   // random bools
  };
  Shape shape;
  Kind kind = Kind::kData;
  Domain domain = Domain::kAny;
  DType dtype = DType::kInt64;  // for kFixed and kIndex
  DrawFn draw;                  // overrides the domain's random values
};

InputSpec Data(Shape shape, Domain domain = Domain::kAny) {
  return {std::move(shape), InputSpec::Kind::kData, domain, DType::kFloat32, nullptr};
}
InputSpec SmallInt(Shape shape) { return Data(std::move(shape), Domain::kSmallInt); }
InputSpec Fixed(Shape shape, DType dtype) {
  return {std::move(shape), InputSpec::Kind::kFixed, Domain::kAny, dtype, nullptr};
}
InputSpec Mask(Shape shape) {
  return {std::move(shape), InputSpec::Kind::kMask, Domain::kAny, DType::kBool, nullptr};
}
InputSpec IndexFrom(Shape shape, DrawFn draw, DType dtype = DType::kInt64) {
  return {std::move(shape), InputSpec::Kind::kIndex, Domain::kAny, dtype, std::move(draw)};
}
// Indices in [0, bound), duplicates allowed.
InputSpec Index(Shape shape, int64_t bound, DType dtype = DType::kInt64) {
  return IndexFrom(
      std::move(shape),
      [bound](const Shape& s, std::mt19937_64& rng) { return random_indices(s, bound, rng); },
      dtype);
}
// Indices in [0, bound) that never repeat along `dim` (scatter must not see duplicates).
InputSpec UniqueIndex(Shape shape, int64_t dim, int64_t bound) {
  return IndexFrom(std::move(shape), [dim, bound](const Shape& s, std::mt19937_64& rng) {
    RefArray out = RefArray::filled(s, 0.0);
    for (int64_t i = 0; i < out.numel(); ++i) {
      ref::Index start = ref::unravel(i, s);
      if (start[dim] != 0) continue;
      std::vector<int64_t> perm(bound);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t j = 0; j < s[dim]; ++j) {
        start[dim] = j;
        out.at(start) = static_cast<double>(perm[j]);
      }
    }
    return out;
  });
}
// Class targets in [0, classes); every third sample (from the second on) is ignore_index.
InputSpec Targets(Shape shape, int64_t classes, int64_t ignore_index) {
  return IndexFrom(std::move(shape), [classes, ignore_index](const Shape& s, std::mt19937_64& rng) {
    RefArray out = random_indices(s, classes, rng);
    for (int64_t i = 1; i < out.numel(); i += 3) out.data[i] = static_cast<double>(ignore_index);
    return out;
  });
}
InputSpec AllIgnored(Shape shape, int64_t ignore_index) {
  return IndexFrom(std::move(shape), [ignore_index](const Shape& s, std::mt19937_64&) {
    return RefArray::filled(s, static_cast<double>(ignore_index));
  });
}

using RunFn = std::function<Ts(const Ts&)>;
using RefFn = std::function<Rs(const Rs&)>;

struct OpCase {
  std::string name;
  std::vector<DType> dtypes;
  std::vector<InputSpec> inputs;
  RunFn run;
  RefFn ref;                              // empty: gradient only (e.g. dropout with p > 0)
  bool differentiable = true;             // checked by gradcheck in float64
  std::function<DType(DType)> out_dtype;  // empty: the case's dtype
  int64_t accumulation = 1;               // terms summed per output (for tolerances)
  bool allow_expanded = true;             // stride-0 inputs would create ties/duplicates
  bool contiguous_only = false;           // ops defined on storage (view, as_strided)

  OpCase& forward_only() {
    differentiable = false;
    return *this;
  }
  OpCase& outputs(std::function<DType(DType)> rule) {
    out_dtype = std::move(rule);
    return *this;
  }
  OpCase& accumulates(int64_t k) {
    accumulation = k;
    return *this;
  }
  OpCase& no_expanded() {
    allow_expanded = false;
    return *this;
  }
  OpCase& contiguous() {
    contiguous_only = true;
    return *this;
  }
};

// Output dtype rules.
DType BoolOut(DType) { return DType::kBool; }
DType Int64Out(DType) { return DType::kInt64; }
// sum/cumsum: integers and bool accumulate into int64 (PyTorch).
DType SumOut(DType d) { return is_floating(d) ? d : DType::kInt64; }
std::function<DType(DType)> PromotedWith(DType other) {
  return [other](DType d) { return promote_types(d, other); };
}
std::function<DType(DType)> Always(DType out) {
  return [out](DType) { return out; };
}

const std::vector<DType> kFloat = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                   DType::kFloat16};
const std::vector<DType> kNumeric = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                     DType::kFloat16, DType::kInt32,   DType::kInt64};
const std::vector<DType> kAll(std::begin(kAllDTypes), std::end(kAllDTypes));
const std::vector<DType> kBoolOnly = {DType::kBool};
const std::vector<DType> kF64 = {DType::kFloat64};
const std::vector<DType> kWide = {DType::kFloat32, DType::kFloat64};

std::string shape_tag(const Shape& shape) {
  if (shape.empty()) return "s";
  std::string tag;
  for (size_t i = 0; i < shape.size(); ++i) tag += (i ? "x" : "") + std::to_string(shape[i]);
  return tag;
}

int64_t reduced_length(const Shape& shape, const std::vector<int64_t>& dims) {
  if (dims.empty()) return ref::numel_of(shape);
  int64_t n = 1;
  for (int64_t d : ref::wrap_dims(dims, static_cast<int64_t>(shape.size()))) n *= shape[d];
  return n;
}

// The table under construction. Case names get the input shapes appended.
class CaseTable {
 public:
  OpCase& def(const std::string& name, std::vector<DType> dtypes, std::vector<InputSpec> inputs,
              std::function<Tensor(const Ts&)> run, std::function<RefArray(const Rs&)> ref) {
    RefFn multi_ref;
    if (ref) multi_ref = [ref](const Rs& r) { return Rs{ref(r)}; };
    return def_multi(
        name, std::move(dtypes), std::move(inputs), [run](const Ts& x) { return Ts{run(x)}; },
        multi_ref);
  }
  OpCase& def_multi(const std::string& name, std::vector<DType> dtypes,
                    std::vector<InputSpec> inputs, RunFn run, RefFn ref) {
    std::string full = name;
    for (const InputSpec& in : inputs) full += "_" + shape_tag(in.shape);
    if (!names_.insert(full).second) throw std::logic_error("duplicate op case " + full);
    OpCase c;
    c.name = full;
    c.dtypes = std::move(dtypes);
    c.inputs = std::move(inputs);
    c.run = std::move(run);
    c.ref = std::move(ref);
    cases_.push_back(std::move(c));
    return cases_.back();
  }
  std::vector<OpCase> take() { return std::move(cases_); }

 private:
  std::vector<OpCase> cases_;
  std::set<std::string> names_;
};

// ---------------------------------------------------------------------------------------
// The table.

using UnaryOpFn = std::function<Tensor(const Tensor&)>;
using ScalarFn = std::function<double(double)>;
using BinaryOpFn = std::function<Tensor(const Tensor&, const Tensor&)>;
using ScalarFn2 = std::function<double(double, double)>;

void unary(CaseTable& t, const std::string& name, const std::vector<DType>& dtypes, Domain domain,
           UnaryOpFn op, ScalarFn f) {
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 3, 4}, Shape{}}) {
    t.def(
        name, dtypes, {Data(shape, domain)}, [op](const Ts& x) { return op(x[0]); },
        [f](const Rs& r) { return ref::map(r[0], f); });
  }
}

// Same shapes, broadcasting both ways, a 0-dim operand, a size-1 dim, and two 0-dim ones.
const std::vector<std::pair<Shape, Shape>> kBinaryShapes = {
    {{3, 4}, {3, 4}}, {{2, 1, 4}, {3, 1}}, {{}, {2, 3}}, {{1}, {3, 4}}, {{}, {}}};

OpCase& binary_case(CaseTable& t, const std::string& name, const std::vector<DType>& dtypes,
                    const InputSpec& a, const InputSpec& b, BinaryOpFn op, ScalarFn2 f) {
  return t.def(
      name, dtypes, {a, b}, [op](const Ts& x) { return op(x[0], x[1]); },
      [f](const Rs& r) { return ref::zip(r[0], r[1], f); });
}

void binary(CaseTable& t, const std::string& name, const std::vector<DType>& dtypes,
            Domain domain_a, BinaryOpFn op, ScalarFn2 f) {
  for (const auto& [sa, sb] : kBinaryShapes) {
    binary_case(t, name, dtypes, Data(sa, domain_a), Data(sb), op, f);
  }
}

void comparison(CaseTable& t, const std::string& name, BinaryOpFn op,
                std::function<Tensor(const Tensor&, double)> op_scalar, ScalarFn2 f) {
  ScalarFn2 as_bool = [f](double a, double b) { return f(a, b) ? 1.0 : 0.0; };
  for (const auto& [sa, sb] :
       {std::pair<Shape, Shape>{{3, 4}, {3, 4}}, {{2, 1, 4}, {3, 1}}, {{}, {}}}) {
    binary_case(t, name, kNumeric, SmallInt(sa), SmallInt(sb), op, as_bool)
        .outputs(BoolOut)
        .forward_only();
  }
  t.def(
       name + "_scalar", kNumeric, {SmallInt({3, 4})},
       [op_scalar](const Ts& x) { return op_scalar(x[0], 1.0); },
       [as_bool](const Rs& r) {
         return ref::map(r[0], [as_bool](double v) { return as_bool(v, 1.0); });
       })
      .outputs(BoolOut)
      .forward_only();
}

void add_elementwise(CaseTable& t) {
  unary(
      t, "neg", kNumeric, Domain::kAny, [](const Tensor& x) { return neg(x); },
      [](double v) { return -v; });
  unary(
      t, "neg_operator", kFloat, Domain::kAny, [](const Tensor& x) { return -x; },
      [](double v) { return -v; });
  unary(
      t, "abs", kNumeric, Domain::kAny, [](const Tensor& x) { return abs(x); },
      [](double v) { return std::abs(v); });
  unary(
      t, "exp", kFloat, Domain::kAny, [](const Tensor& x) { return exp(x); },
      [](double v) { return std::exp(v); });
  unary(
      t, "log", kFloat, Domain::kPositive, [](const Tensor& x) { return log(x); },
      [](double v) { return std::log(v); });
  unary(
      t, "sqrt", kFloat, Domain::kPositive, [](const Tensor& x) { return sqrt(x); },
      [](double v) { return std::sqrt(v); });
  unary(
      t, "rsqrt", kFloat, Domain::kPositive, [](const Tensor& x) { return rsqrt(x); },
      [](double v) { return 1.0 / std::sqrt(v); });
  unary(
      t, "square", kFloat, Domain::kAny, [](const Tensor& x) { return square(x); },
      [](double v) { return v * v; });
  unary(
      t, "tanh", kFloat, Domain::kAny, [](const Tensor& x) { return tanh(x); },
      [](double v) { return std::tanh(v); });
  unary(
      t, "sigmoid", kFloat, Domain::kAny, [](const Tensor& x) { return sigmoid(x); }, ref::sigmoid);
  unary(
      t, "relu", kFloat, Domain::kAny, [](const Tensor& x) { return relu(x); },
      [](double v) { return v > 0 ? v : 0.0; });
  unary(
      t, "gelu_erf", kFloat, Domain::kAny, [](const Tensor& x) { return gelu(x); }, ref::gelu_erf);
  unary(
      t, "gelu_tanh", kFloat, Domain::kAny,
      [](const Tensor& x) { return gelu(x, GeluApproximation::kTanh); }, ref::gelu_tanh);
  unary(
      t, "silu", kFloat, Domain::kAny, [](const Tensor& x) { return silu(x); }, ref::silu);
  unary(
      t, "clamp_both", kFloat, Domain::kAny, [](const Tensor& x) { return clamp(x, -0.5, 0.8); },
      [](double v) { return std::min(std::max(v, -0.5), 0.8); });
  unary(
      t, "clamp_min", kFloat, Domain::kAny,
      [](const Tensor& x) { return clamp(x, 0.3, std::nullopt); },
      [](double v) { return std::max(v, 0.3); });
  unary(
      t, "clamp_max", kFloat, Domain::kAny,
      [](const Tensor& x) { return clamp(x, std::nullopt, -0.4); },
      [](double v) { return std::min(v, -0.4); });
  unary(
      t, "pow_2", kFloat, Domain::kAny, [](const Tensor& x) { return pow(x, 2.0); },
      [](double v) { return v * v; });
  unary(
      t, "pow_3", kFloat, Domain::kAny, [](const Tensor& x) { return pow(x, 3.0); },
      [](double v) { return v * v * v; });
  unary(
      t, "pow_half", kFloat, Domain::kPositive, [](const Tensor& x) { return pow(x, 0.5); },
      [](double v) { return std::sqrt(v); });
  unary(
      t, "pow_neg1p5", kFloat, Domain::kPositive, [](const Tensor& x) { return pow(x, -1.5); },
      [](double v) { return std::pow(v, -1.5); });
  unary(
      t, "pow_neg1", kFloat, Domain::kAny, [](const Tensor& x) { return pow(x, -1.0); },
      [](double v) { return 1.0 / v; });

  // Tensor-scalar arithmetic; integer-valued scalars so that integer dtypes are exact.
  unary(
      t, "add_scalar", kNumeric, Domain::kAny, [](const Tensor& x) { return add(x, 2.0); },
      [](double v) { return v + 2.0; });
  unary(
      t, "sub_scalar", kNumeric, Domain::kAny, [](const Tensor& x) { return sub(x, 2.0); },
      [](double v) { return v - 2.0; });
  unary(
      t, "mul_scalar", kNumeric, Domain::kAny, [](const Tensor& x) { return mul(x, -3.0); },
      [](double v) { return -3.0 * v; });
  unary(
      t, "div_scalar", kFloat, Domain::kAny, [](const Tensor& x) { return div(x, 4.0); },
      [](double v) { return v / 4.0; });
  // Composite expressions round after every op in 16-bit dtypes, so only f32/f64 here.
  unary(
      t, "scalar_operators", kWide, Domain::kAny,
      [](const Tensor& x) { return (2.0 - x) * 3.0 + x / 4.0 - (1.5 / x) + (x + 1.0) - 0.5 * x; },
      [](double v) { return (2.0 - v) * 3.0 + v / 4.0 - (1.5 / v) + (v + 1.0) - 0.5 * v; });

  binary(
      t, "add", kNumeric, Domain::kAny, [](const Tensor& a, const Tensor& b) { return add(a, b); },
      [](double a, double b) { return a + b; });
  binary(
      t, "sub", kNumeric, Domain::kAny, [](const Tensor& a, const Tensor& b) { return sub(a, b); },
      [](double a, double b) { return a - b; });
  binary(
      t, "mul", kNumeric, Domain::kAny, [](const Tensor& a, const Tensor& b) { return mul(a, b); },
      [](double a, double b) { return a * b; });
  binary(
      t, "div", kFloat, Domain::kAny, [](const Tensor& a, const Tensor& b) { return div(a, b); },
      [](double a, double b) { return a / b; });
  binary(
      t, "add_alpha", kFloat, Domain::kAny,
      [](const Tensor& a, const Tensor& b) { return add(a, b, 0.5); },
      [](double a, double b) { return a + 0.5 * b; });
  binary(
      t, "sub_alpha", kFloat, Domain::kAny,
      [](const Tensor& a, const Tensor& b) { return sub(a, b, 2.0); },
      [](double a, double b) { return a - 2.0 * b; });
  binary(
      t, "pow", kFloat, Domain::kPositive,
      [](const Tensor& a, const Tensor& b) { return pow(a, b); },
      [](double a, double b) { return std::pow(a, b); });
  binary(
      t, "maximum", kNumeric, Domain::kAny,
      [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
      [](double a, double b) { return std::max(a, b); });
  binary(
      t, "minimum", kNumeric, Domain::kAny,
      [](const Tensor& a, const Tensor& b) { return minimum(a, b); },
      [](double a, double b) { return std::min(a, b); });
  binary_case(
      t, "operators", kWide, Data({3, 4}), Data({4}),
      [](const Tensor& a, const Tensor& b) { return (a + b) * a - b / a; },
      [](double a, double b) { return (a + b) * a - b / a; });

  // Promotion: the other operand has a fixed dtype.
  binary_case(
      t, "add_promote_f64", {DType::kFloat32, DType::kBFloat16, DType::kInt32}, Data({3, 4}),
      Fixed({4}, DType::kFloat64), [](const Tensor& a, const Tensor& b) { return add(a, b); },
      [](double a, double b) { return a + b; })
      .outputs(PromotedWith(DType::kFloat64));
  binary_case(
      t, "mul_promote_f32", {DType::kBFloat16, DType::kFloat16, DType::kInt64}, Data({3, 4}),
      Fixed({3, 1}, DType::kFloat32), [](const Tensor& a, const Tensor& b) { return mul(a, b); },
      [](double a, double b) { return a * b; })
      .outputs(PromotedWith(DType::kFloat32));
  binary_case(
      t, "sub_promote_bf16", {DType::kFloat16}, Data({3, 4}), Fixed({3, 4}, DType::kBFloat16),
      [](const Tensor& a, const Tensor& b) { return sub(a, b); },
      [](double a, double b) { return a - b; })
      .outputs(PromotedWith(DType::kBFloat16));
  binary_case(
      t, "add_promote_i64", {DType::kInt32}, Data({3, 4}), Fixed({4}, DType::kInt64),
      [](const Tensor& a, const Tensor& b) { return add(a, b); },
      [](double a, double b) { return a + b; })
      .outputs(PromotedWith(DType::kInt64));

  comparison(
      t, "eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); },
      [](const Tensor& a, double b) { return eq(a, b); },
      [](double a, double b) { return a == b; });
  comparison(
      t, "ne", [](const Tensor& a, const Tensor& b) { return ne(a, b); },
      [](const Tensor& a, double b) { return ne(a, b); },
      [](double a, double b) { return a != b; });
  comparison(
      t, "lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); },
      [](const Tensor& a, double b) { return lt(a, b); }, [](double a, double b) { return a < b; });
  comparison(
      t, "le", [](const Tensor& a, const Tensor& b) { return le(a, b); },
      [](const Tensor& a, double b) { return le(a, b); },
      [](double a, double b) { return a <= b; });
  comparison(
      t, "gt", [](const Tensor& a, const Tensor& b) { return gt(a, b); },
      [](const Tensor& a, double b) { return gt(a, b); }, [](double a, double b) { return a > b; });
  comparison(
      t, "ge", [](const Tensor& a, const Tensor& b) { return ge(a, b); },
      [](const Tensor& a, double b) { return ge(a, b); },
      [](double a, double b) { return a >= b; });

  for (const auto& [sa, sb] : {std::pair<Shape, Shape>{{3, 4}, {3, 4}}, {{2, 1, 4}, {3, 1}}}) {
    binary_case(
        t, "logical_and", kBoolOnly, Data(sa), Data(sb),
        [](const Tensor& a, const Tensor& b) { return logical_and(a, b); },
        [](double a, double b) { return (a != 0 && b != 0) ? 1.0 : 0.0; })
        .forward_only();
  }
  for (const Shape& shape : {Shape{3, 4}, Shape{}}) {
    t.def(
         "logical_not", kBoolOnly, {Data(shape)}, [](const Ts& x) { return logical_not(x[0]); },
         [](const Rs& r) { return ref::map(r[0], [](double v) { return v == 0 ? 1.0 : 0.0; }); })
        .forward_only();
  }

  auto where3 = [](const Ts& x) { return where(x[0], x[1], x[2]); };
  auto where3_ref = [](const Rs& r) { return ref::where(r[0], r[1], r[2]); };
  t.def("where", kNumeric, {Mask({3, 4}), Data({3, 4}), Data({3, 4})}, where3, where3_ref);
  t.def("where_bcast", kNumeric, {Mask({3, 1}), Data({4}), Data({})}, where3, where3_ref);
  t.def("where_bcast", kNumeric, {Mask({2, 3, 4}), Data({3, 1}), Data({1, 4})}, where3, where3_ref);
  t.def(
      "where_scalar", kNumeric, {Mask({3, 4}), Data({3, 4})},
      [](const Ts& x) { return where(x[0], x[1], -2.0); },
      [](const Rs& r) { return ref::where(r[0], r[1], RefArray({}, {-2.0})); });
}

struct ReduceVariant {
  std::string tag;
  std::vector<int64_t> dims;
  bool keepdim;
};
const std::vector<ReduceVariant> kReduceVariants = {{"all", {}, false},
                                                    {"all_keep", {}, true},
                                                    {"d1", {1}, false},
                                                    {"dneg1_keep", {-1}, true},
                                                    {"d0_2", {0, 2}, false},
                                                    {"d2_0_keep", {2, 0}, true},
                                                    {"dneg3_neg2", {-3, -2}, false}};

using ReduceOpFn = std::function<Tensor(const Tensor&, std::vector<int64_t>, bool)>;
using ReduceRefFn = std::function<RefArray(const RefArray&, const std::vector<int64_t>&, bool)>;

// ties_matter: replicated (expanded) values would tie. scalar_defined: false where the
// reduction of a single element is NaN (var with correction 1), so only forward is checked.
void reduction(CaseTable& t, const std::string& name, const std::vector<DType>& dtypes,
               ReduceOpFn op, ReduceRefFn f, std::function<DType(DType)> out, bool ties_matter,
               bool scalar_defined = true) {
  auto define = [&](const std::string& tag, const Shape& shape, std::vector<int64_t> dims,
                    bool keepdim) -> OpCase& {
    OpCase& c = t.def(
                     name + "_" + tag, dtypes, {Data(shape)},
                     [op, dims, keepdim](const Ts& x) { return op(x[0], dims, keepdim); },
                     [f, dims, keepdim](const Rs& r) { return f(r[0], dims, keepdim); })
                    .accumulates(reduced_length(shape, dims));
    if (out) c.outputs(out);
    if (ties_matter) c.no_expanded();
    return c;
  };
  for (const ReduceVariant& v : kReduceVariants) define(v.tag, {3, 4, 5}, v.dims, v.keepdim);
  OpCase& scalar = define("all", {}, {}, false);
  if (!scalar_defined) scalar.forward_only();
  define("d0", {6}, {0}, false);
}

void add_reductions(CaseTable& t) {
  reduction(
      t, "sum", kNumeric, [](const Tensor& x, auto d, bool k) { return sum(x, d, k); }, ref::sum,
      SumOut, false);
  reduction(
      t, "mean", kFloat, [](const Tensor& x, auto d, bool k) { return mean(x, d, k); }, ref::mean,
      nullptr, false);
  reduction(
      t, "max", kNumeric, [](const Tensor& x, auto d, bool k) { return max(x, d, k); }, ref::max,
      nullptr, true);
  reduction(
      t, "min", kNumeric, [](const Tensor& x, auto d, bool k) { return min(x, d, k); }, ref::min,
      nullptr, true);
  reduction(
      t, "logsumexp", kFloat, [](const Tensor& x, auto d, bool k) { return logsumexp(x, d, k); },
      ref::logsumexp, nullptr, false);
  for (int64_t correction : {0, 1}) {
    std::string c = "_c" + std::to_string(correction);
    reduction(
        t, "var" + c, kFloat,
        [correction](const Tensor& x, auto d, bool k) { return var(x, d, correction, k); },
        [correction](const RefArray& x, const std::vector<int64_t>& d, bool k) {
          return ref::var(x, d, correction, k);
        },
        nullptr, false, /*scalar_defined=*/correction == 0);
  }
  struct ArgVariant {
    std::string tag;
    int64_t dim;
    bool keepdim;
  };
  for (const ArgVariant& v : {ArgVariant{"d0", 0, false}, ArgVariant{"d1_keep", 1, true},
                              ArgVariant{"dneg1", -1, false}}) {
    for (const Shape& shape : {Shape{3, 4, 5}, Shape{6}}) {
      if (v.dim == 1 && shape.size() == 1) continue;
      int64_t dim = v.dim, keep = v.keepdim;
      t.def(
           "argmax_" + v.tag, kNumeric, {Data(shape)},
           [dim, keep](const Ts& x) { return argmax(x[0], dim, keep); },
           [dim, keep](const Rs& r) { return ref::argmax(r[0], dim, keep); })
          .outputs(Int64Out)
          .forward_only()
          .no_expanded();
      t.def(
           "argmin_" + v.tag, kNumeric, {Data(shape)},
           [dim, keep](const Ts& x) { return argmin(x[0], dim, keep); },
           [dim, keep](const Rs& r) { return ref::argmin(r[0], dim, keep); })
          .outputs(Int64Out)
          .forward_only()
          .no_expanded();
    }
  }
}

void add_linalg(CaseTable& t) {
  auto mm = [](const Ts& x) { return matmul(x[0], x[1]); };
  auto mm_ref = [](const Rs& r) { return ref::matmul(r[0], r[1]); };
  const std::vector<std::pair<Shape, Shape>> shapes = {{{4}, {4}},
                                                       {{4}, {4, 3}},
                                                       {{3, 4}, {4}},
                                                       {{3, 4}, {4, 2}},
                                                       {{2, 3, 4}, {4}},
                                                       {{4}, {2, 4, 3}},
                                                       {{2, 1, 3, 4}, {5, 4, 2}},
                                                       {{1, 3, 4}, {2, 4, 2}}};
  for (const auto& [sa, sb] : shapes) {
    t.def("matmul", kFloat, {Data(sa), Data(sb)}, mm, mm_ref).accumulates(4);
  }
  t.def(
       "bmm", kFloat, {Data({2, 3, 4}), Data({2, 4, 5})},
       [](const Ts& x) { return bmm(x[0], x[1]); },
       [](const Rs& r) { return ref::bmm(r[0], r[1]); })
      .accumulates(4);
  // linear: 1-D, 2-D and 3-D inputs, with and without the fused bias.
  for (const Shape& x_shape : {Shape{4}, Shape{3, 4}, Shape{2, 3, 4}}) {
    for (bool has_bias : {true, false}) {
      std::vector<InputSpec> inputs = {Data(x_shape), Data({5, 4})};
      if (has_bias) inputs.push_back(Data({5}));
      t.def(
           has_bias ? "linear_b" : "linear", kFloat, inputs,
           [has_bias](const Ts& x) { return linear(x[0], x[1], has_bias ? x[2] : Tensor()); },
           [has_bias](const Rs& r) {
             return ref::linear(r[0], r[1], has_bias ? std::optional<RefArray>(r[2]) : std::nullopt);
           })
          .accumulates(4);
    }
  }
}

void add_nn(CaseTable& t) {
  struct LineVariant {
    Shape shape;
    int64_t dim;
  };
  for (const LineVariant& v :
       {LineVariant{{3, 5}, 1}, LineVariant{{3, 5}, 0}, LineVariant{{2, 3, 4}, 1},
        LineVariant{{2, 3, 4}, -1}, LineVariant{{5}, 0}}) {
    int64_t dim = v.dim;
    std::string tag = "_d" + (dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim));
    int64_t len = v.shape[ref::wrap_dim(dim, static_cast<int64_t>(v.shape.size()))];
    t.def(
         "softmax" + tag, kFloat, {Data(v.shape)},
         [dim](const Ts& x) { return softmax(x[0], dim); },
         [dim](const Rs& r) { return ref::softmax(r[0], dim); })
        .accumulates(len);
    t.def(
         "log_softmax" + tag, kFloat, {Data(v.shape)},
         [dim](const Ts& x) { return log_softmax(x[0], dim); },
         [dim](const Rs& r) { return ref::log_softmax(r[0], dim); })
        .accumulates(len);
  }

  // layer_norm / rms_norm over 1 and 2 trailing dims, with and without affine parameters.
  struct NormVariant {
    Shape x;
    Shape normalized;
    bool weight;
    bool bias;
  };
  for (const NormVariant& v :
       {NormVariant{{3, 4}, {4}, false, false}, NormVariant{{3, 4}, {4}, true, true},
        NormVariant{{2, 3, 4}, {3, 4}, true, true}, NormVariant{{2, 3, 4}, {3, 4}, true, false},
        NormVariant{{2, 3, 4}, {4}, false, false}, NormVariant{{4}, {4}, true, true}}) {
    Shape ns = v.normalized;
    bool has_w = v.weight, has_b = v.bias;
    std::vector<InputSpec> inputs = {Data(v.x)};
    if (has_w) inputs.push_back(Data(ns));
    if (has_b) inputs.push_back(Data(ns));
    std::string tag = std::string(has_w ? "_w" : "") + (has_b ? "_b" : "");
    int64_t len = ref::numel_of(ns);
    t.def(
         "layer_norm" + tag, kFloat, inputs,
         [ns, has_w, has_b](const Ts& x) {
           return layer_norm(x[0], ns, has_w ? x[1] : Tensor(),
                             has_b ? x[has_w ? 2 : 1] : Tensor());
         },
         [ns, has_w, has_b](const Rs& r) {
           std::optional<RefArray> w, b;
           if (has_w) w = r[1];
           if (has_b) b = r[has_w ? 2 : 1];
           return ref::layer_norm(r[0], ns, w, b, 1e-5);
         })
        .accumulates(len);
    if (has_b) continue;  // rms_norm has no bias
    t.def(
         "rms_norm" + tag, kFloat, inputs,
         [ns, has_w](const Ts& x) { return rms_norm(x[0], ns, has_w ? x[1] : Tensor()); },
         [ns, has_w](const Rs& r) {
           std::optional<RefArray> w;
           if (has_w) w = r[1];
           return ref::rms_norm(r[0], ns, w, 1e-6);
         })
        .accumulates(len);
  }

  // add_layer_norm / add_rms_norm: both outputs (the norm and the sum x + residual, which
  // the gradient check weights too), with and without affine parameters.
  for (const NormVariant& v :
       {NormVariant{{3, 4}, {4}, false, false}, NormVariant{{3, 4}, {4}, true, true},
        NormVariant{{2, 3, 4}, {3, 4}, true, false}, NormVariant{{2, 3, 4}, {4}, false, true},
        NormVariant{{4}, {4}, true, true}}) {
    Shape ns = v.normalized;
    bool has_w = v.weight, has_b = v.bias;
    std::vector<InputSpec> inputs = {Data(v.x), Data(v.x)};
    if (has_w) inputs.push_back(Data(ns));
    if (has_b) inputs.push_back(Data(ns));
    std::string tag = std::string(has_w ? "_w" : "") + (has_b ? "_b" : "");
    int64_t len = ref::numel_of(ns);
    t.def_multi(
         "add_layer_norm" + tag, kFloat, inputs,
         [ns, has_w, has_b](const Ts& x) {
           AddNormResult r = add_layer_norm(x[0], x[1], ns, has_w ? x[2] : Tensor(),
                                            has_b ? x[has_w ? 3 : 2] : Tensor());
           return Ts{r.out, r.sum};
         },
         [ns, has_w, has_b](const Rs& r) {
           std::optional<RefArray> w, b;
           if (has_w) w = r[2];
           if (has_b) b = r[has_w ? 3 : 2];
           return ref::add_layer_norm(r[0], r[1], ns, w, b, 1e-5);
         })
        .accumulates(len);
    if (has_b) continue;  // rms_norm has no bias
    t.def_multi(
         "add_rms_norm" + tag, kFloat, inputs,
         [ns, has_w](const Ts& x) {
           AddNormResult r = add_rms_norm(x[0], x[1], ns, has_w ? x[2] : Tensor());
           return Ts{r.out, r.sum};
         },
         [ns, has_w](const Rs& r) {
           std::optional<RefArray> w;
           if (has_w) w = r[2];
           return ref::add_rms_norm(r[0], r[1], ns, w, 1e-6);
         })
        .accumulates(len);
  }

  // One output used alone: the backward pass gets an undefined gradient for the other.
  t.def(
       "add_layer_norm_sum_only", kFloat, {Data({3, 4}), Data({3, 4}), Data({4})},
       [](const Ts& x) { return add_layer_norm(x[0], x[1], {4}, x[2]).sum; },
       [](const Rs& r) {
         return ref::add_layer_norm(r[0], r[1], {4}, r[2], std::nullopt, 1e-5)[1];
       })
      .accumulates(4);
  t.def(
       "add_rms_norm_out_only", kFloat, {Data({3, 4}), Data({3, 4}), Data({4})},
       [](const Ts& x) { return add_rms_norm(x[0], x[1], {4}, x[2]).out; },
       [](const Rs& r) { return ref::add_rms_norm(r[0], r[1], {4}, r[2], 1e-6)[0]; })
      .accumulates(4);

  // swiglu: one row, several rows, a batch of rows; widths that take the GPU's 16-byte
  // lanes (2H = 16, 32) and widths that do not (2H = 6, 10).
  for (const Shape& shape : {Shape{6}, Shape{3, 10}, Shape{2, 3, 16}, Shape{5, 32}}) {
    t.def(
        "swiglu", kFloat, {Data(shape)}, [](const Ts& x) { return swiglu(x[0]); },
        [](const Rs& r) { return ref::swiglu(r[0]); });
  }
  // embedding; "repeats" has many repeated indices, so each gradient row sums several (the
  // GPU computes small tables' gradients with a one-hot GEMM, the CPU with index_add).
  auto embed = [](const Ts& x) { return embedding(x[0], x[1]); };
  auto embed_ref = [](const Rs& r) { return ref::embedding(r[0], r[1]); };
  t.def("embedding_repeats", kFloat, {Data({9, 16}), Index({64}, 9)}, embed, embed_ref);
  t.def("embedding", kFloat, {Data({6, 3}), Index({2, 4}, 6)}, embed, embed_ref);
  t.def("embedding", kFloat, {Data({6, 3}), Index({}, 6)}, embed, embed_ref);
  t.def("embedding_i32", kFloat, {Data({5, 2}), Index({7}, 5, DType::kInt32)}, embed, embed_ref);

  // rotary_embedding: plain and offset positions, another base, one head; float64 too, so
  // the gradient (the inverse rotation) is checked. Around position 2^21 only the
  // float32-computed dtypes are compared with the reference here: a float64 angle there
  // carries ~1e-10 rad of rounding, more than the float64 tolerance; rotary_test.cc checks
  // that case with a tolerance derived from the position.
  struct RotaryVariant {
    std::string tag;
    Shape shape;
    int64_t offset;
    double base;
    std::vector<DType> dtypes;
  };
  const std::vector<DType> k32Bit = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (const RotaryVariant& v :
       {RotaryVariant{"", {2, 3, 2, 4}, 0, 10000.0, kFloat},
        RotaryVariant{"_offset7_base500", {1, 5, 3, 6}, 7, 500.0, kFloat},
        RotaryVariant{"_one_head", {2, 4, 1, 8}, 3, 10000.0, kFloat},
        RotaryVariant{"_position2m", {1, 3, 2, 8}, 2'097'151, 10000.0, k32Bit}}) {
    const int64_t offset = v.offset;
    const double base = v.base;
    t.def(
         "rotary_embedding" + v.tag, v.dtypes, {Data(v.shape)},
         [offset, base](const Ts& x) { return rotary_embedding(x[0], offset, base); },
         [offset, base](const Rs& r) { return ref::rotary_embedding(r[0], offset, base); })
        .accumulates(2);
  }

  // rotary_embedding_qkv: the packed form (q and k rotated as 2H heads, v copied), also on a
  // qkv whose heads do not merge (a permuted view, copied first) and in place.
  t.def(
       "rotary_embedding_qkv", kFloat, {Data({2, 3, 3, 2, 4})},
       [](const Ts& x) { return rotary_embedding_qkv(x[0], 5, 1000.0); },
       [](const Rs& r) { return ref::rotary_embedding_qkv(r[0], 5, 1000.0); })
      .accumulates(2);
  t.def(
       "rotary_embedding_qkv_strided", kFloat, {Data({2, 3, 2, 3, 4})},
       [](const Ts& x) { return rotary_embedding_qkv(x[0].permute({0, 1, 3, 2, 4}), 0, 10000.0); },
       [](const Rs& r) {
         return ref::rotary_embedding_qkv(ref::permute(r[0], {0, 1, 3, 2, 4}), 0, 10000.0);
       })
      .accumulates(2);
  // The overwriting form, on a fresh product (its input must be nobody else's).
  t.def(
       "rotary_embedding_qkv_overwrite", kFloat, {Data({2, 3, 3, 2, 4})},
       [](const Ts& x) { return rotary_embedding_qkv_overwrite(mul(x[0], 1.0), 5, 1000.0); },
       [](const Rs& r) { return ref::rotary_embedding_qkv(r[0], 5, 1000.0); })
      .accumulates(2);

  // dropout: identity when p = 0 or when not training; with p > 0 only the gradient is
  // checked here (the mask is random), by re-seeding the generator on every evaluation.
  for (const Shape& shape : {Shape{3, 4}, Shape{}}) {
    t.def(
        "dropout_p0", kFloat, {Data(shape)},
        [](const Ts& x) {
          Generator gen(11);
          return dropout(x[0], 0.0, true, gen);
        },
        [](const Rs& r) { return r[0]; });
    t.def(
        "dropout_eval", kFloat, {Data(shape)},
        [](const Ts& x) {
          Generator gen(11);
          return dropout(x[0], 0.5, false, gen);
        },
        [](const Rs& r) { return r[0]; });
  }
  t.def(
      "dropout_p03_fixed_seed", kFloat, {Data({4, 5})},
      [](const Ts& x) {
        Generator gen(1234);
        return dropout(x[0], 0.3, true, gen);
      },
      nullptr);

  using ref::Reduction;
  struct CeVariant {
    std::string tag;
    rd::Reduction reduction;
    Reduction ref_reduction;
  };
  for (const CeVariant& v : {CeVariant{"mean", rd::Reduction::kMean, Reduction::kMean},
                             CeVariant{"sum", rd::Reduction::kSum, Reduction::kSum},
                             CeVariant{"none", rd::Reduction::kNone, Reduction::kNone}}) {
    auto red = v.reduction;
    auto ref_red = v.ref_reduction;
    for (int64_t ignore : {int64_t{-100}, int64_t{2}}) {
      std::string tag = v.tag + (ignore == -100 ? "" : "_ignore2");
      t.def(
           "cross_entropy_" + tag, kFloat, {Data({4, 5}), Targets({4}, 5, ignore)},
           [red, ignore](const Ts& x) { return cross_entropy(x[0], x[1], ignore, red); },
           [ref_red, ignore](const Rs& r) {
             return ref::cross_entropy(r[0], r[1], ignore, ref_red);
           })
          .accumulates(5);
    }
    t.def(
         "cross_entropy_" + v.tag, kFloat, {Data({5}), Index({}, 5)},
         [red](const Ts& x) { return cross_entropy(x[0], x[1], -100, red); },
         [ref_red](const Rs& r) { return ref::cross_entropy(r[0], r[1], -100, ref_red); })
        .accumulates(5);
  }
  // The spatial form [N, C, d1, ...] with targets [N, d1, ...]: classes `inner` apart. 37
  // positions per sample cover two full tiles of adjacent positions and a partial one.
  struct SpatialCeVariant {
    Shape logits;
    int64_t ignore;
  };
  for (const SpatialCeVariant& s : {SpatialCeVariant{{2, 5, 3}, -100},
                                    SpatialCeVariant{{2, 4, 3, 2}, 1},
                                    SpatialCeVariant{{2, 3, 37}, -100}}) {
    Shape target_shape = s.logits;
    target_shape.erase(target_shape.begin() + 1);
    const int64_t classes = s.logits[1];
    const int64_t ignore = s.ignore;
    for (const CeVariant& v : {CeVariant{"mean", rd::Reduction::kMean, Reduction::kMean},
                               CeVariant{"none", rd::Reduction::kNone, Reduction::kNone}}) {
      auto red = v.reduction;
      auto ref_red = v.ref_reduction;
      t.def(
           "cross_entropy_spatial_" + v.tag, kFloat,
           {Data(s.logits), Targets(target_shape, classes, ignore)},
           [red, ignore](const Ts& x) { return cross_entropy(x[0], x[1], ignore, red); },
           [ref_red, ignore](const Rs& r) {
             return ref::cross_entropy(r[0], r[1], ignore, ref_red);
           })
          .accumulates(classes);
    }
  }
  t.def(
       "cross_entropy_mean_all_ignored", kFloat, {Data({3, 4}), AllIgnored({3}, -100)},
       [](const Ts& x) { return cross_entropy(x[0], x[1]); },
       [](const Rs& r) { return ref::cross_entropy(r[0], r[1], -100, ref::Reduction::kMean); })
      .forward_only();
  // A vocabulary-sized row (the fused kernels' long-row path) next to an ignored row. The
  // gradient check (finite differences over 6000 logits, ~3 s) runs for kMean only.
  t.def(
       "cross_entropy_wide_mean", kFloat, {Data({2, 3000}), Targets({2}, 3000, -100)},
       [](const Ts& x) { return cross_entropy(x[0], x[1]); },
       [](const Rs& r) { return ref::cross_entropy(r[0], r[1], -100, ref::Reduction::kMean); })
      .accumulates(3000);
  t.def(
       "cross_entropy_wide_none", kFloat, {Data({2, 3000}), Targets({2}, 3000, -100)},
       [](const Ts& x) { return cross_entropy(x[0], x[1], -100, rd::Reduction::kNone); },
       [](const Rs& r) { return ref::cross_entropy(r[0], r[1], -100, ref::Reduction::kNone); })
      .accumulates(3000)
      .forward_only();
}

void add_joining_and_indexing(CaseTable& t) {
  auto cat_case = [&t](int64_t dim, std::vector<Shape> shapes) {
    std::vector<InputSpec> inputs;
    for (const Shape& s : shapes) inputs.push_back(Data(s));
    std::string tag = dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim);
    t.def(
        "cat_d" + tag, kAll, inputs, [dim](const Ts& x) { return cat(x, dim); },
        [dim](const Rs& r) { return ref::cat(r, dim); });
  };
  cat_case(0, {{2, 3}, {4, 3}});
  cat_case(-1, {{2, 3}, {2, 1}, {2, 2}});
  cat_case(1, {{2, 2, 3}, {2, 4, 3}});
  cat_case(0, {{3}, {2}});
  auto stack_case = [&t](int64_t dim, std::vector<Shape> shapes) {
    std::vector<InputSpec> inputs;
    for (const Shape& s : shapes) inputs.push_back(Data(s));
    std::string tag = dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim);
    t.def(
        "stack_d" + tag, kAll, inputs, [dim](const Ts& x) { return stack(x, dim); },
        [dim](const Rs& r) { return ref::stack(r, dim); });
  };
  stack_case(0, {{2, 3}, {2, 3}, {2, 3}});
  stack_case(1, {{2, 3}, {2, 3}});
  stack_case(-1, {{2, 3}, {2, 3}});
  stack_case(0, {{}, {}, {}});

  struct SplitVariant {
    std::string tag;
    Shape shape;
    int64_t dim;
    std::function<Ts(const Tensor&)> op;
    std::vector<int64_t> sizes;
  };
  const std::vector<SplitVariant> splits = {
      {"split_size2_d0", {5, 3}, 0, [](const Tensor& x) { return split(x, 2, 0); }, {2, 2, 1}},
      {"split_size2_d1", {2, 5}, 1, [](const Tensor& x) { return split(x, 2, 1); }, {2, 2, 1}},
      {"split_sizes_d0",
       {5, 3},
       0,
       [](const Tensor& x) {
         return split(x, std::vector<int64_t>{1, 3, 1}, 0);
       },
       {1, 3, 1}},
      {"split_sizes_dneg1",
       {2, 6},
       -1,
       [](const Tensor& x) {
         return split(x, std::vector<int64_t>{4, 2}, -1);
       },
       {4, 2}},
      {"chunk4_d0",
       {6, 2},
       0,
       [](const Tensor& x) { return chunk(x, 4, 0); },
       ref::chunk_sizes(6, 4)},
      {"chunk3_d0",
       {5, 3},
       0,
       [](const Tensor& x) { return chunk(x, 3, 0); },
       ref::chunk_sizes(5, 3)},
      {"chunk3_dneg1",
       {3, 7},
       -1,
       [](const Tensor& x) { return chunk(x, 3, -1); },
       ref::chunk_sizes(7, 3)},
  };
  for (const SplitVariant& v : splits) {
    auto op = v.op;
    auto sizes = v.sizes;
    int64_t dim = v.dim;
    t.def_multi(
        v.tag, kAll, {Data(v.shape)}, [op](const Ts& x) { return op(x[0]); },
        [sizes, dim](const Rs& r) { return ref::split(r[0], sizes, dim); });
  }

  auto index_select_case = [&t](int64_t dim, Shape x, int64_t n, int64_t bound) {
    std::string tag = dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim);
    t.def(
        "index_select_d" + tag, kNumeric, {Data(x), Index({n}, bound)},
        [dim](const Ts& in) { return index_select(in[0], dim, in[1]); },
        [dim](const Rs& r) { return ref::index_select(r[0], dim, r[1]); });
  };
  index_select_case(0, {4, 3}, 5, 4);
  index_select_case(1, {4, 3}, 2, 3);
  index_select_case(-1, {2, 3, 4}, 6, 4);
  index_select_case(0, {5}, 3, 5);

  auto gather_case = [&t](int64_t dim, Shape x, Shape index, int64_t bound) {
    std::string tag = dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim);
    t.def(
        "gather_d" + tag, kNumeric, {Data(x), Index(index, bound)},
        [dim](const Ts& in) { return gather(in[0], dim, in[1]); },
        [dim](const Rs& r) { return ref::gather(r[0], dim, r[1]); });
  };
  gather_case(1, {3, 4}, {3, 6}, 4);
  gather_case(0, {3, 4}, {2, 4}, 3);
  gather_case(1, {2, 3, 4}, {2, 5, 3}, 3);
  gather_case(-1, {2, 3, 4}, {1, 2, 2}, 4);

  t.def(
       "scatter_d1", kNumeric, {Data({3, 5}), UniqueIndex({3, 2}, 1, 5), Data({3, 2})},
       [](const Ts& x) { return scatter(x[0], 1, x[1], x[2]); },
       [](const Rs& r) { return ref::scatter(r[0], 1, r[1], r[2]); })
      .no_expanded();
  t.def(
       "scatter_d0", kNumeric, {Data({4, 3}), UniqueIndex({2, 3}, 0, 4), Data({2, 3})},
       [](const Ts& x) { return scatter(x[0], 0, x[1], x[2]); },
       [](const Rs& r) { return ref::scatter(r[0], 0, r[1], r[2]); })
      .no_expanded();
  t.def(
       "scatter_add_d1", kNumeric, {Data({3, 5}), Index({3, 4}, 5), Data({3, 4})},
       [](const Ts& x) { return scatter_add(x[0], 1, x[1], x[2]); },
       [](const Rs& r) { return ref::scatter_add(r[0], 1, r[1], r[2]); })
      .accumulates(4);
  t.def(
       "scatter_add_d0", kNumeric, {Data({3, 4}), Index({5, 4}, 3), Data({5, 4})},
       [](const Ts& x) { return scatter_add(x[0], 0, x[1], x[2]); },
       [](const Rs& r) { return ref::scatter_add(r[0], 0, r[1], r[2]); })
      .accumulates(5);

  for (const auto& [sx, sm] :
       {std::pair<Shape, Shape>{{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 4}, {3, 1}}, {{}, {}}}) {
    t.def(
        "masked_fill", kNumeric, {Data(sx), Mask(sm)},
        [](const Ts& x) { return masked_fill(x[0], x[1], 3.0); },
        [](const Rs& r) { return ref::masked_fill(r[0], r[1], 3.0); });
  }

  for (int64_t k : {0, -1, 2}) {
    std::string tag = k < 0 ? "neg" + std::to_string(-k) : std::to_string(k);
    t.def(
        "tril_k" + tag, kNumeric, {Data({4, 5})}, [k](const Ts& x) { return tril(x[0], k); },
        [k](const Rs& r) { return ref::tril(r[0], k); });
    t.def(
        "triu_k" + tag, kNumeric, {Data({4, 5})}, [k](const Ts& x) { return triu(x[0], k); },
        [k](const Rs& r) { return ref::triu(r[0], k); });
  }
  t.def(
      "tril_k1", kNumeric, {Data({2, 3, 4})}, [](const Ts& x) { return tril(x[0], 1); },
      [](const Rs& r) { return ref::tril(r[0], 1); });
  t.def(
      "triu_kneg2", kNumeric, {Data({2, 4, 3})}, [](const Ts& x) { return triu(x[0], -2); },
      [](const Rs& r) { return ref::triu(r[0], -2); });

  struct CumsumVariant {
    Shape shape;
    int64_t dim;
  };
  for (const CumsumVariant& v :
       {CumsumVariant{{3, 4}, 0}, CumsumVariant{{3, 4}, -1}, CumsumVariant{{2, 3, 4}, 1},
        CumsumVariant{{6}, 0}, CumsumVariant{{}, 0}}) {
    int64_t dim = v.dim;
    std::string tag = dim < 0 ? "neg" + std::to_string(-dim) : std::to_string(dim);
    int64_t len = v.shape.empty() ? 1 : v.shape[ref::wrap_dim(dim, v.shape.size())];
    t.def(
         "cumsum_d" + tag, kNumeric, {Data(v.shape)},
         [dim](const Ts& x) { return cumsum(x[0], dim); },
         [dim](const Rs& r) { return ref::cumsum(r[0], dim); })
        .outputs(SumOut)
        .accumulates(len);
  }
}

void add_views_and_copies(CaseTable& t) {
  auto view_case = [&t](const std::string& name, Shape shape, UnaryOpFn op,
                        std::function<RefArray(const RefArray&)> f) -> OpCase& {
    return t.def(
        name, kAll, {Data(shape)}, [op](const Ts& x) { return op(x[0]); },
        [f](const Rs& r) { return f(r[0]); });
  };
  view_case(
      "permute_201", {2, 3, 4},
      [](const Tensor& x) {
        return x.permute({2, 0, 1});
      },
      [](const RefArray& x) {
        return ref::permute(x, {2, 0, 1});
      });
  view_case(
      "permute_neg", {2, 3, 4},
      [](const Tensor& x) {
        return x.permute({-1, 0, -2});
      },
      [](const RefArray& x) {
        return ref::permute(x, {2, 0, 1});
      });
  view_case(
      "transpose_02", {2, 3, 4}, [](const Tensor& x) { return x.transpose(0, 2); },
      [](const RefArray& x) { return ref::transpose(x, 0, 2); });
  view_case(
      "transpose_neg", {2, 3, 4}, [](const Tensor& x) { return x.transpose(-1, -2); },
      [](const RefArray& x) { return ref::transpose(x, 2, 1); });
  view_case(
      "t", {3, 4}, [](const Tensor& x) { return x.t(); },
      [](const RefArray& x) { return ref::transpose(x, 0, 1); });
  view_case(
      "slice_step2", {5, 6}, [](const Tensor& x) { return x.slice(1, 1, 6, 2); },
      [](const RefArray& x) { return ref::slice(x, 1, 1, 6, 2); });
  view_case(
      "slice_step3_d0", {7, 2}, [](const Tensor& x) { return x.slice(0, 0, 7, 3); },
      [](const RefArray& x) { return ref::slice(x, 0, 0, 7, 3); });
  view_case(
      "slice_negative_bounds", {5, 6}, [](const Tensor& x) { return x.slice(0, -4, -1); },
      [](const RefArray& x) { return ref::slice(x, 0, -4, -1, 1); });
  view_case(
      "slice_end_past_size", {5, 6}, [](const Tensor& x) { return x.slice(1, 2, 100, 2); },
      [](const RefArray& x) { return ref::slice(x, 1, 2, 100, 2); });
  view_case(
      "narrow_d1", {4, 5}, [](const Tensor& x) { return x.narrow(1, 1, 3); },
      [](const RefArray& x) { return ref::slice(x, 1, 1, 4, 1); });
  view_case(
      "narrow_d0", {4, 5}, [](const Tensor& x) { return x.narrow(0, 2, 2); },
      [](const RefArray& x) { return ref::slice(x, 0, 2, 4, 1); });
  view_case(
      "select_d0", {3, 4}, [](const Tensor& x) { return x.select(0, 1); },
      [](const RefArray& x) { return ref::select(x, 0, 1); });
  view_case(
      "select_neg_index", {3, 4}, [](const Tensor& x) { return x.select(1, -1); },
      [](const RefArray& x) { return ref::select(x, 1, 3); });
  view_case(
      "select_d2", {2, 3, 4}, [](const Tensor& x) { return x.select(2, 2); },
      [](const RefArray& x) { return ref::select(x, 2, 2); });
  view_case(
      "select_to_0d", {5}, [](const Tensor& x) { return x.select(0, 3); },
      [](const RefArray& x) { return ref::select(x, 0, 3); });
  view_case(
      "expand_new_dims", {3, 1},
      [](const Tensor& x) {
        return x.expand({2, 3, 4});
      },
      [](const RefArray& x) {
        return ref::expand(x, {2, 3, 4});
      });
  view_case(
      "expand_keep", {1, 4},
      [](const Tensor& x) {
        return x.expand({3, -1});
      },
      [](const RefArray& x) {
        return ref::expand(x, {3, -1});
      });
  view_case(
      "expand_0d", {},
      [](const Tensor& x) {
        return x.expand({2, 3});
      },
      [](const RefArray& x) {
        return ref::expand(x, {2, 3});
      });
  view_case(
      "squeeze_all", {1, 3, 1, 4}, [](const Tensor& x) { return x.squeeze(); },
      [](const RefArray& x) { return ref::squeeze(x); });
  view_case(
      "squeeze_d2", {3, 4, 1}, [](const Tensor& x) { return x.squeeze(2); },
      [](const RefArray& x) { return ref::squeeze(x, 2); });
  view_case(
      "squeeze_non1_noop", {3, 4}, [](const Tensor& x) { return x.squeeze(0); },
      [](const RefArray& x) { return ref::squeeze(x, 0); });
  view_case(
      "unsqueeze_0", {3, 4}, [](const Tensor& x) { return x.unsqueeze(0); },
      [](const RefArray& x) { return ref::unsqueeze(x, 0); });
  view_case(
      "unsqueeze_neg1", {3, 4}, [](const Tensor& x) { return x.unsqueeze(-1); },
      [](const RefArray& x) { return ref::unsqueeze(x, 2); });
  view_case(
      "unsqueeze_0d", {}, [](const Tensor& x) { return x.unsqueeze(0); },
      [](const RefArray& x) { return ref::unsqueeze(x, 0); });
  view_case(
      "view_merge", {2, 3, 4},
      [](const Tensor& x) {
        return x.view({6, 4});
      },
      [](const RefArray& x) {
        return ref::reshape(x, {6, 4});
      })
      .contiguous();
  view_case(
      "view_infer", {2, 3, 4}, [](const Tensor& x) { return x.view({-1}); },
      [](const RefArray& x) { return ref::reshape(x, {-1}); })
      .contiguous();
  view_case(
      "reshape_infer", {2, 3, 4},
      [](const Tensor& x) {
        return x.reshape({4, -1});
      },
      [](const RefArray& x) {
        return ref::reshape(x, {4, -1});
      });
  view_case(
      "reshape_split", {3, 4},
      [](const Tensor& x) {
        return x.reshape({2, 2, 3});
      },
      [](const RefArray& x) {
        return ref::reshape(x, {2, 2, 3});
      });
  view_case(
      "reshape_0d", {},
      [](const Tensor& x) {
        return x.reshape({1, 1});
      },
      [](const RefArray& x) {
        return ref::reshape(x, {1, 1});
      });
  view_case(
      "flatten_all", {2, 3, 4}, [](const Tensor& x) { return x.flatten(); },
      [](const RefArray& x) { return ref::flatten(x, 0, -1); });
  view_case(
      "flatten_12", {2, 3, 4}, [](const Tensor& x) { return x.flatten(1, 2); },
      [](const RefArray& x) { return ref::flatten(x, 1, 2); });
  view_case(
      "flatten_01", {2, 3, 4}, [](const Tensor& x) { return x.flatten(0, 1); },
      [](const RefArray& x) { return ref::flatten(x, 0, 1); });
  view_case(
      "as_strided", {4, 6},
      [](const Tensor& x) {
        return x.as_strided({3, 2}, {6, 2}, 1);
      },
      [](const RefArray& x) {
        return ref::as_strided(x, {3, 2}, {6, 2}, 1);
      })
      .contiguous();
  view_case(
      "as_strided_transposed", {4, 6},
      [](const Tensor& x) {
        return x.as_strided({2, 3}, {1, 6});
      },
      [](const RefArray& x) {
        return ref::as_strided(x, {2, 3}, {1, 6}, 0);
      })
      .contiguous();
  view_case(
      "view_chain", {2, 3, 4},
      [](const Tensor& x) { return x.transpose(0, 1).slice(2, 1, 4, 2).unsqueeze(1).select(0, 2); },
      [](const RefArray& x) {
        return ref::select(ref::unsqueeze(ref::slice(ref::transpose(x, 0, 1), 2, 1, 4, 2), 1), 0,
                           2);
      });
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 3, 4}, Shape{}}) {
    view_case(
        "contiguous", shape, [](const Tensor& x) { return x.contiguous(); },
        [](const RefArray& x) { return x; });
    view_case(
        "clone", shape, [](const Tensor& x) { return x.clone(); },
        [](const RefArray& x) { return x; });
  }
  for (const Shape& shape : {Shape{3, 4}, Shape{}}) {
    t.def(
         "to_f64", kAll, {Data(shape)}, [](const Ts& x) { return x[0].to(DType::kFloat64); },
         [](const Rs& r) { return r[0]; })
        .outputs(Always(DType::kFloat64));
    t.def(
         "to_f32", kAll, {Data(shape)}, [](const Ts& x) { return x[0].to(DType::kFloat32); },
         [](const Rs& r) { return r[0]; })
        .outputs(Always(DType::kFloat32))
        .forward_only();
    t.def(
         "to_bf16", kFloat, {Data(shape)}, [](const Ts& x) { return x[0].to(DType::kBFloat16); },
         [](const Rs& r) { return r[0]; })
        .outputs(Always(DType::kBFloat16))
        .forward_only();
    t.def(
         "to_i64", {DType::kInt32, DType::kInt64, DType::kBool}, {Data(shape)},
         [](const Ts& x) { return x[0].to(DType::kInt64); }, [](const Rs& r) { return r[0]; })
        .outputs(Int64Out)
        .forward_only();
  }
}

const std::vector<OpCase>& all_cases() {
  static const std::vector<OpCase> cases = [] {
    CaseTable t;
    add_elementwise(t);
    add_reductions(t);
    add_linalg(t);
    add_nn(t);
    add_joining_and_indexing(t);
    add_views_and_copies(t);
    return t.take();
  }();
  return cases;
}

// ---------------------------------------------------------------------------------------
// Running a case.

// The devices every case runs on. A non-CPU device is checked against the CPU's results.
// Every device this process can run: CPU always, plus the first CUDA device when one is
// visible (CUDA cases are checked against the CPU's results). Without a GPU, as in CI, the
// CUDA cases are not registered at all; the GPU machine runs this binary directly.
std::vector<Device> suite_devices() {
  std::vector<Device> devices{Device::cpu()};
  if (cuda_available()) devices.push_back(Device::cuda(0));
  return devices;
}

// Byte every new block of the device's pool is filled with during the checks: 0x7F7F...
// reads as ~3.4e38 in float32 and bfloat16, ~1.4e306 in float64, NaN in float16 and a huge
// integer, so an output element an op never writes cannot pass for a right answer.
constexpr uint8_t kPoisonByte = 0x7F;

// Turns the fill on for a device's pool (idempotent; the pools are per process).
void poison_new_memory(Device device) {
  allocator_for(device).set_fill_on_allocate(kPoisonByte);
}

std::string device_tag(Device d) { return d.is_cpu() ? "cpu" : "cuda" + std::to_string(d.index); }

// One check: a case on one dtype, layout and device.
struct SuiteParam {
  const OpCase* op;
  DType dtype;
  Layout layout;
  Device device;
};

// One registered test: a case on one device, checked in each of its dtypes and in every
// layout that applies. dtypes and layouts loop inside the test instead of being registered
// one by one because ctest runs each registered test in its own process and gtest's
// start-up grows with the number of registered tests: ~7400 entries cost ~40 ms per process
// (~0.2 s under ASan), i.e. many minutes per preset; ~700 entries keep ctest well under a
// minute. A failure names its dtype and layout in the gtest trace.
struct SuiteTest {
  const OpCase* op;
  Device device;
  std::vector<DType> dtypes;
  std::vector<Layout> layouts;
};

// gtest prints every parameter while registering tests; a short text keeps start-up cheap
// and failure messages readable.
void PrintTo(const SuiteTest& t, std::ostream* os) { *os << t.op->name << " " << t.device.str(); }

bool layout_allowed(const OpCase& op, Layout layout) {
  if (layout == Layout::kContiguous) return true;
  if (op.contiguous_only) return false;
  if (layout == Layout::kExpanded && !op.allow_expanded) return false;
  return std::any_of(op.inputs.begin(), op.inputs.end(),
                     [layout](const InputSpec& in) { return layout_applies(layout, in.shape); });
}

// Forward tests: every case with a reference, in each of its dtypes. Gradient tests: every
// differentiable case that supports float64, in float64.
std::vector<SuiteTest> make_tests(bool gradients) {
  std::vector<SuiteTest> tests;
  for (const OpCase& op : all_cases()) {
    if (gradients ? !op.differentiable : !op.ref) continue;
    std::vector<DType> dtypes = op.dtypes;
    if (gradients) {
      if (std::find(dtypes.begin(), dtypes.end(), DType::kFloat64) == dtypes.end()) continue;
      dtypes = kF64;
    }
    std::vector<Layout> layouts;
    for (Layout layout : kAllLayouts) {
      if (layout_allowed(op, layout)) layouts.push_back(layout);
    }
    for (Device device : suite_devices()) tests.push_back({&op, device, dtypes, layouts});
  }
  return tests;
}

int64_t count_checks(const std::vector<SuiteTest>& tests) {
  int64_t n = 0;
  for (const SuiteTest& t : tests) n += static_cast<int64_t>(t.dtypes.size() * t.layouts.size());
  return n;
}

std::string test_name(const ::testing::TestParamInfo<SuiteTest>& info) {
  return info.param.op->name + "_" + device_tag(info.param.device);
}

// A reproducible seed per (case, dtype, layout): FNV-1a of the pieces.
uint64_t case_seed(const SuiteParam& p) {
  std::string key = p.op->name + "/" + std::string(dtype_short_name(p.dtype)) + "/" +
                    std::string(layout_name(p.layout));
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  return h;
}

DType input_dtype(const InputSpec& spec, DType case_dtype) {
  switch (spec.kind) {
    case InputSpec::Kind::kData:
      return case_dtype;
    case InputSpec::Kind::kMask:
      return DType::kBool;
    default:
      return spec.dtype;
  }
}

std::vector<LaidOutInput> make_case_inputs(const SuiteParam& p, Device device) {
  std::mt19937_64 rng(case_seed(p));
  std::vector<LaidOutInput> inputs;
  for (const InputSpec& spec : p.op->inputs) {
    DType dtype = input_dtype(spec, p.dtype);
    DrawFn draw = spec.draw;
    if (!draw) {
      draw = [&spec, dtype](const Shape& s, std::mt19937_64& r) {
        return random_values(s, spec.domain, dtype, r);
      };
    }
    inputs.push_back(make_input(spec.shape, dtype, p.layout, device, draw, rng));
  }
  return inputs;
}

Ts input_tensors(const std::vector<LaidOutInput>& inputs) {
  Ts out;
  for (const LaidOutInput& in : inputs) out.push_back(in.input());
  return out;
}

// The tolerance for a case: the loosest over its floating input dtypes and output dtype.
Tolerance case_tolerance(const SuiteParam& p, DType out_dtype) {
  Tolerance tol = tolerance_for(out_dtype, p.op->accumulation);
  for (const InputSpec& spec : p.op->inputs) {
    if (spec.kind == InputSpec::Kind::kIndex || spec.kind == InputSpec::Kind::kMask) continue;
    tol = loosest(tol, tolerance_for(input_dtype(spec, p.dtype), p.op->accumulation));
  }
  return tol;
}

// The checks report through EXPECT/ASSERT; an ASSERT ends only the current check.
void check_forward(const SuiteParam& p) {
  const OpCase& op = *p.op;
  poison_new_memory(p.device);
  std::vector<LaidOutInput> inputs = make_case_inputs(p, p.device);
  Ts tensors = input_tensors(inputs);
  Ts outputs = op.run(tensors);

  Rs expected;
  if (p.device.is_cpu()) {
    Rs values;
    for (const LaidOutInput& in : inputs) values.push_back(in.values);
    expected = op.ref(values);
  } else {
    for (const Tensor& out : op.run(input_tensors(make_case_inputs(p, Device::cpu())))) {
      expected.push_back(to_ref(out));
    }
  }
  ASSERT_EQ(outputs.size(), expected.size()) << "number of outputs";
  DType out_dtype = op.out_dtype ? op.out_dtype(p.dtype) : p.dtype;
  Tolerance tol = case_tolerance(p, out_dtype);
  for (size_t j = 0; j < outputs.size(); ++j) {
    SCOPED_TRACE("output " + std::to_string(j));
    EXPECT_EQ(dtype_name(outputs[j].dtype()), dtype_name(out_dtype)) << "output dtype";
    EXPECT_EQ(outputs[j].device(), p.device) << "output device";
    EXPECT_FALSE(outputs[j].requires_grad()) << "no input requires grad";
    EXPECT_TRUE(values_close(expected[j], to_ref(outputs[j]), tol));
  }
  // Ops never write into their inputs.
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_TRUE(values_close(inputs[i].values, to_ref(tensors[i]), {}))
        << "input " << i << " was modified";
  }
}

// The leaves are the inputs as laid out (non-contiguous for kTransposed / kSliced); for
// kExpanded the leaf is the un-expanded base, expanded inside the function.
MultiOutputFn differentiated_fn(const OpCase& op, const std::vector<LaidOutInput>& inputs) {
  std::vector<std::function<Tensor(const Tensor&)>> views;
  for (const LaidOutInput& in : inputs) views.push_back(in.view);
  return [&op, views](const Ts& leaves) {
    Ts viewed;
    for (size_t i = 0; i < leaves.size(); ++i) viewed.push_back(views[i](leaves[i]));
    return op.run(viewed);
  };
}

Ts leaves_of(const std::vector<LaidOutInput>& inputs) {
  Ts leaves;
  for (const LaidOutInput& in : inputs) leaves.push_back(in.leaf);
  return leaves;
}

void check_gradient(const SuiteParam& p) {
  const OpCase& op = *p.op;
  poison_new_memory(p.device);
  std::vector<LaidOutInput> inputs = make_case_inputs(p, p.device);
  if (p.device.is_cpu()) {
    EXPECT_TRUE(gradcheck(differentiated_fn(op, inputs), leaves_of(inputs)));
    return;
  }
  std::vector<LaidOutInput> cpu_inputs = make_case_inputs(p, Device::cpu());
  const uint64_t seed = GradcheckOptions{}.seed;
  Ts expected = analytic_gradients(differentiated_fn(op, cpu_inputs), leaves_of(cpu_inputs), seed);
  Ts got = analytic_gradients(differentiated_fn(op, inputs), leaves_of(inputs), seed);
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("input " + std::to_string(i));
    ASSERT_EQ(expected[i].defined(), got[i].defined());
    if (expected[i].defined()) {
      EXPECT_TRUE(values_close(to_ref(expected[i]), to_ref(got[i]),
                               tolerance_for(DType::kFloat64, op.accumulation)));
    }
  }
}

class OpForward : public ::testing::TestWithParam<SuiteTest> {};
class OpGradient : public ::testing::TestWithParam<SuiteTest> {};

// Runs check on every (dtype, layout) of t, naming both in any failure.
void for_each_check(const SuiteTest& t, void (*check)(const SuiteParam&)) {
  for (DType dtype : t.dtypes) {
    for (Layout layout : t.layouts) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::string(layout_name(layout)));
      check({t.op, dtype, layout, t.device});
    }
  }
}

TEST_P(OpForward, MatchesReference) { for_each_check(GetParam(), check_forward); }
TEST_P(OpGradient, MatchesFiniteDifferences) { for_each_check(GetParam(), check_gradient); }

INSTANTIATE_TEST_SUITE_P(Ops, OpForward, ::testing::ValuesIn(make_tests(false)), test_name);
INSTANTIATE_TEST_SUITE_P(Ops, OpGradient, ::testing::ValuesIn(make_tests(true)), test_name);

// ---------------------------------------------------------------------------------------
// Dropout with p in (0, 1): statistical properties the table cannot express.

class DropoutForward : public ::testing::TestWithParam<DType> {};

TEST_P(DropoutForward, ZeroesAboutPAndScalesSurvivors) {
  const DType dtype = GetParam();
  const double p = 0.3;
  std::mt19937_64 rng(77);
  RefArray values = random_values({40, 50}, Domain::kAny, dtype, rng);
  Tensor x = from_ref(values, dtype);
  RefArray x_values = to_ref(x);  // rounded to the dtype

  Generator gen(2024);
  RefArray y = to_ref(dropout(x, p, /*training=*/true, gen));
  EXPECT_NE(gen.state().offset, 0u) << "dropout must advance the generator";
  Tolerance tol = tolerance_for(dtype);
  int64_t zeros = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    if (y.data[i] == 0.0) {
      ++zeros;
      continue;
    }
    double want = x_values.data[i] / (1.0 - p);
    ASSERT_LE(std::abs(y.data[i] - want), tol.atol + tol.rtol * std::abs(want))
        << "element " << i << ": survivor must be x / (1 - p)";
  }
  double fraction = static_cast<double>(zeros) / static_cast<double>(y.numel());
  EXPECT_NEAR(fraction, p, 0.04) << "fraction of zeros";

  Generator same(2024);
  RefArray y_same = to_ref(dropout(x, p, true, same));
  EXPECT_EQ(y.data, y_same.data) << "same seed must give the same mask";
  Generator other(2025);
  RefArray y_other = to_ref(dropout(x, p, true, other));
  EXPECT_NE(y.data, y_other.data) << "another seed must give another mask";
  RefArray y_next = to_ref(dropout(x, p, true, gen));
  EXPECT_NE(y.data, y_next.data) << "a second draw from the advanced generator must differ";
}

INSTANTIATE_TEST_SUITE_P(Ops, DropoutForward, ::testing::ValuesIn(kFloat),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_short_name(info.param));
                         });

TEST(OpTable, CoversEveryDTypeAxisAndHasUniqueNames) {
  std::set<std::string> names;
  std::set<DType> dtypes;
  for (const OpCase& op : all_cases()) {
    EXPECT_TRUE(names.insert(op.name).second) << op.name;
    EXPECT_TRUE(op.ref || op.differentiable) << op.name << " checks nothing";
    dtypes.insert(op.dtypes.begin(), op.dtypes.end());
  }
  EXPECT_EQ(dtypes.size(), std::size(kAllDTypes));
  EXPECT_GT(count_checks(make_tests(false)), 6000);
  EXPECT_GT(count_checks(make_tests(true)), 1000);
}

// ---------------------------------------------------------------------------------------
// The harness itself must be able to fail.

TEST(Harness, LayoutsReallyChangeStridesButNotValues) {
  DrawFn draw = [](const Shape& s, std::mt19937_64& r) {
    return random_values(s, Domain::kAny, DType::kFloat32, r);
  };
  std::mt19937_64 rng(1);
  LaidOutInput transposed =
      make_input({3, 4}, DType::kFloat32, Layout::kTransposed, Device::cpu(), draw, rng);
  EXPECT_FALSE(transposed.input().is_contiguous());
  LaidOutInput sliced =
      make_input({3, 4}, DType::kFloat32, Layout::kSliced, Device::cpu(), draw, rng);
  EXPECT_EQ(sliced.input().stride(-1), 2);
  EXPECT_EQ(sliced.input().offset(), 1);
  LaidOutInput expanded =
      make_input({3, 4}, DType::kFloat32, Layout::kExpanded, Device::cpu(), draw, rng);
  EXPECT_EQ(expanded.input().stride(0), 0);
  EXPECT_EQ(expanded.leaf.shape(), (Shape{1, 4}));
  for (const LaidOutInput* in : {&transposed, &sliced, &expanded}) {
    EXPECT_EQ(in->input().shape(), (Shape{3, 4}));
    EXPECT_TRUE(values_close(in->values, to_ref(in->input().contiguous()), {}));
    for (double v : in->values.data) EXPECT_GE(std::abs(v), 0.099);
  }
}

TEST(Harness, PoisonedMemoryCannotPassForAResult) {
  for (Device device : suite_devices()) {
    poison_new_memory(device);
    for (DType dtype : kFloat) {
      SCOPED_TRACE(device_tag(device) + " " + std::string(dtype_name(dtype)));
      RefArray unwritten = to_ref(empty({257}, TensorOptions(dtype).with_device(device)));
      for (double v : unwritten.data) ASSERT_FALSE(std::abs(v) < 1e38) << v;
    }
  }
}

TEST(Harness, ValuesCloseRejectsDifferences) {
  Tolerance tol = tolerance_for(DType::kFloat32);
  EXPECT_TRUE(values_close(RefArray({2}, {1.0, 2.0}), RefArray({2}, {1.0, 2.0 + 1e-6}), tol));
  EXPECT_FALSE(values_close(RefArray({2}, {1.0, 2.0}), RefArray({2}, {1.0, 2.001}), tol));
  EXPECT_FALSE(values_close(RefArray({2}, {1.0, 2.0}), RefArray({1, 2}, {1.0, 2.0}), tol));
  EXPECT_FALSE(values_close(RefArray({}, {1.0}), RefArray({}, {NAN}), tol));
  EXPECT_TRUE(values_close(RefArray({}, {NAN}), RefArray({}, {NAN}), tol));
}

// y = 2 x with a backward that returns `slope` * grad.
Tensor doubled_with_backward_slope(const Tensor& x, double slope) {
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = mul(x, 2.0);
  }
  if (autograd::needs_grad({&x})) {
    autograd::record(out, "doubled", {x}, [slope](const Tensor& g) { return Ts{mul(g, slope)}; });
  }
  return out;
}

TEST(Harness, GradcheckCatchesAWrongBackward) {
  Tensor x = from_vector<double>({0.5, -1.0, 2.0}, {3});
  EXPECT_TRUE(gradcheck([](const Ts& in) { return doubled_with_backward_slope(in[0], 2.0); }, {x}));
  EXPECT_FALSE(
      gradcheck([](const Ts& in) { return doubled_with_backward_slope(in[0], 2.001); }, {x}));
  // Through a non-contiguous input, too.
  Tensor base = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_TRUE(
      gradcheck([](const Ts& in) { return doubled_with_backward_slope(in[0], 2.0); }, {base.t()}));
  EXPECT_FALSE(
      gradcheck([](const Ts& in) { return doubled_with_backward_slope(in[0], 1.0); }, {base.t()}));
}

}  // namespace
}  // namespace rd::test
