// Kernel-level tests of the CPU backend: the parts the tensor API cannot reach directly
// (overlapping accumulate, broadcast strides, thread-count determinism, GEMM leading dims and
// batch strides, reduction edge cases, dtype errors), against plain float64 references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/kernels/view_checks.h"
#include "testing/dtype_precision.h"
#include "testing/host_views.h"

namespace rd::kernels {
namespace {

KernelBackend& cpu() { return cpu_backend(); }

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};

using test::unit_roundoff;

// The value v becomes when stored in dtype t (what a correct kernel must produce).
double stored(DType t, double v) {
  switch (t) {
    case DType::kFloat32: return static_cast<float>(v);
    case DType::kFloat64: return v;
    case DType::kBFloat16: return static_cast<float>(BFloat16(static_cast<float>(v)));
    case DType::kFloat16: return static_cast<float>(Float16(static_cast<float>(v)));
    case DType::kInt32: return static_cast<int32_t>(v);
    case DType::kInt64: return static_cast<double>(static_cast<int64_t>(v));
    case DType::kBool: return v != 0 ? 1.0 : 0.0;
  }
  return 0;
}

// A host buffer of any dtype, with element access as double and StridedView construction.
class Buffer {
 public:
  Buffer(DType dtype, int64_t count)
      : dtype_(dtype), count_(count), storage_((count * dtype_size(dtype) + 7) / 8 + 1) {}

  DType dtype() const { return dtype_; }
  int64_t size() const { return count_; }
  void* data() { return storage_.data(); }

  double get(int64_t i) const { return test::load_element(element(i), dtype_); }
  void set(int64_t i, double v) { test::store_element(element(i), dtype_, v); }
  // Random values: integers in [-9, 9] for int types, {0,1} for bool, nonzero floats in
  // [lo, hi] otherwise (rounded to the dtype).
  void randomize(std::mt19937& rng, double lo = -2.0, double hi = 2.0) {
    std::uniform_real_distribution<double> real(lo, hi);
    std::uniform_int_distribution<int> integer(-9, 9);
    for (int64_t i = 0; i < count_; ++i) {
      if (dtype_ == DType::kBool) {
        set(i, integer(rng) > 0);
      } else if (dtype_ == DType::kInt32 || dtype_ == DType::kInt64) {
        set(i, integer(rng));
      } else {
        double v = real(rng);
        set(i, v == 0 ? 0.5 : v);
      }
    }
  }

  // A view with the given shape and element strides (row-major contiguous if empty).
  StridedView view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides = {},
                   int64_t offset = 0) {
    return test::make_view(data(), dtype_, shape, strides, offset);
  }

 private:
  const unsigned char* element(int64_t i) const {
    return reinterpret_cast<const unsigned char*>(storage_.data()) + i * dtype_size(dtype_);
  }
  unsigned char* element(int64_t i) {
    return reinterpret_cast<unsigned char*>(storage_.data()) + i * dtype_size(dtype_);
  }

  DType dtype_;
  int64_t count_;
  std::vector<uint64_t> storage_;  // 8-byte aligned for every dtype
};

// Offset (in elements) of a multi-index within a view.
int64_t offset_of(const StridedView& v, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (int d = 0; d < v.ndim; ++d) off += idx[d] * v.strides[d];
  return off;
}

// Calls f(idx) for every multi-index of `shape` in row-major order.
void for_each_index(const std::vector<int64_t>& shape,
                    const std::function<void(const std::vector<int64_t>&)>& f) {
  int64_t total = 1;
  for (int64_t s : shape) total *= s;
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t n = 0; n < total; ++n) {
    f(idx);
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Runs f and expects an rd::Error with `code` whose message contains `fragment`.
void expect_error(const std::function<void()>& f, ErrorCode code, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an rd::Error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

// Sets the CPU thread count for one scope.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(cpu::num_threads()) { cpu::set_num_threads(n); }
  ~ThreadCount() { cpu::set_num_threads(saved_); }

 private:
  int saved_;
};

// ---------------------------------------------------------------------------------------
// Data movement
// ---------------------------------------------------------------------------------------

TEST(CpuKernelsTest, CopyConvertsEveryDtypePairThroughBroadcastAndTransposedViews) {
  std::mt19937 rng(1);
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      Buffer in(from, 3 * 5);
      in.randomize(rng);
      Buffer out(to, 3 * 4 * 5);
      // in [3, 5] broadcast along a new middle dim of 4; out stored transposed ([5, 4, 3]).
      StridedView src = in.view({3, 4, 5}, {5, 0, 1});
      StridedView dst = out.view({3, 4, 5}, {1, 15, 3});
      cpu().copy(dst, src);
      for_each_index({3, 4, 5}, [&](const std::vector<int64_t>& i) {
        double want = stored(to, in.get(i[0] * 5 + i[2]));
        ASSERT_EQ(out.get(offset_of(dst, i)), want) << dtype_name(from) << " -> " << dtype_name(to);
      });
    }
  }
}

TEST(CpuKernelsTest, AccumulateIntoOverlappingOutputAppliesAddsInOrder) {
  std::mt19937 rng(2);
  // out [1024, 1024] with row stride 0: every row adds into the same 1024 floats. Large
  // enough that the parallel path would race (and lose adds) if taken.
  const int64_t rows = 1024;
  Buffer out(DType::kFloat32, 1024), in(DType::kFloat32, rows * 1024);
  out.randomize(rng);
  in.randomize(rng);
  std::vector<float> want(1024);
  for (int j = 0; j < 1024; ++j) {
    float acc = static_cast<float>(out.get(j));
    for (int64_t i = 0; i < rows; ++i) acc += static_cast<float>(in.get(i * 1024 + j));
    want[j] = acc;
  }
  cpu().accumulate(out.view({rows, 1024}, {0, 1}), in.view({rows, 1024}));
  for (int j = 0; j < 1024; ++j) ASSERT_EQ(out.get(j), want[j]) << j;

  // Partially overlapping rows: row i covers [2i, 2i + 3).
  Buffer out2(DType::kFloat64, 2 * 20000 + 1), in2(DType::kFloat64, 20000 * 3);
  out2.randomize(rng);
  in2.randomize(rng);
  std::vector<double> want2(out2.size());
  for (int64_t k = 0; k < out2.size(); ++k) want2[k] = out2.get(k);
  for (int64_t i = 0; i < 20000; ++i) {
    for (int j = 0; j < 3; ++j) want2[2 * i + j] += in2.get(i * 3 + j);
  }
  cpu().accumulate(out2.view({20000, 3}, {2, 1}), in2.view({20000, 3}));
  for (int64_t k = 0; k < out2.size(); ++k) ASSERT_EQ(out2.get(k), want2[k]) << k;
}

// A 16-bit float adds into float32 widened: each sum is the float32 sum of the two values,
// rounded once (in float32), into distinct and overlapping outputs. Other mixes are refused.
TEST(CpuKernelsTest, AccumulateWidensSixteenBitFloatsIntoFloat32) {
  std::mt19937 rng(4);
  for (DType narrow : {DType::kBFloat16, DType::kFloat16}) {
    Buffer out(DType::kFloat32, 6 * 40), in(narrow, 6 * 40);
    out.randomize(rng);
    in.randomize(rng);
    std::vector<float> want(out.size());
    for (int64_t k = 0; k < out.size(); ++k) {
      want[k] = static_cast<float>(out.get(k)) + static_cast<float>(in.get(k));
    }
    cpu().accumulate(out.view({6, 40}), in.view({6, 40}));
    for (int64_t k = 0; k < out.size(); ++k) ASSERT_EQ(out.get(k), want[k]) << k;

    Buffer row(DType::kFloat32, 40);  // six rows into one, in order
    row.randomize(rng);
    std::vector<float> want_row(40);
    for (int j = 0; j < 40; ++j) {
      float acc = static_cast<float>(row.get(j));
      for (int i = 0; i < 6; ++i) acc += static_cast<float>(in.get(i * 40 + j));
      want_row[j] = acc;
    }
    cpu().accumulate(row.view({6, 40}, {0, 1}), in.view({6, 40}));
    for (int j = 0; j < 40; ++j) ASSERT_EQ(row.get(j), want_row[j]) << j;
  }
  Buffer f32(DType::kFloat32, 4), f64(DType::kFloat64, 4), bf16(DType::kBFloat16, 4);
  expect_error([&] { cpu().accumulate(bf16.view({4}), f32.view({4})); }, ErrorCode::kDTypeMismatch,
               "accumulate: argument 'in' has dtype float32");
  expect_error([&] { cpu().accumulate(f64.view({4}), bf16.view({4})); }, ErrorCode::kDTypeMismatch,
               "accumulate");
}

TEST(CpuKernelsTest, OverlapDetectionIsExactOnCommonLayouts) {
  Buffer b(DType::kFloat32, 64);
  EXPECT_TRUE(has_distinct_elements(b.view({4, 8})));
  EXPECT_TRUE(has_distinct_elements(b.view({8, 4}, {1, 8})));         // transposed
  EXPECT_TRUE(has_distinct_elements(b.view({3, 2, 5}, {20, 1, 2})));  // interleaved
  EXPECT_TRUE(has_distinct_elements(b.view({1, 4}, {0, 1})));         // size-1 dim
  EXPECT_TRUE(has_distinct_elements(b.view({0, 4}, {0, 1})));         // empty
  EXPECT_FALSE(has_distinct_elements(b.view({4, 8}, {0, 1})));        // broadcast
  EXPECT_FALSE(has_distinct_elements(b.view({4, 3}, {2, 1})));        // rows overlap
  EXPECT_FALSE(has_distinct_elements(b.view({2, 3, 2}, {3, 2, 1})));  // offset 3 twice
}

TEST(CpuKernelsTest, AccumulateIntoTransposedViewIsExact) {
  std::mt19937 rng(3);
  for (DType t : kAllDTypes) {
    Buffer out(t, 300 * 200), in(t, 300 * 200);
    out.randomize(rng);
    in.randomize(rng);
    std::vector<double> want(out.size());
    StridedView dst = out.view({200, 300}, {1, 200});  // transposed
    for_each_index({200, 300}, [&](const std::vector<int64_t>& i) {
      double a = out.get(offset_of(dst, i)), b = in.get(i[0] * 300 + i[1]);
      want[offset_of(dst, i)] = t == DType::kBool ? (a != 0 || b != 0) : stored(t, a + b);
    });
    cpu().accumulate(dst, in.view({200, 300}));
    for (int64_t k = 0; k < out.size(); ++k) ASSERT_EQ(out.get(k), want[k]) << dtype_name(t);
  }
}

