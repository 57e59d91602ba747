// CUDA indexing kernels and cumsum. index_select and gather (reads through an index) share
// one kernel; index_add and scatter (writes through an index) share two: a deterministic one
// that walks each line along `dim` in order on one thread (the CPU's order, so results match
// it bit for bit), used when lines are short or plentiful, and an element-parallel one with
// atomic adds (float sums then depend on the order of the adds; assignment with duplicate
// indices keeps an unspecified one of the values). cumsum scans each line on one thread in
// the CPU's order when lines are plentiful, else each long line with a whole thread block
// (deterministic, but float sums associate differently from the CPU's serial order).
//
// Index values are checked by the kernels as they run, without a host synchronization: an
// out-of-range index is recorded in the device's AsyncErrors (async_error.h), raised at the
// next synchronization, and its element skipped (a read writes 0, a write writes nothing),
// so nothing outside the tensors is ever touched.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "ringdilated/kernels/cuda/async_error.h"
#include "ringdilated/kernels/cuda/dtype_dispatch.cuh"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/cuda/strided_index.cuh"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cuda {
namespace {

// Writes through an index run one line per thread, in order, when a line has at most this many
// elements or there are at least kMinSerialLines lines (enough threads to fill the GPU);
// otherwise one thread per element with atomics. Deterministic whenever the former holds.
constexpr int64_t kMaxSerialLineLength = 256;
constexpr int64_t kMinSerialLines = 65536;

// `v` seen with `shape`'s shape (same ndim) and its stride along `dim` zeroed: the base of
// every line along dim, to be offset by index * v.strides[dim].
StridedView line_base(const StridedView& v, const StridedView& shape, int dim) {
  StridedView r = v;
  r.shape = shape.shape;
  r.strides[dim] = 0;
  return r;
}

// The 1-D `index` seen as a view of `shape`'s shape that varies only along `dim`.
StridedView index_along(const StridedView& index, const StridedView& shape, int dim) {
  StridedView r = index;
  r.ndim = shape.ndim;
  r.shape = shape.shape;
  r.strides.fill(0);
  r.strides[dim] = index.strides[0];
  return r;
}

// `v` with `dim` dropped from the iteration (size 1): one element per line along dim.
StridedView lines_of(const StridedView& v, int dim) {
  StridedView r = v;
  r.shape[dim] = 1;
  return r;
}

// --- reads through an index ---

// Throws kDTypeMismatch unless the index is int64 or int32 (what load_index reads).
void check_index_dtype(const char* op, const StridedView& index) {
  dispatch_index(index.dtype, op, [](auto) {});
}

// True when idx is in [0, limit); otherwise reports it, for the caller to skip the element.
RD_HOST_DEVICE inline bool index_ok(int64_t idx, int64_t limit, const AsyncErrorSink& errors) {
  if (idx >= 0 && idx < limit) return true;
  errors.report(idx, limit);
  return false;
}

// out[e] = in_base[e + index[e] * dim_stride] for every element e of out (element offsets);
// 0 where the index is out of range.
template <class U>
struct GatherBody {
  U* out;
  const U* in;
  const void* index;
  bool is_int64;
  int64_t dim_stride;
  int64_t limit;  // in's size along dim
  AsyncErrorSink errors;
  OffsetCalculator<3> calc;  // out, in_base, index

  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<3> o = calc.get(i);
    const int64_t idx = load_index(index, is_int64, o.v[2]);
    out[o.v[0]] = index_ok(idx, limit, errors) ? in[o.v[1] + idx * dim_stride] : U(0);
  }
};

void gather_kernel(const StridedView& out, const StridedView& in_base, const StridedView& index,
                   int64_t dim_stride, int64_t limit, const AsyncErrorSink& errors,
                   cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const OffsetCalculator<3> calc = make_offset_calculator<3>({&out, &in_base, &index});
  const bool is_int64 = index.dtype == DType::kInt64;
  dispatch_by_size(out.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    launch_grid_stride(n,
                       GatherBody<U>{static_cast<U*>(out.data), static_cast<const U*>(in_base.data),
                                     index.data, is_int64, dim_stride, limit, errors, calc},
                       stream);
  });
}

// --- writes through an index ---

// What a scatter reads and writes; offsets in elements.
template <class T>
struct ScatterArgs {
  T* out;  // out_base: the target line's base, offset by index * out_dim_stride
  const T* src;
  const void* index;
  bool is_int64;
  bool accumulate;
  int64_t out_dim_stride;
  int64_t limit;  // out's size along dim
  AsyncErrorSink errors;
};

// One line along dim per item, its elements in order: races only across lines, whose targets
// are disjoint when out's elements are distinct.
template <class T>
struct ScatterLineBody {
  ScatterArgs<T> args;
  OffsetCalculator<3> lines;  // out_base, index, src; `dim` dropped
  int64_t length;
  int64_t index_dim_stride;
  int64_t src_dim_stride;

