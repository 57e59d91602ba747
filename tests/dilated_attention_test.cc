// Tests of rd::nn::dilated_attention against the independent float64 reference of
// tests/testing/dilated_reference.h: every variant, mixing, offset rule and causal setting, in
// every floating dtype and several memory layouts; the worked examples of
// docs/dilated-attention.md; extreme inputs; float64 finite-difference gradients through out
// and lse; option errors; dropout; Hilbert order; and each CUDA path against the CPU.
// Tolerances: tolerance_for(dtype, D + keys), i.e. a few units of the storage dtype plus the
// float32 (float64) accumulation over the head dim and the keys one row sees.
#include "ringdilated/nn/dilated_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/hilbert.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dilated_reference.h"
#include "testing/gradcheck.h"
#include "testing/poisoned_pool.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

// Every test here runs with new blocks of the CPU and GPU pools holding NaN
// (testing/poisoned_pool.h): an element of an output or gradient that the engine neither
// writes nor zeroes shows.
[[maybe_unused]] ::testing::Environment* const kPoisonedPools =
    ::testing::AddGlobalTestEnvironment(new PoisonedPoolEnvironment);

using nn::AttentionCallContext;
using nn::AttentionPath;
using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::HeadMixing;
using nn::OffsetRule;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kAllFloatTypes[] = {DType::kFloat64, DType::kFloat32, DType::kBFloat16,
                                    DType::kFloat16};

// ---------------------------------------------------------------------------------------
// Plumbing between tensors, RefArrays and the reference.

HeadsArray heads_from(const RefArray& a) {
  HeadsArray h;
  h.batch = a.shape.at(0);
  h.seq = a.shape.at(1);
  h.heads = a.shape.at(2);
  h.dim = a.shape.at(3);
  h.values = a.data;
  return h;
}

RefArray ref_from(const HeadsArray& h) {
  return RefArray({h.batch, h.seq, h.heads, h.dim}, h.values);
}

struct Expected {
  RefArray out;  // [B, N, H, D]
  RefArray lse;  // [B, H, N]
};

Expected reference_for(const RefArray& q, const RefArray& k, const RefArray& v,
                       const DilatedAttentionOptions& options) {
  DilatedReferenceResult r =
      dilated_attention_reference(heads_from(q), heads_from(k), heads_from(v), options);
  return {ref_from(r.out), RefArray({r.out.batch, r.out.heads, r.out.seq}, r.lse)};
}

DilatedAttentionOptions pairs(std::vector<int64_t> segments, std::vector<int64_t> rates) {
  DilatedAttentionOptions o;
  o.segment_lengths = std::move(segments);
  o.dilation_rates = std::move(rates);
  o.path = AttentionPath::kMath;
  return o;
}

// Most keys one output row can see: N per pair (the global variant sees N with repeats).
int64_t max_keys(int64_t seq, const DilatedAttentionOptions& o) {
  return o.mixing == HeadMixing::kAllHeads ? seq * static_cast<int64_t>(o.dilation_rates.size())
                                           : seq;
}

Tolerance out_tolerance(DType dtype, int64_t dim, int64_t keys) {
  return tolerance_for(dtype, dim + keys);
}

// Merging pairs through the log-sum-exp (all heads, G > 1) weighs them by exp(lse_i - LSE),
// whose absolute error is that of the lse_i themselves: the accumulator's rounding times
// |lse| (large for scores around 1e4).
Tolerance merged_out_tolerance(DType dtype, int64_t dim, int64_t keys,
                               const DilatedAttentionOptions& o, const RefArray& expected_lse) {
  Tolerance tol = out_tolerance(dtype, dim, keys);
  if (o.mixing != HeadMixing::kAllHeads || o.dilation_rates.size() < 2) return tol;
  double largest = 0.0;
  for (double x : expected_lse.data) {
    if (std::isfinite(x)) largest = std::max(largest, std::abs(x));
  }
  const double accumulator_u = dtype == DType::kFloat64 ? 0x1p-53 : 0x1p-24;
  const double merge = 4.0 * accumulator_u * largest;
  return {tol.rtol + merge, tol.atol + merge};
}
// The LSE is float32 whatever the input dtype, computed from the (rounded) inputs.
Tolerance lse_tolerance(int64_t dim, int64_t keys) {
  return tolerance_for(DType::kFloat32, dim + keys);
}

struct Got {
  RefArray out;
  RefArray lse;
  AttentionPath path = AttentionPath::kAuto;
};

// Runs the library and checks the result's metadata against the header's contract.
Got run_library(const Tensor& q, const Tensor& k, const Tensor& v,
                const DilatedAttentionOptions& options, const AttentionCallContext& context = {}) {
  nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(q, k, v, options, context);
  Shape lse_shape = {q.size(0), q.size(2), q.size(1)};
  EXPECT_EQ(r.out.shape(), q.shape());
  EXPECT_EQ(r.out.dtype(), q.dtype());
  EXPECT_TRUE(r.out.device() == q.device());
  EXPECT_EQ(r.lse.shape(), lse_shape);
  EXPECT_EQ(r.lse.dtype(), DType::kFloat32);
  EXPECT_TRUE(r.lse.device() == q.device());
  return {to_ref(r.out), to_ref(r.lse), r.path_used};
}

RefArray draw_any(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  return random_values(shape, Domain::kAny, dtype, rng);
}

// How q, k and v are laid out in memory. The first four are tensor_util's layouts; the others
// are the layouts attention really sees.
enum class QkvLayout {
  kContiguous,
  kTransposed,   // dims 0 and 3 swapped in storage
  kSliced,       // every other element of a wider last dim
  kExpanded,     // a size-1 dim broadcast with stride 0
  kHeadsMajor,   // stored [B, H, N, D], permuted to [B, N, H, D]
  kPackedQkv,    // q, k, v are select(2, i) of one [B, N, 3, H, D] tensor
  kMixed,        // q transposed, k sliced, v heads-major
};

std::string layout_label(QkvLayout layout) {
  switch (layout) {
    case QkvLayout::kContiguous: return "Contiguous";
    case QkvLayout::kTransposed: return "Transposed";
    case QkvLayout::kSliced: return "Sliced";
    case QkvLayout::kExpanded: return "Expanded";
    case QkvLayout::kHeadsMajor: return "HeadsMajor";
    case QkvLayout::kPackedQkv: return "PackedQkv";
    case QkvLayout::kMixed: return "Mixed";
  }
  return "?";
}

struct Qkv {
  Tensor q, k, v;
  RefArray q_values, k_values, v_values;  // logical values after rounding to the dtype
};

Tensor heads_major_tensor(const RefArray& values, DType dtype, Device device) {
  return from_ref(ref::permute(values, {0, 2, 1, 3}), dtype, device).permute({0, 2, 1, 3});
}

Tensor tensor_in_layout(const RefArray& values, DType dtype, Device device, Layout layout,
                        std::mt19937_64& rng) {
  return make_input(values.shape, dtype, layout, device,
                    [&](const Shape& shape, std::mt19937_64&) {
                      // kExpanded asks for the stored (smaller) shape: keep its first slice.
                      if (shape == values.shape) return values;
                      RefArray part = RefArray::filled(shape, 0.0);
                      for (int64_t i = 0; i < part.numel(); ++i) {
                        part.data[i] = values.at(ref::unravel(i, shape));
                      }
                      return part;
                    },
                    rng)
      .input();
}

