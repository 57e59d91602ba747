// The fused, in-place merge of attention partials (rd::attention_merge_ and
// KernelBackend::attention_merge) against a float64 reference written from its definition:
// random values, extreme LSE gaps, rows masked on one side or on both, on the CPU and (where
// present) the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

namespace rd {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kB = 2, kN = 37, kH = 3;
// Head dims: 5 takes the CUDA merge's per-element loop, 8 its loop over 16-byte vectors.
constexpr int64_t kOddHeadDim = 5, kVectorHeadDim = 8;

// What a row's LSE is drawn as: an ordinary value, a huge or tiny one (exp under/overflows
// in float32 if computed naively), or -inf (no key seen).
double draw_lse(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> kind(0, 5);
  std::uniform_real_distribution<double> value(-3, 3);
  switch (kind(rng)) {
    case 0: return -kInf;
    case 1: return 80 + value(rng);    // exp overflows float32 without the max shift
    case 2: return -100 + value(rng);  // exp underflows
    default: return value(rng);
  }
}

struct MergeCase {
  int64_t head_dim = kOddHeadDim;    // D
  test::RefArray acc_out, part_out;  // [B, N, H, D]
  test::RefArray acc_lse, part_lse;  // [B, H, N]
};

// Rows with acc_lse = -inf hold 0 in acc_out, as the kernels leave them; rows with part_lse
// = -inf hold NaN in part_out (not initialized, never read). A few rows are forced to -inf on
// both sides.
MergeCase random_case(uint64_t seed, int64_t head_dim) {
  std::mt19937_64 rng(seed);
  MergeCase c;
  c.head_dim = head_dim;
  const int64_t kD = head_dim;
  c.acc_out = test::random_values({kB, kN, kH, kD}, test::Domain::kAny, DType::kFloat64, rng);
  c.part_out = test::random_values({kB, kN, kH, kD}, test::Domain::kAny, DType::kFloat64, rng);
  c.acc_lse = test::RefArray::filled({kB, kH, kN}, 0);
  c.part_lse = test::RefArray::filled({kB, kH, kN}, 0);
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t n = 0; n < kN; ++n) {
        const int64_t row = (b * kH + h) * kN + n;
        const bool both_masked = n % 11 == 3;
        c.acc_lse.data[row] = both_masked ? -kInf : draw_lse(rng);
        c.part_lse.data[row] = both_masked ? -kInf : draw_lse(rng);
        if (c.acc_lse.data[row] == -kInf) {
          for (int64_t d = 0; d < kD; ++d) c.acc_out.data[((b * kN + n) * kH + h) * kD + d] = 0;
        }
        // A partial's rows without keys are never read: callers leave them uninitialized.
        if (c.part_lse.data[row] == -kInf) {
          for (int64_t d = 0; d < kD; ++d) {
            c.part_out.data[((b * kN + n) * kH + h) * kD + d] =
                std::numeric_limits<double>::quiet_NaN();
          }
        }
      }
    }
  }
  return c;
}

// The definition, in float64: m = log(e^a + e^p); out = e^(a-m) acc + e^(p-m) part, where a
// side with no key (lse -inf) adds nothing and is not read.
MergeCase reference(const MergeCase& in) {
  MergeCase out = in;
  const int64_t kD = in.head_dim;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t n = 0; n < kN; ++n) {
        const int64_t row = (b * kH + h) * kN + n;
        const double a = in.acc_lse.data[row], p = in.part_lse.data[row];
        const double hi = std::max(a, p);
        const double m = hi == -kInf ? -kInf : hi + std::log(std::exp(a - hi) + std::exp(p - hi));
        out.acc_lse.data[row] = m;
        for (int64_t d = 0; d < kD; ++d) {
          const int64_t i = ((b * kN + n) * kH + h) * kD + d;
          const double wa = m == -kInf ? 0 : std::exp(a - m), wp = m == -kInf ? 0 : std::exp(p - m);
          const double from_part = p == -kInf ? 0 : wp * in.part_out.data[i];
          out.acc_out.data[i] =
              m == -kInf ? in.acc_out.data[i] : wa * in.acc_out.data[i] + from_part;
        }
      }
    }
  }
  return out;
}

