// CPU reductions (sum, mean, max, min, argmax, argmin, logsumexp) and cumsum. A reduction
// walks the input with kept dims outermost and reduced dims innermost, so each output owns a
// contiguous range of the logical index space; long ranges are split into fixed kGrain-sized
// chunks whose partial results are merged in order, independent of the thread count. Sums
// over non-contiguous dims of an input with a contiguous kept dim (column sums) take a
// "lane" path that reads rows and keeps one accumulator per output instead.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <span>
#include <vector>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/cpu/summation.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cpu {
namespace {

template <class T>
Compute<T> load(const char* p) {
  return static_cast<Compute<T>>(*reinterpret_cast<const T*>(p));
}

// Dims of the reduction: kept dims (outermost, in order) then reduced dims.
struct ReduceLayout {
  std::array<int, kMaxDims> order{};
  int kept = 0;
  int64_t outputs = 1;  // product of kept sizes
  int64_t reduced = 1;  // elements per output
};

ReduceLayout make_layout(const StridedView& in, uint32_t dims_mask) {
  ReduceLayout layout;
  int n = 0;
  for (int d = 0; d < in.ndim; ++d) {
    if (!((dims_mask >> d) & 1u)) {
      layout.order[n++] = d;
      layout.outputs *= in.shape[d];
    }
  }
  layout.kept = n;
  for (int d = 0; d < in.ndim; ++d) {
    if ((dims_mask >> d) & 1u) {
      layout.order[n++] = d;
      layout.reduced *= in.shape[d];
    }
  }
  return layout;
}

// Address of output `o` (row-major over the kept dims).
char* output_address(const StridedView& out, const ReduceLayout& layout, int64_t o) {
  int64_t offset = 0;
  for (int i = layout.kept - 1; i >= 0; --i) {
    int d = layout.order[i];
    offset += (o % out.shape[d]) * out.strides[d];
    o /= out.shape[d];
  }
  return static_cast<char*>(out.data) + offset * static_cast<int64_t>(dtype_size(out.dtype));
}

// A reducer defines State, init(), add_run(state, ptr, n, byte_stride, position_in_output),
// merge(state, later_state) and store(out_address, state).

template <class T, bool kMean>
struct SumReducer {
  using A = Accum<T>;
  using State = Summer<A>;
  DType out_dtype;
  int64_t count;

  State init() const { return {}; }
  void add_run(State& s, const char* p, int64_t n, int64_t stride, int64_t) const {
    if (stride == static_cast<int64_t>(sizeof(T))) {
      const T* x = reinterpret_cast<const T*>(p);
      s.add_many(n, [x](int64_t k) { return static_cast<A>(static_cast<Compute<T>>(x[k])); });
    } else {
      s.add_many(n, [=](int64_t k) { return static_cast<A>(load<T>(p + k * stride)); });
    }
  }
  void merge(State& s, const State& later) const { s.add(later.value()); }
  void store(char* out, const State& s) const {
    if constexpr (kMean) {
      store_as(out, out_dtype, s.value() / static_cast<A>(count));  // 0/0 -> NaN when empty
    } else {
      store_as(out, out_dtype, s.value());
    }
  }
};

template <class T, bool kMax>
struct ExtremeReducer {
  using C = Compute<T>;
  using State = C;
  DType out_dtype;

  static bool wins(C x, C best) {  // NaN wins and then stays
    return is_nan(x) || (kMax ? x > best : x < best);
  }
  State init() const { return kMax ? lowest_value<C>() : highest_value<C>(); }
  void add_run(State& s, const char* p, int64_t n, int64_t stride, int64_t) const {
    for (int64_t k = 0; k < n; ++k) {
      C x = load<T>(p + k * stride);
      if (wins(x, s)) s = x;
    }
  }
  void merge(State& s, const State& later) const {
    if (wins(later, s)) s = later;
  }
  void store(char* out, const State& s) const { store_as(out, out_dtype, s); }
};

template <class T, bool kMax>
struct ArgReducer {
  using C = Compute<T>;
  struct State {
    C value{};
    int64_t index = -1;  // -1: nothing seen yet
  };

  // Strictly better, so the first occurrence is kept; the first NaN beats everything.
  static bool wins(C x, C best) {
    if (is_nan(best)) return false;
    return is_nan(x) || (kMax ? x > best : x < best);
  }
  State init() const { return {}; }
  void add_run(State& s, const char* p, int64_t n, int64_t stride, int64_t position) const {
    for (int64_t k = 0; k < n; ++k) {
      C x = load<T>(p + k * stride);
      if (s.index < 0 || wins(x, s.value)) s = {x, position + k};
    }
  }
  void merge(State& s, const State& later) const {
    if (later.index >= 0 && (s.index < 0 || wins(later.value, s.value))) s = later;
  }
  void store(char* out, const State& s) const { *reinterpret_cast<int64_t*>(out) = s.index; }
};

// State: running max m and sum s of exp(x - m). m = -inf means nothing but -inf seen; m of
// +inf or NaN is final (the result is m).
template <class T>
struct LogSumExpReducer {
  using A = Compute<T>;
  struct State {
    A max = -std::numeric_limits<A>::infinity();
    A sum = 0;
  };
  DType out_dtype;

