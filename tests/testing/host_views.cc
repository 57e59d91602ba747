// Typed host memory for kernel tests: element access, buffers and strided views over them.
#include "testing/host_views.h"

#include <algorithm>
#include <cstring>

#include "gtest/gtest.h"
#include "ringdilated/kernels/half.h"

namespace rd::test {
namespace {

template <class T>
T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void save(void* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace

double load_element(const void* p, DType t) {
  switch (t) {
    case DType::kFloat32: return load<float>(p);
    case DType::kFloat64: return load<double>(p);
    case DType::kBFloat16: return static_cast<float>(load<BFloat16>(p));
    case DType::kFloat16: return static_cast<float>(load<Float16>(p));
    case DType::kInt32: return load<int32_t>(p);
    case DType::kInt64: return static_cast<double>(load<int64_t>(p));
    case DType::kBool: return load<unsigned char>(p);
  }
  ADD_FAILURE() << "unexpected dtype " << static_cast<int>(t);
  return 0;
}

void store_element(void* p, DType t, double v) {
  switch (t) {
    case DType::kFloat32: return save(p, static_cast<float>(v));
    case DType::kFloat64: return save(p, v);
    case DType::kBFloat16: return save(p, BFloat16(static_cast<float>(v)));
    case DType::kFloat16: return save(p, Float16(static_cast<float>(v)));
    case DType::kInt32: return save(p, static_cast<int32_t>(v));
    case DType::kInt64: return save(p, static_cast<int64_t>(v));
    case DType::kBool: return save(p, v != 0);
  }
  ADD_FAILURE() << "unexpected dtype " << static_cast<int>(t);
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return n;
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

kernels::StridedView make_view(void* base, DType dtype, const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides, int64_t offset) {
  const std::vector<int64_t> steps = strides.empty() ? contiguous_strides(shape) : strides;
  kernels::StridedView v;
  v.data = static_cast<unsigned char*>(base) + offset * static_cast<int64_t>(dtype_size(dtype));
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = shape[d];
    v.strides[d] = steps[d];
  }
  return v;
}

HostBuffer::HostBuffer(DType dtype, int64_t count)
    : dtype_(dtype), count_(count), bytes_(static_cast<size_t>(count) * dtype_size(dtype)) {}

void HostBuffer::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < count_; ++i) set(i, dist(rng));
}

void HostBuffer::fill_bytes(unsigned char byte) { std::fill(bytes_.begin(), bytes_.end(), byte); }

Operand Operand::clone() const {
  Operand o;
  o.buffer = buffer;
  o.view = view;
  if (view.data != nullptr) {
    o.view.data = o.buffer.data() + (static_cast<const unsigned char*>(view.data) - buffer.data());
  }
  return o;
}

Operand make_strided_operand(DType dtype, const std::vector<int64_t>& shape,
                             const std::vector<int64_t>& strides, int64_t offset, int64_t count) {
  Operand o;
  o.buffer = HostBuffer(dtype, count);
  o.view = make_view(o.buffer.data(), dtype, shape, strides, offset);
  if (count == 0) o.view.data = nullptr;
  return o;
}

namespace {

unsigned char* element_at(const kernels::StridedView& v, int64_t offset) {
  return static_cast<unsigned char*>(v.data) + offset * static_cast<int64_t>(dtype_size(v.dtype));
}

}  // namespace

std::vector<double> read_view(const kernels::StridedView& v) {
  std::vector<double> values(v.numel());
  for_each_element(v, [&](int64_t i, int64_t off) {
    values[i] = load_element(element_at(v, off), v.dtype);
  });
  return values;
}

void write_view(const kernels::StridedView& v, const std::vector<double>& values) {
  for_each_element(v, [&](int64_t i, int64_t off) {
    store_element(element_at(v, off), v.dtype, values[i]);
  });
}

void expect_untouched_outside(const std::string& what, const Operand& o,
                              const std::vector<unsigned char>& before) {
  const int64_t count = o.buffer.count();
  if (count == 0 || o.view.data == nullptr) return;
  std::vector<bool> inside(count, false);
  const unsigned char* base = o.buffer.data();
  const auto size = static_cast<int64_t>(dtype_size(o.view.dtype));
  const int64_t first = (static_cast<const unsigned char*>(o.view.data) - base) / size;
  for_each_element(o.view, [&](int64_t, int64_t off) { inside[first + off] = true; });
  int64_t changed = 0;
  for (int64_t e = 0; e < count; ++e) {
    if (!inside[e] && std::memcmp(base + e * size, before.data() + e * size, size) != 0) ++changed;
  }
  EXPECT_EQ(changed, 0) << what << ": elements outside the view were written";
}

}  // namespace rd::test
