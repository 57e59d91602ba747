// CPU indexing kernels: index_select and gather (reads through an index) share one kernel;
// index_add and scatter (writes through an index) share another. Index values are checked
// up front, so an out-of-range index raises kOutOfRange instead of touching stray memory.
#include <algorithm>
#include <array>
#include <span>
#include <string>
#include <type_traits>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cpu {
namespace {

int64_t byte_stride(const StridedView& v, int dim) {
  return v.strides[dim] * static_cast<int64_t>(dtype_size(v.dtype));
}

// `v` seen with shape `shape` (same ndim) and its stride along `dim` zeroed: the base of
// every line along dim, to be offset by index * byte_stride(v, dim).
StridedView line_base(const StridedView& v, const StridedView& shape, int dim) {
  StridedView r = v;
  r.shape = shape.shape;
  r.strides[dim] = 0;
  return r;
}

// Throws kOutOfRange naming the first index value outside [0, limit).
void check_index_values(const char* op, const StridedView& index, int64_t limit) {
  dispatch_index(index.dtype, op, [&](auto tag) {
    using I = typename decltype(tag)::type;
    const StridedIter<1> it = make_iter<1>({&index});
    bool ok = true;
    int64_t bad = 0;
    iterate_range(it, 0, it.numel, [&](const auto& p, int64_t n, const auto& s, int64_t) {
      for (int64_t k = 0; k < n && ok; ++k) {
        int64_t v = *reinterpret_cast<const I*>(p[0] + k * s[0]);
        if (v < 0 || v >= limit) {
          ok = false;
          bad = v;
        }
      }
    });
    RD_CHECK(ok, kOutOfRange, op, ": index ", bad, " is out of range for a dim of size ",
             limit);
  });
}

// out[e] = in_base[e] + index[e] * dim_stride (bytes), for every element e of out.
void gather_kernel(const StridedView& out, const StridedView& in_base,
                   const StridedView& index, int64_t dim_stride) {
  dispatch_by_size(out.dtype, [&](auto value_tag) {
    using U = typename decltype(value_tag)::type;
    dispatch_index(index.dtype, "gather", [&](auto index_tag) {
      using I = typename decltype(index_tag)::type;
      const StridedIter<3> it = make_iter<3>({&out, &in_base, &index});
      for_each_run(it, [&](const auto& p, int64_t n, const auto& s, int64_t) {
        for (int64_t k = 0; k < n; ++k) {
          int64_t i = *reinterpret_cast<const I*>(p[2] + k * s[2]);
          *reinterpret_cast<U*>(p[0] + k * s[0]) =
              *reinterpret_cast<const U*>(p[1] + k * s[1] + i * dim_stride);
        }
      });
    });
  });
}

// Lines (positions outside `dim`) handled per task by the blocked schedule below: enough
// that each step is a long contiguous run.
constexpr int64_t kScatterBlockLines = 256;

// out_base[e] + index[e] * dim_stride (bytes) receives src[e] (+= when accumulating), for
// every element e of the index space (src's shape). Only elements on the same line (equal
// coordinates outside `dim`) can collide, so tasks own disjoint sets of lines and apply each
// line's updates in increasing position along dim: deterministic, race-free, and the same
// result for either schedule.
void scatter_kernel(const char* op, const StridedView& out_base, int dim,
                    const StridedView& index, const StridedView& src, int64_t dim_stride,
                    bool accumulate, bool serial) {
  const int64_t length = src.shape[dim];
  const int64_t numel = src.numel();
  if (numel == 0) return;
  const int64_t lines = numel / length;
  std::array<int, kMaxDims> order{};
  int n = 0;
  // Few lines (e.g. a 1-D scatter_add): walk each line as one run, dim innermost.
  // Many lines (e.g. an embedding backward, rows added at index[i]): dim outermost, and per
  // step i a block of lines as contiguous runs.
  const bool by_line = lines < kScatterBlockLines;
  if (!by_line) order[n++] = dim;
  for (int d = 0; d < src.ndim; ++d) {
    if (d != dim) order[n++] = d;
  }
  if (by_line) order[n++] = dim;
  const StridedIter<3> it = make_iter<3>({&src, &out_base, &index}, order.data());
  auto run_in_order = [&](auto body) {
    const int64_t blocks = by_line ? lines : (lines + kScatterBlockLines - 1) / kScatterBlockLines;
    auto task = [&](int64_t b) {
      if (by_line) {
        iterate_range(it, b * length, (b + 1) * length, body);
        return;
      }
      const int64_t first = b * kScatterBlockLines;
      const int64_t last = std::min(lines, first + kScatterBlockLines);
      for (int64_t i = 0; i < length; ++i) {
        iterate_range(it, i * lines + first, i * lines + last, body);
      }
    };
    if (serial) {  // out overlaps itself: one thread, still in order along dim
      for (int64_t b = 0; b < blocks; ++b) task(b);
    } else {
      parallel_items(blocks, numel / blocks, task);
    }
  };
  dispatch_index(index.dtype, op, [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    auto with_values = [&](auto value_tag, auto accumulate_tag) {
      using T = typename decltype(value_tag)::type;
      run_in_order([&](const auto& p, int64_t count, const auto& s, int64_t) {
        for (int64_t k = 0; k < count; ++k) {
          int64_t i = *reinterpret_cast<const I*>(p[2] + k * s[2]);
          T& o = *reinterpret_cast<T*>(p[1] + k * s[1] + i * dim_stride);
          const T& x = *reinterpret_cast<const T*>(p[0] + k * s[0]);
          if constexpr (decltype(accumulate_tag)::value) {
            add_into(o, x);
          } else {
            o = x;
          }
        }
      });
    };
    if (accumulate) {
      dispatch_dtype(out_base.dtype, [&](auto tag) { with_values(tag, std::true_type{}); });
    } else {  // assignment only moves bytes
      dispatch_by_size(out_base.dtype, [&](auto tag) { with_values(tag, std::false_type{}); });
    }
  });
}

}  // namespace

