// CPU row-wise fused ops on contiguous [rows, cols] data: softmax / log-softmax, layer and
// RMS norm (optionally fused with a residual add), and their backward passes. Rows run in
// parallel; each row is computed in float32 (float64 for float64 data) with cascade sums.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/cpu/strided_iter.h"
#include "ringdilated/kernels/cpu/summation.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {
namespace {

// Loads element j of a row of T in the compute type.
template <class T>
Compute<T> at(const void* row, int64_t j) {
  return static_cast<Compute<T>>(static_cast<const T*>(row)[j]);
}

template <class T>
void softmax_rows(const SoftmaxArgs& a) {
  using A = Compute<T>;
  const int64_t cols = a.cols;
  const bool log = a.log;
  parallel_items(a.rows, cols, [&](int64_t r) {
    const T* x = static_cast<const T*>(a.in) + r * cols;
    T* y = static_cast<T*>(a.out) + r * cols;
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, at<T>(x, j));
    Summer<A> sum;
    // Full-precision outputs hold exp(x - m) until scaled; 16-bit ones recompute it.
    constexpr bool kKeepExp = std::is_same_v<T, A>;
    sum.add_many(cols, [&](int64_t j) {
      A e = std::exp(at<T>(x, j) - m);
      if constexpr (kKeepExp) {
        if (!log) y[j] = e;
      }
      return e;
    });
    if (log) {
      A shift = m + std::log(sum.value());
      for (int64_t j = 0; j < cols; ++j) y[j] = static_cast<T>(at<T>(x, j) - shift);
    } else {
      A inv = A(1) / sum.value();
      for (int64_t j = 0; j < cols; ++j) {
        if constexpr (kKeepExp) {
          y[j] *= inv;
        } else {
          y[j] = static_cast<T>(std::exp(at<T>(x, j) - m) * inv);
        }
      }
    }
  });
}

template <class T>
void softmax_backward_rows(const SoftmaxBackwardArgs& a) {
  using A = Compute<T>;
  const int64_t cols = a.cols;
  const bool log = a.log;
  parallel_items(a.rows, cols, [&](int64_t r) {
    const T* g = static_cast<const T*>(a.grad_out) + r * cols;
    const T* y = static_cast<const T*>(a.out) + r * cols;
    T* gi = static_cast<T*>(a.grad_in) + r * cols;
    Summer<A> sum;
    if (log) {  // y is log-softmax: grad = g - softmax * sum(g)
      sum.add_many(cols, [&](int64_t j) { return at<T>(g, j); });
      A s = sum.value();
      for (int64_t j = 0; j < cols; ++j) {
        gi[j] = static_cast<T>(at<T>(g, j) - std::exp(at<T>(y, j)) * s);
      }
    } else {  // grad = y * (g - sum(g * y))
      sum.add_many(cols, [&](int64_t j) { return at<T>(g, j) * at<T>(y, j); });
      A dot = sum.value();
      for (int64_t j = 0; j < cols; ++j) gi[j] = static_cast<T>(at<T>(y, j) * (at<T>(g, j) - dot));
    }
  });
}

template <class T>
void norm_rows(const NormArgs& a) {
  using A = Compute<T>;
  const int64_t cols = a.cols;
  parallel_items(a.rows, cols, [&](int64_t r) {
    const T* x = static_cast<const T*>(a.in) + r * cols;
    T* y = static_cast<T*>(a.out) + r * cols;
    if (a.residual != nullptr) {
      // The row normalized is the sum as stored (rounded to T): what the caller keeps and
      // the backward pass reads. Each element is read before it is written, so `sum` may
      // alias `in` or `residual`.
      const T* res = static_cast<const T*>(a.residual) + r * cols;
      T* sum = static_cast<T*>(a.sum) + r * cols;
      for (int64_t j = 0; j < cols; ++j) sum[j] = static_cast<T>(at<T>(x, j) + at<T>(res, j));
      x = sum;
    }
    A mu = 0;
    if (!a.rms) {
      Summer<A> sum;
      sum.add_many(cols, [&](int64_t j) { return at<T>(x, j); });
      mu = sum.value() / static_cast<A>(cols);
    }
    Summer<A> sq;  // two-pass variance: no cancellation from E[x^2] - E[x]^2
    sq.add_many(cols, [&](int64_t j) {
      A d = at<T>(x, j) - mu;
      return d * d;
    });
    A rstd = A(1) / std::sqrt(sq.value() / static_cast<A>(cols) + static_cast<A>(a.eps));
    if (a.mean && !a.rms) a.mean[r] = static_cast<float>(mu);
    if (a.rstd) a.rstd[r] = static_cast<float>(rstd);
    for (int64_t j = 0; j < cols; ++j) {
      A v = (at<T>(x, j) - mu) * rstd;
      if (a.weight) v *= at<T>(a.weight, j);
      if (a.bias) v += at<T>(a.bias, j);
      y[j] = static_cast<T>(v);
    }
  });
}

