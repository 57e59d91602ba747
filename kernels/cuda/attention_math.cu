// The CUDA math attention (kernels/cuda/attention.h): a simple, correct fallback with the
// CPU kernel's semantics, one warp per row.
//
// Forward: a warp owns a query row and walks its visible keys 32 at a time, one key per
// lane: each lane computes its key's score, the warp folds the tile's max and sum into an
// online softmax, then every lane adds the tile's weighted value rows into its share of the
// output columns (kSlots per lane, 256 columns per pass over the keys; larger D takes more
// passes, recomputing the scores).
// Backward: one kernel computes delta = grad_out . out - grad_lse per row into scratch; one
// kernel over query rows adds grad_q, one over key rows adds grad_k and grad_v, each
// recomputing p = exp(s - lse) for its pairs. Every output element has one owner: no
// atomics, and results are bitwise reproducible.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "ringdilated/kernels/attention_dropout.h"
#include "ringdilated/kernels/cuda/attention.h"
#include "ringdilated/kernels/cuda/reduce_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cuda {
namespace {

using reduce_util::exp_of;
using reduce_util::from_compute;
using reduce_util::kFullMask;
using reduce_util::kWarp;
using reduce_util::log_of;
using reduce_util::max_of;
using reduce_util::to_compute;

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr int kSlots = 8;                         // output columns per lane in one pass
constexpr int64_t kPassColumns = kWarp * kSlots;  // output columns per pass over the keys
constexpr int kMaxBatchDims = kMaxDims - 2;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // grid-stride loops cover the rest

// Where the rows of one [batch..., rows, D] (or [batch..., rows]) view are.
struct Operand {
  void* data = nullptr;
  bool f32 = false;  // stored as float32 (else as the inputs' type)
  int64_t batch_strides[kMaxBatchDims] = {};
  int64_t row_stride = 0, col_stride = 0;  // elements
};

// lse and grad_lse: float32, or float64 for float64 inputs (then f32 is false).
__device__ __forceinline__ double load_statistic(const Operand& o, int64_t offset) {
  return o.f32 ? static_cast<double>(static_cast<const float*>(o.data)[offset])
               : static_cast<const double*>(o.data)[offset];
}

__device__ __forceinline__ void store_statistic(const Operand& o, int64_t offset, double value) {
  if (o.f32) {
    static_cast<float*>(o.data)[offset] = static_cast<float>(value);
  } else {
    static_cast<double*>(o.data)[offset] = value;
  }
}

// What every kernel of one call shares: the shape and the mask.
struct Call {
  int batch_dims = 0;
  int64_t batch_sizes[kMaxBatchDims] = {};
  int64_t batch = 1, lq = 0, lk = 0, d = 0;
  double scale = 1;
  bool causal = false;
  int64_t causal_offset = 0;  // clamped to [-(lq + 1), lk]: the same mask, no overflow
  bool dropout = false;
  double keep_probability = 1, keep_scale = 1;
  uint64_t seed = 0, offset = 0;
  DropoutIndexing numbering;           // resolved (kernels/attention_dropout.h)
  const int64_t* key_order = nullptr;  // device memory; nullptr: natural order
};

struct ForwardParams {
  Call call;
  Operand q, k, v, out, lse;
};

struct BackwardParams {
  Call call;
  Operand q, k, v, out, lse, grad_out, grad_lse, grad_q, grad_k, grad_v;
  void* delta = nullptr;  // [batch * lq] of the accumulation type
};

// ---------------------------------------------------------------------------------------
// Device helpers.

// Element offset of row `row` of flattened batch b (batch dims in row-major order).
__device__ int64_t row_offset(const Operand& o, const Call& c, int64_t b, int64_t row) {
  int64_t offset = row * o.row_stride;
#pragma unroll
  for (int d = kMaxBatchDims - 1; d >= 0; --d) {
    if (d < c.batch_dims) {
      offset += (b % c.batch_sizes[d]) * o.batch_strides[d];
      b /= c.batch_sizes[d];
    }
  }
  return offset;
}

template <class T, class A>
__device__ __forceinline__ A load(const Operand& o, int64_t offset) {
  if (o.f32) return static_cast<A>(static_cast<const float*>(o.data)[offset]);
  return static_cast<A>(to_compute(static_cast<const T*>(o.data)[offset]));
}

template <class T, class A>
__device__ __forceinline__ void store(const Operand& o, int64_t offset, A value) {
  if (o.f32) {
    static_cast<float*>(o.data)[offset] = static_cast<float>(value);
  } else {
    static_cast<T*>(o.data)[offset] = from_compute<T>(static_cast<Compute<T>>(value));
  }
}

// x . y over D elements of two rows (offsets of their first elements).
template <class T, class A>
__device__ A row_dot(const Operand& x, int64_t x_row, const Operand& y, int64_t y_row, int64_t d) {
  A sum = 0;
  for (int64_t c = 0; c < d; ++c) {
    sum += load<T, A>(x, x_row + c * x.col_stride) * load<T, A>(y, y_row + c * y.col_stride);
  }
  return sum;
}

// Query i sees keys [0, keys_for(i)); key j is seen by queries [first_query_for(j), lq).
__device__ __forceinline__ int64_t keys_for(const Call& c, int64_t i) {
  if (!c.causal) return c.lk;
  const int64_t n = i + c.causal_offset + 1;
  return n < 0 ? 0 : (n > c.lk ? c.lk : n);
}
// A row visits keys in steps: step t is key key_at(t). In the natural order its visible keys
// are the steps [0, keys_for(i)); with a key_order they are scattered over all steps, each
// checked with sees(). (grad_k and grad_v sum over queries: the key order never enters.)
__device__ __forceinline__ int64_t visit_end(const Call& c, int64_t i) {
  return c.key_order != nullptr ? c.lk : keys_for(c, i);
}
__device__ __forceinline__ int64_t key_at(const Call& c, int64_t step) {
  return c.key_order != nullptr ? c.key_order[step] : step;
}
__device__ __forceinline__ bool sees(const Call& c, int64_t i, int64_t j) {
  return !c.causal || j <= i + c.causal_offset;
}
__device__ __forceinline__ int64_t first_query_for(const Call& c, int64_t j) {
  if (!c.causal) return 0;
  const int64_t i = j - c.causal_offset;
  return i < 0 ? 0 : (i > c.lq ? c.lq : i);
}

// The dropout number of element (b, 0, 0), once per row: it divides.
__device__ __forceinline__ uint64_t dropout_base(const Call& c, int64_t b) {
  return dropout_batch_base(c.numbering, c.batch_sizes, c.batch_dims, b);
}

// What p[i, j] of the batch whose dropout_base is `base` is multiplied by: 1 without
// dropout, else 0 (dropped) or 1 / (1 - dropout); the mask of kernels/attention.h, bit for
// bit the CPU's.
template <class A>
__device__ __forceinline__ A dropout_factor(const Call& c, uint64_t base, int64_t i, int64_t j) {
  if (!c.dropout) return A(1);
  return attention_keeps(c.seed, c.offset, c.keep_probability,
                         dropout_element(c.numbering, base, i, j))
             ? static_cast<A>(c.keep_scale)
             : A(0);
}

template <class A>
__device__ __forceinline__ A warp_max(A v) {
  return reduce_util::group_fold(v, kWarp, reduce_util::MaxOp{});
}
template <class A>
__device__ __forceinline__ A warp_sum(A v) {
  return reduce_util::group_fold(v, kWarp, reduce_util::SumOp{});
}

__device__ __forceinline__ int64_t first_warp() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}
__device__ __forceinline__ int64_t warp_count() {
  return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
}

