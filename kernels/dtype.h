// Element types shared by every layer: the DType enum, sizes, names and promotion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace rd {

enum class DType : uint8_t { kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kBool };

inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                       DType::kFloat16, DType::kInt32,   DType::kInt64,
                                       DType::kBool};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kBool: return 1;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16 ||
         t == DType::kFloat16;
}
constexpr bool is_integral(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
  }
  return "?";
}

// The type kernels accumulate and keep statistics in: float64 for float64 data, else
// float32 (16-bit floats are stored 16-bit but computed in float32).
constexpr DType accumulation_dtype(DType t) {
  return t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// The dtypes KernelBackend::accumulate adds: out += in where in has out's dtype, or is a
// 16-bit float read widened into a float32 out.
constexpr bool accumulate_takes(DType out, DType in) {
  return in == out || (out == DType::kFloat32 && (in == DType::kBFloat16 || in == DType::kFloat16));
}

// Result type of a binary op on two tensors (PyTorch's rules, minus scalars):
// bool < int32 < int64 < 16-bit floats < float32 < float64; bf16 with f16 gives float32.
constexpr DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    switch (t) {
      case DType::kBool: return 0;
      case DType::kInt32: return 1;
      case DType::kInt64: return 2;
      case DType::kBFloat16:
      case DType::kFloat16: return 3;
      case DType::kFloat32: return 4;
      case DType::kFloat64: return 5;
    }
    return 0;
  };
  if (rank(a) == 3 && rank(b) == 3) return DType::kFloat32;
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace rd