TEST(CpuKernelsTest, FillAndArangeConvertToEveryDtype) {
  for (DType t : kAllDTypes) {
    Buffer b(t, 10);
    cpu().fill(b.view({5}, {2}), 3.0);
    cpu().arange(b.view({5}, {2}, 1), 1.0, 2.0);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(b.get(2 * i), stored(t, 3.0)) << dtype_name(t);
      EXPECT_EQ(b.get(2 * i + 1), stored(t, 1.0 + 2.0 * i)) << dtype_name(t);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------

struct UnaryCase {
  UnaryOp op;
  std::function<double(double)> ref;
  double lo, hi;  // input range
};

double gelu_tanh_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double gelu_erf_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double central_difference(const std::function<double(double)>& f, double x) {
  const double h = 1e-5;
  return (f(x + h) - f(x - h)) / (2 * h);
}

TEST(CpuKernelsTest, UnaryOpsMatchFloat64References) {
  const std::vector<UnaryCase> cases = {
      {UnaryOp::kNeg, [](double x) { return -x; }, -3, 3},
      {UnaryOp::kAbs, [](double x) { return std::fabs(x); }, -3, 3},
      {UnaryOp::kExp, [](double x) { return std::exp(x); }, -3, 3},
      {UnaryOp::kLog, [](double x) { return std::log(x); }, 0.1, 5},
      {UnaryOp::kSqrt, [](double x) { return std::sqrt(x); }, 0.1, 5},
      {UnaryOp::kRsqrt, [](double x) { return 1 / std::sqrt(x); }, 0.1, 5},
      {UnaryOp::kTanh, [](double x) { return std::tanh(x); }, -3, 3},
      {UnaryOp::kSigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, -6, 6},
      {UnaryOp::kRelu, [](double x) { return x > 0 ? x : 0; }, -3, 3},
      {UnaryOp::kSilu, [](double x) { return x / (1 + std::exp(-x)); }, -6, 6},
      {UnaryOp::kGeluTanh, gelu_tanh_ref, -4, 4},
      {UnaryOp::kGeluErf, gelu_erf_ref, -4, 4},
      // The gradient ops are checked against numerical derivatives of the forward refs.
      {UnaryOp::kGeluTanhGrad, [](double x) { return central_difference(gelu_tanh_ref, x); }, -4,
       4},
      {UnaryOp::kGeluErfGrad, [](double x) { return central_difference(gelu_erf_ref, x); }, -4, 4},
      {UnaryOp::kPowScalar, [](double x) { return std::pow(x, 2.5); }, 0.1, 3},
      {UnaryOp::kClamp, [](double x) { return std::min(std::max(x, -0.5), 1.25); }, -3, 3},
  };
  UnaryParams params;
  params.scalar = 2.5;
  params.lo = -0.5;
  params.hi = 1.25;
  std::mt19937 rng(4);
  for (DType t : kFloatTypes) {
    for (const UnaryCase& c : cases) {
      Buffer in(t, 200), out(t, 200);
      in.randomize(rng, c.lo, c.hi);
      cpu().unary(c.op, out.view({10, 20}), in.view({10, 20}, {1, 10}), params);
      // Inputs are exact in t; the result may be off by t's rounding plus float32 math.
      double tol = 4 * std::max(unit_roundoff(t), 1e-9) + (t == DType::kFloat64 ? 1e-9 : 4e-7);
      for (int64_t i = 0; i < 10; ++i) {
        for (int64_t j = 0; j < 20; ++j) {
          double want = c.ref(in.get(j * 10 + i));
          EXPECT_NEAR(out.get(i * 20 + j), want, tol * std::max(1.0, std::fabs(want)))
              << dtype_name(t) << " op " << static_cast<int>(c.op) << " x=" << in.get(j * 10 + i);
        }
      }
    }
  }
  // Clamp with one bound only.
  Buffer in(DType::kFloat32, 4), out(DType::kFloat32, 4);
  for (int i = 0; i < 4; ++i) in.set(i, i - 1.5);
  UnaryParams lo_only;
  lo_only.lo = 0.0;
  cpu().unary(UnaryOp::kClamp, out.view({4}), in.view({4}), lo_only);
  EXPECT_EQ(out.get(0), 0.0);
  EXPECT_EQ(out.get(3), 1.5);
}

TEST(CpuKernelsTest, IntegerUnaryAndBinaryOps) {
  for (DType t : {DType::kInt32, DType::kInt64}) {
    Buffer a(t, 12), b(t, 4), out(t, 12);
    for (int i = 0; i < 12; ++i) a.set(i, i * 7 % 11 - 5);
    for (int i = 0; i < 4; ++i) b.set(i, i - 2 == 0 ? 3 : i - 2);
    cpu().unary(UnaryOp::kNeg, out.view({12}), a.view({12}), {});
    for (int i = 0; i < 12; ++i) EXPECT_EQ(out.get(i), -a.get(i));
    cpu().unary(UnaryOp::kAbs, out.view({12}), a.view({12}), {});
    for (int i = 0; i < 12; ++i) EXPECT_EQ(out.get(i), std::fabs(a.get(i)));
    // a as [3, 4] op b broadcast over rows.
    StridedView av = a.view({3, 4}), bv = b.view({3, 4}, {0, 1}), ov = out.view({3, 4});
    const std::vector<std::pair<BinaryOp, std::function<double(double, double)>>> ops = {
        {BinaryOp::kAdd, [](double x, double y) { return x + y; }},
        {BinaryOp::kSub, [](double x, double y) { return x - y; }},
        {BinaryOp::kMul, [](double x, double y) { return x * y; }},
        {BinaryOp::kMaximum, [](double x, double y) { return std::max(x, y); }},
        {BinaryOp::kMinimum, [](double x, double y) { return std::min(x, y); }},
    };
    for (const auto& [op, ref] : ops) {
      cpu().binary(op, ov, av, bv);
      for (int i = 0; i < 12; ++i) EXPECT_EQ(out.get(i), ref(a.get(i), b.get(i % 4)));
    }
    Buffer flags(DType::kBool, 12);
    cpu().binary(BinaryOp::kLt, flags.view({3, 4}), av, bv);
    for (int i = 0; i < 12; ++i) EXPECT_EQ(flags.get(i), a.get(i) < b.get(i % 4) ? 1.0 : 0.0);
  }
}

TEST(CpuKernelsTest, BinaryOpsBroadcastAndCompareForFloatTypes) {
  std::mt19937 rng(5);
  const std::vector<std::pair<BinaryOp, std::function<double(double, double)>>> ops = {
      {BinaryOp::kAdd, [](double x, double y) { return x + y; }},
      {BinaryOp::kSub, [](double x, double y) { return x - y; }},
      {BinaryOp::kMul, [](double x, double y) { return x * y; }},
      {BinaryOp::kDiv, [](double x, double y) { return x / y; }},
      {BinaryOp::kPow, [](double x, double y) { return std::pow(std::fabs(x), y); }},
      {BinaryOp::kMaximum, [](double x, double y) { return std::max(x, y); }},
      {BinaryOp::kMinimum, [](double x, double y) { return std::min(x, y); }},
  };
  const std::vector<std::pair<BinaryOp, std::function<bool(double, double)>>> comparisons = {
      {BinaryOp::kEq, [](double x, double y) { return x == y; }},
      {BinaryOp::kNe, [](double x, double y) { return x != y; }},
      {BinaryOp::kLt, [](double x, double y) { return x < y; }},
      {BinaryOp::kLe, [](double x, double y) { return x <= y; }},
      {BinaryOp::kGt, [](double x, double y) { return x > y; }},
      {BinaryOp::kGe, [](double x, double y) { return x >= y; }},
  };
  for (DType t : kFloatTypes) {
    Buffer a(t, 6 * 7), b(t, 7), out(t, 6 * 7), flags(DType::kBool, 6 * 7);
    a.randomize(rng, 0.5, 2.0);
    b.randomize(rng, 0.5, 2.0);
    a.set(3, b.get(3));  // one equal pair for the comparisons
    StridedView av = a.view({6, 7}), bv = b.view({6, 7}, {0, 1}), ov = out.view({6, 7});
    for (const auto& [op, ref] : ops) {
      cpu().binary(op, ov, av, bv);
      for (int i = 0; i < 42; ++i) {
        double want = stored(t, ref(a.get(i), b.get(i % 7)));
        EXPECT_NEAR(out.get(i), want, 2 * unit_roundoff(t) * std::fabs(want) + 1e-300)
            << dtype_name(t) << " op " << static_cast<int>(op);
      }
    }
    for (const auto& [op, ref] : comparisons) {
      cpu().binary(op, flags.view({6, 7}), av, bv);
      for (int i = 0; i < 42; ++i) {
        EXPECT_EQ(flags.get(i), ref(a.get(i), b.get(i % 7)) ? 1.0 : 0.0) << dtype_name(t);
      }
    }
  }
  // NaN propagates through maximum/minimum.
  Buffer x(DType::kFloat32, 2), y(DType::kFloat32, 2), z(DType::kFloat32, 2);
  x.set(0, NAN);
  x.set(1, 1.0);
  y.set(0, 1.0);
  y.set(1, NAN);
  cpu().binary(BinaryOp::kMaximum, z.view({2}), x.view({2}), y.view({2}));
  EXPECT_TRUE(std::isnan(z.get(0)) && std::isnan(z.get(1)));
}

TEST(CpuKernelsTest, LogicalAndAndWhere) {
  Buffer p(DType::kBool, 4), q(DType::kBool, 4), r(DType::kBool, 4);
  for (int i = 0; i < 4; ++i) {
    p.set(i, i & 1);
    q.set(i, i & 2);
  }
  cpu().binary(BinaryOp::kLogicalAnd, r.view({4}), p.view({4}), q.view({4}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r.get(i), i == 3 ? 1.0 : 0.0);

  std::mt19937 rng(6);
  for (DType t : kAllDTypes) {
    Buffer cond(DType::kBool, 15), a(t, 15), b(t, 5), out(t, 15);
    cond.randomize(rng);
    a.randomize(rng);
    b.randomize(rng);
    cpu().where(out.view({3, 5}), cond.view({3, 5}), a.view({3, 5}), b.view({3, 5}, {0, 1}));
    for (int i = 0; i < 15; ++i) {
      EXPECT_EQ(out.get(i), cond.get(i) != 0 ? a.get(i) : b.get(i % 5)) << dtype_name(t);
    }
  }
}

TEST(CpuKernelsTest, FloatOnlyOpsRejectOtherDtypesNamingTheOp) {
  Buffer ints(DType::kInt32, 4), out(DType::kInt32, 4), bools(DType::kBool, 4);
  expect_error([&] { cpu().unary(UnaryOp::kExp, out.view({4}), ints.view({4}), {}); },
               ErrorCode::kDTypeMismatch, "exp");
  expect_error([&] { cpu().unary(UnaryOp::kGeluTanh, out.view({4}), ints.view({4}), {}); },
               ErrorCode::kDTypeMismatch, "gelu_tanh");
  expect_error([&] { cpu().binary(BinaryOp::kPow, out.view({4}), ints.view({4}), ints.view({4})); },
               ErrorCode::kDTypeMismatch, "pow");
  expect_error(
      [&] { cpu().binary(BinaryOp::kAdd, bools.view({4}), bools.view({4}), bools.view({4})); },
      ErrorCode::kDTypeMismatch, "add");
  expect_error(
      [&] { cpu().binary(BinaryOp::kLogicalAnd, out.view({4}), ints.view({4}), ints.view({4})); },
      ErrorCode::kDTypeMismatch, "logical_and");
  Buffer one(DType::kInt32, 1);
  expect_error([&] { cpu().reduce(ReduceOp::kMean, one.view({1}), ints.view({4}), 1); },
               ErrorCode::kDTypeMismatch, "mean");
  expect_error(
      [&] {
        cpu().softmax({.out = out.data(),
                       .in = ints.data(),
                       .dtype = DType::kInt32,
                       .rows = 2,
                       .cols = 2,
                       .log = false});
      },
      ErrorCode::kDTypeMismatch, "softmax");
  GemmArgs g;
  g.dtype = DType::kInt64;
  g.m = g.n = g.k = 1;
  g.lda = g.ldb = g.ldc = 1;
  expect_error([&] { cpu().gemm(g); }, ErrorCode::kDTypeMismatch, "gemm");
  Buffer floats(DType::kFloat32, 4);
  expect_error(
      [&] { cpu().binary(BinaryOp::kAdd, out.view({4}), floats.view({4}), ints.view({4})); },
      ErrorCode::kDTypeMismatch, "binary");
  expect_error(
      [&] {
        cpu().copy(out.view({4}), floats.view({2, 2}));
      },
      ErrorCode::kShapeMismatch, "copy");
}

// ---------------------------------------------------------------------------------------
// Reductions and scans
// ---------------------------------------------------------------------------------------

// Reference reduction of a view over mask, in double. `magnitude` (if given) receives, per
// output, the sum of |x| (divided by the count for kMean): the scale of rounding errors.
std::vector<double> reference_reduce(ReduceOp op, const Buffer& buf, const StridedView& v,
                                     uint32_t mask, std::vector<double>* magnitude = nullptr) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim), out_shape = shape;
  for (int d = 0; d < v.ndim; ++d) {
    if ((mask >> d) & 1) out_shape[d] = 1;
  }
  int64_t outputs = 1;
  for (int64_t s : out_shape) outputs *= s;
  std::vector<std::vector<double>> groups(outputs);
  for_each_index(shape, [&](const std::vector<int64_t>& idx) {
    int64_t o = 0;
    for (int d = 0; d < v.ndim; ++d) o = o * out_shape[d] + (((mask >> d) & 1) ? 0 : idx[d]);
    groups[o].push_back(buf.get(offset_of(v, idx)));
  });
  std::vector<double> result;
  for (const auto& g : groups) {
    double r = 0;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: {
        double mag = 0;
        for (double x : g) {
          r += x;
          mag += std::fabs(x);
        }
        if (op == ReduceOp::kMean) {
          r /= g.size();
          mag /= g.size();
        }
        if (magnitude) magnitude->push_back(mag);
        break;
      }
      case ReduceOp::kMax:
        r = -INFINITY;
        for (double x : g) r = std::max(r, x);
        break;
      case ReduceOp::kMin:
        r = INFINITY;
        for (double x : g) r = std::min(r, x);
        break;
      case ReduceOp::kArgMax:
      case ReduceOp::kArgMin:
        for (size_t i = 1, best = 0; i < g.size(); ++i) {
          bool better = op == ReduceOp::kArgMax ? g[i] > g[best] : g[i] < g[best];
          if (better) r = static_cast<double>(best = i);
        }
        break;
      case ReduceOp::kLogSumExp: {
        double m = -INFINITY, s = 0, largest = 0;
        for (double x : g) {
          m = std::max(m, x);
          largest = std::max(largest, std::fabs(x));
        }
        for (double x : g) s += std::exp(x - m);
        r = m + std::log(s);
        // m and log(s) may cancel: errors scale with max|x| + log(count).
        if (magnitude) magnitude->push_back(largest + std::log(g.size()) + 1);
        break;
      }
    }
    result.push_back(r);
  }
  return result;
}

