// CPU reference attention (kernels/cpu/attention.h). A task owns a (batch, block of rows)
// and loads its rows, then one tile of keys at a time, into float32 (float64 for float64
// data) buffers, so the inner loops run on contiguous memory whatever the views' strides and
// dtypes, and memory stays O(rows * D).
#include "ringdilated/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ringdilated/kernels/attention_dropout.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/dtype_dispatch.h"

namespace rd::kernels::cpu {
namespace {

// lse and grad_lse are float32, or float64 for float64 inputs (kernels/attention.h).
double load_statistic(const void* data, DType dtype, int64_t index) {
  return dtype == DType::kFloat64 ? static_cast<const double*>(data)[index]
                                  : static_cast<const float*>(data)[index];
}

void store_statistic(void* data, DType dtype, int64_t index, double value) {
  if (dtype == DType::kFloat64) {
    static_cast<double*>(data)[index] = value;
  } else {
    static_cast<float*>(data)[index] = static_cast<float>(value);
  }
}

constexpr int64_t kQueryBlock = 32;  // query rows per task
constexpr int64_t kKeyBlock = 64;    // keys per tile, and key rows per task of the key pass

template <class A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// One batch's [rows, cols] matrix inside a view (strides in elements). With a row_order,
// row r of the matrix is stored row row_order[r] (the keys of an ordered visit).
struct Matrix {
  char* data = nullptr;
  int64_t row_stride = 0, col_stride = 0;
  const int64_t* row_order = nullptr;

  int64_t row_offset(int64_t r) const { return (row_order ? row_order[r] : r) * row_stride; }
};

// The matrix of flattened batch b of v: the batch dims are its first `batch_dims`, in
// row-major order; rows are the next dim and columns the one after (absent for lse).
Matrix batch_matrix(const StridedView& v, int batch_dims, int64_t b) {
  if (v.data == nullptr) return {};
  int64_t offset = 0;
  for (int d = batch_dims - 1; d >= 0; --d) {
    offset += (b % v.shape[d]) * v.strides[d];
    b /= v.shape[d];
  }
  Matrix m;
  m.data = static_cast<char*>(v.data) + offset * static_cast<int64_t>(dtype_size(v.dtype));
  m.row_stride = v.strides[batch_dims];
  m.col_stride = batch_dims + 1 < v.ndim ? v.strides[batch_dims + 1] : 0;
  return m;
}

// Copies rows [row0, row0 + rows) of m, stored as T, into dst as a row-major [rows, cols]
// array of A.
template <class A, class T>
void load_typed(A* dst, const Matrix& m, int64_t row0, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = reinterpret_cast<const T*>(m.data) + m.row_offset(row0 + r);
    A* row = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) row[c] = convert<A>(src[c * m.col_stride]);
  }
}

// As load_typed, transposed: dst is a row-major [cols, rows] array.
template <class A, class T>
void load_transposed_typed(A* dst, const Matrix& m, int64_t row0, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = reinterpret_cast<const T*>(m.data) + m.row_offset(row0 + r);
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = convert<A>(src[c * m.col_stride]);
  }
}

// Writes factor * src ([rows, cols], row-major) to rows [row0, row0 + rows) of m, or adds it
// to what is there when `accumulate`.
template <class A, class T>
void store_typed(const Matrix& m, int64_t row0, int64_t rows, int64_t cols, const A* src, A factor,
                 bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = reinterpret_cast<T*>(m.data) + m.row_offset(row0 + r);
    const A* row = src + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      T& element = dst[c * m.col_stride];
      const A value = factor * row[c];
      element = convert<T>(accumulate ? convert<A>(element) + value : value);
    }
  }
}

// A [batch..., rows, D] view with its load and store resolved for its dtype once, before
// the parallel loop (where nothing may throw).
template <class A>
struct Operand {
  using Load = void (*)(A*, const Matrix&, int64_t, int64_t, int64_t);
  using Store = void (*)(const Matrix&, int64_t, int64_t, int64_t, const A*, A, bool);