  State init() const { return {}; }
  void add_run(State& s, const char* p, int64_t n, int64_t stride, int64_t) const {
    State run;
    for (int64_t k = 0; k < n; ++k) {
      A x = load<T>(p + k * stride);
      if (x > run.max || std::isnan(x)) run.max = x;
    }
    if (std::isfinite(run.max)) {
      Summer<A> sum;
      const A m = run.max;
      sum.add_many(n, [=](int64_t k) { return std::exp(load<T>(p + k * stride) - m); });
      run.sum = sum.value();
    }
    merge(s, run);
  }
  void merge(State& s, const State& later) const {
    A m = (later.max > s.max || std::isnan(later.max)) ? later.max : s.max;
    if (std::isnan(s.max)) m = s.max;
    if (!std::isfinite(m)) {
      s = {m, 0};
      return;
    }
    s.sum = s.sum * std::exp(s.max - m) + later.sum * std::exp(later.max - m);
    s.max = m;
  }
  void store(char* out, const State& s) const {
    A v = std::isfinite(s.max) ? s.max + std::log(s.sum) : s.max;
    store_as(out, out_dtype, v);
  }
};

template <class Reducer>
void run_reduction(const Reducer& red, const StridedView& out, const StridedView& in,
                   const ReduceLayout& layout) {
  using State = typename Reducer::State;
  const StridedIter<1> it = make_iter<1>({&in}, layout.order.data());
  const int64_t per_output = layout.reduced;
  const int64_t outputs = layout.outputs;
  auto fold = [&](int64_t o, int64_t begin, int64_t end) {
    State s = red.init();
    iterate_range(it, begin, end, [&](const auto& p, int64_t n, const auto& stride, int64_t pos) {
      red.add_run(s, p[0], n, stride[0], pos - o * per_output);
    });
    return s;
  };
  const int64_t chunks = per_output > kGrain ? (per_output + kGrain - 1) / kGrain : 1;
  if (chunks == 1) {
    parallel_items(outputs, per_output, [&](int64_t o) {
      red.store(output_address(out, layout, o), fold(o, o * per_output, (o + 1) * per_output));
    });
    return;
  }
  // Long reductions: fixed chunks in parallel, then an in-order merge per output.
  std::vector<State> partial(outputs * chunks);
  parallel_items(outputs * chunks, kGrain, [&](int64_t task) {
    int64_t o = task / chunks;
    int64_t begin = o * per_output + (task % chunks) * kGrain;
    partial[task] = fold(o, begin, std::min(begin + kGrain, (o + 1) * per_output));
  });
  parallel_items(outputs, chunks, [&](int64_t o) {
    State s = partial[o * chunks];
    for (int64_t c = 1; c < chunks; ++c) red.merge(s, partial[o * chunks + c]);
    red.store(output_address(out, layout, o), s);
  });
}

// Walks the positions of a set of dims (an odometer), tracking the element offset.
class DimWalker {
 public:
  DimWalker(const StridedView& v, const int* dims, int count) : count_(count) {
    for (int i = 0; i < count; ++i) {
      shape_[i] = v.shape[dims[i]];
      stride_[i] = v.strides[dims[i]];
    }
  }
  // Moves to the position with row-major index `linear`.
  void seek(int64_t linear) {
    offset_ = 0;
    for (int i = count_ - 1; i >= 0; --i) {
      index_[i] = linear % shape_[i];
      linear /= shape_[i];
      offset_ += index_[i] * stride_[i];
    }
  }
  void next() {
    for (int i = count_ - 1; i >= 0; --i) {
      offset_ += stride_[i];
      if (++index_[i] < shape_[i]) return;
      offset_ -= shape_[i] * stride_[i];
      index_[i] = 0;
    }
  }
  int64_t offset() const { return offset_; }  // in elements

