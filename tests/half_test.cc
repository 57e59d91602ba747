// float16 / bfloat16 conversions (kernels/half.h) against plainly written references:
// exhaustive over all 65536 16-bit patterns, and float -> 16-bit over structured and random
// floats, with round-to-nearest-even decided by exact double arithmetic.
#include "ringdilated/kernels/half.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace rd {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// binary16 pattern -> value; exponent 31 is read as if finite (2^16 * ...), which the
// float -> half reference uses as the rounding neighbour of 65504.
double half_value_as_finite(uint16_t h) {
  int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
  double magnitude = exponent == 0 ? std::ldexp(mantissa, -24)
                                   : std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}
bool half_is_nan(uint16_t h) { return ((h >> 10) & 31) == 31 && (h & 1023) != 0; }
bool half_is_inf(uint16_t h) { return (h & 0x7fff) == 0x7c00; }

// bfloat16 pattern -> value, exponent 255 read as if finite.
double bf16_value_as_finite(uint16_t h) {
  int sign = h >> 15, exponent = (h >> 7) & 255, mantissa = h & 127;
  double magnitude = exponent == 0 ? std::ldexp(mantissa, -133)
                                   : std::ldexp(128 + mantissa, exponent - 134);
  return sign ? -magnitude : magnitude;
}

// Nearest of two neighbours lo < hi (patterns of the same sign, hi = lo + 1 in magnitude),
// ties to the even pattern.
template <class ValueOf>
uint16_t round_between(double x, uint16_t lo, uint16_t hi, ValueOf value_of) {
  double dlo = std::fabs(x - value_of(lo)), dhi = std::fabs(value_of(hi) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

// Reference float -> binary16: binary search of the magnitude among all finite patterns.
uint16_t reference_to_half(float f) {
  if (std::isnan(f)) return 0x7e00;
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double x = std::fabs(static_cast<double>(f));
  // Largest pattern p in [0, 0x7c00] with value(p) <= x.
  uint16_t lo = 0, hi = 0x7c00;
  if (x >= half_value_as_finite(0x7c00)) return sign | 0x7c00;
  while (hi - lo > 1) {
    uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    if (half_value_as_finite(mid) <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  uint16_t below = lo, above = static_cast<uint16_t>(lo + 1);
  return sign | round_between(x, below, above, half_value_as_finite);
}

// Reference float -> bfloat16: truncate the float's pattern, then pick the nearer neighbour.
uint16_t reference_to_bf16(float f) {
  uint32_t u = to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  uint16_t truncated = static_cast<uint16_t>((u >> 16) & 0x7fff);
  double x = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return sign | 0x7f80;
  return sign | round_between(x, truncated, static_cast<uint16_t>(truncated + 1),
                              bf16_value_as_finite);
}

void expect_half_of(float f) {
  uint16_t want = reference_to_half(f);
  uint16_t got = Float16(f).bits;
  if (half_is_nan(want)) {
    EXPECT_TRUE(half_is_nan(got)) << "f=" << f;
  } else {
    EXPECT_EQ(got, want) << "f=" << f << " (bits 0x" << std::hex << to_bits(f) << ")";
  }
}

void expect_bf16_of(float f) {
  uint16_t got = BFloat16(f).bits;
  if (std::isnan(f)) {
    EXPECT_TRUE(((got >> 7) & 255) == 255 && (got & 127) != 0) << "NaN became " << got;
  } else {
    EXPECT_EQ(got, reference_to_bf16(f))
        << "f=" << f << " (bits 0x" << std::hex << to_bits(f) << ")";
  }
}

TEST(Float16Test, EveryPatternDecodesAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t h = static_cast<uint16_t>(b);
    float f = Float16::from_bits(h);
    if (half_is_nan(h)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << b;
      EXPECT_TRUE(half_is_nan(Float16(f).bits)) << std::hex << b;
      continue;
    }
    if (half_is_inf(h)) {
      EXPECT_TRUE(std::isinf(f) && std::signbit(f) == ((h >> 15) != 0)) << std::hex << b;
    } else {
      EXPECT_EQ(static_cast<double>(f), half_value_as_finite(h)) << std::hex << b;
      EXPECT_EQ(std::signbit(f), (h >> 15) != 0) << std::hex << b;  // -0 stays -0
    }
    ASSERT_EQ(Float16(f).bits, h) << std::hex << b;
  }
}

TEST(Float16Test, RoundsTiesNeighboursAndBoundariesToNearestEven) {
  // Every exact midpoint between neighbouring halves, and one float ulp either side.
  for (uint32_t b = 0; b < 0x7c00; ++b) {
    double mid = (half_value_as_finite(static_cast<uint16_t>(b)) +
                  half_value_as_finite(static_cast<uint16_t>(b + 1))) / 2;
    float m = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(m), mid);  // midpoints are exact in float
    for (float f : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e30f)}) {
      expect_half_of(f);
      expect_half_of(-f);
    }
  }
  // The overflow boundary and special values.
  EXPECT_EQ(Float16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(Float16(65519.99f).bits, 0x7bff);
  EXPECT_EQ(Float16(65520.0f).bits, 0x7c00);
  EXPECT_EQ(Float16(-65520.0f).bits, 0xfc00);
  EXPECT_EQ(Float16(1e10f).bits, 0x7c00);
  EXPECT_EQ(Float16(INFINITY).bits, 0x7c00);
  EXPECT_EQ(Float16(std::ldexp(1.0f, -25)).bits, 0x0000);       // tie with 0 -> 0 (even)
  EXPECT_EQ(Float16(std::ldexp(3.0f, -26)).bits, 0x0001);       // above the tie
  EXPECT_EQ(Float16(std::ldexp(1.0f, -24)).bits, 0x0001);       // smallest subnormal
  EXPECT_EQ(Float16(std::ldexp(1023.5f, -24)).bits, 0x0400);    // rounds up to min normal
  EXPECT_EQ(Float16(-0.0f).bits, 0x8000);
  EXPECT_TRUE(half_is_nan(Float16(NAN).bits));
}

TEST(Float16Test, MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 17);  // subnormal range to beyond overflow
  for (int i = 0; i < 300000; ++i) {
    expect_half_of(from_bits(any_bits(rng)));
    expect_half_of(std::ldexp(mantissa(rng), exponent(rng)));
    expect_half_of(-std::ldexp(mantissa(rng), exponent(rng)));
  }
}