  const StridedView* view = nullptr;
  int batch_dims = 0;
  Load load = nullptr;
  Load load_transposed = nullptr;
  Store store = nullptr;

  Operand() = default;
  Operand(const StridedView& v, int dims) : view(&v), batch_dims(dims) {
    dispatch_floating(v.dtype, "attention", [&](auto tag) {
      using T = typename decltype(tag)::type;
      load = &load_typed<A, T>;
      load_transposed = &load_transposed_typed<A, T>;
      store = &store_typed<A, T>;
    });
  }
  Matrix at(int64_t b) const { return batch_matrix(*view, batch_dims, b); }
};

struct Geometry {
  int batch_dims = 0;
  int64_t batch_shape[kMaxDropoutBatchDims] = {};
  int64_t batch = 1, lq = 0, lk = 0, d = 0;
};

Geometry geometry_of(const StridedView& q, const StridedView& k) {
  Geometry g;
  g.batch_dims = q.ndim - 2;
  for (int d = 0; d < g.batch_dims; ++d) {
    g.batch_shape[d] = q.shape[d];
    g.batch *= q.shape[d];
  }
  g.lq = q.shape[q.ndim - 2];
  g.lk = k.shape[k.ndim - 2];
  g.d = q.shape[q.ndim - 1];
  return g;
}

// Which keys each query sees (causal mask), the order it visits them in, and the dropout
// factor of each (query, key). Keys are visited in steps t = 0, 1, ...: step t is key
// key_at(t). In the natural order a row's visible keys are a prefix of the steps; with a
// key_order they are not, so every step is visited and checked with sees().
template <class A>
struct Mask {
  bool causal = false;
  int64_t offset = 0;  // causal_offset clamped to [-(lq + 1), lk]: same mask, no overflow
  int64_t lq = 0, lk = 0;
  bool dropout = false;
  double keep_probability = 1;
  A keep_scale = 1;
  uint64_t seed = 0, stream_offset = 0;
  DropoutIndexing numbering;  // resolved: always in the affine form
  Geometry geometry;
  const int64_t* key_order = nullptr;

  Mask(const AttentionParams& p, const Geometry& g)
      : causal(p.causal),
        offset(std::clamp<int64_t>(p.causal_offset, -(g.lq + 1), g.lk)),
        lq(g.lq),
        lk(g.lk),
        dropout(p.dropout > 0),
        keep_probability(1 - p.dropout),
        keep_scale(static_cast<A>(1 / (1 - p.dropout))),
        seed(p.seed),
        stream_offset(p.offset),
        numbering(
            resolve_dropout_indexing(p.dropout_indexing, g.batch_shape, g.batch_dims, g.lq, g.lk)),
        geometry(g),
        key_order(p.key_order) {}

  // Query i sees keys [0, keys_for(i)).
  int64_t keys_for(int64_t i) const {
    return causal ? std::clamp<int64_t>(i + offset + 1, 0, lk) : lk;
  }
  // Row i may see keys among the steps [0, visit_end(i)).
  int64_t visit_end(int64_t i) const { return key_order != nullptr ? lk : keys_for(i); }
  int64_t key_at(int64_t step) const { return key_order != nullptr ? key_order[step] : step; }
  bool sees(int64_t i, int64_t j) const { return !causal || j <= i + offset; }
  // Key j is seen by queries [first_query_for(j), lq).
  int64_t first_query_for(int64_t j) const {
    return causal ? std::clamp<int64_t>(j - offset, 0, lq) : 0;
  }
  // The dropout number of element (b, 0, 0): what factor() takes, once per batch.
  uint64_t batch_base(int64_t b) const {
    return dropout_batch_base(numbering, geometry.batch_shape, geometry.batch_dims, b);
  }
  // What p[i, j] of the batch whose batch_base() is `base` is multiplied by: 1 without
  // dropout, else 0 for a dropped element and 1 / (1 - dropout) for a kept one (the mask of
  // kernels/attention.h).
  A factor(uint64_t base, int64_t i, int64_t j) const {
    if (!dropout) return A(1);
    const uint64_t element = dropout_element(numbering, base, i, j);
    return attention_keeps(seed, stream_offset, keep_probability, element) ? keep_scale : A(0);
  }
};

