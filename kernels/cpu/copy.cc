// CPU data movement: fill, arange, copy (with dtype conversion) and accumulate, all through
// the shared strided loop.
#include <cstring>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {

void CpuBackend::fill(const StridedView& out, double value) {
  bool serial = !has_distinct_elements(out);
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T v = convert<T>(value);
    for_each_typed<T>(out, {}, [v](T& o) { o = v; }, serial);
  });
}

void CpuBackend::arange(const StridedView& out, double start, double step) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    StridedIter<1> it = make_iter<1>({&out});
    for_each_run(it, [&](const auto& p, int64_t n, const auto& s, int64_t linear) {
      for (int64_t k = 0; k < n; ++k) {
        double v = start + static_cast<double>(linear + k) * step;
        *reinterpret_cast<T*>(p[0] + k * s[0]) = convert<T>(v);
      }
    });
  });
}

void CpuBackend::copy(const StridedView& out, const StridedView& in) {
  check_same_shape("copy", "out", out, "in", in);
  if (out.dtype == in.dtype && out.is_contiguous() && in.is_contiguous()) {
    const size_t elem = dtype_size(out.dtype);
    char* dst = static_cast<char*>(out.data);
    const char* src = static_cast<const char*>(in.data);
    parallel_range(out.numel(), [&](int64_t begin, int64_t end) {
      std::memcpy(dst + begin * elem, src + begin * elem, (end - begin) * elem);
    });
    return;
  }
  dispatch_dtype(out.dtype, [&](auto out_tag) {
    using To = typename decltype(out_tag)::type;
    dispatch_dtype(in.dtype, [&](auto in_tag) {
      using From = typename decltype(in_tag)::type;
      for_each_typed<To, From>(out, {&in}, [](To& o, const From& x) { o = convert<To>(x); });
    });
  });
}

void CpuBackend::accumulate(const StridedView& out, const StridedView& in) {
  check_same_shape("accumulate", "out", out, "in", in);
  check_accumulate_dtypes("accumulate", out, in);
  // Overlapping out elements receive several adds: apply them one at a time, in order.
  bool serial = !has_distinct_elements(out);
  if (out.dtype != in.dtype) {  // a 16-bit float into float32, read widened
    auto widen = [&](auto narrow_tag) {
      using Narrow = decltype(narrow_tag);
      for_each_typed<float, Narrow>(
          out, {&in}, [](float& o, const Narrow& x) { o += convert<float>(x); }, serial);
    };
    in.dtype == DType::kBFloat16 ? widen(BFloat16{}) : widen(Float16{});
    return;
  }
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_each_typed<T, T>(out, {&in}, [](T& o, const T& x) { add_into(o, x); }, serial);
  });
}

}  // namespace rd::kernels::cpu