TEST(CpuKernelsTest, ReductionsOverDimMasksOfPermutedInputsMatchReference) {
  std::mt19937 rng(7);
  const std::vector<int64_t> shape = {3, 4, 5, 6};
  // A permuted view: memory order [5, 3, 6, 4] (dims 2, 0, 3, 1).
  const std::vector<int64_t> strides = {6 * 4, 1, 3 * 6 * 4, 4};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin,
                          ReduceOp::kLogSumExp};
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16,
                  DType::kInt32, DType::kInt64}) {
    Buffer in(t, 360);
    in.randomize(rng);
    StridedView iv = in.view(shape, strides);
    for (uint32_t mask : {0b0000u, 0b0001u, 0b0110u, 0b1010u, 0b1111u}) {
      std::vector<int64_t> out_shape = shape;
      int64_t outputs = 1;
      for (int d = 0; d < 4; ++d) {
        if ((mask >> d) & 1) out_shape[d] = 1;
        outputs *= out_shape[d];
      }
      for (ReduceOp op : ops) {
        bool float_only = op == ReduceOp::kMean || op == ReduceOp::kLogSumExp;
        if (float_only && !is_floating(t)) continue;
        Buffer out(t, outputs);
        cpu().reduce(op, out.view(out_shape), iv, mask);
        std::vector<double> magnitude;
        std::vector<double> want = reference_reduce(op, in, iv, mask, &magnitude);
        const int64_t count = 360 / outputs;
        for (int64_t o = 0; o < outputs; ++o) {
          // Output rounding, plus accumulation error: count * u * sum|x| for sums and means,
          // a few u times the magnitude for logsumexp.
          const double acc_u = t == DType::kFloat64 ? 1.2e-16 : 6e-8;
          double tol = 2 * unit_roundoff(t) * (std::fabs(want[o]) + 1e-3);
          if (op == ReduceOp::kLogSumExp) tol += 8 * acc_u * magnitude[o];
          if (op == ReduceOp::kSum || op == ReduceOp::kMean) tol += count * acc_u * magnitude[o];
          EXPECT_NEAR(out.get(o), want[o], tol)
              << dtype_name(t) << " op " << static_cast<int>(op) << " mask " << mask;
        }
      }
    }
  }
}

TEST(CpuKernelsTest, SumOfBoolIntoInt64AndEmptyReductions) {
  Buffer flags(DType::kBool, 10), count(DType::kInt64, 1);
  for (int i = 0; i < 10; ++i) flags.set(i, i % 3 == 0);
  cpu().reduce(ReduceOp::kSum, count.view({1}), flags.view({10}), 1);
  EXPECT_EQ(count.get(0), 4.0);

  Buffer empty(DType::kFloat32, 1), out(DType::kFloat32, 3), idx(DType::kInt64, 3);
  StridedView ev = empty.view({3, 0});
  out.set(0, 7);
  cpu().reduce(ReduceOp::kSum, out.view({3, 1}), ev, 0b10);
  EXPECT_EQ(out.get(0), 0.0);
  cpu().reduce(ReduceOp::kMean, out.view({3, 1}), ev, 0b10);
  EXPECT_TRUE(std::isnan(out.get(1)));
  cpu().reduce(ReduceOp::kLogSumExp, out.view({3, 1}), ev, 0b10);
  EXPECT_EQ(out.get(2), -INFINITY);
  expect_error(
      [&] {
        cpu().reduce(ReduceOp::kMax, out.view({3, 1}), ev, 0b10);
      },
      ErrorCode::kInvalidArgument, "max");
  expect_error(
      [&] {
        cpu().reduce(ReduceOp::kArgMin, idx.view({3, 1}), ev, 0b10);
      },
      ErrorCode::kInvalidArgument, "argmin");
  // argmax needs one reduced dim and an int64 output.
  Buffer x(DType::kFloat32, 6);
  expect_error(
      [&] {
        cpu().reduce(ReduceOp::kArgMax, idx.view({1, 1}), x.view({2, 3}), 0b11);
      },
      ErrorCode::kInvalidArgument, "argmax");
  expect_error(
      [&] {
        cpu().reduce(ReduceOp::kArgMax, out.view({2, 1}), x.view({2, 3}), 0b10);
      },
      ErrorCode::kDTypeMismatch, "argmax");
  expect_error(
      [&] {
        cpu().reduce(ReduceOp::kSum, out.view({2, 3}), x.view({2, 3}), 0b10);
      },
      ErrorCode::kShapeMismatch, "sum");
}