// m with its rows in the mask's key visiting order.
template <class A>
Matrix ordered(Matrix m, const Mask<A>& mask) {
  m.row_order = mask.key_order;
  return m;
}

template <class A>
A dot(const A* x, const A* y, int64_t n) {
  A sum = 0;
  for (int64_t c = 0; c < n; ++c) sum += x[c] * y[c];
  return sum;
}

// out[j] = x . y_j for j < n, with the rows y_j stored transposed (yt is [d, pitch]). Each
// dot is summed in column order like dot(), but the inner loop runs over j and vectorizes.
template <class A>
void tile_dots(const A* x, const A* yt, int64_t pitch, int64_t n, int64_t d, A* out) {
  std::fill(out, out + n, A(0));
  for (int64_t c = 0; c < d; ++c) {
    const A xc = x[c];
    const A* row = yt + c * pitch;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += xc * row[j];
  }
}

// y += a * x. (`omp simd`: -O2 alone leaves loops of unknown length scalar.)
template <class A>
void axpy(A* y, A a, const A* x, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

// ---------------------------------------------------------------------------------------
// Forward.

// What the forward and the backward both take from their arguments: the shapes, the views
// both read (q, k, v, out, lse), the scale and the mask. The forward needs nothing more.
template <class A>
struct ForwardPlan {
  Geometry g;
  Operand<A> q, k, v, out;
  const StridedView* lse = nullptr;
  A scale = 1;
  Mask<A> mask;

  template <class Args>  // AttentionForwardArgs or AttentionBackwardArgs
  explicit ForwardPlan(const Args& args)
      : g(geometry_of(args.q, args.k)),
        q(args.q, g.batch_dims),
        k(args.k, g.batch_dims),
        v(args.v, g.batch_dims),
        out(args.out, g.batch_dims),
        lse(&args.lse),
        scale(static_cast<A>(args.params.scale)),
        mask(args.params, g) {}
};

// A task's query rows [i0, i0 + rows) of batch b and the keys they visit, as the forward and
// grad_q both walk them: k and v in the mask's visiting order, the steps [0, key_end) (the
// last row sees the most), and the batch's dropout base.
struct QueryBlock {
  int64_t rows;
  Matrix keys, values;
  uint64_t batch_base;
  int64_t key_end;
};

template <class A>
QueryBlock query_block(const ForwardPlan<A>& p, int64_t b, int64_t i0) {
  const int64_t rows = std::min(kQueryBlock, p.g.lq - i0);
  return {rows, ordered(p.k.at(b), p.mask), ordered(p.v.at(b), p.mask), p.mask.batch_base(b),
          p.mask.visit_end(i0 + rows - 1)};
}

// Rows [i0, i0 + kQueryBlock) of batch b: an online softmax over key tiles. Per row it
// keeps the running max m and sum l of exp(s - m), and the accumulator sum p v rescaled
// whenever m grows.
template <class A>
void forward_rows(const ForwardPlan<A>& p, int64_t b, int64_t i0) {
  const int64_t d = p.g.d;
  const auto [nq, km, vm, batch_base, key_end] = query_block(p, b, i0);
  std::vector<A> queries(nq * d), keys_t(kKeyBlock * d), values(kKeyBlock * d), scores(kKeyBlock);
  std::vector<A> acc(nq * d, A(0)), row_max(nq, kNegInf<A>), row_sum(nq, A(0));
  p.q.load(queries.data(), p.q.at(b), i0, nq, d);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, key_end - j0);
    p.k.load_transposed(keys_t.data(), km, j0, nk, d);
    p.v.load(values.data(), vm, j0, nk, d);
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const int64_t n = std::min(nk, p.mask.visit_end(i) - j0);
      if (n <= 0) continue;
      tile_dots(queries.data() + r * d, keys_t.data(), nk, n, d, scores.data());
      A tile_max = kNegInf<A>;
      for (int64_t jj = 0; jj < n; ++jj) {
        scores[jj] = p.mask.sees(i, p.mask.key_at(j0 + jj)) ? scores[jj] * p.scale : kNegInf<A>;
        tile_max = std::max(tile_max, scores[jj]);
      }
      const A new_max = std::max(row_max[r], tile_max);
      if (new_max == kNegInf<A>) continue;  // every score -inf: only from infinite inputs
      const A rescale = std::exp(row_max[r] - new_max);  // 0 for the first visible tile
      A* acc_row = acc.data() + r * d;
      if (rescale != A(1)) {
        for (int64_t c = 0; c < d; ++c) acc_row[c] *= rescale;
      }
      A tile_sum = 0;
      for (int64_t jj = 0; jj < n; ++jj) {
        const A prob = std::exp(scores[jj] - new_max);
        tile_sum += prob;  // the softmax denominator ignores dropout
        const A weight = prob * p.mask.factor(batch_base, i, p.mask.key_at(j0 + jj));
        if (weight != A(0)) axpy(acc_row, weight, values.data() + jj * d, d);
      }
      row_sum[r] = row_sum[r] * rescale + tile_sum;
      row_max[r] = new_max;
    }
  }
  const Matrix lse = batch_matrix(*p.lse, p.g.batch_dims, b);
  for (int64_t r = 0; r < nq; ++r) {
    // A row that sees no key gives 0 and lse -inf, never 0/0.
    const bool visible = row_sum[r] > A(0);
    const A inv = visible ? A(1) / row_sum[r] : A(0);
    for (int64_t c = 0; c < d; ++c) acc[r * d + c] *= inv;
    if (lse.data != nullptr) {
      store_statistic(lse.data, p.lse->dtype, (i0 + r) * lse.row_stride,
                      visible ? static_cast<double>(row_max[r] + std::log(row_sum[r]))
                              : -std::numeric_limits<double>::infinity());
    }
  }
  p.out.store(p.out.at(b), i0, nq, d, acc.data(), A(1), /*accumulate=*/false);
}