// One tile of a query row's keys, lane l holding key `key` (of the rows at `base` in
// `rows`) and its `weight`: every lane adds weight_l * row_l to its kSlots columns from col0,
// for the tile's first min(remaining, 32) lanes. A zero weight (dropped or masked) is
// uniform over the warp: its row is skipped.
template <class T, class A>
__device__ __forceinline__ void add_weighted_rows(A (&acc)[kSlots], A weight, int64_t key,
                                                  int64_t remaining, const Operand& rows,
                                                  int64_t base, int64_t col0, int64_t d) {
  const int n = remaining < kWarp ? static_cast<int>(remaining) : kWarp;
  for (int jj = 0; jj < n; ++jj) {
    const A w = __shfl_sync(kFullMask, weight, jj);
    const int64_t row = base + __shfl_sync(kFullMask, key, jj) * rows.row_stride;
    if (w == A(0)) continue;
#pragma unroll
    for (int t = 0; t < kSlots; ++t) {
      const int64_t col = col0 + t * kWarp;
      if (col < d) acc[t] += w * load<T, A>(rows, row + col * rows.col_stride);
    }
  }
}

int64_t passes_for(int64_t d) {
  return d <= kPassColumns ? 1 : (d + kPassColumns - 1) / kPassColumns;
}

// ---------------------------------------------------------------------------------------
// Forward: one warp per query row.