TEST(CpuKernelsTest, ArgMaxAndArgMinReturnTheFirstOccurrence) {
  // Rows with repeated extremes, reduced along dim 1 of a transposed view and along dim 0.
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
    Buffer in(t, 4 * 6);
    const double rows[4][6] = {
        {1, 5, 2, 5, 0, 5}, {-3, -3, -3, -3, -3, -3}, {2, 1, 0, 0, 1, 2}, {0, 9, 9, -9, -9, 3}};
    StridedView v = in.view({4, 6}, {1, 4});  // transposed storage
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 6; ++j) in.set(j * 4 + i, rows[i][j]);
    }
    Buffer out(DType::kInt64, 6);
    cpu().reduce(ReduceOp::kArgMax, out.view({4, 1}), v, 0b10);
    const double max_at[4] = {1, 0, 0, 1}, min_at[4] = {4, 0, 2, 3};
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.get(i), max_at[i]) << dtype_name(t) << " row " << i;
    cpu().reduce(ReduceOp::kArgMin, out.view({4, 1}), v, 0b10);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.get(i), min_at[i]) << dtype_name(t) << " row " << i;
    cpu().reduce(ReduceOp::kArgMax, out.view({1, 6}), v, 0b01);
    const double col_max_at[6] = {2, 3, 3, 0, 2, 0};
    for (int j = 0; j < 6; ++j) {
      EXPECT_EQ(out.get(j), col_max_at[j]) << dtype_name(t) << " col " << j;
    }
  }
  // A long row crosses chunk boundaries: the first of equal maxima (in the first chunk) wins,
  // and the first NaN beats everything.
  const int64_t n = 200000;
  Buffer big(DType::kFloat32, n), at(DType::kInt64, 1);
  std::mt19937 rng(8);
  big.randomize(rng);
  big.set(150000, 10.0);
  big.set(40000, 10.0);
  big.set(190000, 10.0);
  cpu().reduce(ReduceOp::kArgMax, at.view({1}), big.view({n}), 1);
  EXPECT_EQ(at.get(0), 40000.0);
  big.set(120000, NAN);
  big.set(180000, NAN);
  cpu().reduce(ReduceOp::kArgMax, at.view({1}), big.view({n}), 1);
  EXPECT_EQ(at.get(0), 120000.0);
  Buffer m(DType::kFloat32, 1);
  cpu().reduce(ReduceOp::kMax, m.view({1}), big.view({n}), 1);
  EXPECT_TRUE(std::isnan(m.get(0)));
}

TEST(CpuKernelsTest, LogSumExpHandlesInfinitiesAndLongRows) {
  const double inf = INFINITY;
  const double rows[4][4] = {{-inf, -inf, -inf, -inf},
                             {1.0, inf, 2.0, -inf},
                             {-inf, 0.5, -inf, -1.0},
                             {100.0, 100.0, 99.0, -50.0}};
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    Buffer in(t, 16), out(t, 4);
    for (int i = 0; i < 16; ++i) in.set(i, rows[i / 4][i % 4]);
    cpu().reduce(ReduceOp::kLogSumExp, out.view({4, 1}), in.view({4, 4}), 0b10);
    EXPECT_EQ(out.get(0), -inf);
    EXPECT_EQ(out.get(1), inf);
    double want2 = std::log(std::exp(0.5) + std::exp(-1.0));
    double want3 = 100 + std::log(2 + std::exp(-1.0) + std::exp(-150.0));
    EXPECT_NEAR(out.get(2), want2, 2 * unit_roundoff(t) * 2);
    EXPECT_NEAR(out.get(3), want3, 2 * unit_roundoff(t) * 101);
  }
  // Across chunks: -inf prefix chunks followed by finite values.
  const int64_t n = 100000;
  Buffer big(DType::kFloat32, n), out(DType::kFloat32, 1);
  std::mt19937 rng(9);
  big.randomize(rng, -3, 3);
  for (int64_t i = 0; i < 70000; ++i) big.set(i, -inf);
  double m = -inf, s = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, big.get(i));
  for (int64_t i = 0; i < n; ++i) s += std::exp(big.get(i) - m);
  cpu().reduce(ReduceOp::kLogSumExp, out.view({1}), big.view({n}), 1);
  EXPECT_NEAR(out.get(0), m + std::log(s), 1e-5);
}

TEST(CpuKernelsTest, LongFloat32SumsAreAccurateAndThreadCountIndependent) {
  const int64_t n = 1 << 21;
  Buffer in(DType::kFloat32, n);
  std::mt19937 rng(10);
  in.randomize(rng, 0.0, 1.0);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) want += in.get(i);
  Buffer one(DType::kFloat32, 4), two(DType::kFloat32, 4);
  {
    ThreadCount threads(1);
    cpu().reduce(ReduceOp::kSum, one.view({1}), in.view({n}), 1);
    cpu().reduce(ReduceOp::kSum, one.view({2, 1}, {}, 2), in.view({2, n / 2}), 0b10);
  }
  {
    ThreadCount threads(2);
    cpu().reduce(ReduceOp::kSum, two.view({1}), in.view({n}), 1);
    cpu().reduce(ReduceOp::kSum, two.view({2, 1}, {}, 2), in.view({2, n / 2}), 0b10);
  }
  for (int i = 0; i < 4; ++i) {
    uint32_t a, b;
    float fa = static_cast<float>(one.get(i)), fb = static_cast<float>(two.get(i));
    std::memcpy(&a, &fa, 4);
    std::memcpy(&b, &fb, 4);
    EXPECT_EQ(a, b) << "output " << i << " differs between 1 and 2 threads";
  }
  EXPECT_NEAR(one.get(0), want, 2e-7 * want);  // a naive float sum is off by ~1e-4 here
  EXPECT_NEAR(one.get(2) + one.get(3), want, 4e-7 * want);
}

TEST(CpuKernelsTest, ColumnSumsOfRowMajorDataMatchRowSumsOfTheTranspose) {
  // Summing dim 0 of [rows, cols] reads whole rows at a time; the per-output sequence of adds
  // is the same as summing the contiguous transpose along its rows, so results are bitwise
  // equal while both stay within one chunk (1000 rows).
  const int64_t rows = 1000, cols = 1100;
  std::mt19937 rng(19);
  Buffer x(DType::kFloat32, rows * cols), xt(DType::kFloat32, rows * cols);
  x.randomize(rng);
  cpu().copy(xt.view({rows, cols}, {1, rows}), x.view({rows, cols}));
  Buffer by_cols(DType::kFloat32, cols), by_rows(DType::kFloat32, cols);
  cpu().reduce(ReduceOp::kSum, by_cols.view({1, cols}), x.view({rows, cols}), 0b01);
  cpu().reduce(ReduceOp::kSum, by_rows.view({cols, 1}), xt.view({cols, rows}), 0b10);
  for (int64_t j = 0; j < cols; ++j) ASSERT_EQ(by_cols.get(j), by_rows.get(j)) << j;
}

TEST(CpuKernelsTest, LongColumnSumsAndMeansAreAccurateAndThreadCountIndependent) {
  std::mt19937 rng(20);
  // Several row chunks, several lane tiles (the last one partial).
  const int64_t rows = 10000, cols = 130;
  Buffer x(DType::kFloat32, rows * cols);
  x.randomize(rng);
  Buffer one(DType::kFloat32, cols), two(DType::kFloat32, cols);
  {
    ThreadCount threads(1);
    cpu().reduce(ReduceOp::kSum, one.view({1, cols}), x.view({rows, cols}), 0b01);
  }
  {
    ThreadCount threads(2);
    cpu().reduce(ReduceOp::kSum, two.view({1, cols}), x.view({rows, cols}), 0b01);
  }
  for (int64_t j = 0; j < cols; ++j) {
    double want = 0, magnitude = 0;
    for (int64_t r = 0; r < rows; ++r) {
      want += x.get(r * cols + j);
      magnitude += std::fabs(x.get(r * cols + j));
    }
    ASSERT_EQ(one.get(j), two.get(j)) << j;
    EXPECT_NEAR(one.get(j), want, 2e-6 * magnitude) << j;
  }
  // Mean over dims {0, 1} of a [3, 5000, 7] bfloat16 input whose last dim is contiguous,
  // into a strided output.
  Buffer y(DType::kBFloat16, 3 * 5000 * 7), mean(DType::kBFloat16, 14);
  y.randomize(rng);
  cpu().reduce(ReduceOp::kMean, mean.view({1, 1, 7}, {0, 0, 2}), y.view({3, 5000, 7}), 0b011);
  for (int64_t j = 0; j < 7; ++j) {
    double want = 0;
    for (int64_t r = 0; r < 15000; ++r) want += y.get(r * 7 + j);
    want /= 15000;
    EXPECT_NEAR(mean.get(2 * j), want, unit_roundoff(DType::kBFloat16) * std::fabs(want) + 1e-6)
        << j;
  }
}