template <class A>
void forward(const AttentionForwardArgs& args) {
  const ForwardPlan<A> plan(args);
  const Geometry& g = plan.g;
  if (g.batch == 0 || g.lq == 0) return;
  const int64_t blocks = blocks_of(g.lq, kQueryBlock);
  parallel_items(g.batch * blocks, kQueryBlock * (g.lk + 1) * (2 * g.d + 1), [&](int64_t item) {
    forward_rows(plan, item / blocks, (item % blocks) * kQueryBlock);
  });
}

// ---------------------------------------------------------------------------------------
// Backward. With P = exp(s - lse), the dropout factor f and dp = f * (grad_out . v):
//   dS = P * (dp - delta), delta = grad_out . out - grad_lse,
//   grad_q += scale * dS k, grad_k += scale * dS^T q, grad_v += (P f)^T grad_out.
// Three passes: delta per row, grad_q over query blocks, grad_k/grad_v over key blocks
// (each task loops over every query that sees its keys), recomputing P in each.

// The forward's plan, plus the gradients and the per-row statistics of the first pass.
template <class A>
struct BackwardPlan : ForwardPlan<A> {
  Operand<A> grad_out, grad_q, grad_k, grad_v;
  const StridedView* grad_lse = nullptr;
  std::vector<A> row_lse, row_delta;  // per (b, i): O(rows) memory