template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const ForwardParams p, int64_t passes) {
  using A = Accum<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const Call& c = p.call;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const A scale = static_cast<A>(c.scale);
  for (int64_t row = first_warp(); row < c.batch * c.lq; row += warp_count()) {
    const int64_t b = row / c.lq, i = row - b * c.lq;
    const int64_t q_row = row_offset(p.q, c, b, i);
    const int64_t k_base = row_offset(p.k, c, b, 0), v_base = row_offset(p.v, c, b, 0);
    const int64_t out_row = row_offset(p.out, c, b, i);
    const uint64_t drop_base = c.dropout ? dropout_base(c, b) : 0;
    const int64_t keys = visit_end(c, i);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t col0 = pass * kPassColumns + lane;
      A row_max = kNegInf, row_sum = 0, acc[kSlots];
#pragma unroll
      for (int t = 0; t < kSlots; ++t) acc[t] = 0;
      for (int64_t j0 = 0; j0 < keys; j0 += kWarp) {
        const int64_t j = j0 + lane < keys ? key_at(c, j0 + lane) : 0;
        const bool valid = j0 + lane < keys && sees(c, i, j);
        const A score =
            valid ? scale * row_dot<T, A>(p.q, q_row, p.k, k_base + j * p.k.row_stride, c.d)
                  : kNegInf;
        const A new_max = max_of(row_max, warp_max(score));
        if (new_max == kNegInf) continue;             // every score -inf: only from infinite inputs
        const A rescale = exp_of(row_max - new_max);  // 0 for the first tile
        const A prob = valid ? exp_of(score - new_max) : A(0);
        row_sum = row_sum * rescale + warp_sum(prob);  // the denominator ignores dropout
        const A weight = valid ? prob * dropout_factor<A>(c, drop_base, i, j) : A(0);
#pragma unroll
        for (int t = 0; t < kSlots; ++t) acc[t] *= rescale;
        add_weighted_rows<T, A>(acc, weight, j, keys - j0, p.v, v_base, col0, c.d);
        row_max = new_max;
      }
      // A row that sees no key gives 0 and lse -inf, never 0/0.
      const A inv = row_sum > A(0) ? A(1) / row_sum : A(0);
#pragma unroll
      for (int t = 0; t < kSlots; ++t) {
        const int64_t col = col0 + t * kWarp;
        if (col < c.d) store<T, A>(p.out, out_row + col * p.out.col_stride, acc[t] * inv);
      }
      if (pass == 0 && lane == 0 && p.lse.data != nullptr) {
        store_statistic(p.lse, row_offset(p.lse, c, b, i),
                        row_sum > A(0) ? static_cast<double>(row_max + log_of(row_sum))
                                       : -std::numeric_limits<double>::infinity());
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Backward. With P = exp(s - lse), the dropout factor f and dp = f * (grad_out . v):
//   dS = P * (dp - delta), grad_q += scale * dS k, grad_k += scale * dS^T q,
//   grad_v += (P f)^T grad_out.

// delta = grad_out . out - grad_lse, one warp per row.
template <class T>
__global__ void __launch_bounds__(kThreads) delta_kernel(const BackwardParams p) {
  using A = Accum<T>;
  const Call& c = p.call;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  for (int64_t row = first_warp(); row < c.batch * c.lq; row += warp_count()) {
    const int64_t b = row / c.lq, i = row - b * c.lq;
    const int64_t out_row = row_offset(p.out, c, b, i), g_row = row_offset(p.grad_out, c, b, i);
    A sum = 0;
    for (int64_t col = lane; col < c.d; col += kWarp) {
      sum += load<T, A>(p.grad_out, g_row + col * p.grad_out.col_stride) *
             load<T, A>(p.out, out_row + col * p.out.col_stride);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      if (p.grad_lse.data != nullptr) {
        sum -= static_cast<A>(load_statistic(p.grad_lse, row_offset(p.grad_lse, c, b, i)));
      }
      static_cast<A*>(p.delta)[row] = sum;
    }
  }
}

template <class A>
__device__ __forceinline__ A row_lse(const BackwardParams& p, int64_t b, int64_t i) {
  return static_cast<A>(load_statistic(p.lse, row_offset(p.lse, p.call, b, i)));
}

// Adds scale * acc (kSlots columns per lane from col0) to a gradient row.
template <class T, class A>
__device__ __forceinline__ void add_to_row(const Operand& grad, int64_t row, int64_t col0,
                                           int64_t d, A scale, const A (&acc)[kSlots]) {
#pragma unroll
  for (int t = 0; t < kSlots; ++t) {
    const int64_t col = col0 + t * kWarp;
    if (col < d) {
      const int64_t offset = row + col * grad.col_stride;
      store<T, A>(grad, offset, load<T, A>(grad, offset) + scale * acc[t]);
    }
  }
}

// grad_q, one warp per query row: its visible keys 32 at a time, one per lane.
template <class T>
__global__ void __launch_bounds__(kThreads) grad_q_kernel(const BackwardParams p, int64_t passes) {
  using A = Accum<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const Call& c = p.call;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const A scale = static_cast<A>(c.scale);
  for (int64_t row = first_warp(); row < c.batch * c.lq; row += warp_count()) {
    const int64_t b = row / c.lq, i = row - b * c.lq;
    const A lse = row_lse<A>(p, b, i), delta = static_cast<const A*>(p.delta)[row];
    if (lse == kNegInf) continue;  // the row saw no key anywhere: no gradient
    const int64_t q_row = row_offset(p.q, c, b, i), g_row = row_offset(p.grad_out, c, b, i);
    const int64_t k_base = row_offset(p.k, c, b, 0), v_base = row_offset(p.v, c, b, 0);
    const uint64_t drop_base = c.dropout ? dropout_base(c, b) : 0;
    const int64_t keys = visit_end(c, i);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t col0 = pass * kPassColumns + lane;
      A acc[kSlots];
#pragma unroll
      for (int t = 0; t < kSlots; ++t) acc[t] = 0;
      for (int64_t j0 = 0; j0 < keys; j0 += kWarp) {
        const int64_t j = j0 + lane < keys ? key_at(c, j0 + lane) : 0;
        A ds = 0;
        if (j0 + lane < keys && sees(c, i, j)) {
          const A s = scale * row_dot<T, A>(p.q, q_row, p.k, k_base + j * p.k.row_stride, c.d);
          const A prob = exp_of(s - lse);
          const A f = dropout_factor<A>(c, drop_base, i, j);
          const A dp = f == A(0) ? A(0)
                                 : f * row_dot<T, A>(p.grad_out, g_row, p.v,
                                                     v_base + j * p.v.row_stride, c.d);
          ds = prob * (dp - delta);
        }
        add_weighted_rows<T, A>(acc, ds, j, keys - j0, p.k, k_base, col0, c.d);
      }
      add_to_row<T, A>(p.grad_q, row_offset(p.grad_q, c, b, i), col0, c.d, scale, acc);
    }
  }
}

// grad_k and grad_v, one warp per key row: the queries that see it 32 at a time, one per
// lane.
template <class T>
__global__ void __launch_bounds__(kThreads) grad_kv_kernel(const BackwardParams p, int64_t passes) {
  using A = Accum<T>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const Call& c = p.call;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const A scale = static_cast<A>(c.scale);
  for (int64_t row = first_warp(); row < c.batch * c.lk; row += warp_count()) {
    const int64_t b = row / c.lk, j = row - b * c.lk;
    const int64_t k_row = row_offset(p.k, c, b, j), v_row = row_offset(p.v, c, b, j);
    const int64_t q_base = row_offset(p.q, c, b, 0), g_base = row_offset(p.grad_out, c, b, 0);
    const uint64_t drop_base = c.dropout ? dropout_base(c, b) : 0;
    const int64_t first = first_query_for(c, j);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t col0 = pass * kPassColumns + lane;
      A acc_k[kSlots], acc_v[kSlots];
#pragma unroll
      for (int t = 0; t < kSlots; ++t) acc_k[t] = acc_v[t] = 0;
      for (int64_t i0 = first; i0 < c.lq; i0 += kWarp) {
        const int64_t i = i0 + lane;
        A ds = 0, kept = 0;
        if (i < c.lq) {
          const A lse = row_lse<A>(p, b, i);
          if (lse != kNegInf) {
            const A delta = static_cast<const A*>(p.delta)[b * c.lq + i];
            const A s = scale * row_dot<T, A>(p.q, q_base + i * p.q.row_stride, p.k, k_row, c.d);
            const A prob = exp_of(s - lse);
            const A f = dropout_factor<A>(c, drop_base, i, j);
            const A dp = f == A(0)
                             ? A(0)
                             : f * row_dot<T, A>(p.grad_out, g_base + i * p.grad_out.row_stride,
                                                 p.v, v_row, c.d);
            ds = prob * (dp - delta);
            kept = prob * f;
          }
        }
        const int n = c.lq - i0 < kWarp ? static_cast<int>(c.lq - i0) : kWarp;
        for (int ii = 0; ii < n; ++ii) {
          const A wk = __shfl_sync(kFullMask, ds, ii);
          const A wv = __shfl_sync(kFullMask, kept, ii);
          if (wk == A(0) && wv == A(0)) continue;
          const int64_t q_row = q_base + (i0 + ii) * p.q.row_stride;
          const int64_t g_row = g_base + (i0 + ii) * p.grad_out.row_stride;
#pragma unroll
          for (int t = 0; t < kSlots; ++t) {
            const int64_t col = col0 + t * kWarp;
            if (col < c.d) {
              acc_k[t] += wk * load<T, A>(p.q, q_row + col * p.q.col_stride);
              acc_v[t] += wv * load<T, A>(p.grad_out, g_row + col * p.grad_out.col_stride);
            }
          }
        }
      }
      add_to_row<T, A>(p.grad_k, row_offset(p.grad_k, c, b, j), col0, c.d, scale, acc_k);
      add_to_row<T, A>(p.grad_v, row_offset(p.grad_v, c, b, j), col0, c.d, A(1), acc_v);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

Operand operand_of(const StridedView& v, int batch_dims) {
  Operand o;
  o.data = v.data;
  o.f32 = v.dtype == DType::kFloat32;
  if (v.data == nullptr) return o;
  for (int d = 0; d < batch_dims; ++d) o.batch_strides[d] = v.strides[d];
  o.row_stride = v.strides[batch_dims];
  o.col_stride = batch_dims + 1 < v.ndim ? v.strides[batch_dims + 1] : 0;
  return o;
}

Call call_of(const StridedView& q, const StridedView& k, const AttentionParams& params) {
  Call c;
  c.batch_dims = q.ndim - 2;
  for (int d = 0; d < c.batch_dims; ++d) {
    c.batch_sizes[d] = q.shape[d];
    c.batch *= q.shape[d];
  }
  c.lq = q.shape[q.ndim - 2];
  c.lk = k.shape[k.ndim - 2];
  c.d = q.shape[q.ndim - 1];
  c.scale = params.scale;
  c.causal = params.causal;
  c.causal_offset = std::clamp<int64_t>(params.causal_offset, -(c.lq + 1), c.lk);
  c.dropout = params.dropout > 0;
  c.keep_probability = 1 - params.dropout;
  c.keep_scale = 1 / (1 - params.dropout);
  c.seed = params.seed;
  c.offset = params.offset;
  c.numbering =
      resolve_dropout_indexing(params.dropout_indexing, c.batch_sizes, c.batch_dims, c.lq, c.lk);
  c.key_order = params.key_order;
  return c;
}

// Forward or backward params with the call and the operands both read (q, k, v, out, lse)
// set from `args`, an AttentionForwardArgs or AttentionBackwardArgs.
template <class Params, class Args>
Params params_with_inputs(const Args& args) {
  Params p;
  p.call = call_of(args.q, args.k, args.params);
  const int dims = p.call.batch_dims;
  p.q = operand_of(args.q, dims);
  p.k = operand_of(args.k, dims);
  p.v = operand_of(args.v, dims);
  p.out = operand_of(args.out, dims);
  p.lse = operand_of(args.lse, dims);
  return p;
}

unsigned blocks_for_rows(int64_t rows) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kMaxBlocks));
}

}  // namespace

