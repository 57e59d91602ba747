// Conversions between Tensor and RefArray, seeded random inputs in several layouts, and
// dtype-derived tolerances for the op conformance tests.
#include "testing/tensor_util.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace rd::test {
namespace {

// Filler for the elements a strided view must skip: reading one by mistake shows up as a
// wrong value.
constexpr double kJunk = 99.0;

template <class T>
std::vector<T> cast_values(const std::vector<double>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
  return out;
}

template <class T>
std::vector<double> to_doubles(const std::vector<T>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// Index of the first dim of size > 1, or -1.
int64_t first_expandable_dim(const Shape& shape) {
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] > 1) return static_cast<int64_t>(d);
  }
  return -1;
}

// The storage tensor of a sliced layout: `values` sit at odd positions of a last dim of
// length 2n + 1; everything else is junk.
RefArray interleave_with_junk(const RefArray& values) {
  Shape big = values.shape;
  int64_t n = big.back();
  big.back() = 2 * n + 1;
  RefArray out = RefArray::filled(big, kJunk);
  for (int64_t i = 0; i < values.numel(); ++i) {
    ref::Index idx = ref::unravel(i, values.shape);
    idx.back() = 1 + 2 * idx.back();
    out.at(idx) = values.data[i];
  }
  return out;
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 0x1p-53;
    case DType::kFloat32:
      return 0x1p-24;
    case DType::kBFloat16:
      return 0x1p-8;
    case DType::kFloat16:
      return 0x1p-11;
    default:
      return 0.0;
  }
}

}  // namespace

RefArray to_ref(const Tensor& t) {
  Tensor c = t.device().is_cpu() ? t : t.to(Device::cpu());
  switch (c.dtype()) {
    case DType::kFloat64:
      return RefArray(c.shape(), c.to_vector<double>());
    case DType::kFloat32:
      return RefArray(c.shape(), to_doubles(c.to_vector<float>()));
    case DType::kInt64:
      return RefArray(c.shape(), to_doubles(c.to_vector<int64_t>()));
    case DType::kInt32:
      return RefArray(c.shape(), to_doubles(c.to_vector<int32_t>()));
    case DType::kBFloat16:
    case DType::kFloat16:
      return RefArray(c.shape(), to_doubles(c.to(DType::kFloat32).to_vector<float>()));
    case DType::kBool:
      return RefArray(c.shape(), to_doubles(c.to(DType::kInt64).to_vector<int64_t>()));
  }
  return {};
}

Tensor from_ref(const RefArray& values, DType dtype, Device device) {
  Tensor t;
  switch (dtype) {
    case DType::kFloat64:
      t = from_vector<double>(values.data, values.shape);
      break;
    case DType::kFloat32:
      t = from_vector<float>(cast_values<float>(values.data), values.shape);
      break;
    case DType::kInt64:
      t = from_vector<int64_t>(cast_values<int64_t>(values.data), values.shape);
      break;
    case DType::kInt32:
      t = from_vector<int32_t>(cast_values<int32_t>(values.data), values.shape);
      break;
    case DType::kBFloat16:
    case DType::kFloat16:
      t = from_vector<float>(cast_values<float>(values.data), values.shape).to(dtype);
      break;
    case DType::kBool:
      t = from_vector<int64_t>(cast_values<int64_t>(values.data), values.shape).to(dtype);
      break;
  }
  return device.is_cpu() ? t : t.to(device);
}

RefArray random_values(const Shape& shape, Domain domain, DType dtype, std::mt19937_64& rng) {
  RefArray out = RefArray::filled(shape, 0.0);
  std::uniform_real_distribution<double> magnitude(0.1, 2.0);
  std::uniform_int_distribution<int> small(1, 2);
  std::uniform_int_distribution<int> digit(1, 9);
  std::bernoulli_distribution coin(0.5);
  for (double& v : out.data) {
    double sign = coin(rng) ? 1.0 : -1.0;
    if (dtype == DType::kBool) {
      v = coin(rng) ? 1.0 : 0.0;
    } else if (domain == Domain::kSmallInt) {
      v = sign * small(rng);
    } else if (is_integral(dtype)) {
      v = (domain == Domain::kPositive ? 1.0 : sign) * digit(rng);
    } else {
      v = (domain == Domain::kPositive ? 1.0 : sign) * magnitude(rng);
    }
  }
  return out;
}