TEST(CpuKernelsTest, CumsumForwardAndReverseAlongEachDimOfAStridedView) {
  std::mt19937 rng(11);
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    for (int dim = 0; dim < 2; ++dim) {
      for (bool reverse : {false, true}) {
        Buffer in(t, 5 * 7), out(t, 5 * 7);
        in.randomize(rng);
        StridedView iv = in.view({5, 7}, {1, 5});  // transposed
        StridedView ov = out.view({5, 7});
        cpu().cumsum(ov, iv, dim, reverse);
        for (int i = 0; i < 5; ++i) {
          for (int j = 0; j < 7; ++j) {
            double want = 0;
            int len = dim == 0 ? 5 : 7, pos = dim == 0 ? i : j;
            for (int k = 0; k < len; ++k) {
              if (reverse ? k < pos : k > pos) continue;
              want += dim == 0 ? in.get(j * 5 + k) : in.get(k * 5 + i);
            }
            EXPECT_NEAR(out.get(i * 7 + j), want, 1e-5 * (std::fabs(want) + 7))
                << dtype_name(t) << " dim " << dim << " reverse " << reverse;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------

// One batched product of dtype t against a float64 reference: padded leading dims, A's
// batch stride, B broadcast over the batch; beta == 0 with NaN in C (it must not leak).
void check_gemm(DType t, bool ta, bool tb, int64_t m, int64_t n, double beta, std::mt19937& rng) {
  const int64_t k = 6, batch = 3;
  GemmArgs g;
  g.dtype = t;
  g.trans_a = ta;
  g.trans_b = tb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lda = (ta ? m : k) + 3;  // padded rows
  g.ldb = (tb ? k : n) + 2;
  g.ldc = n + 4;
  g.batch = batch;
  g.stride_a = (ta ? k : m) * g.lda + 1;
  g.stride_b = 0;  // B broadcast over the batch
  g.stride_c = m * g.ldc + 5;
  g.alpha = 1.25;
  g.beta = beta;
  Buffer a(t, batch * g.stride_a), b(t, (tb ? n : k) * g.ldb), c(t, batch * g.stride_c);
  a.randomize(rng);
  b.randomize(rng);
  c.randomize(rng);
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  auto A = [&](int64_t bi, int64_t i, int64_t p) {
    return a.get(bi * g.stride_a + (ta ? p * g.lda + i : i * g.lda + p));
  };
  auto B = [&](int64_t p, int64_t j) { return b.get(tb ? j * g.ldb + p : p * g.ldb + j); };
  std::vector<double> want(c.size()), scale(c.size());
  for (int64_t q = 0; q < c.size(); ++q) want[q] = c.get(q);  // padding stays as is
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0, mag = 0;
        for (int64_t p = 0; p < k; ++p) {
          dot += A(bi, i, p) * B(p, j);
          mag += std::fabs(A(bi, i, p) * B(p, j));
        }
        const int64_t q = bi * g.stride_c + i * g.ldc + j;
        if (beta == 0.0) c.set(q, NAN);
        want[q] = g.alpha * dot + (beta == 0.0 ? 0.0 : g.beta * c.get(q));
        scale[q] = g.alpha * mag + (beta == 0.0 ? 0.0 : g.beta * std::fabs(c.get(q)));
      }
    }
  }
  cpu().gemm(g);
  const double u = std::max(unit_roundoff(t), 1e-16);
  const double accumulation = t == DType::kFloat64 ? 1e-15 : 1e-6;
  for (int64_t q = 0; q < c.size(); ++q) {
    const double tol = (2 * u + k * accumulation) * scale[q];
    ASSERT_NEAR(c.get(q), want[q], tol)
        << dtype_name(t) << " ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n
        << " beta=" << beta << " element " << q;
  }
}

// Every transpose, and the shapes with one row or one column of C (matrix-vector products,
// which the CPU backend hands to gemv).
TEST(CpuKernelsTest, GemmHandlesTransposesLeadingDimsBatchStridesAndBeta) {
  std::mt19937 rng(12);
  const std::pair<int64_t, int64_t> shapes[] = {{5, 7}, {1, 7}, {5, 1}, {1, 1}};
  for (DType t : kFloatTypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (const auto& [m, n] : shapes) {
          for (double beta : {0.5, 0.0}) check_gemm(t, ta, tb, m, n, beta, rng);
        }
      }
    }
  }
}

TEST(CpuKernelsTest, GemmBiasAndGeluEpilogue) {
  std::mt19937 rng(21);
  const int64_t m = 4, n = 5, k = 3;
  for (DType t : kFloatTypes) {
    for (bool gelu : {false, true}) {
      GemmArgs g;
      g.dtype = t;
      g.m = m;
      g.n = n;
      g.k = k;
      g.lda = k;
      g.ldb = n;
      g.ldc = n;
      g.alpha = 0.75;
      g.beta = 0.5;
      g.gelu = gelu;
      Buffer a(t, m * k), b(t, k * n), c(t, m * n), bias(t, n);
      a.randomize(rng);
      b.randomize(rng);
      c.randomize(rng);
      bias.randomize(rng);
      g.a = a.data();
      g.b = b.data();
      g.c = c.data();
      g.bias = bias.data();
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int64_t p = 0; p < k; ++p) dot += a.get(i * k + p) * b.get(p * n + j);
          double v = g.alpha * dot + g.beta * c.get(i * n + j) + bias.get(j);
          if (gelu) v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
          want[i * n + j] = v;
        }
      }
      cpu().gemm(g);
      double tol = 8 * std::max(unit_roundoff(t), 1e-15) * 4;
      for (int64_t q = 0; q < m * n; ++q) {
        ASSERT_NEAR(c.get(q), want[q], tol * (1 + std::fabs(want[q])))
            << dtype_name(t) << " gelu=" << gelu << " element " << q;
      }
    }
  }
}

TEST(CpuKernelsTest, GemmEdgeSizesAndBetaZeroIgnoresC) {
  GemmArgs g;
  g.dtype = DType::kFloat32;
  g.m = 2;
  g.n = 3;
  g.k = 0;
  g.lda = 0;
  g.ldb = 3;
  g.ldc = 3;
  g.beta = 2.0;
  Buffer c(DType::kFloat32, 6);
  for (int i = 0; i < 6; ++i) c.set(i, i + 1);
  Buffer empty(DType::kFloat32, 1);
  g.a = g.b = empty.data();
  g.c = c.data();
  cpu().gemm(g);  // k == 0: C = beta * C
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c.get(i), 2.0 * (i + 1));

  // beta == 0: NaN in C must not leak into the result.
  for (DType t : kFloatTypes) {
    Buffer a(t, 2), b(t, 3), cc(t, 6);
    for (int i = 0; i < 2; ++i) a.set(i, i + 1);
    for (int j = 0; j < 3; ++j) b.set(j, j - 1);
    for (int q = 0; q < 6; ++q) cc.set(q, NAN);
    GemmArgs h;
    h.dtype = t;
    h.m = 2;
    h.n = 3;
    h.k = 1;
    h.lda = 1;
    h.ldb = 3;
    h.ldc = 3;
    h.a = a.data();
    h.b = b.data();
    h.c = cc.data();
    cpu().gemm(h);
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 3; ++j) {
        EXPECT_EQ(cc.get(i * 3 + j), (i + 1) * (j - 1.0)) << dtype_name(t);
      }
    }
  }
  g.k = 2;
  g.m = 0;
  cpu().gemm(g);  // nothing to do, and no CBLAS complaint about lda
  g.m = 2;
  g.lda = 1;  // smaller than k
  expect_error([&] { cpu().gemm(g); }, ErrorCode::kInvalidArgument, "lda");
}

// ---------------------------------------------------------------------------------------
// Row-wise fused ops
// ---------------------------------------------------------------------------------------

TEST(CpuKernelsTest, SoftmaxAndLogSoftmaxWithBackwardMatchReference) {
  std::mt19937 rng(13);
  const int64_t rows = 6, cols = 37;
  for (DType t : kFloatTypes) {
    for (bool log : {false, true}) {
      Buffer x(t, rows * cols), y(t, rows * cols), g(t, rows * cols), gi(t, rows * cols);
      x.randomize(rng, -4, 4);
      g.randomize(rng);
      cpu().softmax(
          {.out = y.data(), .in = x.data(), .dtype = t, .rows = rows, .cols = cols, .log = log});
      cpu().softmax_backward({.grad_in = gi.data(),
                              .grad_out = g.data(),
                              .out = y.data(),
                              .dtype = t,
                              .rows = rows,
                              .cols = cols,
                              .log = log});
      const double tol = 4 * unit_roundoff(t) + 1e-6;
      for (int64_t r = 0; r < rows; ++r) {
        double m = -INFINITY, s = 0;
        for (int64_t j = 0; j < cols; ++j) m = std::max(m, x.get(r * cols + j));
        for (int64_t j = 0; j < cols; ++j) s += std::exp(x.get(r * cols + j) - m);
        std::vector<double> p(cols);
        double gp = 0, gsum = 0;
        for (int64_t j = 0; j < cols; ++j) {
          p[j] = std::exp(x.get(r * cols + j) - m) / s;
          gp += g.get(r * cols + j) * p[j];
          gsum += g.get(r * cols + j);
        }
        for (int64_t j = 0; j < cols; ++j) {
          int64_t q = r * cols + j;
          double want = log ? std::log(p[j]) : p[j];
          EXPECT_NEAR(y.get(q), want, tol * (std::fabs(want) + 1)) << dtype_name(t);
          // d/dx of sum(g * y): softmax -> p (g - g.p); log-softmax -> g - p sum(g).
          double dx = log ? g.get(q) - p[j] * gsum : p[j] * (g.get(q) - gp);
          // Backward reads y as stored in t, so allow t's rounding of y times |g|.
          EXPECT_NEAR(gi.get(q), dx, 8 * tol * (std::fabs(dx) + 2)) << dtype_name(t);
        }
      }
    }
  }
}

// Reference layer/RMS norm forward of one row, in double.
std::vector<double> norm_ref(const std::vector<double>& x, const std::vector<double>& w,
                             const std::vector<double>& b, double eps, bool rms) {
  double n = static_cast<double>(x.size()), mean = 0, var = 0;
  if (!rms) {
    for (double v : x) mean += v;
    mean /= n;
  }
  for (double v : x) var += (v - mean) * (v - mean);
  double rstd = 1 / std::sqrt(var / n + eps);
  std::vector<double> y(x.size());
  for (size_t j = 0; j < x.size(); ++j) {
    y[j] = (x[j] - mean) * rstd * (w.empty() ? 1 : w[j]) + (b.empty() ? 0 : b[j]);
  }
  return y;
}