TEST(BFloat16Test, EveryPatternDecodesAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t h = static_cast<uint16_t>(b);
    float f = BFloat16::from_bits(h);
    EXPECT_EQ(to_bits(f), b << 16) << std::hex << b;  // exact widening, NaN payload kept
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(f)))) << std::hex << b;
    } else {
      ASSERT_EQ(BFloat16(f).bits, h) << std::hex << b;
    }
  }
}

TEST(BFloat16Test, MatchesReferenceOnStructuredAndRandomFloats) {
  // Midpoints between neighbours (ties) and their float neighbours, over all exponents.
  for (uint32_t b = 0; b < 0x7f80; b += 7) {
    uint32_t mid_bits = (b << 16) | 0x8000u;  // exactly halfway to the next pattern
    float mid = from_bits(mid_bits);
    for (float f : {mid, from_bits(mid_bits - 1), from_bits(mid_bits + 1)}) {
      expect_bf16_of(f);
      expect_bf16_of(-f);
    }
  }
  expect_bf16_of(3.3895313892515355e38f);  // largest float: rounds to inf
  expect_bf16_of(std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(BFloat16(INFINITY).bits, 0x7f80);
  EXPECT_EQ(BFloat16(-0.0f).bits, 0x8000);
  std::mt19937 rng(99);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 1000000; ++i) expect_bf16_of(from_bits(any_bits(rng)));
}

}  // namespace
}  // namespace rd
