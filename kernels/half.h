// 16-bit float storage types (bfloat16, float16) usable on host and device; math is float32.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define RD_HOST_DEVICE __host__ __device__
#else
#define RD_HOST_DEVICE
#endif

namespace rd {

namespace detail {
RD_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
RD_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
}  // namespace detail

// bfloat16: the top 16 bits of a float32, rounded to nearest even; NaN stays NaN.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  RD_HOST_DEVICE BFloat16(float f) : bits(round(f)) {}  // NOLINT: implicit like a float
  RD_HOST_DEVICE operator float() const { return detail::bits_float(uint32_t{bits} << 16); }
  RD_HOST_DEVICE static BFloat16 from_bits(uint16_t b) {
    BFloat16 r;
    r.bits = b;
    return r;
  }

 private:
  RD_HOST_DEVICE static uint16_t round(float f) {
    uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
  }
};

// IEEE binary16, round to nearest even, with subnormals, infinities and NaN.
struct Float16 {
  uint16_t bits = 0;
  Float16() = default;
  RD_HOST_DEVICE Float16(float f) : bits(from_float(f)) {}  // NOLINT: implicit like a float
  RD_HOST_DEVICE operator float() const { return to_float(bits); }
  RD_HOST_DEVICE static Float16 from_bits(uint16_t b) {
    Float16 r;
    r.bits = b;
    return r;
  }

 private:
  RD_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t u = detail::float_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
    if (abs < 0x38800000u) {
      // Subnormal or zero in half: scale by 2^24 in float arithmetic, which rounds correctly.
      float scaled = detail::bits_float(abs) * 16777216.0f;  // 2^24
      uint32_t q = static_cast<uint32_t>(scaled);
      float frac = scaled - static_cast<float>(q);
      if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
      return static_cast<uint16_t>(sign | q);
    }
    uint32_t mantissa_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mantissa_odd;  // rebias exponent (-112 << 23) and round
    return static_cast<uint16_t>(sign | (abs >> 13));
  }
  RD_HOST_DEVICE static float to_float(uint16_t h) {
    uint32_t sign = uint32_t{h & 0x8000u} << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0) {
      float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -v : v;
    }
    if (exponent == 31) return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
    return detail::bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
};

}  // namespace rd