TEST(CpuKernelsTest, NormForwardAndBackwardMatchFiniteDifferencesOfFloat64Reference) {
  std::mt19937 rng(14);
  const int64_t rows = 5, cols = 9;
  const double eps = 1e-5;
  for (bool rms : {false, true}) {
    for (DType t : kFloatTypes) {
      Buffer x(t, rows * cols), w(t, cols), b(t, cols), y(t, rows * cols), go(t, rows * cols),
          gi(t, rows * cols);
      x.randomize(rng);
      w.randomize(rng);
      b.randomize(rng);
      go.randomize(rng);
      std::vector<float> mean(rows), rstd(rows), gw(cols), gb(cols);
      cpu().norm({.out = y.data(),
                  .in = x.data(),
                  .weight = w.data(),
                  .bias = rms ? nullptr : b.data(),
                  .mean = mean.data(),
                  .rstd = rstd.data(),
                  .dtype = t,
                  .rows = rows,
                  .cols = cols,
                  .eps = eps,
                  .rms = rms});
      cpu().norm_backward({.grad_in = gi.data(),
                           .grad_weight = gw.data(),
                           .grad_bias = rms ? nullptr : gb.data(),
                           .grad_out = go.data(),
                           .in = x.data(),
                           .mean = mean.data(),
                           .rstd = rstd.data(),
                           .weight = w.data(),
                           .dtype = t,
                           .rows = rows,
                           .cols = cols,
                           .rms = rms});
      std::vector<double> wv(cols), bv;
      for (int64_t j = 0; j < cols; ++j) wv[j] = w.get(j);
      if (!rms) {
        for (int64_t j = 0; j < cols; ++j) bv.push_back(b.get(j));
      }
      const double tol = 8 * unit_roundoff(t) + 1e-6;
      std::vector<double> gw_want(cols, 0), gb_want(cols, 0);
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<double> xr(cols), gor(cols);
        for (int64_t j = 0; j < cols; ++j) {
          xr[j] = x.get(r * cols + j);
          gor[j] = go.get(r * cols + j);
        }
        std::vector<double> yr = norm_ref(xr, wv, bv, eps, rms);
        for (int64_t j = 0; j < cols; ++j) {
          EXPECT_NEAR(y.get(r * cols + j), yr[j], tol * (std::fabs(yr[j]) + 1)) << dtype_name(t);
        }
        // L = sum(go * y); dL/dx, dL/dw and dL/db by central differences in double.
        auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws,
                        const std::vector<double>& bs) {
          std::vector<double> ys = norm_ref(xs, ws, bs, eps, rms);
          double l = 0;
          for (int64_t j = 0; j < cols; ++j) l += gor[j] * ys[j];
          return l;
        };
        const double h = 1e-6;
        for (int64_t j = 0; j < cols; ++j) {
          std::vector<double> xp = xr, xm = xr, wp = wv, wm = wv;
          xp[j] += h;
          xm[j] -= h;
          wp[j] += h;
          wm[j] -= h;
          double dx = (loss(xp, wv, bv) - loss(xm, wv, bv)) / (2 * h);
          EXPECT_NEAR(gi.get(r * cols + j), dx, 20 * tol * (std::fabs(dx) + 1))
              << dtype_name(t) << " rms " << rms << " row " << r << " col " << j;
          gw_want[j] += (loss(xr, wp, bv) - loss(xr, wm, bv)) / (2 * h);
          gb_want[j] += gor[j];
        }
      }
      for (int64_t j = 0; j < cols; ++j) {
        EXPECT_NEAR(gw[j], gw_want[j], 20 * tol * (std::fabs(gw_want[j]) + 1)) << dtype_name(t);
        if (!rms) {
          EXPECT_NEAR(gb[j], gb_want[j], 1e-5 * (std::fabs(gb_want[j]) + 1));
        }
      }
    }
  }
}

TEST(CpuKernelsTest, NormBackwardWeightGradIsThreadCountIndependent) {
  const int64_t rows = 3000, cols = 64;
  Buffer x(DType::kFloat32, rows * cols), go(DType::kFloat32, rows * cols),
      gi(DType::kFloat32, rows * cols), y(DType::kFloat32, rows * cols);
  std::mt19937 rng(15);
  x.randomize(rng);
  go.randomize(rng);
  std::vector<float> mean(rows), rstd(rows), gw1(cols), gb1(cols), gw2(cols), gb2(cols);
  cpu().norm({.out = y.data(),
              .in = x.data(),
              .mean = mean.data(),
              .rstd = rstd.data(),
              .dtype = DType::kFloat32,
              .rows = rows,
              .cols = cols,
              .eps = 1e-5,
              .rms = false});
  {
    ThreadCount threads(1);
    cpu().norm_backward({.grad_in = gi.data(),
                         .grad_weight = gw1.data(),
                         .grad_bias = gb1.data(),
                         .grad_out = go.data(),
                         .in = x.data(),
                         .mean = mean.data(),
                         .rstd = rstd.data(),
                         .dtype = DType::kFloat32,
                         .rows = rows,
                         .cols = cols,
                         .rms = false});
  }
  {
    ThreadCount threads(2);
    cpu().norm_backward({.grad_in = gi.data(),
                         .grad_weight = gw2.data(),
                         .grad_bias = gb2.data(),
                         .grad_out = go.data(),
                         .in = x.data(),
                         .mean = mean.data(),
                         .rstd = rstd.data(),
                         .dtype = DType::kFloat32,
                         .rows = rows,
                         .cols = cols,
                         .rms = false});
  }
  EXPECT_EQ(gw1, gw2);
  EXPECT_EQ(gb1, gb2);
  for (int64_t j = 0; j < cols; ++j) {
    double want = 0;
    for (int64_t r = 0; r < rows; ++r) want += go.get(r * cols + j);
    EXPECT_NEAR(gb1[j], want, 1e-5 * (std::fabs(want) + 1));
  }
}

// dL/dx of L = sum(go * norm_ref(x)) by central differences of the float64 reference.
std::vector<double> norm_grad_ref(const std::vector<double>& x, const std::vector<double>& go,
                                  const std::vector<double>& w, double eps, bool rms) {
  auto loss = [&](const std::vector<double>& xs) {
    std::vector<double> ys = norm_ref(xs, w, {}, eps, rms);
    double l = 0;
    for (size_t j = 0; j < xs.size(); ++j) l += go[j] * ys[j];
    return l;
  };
  const double h = 1e-6;
  std::vector<double> dx(x.size());
  for (size_t j = 0; j < x.size(); ++j) {
    std::vector<double> xp = x, xm = x;
    xp[j] += h;
    xm[j] -= h;
    dx[j] = (loss(xp) - loss(xm)) / (2 * h);
  }
  return dx;
}

TEST(CpuKernelsTest, NormWithResidualNormalizesTheStoredSumAndAddsGradSum) {
  std::mt19937 rng(17);
  const double eps = 1e-5;
  struct Case {
    int64_t rows, cols;
    int64_t grad_row_step;  // finite differences on every step-th row (they cost cols^2)
  };
  // The second case exceeds the parallel grain: its rows run on several threads.
  for (const Case& c : {Case{6, 37, 1}, Case{48, 700, 8}}) {
    for (bool rms : {false, true}) {
      for (DType t : kFloatTypes) {
        SCOPED_TRACE(std::string(dtype_name(t)) + (rms ? " rms" : " layer") +
                     " cols=" + std::to_string(c.cols));
        const int64_t rows = c.rows, cols = c.cols, n = rows * cols;
        Buffer x(t, n), res(t, n), sum(t, n), y(t, n), go(t, n), gs(t, n), gi(t, n), w(t, cols),
            b(t, cols);
        for (Buffer* buf : {&x, &res, &go, &gs, &w, &b}) buf->randomize(rng);
        for (Buffer* buf : {&sum, &y, &gi}) {
          for (int64_t i = 0; i < buf->size(); ++i) buf->set(i, NAN);  // unwritten shows
        }
        std::vector<float> mean(rows, NAN), rstd(rows, NAN), gw(cols, NAN), gb(cols, NAN);
        const void* bias = rms ? nullptr : b.data();
        cpu().norm({.out = y.data(),
                    .in = x.data(),
                    .residual = res.data(),
                    .sum = sum.data(),
                    .weight = w.data(),
                    .bias = bias,
                    .mean = mean.data(),
                    .rstd = rstd.data(),
                    .dtype = t,
                    .rows = rows,
                    .cols = cols,
                    .eps = eps,
                    .rms = rms});
        // The backward pass reads the stored sum, as the tensor layer saves it.
        cpu().norm_backward({.grad_in = gi.data(),
                             .grad_weight = gw.data(),
                             .grad_bias = rms ? nullptr : gb.data(),
                             .grad_out = go.data(),
                             .grad_sum = gs.data(),
                             .in = sum.data(),
                             .mean = mean.data(),
                             .rstd = rstd.data(),
                             .weight = w.data(),
                             .dtype = t,
                             .rows = rows,
                             .cols = cols,
                             .rms = rms});
        std::vector<double> wv(cols), bv;
        for (int64_t j = 0; j < cols; ++j) wv[j] = w.get(j);
        if (!rms) {
          for (int64_t j = 0; j < cols; ++j) bv.push_back(b.get(j));
        }
        const double tol = 8 * unit_roundoff(t) + 1e-6;
        std::vector<double> gw_want(cols, 0), gb_want(cols, 0), gw_scale(cols, 0);
        int failures = 0;
        for (int64_t r = 0; r < rows && failures < 10; ++r) {
          std::vector<double> sr(cols), gor(cols);
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t q = r * cols + j;
            // x + residual is exact in double and rounds once to t, as the kernel's sum must.
            const double want = stored(t, x.get(q) + res.get(q));
            if (sum.get(q) != want) {
              ++failures;
              ADD_FAILURE() << "sum row " << r << " col " << j << ": got " << sum.get(q)
                            << ", want " << want;
            }
            sr[j] = want;
            gor[j] = go.get(q);
          }
          // The float64 statistics of the stored sum.
          double mu = 0, var = 0;
          if (!rms) {
            for (double v : sr) mu += v;
            mu /= static_cast<double>(cols);
          }
          for (double v : sr) var += (v - mu) * (v - mu);
          const double rstd_want = 1 / std::sqrt(var / static_cast<double>(cols) + eps);
          EXPECT_NEAR(rstd[r], rstd_want, 1e-5 * rstd_want) << "row " << r;
          if (!rms) {
            EXPECT_NEAR(mean[r], mu, 1e-5 * (std::fabs(mu) + 1)) << "row " << r;
          }
          const std::vector<double> yr = norm_ref(sr, wv, bv, eps, rms);
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t q = r * cols + j;
            if (!(std::fabs(y.get(q) - yr[j]) <= tol * (std::fabs(yr[j]) + 1)) && failures++ < 10) {
              ADD_FAILURE() << "out row " << r << " col " << j << ": got " << y.get(q) << ", want "
                            << yr[j];
            }
            const double xhat = (sr[j] - mu) * rstd_want;
            gw_want[j] += gor[j] * xhat;
            gw_scale[j] += std::fabs(gor[j] * xhat);
            gb_want[j] += gor[j];
          }
          if (r % c.grad_row_step != 0) continue;
          const std::vector<double> dx = norm_grad_ref(sr, gor, wv, eps, rms);
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t q = r * cols + j;
            const double want = dx[j] + gs.get(q);
            if (!(std::fabs(gi.get(q) - want) <= 20 * tol * (std::fabs(want) + 1)) &&
                failures++ < 10) {
              ADD_FAILURE() << "grad_in row " << r << " col " << j << ": got " << gi.get(q)
                            << ", want " << want << " (" << dx[j] << " + grad_sum " << gs.get(q)
                            << ")";
            }
          }
        }
        for (int64_t j = 0; j < cols; ++j) {
          EXPECT_NEAR(gw[j], gw_want[j], 20 * tol * (gw_scale[j] + 1)) << "col " << j;
          if (!rms) {
            EXPECT_NEAR(gb[j], gb_want[j], 1e-5 * (std::fabs(gb_want[j]) + 1));
          }
        }

        // The sum may be written over the residual (an in-place residual stream).
        Buffer in_place = res, y2(t, n);
        std::vector<float> mean2(rows), rstd2(rows);
        cpu().norm({.out = y2.data(),
                    .in = x.data(),
                    .residual = in_place.data(),
                    .sum = in_place.data(),
                    .weight = w.data(),
                    .bias = bias,
                    .mean = mean2.data(),
                    .rstd = rstd2.data(),
                    .dtype = t,
                    .rows = rows,
                    .cols = cols,
                    .eps = eps,
                    .rms = rms});
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(in_place.get(i), sum.get(i)) << "in-place sum, element " << i;
          ASSERT_EQ(y2.get(i), y.get(i)) << "in-place out, element " << i;
        }
      }
    }
  }
}