void attention_math_forward(const AttentionForwardArgs& args, cudaStream_t stream) {
  check_attention_forward_args(args);
  const auto p = params_with_inputs<ForwardParams>(args);
  const int64_t rows = p.call.batch * p.call.lq;
  if (rows == 0) return;
  dispatch_floating(args.q.dtype, "attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_kernel<T><<<blocks_for_rows(rows), kThreads, 0, stream>>>(p, passes_for(p.call.d));
    RD_CUDA_CHECK_LAUNCH();
  });
}

void attention_math_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                             cudaStream_t stream) {
  check_attention_backward_args(args);
  auto p = params_with_inputs<BackwardParams>(args);
  const int dims = p.call.batch_dims;
  p.grad_out = operand_of(args.grad_out, dims);
  p.grad_lse = operand_of(args.grad_lse, dims);
  p.grad_q = operand_of(args.grad_q, dims);
  p.grad_k = operand_of(args.grad_k, dims);
  p.grad_v = operand_of(args.grad_v, dims);
  const int64_t query_rows = p.call.batch * p.call.lq, key_rows = p.call.batch * p.call.lk;
  if (query_rows == 0 || key_rows == 0) return;  // no (query, key) pair: no gradient
  const int64_t passes = passes_for(p.call.d);
  dispatch_floating(args.q.dtype, "attention_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const ScratchBuffer delta(scratch, static_cast<size_t>(query_rows) * sizeof(Accum<T>));
    p.delta = delta.get();
    delta_kernel<T><<<blocks_for_rows(query_rows), kThreads, 0, stream>>>(p);
    RD_CUDA_CHECK_LAUNCH();
    grad_q_kernel<T><<<blocks_for_rows(query_rows), kThreads, 0, stream>>>(p, passes);
    RD_CUDA_CHECK_LAUNCH();
    grad_kv_kernel<T><<<blocks_for_rows(key_rows), kThreads, 0, stream>>>(p, passes);
    RD_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace rd::kernels::cuda
