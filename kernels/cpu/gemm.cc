// CPU batched GEMM through CBLAS (OpenBLAS): float32/float64 directly, bfloat16/float16 by
// widening A, B (and C when beta != 0) to float32 scratch, sgemm, and narrowing C back; a
// product with one row or one column of C goes to gemv.
// Batch entries run one after another; OpenBLAS parallelizes each product itself, so no
// OpenMP region wraps its calls (which would oversubscribe the cores).
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/cpu/dispatch_types.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cpu {
namespace {

// A validated operand (view_checks.h), held to CBLAS's int leading dims.
StoredMatrix stored_matrix(const char* name, int64_t rows, int64_t cols, int64_t ld) {
  const StoredMatrix s = gemm_stored_matrix(name, rows, cols, ld);
  RD_CHECK(s.ld <= INT_MAX, kInvalidArgument, "gemm: argument '", name, "' is ", ld,
           ", beyond the CBLAS limit ", INT_MAX);
  return s;
}

// C = beta * C; beta == 0 writes zeros (NaN in C does not survive), as BLAS does.
template <class T>
void scale_c(const GemmArgs& g, T* c) {
  using C = Compute<T>;
  for (int64_t i = 0; i < g.m; ++i) {
    T* row = c + i * g.ldc;
    for (int64_t j = 0; j < g.n; ++j) {
      row[j] = g.beta == 0.0 ? T(C(0)) : static_cast<T>(static_cast<C>(row[j]) * C(g.beta));
    }
  }
}

// Copies a stored matrix of T into a dense float32 buffer (row stride = cols).
template <class T>
void widen(const T* src, const StoredMatrix& s, std::vector<float>& dst) {
  dst.resize(s.rows * s.cols);
  for (int64_t i = 0; i < s.rows; ++i) {
    for (int64_t j = 0; j < s.cols; ++j) {
      dst[i * s.cols + j] = static_cast<float>(src[i * s.ld + j]);
    }
  }
}

void gemv(CBLAS_TRANSPOSE trans, int64_t rows, int64_t cols, float alpha, const float* matrix,
          int64_t ld, const float* x, int64_t incx, float beta, float* y, int64_t incy) {
  cblas_sgemv(CblasRowMajor, trans, static_cast<int>(rows), static_cast<int>(cols), alpha, matrix,
              static_cast<int>(ld), x, static_cast<int>(incx), beta, y, static_cast<int>(incy));
}

void gemv(CBLAS_TRANSPOSE trans, int64_t rows, int64_t cols, double alpha, const double* matrix,
          int64_t ld, const double* x, int64_t incx, double beta, double* y, int64_t incy) {
  cblas_dgemv(CblasRowMajor, trans, static_cast<int>(rows), static_cast<int>(cols), alpha, matrix,
              static_cast<int>(ld), x, static_cast<int>(incx), beta, y, static_cast<int>(incy));
}

// A product with one row or one column of C as a matrix-vector product. OpenBLAS's gemm packs
// all of B even for one row of A: [1, 768] x [768, 2304] took 240 us through sgemm against
// 40 us through sgemv on 2 cores, which made decoding one token at a time crawl on the CPU.
template <class T>
void matrix_vector(const GemmArgs& g, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                   int64_t ldc, T beta) {
  const int64_t length = g.m == 1 ? g.n : g.m, incy = g.m == 1 ? 1 : ldc;
  // gemv scales y by beta; beta == 0 must not read C (NaN there does not survive).
  if (beta == T(0)) {
    for (int64_t i = 0; i < length; ++i) c[i * incy] = T(0);
  }
  const T alpha = static_cast<T>(g.alpha);
  if (g.m == 1) {  // C's row = A's row (x) times op(B)
    const int64_t incx = g.trans_a ? lda : 1;
    if (g.trans_b) {  // B stored [n, k]: y = B x
      gemv(CblasNoTrans, g.n, g.k, alpha, b, ldb, a, incx, beta, c, incy);
    } else {  // B stored [k, n]: y = B^T x
      gemv(CblasTrans, g.k, g.n, alpha, b, ldb, a, incx, beta, c, incy);
    }
    return;
  }
  // C's column = op(A) times B's column (x).
  const int64_t incx = g.trans_b ? 1 : ldb;
  if (g.trans_a) {  // A stored [k, m]
    gemv(CblasTrans, g.k, g.m, alpha, a, lda, b, incx, beta, c, incy);
  } else {  // A stored [m, k]
    gemv(CblasNoTrans, g.m, g.k, alpha, a, lda, b, incx, beta, c, incy);
  }
}

void blas(const GemmArgs& g, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc, float beta) {
  if (g.m == 1 || g.n == 1) return matrix_vector(g, a, lda, b, ldb, c, ldc, beta);
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m), static_cast<int>(g.n),
              static_cast<int>(g.k), static_cast<float>(g.alpha), a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void blas(const GemmArgs& g, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
          int64_t ldc, double beta) {
  if (g.m == 1 || g.n == 1) return matrix_vector(g, a, lda, b, ldb, c, ldc, beta);
  cblas_dgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m), static_cast<int>(g.n),
              static_cast<int>(g.k), g.alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
              beta, c, static_cast<int>(ldc));
}