  explicit BackwardPlan(const AttentionBackwardArgs& args)
      : ForwardPlan<A>(args),
        grad_out(args.grad_out, this->g.batch_dims),
        grad_q(args.grad_q, this->g.batch_dims),
        grad_k(args.grad_k, this->g.batch_dims),
        grad_v(args.grad_v, this->g.batch_dims),
        grad_lse(&args.grad_lse),
        row_lse(this->g.batch * this->g.lq),
        row_delta(this->g.batch * this->g.lq) {}
};

template <class A>
void row_statistics(BackwardPlan<A>& p, int64_t b, int64_t i0) {
  const int64_t d = p.g.d;
  const int64_t nq = std::min(kQueryBlock, p.g.lq - i0);
  std::vector<A> out(nq * d), grad_out(nq * d);
  p.out.load(out.data(), p.out.at(b), i0, nq, d);
  p.grad_out.load(grad_out.data(), p.grad_out.at(b), i0, nq, d);
  const Matrix lse = batch_matrix(*p.lse, p.g.batch_dims, b);
  const Matrix grad_lse = batch_matrix(*p.grad_lse, p.g.batch_dims, b);
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = i0 + r, row = b * p.g.lq + i;
    p.row_lse[row] = static_cast<A>(load_statistic(lse.data, p.lse->dtype, i * lse.row_stride));
    A delta = dot(grad_out.data() + r * d, out.data() + r * d, d);
    if (grad_lse.data != nullptr) {
      delta -=
          static_cast<A>(load_statistic(grad_lse.data, p.grad_lse->dtype, i * grad_lse.row_stride));
    }
    p.row_delta[row] = delta;
  }
}

template <class A>
void grad_q_rows(const BackwardPlan<A>& p, int64_t b, int64_t i0) {
  const int64_t d = p.g.d;
  const auto [nq, km, vm, batch_base, key_end] = query_block(p, b, i0);
  std::vector<A> queries(nq * d), grad_out(nq * d), keys(kKeyBlock * d), keys_t(kKeyBlock * d);
  std::vector<A> values_t(kKeyBlock * d), scores(kKeyBlock), dp(kKeyBlock), dq(nq * d, A(0));
  p.q.load(queries.data(), p.q.at(b), i0, nq, d);
  p.grad_out.load(grad_out.data(), p.grad_out.at(b), i0, nq, d);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, key_end - j0);
    p.k.load(keys.data(), km, j0, nk, d);
    p.k.load_transposed(keys_t.data(), km, j0, nk, d);
    p.v.load_transposed(values_t.data(), vm, j0, nk, d);
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r, row = b * p.g.lq + i;
      const A lse = p.row_lse[row], delta = p.row_delta[row];
      const int64_t n = std::min(nk, p.mask.visit_end(i) - j0);
      if (lse == kNegInf<A> || n <= 0) continue;  // the row saw no key anywhere: no gradient
      tile_dots(queries.data() + r * d, keys_t.data(), nk, n, d, scores.data());
      tile_dots(grad_out.data() + r * d, values_t.data(), nk, n, d, dp.data());
      for (int64_t jj = 0; jj < n; ++jj) {
        const int64_t j = p.mask.key_at(j0 + jj);
        if (!p.mask.sees(i, j)) continue;
        const A prob = std::exp(p.scale * scores[jj] - lse);
        const A ds = prob * (p.mask.factor(batch_base, i, j) * dp[jj] - delta);
        if (ds != A(0)) axpy(dq.data() + r * d, ds, keys.data() + jj * d, d);
      }
    }
  }
  p.grad_q.store(p.grad_q.at(b), i0, nq, d, dq.data(), p.scale, /*accumulate=*/true);
}

