// Typed host memory for kernel tests: elements of any dtype read and written as doubles,
// buffers with strided views into them, and a view's elements in logical row-major order.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/strided.h"

namespace rd::test {

// The element of dtype t at p as a double. A bool reads as its raw byte, so that a byte a
// kernel should have written (0 or 1) and did not shows as a wrong value.
double load_element(const void* p, DType t);
// Stores v at p as dtype t (rounded for floats, truncated for integers, v != 0 for bool).
void store_element(void* p, DType t, double v);

int64_t product(const std::vector<int64_t>& shape);
std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b);
// Row-major element strides of a contiguous tensor of `shape`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

// A view of `shape` whose element [0, ..., 0] is element `offset` of `base`, with element
// `strides` (row-major contiguous when empty).
kernels::StridedView make_view(void* base, DType dtype, const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides = {}, int64_t offset = 0);

// Host memory of `count` elements of one dtype, element access as double.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(DType dtype, int64_t count);

  DType dtype() const { return dtype_; }
  int64_t count() const { return count_; }
  size_t size_bytes() const { return bytes_.size(); }
  unsigned char* data() { return bytes_.data(); }
  const unsigned char* data() const { return bytes_.data(); }
  unsigned char* element(int64_t i) { return data() + i * dtype_size(dtype_); }
  const unsigned char* element(int64_t i) const { return data() + i * dtype_size(dtype_); }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

  double get(int64_t i) const { return load_element(element(i), dtype_); }
  void set(int64_t i, double v) { store_element(element(i), dtype_, v); }
  // Every element uniform in [lo, hi), rounded to the dtype, drawn in element order.
  void fill_uniform(std::mt19937_64& rng, double lo = -1, double hi = 1);
  void fill_bytes(unsigned char byte);
  // 0xff in every byte: NaN in every float dtype, so an element left unwritten fails.
  void poison() { fill_bytes(0xff); }

 private:
  DType dtype_ = DType::kFloat32;
  int64_t count_ = 0;
  std::vector<unsigned char> bytes_;
};

// A view with the host memory behind it. Movable (the view points into the buffer's heap
// block, which a move keeps); clone() makes a copy with the view rebased onto it.
struct Operand {
  HostBuffer buffer;
  kernels::StridedView view;

  Operand() = default;
  Operand(Operand&&) = default;
  Operand& operator=(Operand&&) = default;
  Operand(const Operand&) = delete;
  Operand& operator=(const Operand&) = delete;

  Operand clone() const;
};

// A buffer of `count` elements and a view of `shape` into it at element `offset`.
Operand make_strided_operand(DType dtype, const std::vector<int64_t>& shape,
                             const std::vector<int64_t>& strides, int64_t offset, int64_t count);

// Calls f(logical index, element offset from v.data) for every element of v in row-major
// order.
template <class F>
void for_each_element(const kernels::StridedView& v, const F& f) {
  const int64_t n = v.numel();
  std::vector<int64_t> index(v.ndim, 0);
  int64_t offset = 0;
  for (int64_t linear = 0; linear < n; ++linear) {
    f(linear, offset);
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++index[d] < v.shape[d]) {
        offset += v.strides[d];
        break;
      }
      offset -= (v.shape[d] - 1) * v.strides[d];
      index[d] = 0;
    }
  }
}

// The values of v in logical row-major order.
std::vector<double> read_view(const kernels::StridedView& v);
// Stores values (logical row-major order) through v, rounded to its dtype.
void write_view(const kernels::StridedView& v, const std::vector<double>& values);

// Fails when any element of the operand's buffer outside its view differs from `before`
// (the buffer's bytes before the run).
void expect_untouched_outside(const std::string& what, const Operand& o,
                              const std::vector<unsigned char>& before);

}  // namespace rd::test