// The optional epilogue: v + bias[col], then the tanh GELU, computed in float32 (float64
// for double), before the value is rounded to its storage type, as cuBLASLt does.
template <class C, class T>
C epilogue(const GemmArgs& g, C v, int64_t col) {
  if (g.bias != nullptr) v += static_cast<C>(static_cast<const T*>(g.bias)[col]);
  if (g.gelu) {
    const C k = C(0.7978845608028654);  // sqrt(2 / pi)
    v = C(0.5) * v * (C(1) + std::tanh(k * (v + C(0.044715) * v * v * v)));
  }
  return v;
}

bool has_epilogue(const GemmArgs& g) { return g.bias != nullptr || g.gelu; }

// Applies the epilogue to one batch entry of C, rows of `ld` elements.
template <class C, class T, class Elem>
void apply_epilogue(const GemmArgs& g, Elem* c, int64_t ld) {
  for (int64_t r = 0; r < g.m; ++r) {
    for (int64_t j = 0; j < g.n; ++j) {
      c[r * ld + j] = static_cast<Elem>(epilogue<C, T>(g, static_cast<C>(c[r * ld + j]), j));
    }
  }
}

template <class T>
void gemm_typed(const GemmArgs& g, const StoredMatrix& sa, const StoredMatrix& sb) {
  const T* a = static_cast<const T*>(g.a);
  const T* b = static_cast<const T*>(g.b);
  T* c = static_cast<T*>(g.c);
  using Compute = std::conditional_t<std::is_same_v<T, double>, double, float>;
  if (g.k == 0 || g.alpha == 0.0) {  // no product term; also keeps CBLAS off ld = 0
    for (int64_t i = 0; i < g.batch; ++i) {
      scale_c(g, c + i * g.stride_c);
      if (has_epilogue(g)) apply_epilogue<Compute, T>(g, c + i * g.stride_c, g.ldc);
    }
    return;
  }
  if constexpr (!kIsHalf<T>) {
    for (int64_t i = 0; i < g.batch; ++i) {
      blas(g, a + i * g.stride_a, sa.ld, b + i * g.stride_b, sb.ld, c + i * g.stride_c, g.ldc,
           static_cast<T>(g.beta));
      if (has_epilogue(g)) apply_epilogue<Compute, T>(g, c + i * g.stride_c, g.ldc);
    }
  } else {
    std::vector<float> a32, b32, c32(g.m * g.n);
    for (int64_t i = 0; i < g.batch; ++i) {
      widen(a + i * g.stride_a, sa, a32);
      widen(b + i * g.stride_b, sb, b32);
      T* ci = c + i * g.stride_c;
      for (int64_t r = 0; r < g.m; ++r) {
        for (int64_t j = 0; j < g.n; ++j) {
          c32[r * g.n + j] = g.beta == 0.0 ? 0.0f : static_cast<float>(ci[r * g.ldc + j]);
        }
      }
      blas(g, a32.data(), std::max<int64_t>(sa.cols, 1), b32.data(), std::max<int64_t>(sb.cols, 1),
           c32.data(), std::max<int64_t>(g.n, 1), static_cast<float>(g.beta));
      if (has_epilogue(g)) apply_epilogue<float, T>(g, c32.data(), g.n);
      for (int64_t r = 0; r < g.m; ++r) {
        for (int64_t j = 0; j < g.n; ++j) ci[r * g.ldc + j] = T(c32[r * g.n + j]);
      }
    }
  }
}

}  // namespace

void CpuBackend::gemm(const GemmArgs& g) {
  RD_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 0, kInvalidArgument,
           "gemm: sizes must be non-negative, got m=", g.m, " n=", g.n, " k=", g.k,
           " batch=", g.batch);
  RD_CHECK(g.m <= INT_MAX && g.n <= INT_MAX && g.k <= INT_MAX, kInvalidArgument,
           "gemm: sizes m=", g.m, " n=", g.n, " k=", g.k, " exceed the CBLAS limit ", INT_MAX);
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const StoredMatrix sa =
      g.trans_a ? stored_matrix("lda", g.k, g.m, g.lda) : stored_matrix("lda", g.m, g.k, g.lda);
  const StoredMatrix sb =
      g.trans_b ? stored_matrix("ldb", g.n, g.k, g.ldb) : stored_matrix("ldb", g.k, g.n, g.ldb);
  RD_CHECK((g.ldc >= g.n && g.ldc <= INT_MAX) || g.m == 1, kInvalidArgument,
           "gemm: argument 'ldc' is ", g.ldc, " but C has ", g.n,
           " columns (and CBLAS takes at most ", INT_MAX, ")");
  GemmArgs args = g;
  if (args.m == 1) args.ldc = std::max<int64_t>(args.n, 1);  // unused row stride
  dispatch_floating(g.dtype, "gemm",
                    [&](auto tag) { gemm_typed<typename decltype(tag)::type>(args, sa, sb); });
}

}  // namespace rd::kernels::cpu