Qkv make_qkv(const Shape& shape, DType dtype, QkvLayout layout, uint64_t seed,
             Device device = Device::cpu()) {
  std::mt19937_64 rng(seed);
  RefArray values[3] = {draw_any(shape, dtype, rng), draw_any(shape, dtype, rng),
                        draw_any(shape, dtype, rng)};
  Tensor t[3];
  switch (layout) {
    case QkvLayout::kContiguous:
    case QkvLayout::kTransposed:
    case QkvLayout::kSliced:
    case QkvLayout::kExpanded: {
      Layout l = layout == QkvLayout::kContiguous   ? Layout::kContiguous
                 : layout == QkvLayout::kTransposed ? Layout::kTransposed
                 : layout == QkvLayout::kSliced     ? Layout::kSliced
                                                    : Layout::kExpanded;
      for (int i = 0; i < 3; ++i) t[i] = tensor_in_layout(values[i], dtype, device, l, rng);
      break;
    }
    case QkvLayout::kHeadsMajor:
      for (int i = 0; i < 3; ++i) t[i] = heads_major_tensor(values[i], dtype, device);
      break;
    case QkvLayout::kPackedQkv: {
      Shape packed_shape = {shape[0], shape[1], 3, shape[2], shape[3]};
      RefArray packed = RefArray::filled(packed_shape, 0.0);
      for (int i = 0; i < 3; ++i) {
        for (int64_t e = 0; e < values[i].numel(); ++e) {
          ref::Index idx = ref::unravel(e, shape);
          packed.at({idx[0], idx[1], i, idx[2], idx[3]}) = values[i].data[e];
        }
      }
      Tensor storage = from_ref(packed, dtype, device);
      for (int i = 0; i < 3; ++i) t[i] = storage.select(2, i);
      break;
    }
    case QkvLayout::kMixed:
      t[0] = tensor_in_layout(values[0], dtype, device, Layout::kTransposed, rng);
      t[1] = tensor_in_layout(values[1], dtype, device, Layout::kSliced, rng);
      t[2] = heads_major_tensor(values[2], dtype, device);
      break;
  }
  return {t[0], t[1], t[2], to_ref(t[0]), to_ref(t[1]), to_ref(t[2])};
}