RefArray random_indices(const Shape& shape, int64_t bound, std::mt19937_64& rng) {
  RefArray out = RefArray::filled(shape, 0.0);
  std::uniform_int_distribution<int64_t> pick(0, bound - 1);
  for (double& v : out.data) v = static_cast<double>(pick(rng));
  return out;
}

std::string_view layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kTransposed:
      return "transposed";
    case Layout::kSliced:
      return "sliced";
    case Layout::kExpanded:
      return "expanded";
  }
  return "?";
}

bool layout_applies(Layout layout, const Shape& shape) {
  switch (layout) {
    case Layout::kContiguous:
      return true;
    case Layout::kTransposed:
      return shape.size() >= 2 && shape.front() > 1 && shape.back() > 1;
    case Layout::kSliced:
      return !shape.empty() && shape.back() > 0;
    case Layout::kExpanded:
      return first_expandable_dim(shape) >= 0;
  }
  return false;
}

LaidOutInput make_input(const Shape& shape, DType dtype, Layout layout, Device device,
                        const DrawFn& draw, std::mt19937_64& rng) {
  if (!layout_applies(layout, shape)) layout = Layout::kContiguous;
  LaidOutInput in;
  in.view = [](const Tensor& t) { return t; };
  switch (layout) {
    case Layout::kContiguous:
      in.leaf = from_ref(draw(shape, rng), dtype, device);
      break;
    case Layout::kTransposed: {
      int64_t last = static_cast<int64_t>(shape.size()) - 1;
      RefArray stored = ref::transpose(draw(shape, rng), 0, last);
      in.leaf = from_ref(stored, dtype, device).transpose(0, last);
      break;
    }
    case Layout::kSliced: {
      int64_t last = static_cast<int64_t>(shape.size()) - 1;
      RefArray stored = interleave_with_junk(draw(shape, rng));
      in.leaf = from_ref(stored, dtype, device).slice(last, 1, stored.shape.back(), 2);
      break;
    }
    case Layout::kExpanded: {
      Shape base = shape;
      base[first_expandable_dim(shape)] = 1;
      in.leaf = from_ref(draw(base, rng), dtype, device);
      in.view = [shape](const Tensor& t) { return t.expand(shape); };
      break;
    }
  }
  in.values = to_ref(in.input());
  return in;
}

Tolerance tolerance_for(DType dtype, int64_t accumulation_length) {
  if (!is_floating(dtype)) return {0.0, 0.0};
  double base = 0.0;
  switch (dtype) {
    case DType::kFloat64:
      base = 1e-12;
      break;
    case DType::kFloat32:
      base = 1e-5;
      break;
    case DType::kBFloat16:
      base = 1e-2;
      break;
    case DType::kFloat16:
      base = 2e-3;
      break;
    default:
      break;
  }
  // Accumulators are float64 for float64 data and float32 otherwise.
  double accumulator_u = unit_roundoff(dtype == DType::kFloat64 ? dtype : DType::kFloat32);
  double rtol =
      base + 4.0 * accumulator_u * static_cast<double>(std::max<int64_t>(accumulation_length, 1));
  return {rtol, rtol};
}

Tolerance loosest(Tolerance a, Tolerance b) {
  return {std::max(a.rtol, b.rtol), std::max(a.atol, b.atol)};
}

::testing::AssertionResult values_close(const RefArray& expected, const RefArray& got,
                                        Tolerance tol) {
  if (expected.shape != got.shape) {
    return ::testing::AssertionFailure() << "shape: expected " << shape_string(expected.shape)
                                         << ", got " << shape_string(got.shape);
  }
  std::ostringstream detail;
  detail.precision(10);
  int64_t bad = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    double e = expected.data[i], g = got.data[i];
    bool ok;
    if (std::isnan(e) || std::isnan(g)) {
      ok = std::isnan(e) && std::isnan(g);
    } else if (std::isinf(e) || std::isinf(g)) {
      ok = e == g;
    } else {
      double err = std::abs(g - e);
      worst = std::max(worst, err);
      ok = err <= tol.atol + tol.rtol * std::abs(e);
    }
    if (!ok && bad++ < 6) {
      detail << "\n  at " << shape_string(ref::unravel(i, expected.shape)) << ": expected " << e
             << ", got " << g;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << std::setprecision(3) << bad << " of " << expected.numel() << " values differ (shape "
         << shape_string(expected.shape) << ", rtol " << tol.rtol << ", atol " << tol.atol
         << ", max abs error " << worst << ")" << detail.str();
}

std::string shape_string(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::string_view dtype_short_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat64:
      return "f64";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

}  // namespace rd::test