 private:
  int count_;
  std::array<int64_t, kMaxDims> shape_{}, stride_{}, index_{};
  int64_t offset_ = 0;
};

// The lane path's fixed work split (never derived from the thread count): chunks of
// kLaneChunkRows reduced positions, times groups of kLaneTilesPerTask tiles of kLanes
// neighbouring outputs (1024 outputs: a 4 KB float row segment, read sequentially).
constexpr int64_t kLaneChunkRows = 1024;
constexpr int64_t kLaneTilesPerTask = 16;
constexpr int kLaneLevels = 5;
static_assert(kLaneChunkRows <= (int64_t{128} << (kLaneLevels - 1)));

// The kept dim to sum along in lanes, or -1: a kept dim of size > 1 that is contiguous in
// the input (stride 1) while no reduced dim is. Summing, say, dim 0 of a [rows, cols] matrix
// then reads whole row segments, instead of one strided column per output (slow: a cache
// line and a TLB entry per element).
int lane_dim_for(const StridedView& in, const ReduceLayout& layout) {
  int lane_dim = -1;
  for (int i = 0; i < in.ndim; ++i) {
    const int d = layout.order[i];
    if (in.shape[d] <= 1 || in.strides[d] != 1) continue;
    if (i >= layout.kept) return -1;  // a reduced dim is contiguous: the scalar path suits
    lane_dim = d;
  }
  return layout.reduced > 1 ? lane_dim : -1;
}

// Adds each span task's `chunks` partials (`per_task` values each, chunk-major within the
// task) in chunk order and hands the sums to store(span_task, values).
template <class A, class Store>
void merge_chunk_partials(const std::vector<A>& partial, int64_t span_tasks, int64_t chunks,
                          int64_t per_task, const Store& store) {
  parallel_items(span_tasks, chunks * per_task, [&](int64_t span_task) {
    std::vector<A> values(static_cast<size_t>(per_task));
    for (int64_t i = 0; i < per_task; ++i) {
      Summer<A> sum;
      for (int64_t c = 0; c < chunks; ++c) {
        sum.add(partial[static_cast<size_t>((span_task * chunks + c) * per_task + i)]);
      }
      values[static_cast<size_t>(i)] = sum.value();
    }
    store(span_task, values.data());
  });
}

// Sum/mean with a contiguous kept dim. Each task sums up to kLaneTilesPerTask * kLanes
// neighbouring outputs over one chunk of reduced positions, row by row; chunk partials are
// then merged in order.
template <class T, bool kMean>
void lane_sum(const SumReducer<T, kMean>& red, const StridedView& out, const StridedView& in,
              const ReduceLayout& layout, int lane_dim) {
  using A = Accum<T>;
  using Lanes = CascadeSumLanes<A, kLaneLevels>;
  constexpr int64_t kLanes = Lanes::kLanes;
  constexpr int64_t kPerTask = kLaneTilesPerTask * kLanes;  // outputs per task
  std::array<int, kMaxDims> outer{};                        // kept dims other than lane_dim
  int n_outer = 0;
  for (int i = 0; i < layout.kept; ++i) {
    if (layout.order[i] != lane_dim) outer[n_outer++] = layout.order[i];
  }
  const int* reduced_dims = layout.order.data() + layout.kept;
  const int n_reduced = in.ndim - layout.kept;
  const int64_t width = in.shape[lane_dim];
  const int64_t rows = layout.reduced;
  const int64_t groups = layout.outputs / width;
  const int64_t spans = (width + kPerTask - 1) / kPerTask;  // output spans per group
  const int64_t chunks = (rows + kLaneChunkRows - 1) / kLaneChunkRows;

  // Sums outputs [span * kPerTask, +kPerTask) of `group` over `chunk` into values[].
  auto fold = [&](int64_t group, int64_t span, int64_t chunk, A* values) {
    DimWalker group_walker(in, outer.data(), n_outer);
    group_walker.seek(group);
    const int64_t first_out = span * kPerTask;
    const int64_t count = std::min(kPerTask, width - first_out);
    const int64_t tiles = (count + kLanes - 1) / kLanes;
    const T* base = static_cast<const T*>(in.data) + group_walker.offset() + first_out;
    std::vector<Lanes> sums(tiles);
    DimWalker rows_walker(in, reduced_dims, n_reduced);
    const int64_t first = chunk * kLaneChunkRows, last = std::min(rows, first + kLaneChunkRows);
    rows_walker.seek(first);
    for (int64_t r = first; r < last; ++r, rows_walker.next()) {
      const T* row = base + rows_walker.offset();
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t lanes = std::min(kLanes, count - t * kLanes);
        const T* segment = row + t * kLanes;
        A* acc = sums[t].row();
        for (int64_t j = 0; j < lanes; ++j) {
          acc[j] += static_cast<A>(static_cast<Compute<T>>(segment[j]));
        }
        sums[t].end_row();
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      values[i] = sums[i / kLanes].value(static_cast<int>(i % kLanes));
    }
  };
  auto store = [&](int64_t group, int64_t span, const A* values) {
    DimWalker walker(out, outer.data(), n_outer);
    walker.seek(group);
    char* base = static_cast<char*>(out.data);
    const int64_t elem = static_cast<int64_t>(dtype_size(out.dtype));
    const int64_t first_out = span * kPerTask;
    const int64_t count = std::min(kPerTask, width - first_out);
    for (int64_t i = 0; i < count; ++i) {
      typename SumReducer<T, kMean>::State s;
      s.add(values[i]);
      red.store(base + (walker.offset() + (first_out + i) * out.strides[lane_dim]) * elem, s);
    }
  };
  const int64_t work = std::min(rows, kLaneChunkRows) * std::min(width, kPerTask);
  if (chunks == 1) {
    parallel_items(groups * spans, work, [&](int64_t task) {
      std::vector<A> values(kPerTask);
      fold(task / spans, task % spans, 0, values.data());
      store(task / spans, task % spans, values.data());
    });
    return;
  }
  const int64_t tasks = groups * spans * chunks;
  std::vector<A> partial(tasks * kPerTask);
  parallel_items(tasks, work, [&](int64_t task) {
    const int64_t span_task = task / chunks;
    fold(span_task / spans, span_task % spans, task % chunks, partial.data() + task * kPerTask);
  });
  merge_chunk_partials<A>(partial, groups * spans, chunks, kPerTask,
                          [&](int64_t span_task, const A* values) {
                            store(span_task / spans, span_task % spans, values);
                          });
}

template <class T, bool kMean>
void sum_or_mean(const StridedView& out, const StridedView& in, const ReduceLayout& layout) {
  const SumReducer<T, kMean> red{out.dtype, layout.reduced};
  const int lane_dim = lane_dim_for(in, layout);
  if (lane_dim >= 0) {
    lane_sum(red, out, in, layout, lane_dim);
  } else {
    run_reduction(red, out, in, layout);
  }
}

template <class T>
void reduce_typed(ReduceOp op, const StridedView& out, const StridedView& in,
                  const ReduceLayout& layout) {
  const DType od = out.dtype;
  switch (op) {
    case ReduceOp::kSum: return sum_or_mean<T, false>(out, in, layout);
    case ReduceOp::kMax: return run_reduction(ExtremeReducer<T, true>{od}, out, in, layout);
    case ReduceOp::kMin: return run_reduction(ExtremeReducer<T, false>{od}, out, in, layout);
    case ReduceOp::kArgMax: return run_reduction(ArgReducer<T, true>{}, out, in, layout);
    case ReduceOp::kArgMin: return run_reduction(ArgReducer<T, false>{}, out, in, layout);
    case ReduceOp::kMean:
    case ReduceOp::kLogSumExp:
      if constexpr (kIsFloating<T>) {
        if (op == ReduceOp::kMean) return sum_or_mean<T, true>(out, in, layout);
        return run_reduction(LogSumExpReducer<T>{od}, out, in, layout);
      }
      break;
  }
  RD_FAIL(kDTypeMismatch, "reduce: op ", op_name(op), " does not support dtype ",
          dtype_name(in.dtype));
}

}  // namespace

