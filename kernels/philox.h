// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11) and the mapping from its output words to values, shared by every backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ringdilated/kernels/dtype_dispatch.h"
#include "ringdilated/kernels/half.h"

namespace rd::kernels {

// Four 32-bit words: one Philox block, counter or output.
struct Philox4x32 {
  uint32_t w[4];
};

namespace philox_detail {
inline constexpr uint32_t kMul0 = 0xD2511F53u;
inline constexpr uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr uint32_t kBump0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kBump1 = 0xBB67AE85u;  // sqrt(3) - 1

RD_HOST_DEVICE inline void mul_hi_lo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}
}  // namespace philox_detail

// The Philox4x32 bijection with 10 rounds: counter and key in, four words out.
RD_HOST_DEVICE inline Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  using namespace philox_detail;
  uint32_t c0 = counter.w[0], c1 = counter.w[1], c2 = counter.w[2], c3 = counter.w[3];
#if defined(__CUDA_ARCH__)
#pragma unroll
#elif defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)  // nvcc warns on GCC pragmas
#pragma GCC unroll 10
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key is bumped between rounds, not before the first
      key0 += kBump0;
      key1 += kBump1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, c0, &hi0, &lo0);
    mul_hi_lo(kMul1, c2, &hi1, &lo1);
    uint32_t next0 = hi1 ^ c1 ^ key0, next2 = hi0 ^ c3 ^ key1;
    c0 = next0;
    c1 = lo1;
    c2 = next2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

// ---------------------------------------------------------------------------------------
// The random-fill mapping. Every backend must follow it bit for bit.
//
// Element i of the logical row-major order of the output uses the 64-bit counter value
// n = offset + i (wrapping mod 2^64) as counter words {lo32(n), hi32(n), 0, 0}, key
// {lo32(seed), hi32(seed)}, and reads the output words w[0..3]:
//
//   Uniform [a, b):
//     u = (w[0] >> (32 - bits)) * 2^-bits, bits = the dtype's significand precision
//         (24 float32, 11 float16, 8 bfloat16), so u is exact in the output dtype;
//     float64: u = (((uint64(w[1]) << 32) | w[0]) >> 11) * 2^-53.
//     value = a + (b - a) * u evaluated in double without FMA contraction, rounded to
//     float32 and then to the storage dtype (directly to double for float64). If rounding
//     lands on b or above (only possible when b - a is not a power-of-two multiple of
//     u's grid), the value is a instead, keeping the range half-open.
//   Normal (mean a, stddev b), Box-Muller in double:
//     u1 = ((w[0] >> 8) + 1) * 2^-24 in (0, 1] (never 0, so log is finite),
//     u2 = (w[1] >> 8) * 2^-24 in [0, 1);
//     float64 uses 53-bit uniforms: u1 = ((((w1 << 32) | w0) >> 11) + 1) * 2^-53 and
//     u2 = (((w3 << 32) | w2) >> 11) * 2^-53.
//     value = a + b * sqrt(-2 log u1) * cos(2 pi u2), rounded as for uniform. log/cos of
//     different math libraries may differ in the last double ulp, so normal samples agree
//     across devices after rounding to float32 except with probability ~2^-29 per element.
//   Bernoulli(p = a): value = 1 if (w[0] >> 8) * 2^-24 < p else 0, in any output dtype.
// ---------------------------------------------------------------------------------------

RD_HOST_DEVICE inline Philox4x32 philox_for_element(uint64_t seed, uint64_t offset,
                                                    uint64_t i) {
  uint64_t n = offset + i;
  Philox4x32 counter = {{static_cast<uint32_t>(n), static_cast<uint32_t>(n >> 32), 0u, 0u}};
  return philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in [0, 1) with `bits` (1..32) significant bits, exact in double.
RD_HOST_DEVICE inline double philox_unit(uint32_t word, int bits) {
  return static_cast<double>(word >> (32 - bits)) * (1.0 / static_cast<double>(1ull << bits));
}

// Uniform in [0, 1) with 53 bits from two words.
RD_HOST_DEVICE inline double philox_unit53(uint32_t lo, uint32_t hi) {
  uint64_t x = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

// Standard normal pair -> one sample, from u1 in (0, 1] and u2 in [0, 1).
RD_HOST_DEVICE inline double philox_box_muller(double u1, double u2) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  // Qualified: an includer's rd::sqrt(Tensor) etc. would hide the math functions here.
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(kTwoPi * u2);
}

// ---------------------------------------------------------------------------------------
// From an element's Philox block to its sample: the one mapping every backend uses.

// Significand precision of T: the uniform draw's bit count, so u is exact in T.
template <class T>
constexpr int philox_uniform_bits() {
  if constexpr (std::is_same_v<T, BFloat16>) return 8;
  if constexpr (std::is_same_v<T, Float16>) return 11;
  return 24;
}

// Rounds a double sample to the floating type T: to float32 first, then to the storage type.
template <class T>
RD_HOST_DEVICE T philox_round(double v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return T(static_cast<float>(v));
  }
}

template <class T>
RD_HOST_DEVICE double philox_as_double(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

// One uniform ([a, b)) or normal (mean a, stddev b) sample of floating type T from the
// element's Philox block r. Uniform uses word 0 (words 0-1 for double); normal uses words
// 0-1 (all four for double) through Box-Muller.
template <class T>
RD_HOST_DEVICE T philox_sample(bool normal, double a, double b, const Philox4x32& r) {
  constexpr bool kDouble = std::is_same_v<T, double>;
  if (!normal) {
    const double u =
        kDouble ? philox_unit53(r.w[0], r.w[1]) : philox_unit(r.w[0], philox_uniform_bits<T>());
    const T v = philox_round<T>(affine_no_fma(a, b - a, u));
    // Rounding may reach b; keep the range half-open.
    return (a < b && philox_as_double(v) >= b) ? philox_round<T>(a) : v;
  }
  double u1, u2;
  if constexpr (kDouble) {
    u1 = philox_unit53(r.w[0], r.w[1]) + 1.0 / 9007199254740992.0;  // (0, 1]
    u2 = philox_unit53(r.w[2], r.w[3]);
  } else {
    u1 = philox_unit(r.w[0], 24) + 1.0 / 16777216.0;  // (0, 1]
    u2 = philox_unit(r.w[1], 24);
  }
  return philox_round<T>(affine_no_fma(a, b, philox_box_muller(u1, u2)));
}

// A Bernoulli draw with probability p from word 0 of the block.
RD_HOST_DEVICE inline bool philox_bernoulli(double p, const Philox4x32& r) {
  return philox_unit(r.w[0], 24) < p;
}

}  // namespace rd::kernels