// Row blocks for the weight/bias gradient sums: a count fixed by the shape alone, so the
// per-block partial sums (and their in-order total) do not depend on the thread count.
constexpr int64_t kMaxRowBlocks = 64;

template <class T>
void norm_backward_rows(const NormBackwardArgs& a) {
  using A = Compute<T>;
  const int64_t rows = a.rows, cols = a.cols;
  T* grad_in = static_cast<T*>(a.grad_in);
  const T* grad_out = static_cast<const T*>(a.grad_out);
  const T* in = static_cast<const T*>(a.in);
  const bool param_grads = a.grad_weight || a.grad_bias;
  const int64_t blocks = std::clamp<int64_t>((rows * cols + kGrain - 1) / kGrain, 1,
                                             std::min(kMaxRowBlocks, std::max<int64_t>(rows, 1)));
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  // Partials in double: cheap here, and keeps long column sums accurate.
  std::vector<double> dw(param_grads && a.grad_weight ? blocks * cols : 0);
  std::vector<double> db(param_grads && a.grad_bias ? blocks * cols : 0);
  parallel_items(blocks, rows_per_block * cols, [&](int64_t block) {
    double* dw_block = dw.empty() ? nullptr : dw.data() + block * cols;
    double* db_block = db.empty() ? nullptr : db.data() + block * cols;
    const int64_t end = std::min(rows, (block + 1) * rows_per_block);
    for (int64_t r = block * rows_per_block; r < end; ++r) {
      const T* x = in + r * cols;
      const T* go = grad_out + r * cols;
      const A mu = a.rms ? A(0) : static_cast<A>(a.mean[r]);
      const A rstd = static_cast<A>(a.rstd[r]);
      auto xhat = [&](int64_t j) { return (at<T>(x, j) - mu) * rstd; };
      auto g = [&](int64_t j) {
        return a.weight ? at<T>(go, j) * at<T>(a.weight, j) : at<T>(go, j);
      };
      if (dw_block || db_block) {
        for (int64_t j = 0; j < cols; ++j) {
          if (dw_block) dw_block[j] += static_cast<double>(at<T>(go, j) * xhat(j));
          if (db_block) db_block[j] += static_cast<double>(at<T>(go, j));
        }
      }
      if (!grad_in) continue;
      Summer<A> g_xhat, g_sum;
      for (int64_t j = 0; j < cols; ++j) {
        g_xhat.add(g(j) * xhat(j));
        if (!a.rms) g_sum.add(g(j));
      }
      const A c1 = g_xhat.value() / static_cast<A>(cols);
      const A c2 = a.rms ? A(0) : g_sum.value() / static_cast<A>(cols);
      T* gi = grad_in + r * cols;
      const T* gs = a.grad_sum ? static_cast<const T*>(a.grad_sum) + r * cols : nullptr;
      for (int64_t j = 0; j < cols; ++j) {
        A v = rstd * (g(j) - c2 - xhat(j) * c1);
        if (gs) v += at<T>(gs, j);
        gi[j] = static_cast<T>(v);
      }
    }
  });
  auto total = [&](const std::vector<double>& partial, float* dst) {
    if (!dst) return;
    parallel_items(cols, blocks, [&](int64_t j) {
      double s = 0;
      for (int64_t block = 0; block < blocks; ++block) s += partial[block * cols + j];
      dst[j] = static_cast<float>(s);
    });
  };
  total(dw, a.grad_weight);
  total(db, a.grad_bias);
}

}  // namespace

void CpuBackend::softmax(const SoftmaxArgs& args) {
  check_softmax_args(args);
  dispatch_floating(args.dtype, "softmax", [&](auto tag) {
    softmax_rows<typename decltype(tag)::type>(args);
  });
}

void CpuBackend::softmax_backward(const SoftmaxBackwardArgs& args) {
  check_softmax_backward_args(args);
  dispatch_floating(args.dtype, "softmax_backward", [&](auto tag) {
    softmax_backward_rows<typename decltype(tag)::type>(args);
  });
}

void CpuBackend::norm(const NormArgs& args) {
  check_norm_args(args);
  dispatch_floating(args.dtype, "norm", [&](auto tag) {
    norm_rows<typename decltype(tag)::type>(args);
  });
}

void CpuBackend::norm_backward(const NormBackwardArgs& args) {
  check_norm_backward_args(args);
  dispatch_floating(args.dtype, "norm_backward", [&](auto tag) {
    norm_backward_rows<typename decltype(tag)::type>(args);
  });
}

}  // namespace rd::kernels::cpu