void CpuBackend::reduce(ReduceOp op, const StridedView& out, const StridedView& in,
                        uint32_t dims_mask) {
  check_reduce_args(op, out, in, dims_mask);
  const ReduceLayout layout = make_layout(in, dims_mask);
  dispatch_dtype(
      in.dtype, [&](auto tag) { reduce_typed<typename decltype(tag)::type>(op, out, in, layout); });
}

void CpuBackend::cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse) {
  check_cumsum_args(out, in, dim);
  const int64_t length = in.shape[dim];
  if (in.numel() == 0) return;
  const StridedView o = reverse ? flipped(out, dim) : out;
  const StridedView i = reverse ? flipped(in, dim) : in;
  std::array<int, kMaxDims> order{};
  int n = 0;
  for (int d = 0; d < in.ndim; ++d) {
    if (d != dim) order[n++] = d;
  }
  order[n] = dim;  // innermost, so each line is one contiguous logical range
  const StridedIter<2> it = make_iter<2>({&o, &i}, order.data());
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Accum<T>;
    parallel_items(in.numel() / length, length, [&](int64_t line) {
      A acc = 0;
      iterate_range(it, line * length, (line + 1) * length,
                    [&](const auto& p, int64_t count, const auto& s, int64_t) {
                      for (int64_t k = 0; k < count; ++k) {
                        acc += static_cast<A>(load<T>(p[1] + k * s[1]));
                        *reinterpret_cast<T*>(p[0] + k * s[0]) = convert<T>(acc);
                      }
                    });
    });
  });
}

}  // namespace rd::kernels::cpu