  RD_HOST_DEVICE void operator()(int64_t line) const {
    const Offsets<3> o = lines.get(line);
    for (int64_t k = 0; k < length; ++k) {
      const int64_t idx = load_index(args.index, args.is_int64, o.v[1] + k * index_dim_stride);
      if (!index_ok(idx, args.limit, args.errors)) continue;
      T& target = args.out[o.v[0] + idx * args.out_dim_stride];
      const T x = args.src[o.v[2] + k * src_dim_stride];
      if (args.accumulate) {
        add_into(target, x);
      } else {
        target = x;
      }
    }
  }
};

// One element per item: accumulation is atomic, assignment a plain store.
template <class T>
struct ScatterElementBody {
  ScatterArgs<T> args;
  OffsetCalculator<3> calc;  // out_base, index, src

  RD_HOST_DEVICE void operator()(int64_t i) const {
    const Offsets<3> o = calc.get(i);
    const int64_t idx = load_index(args.index, args.is_int64, o.v[1]);
    if (!index_ok(idx, args.limit, args.errors)) return;
    T* target = args.out + o.v[0] + idx * args.out_dim_stride;
    const T x = args.src[o.v[2]];
    if (args.accumulate) {
      atomic_add_into(target, x);
    } else {
      *target = x;
    }
  }
};

// out_base[e] + index[e] * out.strides[dim] receives src[e] (+= when accumulating) for every
// element e of the index space (src's shape, which index and out_base share).
void scatter_kernel(const StridedView& out, const StridedView& out_base, int dim,
                    const StridedView& index, const StridedView& src, bool accumulate,
                    const AsyncErrorSink& errors, cudaStream_t stream) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const int64_t length = src.shape[dim];
  const int64_t lines = n / length;
  // With overlapping out elements, different lines may hit one target: assignment then runs
  // every line on a single thread in the CPU's order; accumulation uses atomics.
  const bool distinct = has_distinct_elements(out);
  const bool line_mode =
      distinct ? (length <= kMaxSerialLineLength || lines >= kMinSerialLines) : !accumulate;
  const bool serial = !distinct;
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const ScatterArgs<T> args{static_cast<T*>(out_base.data),
                              static_cast<const T*>(src.data),
                              index.data,
                              index.dtype == DType::kInt64,
                              accumulate,
                              out.strides[dim],
                              out.shape[dim],
                              errors};
    if (line_mode) {
      const StridedView out_lines = lines_of(out_base, dim);
      const StridedView index_lines = lines_of(index, dim);
      const StridedView src_lines = lines_of(src, dim);
      launch_grid_stride(
          lines,
          ScatterLineBody<T>{args,
                             make_offset_calculator<3>({&out_lines, &index_lines, &src_lines}),
                             length, index.strides[dim], src.strides[dim]},
          stream, serial);
    } else {
      launch_grid_stride(
          n, ScatterElementBody<T>{args, make_offset_calculator<3>({&out_base, &index, &src})},
          stream);
    }
  });
}

// --- cumsum ---

// Lines are scanned one per thread, in the CPU's order (bit-identical results), unless they
// are long and too few to occupy the GPU: then one block scans each line.
constexpr int64_t kMinBlockScanLength = 512;
constexpr int64_t kMinThreadScanLines = 65536;

struct CumsumLines {
  OffsetCalculator<2> lines;  // out, in; `dim` dropped
  int64_t count;
  int64_t length;
  int64_t out_stride;
  int64_t in_stride;
};

// Inclusive scan of one line along dim per item, accumulating in Accum<T> like the CPU.
template <class T>
struct CumsumBody {
  T* out;
  const T* in;
  CumsumLines shape;

  RD_HOST_DEVICE void operator()(int64_t line) const {
    using A = Accum<T>;
    const Offsets<2> o = shape.lines.get(line);
    A acc = 0;
    for (int64_t k = 0; k < shape.length; ++k) {
      acc += static_cast<A>(static_cast<Compute<T>>(in[o.v[1] + k * shape.in_stride]));
      out[o.v[0] + k * shape.out_stride] = convert<T>(acc);
    }
  }
};

constexpr int kScanThreads = 256;
constexpr int kScanItems = 8;  // consecutive elements per thread per tile
constexpr int kScanWarps = kScanThreads / 32;
constexpr int64_t kScanTile = int64_t{kScanThreads} * kScanItems;