TEST(CpuKernelsTest, NormNeedsResidualAndSumTogether) {
  Buffer x(DType::kFloat32, 8), y(DType::kFloat32, 8), s(DType::kFloat32, 8);
  std::vector<float> mean(2), rstd(2);
  expect_error(
      [&] {
        cpu().norm({.out = y.data(),
                    .in = x.data(),
                    .residual = x.data(),
                    .mean = mean.data(),
                    .rstd = rstd.data(),
                    .dtype = DType::kFloat32,
                    .rows = 2,
                    .cols = 4,
                    .eps = 1e-5,
                    .rms = false});
      },
      ErrorCode::kInvalidArgument, "'residual' and 'sum'");
  expect_error(
      [&] {
        cpu().norm({.out = y.data(),
                    .in = x.data(),
                    .sum = s.data(),
                    .mean = mean.data(),
                    .rstd = rstd.data(),
                    .dtype = DType::kFloat32,
                    .rows = 2,
                    .cols = 4,
                    .eps = 1e-5,
                    .rms = true});
      },
      ErrorCode::kInvalidArgument, "'residual' and 'sum'");
}

// ---------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------

// Float64 logsumexp of one row.
double logsumexp_ref(const std::vector<double>& x) {
  double m = -INFINITY;
  for (double v : x) m = std::max(m, v);
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

TEST(CpuKernelsTest, CrossEntropyMatchesFloat64ReferenceOnShortAndLongRows) {
  std::mt19937 rng(18);
  struct Case {
    int64_t rows, cols;
    int64_t ignore_index;
  };
  // Long rows exceed the parallel grain and the logsumexp's 128-value blocks many times
  // over; ignore_index 3 is also a valid class, so targets equal to it must be skipped.
  for (const Case& c :
       {Case{7, 37, -100}, Case{5, 1, -100}, Case{4, 70001, -100}, Case{6, 300, 3}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " rows=" + std::to_string(c.rows) + " cols=" +
                   std::to_string(c.cols) + " ignore_index=" + std::to_string(c.ignore_index));
      const int64_t rows = c.rows, cols = c.cols, n = rows * cols;
      const DType acc = accumulation_dtype(t);
      Buffer x(t, n), targets(DType::kInt64, rows), loss(acc, rows), lse(acc, rows), g(acc, rows),
          gx(t, n);
      x.randomize(rng, -8, 8);
      // A few -inf logits (never a target): they must add exactly 0 to the sum.
      for (int64_t i = 5; i < n; i += 997) x.set(i, -INFINITY);
      g.randomize(rng, 0.5, 2);
      for (int64_t r = 0; r < rows; ++r) {
        int64_t target = (r * 7919 + 11) % cols;
        while (std::isinf(x.get(r * cols + target))) target = (target + 1) % cols;
        if (r % 3 == 1) target = c.ignore_index;
        targets.set(r, static_cast<double>(target));
      }
      if (c.ignore_index >= 0 && rows > 2) targets.set(2, static_cast<double>(c.ignore_index));
      for (Buffer* buf : {&loss, &lse, &gx}) {
        for (int64_t i = 0; i < buf->size(); ++i) buf->set(i, NAN);
      }
      const auto* tp = static_cast<const int64_t*>(targets.data());
      cpu().cross_entropy({.loss = loss.data(),
                           .lse = lse.data(),
                           .logits = x.data(),
                           .targets = tp,
                           .dtype = t,
                           .rows = rows,
                           .cols = cols,
                           .inner = 1,
                           .ignore_index = c.ignore_index});

      const double u_acc = unit_roundoff(acc);
      for (bool broadcast : {false, true}) {
        SCOPED_TRACE(broadcast ? "grad_loss stride 0" : "grad_loss stride 1");
        cpu().cross_entropy_backward({.grad_logits = gx.data(),
                                      .grad_loss = g.data(),
                                      .grad_loss_stride = broadcast ? 0 : 1,
                                      .logits = x.data(),
                                      .lse = lse.data(),
                                      .targets = tp,
                                      .dtype = t,
                                      .rows = rows,
                                      .cols = cols,
                                      .inner = 1,
                                      .ignore_index = c.ignore_index});
        int failures = 0;
        for (int64_t r = 0; r < rows && failures < 10; ++r) {
          std::vector<double> xr(cols);
          double max_abs = 0;
          for (int64_t j = 0; j < cols; ++j) {
            xr[j] = x.get(r * cols + j);
            if (!std::isinf(xr[j])) max_abs = std::max(max_abs, std::fabs(xr[j]));
          }
          const double lse_want = logsumexp_ref(xr);
          // Error scale of a float logsumexp: the operands' magnitude and the sum's length.
          const double scale = max_abs + std::log(static_cast<double>(cols)) + 1;
          EXPECT_NEAR(lse.get(r), lse_want, 16 * u_acc * scale) << "lse row " << r;
          const auto target = static_cast<int64_t>(targets.get(r));
          const bool ignored = target == c.ignore_index;
          const double loss_want = ignored ? 0.0 : lse_want - xr[target];
          EXPECT_NEAR(loss.get(r), loss_want, 16 * u_acc * scale) << "loss row " << r;
          if (ignored) {
            EXPECT_EQ(loss.get(r), 0.0) << "ignored row " << r;
          }
          const double gr = g.get(broadcast ? 0 : r);
          for (int64_t j = 0; j < cols; ++j) {
            const double p = std::exp(xr[j] - lse_want);
            const double want = ignored ? 0.0 : gr * (p - (j == target ? 1.0 : 0.0));
            const double tol = ignored ? 0.0
                                       : 2 * unit_roundoff(t) * std::fabs(want) +
                                             32 * u_acc * scale * std::fabs(gr) * p +
                                             (t == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0);
            if (!(std::fabs(gx.get(r * cols + j) - want) <= tol) && failures++ < 10) {
              ADD_FAILURE() << "grad row " << r << " col " << j << ": got " << gx.get(r * cols + j)
                            << ", want " << want << " (tol " << tol << ")";
            }
          }
        }
      }
    }
  }
}

TEST(CpuKernelsTest, CrossEntropyRejectsBadArguments) {
  Buffer x(DType::kFloat32, 6), loss(DType::kFloat32, 2), lse(DType::kFloat32, 2);
  std::vector<int64_t> targets = {1, 3};  // 3 is out of range for 3 classes
  expect_error(
      [&] {
        cpu().cross_entropy({.loss = loss.data(),
                             .lse = lse.data(),
                             .logits = x.data(),
                             .targets = targets.data(),
                             .dtype = DType::kFloat32,
                             .rows = 2,
                             .cols = 3,
                             .inner = 1,
                             .ignore_index = -100});
      },
      ErrorCode::kOutOfRange, "cross_entropy: target 3");
  targets[1] = -100;
  expect_error(
      [&] {
        cpu().cross_entropy({.loss = loss.data(),
                             .lse = lse.data(),
                             .targets = targets.data(),
                             .dtype = DType::kFloat32,
                             .rows = 2,
                             .cols = 3,
                             .inner = 1,
                             .ignore_index = -100});
      },
      ErrorCode::kInvalidArgument, "'logits'");
  expect_error(
      [&] {
        cpu().cross_entropy({.loss = loss.data(),
                             .lse = lse.data(),
                             .logits = x.data(),
                             .targets = targets.data(),
                             .dtype = DType::kFloat32,
                             .rows = -1,
                             .cols = 3,
                             .inner = 1,
                             .ignore_index = -100});
      },
      ErrorCode::kInvalidArgument, "cross_entropy: rows and cols");
  expect_error(
      [&] {
        cpu().cross_entropy({.loss = loss.data(),
                             .lse = lse.data(),
                             .logits = x.data(),
                             .targets = targets.data(),
                             .dtype = DType::kInt32,
                             .rows = 2,
                             .cols = 3,
                             .inner = 1,
                             .ignore_index = -100});
      },
      ErrorCode::kDTypeMismatch, "cross_entropy");
  expect_error(
      [&] {
        cpu().cross_entropy_backward({.grad_logits = x.data(),
                                      .grad_loss = loss.data(),
                                      .grad_loss_stride = -1,
                                      .logits = x.data(),
                                      .lse = lse.data(),
                                      .targets = targets.data(),
                                      .dtype = DType::kFloat32,
                                      .rows = 2,
                                      .cols = 3,
                                      .inner = 1,
                                      .ignore_index = -100});
      },
      ErrorCode::kInvalidArgument, "cross_entropy_backward: argument 'grad_loss_stride'");
  expect_error(
      [&] {
        cpu().cross_entropy({.loss = loss.data(),
                             .lse = lse.data(),
                             .logits = x.data(),
                             .targets = targets.data(),
                             .dtype = DType::kFloat32,
                             .rows = 2,
                             .cols = 3,
                             .inner = 4,
                             .ignore_index = -100});
      },
      ErrorCode::kInvalidArgument, "cross_entropy: argument 'inner'");
  // No rows: nothing is read, so null pointers are fine.
  cpu().cross_entropy(
      {.dtype = DType::kFloat32, .rows = 0, .cols = 3, .inner = 1, .ignore_index = -100});
}