// dtype: the accumulator's; part_dtype: the partial output's (dtype, or a 16-bit float with
// float32). The reference merges the partial's stored (rounded) values.
void expect_merge_matches(DType dtype, Device device, uint64_t seed,
                          std::optional<DType> part_dtype = {}, int64_t head_dim = kOddHeadDim) {
  MergeCase in = random_case(seed, head_dim);
  const int64_t kD = head_dim;
  const Tensor part_out = test::from_ref(in.part_out, part_dtype.value_or(dtype), device);
  in.part_out = test::to_ref(part_out);
  const MergeCase want = reference(in);
  Tensor acc_out = test::from_ref(in.acc_out, dtype, device);
  Tensor acc_lse = test::from_ref(in.acc_lse, dtype, device);
  const Tensor part_lse = test::from_ref(in.part_lse, dtype, device);
  attention_merge_(acc_out, acc_lse, part_out, part_lse);
  const test::RefArray got_out = test::to_ref(acc_out), got_lse = test::to_ref(acc_lse);
  // Each LSE is stored with an absolute error of |lse| units of roundoff, which the weights
  // exp(lse - m) turn into a relative error of that size: the bound scales with the row's
  // LSE magnitudes (up to ~100 here), plus a few roundings of the arithmetic.
  const double u = test::unit_roundoff(dtype);
  auto row_tol = [&](int64_t row) {
    double magnitude = 1;
    for (double l : {in.acc_lse.data[row], in.part_lse.data[row]}) {
      if (std::isfinite(l)) magnitude += std::abs(l);
    }
    return 8 * u * magnitude;
  };
  for (int64_t i = 0; i < got_lse.numel(); ++i) {
    const double w = want.acc_lse.data[i], g = got_lse.data[i];
    ASSERT_FALSE(std::isnan(g)) << "lse row " << i;
    if (w == -kInf) {
      ASSERT_EQ(g, -kInf) << "lse row " << i;
    } else {
      ASSERT_NEAR(g, w, row_tol(i)) << "lse row " << i;
    }
  }
  for (int64_t i = 0; i < got_out.numel(); ++i) {
    const int64_t b = i / (kN * kH * kD), n = i / (kH * kD) % kN, h = i / kD % kH;
    ASSERT_FALSE(std::isnan(got_out.data[i])) << "out element " << i;
    ASSERT_NEAR(got_out.data[i], want.acc_out.data[i],
                row_tol((b * kH + h) * kN + n) * std::max(1.0, std::abs(want.acc_out.data[i])))
        << "out element " << i;
  }
}

TEST(AttentionMerge, MatchesFloat64ReferenceOnCpu) {
  expect_merge_matches(DType::kFloat32, Device::cpu(), 1);
  expect_merge_matches(DType::kFloat64, Device::cpu(), 2);
  expect_merge_matches(DType::kFloat32, Device::cpu(), 3, DType::kBFloat16);
  expect_merge_matches(DType::kFloat32, Device::cpu(), 4, DType::kFloat16);
  expect_merge_matches(DType::kFloat32, Device::cpu(), 8, DType::kBFloat16, kVectorHeadDim);
}

TEST(AttentionMerge, MaskedRowsGiveZeroAndMinusInfinityNeverNan) {
  const TensorOptions f32(DType::kFloat32);
  Tensor acc_out = zeros({1, 2, 1, 4}, f32), acc_lse = full({1, 1, 2}, -kInf, f32);
  Generator gen(3);
  const Tensor part_out = randn({1, 2, 1, 4}, gen, f32);
  // Row 0: masked on both sides. Row 1: only the partial saw keys.
  const Tensor part_lse = from_vector<float>({-INFINITY, 1.5f}, {1, 1, 2});
  attention_merge_(acc_out, acc_lse, part_out, part_lse);
  const test::RefArray out = test::to_ref(acc_out), lse = test::to_ref(acc_lse);
  const test::RefArray part = test::to_ref(part_out);
  EXPECT_EQ(lse.data[0], -kInf);
  EXPECT_EQ(lse.data[1], 1.5);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(out.data[d], 0.0);
    EXPECT_EQ(out.data[4 + d], part.data[4 + d]);  // weight exactly 1
  }
}

TEST(AttentionMerge, BadArgumentsNameTheOpAndShapes) {
  const TensorOptions f32(DType::kFloat32);
  const Tensor out = zeros({1, 4, 2, 3}, f32), lse = zeros({1, 2, 4}, f32);
  EXPECT_TRUE(test::raises([&] { attention_merge_(out, lse, zeros({1, 4, 2, 2}, f32), lse); },
                          {ErrorCode::kShapeMismatch},
                          {"attention_merge", "part_out", "[1, 4, 2, 2]"}));
  EXPECT_TRUE(test::raises(
      [&] {
        attention_merge_(out.to(DType::kFloat64), lse.to(DType::kFloat64),
                         out.to(DType::kBFloat16), lse.to(DType::kFloat64));
      },
      {ErrorCode::kDTypeMismatch}, {"attention_merge", "part_out", "bfloat16", "float64"}));
  EXPECT_TRUE(test::raises([&] { attention_merge_(out, zeros({1, 4}, f32), out, lse); },
                          {ErrorCode::kShapeMismatch}, {"attention_merge_", "acc_lse", "[B, H, N]"}));
}

TEST(AttentionMergeCuda, MatchesFloat64ReferenceAndTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  expect_merge_matches(DType::kFloat32, Device::cuda(), 4);
  expect_merge_matches(DType::kFloat64, Device::cuda(), 5);
  expect_merge_matches(DType::kFloat32, Device::cuda(), 6, DType::kBFloat16);
  expect_merge_matches(DType::kFloat32, Device::cuda(), 7, DType::kFloat16);
  expect_merge_matches(DType::kFloat32, Device::cuda(), 8, DType::kBFloat16, kVectorHeadDim);
  expect_merge_matches(DType::kFloat64, Device::cuda(), 9, std::nullopt, kVectorHeadDim);
  expect_merge_matches(DType::kFloat32, Device::cuda(), 10, std::nullopt, kVectorHeadDim);
}

}  // namespace
}  // namespace rd
