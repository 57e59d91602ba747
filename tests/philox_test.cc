// Philox4x32-10 against the published Random123 known-answer vectors, and the CPU random
// fill's element -> counter -> value mapping and distributions.
#include "ringdilated/kernels/philox.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels {
namespace {

struct Kat {
  Philox4x32 counter;
  uint32_t key0, key1;
  Philox4x32 expected;
};

// Random123 1.09, kat_vectors: "philox4x32 10 <ctr x4> <key x2> <out x4>".
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& kat : kats) {
    Philox4x32 out = philox4x32_10(kat.counter, kat.key0, kat.key1);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(out.w[i], kat.expected.w[i]) << "word " << i << " of KAT with key " << std::hex
                                             << kat.key0;
    }
  }
}

TEST(PhiloxTest, ElementCounterSpansBothWordsAndSeedIsTheKey) {
  const uint64_t seed = 0x123456789abcdef0ull;
  const uint64_t offset = 0xfffffffeull;  // offset + 2 carries into the high counter word
  Philox4x32 got = philox_for_element(seed, offset, 2);
  Philox4x32 want = philox4x32_10({{0u, 1u, 0u, 0u}}, 0x9abcdef0u, 0x12345678u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got.w[i], want.w[i]);
}

// A float32 buffer viewed as a StridedView.
StridedView view_of(std::vector<float>& v, std::vector<int64_t> shape,
                    std::vector<int64_t> strides) {
  StridedView s;
  s.data = v.data();
  s.dtype = DType::kFloat32;
  s.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < s.ndim; ++d) {
    s.shape[d] = shape[d];
    s.strides[d] = strides[d];
  }
  return s;
}

TEST(PhiloxTest, UniformFollowsTheDocumentedMappingInLogicalOrder) {
  const uint64_t seed = 42, offset = 1000;
  const double a = -2.0, b = 3.0;
  // A transposed [3, 4] view: logical element (i, j) lives at j * 3 + i.
  std::vector<float> buf(12, 0.0f);
  cpu_backend().random(view_of(buf, {3, 4}, {1, 3}), Distribution::kUniform, a, b, seed, offset);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) {
      uint64_t n = offset + static_cast<uint64_t>(i * 4 + j);
      Philox4x32 r =
          philox4x32_10({{static_cast<uint32_t>(n), static_cast<uint32_t>(n >> 32), 0, 0}},
                        static_cast<uint32_t>(seed), 0);
      double u = static_cast<double>(r.w[0] >> 8) / 16777216.0;
      float want = static_cast<float>(a + (b - a) * u);
      EXPECT_EQ(buf[j * 3 + i], want) << "element (" << i << ", " << j << ")";
    }
  }
}

TEST(PhiloxTest, SplitFillsContinueTheStream) {
  std::vector<float> whole(100), parts(100);
  cpu_backend().random(view_of(whole, {100}, {1}), Distribution::kNormal, 0.5, 2.0, 7, 3);
  cpu_backend().random(view_of(parts, {40}, {1}), Distribution::kNormal, 0.5, 2.0, 7, 3);
  StridedView rest = view_of(parts, {60}, {1});
  rest.data = parts.data() + 40;
  cpu_backend().random(rest, Distribution::kNormal, 0.5, 2.0, 7, 43);
  EXPECT_EQ(whole, parts);
}

TEST(PhiloxTest, ResultsDoNotDependOnThreadCount) {
  const int64_t n = 300000;  // above the parallel threshold
  std::vector<float> one(n), two(n);
  int saved = cpu::num_threads();
  cpu::set_num_threads(1);
  cpu_backend().random(view_of(one, {n}, {1}), Distribution::kNormal, 0.0, 1.0, 99, 0);
  cpu::set_num_threads(2);
  cpu_backend().random(view_of(two, {n}, {1}), Distribution::kNormal, 0.0, 1.0, 99, 0);
  cpu::set_num_threads(saved);
  EXPECT_EQ(one, two);
}

// Sample mean and variance of a float buffer, in double.
std::pair<double, double> moments(const std::vector<float>& v) {
  double s = 0, s2 = 0;
  for (float x : v) s += x;
  double mean = s / v.size();
  for (float x : v) s2 += (x - mean) * (x - mean);
  return {mean, s2 / v.size()};
}

TEST(PhiloxTest, DistributionsHaveTheRequestedMoments) {
  const int64_t n = 1 << 20;
  std::vector<float> v(n);
  // 6-sigma bounds on the sample mean: sd / sqrt(n).
  const double k = 6.0 / std::sqrt(static_cast<double>(n));

  cpu_backend().random(view_of(v, {n}, {1}), Distribution::kUniform, 2.0, 5.0, 1, 0);
  auto [mean_u, var_u] = moments(v);
  double sd_u = 3.0 / std::sqrt(12.0);
  EXPECT_NEAR(mean_u, 3.5, k * sd_u);
  EXPECT_NEAR(var_u, sd_u * sd_u, 0.01 * sd_u * sd_u);
  for (float x : v) ASSERT_TRUE(x >= 2.0f && x < 5.0f) << x;

  cpu_backend().random(view_of(v, {n}, {1}), Distribution::kNormal, -1.0, 3.0, 2, 0);
  auto [mean_n, var_n] = moments(v);
  EXPECT_NEAR(mean_n, -1.0, k * 3.0);
  EXPECT_NEAR(var_n, 9.0, 0.02 * 9.0);
  for (float x : v) ASSERT_TRUE(std::isfinite(x));

  cpu_backend().random(view_of(v, {n}, {1}), Distribution::kBernoulli, 0.3, 0.0, 3, 0);
  int64_t ones = 0;
  for (float x : v) {
    ASSERT_TRUE(x == 0.0f || x == 1.0f) << x;
    ones += x == 1.0f;
  }
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.3, k * std::sqrt(0.3 * 0.7));
}

TEST(PhiloxTest, RejectsBadArguments) {
  std::vector<float> v(4);
  StridedView s = view_of(v, {4}, {1});
  EXPECT_THROW(cpu_backend().random(s, Distribution::kBernoulli, 1.5, 0, 0, 0), Error);
  EXPECT_THROW(cpu_backend().random(s, Distribution::kUniform, 2.0, 1.0, 0, 0), Error);
  std::vector<int32_t> ints(4);
  StridedView si = s;
  si.data = ints.data();
  si.dtype = DType::kInt32;
  try {
    cpu_backend().random(si, Distribution::kNormal, 0, 1, 0, 0);
    FAIL() << "normal fill of int32 should throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDTypeMismatch);
  }
  cpu_backend().random(si, Distribution::kBernoulli, 1.0, 0, 0, 0);  // p = 1: all ones
  for (int32_t x : ints) EXPECT_EQ(x, 1);
}

}  // namespace
}  // namespace rd::kernels