// Logits [outer, cols, inner] (classes `inner` apart) give bit for bit what the same values
// moved to row-major [outer * inner, cols] give: every position is reduced in the same order.
TEST(CpuKernelsTest, CrossEntropyWithAClassStrideMatchesRowMajorBitForBit) {
  std::mt19937 rng(19);
  struct Case {
    int64_t outer, cols, inner;
  };
  // inner 37: two full tiles of 16 adjacent positions and a partial one; cols 300 spans
  // several 128-class blocks.
  for (const Case& c : {Case{2, 300, 37}, Case{3, 5, 2}, Case{1, 129, 16}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " outer=" + std::to_string(c.outer) +
                   " cols=" + std::to_string(c.cols) + " inner=" + std::to_string(c.inner));
      const int64_t rows = c.outer * c.inner, n = rows * c.cols;
      const DType acc = accumulation_dtype(t);
      Buffer strided(t, n), row_major(t, n), targets(DType::kInt64, rows), g(acc, rows);
      strided.randomize(rng, -8, 8);
      g.randomize(rng, 0.5, 2);
      for (int64_t o = 0; o < c.outer; ++o) {
        for (int64_t j = 0; j < c.cols; ++j) {
          for (int64_t i = 0; i < c.inner; ++i) {
            row_major.set((o * c.inner + i) * c.cols + j,
                          strided.get((o * c.cols + j) * c.inner + i));
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        targets.set(r, r % 4 == 1 ? -100.0 : static_cast<double>((r * 7919 + 3) % c.cols));
      }
      const auto* tp = static_cast<const int64_t*>(targets.data());
      Buffer loss_s(acc, rows), lse_s(acc, rows), loss_r(acc, rows), lse_r(acc, rows);
      cpu().cross_entropy({.loss = loss_s.data(),
                           .lse = lse_s.data(),
                           .logits = strided.data(),
                           .targets = tp,
                           .dtype = t,
                           .rows = rows,
                           .cols = c.cols,
                           .inner = c.inner,
                           .ignore_index = -100});
      cpu().cross_entropy({.loss = loss_r.data(),
                           .lse = lse_r.data(),
                           .logits = row_major.data(),
                           .targets = tp,
                           .dtype = t,
                           .rows = rows,
                           .cols = c.cols,
                           .inner = 1,
                           .ignore_index = -100});
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(lse_s.get(r), lse_r.get(r)) << "lse of position " << r;
        ASSERT_EQ(loss_s.get(r), loss_r.get(r)) << "loss of position " << r;
      }
      Buffer gx_s(t, n), gx_r(t, n);
      cpu().cross_entropy_backward({.grad_logits = gx_s.data(),
                                    .grad_loss = g.data(),
                                    .grad_loss_stride = 1,
                                    .logits = strided.data(),
                                    .lse = lse_s.data(),
                                    .targets = tp,
                                    .dtype = t,
                                    .rows = rows,
                                    .cols = c.cols,
                                    .inner = c.inner,
                                    .ignore_index = -100});
      cpu().cross_entropy_backward({.grad_logits = gx_r.data(),
                                    .grad_loss = g.data(),
                                    .grad_loss_stride = 1,
                                    .logits = row_major.data(),
                                    .lse = lse_r.data(),
                                    .targets = tp,
                                    .dtype = t,
                                    .rows = rows,
                                    .cols = c.cols,
                                    .inner = 1,
                                    .ignore_index = -100});
      for (int64_t o = 0; o < c.outer; ++o) {
        for (int64_t j = 0; j < c.cols; ++j) {
          for (int64_t i = 0; i < c.inner; ++i) {
            ASSERT_EQ(gx_s.get((o * c.cols + j) * c.inner + i),
                      gx_r.get((o * c.inner + i) * c.cols + j))
                << "grad of position " << o * c.inner + i << " class " << j;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Indexing
// ---------------------------------------------------------------------------------------

TEST(CpuKernelsTest, IndexSelectAndGatherReadThroughIndices) {
  std::mt19937 rng(16);
  for (DType it : {DType::kInt64, DType::kInt32}) {
    for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kBool}) {
      Buffer in(t, 4 * 6);
      in.randomize(rng);
      StridedView iv = in.view({4, 6}, {1, 4});  // transposed
      Buffer index(it, 5);
      const int picks[5] = {5, 0, 5, 2, 3};
      for (int i = 0; i < 5; ++i) index.set(i, picks[i]);
      Buffer out(t, 4 * 5);
      cpu().index_select(out.view({4, 5}), iv, 1, index.view({5}));
      for (int r = 0; r < 4; ++r) {
        for (int i = 0; i < 5; ++i) {
          EXPECT_EQ(out.get(r * 5 + i), in.get(picks[i] * 4 + r)) << dtype_name(t);
        }
      }
      // gather along dim 0 with a [2, 6] index.
      Buffer gidx(it, 12), gout(t, 12);
      for (int q = 0; q < 12; ++q) gidx.set(q, (q * 5 + 1) % 4);
      cpu().gather(gout.view({2, 6}), iv, 0, gidx.view({2, 6}));
      for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < 6; ++c) {
          int src_row = static_cast<int>(gidx.get(r * 6 + c));
          EXPECT_EQ(gout.get(r * 6 + c), in.get(c * 4 + src_row)) << dtype_name(t);
        }
      }
      index.set(2, 6);  // out of range
      expect_error(
          [&] {
            cpu().index_select(out.view({4, 5}), iv, 1, index.view({5}));
          },
          ErrorCode::kOutOfRange, "index 6");
      gidx.set(3, -1);
      expect_error(
          [&] {
            cpu().gather(gout.view({2, 6}), iv, 0, gidx.view({2, 6}));
          },
          ErrorCode::kOutOfRange, "index -1");
    }
  }
}

TEST(CpuKernelsTest, IndexAddAndScatterAccumulateDuplicatesDeterministically) {
  std::mt19937 rng(17);
  // Large enough to run in parallel; heavy duplication in the index.
  const int64_t rows = 50, cols = 2000, picks = 400;
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt32}) {
    Buffer out(t, rows * cols), src(t, picks * cols), index(DType::kInt64, picks);
    out.randomize(rng);
    src.randomize(rng);
    for (int64_t i = 0; i < picks; ++i) index.set(i, (i * 7) % rows);
    std::vector<double> want(out.size());
    for (int64_t q = 0; q < out.size(); ++q) want[q] = out.get(q);
    // Adds in index order, rounding to t after each one (as the kernel must).
    for (int64_t i = 0; i < picks; ++i) {
      for (int64_t c = 0; c < cols; ++c) {
        int64_t q = static_cast<int64_t>(index.get(i)) * cols + c;
        want[q] = stored(t, want[q] + src.get(i * cols + c));
      }
    }
    cpu().index_add(out.view({rows, cols}), 0, index.view({picks}), src.view({picks, cols}));
    for (int64_t q = 0; q < out.size(); ++q) {
      ASSERT_EQ(out.get(q), want[q]) << dtype_name(t) << " " << q;
    }
  }

  // A 1-D index_add (a histogram): a single line, many duplicates, adds in index order.
  {
    const int64_t n = 100000, bins = 10;
    Buffer hist(DType::kFloat32, bins), values(DType::kFloat32, n), index(DType::kInt32, n);
    hist.randomize(rng);
    values.randomize(rng);
    std::uniform_int_distribution<int> bin(0, bins - 1);
    std::vector<float> want(bins);
    for (int64_t b = 0; b < bins; ++b) want[b] = static_cast<float>(hist.get(b));
    for (int64_t i = 0; i < n; ++i) {
      index.set(i, bin(rng));
      want[static_cast<int64_t>(index.get(i))] += static_cast<float>(values.get(i));
    }
    cpu().index_add(hist.view({bins}), 0, index.view({n}), values.view({n}));
    for (int64_t b = 0; b < bins; ++b) EXPECT_EQ(hist.get(b), want[b]) << b;
  }

  // scatter along dim 1 (accumulate and assign) with a smaller index than out.
  for (bool accumulate : {true, false}) {
    Buffer out(DType::kFloat64, 3 * 4), src(DType::kFloat64, 3 * 5), index(DType::kInt64, 2 * 5);
    out.randomize(rng);
    src.randomize(rng);
    const int idx[2][5] = {{1, 1, 3, 0, 1}, {2, 2, 2, 2, 0}};
    for (int r = 0; r < 2; ++r) {
      for (int c = 0; c < 5; ++c) index.set(r * 5 + c, idx[r][c]);
    }
    std::vector<double> want(12);
    for (int q = 0; q < 12; ++q) want[q] = out.get(q);
    for (int r = 0; r < 2; ++r) {
      for (int c = 0; c < 5; ++c) {
        double v = src.get(r * 5 + c);
        double& o = want[r * 4 + idx[r][c]];
        o = accumulate ? o + v : v;  // the last write wins for assign
      }
    }
    cpu().scatter(out.view({3, 4}), 1, index.view({2, 5}), src.view({3, 5}), accumulate);
    for (int q = 0; q < 12; ++q) EXPECT_EQ(out.get(q), want[q]) << "accumulate " << accumulate;
    index.set(0, 4);
    expect_error(
        [&] {
          cpu().scatter(out.view({3, 4}), 1, index.view({2, 5}), src.view({3, 5}), accumulate);
        },
        ErrorCode::kOutOfRange, "scatter");
  }
}

TEST(CpuKernelsTest, IndexAddIsThreadCountIndependent) {
  const int64_t rows = 7, cols = 20000, picks = 64;
  Buffer src(DType::kFloat32, picks * cols), index(DType::kInt32, picks);
  std::mt19937 rng(18);
  src.randomize(rng);
  for (int64_t i = 0; i < picks; ++i) index.set(i, (i * 3) % rows);
  Buffer one(DType::kFloat32, rows * cols), two(DType::kFloat32, rows * cols);
  cpu().fill(one.view({rows, cols}), 0.0);
  cpu().fill(two.view({rows, cols}), 0.0);
  {
    ThreadCount threads(1);
    cpu().index_add(one.view({rows, cols}), 0, index.view({picks}), src.view({picks, cols}));
  }
  {
    ThreadCount threads(2);
    cpu().index_add(two.view({rows, cols}), 0, index.view({picks}), src.view({picks, cols}));
  }
  for (int64_t q = 0; q < rows * cols; ++q) ASSERT_EQ(one.get(q), two.get(q)) << q;
}

}  // namespace
}  // namespace rd::kernels