template <class A>
void grad_kv_rows(const BackwardPlan<A>& p, int64_t b, int64_t j0) {
  const int64_t d = p.g.d;
  const int64_t nk = std::min(kKeyBlock, p.g.lk - j0);
  const Matrix qm = p.q.at(b), gm = p.grad_out.at(b);
  const uint64_t batch_base = p.mask.batch_base(b);
  std::vector<A> keys_t(nk * d), values_t(nk * d), queries(kQueryBlock * d);
  std::vector<A> grad_out(kQueryBlock * d), scores(nk), dp(nk), dk(nk * d, A(0)), dv(nk * d, A(0));
  p.k.load_transposed(keys_t.data(), p.k.at(b), j0, nk, d);
  p.v.load_transposed(values_t.data(), p.v.at(b), j0, nk, d);
  for (int64_t i0 = p.mask.first_query_for(j0); i0 < p.g.lq; i0 += kQueryBlock) {
    const int64_t nq = std::min(kQueryBlock, p.g.lq - i0);
    p.q.load(queries.data(), qm, i0, nq, d);
    p.grad_out.load(grad_out.data(), gm, i0, nq, d);
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r, row = b * p.g.lq + i;
      const A lse = p.row_lse[row], delta = p.row_delta[row];
      const int64_t n = std::min(nk, p.mask.keys_for(i) - j0);
      if (lse == kNegInf<A> || n <= 0) continue;
      const A* query = queries.data() + r * d;
      const A* go = grad_out.data() + r * d;
      tile_dots(query, keys_t.data(), nk, n, d, scores.data());
      tile_dots(go, values_t.data(), nk, n, d, dp.data());
      for (int64_t jj = 0; jj < n; ++jj) {
        const A prob = std::exp(p.scale * scores[jj] - lse);
        const A f = p.mask.factor(batch_base, i, j0 + jj);
        const A ds = prob * (f * dp[jj] - delta);
        const A kept = prob * f;
        if (kept != A(0)) axpy(dv.data() + jj * d, kept, go, d);
        if (ds != A(0)) axpy(dk.data() + jj * d, ds, query, d);
      }
    }
  }
  p.grad_k.store(p.grad_k.at(b), j0, nk, d, dk.data(), p.scale, /*accumulate=*/true);
  p.grad_v.store(p.grad_v.at(b), j0, nk, d, dv.data(), A(1), /*accumulate=*/true);
}

template <class A>
void backward(const AttentionBackwardArgs& args) {
  BackwardPlan<A> plan(args);
  const Geometry& g = plan.g;
  if (g.batch == 0 || g.lq == 0 || g.lk == 0) return;  // no (query, key) pair: no gradient
  const int64_t query_blocks = blocks_of(g.lq, kQueryBlock);
  const int64_t key_blocks = blocks_of(g.lk, kKeyBlock);
  parallel_items(g.batch * query_blocks, kQueryBlock * (2 * g.d + 1), [&](int64_t item) {
    row_statistics(plan, item / query_blocks, (item % query_blocks) * kQueryBlock);
  });
  parallel_items(g.batch * query_blocks, kQueryBlock * g.lk * (3 * g.d + 1), [&](int64_t item) {
    grad_q_rows(plan, item / query_blocks, (item % query_blocks) * kQueryBlock);
  });
  parallel_items(g.batch * key_blocks, kKeyBlock * g.lq * (4 * g.d + 1), [&](int64_t item) {
    grad_kv_rows(plan, item / key_blocks, (item % key_blocks) * kKeyBlock);
  });
}

}  // namespace

void attention_forward(const AttentionForwardArgs& args) {
  check_attention_forward_args(args);
  if (accumulation_dtype(args.q.dtype) == DType::kFloat64) {
    forward<double>(args);
  } else {
    forward<float>(args);
  }
}

void attention_backward(const AttentionBackwardArgs& args) {
  check_attention_backward_args(args);
  if (accumulation_dtype(args.q.dtype) == DType::kFloat64) {
    backward<double>(args);
  } else {
    backward<float>(args);
  }
}

}  // namespace rd::kernels::cpu