void CpuBackend::index_select(const StridedView& out, const StridedView& in, int dim,
                              const StridedView& index) {
  check_index_select_args(out, in, dim, index);
  check_index_values("index_select", index, in.shape[dim]);
  StridedView index_view = index;  // the 1-D index seen along `dim` of out's shape
  index_view.ndim = out.ndim;
  index_view.shape = out.shape;
  index_view.strides.fill(0);
  index_view.strides[dim] = index.strides[0];
  gather_kernel(out, line_base(in, out, dim), index_view, byte_stride(in, dim));
}

void CpuBackend::gather(const StridedView& out, const StridedView& in, int dim,
                        const StridedView& index) {
  check_gather_args(out, in, dim, index);
  check_index_values("gather", index, in.shape[dim]);
  gather_kernel(out, line_base(in, out, dim), index, byte_stride(in, dim));
}

void CpuBackend::index_add(const StridedView& out, int dim, const StridedView& index,
                           const StridedView& src) {
  check_index_add_args(out, dim, index, src);
  check_index_values("index_add", index, out.shape[dim]);
  StridedView index_view = index;
  index_view.ndim = src.ndim;
  index_view.shape = src.shape;
  index_view.strides.fill(0);
  index_view.strides[dim] = index.strides[0];
  scatter_kernel("index_add", line_base(out, src, dim), dim, index_view, src,
                 byte_stride(out, dim), /*accumulate=*/true, !has_distinct_elements(out));
}

void CpuBackend::scatter(const StridedView& out, int dim, const StridedView& index,
                         const StridedView& src, bool accumulate) {
  check_scatter_args(out, dim, index, src);
  check_index_values("scatter", index, out.shape[dim]);
  StridedView src_view = src;  // src restricted to the index's shape
  src_view.shape = index.shape;
  scatter_kernel("scatter", line_base(out, index, dim), dim, index, src_view,
                 byte_stride(out, dim), accumulate, !has_distinct_elements(out));
}

}  // namespace rd::kernels::cpu