// One block per line (grid-strided over lines), tile by tile: each thread sums its
// kScanItems elements serially, a warp-shuffle scan and a scan of the warp totals give every
// thread the sum before it, and a carry brings in the earlier tiles. The order of the adds
// depends only on the line length, so results are deterministic.
template <class T>
__global__ void __launch_bounds__(kScanThreads)
    cumsum_block_kernel(T* out, const T* in, CumsumLines shape) {
  using A = Accum<T>;
  constexpr unsigned kFullMask = 0xffffffffu;
  __shared__ A warp_totals[kScanWarps];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  for (int64_t line = blockIdx.x; line < shape.count; line += gridDim.x) {
    const Offsets<2> o = shape.lines.get(line);
    A carry = 0;
    for (int64_t tile = 0; tile < shape.length; tile += kScanTile) {
      const int64_t first = tile + static_cast<int64_t>(threadIdx.x) * kScanItems;
      A partial[kScanItems];  // inclusive sums within this thread's items
      A running = 0;
      RD_UNROLL
      for (int j = 0; j < kScanItems; ++j) {
        const int64_t k = first + j;
        if (k < shape.length) {
          running += static_cast<A>(static_cast<Compute<T>>(in[o.v[1] + k * shape.in_stride]));
        }
        partial[j] = running;
      }
      // Inclusive scan of the thread totals within the warp.
      A inclusive = running;
      RD_UNROLL
      for (int d = 1; d < 32; d *= 2) {
        const A y = __shfl_up_sync(kFullMask, inclusive, d);
        if (lane >= d) inclusive += y;
      }
      A before_in_warp = __shfl_up_sync(kFullMask, inclusive, 1);
      if (lane == 0) before_in_warp = 0;
      if (lane == 31) warp_totals[warp] = inclusive;
      __syncthreads();
      if (warp == 0) {  // inclusive scan of the warp totals, in place
        A t = lane < kScanWarps ? warp_totals[lane] : A(0);
        RD_UNROLL
        for (int d = 1; d < kScanWarps; d *= 2) {
          const A y = __shfl_up_sync(kFullMask, t, d);
          if (lane >= d) t += y;
        }
        if (lane < kScanWarps) warp_totals[lane] = t;
      }
      __syncthreads();
      const A before = carry + (warp > 0 ? warp_totals[warp - 1] : A(0)) + before_in_warp;
      RD_UNROLL
      for (int j = 0; j < kScanItems; ++j) {
        const int64_t k = first + j;
        if (k < shape.length) out[o.v[0] + k * shape.out_stride] = convert<T>(before + partial[j]);
      }
      carry += warp_totals[kScanWarps - 1];
      __syncthreads();  // warp_totals is rewritten by the next tile
    }
  }
}

}  // namespace

void index_select(const StridedView& out, const StridedView& in, int dim, const StridedView& index,
                  AsyncErrors& errors, cudaStream_t stream) {
  check_index_select_args(out, in, dim, index);
  check_index_dtype("index_select", index);
  gather_kernel(out, line_base(in, out, dim), index_along(index, out, dim), in.strides[dim],
                in.shape[dim], errors.sink(AsyncErrorOp::kIndexSelect), stream);
}

void gather(const StridedView& out, const StridedView& in, int dim, const StridedView& index,
            AsyncErrors& errors, cudaStream_t stream) {
  check_gather_args(out, in, dim, index);
  check_index_dtype("gather", index);
  gather_kernel(out, line_base(in, out, dim), index, in.strides[dim], in.shape[dim],
                errors.sink(AsyncErrorOp::kGather), stream);
}

void index_add(const StridedView& out, int dim, const StridedView& index, const StridedView& src,
               AsyncErrors& errors, cudaStream_t stream) {
  check_index_add_args(out, dim, index, src);
  check_index_dtype("index_add", index);
  scatter_kernel(out, line_base(out, src, dim), dim, index_along(index, src, dim), src,
                 /*accumulate=*/true, errors.sink(AsyncErrorOp::kIndexAdd), stream);
}

void scatter(const StridedView& out, int dim, const StridedView& index, const StridedView& src,
             bool accumulate, AsyncErrors& errors, cudaStream_t stream) {
  check_scatter_args(out, dim, index, src);
  check_index_dtype("scatter", index);
  StridedView src_view = src;  // src restricted to the index's shape
  src_view.shape = index.shape;
  scatter_kernel(out, line_base(out, index, dim), dim, index, src_view, accumulate,
                 errors.sink(AsyncErrorOp::kScatter), stream);
}

void cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse,
            cudaStream_t stream) {
  check_cumsum_args(out, in, dim);
  const int64_t n = in.numel();
  if (n == 0) return;
  const int64_t length = in.shape[dim];
  const StridedView o = reverse ? flipped(out, dim) : out;
  const StridedView i = reverse ? flipped(in, dim) : in;
  const StridedView o_lines = lines_of(o, dim);
  const StridedView i_lines = lines_of(i, dim);
  const CumsumLines shape{make_offset_calculator<2>({&o_lines, &i_lines}), n / length, length,
                          o.strides[dim], i.strides[dim]};
  const bool block_scan = length >= kMinBlockScanLength && shape.count < kMinThreadScanLines;
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, bool>) {
      T* out_data = static_cast<T*>(o.data);
      const T* in_data = static_cast<const T*>(i.data);
      if (block_scan) {
        const auto blocks = static_cast<unsigned>(std::min(shape.count, kMaxBlocks));
        cumsum_block_kernel<T><<<blocks, kScanThreads, 0, stream>>>(out_data, in_data, shape);
        RD_CUDA_CHECK_LAUNCH();
      } else {
        launch_grid_stride(shape.count, CumsumBody<T>{out_data, in_data, shape}, stream);
      }
    }
  });
}

}  // namespace rd::kernels::cuda
