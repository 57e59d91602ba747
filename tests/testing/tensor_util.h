// Bridges between rd::Tensor and the float64 reference: conversions, seeded random inputs
// laid out in several memory layouts, and tolerances derived from the dtype.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <string_view>

#include "gtest/gtest.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/reference.h"

namespace rd::test {

using ref::RefArray;

// The values of t (any dtype, layout or device) in logical row-major order, as doubles.
RefArray to_ref(const Tensor& t);
// A new contiguous tensor of `dtype` on `device` holding `values`, rounded to the dtype.
Tensor from_ref(const RefArray& values, DType dtype, Device device = Device::cpu());

// Which random values an input gets. Float values stay at least 0.1 away from 0 (and so
// from the kinks of relu/abs) and are continuous, so ties are improbable.
enum class Domain {
  kAny,       // floats: +-[0.1, 2]; integers: nonzero in [-9, 9]; bool: random
  kPositive,  // floats: [0.1, 2]; integers: [1, 9]
  kSmallInt,  // values in {-2, -1, 1, 2} for every dtype, so that comparisons see ties
};

// Random values of `shape` for `dtype` (not yet rounded to it).
RefArray random_values(const Shape& shape, Domain domain, DType dtype, std::mt19937_64& rng);
// Integer values in [0, bound), as used for index tensors.
RefArray random_indices(const Shape& shape, int64_t bound, std::mt19937_64& rng);

// How an input tensor's memory is arranged. Each non-contiguous layout shows the same
// logical values through different strides.
enum class Layout {
  kContiguous,
  kTransposed,  // x.transpose(0, -1).contiguous().transpose(0, -1): dims >= 2
  kSliced,      // every other element of a bigger tensor (step 2, offset 1), last dim
  kExpanded,    // a size-1 dim broadcast by expand (stride 0): the first dim of size > 1
};
inline constexpr Layout kAllLayouts[] = {Layout::kContiguous, Layout::kTransposed, Layout::kSliced,
                                         Layout::kExpanded};
std::string_view layout_name(Layout layout);
// True when `layout` actually changes the strides of a tensor of `shape`.
bool layout_applies(Layout layout, const Shape& shape);

// An op input in some layout. `leaf` is what a gradient check differentiates: the input
// itself, except for kExpanded, where it is the un-expanded base and `view` expands it.
struct LaidOutInput {
  Tensor leaf;
  std::function<Tensor(const Tensor&)> view;
  RefArray values;  // the input's logical values, after rounding to its dtype
  Tensor input() const { return view(leaf); }
};

// Draws the values of an input of `shape` (from `draw`, called with the shape actually
// stored, which is smaller for kExpanded) and lays them out.
using DrawFn = std::function<RefArray(const Shape& shape, std::mt19937_64& rng)>;
LaidOutInput make_input(const Shape& shape, DType dtype, Layout layout, Device device,
                        const DrawFn& draw, std::mt19937_64& rng);

// Comparison tolerances: |got - expected| <= atol + rtol * |expected|.
struct Tolerance {
  double rtol = 0.0;
  double atol = 0.0;
};
// For results of `dtype` computed from inputs already rounded to it; accumulation_length is
// the number of terms summed into one output (reductions, matmul, norms), which adds
// rounding error of the accumulator (float64 for float64, else float32). Integers and bool
// are exact.
Tolerance tolerance_for(DType dtype, int64_t accumulation_length = 1);
// The looser of two tolerances.
Tolerance loosest(Tolerance a, Tolerance b);

// Elementwise comparison with shape check; NaN matches NaN and infinities must match
// exactly. Names the first mismatching positions and the largest error on failure.
::testing::AssertionResult values_close(const RefArray& expected, const RefArray& got,
                                        Tolerance tol);

std::string shape_string(const Shape& shape);
std::string_view dtype_short_name(DType dtype);  // "f32", "bf16", "i64", "bool", ...

}  // namespace rd::test