// Compares the library with the reference on the same (rounded) inputs.
::testing::AssertionResult matches_reference(const Qkv& in, const DilatedAttentionOptions& o,
                                             const AttentionCallContext& context = {}) {
  Expected expected = reference_for(in.q_values, in.k_values, in.v_values, o);
  Got got = run_library(in.q, in.k, in.v, o, context);
  const int64_t dim = in.q.size(3), keys = max_keys(in.q.size(1), o);
  ::testing::AssertionResult out_ok = values_close(
      expected.out, got.out, merged_out_tolerance(in.q.dtype(), dim, keys, o, expected.lse));
  if (!out_ok) return ::testing::AssertionFailure() << "out: " << out_ok.message();
  ::testing::AssertionResult lse_ok = values_close(expected.lse, got.lse, lse_tolerance(dim, keys));
  if (!lse_ok) return ::testing::AssertionFailure() << "lse: " << lse_ok.message();
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// The comparison table: each case runs in every floating dtype.

struct Case {
  std::string name;
  Shape shape;  // [B, N, H, D]
  std::vector<int64_t> segments, rates;
  DilationVariant variant = DilationVariant::kSegmentLocal;
  HeadMixing mixing = HeadMixing::kHeadGroups;
  OffsetRule rule = OffsetRule::kConstant;
  bool causal = false;
  std::optional<double> scale;

  DilatedAttentionOptions options() const {
    DilatedAttentionOptions o = pairs(segments, rates);
    o.variant = variant;
    o.mixing = mixing;
    o.offset_rule = rule;
    o.causal = causal;
    o.scale = scale;
    return o;
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr auto kFixed = DilationVariant::kSegmentLocal;
constexpr auto kGlobal = DilationVariant::kGlobal;
constexpr auto kGroups = HeadMixing::kHeadGroups;
constexpr auto kAllHeads = HeadMixing::kAllHeads;
constexpr auto kConstant = OffsetRule::kConstant;
constexpr auto kRotating = OffsetRule::kRotating;

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      {"FixedGroupsDivisible", {2, 16, 3, 16}, {4, 8, 16}, {1, 2, 4}, kFixed, kGroups, kConstant, false, std::nullopt},
      {"FixedGroupsRaggedNAndH", {1, 21, 5, 32}, {4, 8, 16}, {1, 2, 4}, kFixed, kGroups, kConstant, false, std::nullopt},
      {"FixedGroupsRaggedCausal", {3, 21, 5, 64}, {4, 8, 16}, {1, 2, 4}, kFixed, kGroups, kConstant, true, std::nullopt},
      {"FixedGroupsRotating", {2, 26, 4, 16}, {6, 12}, {3, 2}, kFixed, kGroups, kRotating, false, std::nullopt},
      {"FixedGroupsRotatingCausal", {1, 19, 3, 128}, {8, 4, 2}, {4, 2, 1}, kFixed, kGroups, kRotating, true, std::nullopt},
      {"FixedAllHeads", {2, 22, 3, 16}, {4, 8, 16}, {1, 2, 4}, kFixed, kAllHeads, kConstant, false, std::nullopt},
      {"FixedAllHeadsCausalUnselectedRows", {1, 17, 2, 96}, {8, 16}, {2, 4}, kFixed, kAllHeads, kConstant, true, std::nullopt},
      {"FixedAllHeadsRotatingCausal", {2, 20, 3, 24}, {4, 10}, {2, 5}, kFixed, kAllHeads, kRotating, true, std::nullopt},
      {"FixedAllHeadsFewerHeadsThanPairs", {1, 12, 1, 16}, {4, 6, 12}, {1, 2, 4}, kFixed, kAllHeads, kConstant, false, std::nullopt},
      {"FixedSegmentLongerThanSequence", {2, 10, 2, 16}, {16, 32}, {2, 4}, kFixed, kGroups, kConstant, false, std::nullopt},
      {"FixedRateEqualsSegmentLength", {1, 14, 2, 16}, {4, 2}, {4, 1}, kFixed, kGroups, kConstant, true, std::nullopt},
      {"FixedOneDensePairHeadDim256", {1, 13, 2, 256}, {13}, {1}, kFixed, kGroups, kConstant, false, std::nullopt},
      {"FixedHeadDim256Causal", {1, 9, 2, 256}, {4, 8}, {2, 1}, kFixed, kGroups, kConstant, true, std::nullopt},
      {"FixedExplicitScale", {2, 12, 2, 32}, {6, 12}, {2, 3}, kFixed, kGroups, kConstant, false, 0.37},
      {"GlobalGroupsExtraHeadsLast", {2, 19, 5, 16}, {4, 8, 16}, {1, 2, 4}, kGlobal, kGroups, kConstant, false, std::nullopt},
      {"GlobalGroupsCausal", {1, 16, 4, 64}, {8, 8}, {2, 4}, kGlobal, kGroups, kConstant, true, std::nullopt},
      {"GlobalRateOneIsDenseCausal", {3, 11, 2, 32}, {8}, {1}, kGlobal, kGroups, kConstant, true, std::nullopt},
      // The global variant has head groups only (docs/dilated-attention.md): kAllHeads with
      // it is an option error, checked in bad_options().
  };
  return table;
}

using CaseAndDType = std::tuple<Case, DType>;

class DilatedAttentionVsReference : public ::testing::TestWithParam<CaseAndDType> {};

// In the poisoned pools (kPoisonedPools) this also checks what is never written: all-heads
// partials are merged without being zeroed (the merge reads only the rows a call wrote), and
// head-group outputs are zeroed only where no call writes, so a row read or left unwritten
// would show as NaN.
TEST_P(DilatedAttentionVsReference, OutAndLseMatch) {
  const auto& [c, dtype] = GetParam();
  Qkv in = make_qkv(c.shape, dtype, QkvLayout::kContiguous, 0xa11ce);
  EXPECT_TRUE(matches_reference(in, c.options()));
}

std::string case_dtype_name(const ::testing::TestParamInfo<CaseAndDType>& info) {
  return std::get<0>(info.param).name + "_" +
         std::string(dtype_short_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllCases, DilatedAttentionVsReference,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::ValuesIn(kAllFloatTypes)),
                         case_dtype_name);

// Non-contiguous inputs: each layout on a few representative cases, float64 and bfloat16.
using CaseLayoutDType = std::tuple<int, QkvLayout, DType>;

class DilatedAttentionLayouts : public ::testing::TestWithParam<CaseLayoutDType> {};

TEST_P(DilatedAttentionLayouts, StridedInputsMatchTheReference) {
  const auto& [index, layout, dtype] = GetParam();
  const Case& c = cases()[index];
  Qkv in = make_qkv(c.shape, dtype, layout, 0xb0b);
  EXPECT_TRUE(matches_reference(in, c.options()));
}

INSTANTIATE_TEST_SUITE_P(
    Views, DilatedAttentionLayouts,
    ::testing::Combine(::testing::Values(1, 6, 7, 15),  // ragged N and H, all heads, global
                       ::testing::Values(QkvLayout::kTransposed, QkvLayout::kSliced,
                                         QkvLayout::kExpanded, QkvLayout::kHeadsMajor,
                                         QkvLayout::kPackedQkv, QkvLayout::kMixed),
                       ::testing::Values(DType::kFloat64, DType::kBFloat16)),
    [](const ::testing::TestParamInfo<CaseLayoutDType>& info) {
      return cases()[std::get<0>(info.param)].name + "_" +
             layout_label(std::get<1>(info.param)) + "_" +
             std::string(dtype_short_name(std::get<2>(info.param)));
    });

TEST(DilatedAttention, DefaultScaleIsInverseSqrtHeadDim) {
  Qkv in = make_qkv({1, 12, 2, 16}, DType::kFloat64, QkvLayout::kContiguous, 7);
  DilatedAttentionOptions implicit = pairs({6, 12}, {1, 2});
  DilatedAttentionOptions explicit_scale = implicit;
  explicit_scale.scale = 0.25;
  Got a = run_library(in.q, in.k, in.v, implicit);
  Got b = run_library(in.q, in.k, in.v, explicit_scale);
  EXPECT_TRUE(values_close(a.out, b.out, {0.0, 0.0}));
  EXPECT_TRUE(values_close(a.lse, b.lse, {0.0, 0.0}));
  explicit_scale.scale = 1.0;  // a different scale must change the result
  Got c = run_library(in.q, in.k, in.v, explicit_scale);
  EXPECT_FALSE(values_close(a.out, c.out, {1e-6, 1e-6}));
}

TEST(DilatedAttention, DilatedAttentionEqualsTheOutOfWithLse) {
  Qkv in = make_qkv({2, 14, 3, 16}, DType::kFloat32, QkvLayout::kContiguous, 8);
  DilatedAttentionOptions o = cases()[3].options();
  RefArray out_only = to_ref(nn::dilated_attention(in.q, in.k, in.v, o));
  EXPECT_TRUE(values_close(run_library(in.q, in.k, in.v, o).out, out_only, {0.0, 0.0}));
}

// ---------------------------------------------------------------------------------------
// Worked examples of docs/dilated-attention.md on the library. Values are one-hot (v[n] =
// e_n, so D = N): an output row's non-zero entries are exactly the keys it attended, which
// is checked exactly, and the values match the reference within rounding.

Qkv one_hot_example(int64_t seq, int64_t heads, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> magnitude(0.1, 1.0);
  std::bernoulli_distribution sign(0.5);
  Shape shape = {1, seq, heads, seq};
  RefArray q = RefArray::filled(shape, 0.0), k = q, v = q;
  for (double& x : q.data) x = (sign(rng) ? 1 : -1) * magnitude(rng);
  for (double& x : k.data) x = (sign(rng) ? 1 : -1) * magnitude(rng);
  for (int64_t n = 0; n < seq; ++n) {
    for (int64_t h = 0; h < heads; ++h) v.at({0, n, h, n}) = 1.0;
  }
  Tensor t[3] = {from_ref(q, dtype), from_ref(k, dtype), from_ref(v, dtype)};
  return {t[0], t[1], t[2], to_ref(t[0]), to_ref(t[1]), to_ref(t[2])};
}

// Exact: the same entries are zero, the same LSEs are -inf.
::testing::AssertionResult same_support(const Expected& expected, const Got& got) {
  for (int64_t i = 0; i < expected.out.numel(); ++i) {
    if ((expected.out.data[i] == 0.0) != (got.out.data[i] == 0.0)) {
      return ::testing::AssertionFailure()
             << "out at " << shape_string(ref::unravel(i, expected.out.shape)) << ": expected "
             << expected.out.data[i] << ", got " << got.out.data[i];
    }
  }
  for (int64_t i = 0; i < expected.lse.numel(); ++i) {
    if (std::isinf(expected.lse.data[i]) != std::isinf(got.lse.data[i])) {
      return ::testing::AssertionFailure()
             << "lse at " << shape_string(ref::unravel(i, expected.lse.shape)) << ": expected "
             << expected.lse.data[i] << ", got " << got.lse.data[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// Row n of head h equals v[p] exactly (a query that attends only to itself).
void expect_row_is_value(const Got& got, const Qkv& in, int64_t n, int64_t h, int64_t p) {
  for (int64_t d = 0; d < in.v.size(3); ++d) {
    EXPECT_EQ(got.out.at({0, n, h, d}), in.v_values.at({0, p, h, d})) << "row " << n << " d " << d;
  }
}

void expect_row_zero(const Got& got, int64_t n, int64_t h) {
  for (int64_t d = 0; d < got.out.shape[3]; ++d) {
    EXPECT_EQ(got.out.at({0, n, h, d}), 0.0) << "row " << n << " head " << h;
  }
  EXPECT_EQ(got.lse.at({0, h, n}), -kInf) << "row " << n << " head " << h;
}

// The keys row n of head h attended, read from the one-hot output.
std::vector<int64_t> attended(const Got& got, int64_t n, int64_t h) {
  std::vector<int64_t> keys;
  for (int64_t d = 0; d < got.out.shape[3]; ++d) {
    if (got.out.at({0, n, h, d}) != 0.0) keys.push_back(d);
  }
  return keys;
}

using V = std::vector<int64_t>;

class DilatedAttentionExamples : public ::testing::TestWithParam<DType> {
 protected:
  // Runs the library, checks it against the reference, and returns its result.
  Got run(const Qkv& in, const DilatedAttentionOptions& o) {
    Got got = run_library(in.q, in.k, in.v, o);
    Expected expected = reference_for(in.q_values, in.k_values, in.v_values, o);
    const int64_t keys = max_keys(in.q.size(1), o);
    EXPECT_TRUE(values_close(
        expected.out, got.out,
        merged_out_tolerance(GetParam(), in.q.size(3), keys, o, expected.lse)));
    EXPECT_TRUE(values_close(expected.lse, got.lse, lse_tolerance(in.q.size(3), keys)));
    EXPECT_TRUE(same_support(expected, got));
    return got;
  }
};

TEST_P(DilatedAttentionExamples, Example1FixedConstantOffsets) {
  Qkv in = one_hot_example(16, 2, GetParam(), 1);
  Got got = run(in, pairs({8, 8}, {2, 2}));
  EXPECT_EQ(attended(got, 4, 0), (V{0, 2, 4, 6}));
  EXPECT_EQ(attended(got, 10, 0), (V{8, 10, 12, 14}));
  EXPECT_EQ(attended(got, 1, 1), (V{1, 3, 5, 7}));
  EXPECT_EQ(attended(got, 15, 1), (V{9, 11, 13, 15}));
  for (int64_t p = 0; p < 16; ++p) expect_row_zero(got, p, p % 2 == 0 ? 1 : 0);
}

TEST_P(DilatedAttentionExamples, Example2GlobalVariant) {
  Qkv in = one_hot_example(16, 2, GetParam(), 2);
  DilatedAttentionOptions o = pairs({8, 8}, {2, 2});
  o.variant = DilationVariant::kGlobal;
  Got got = run(in, o);
  for (int64_t j = 0; j < 16; ++j) {
    EXPECT_EQ(attended(got, j, 0), (V{0, 2, 4, 6, 8, 10, 12, 14})) << j;
    EXPECT_EQ(attended(got, j, 1), (V{1, 3, 5, 7, 9, 11, 13, 15})) << j;
  }
  // Rows are not scattered back: row j and row j + 8 hold the same query's result.
  for (int64_t j = 0; j < 8; ++j) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t d = 0; d < 16; ++d) EXPECT_EQ(got.out.at({0, j, h, d}), got.out.at({0, j + 8, h, d}));
      EXPECT_EQ(got.lse.at({0, h, j}), got.lse.at({0, h, j + 8}));
    }
  }
}

TEST_P(DilatedAttentionExamples, Example3ShortLastSegment) {
  Qkv in = one_hot_example(10, 2, GetParam(), 3);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.mixing = HeadMixing::kAllHeads;
  Got got = run(in, o);
  expect_row_is_value(got, in, 9, 1, 9);
  EXPECT_EQ(attended(got, 9, 1), (V{9}));
  EXPECT_EQ(attended(got, 5, 1), (V{5, 7}));
  expect_row_is_value(got, in, 8, 0, 8);
  for (int64_t p : {0, 2, 4, 6, 8}) expect_row_zero(got, p, 1);
}

TEST_P(DilatedAttentionExamples, Example4RotatingOffsets) {
  Qkv in = one_hot_example(16, 1, GetParam(), 4);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.offset_rule = OffsetRule::kRotating;
  Got got = run(in, o);
  const std::vector<V> segments = {{0, 2}, {5, 7}, {8, 10}, {13, 15}};
  for (const V& segment : segments) {
    for (int64_t p : segment) EXPECT_EQ(attended(got, p, 0), segment) << p;
  }
  for (int64_t p : {1, 3, 4, 6, 9, 11, 12, 14}) expect_row_zero(got, p, 0);
}

TEST_P(DilatedAttentionExamples, Example5CausalFixed) {
  Qkv in = one_hot_example(8, 1, GetParam(), 5);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.causal = true;
  Got got = run(in, o);
  expect_row_is_value(got, in, 0, 0, 0);
  EXPECT_EQ(attended(got, 2, 0), (V{0, 2}));
  expect_row_is_value(got, in, 4, 0, 4);
  EXPECT_EQ(attended(got, 6, 0), (V{4, 6}));
  for (int64_t p : {1, 3, 5, 7}) expect_row_zero(got, p, 0);
}

TEST_P(DilatedAttentionExamples, Example6AllHeads) {
  Qkv in = one_hot_example(8, 2, GetParam(), 6);
  DilatedAttentionOptions o = pairs({4, 8}, {1, 2});
  o.mixing = HeadMixing::kAllHeads;
  Got got = run(in, o);
  EXPECT_EQ(attended(got, 1, 0), (V{0, 1, 2, 3}));
  EXPECT_EQ(attended(got, 2, 0), (V{0, 1, 2, 3, 4, 6}));
  EXPECT_EQ(attended(got, 1, 1), (V{0, 1, 2, 3, 5, 7}));
  EXPECT_EQ(attended(got, 2, 1), (V{0, 1, 2, 3}));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DilatedAttentionExamples, ::testing::ValuesIn(kAllFloatTypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_short_name(info.param));
                         });

// ---------------------------------------------------------------------------------------
// Extreme inputs.

// q, k = +-50 (exact in every dtype): with D = 16 and scale 1/4 the scores are multiples of
// 1250 in [-1e4, 1e4], computed exactly in float32, so every dtype must match the reference.
Qkv extreme_qkv(const Shape& shape, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution sign(0.5);
  RefArray q = RefArray::filled(shape, 0.0), k = q;
  for (double& x : q.data) x = sign(rng) ? 50.0 : -50.0;
  for (double& x : k.data) x = sign(rng) ? 50.0 : -50.0;
  RefArray v = draw_any(shape, dtype, rng);
  Tensor t[3] = {from_ref(q, dtype), from_ref(k, dtype), from_ref(v, dtype)};
  return {t[0], t[1], t[2], to_ref(t[0]), to_ref(t[1]), to_ref(t[2])};
}

bool all_finite(const RefArray& a) {
  return std::all_of(a.data.begin(), a.data.end(), [](double x) { return std::isfinite(x); });
}

class DilatedAttentionExtreme : public ::testing::TestWithParam<DType> {};

TEST_P(DilatedAttentionExtreme, ScoresAroundTenThousandStayFiniteAndCorrect) {
  for (const Case* c : {&cases()[1], &cases()[6], &cases()[15]}) {
    SCOPED_TRACE(c->name);
    Shape shape = c->shape;
    shape[3] = 16;
    Qkv in = extreme_qkv(shape, GetParam(), 11);
    Got got = run_library(in.q, in.k, in.v, c->options());
    EXPECT_TRUE(all_finite(got.out));
    EXPECT_TRUE(matches_reference(in, c->options()));
  }
}

TEST_P(DilatedAttentionExtreme, RowsNoPairSelectsGiveZeroAndNoNaNGradients) {
  // All heads, pairs (4, 2) and (8, 4): head 0 leaves the odd positions unselected.
  DilatedAttentionOptions o = pairs({4, 8}, {2, 4});
  o.mixing = HeadMixing::kAllHeads;
  o.causal = true;
  Qkv in = extreme_qkv({1, 8, 1, 16}, GetParam(), 12);
  Tensor q = in.q.detach(), k = in.k.detach(), v = in.v.detach();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(q, k, v, o);
  Got got{to_ref(r.out), to_ref(r.lse), r.path_used};
  for (int64_t p : {1, 3, 5, 7}) expect_row_zero(got, p, 0);
  EXPECT_TRUE(all_finite(got.out));
  Tensor finite_lse = where(gt(r.lse, -kInf), r.lse, 0.0);
  autograd::backward({r.out, finite_lse},
                     {ones_like(r.out), full_like(finite_lse, 0.5)});
  for (const Tensor* t : {&q, &k, &v}) {
    ASSERT_TRUE(t->grad().defined());
    EXPECT_TRUE(all_finite(to_ref(t->grad())));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DilatedAttentionExtreme, ::testing::ValuesIn(kAllFloatTypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_short_name(info.param));
                         });

TEST(DilatedAttention, HugeScaleScoresInFloat64) {
  Qkv in = make_qkv({2, 12, 2, 8}, DType::kFloat64, QkvLayout::kContiguous, 13);
  DilatedAttentionOptions o = pairs({4, 12}, {1, 3});
  o.scale = 3e3;  // scores of order +-1e4
  EXPECT_TRUE(matches_reference(in, o));
}

// ---------------------------------------------------------------------------------------
// Finite-difference gradients (float64, math path), through out and through lse.

struct GradCase {
  std::string name;
  DilationVariant variant;
  HeadMixing mixing;
  OffsetRule rule;
  bool causal;
  int64_t batch;
  bool strided_too;  // also check inputs in a transposed layout
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

std::vector<GradCase> grad_cases() {
  std::vector<GradCase> out;
  for (DilationVariant variant : {kFixed, kGlobal}) {
    for (HeadMixing mixing : {kGroups, kAllHeads}) {
      if (variant == kGlobal && mixing == kAllHeads) continue;  // an option error
      for (bool causal : {false, true}) {
        std::string name = std::string(variant == kFixed ? "Fixed" : "Global") +
                           (mixing == kGroups ? "Groups" : "AllHeads") + (causal ? "Causal" : "");
        out.push_back({name, variant, mixing, kConstant, causal, 1, false});
      }
    }
  }
  out.push_back({"FixedGroupsRotatingCausalBatch2", kFixed, kGroups, kRotating, true, 2, true});
  out.push_back({"FixedAllHeadsRotating", kFixed, kAllHeads, kRotating, false, 1, false});
  return out;
}

class DilatedAttentionGradients : public ::testing::TestWithParam<GradCase> {
 protected:
  // N = 10, H = 3 over pairs (4, 1) and (6, 2): a short last segment, H % G != 0, an r = 1
  // pair, and (fixed variant) positions that no pair of a head selects.
  DilatedAttentionOptions options() const {
    DilatedAttentionOptions o = pairs({4, 6}, {1, 2});
    o.variant = GetParam().variant;
    o.mixing = GetParam().mixing;
    o.offset_rule = GetParam().rule;
    o.causal = GetParam().causal;
    return o;
  }
  std::vector<Tensor> inputs(Layout layout) const {
    std::mt19937_64 rng(21);
    std::vector<Tensor> in;
    for (int i = 0; i < 3; ++i) {
      in.push_back(make_input({GetParam().batch, 10, 3, 2}, DType::kFloat64, layout,
                              Device::cpu(),
                              [](const Shape& s, std::mt19937_64& r) {
                                return draw_any(s, DType::kFloat64, r);
                              },
                              rng)
                       .leaf);
    }
    return in;
  }
};

TEST_P(DilatedAttentionGradients, ThroughOut) {
  DilatedAttentionOptions o = options();
  auto fn = [o](const std::vector<Tensor>& x) -> Tensor {
    return nn::dilated_attention_with_lse(x[0], x[1], x[2], o).out;
  };
  EXPECT_TRUE(gradcheck(fn, inputs(Layout::kContiguous)));
  if (GetParam().strided_too) {
    EXPECT_TRUE(gradcheck(fn, inputs(Layout::kTransposed)));
  }
}

TEST_P(DilatedAttentionGradients, ThroughLse) {
  DilatedAttentionOptions o = options();
  // -inf entries (rows that saw no key) are masked out of the loss: they have no gradient.
  auto fn = [o](const std::vector<Tensor>& x) -> Tensor {
    Tensor lse = nn::dilated_attention_with_lse(x[0], x[1], x[2], o).lse;
    return where(gt(lse, -kInf), lse, 0.0).to(DType::kFloat64);
  };
  GradcheckOptions check;
  // The LSE is stored in float32 (relative rounding 6e-8): central differences need a larger
  // step, so truncation (eps^2) and rounding (6e-8 / eps) both stay near 1e-4.
  check.eps = 2e-3;
  check.rtol = 2e-3;
  check.atol = 2e-3;
  EXPECT_TRUE(gradcheck(fn, inputs(Layout::kContiguous), check));
}

INSTANTIATE_TEST_SUITE_P(Combinations, DilatedAttentionGradients,
                         ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& info) {
                           return info.param.name;
                         });

TEST(DilatedAttention, GradientsWithAFixedDropoutMask) {
  // Re-seeding the generator on each call fixes the mask, so the function is smooth.
  DilatedAttentionOptions o = pairs({4, 8}, {1, 2});
  o.causal = true;
  o.dropout = 0.3;
  auto fn = [o](const std::vector<Tensor>& x) -> Tensor {
    Generator gen(99);
    return nn::dilated_attention(x[0], x[1], x[2], o, {true, &gen});
  };
  std::mt19937_64 rng(22);
  std::vector<Tensor> in;
  for (int i = 0; i < 3; ++i) {
    in.push_back(from_ref(draw_any({1, 8, 2, 3}, DType::kFloat64, rng), DType::kFloat64));
  }
  EXPECT_TRUE(gradcheck(fn, in));
}

// ---------------------------------------------------------------------------------------
// Option errors: rd::Error (kInvalidArgument) whose message names the option.

::testing::AssertionResult throws_naming(const std::function<void()>& call,
                                         const std::vector<std::string>& any_of,
                                         const std::vector<std::string>& all_of = {}) {
  try {
    call();
  } catch (const Error& e) {
    std::string message = e.what();
    bool named = any_of.empty();
    for (const std::string& name : any_of) named |= message.find(name) != std::string::npos;
    for (const std::string& piece : all_of) named &= message.find(piece) != std::string::npos;
    if (!named) return ::testing::AssertionFailure() << "message does not name it: " << message;
    if (e.code() != ErrorCode::kInvalidArgument) {
      return ::testing::AssertionFailure()
             << "code " << error_code_name(e.code()) << ", message: " << message;
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-rd::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

struct BadOptions {
  std::string what;
  DilatedAttentionOptions options;
  int64_t heads;
  std::vector<std::string> any_of;
  std::vector<std::string> all_of;
};

std::vector<BadOptions> bad_options() {
  const std::vector<std::string> lists = {"segment_lengths", "dilation_rates"};
  auto with = [](auto edit) {
    DilatedAttentionOptions o = pairs({8, 16}, {2, 4});
    edit(o);
    return o;
  };
  return {
      {"empty lists", pairs({}, {}), 4, lists, {}},
      {"unequal lists", pairs({8, 16}, {2}), 4, lists, {}},
      {"zero segment", pairs({0, 16}, {1, 4}), 4, {"segment_lengths"}, {"0"}},
      {"negative segment", pairs({-8, 16}, {2, 4}), 4, {"segment_lengths"}, {"-8"}},
      {"zero rate", pairs({8, 16}, {0, 4}), 4, {"dilation_rates"}, {}},
      {"rate not dividing", pairs({8, 6}, {2, 4}), 4, lists, {"6", "4"}},
      {"dropout 1", with([](auto& o) { o.dropout = 1.0; }), 4, {"dropout"}, {}},
      {"dropout negative", with([](auto& o) { o.dropout = -0.1; }), 4, {"dropout"}, {}},
      {"dropout NaN", with([](auto& o) { o.dropout = std::nan(""); }), 4, {"dropout"}, {}},
      {"scale 0", with([](auto& o) { o.scale = 0.0; }), 4, {"scale"}, {}},
      {"scale negative", with([](auto& o) { o.scale = -1.0; }), 4, {"scale"}, {}},
      {"scale inf", with([](auto& o) { o.scale = kInf; }), 4, {"scale"}, {}},
      {"scale NaN", with([](auto& o) { o.scale = std::nan(""); }), 4, {"scale"}, {}},
      {"fewer heads than groups", pairs({8, 16}, {2, 4}), 1, {"head"}, {}},
      {"fewer heads than groups, global",
       with([](auto& o) { o.variant = DilationVariant::kGlobal; }), 1, {"head"}, {}},
      {"all-heads mixing with the global variant",
       with([](auto& o) {
         o.variant = DilationVariant::kGlobal;
         o.mixing = HeadMixing::kAllHeads;
       }),
       4, {"mixing"}, {}},
  };
}

TEST(DilatedAttentionOptionsTest, ValidateOptionsNamesTheOption) {
  for (const BadOptions& bad : bad_options()) {
    EXPECT_TRUE(throws_naming([&] { nn::validate_options(bad.options, bad.heads); }, bad.any_of,
                              bad.all_of))
        << bad.what;
  }
}

TEST(DilatedAttentionOptionsTest, FunctionalApiRejectsBadOptions) {
  for (const BadOptions& bad : bad_options()) {
    Qkv in = make_qkv({1, 16, bad.heads, 8}, DType::kFloat32, QkvLayout::kContiguous, 30);
    EXPECT_TRUE(throws_naming([&] { nn::dilated_attention(in.q, in.k, in.v, bad.options); },
                              bad.any_of, bad.all_of))
        << bad.what;
  }
}

TEST(DilatedAttentionOptionsTest, ValidOptionsPass) {
  EXPECT_NO_THROW(nn::validate_options(pairs({8, 16}, {2, 4}), 2));
  EXPECT_NO_THROW(nn::validate_options(pairs({1}, {1}), 1));
  DilatedAttentionOptions all_heads = pairs({8, 16, 32}, {1, 2, 4});
  all_heads.mixing = HeadMixing::kAllHeads;  // H < G is fine when every head runs every pair
  EXPECT_NO_THROW(nn::validate_options(all_heads, 1));
  all_heads.dropout = 0.999;
  all_heads.scale = 1e-6;
  EXPECT_NO_THROW(nn::validate_options(all_heads, 1));
}

TEST(DilatedAttentionOptionsTest, BadInputsAreErrors) {
  DilatedAttentionOptions o = pairs({4}, {2});
  Qkv a = make_qkv({1, 8, 2, 4}, DType::kFloat32, QkvLayout::kContiguous, 31);
  Qkv longer = make_qkv({1, 12, 2, 4}, DType::kFloat32, QkvLayout::kContiguous, 32);
  Qkv f64 = make_qkv({1, 8, 2, 4}, DType::kFloat64, QkvLayout::kContiguous, 33);
  EXPECT_THROW(nn::dilated_attention(a.q, longer.k, longer.v, o), Error);
  EXPECT_THROW(nn::dilated_attention(a.q, a.k, f64.v, o), Error);
  EXPECT_THROW(nn::dilated_attention(a.q.select(0, 0), a.k.select(0, 0), a.v.select(0, 0), o),
               Error);
  Tensor ints = zeros({1, 8, 2, 4}, DType::kInt64);
  EXPECT_THROW(nn::dilated_attention(ints, ints, ints, o), Error);
  // Training with dropout needs a generator.
  o.dropout = 0.2;
  EXPECT_TRUE(throws_naming([&] { nn::dilated_attention(a.q, a.k, a.v, o, {true, nullptr}); },
                            {"generator"}));
}

// ---------------------------------------------------------------------------------------
// Dropout (not in the reference).

TEST(DilatedAttentionDropout, ZeroProbabilityInTrainingEqualsEval) {
  Qkv in = make_qkv({2, 16, 3, 16}, DType::kFloat32, QkvLayout::kContiguous, 40);
  DilatedAttentionOptions o = cases()[0].options();
  Generator gen(5);
  Got train = run_library(in.q, in.k, in.v, o, {true, &gen});
  Got eval = run_library(in.q, in.k, in.v, o);
  EXPECT_TRUE(values_close(eval.out, train.out, {0.0, 0.0}));
  EXPECT_TRUE(values_close(eval.lse, train.lse, {0.0, 0.0}));
}

TEST(DilatedAttentionDropout, EvalModeIgnoresDropout) {
  Qkv in = make_qkv({2, 16, 3, 16}, DType::kFloat32, QkvLayout::kContiguous, 41);
  DilatedAttentionOptions o = cases()[0].options();
  Got plain = run_library(in.q, in.k, in.v, o);
  o.dropout = 0.4;
  Generator gen(5);
  Got eval = run_library(in.q, in.k, in.v, o, {false, &gen});
  EXPECT_TRUE(values_close(plain.out, eval.out, {0.0, 0.0}));
  EXPECT_TRUE(matches_reference(in, o));
}

TEST(DilatedAttentionDropout, SeededAndReproducible) {
  Qkv in = make_qkv({2, 16, 3, 16}, DType::kFloat32, QkvLayout::kContiguous, 42);
  for (const Case* c : {&cases()[0], &cases()[5], &cases()[14]}) {
    SCOPED_TRACE(c->name);
    DilatedAttentionOptions o = c->options();
    o.dropout = 0.3;
    Generator a(7), b(7), other(8);
    Got first = run_library(in.q, in.k, in.v, o, {true, &a});
    Got again = run_library(in.q, in.k, in.v, o, {true, &b});
    Got different = run_library(in.q, in.k, in.v, o, {true, &other});
    EXPECT_TRUE(all_finite(first.out));
    EXPECT_TRUE(values_close(first.out, again.out, {0.0, 0.0}));
    EXPECT_FALSE(values_close(first.out, different.out, {1e-3, 1e-3})) << "seeds 7 and 8 agree";
    // The generator advances: a second call with it draws another mask.
    EXPECT_NE(a.state().offset, 0u);
    Got next = run_library(in.q, in.k, in.v, o, {true, &a});
    EXPECT_FALSE(values_close(first.out, next.out, {1e-3, 1e-3})) << "mask reused";
    // The LSE is that of the scores, before dropout.
    Got eval = run_library(in.q, in.k, in.v, o);
    EXPECT_TRUE(values_close(eval.lse, first.lse, tolerance_for(DType::kFloat32, 2)));
  }
}

TEST(DilatedAttentionDropout, SurvivorsAreScaledAndTheDropRateIsP) {
  // One dense pair, one-hot values: out[n, h, m] = p(n, m) * keep / (1 - p), entry by entry.
  const double p = 0.25;
  const int64_t seq = 32;
  std::mt19937_64 rng(43);
  Shape shape = {2, seq, 2, seq};
  RefArray v = RefArray::filled(shape, 0.0);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t n = 0; n < seq; ++n) {
      for (int64_t h = 0; h < 2; ++h) v.at({b, n, h, n}) = 1.0;
    }
  }
  Tensor q = from_ref(draw_any(shape, DType::kFloat64, rng), DType::kFloat64);
  Tensor k = from_ref(draw_any(shape, DType::kFloat64, rng), DType::kFloat64);
  Tensor vt = from_ref(v, DType::kFloat64);
  DilatedAttentionOptions o = pairs({seq}, {1});
  RefArray eval = run_library(q, k, vt, o).out;
  o.dropout = p;
  Generator gen(123);
  RefArray train = run_library(q, k, vt, o, {true, &gen}).out;
  int64_t dropped = 0, bad = 0;
  for (int64_t i = 0; i < eval.numel(); ++i) {
    if (train.data[i] == 0.0) {
      ++dropped;
    } else if (std::abs(train.data[i] - eval.data[i] / (1 - p)) > 1e-12) {
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << "kept probabilities not scaled by 1 / (1 - p)";
  double rate = static_cast<double>(dropped) / static_cast<double>(eval.numel());
  EXPECT_NEAR(rate, p, 0.03) << "over " << eval.numel() << " probabilities";
}

// ---------------------------------------------------------------------------------------
// Hilbert order: a permutation of each segment's keys, so the same result within rounding.

TEST(HilbertOrder, IsAPermutation) {
  for (int64_t n : {0, 1, 2, 3, 4, 5, 7, 15, 16, 17, 63, 64, 65, 100, 1000, 4096, 5000}) {
    const std::vector<int64_t> order = nn::hilbert_order(n);
    ASSERT_EQ(static_cast<int64_t>(order.size()), n) << "n = " << n;
    std::vector<bool> seen(static_cast<size_t>(n), false);
    for (int64_t p : order) {
      ASSERT_TRUE(p >= 0 && p < n) << "n = " << n << ": " << p << " out of range";
      ASSERT_FALSE(seen[static_cast<size_t>(p)]) << "n = " << n << ": " << p << " twice";
      seen[static_cast<size_t>(p)] = true;
    }
  }
}

// On a full 2^k x 2^k grid the curve moves one cell at a time, starts in a corner and is not
// the row-major order (which jumps at every row end).
TEST(HilbertOrder, StepsToAGridNeighbourOnFullGrids) {
  for (int64_t side : {2, 4, 8, 16, 32, 64}) {
    const std::vector<int64_t> order = nn::hilbert_order(side * side);
    EXPECT_EQ(order.front(), 0) << "side " << side;
    for (size_t t = 1; t < order.size(); ++t) {
      const int64_t a = order[t - 1], b = order[t];
      const int64_t distance = std::abs(a / side - b / side) + std::abs(a % side - b % side);
      ASSERT_EQ(distance, 1) << "side " << side << ": step " << t << " from " << a << " to " << b;
    }
  }
}

TEST(HilbertOrder, NegativeLengthIsAnError) {
  EXPECT_THROW(nn::hilbert_order(-1), Error);
}

// Every variant, mixing, offset rule and causal setting: use_hilbert only reorders the
// sums, so the result still matches the float64 reference, and the plain run closely.
TEST(DilatedAttentionHilbert, SameResultAsWithout) {
  for (size_t index = 0; index < cases().size(); ++index) {
    const Case& c = cases()[index];
    for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(c.name + " " + std::string(dtype_short_name(dtype)));
      Qkv in = make_qkv(c.shape, dtype, QkvLayout::kContiguous, 50);
      DilatedAttentionOptions o = c.options();
      Got plain = run_library(in.q, in.k, in.v, o);
      o.use_hilbert = true;
      EXPECT_TRUE(matches_reference(in, o));
      Got hilbert = run_library(in.q, in.k, in.v, o);
      EXPECT_EQ(hilbert.path, AttentionPath::kMath);
      const int64_t keys = max_keys(c.shape[1], o);
      Tolerance tol = out_tolerance(dtype, c.shape[3], keys);
      EXPECT_TRUE(values_close(plain.out, hilbert.out, {2 * tol.rtol, 2 * tol.atol}));
      EXPECT_TRUE(values_close(plain.lse, hilbert.lse, lse_tolerance(c.shape[3], keys)));
    }
  }
}

// The dropout mask belongs to (query, key) pairs, not to visiting steps: the same mask.
TEST(DilatedAttentionHilbert, SameDropoutMaskAsWithout) {
  const Case& c = cases()[7];  // all heads, rotating, causal
  Qkv in = make_qkv(c.shape, DType::kFloat64, QkvLayout::kContiguous, 53);
  DilatedAttentionOptions o = c.options();
  o.dropout = 0.4;
  Generator plain_gen(77), hilbert_gen(77);
  Got plain = run_library(in.q, in.k, in.v, o, {true, &plain_gen});
  o.use_hilbert = true;
  Got hilbert = run_library(in.q, in.k, in.v, o, {true, &hilbert_gen});
  EXPECT_TRUE(values_close(plain.out, hilbert.out, {1e-12, 1e-12}));
  EXPECT_TRUE(plain_gen.state() == hilbert_gen.state());
}

// The orders come from the pattern cache given in the call context, once per length.
TEST(DilatedAttentionHilbert, OrdersAreCachedPerLength) {
  const Case& c = cases()[1];  // N = 21 over pairs (4,1), (8,2), (16,4)
  Qkv in = make_qkv(c.shape, DType::kFloat32, QkvLayout::kContiguous, 54);
  DilatedAttentionOptions o = c.options();
  o.use_hilbert = true;
  nn::PatternCache cache;
  AttentionCallContext context;
  context.patterns = &cache;
  nn::dilated_attention(in.q, in.k, in.v, o, context);
  const nn::PatternCacheStats first = cache.stats();
  EXPECT_GT(first.misses, 0);
  EXPECT_EQ(first.entries, first.misses);
  nn::dilated_attention(in.q, in.k, in.v, o, context);
  const nn::PatternCacheStats second = cache.stats();
  EXPECT_EQ(second.misses, first.misses) << "a second call recomputed an order";
  EXPECT_GT(second.hits, first.hits);
}

TEST(DilatedAttentionHilbert, SameGradientsAsWithout) {
  DilatedAttentionOptions o = pairs({8, 16}, {1, 2});
  o.causal = true;
  std::mt19937_64 rng(51);
  std::vector<Tensor> in;
  for (int i = 0; i < 3; ++i) {
    in.push_back(from_ref(draw_any({1, 20, 2, 8}, DType::kFloat64, rng), DType::kFloat64));
  }
  auto fn_for = [](DilatedAttentionOptions opts) {
    return [opts](const std::vector<Tensor>& x) -> std::vector<Tensor> {
      return {nn::dilated_attention(x[0], x[1], x[2], opts)};
    };
  };
  std::vector<Tensor> plain = analytic_gradients(fn_for(o), in, 3);
  o.use_hilbert = true;
  std::vector<Tensor> hilbert = analytic_gradients(fn_for(o), in, 3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(plain[i].defined() && hilbert[i].defined());
    EXPECT_TRUE(values_close(to_ref(plain[i]), to_ref(hilbert[i]), {1e-12, 1e-12})) << "input " << i;
  }
}

// ---------------------------------------------------------------------------------------
// Packed q, k, v: the same results and gradients as three separate inputs.

TEST(DilatedAttentionPacked, SameResultsAndGradientsAsSeparateInputs) {
  for (int index : {2, 5, 7, 15}) {  // head groups causal, all heads, all heads causal, global
    const Case& c = cases()[index];
    SCOPED_TRACE(c.name);
    const DilatedAttentionOptions o = c.options();
    std::mt19937_64 rng(55);
    const Shape packed_shape{c.shape[0], c.shape[1], 3, c.shape[2], c.shape[3]};
    Tensor qkv = from_ref(draw_any(packed_shape, DType::kFloat64, rng), DType::kFloat64);
    Tensor separate = qkv.detach().clone();
    qkv.set_requires_grad(true);
    separate.set_requires_grad(true);
    nn::DilatedAttentionResult packed = nn::dilated_attention_qkv_with_lse(qkv, o);
    nn::DilatedAttentionResult split = nn::dilated_attention_with_lse(
        separate.select(2, 0), separate.select(2, 1), separate.select(2, 2), o);
    EXPECT_TRUE(values_close(to_ref(packed.out), to_ref(split.out), {1e-14, 1e-14}));
    EXPECT_TRUE(values_close(to_ref(packed.lse), to_ref(split.lse), {1e-14, 1e-14}));
    std::vector<Tensor> weights = upstream_gradients({packed.out}, 56);
    autograd::backward({packed.out}, {weights[0]});
    autograd::backward({split.out}, {weights[0]});
    ASSERT_TRUE(qkv.grad().defined() && separate.grad().defined());
    EXPECT_TRUE(values_close(to_ref(qkv.grad()), to_ref(separate.grad()), {1e-13, 1e-13}));
  }
}

TEST(DilatedAttentionPacked, BadShapeIsAnError) {
  DilatedAttentionOptions o = pairs({4}, {1});
  for (const Shape& shape : {Shape{1, 8, 2, 16}, Shape{1, 8, 2, 2, 16}}) {
    try {
      nn::dilated_attention_qkv_with_lse(zeros(shape), o);
      ADD_FAILURE() << "accepted qkv of shape " << shape_string(shape);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch) << e.what();
      EXPECT_NE(std::string(e.what()).find("qkv"), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------
// Path selection on the CPU: every forced path ends on the math path.

TEST(DilatedAttentionPaths, CpuReportsTheMathPath) {
  Qkv in = make_qkv({1, 16, 2, 16}, DType::kBFloat16, QkvLayout::kContiguous, 60);
  for (AttentionPath path :
       {AttentionPath::kAuto, AttentionPath::kMath, AttentionPath::kFlash, AttentionPath::kCudnn}) {
    DilatedAttentionOptions o = pairs({8, 16}, {1, 2});
    o.path = path;
    Got got = run_library(in.q, in.k, in.v, o);
    EXPECT_EQ(got.path, AttentionPath::kMath) << "forced " << nn::path_name(path);
    EXPECT_TRUE(matches_reference(in, o)) << nn::path_name(path);
  }
  EXPECT_STREQ(nn::path_name(AttentionPath::kMath), "math");
  EXPECT_STREQ(nn::path_name(AttentionPath::kFlash), "flash");
  EXPECT_STREQ(nn::path_name(AttentionPath::kCudnn), "cudnn");
  EXPECT_STREQ(nn::path_name(AttentionPath::kAuto), "auto");
}

// ---------------------------------------------------------------------------------------
// CUDA: each path against the CPU (skipped without a GPU).

class DilatedAttentionCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

struct Gradients {
  RefArray q, k, v;
};

// Forward and backward of L = sum(out * w_out) + sum(finite lse * w_lse) on q's device.
struct DeviceRun {
  Got result;
  Gradients grads;
};

DeviceRun run_with_backward(const Qkv& in, Device device, const DilatedAttentionOptions& o,
                            const AttentionCallContext& context = {}) {
  Tensor q = in.q.to(device).detach(), k = in.k.to(device).detach(), v = in.v.to(device).detach();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(q, k, v, o, context);
  Tensor finite_lse = where(gt(r.lse, -kInf), r.lse, 0.0);
  std::vector<Tensor> weights = upstream_gradients({r.out, finite_lse}, 77);
  autograd::backward({r.out, finite_lse}, {weights[0].to(device), weights[1].to(device)});
  DeviceRun run;
  run.result = {to_ref(r.out), to_ref(r.lse), r.path_used};
  run.grads = {to_ref(q.grad()), to_ref(k.grad()), to_ref(v.grad())};
  return run;
}

double max_abs(const RefArray& a) {
  double m = 0.0;
  for (double x : a.data) m = std::max(m, std::abs(x));
  return m;
}

// Gradients carry a softmax-Jacobian cancellation: errors scale with the largest gradient.
::testing::AssertionResult grads_close(const Gradients& expected, const Gradients& got, DType dtype,
                                       int64_t dim, int64_t keys) {
  const RefArray* e[3] = {&expected.q, &expected.k, &expected.v};
  const RefArray* g[3] = {&got.q, &got.k, &got.v};
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  for (int i = 0; i < 3; ++i) {
    double tol = 4.0 * out_tolerance(dtype, dim, keys).rtol;
    ::testing::AssertionResult ok = values_close(*e[i], *g[i], {tol, tol * max_abs(*e[i])});
    if (!ok) return ::testing::AssertionFailure() << names[i] << ": " << ok.message();
  }
  return ::testing::AssertionSuccess();
}

// The backward may run each call in pieces of whole segments (bounding kernel workspaces):
// one segment per piece gives the gradients of the default.
TEST(DilatedAttentionBackwardPieces, SegmentPiecesGiveTheSameGradients) {
  for (int index : {0, 3, 4, 7}) {  // constant, rotating, rotating causal, all heads rotating
    const Case& c = cases()[index];
    SCOPED_TRACE(c.name);
    Qkv in = make_qkv(c.shape, DType::kFloat64, QkvLayout::kContiguous, 57);
    const DilatedAttentionOptions o = c.options();
    AttentionCallContext one_segment_pieces;
    one_segment_pieces.backward_piece_elements = 1;
    DeviceRun whole = run_with_backward(in, Device::cpu(), o);
    DeviceRun pieces = run_with_backward(in, Device::cpu(), o, one_segment_pieces);
    EXPECT_TRUE(grads_close(whole.grads, pieces.grads, DType::kFloat64, c.shape[3],
                            max_keys(c.shape[1], o)));
  }
  AttentionCallContext bad;
  bad.backward_piece_elements = 0;
  Qkv in = make_qkv(cases()[0].shape, DType::kFloat32, QkvLayout::kContiguous, 58);
  EXPECT_THROW(nn::dilated_attention(in.q, in.k, in.v, cases()[0].options(), bad), Error);
}

TEST_F(DilatedAttentionCuda, EachPathMatchesTheCpuForwardAndBackward) {
  const Device gpu = Device::cuda(0);
  for (int index : {0, 2, 4, 6, 7, 12, 14, 15, 16}) {
    const Case& c = cases()[index];
    for (DType dtype : kAllFloatTypes) {
      Qkv in = make_qkv(c.shape, dtype, QkvLayout::kContiguous, 70);
      DilatedAttentionOptions o = c.options();
      DeviceRun cpu = run_with_backward(in, Device::cpu(), o);
      const int64_t keys = max_keys(c.shape[1], o), dim = c.shape[3];
      Tolerance out_tol = out_tolerance(dtype, dim, keys);
      out_tol = {2 * out_tol.rtol, 2 * out_tol.atol};  // two roundings: CPU and GPU
      for (AttentionPath path : {AttentionPath::kMath, AttentionPath::kFlash, AttentionPath::kCudnn}) {
        SCOPED_TRACE(c.name + " " + std::string(dtype_short_name(dtype)) + " " +
                     nn::path_name(path));
        o.path = path;
        DeviceRun cuda = run_with_backward(in, gpu, o);
        EXPECT_TRUE(values_close(cpu.result.out, cuda.result.out, out_tol));
        EXPECT_TRUE(values_close(cpu.result.lse, cuda.result.lse, lse_tolerance(dim, keys)));
        EXPECT_TRUE(grads_close(cpu.grads, cuda.grads, dtype, dim, keys));
      }
    }
  }
}

TEST_F(DilatedAttentionCuda, StridedInputsOnEachPath) {
  const Case& c = cases()[6];
  for (QkvLayout layout : {QkvLayout::kPackedQkv, QkvLayout::kHeadsMajor, QkvLayout::kMixed}) {
    for (AttentionPath path : {AttentionPath::kMath, AttentionPath::kFlash, AttentionPath::kCudnn}) {
      SCOPED_TRACE(layout_label(layout) + " " + nn::path_name(path));
      Qkv in = make_qkv(c.shape, DType::kBFloat16, layout, 71, Device::cuda(0));
      DilatedAttentionOptions o = c.options();
      o.path = path;
      EXPECT_TRUE(matches_reference(in, o));
    }
  }
}

TEST_F(DilatedAttentionCuda, PathUsedIsReported) {
  const Device gpu = Device::cuda(0);
  DilatedAttentionOptions o = pairs({8, 16}, {1, 2});
  auto path_for = [&](DType dtype, int64_t dim, AttentionPath path) {
    Qkv in = make_qkv({1, 16, 2, dim}, dtype, QkvLayout::kContiguous, 72, gpu);
    o.path = path;
    return run_library(in.q, in.k, in.v, o).path;
  };
  EXPECT_EQ(path_for(DType::kFloat32, 64, AttentionPath::kMath), AttentionPath::kMath);
  EXPECT_EQ(path_for(DType::kBFloat16, 64, AttentionPath::kMath), AttentionPath::kMath);
  EXPECT_EQ(path_for(DType::kFloat32, 64, AttentionPath::kFlash), AttentionPath::kFlash);
  EXPECT_EQ(path_for(DType::kBFloat16, 128, AttentionPath::kFlash), AttentionPath::kFlash);
  EXPECT_EQ(path_for(DType::kFloat16, 256, AttentionPath::kFlash), AttentionPath::kFlash);
  // Flash has no float64 kernels: it falls back to math.
  EXPECT_EQ(path_for(DType::kFloat64, 64, AttentionPath::kFlash), AttentionPath::kMath);
  // cuDNN serves bf16/fp16 (sm_80+, D % 8 == 0); otherwise it falls back to flash.
  EXPECT_EQ(path_for(DType::kFloat32, 64, AttentionPath::kCudnn), AttentionPath::kFlash);
  AttentionPath cudnn_bf16 = path_for(DType::kBFloat16, 64, AttentionPath::kCudnn);
  EXPECT_TRUE(cudnn_bf16 == AttentionPath::kCudnn || cudnn_bf16 == AttentionPath::kFlash)
      << nn::path_name(cudnn_bf16);
  AttentionPath automatic = path_for(DType::kBFloat16, 64, AttentionPath::kAuto);
  EXPECT_NE(automatic, AttentionPath::kAuto);
  EXPECT_NE(automatic, AttentionPath::kMath) << "kAuto chose math for bf16 D=64 on a GPU";
}

// use_hilbert on the GPU: every forced path ends on the math kernel (the only one that
// visits keys out of storage order), and forward and backward match the CPU.
TEST_F(DilatedAttentionCuda, HilbertOrderRunsOnTheMathPathAndMatchesTheCpu) {
  const Device gpu = Device::cuda(0);
  for (int index : {2, 7, 15}) {
    const Case& c = cases()[index];
    Qkv in = make_qkv(c.shape, DType::kBFloat16, QkvLayout::kContiguous, 74);
    DilatedAttentionOptions o = c.options();
    o.use_hilbert = true;
    DeviceRun cpu = run_with_backward(in, Device::cpu(), o);
    const int64_t keys = max_keys(c.shape[1], o), dim = c.shape[3];
    Tolerance out_tol = out_tolerance(DType::kBFloat16, dim, keys);
    for (AttentionPath path : {AttentionPath::kAuto, AttentionPath::kFlash, AttentionPath::kCudnn}) {
      SCOPED_TRACE(c.name + " " + nn::path_name(path));
      o.path = path;
      DeviceRun cuda = run_with_backward(in, gpu, o);
      EXPECT_EQ(cuda.result.path, AttentionPath::kMath);
      EXPECT_TRUE(values_close(cpu.result.out, cuda.result.out, {2 * out_tol.rtol, 2 * out_tol.atol}));
      EXPECT_TRUE(values_close(cpu.result.lse, cuda.result.lse, lse_tolerance(dim, keys)));
      EXPECT_TRUE(grads_close(cpu.grads, cuda.grads, DType::kBFloat16, dim, keys));
    }
  }
}

TEST_F(DilatedAttentionCuda, DropoutMaskIsTheSameOnEveryDevice) {
  const Case& c = cases()[5];
  Qkv in = make_qkv(c.shape, DType::kFloat32, QkvLayout::kContiguous, 73);
  DilatedAttentionOptions o = c.options();
  o.dropout = 0.3;
  Generator cpu_gen(9);
  Got cpu = run_library(in.q, in.k, in.v, o, {true, &cpu_gen});
  for (AttentionPath path : {AttentionPath::kMath, AttentionPath::kFlash}) {
    SCOPED_TRACE(nn::path_name(path));
    o.path = path;
    Generator gpu_gen(9);
    Got gpu = run_library(in.q.to(Device::cuda(0)), in.k.to(Device::cuda(0)),
                          in.v.to(Device::cuda(0)), o, {true, &gpu_gen});
    Tolerance tol = out_tolerance(DType::kFloat32, c.shape[3], max_keys(c.shape[1], o));
    EXPECT_TRUE(values_close(cpu.out, gpu.out, {2 * tol.rtol, 2 * tol.atol}));
    EXPECT_TRUE(cpu_gen.state() == gpu_gen.state());
  }
}

}  // namespace
}  // namespace rd::test
