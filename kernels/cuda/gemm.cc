// CUDA batched GEMM through cuBLASLt, with the CPU backend's row-major semantics plus the
// optional bias / GELU epilogue.
//
// Row-major to cuBLASLt: a row-major r x c matrix with row stride ld is the column-major
// c x r matrix with leading dim ld, its transpose. So C = op(A) op(B) (row-major) is computed
// as C^T = op(B)^T op(A)^T in column-major: cuBLASLt's first operand is our stored B (with
// our trans_b), its second our stored A (with trans_a), its m x n output is our n x m C^T.
// No data moves and every layout stays CUBLASLT_ORDER_COL, the order every algorithm
// supports (ORDER_ROW layouts restrict the algorithm choice). C^T has n rows, so the bias
// epilogue, which adds a vector along the output's rows, adds bias[j] to column j of C.
//
// Process-wide state (there is one set of devices per process): a cublasLt handle per
// device, created on first use; a 32 MiB workspace per (device, stream) from the caller's
// scratch allocator, allocated on first use and kept (a workspace shared between streams
// would let two GEMMs running concurrently overwrite each other's); and the algorithm chosen
// by cuBLASLt's heuristic for each problem (shapes, leading dims, strides, dtype, compute
// mode, epilogue, pointer alignments). All of it sits behind one mutex, and is never freed:
// destroying handles during static destruction can run after the CUDA driver shut down.
//
// cuBLASLt is not linked: its entry points come from cublaslt_api() (loaded on the first
// GEMM), so programs that never multiply on a GPU run without the library.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "ringdilated/kernels/cuda/cublaslt_api.h"
#include "ringdilated/kernels/cuda/gemm_epilogue.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/view_checks.h"

namespace rd::kernels::cuda {
namespace {

// The loaded cuBLASLt. Where the library is missing, the first request (creating the
// handle, in gemm()) throws kUnimplemented naming it: GEMMs on a GPU fail, nothing else.
const CublasLtApi& lt() { return cublaslt_api("gemm"); }

// Throws rd::Error naming the failed cuBLASLt call, its status and where it happened.
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expression,
                                     const char* file, int line) {
  ErrorCode code = ErrorCode::kInternal;
  if (status == CUBLAS_STATUS_ALLOC_FAILED) code = ErrorCode::kOutOfMemory;
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) code = ErrorCode::kUnimplemented;
  throw Error(
      code, str_cat("cuBLASLt error ", lt().get_status_name(status), " (",
                    lt().get_status_string(status), ") in ", expression, " at ", file, ":", line));
}

}  // namespace
}  // namespace rd::kernels::cuda

// RD_CUBLAS_CHECK(cublasLtMatmul(...)): throws rd::Error with the expression, the status name
// and file:line unless the call returned CUBLAS_STATUS_SUCCESS.
#define RD_CUBLAS_CHECK(expr)                                                                \
  do {                                                                                       \
    cublasStatus_t rd_cublas_status_ = (expr);                                               \
    if (rd_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                           \
      ::rd::kernels::cuda::throw_cublas_error(rd_cublas_status_, #expr, __FILE__, __LINE__); \
    }                                                                                        \
  } while (false)

namespace rd::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr uint32_t kMaxAlignment = 256;  // cuBLASLt's default assumption for every pointer

// The largest power of two (<= 256) dividing the address of every batch entry.
uint32_t alignment_of(const void* p, int64_t stride, int64_t batch, size_t element_size) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) bits |= static_cast<uint64_t>(stride) * element_size;
  if (bits == 0) return kMaxAlignment;
  return static_cast<uint32_t>(std::min<uint64_t>(kMaxAlignment, bits & (~bits + 1)));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat64: return CUDA_R_64F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: break;
  }
  RD_FAIL(kDTypeMismatch, "gemm: requires a floating dtype, got ", dtype_name(t));
}

// Everything the descriptors and the algorithm choice depend on (pointers only through
// their alignment). Strides are 0 when batch == 1.
struct Problem {
  int device = 0;
  DType dtype = DType::kFloat32;
  bool tf32 = false;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  bool bias = false, gelu = false;
  bool fused_epilogue = false;  // whether the descriptors carry the epilogue
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_bias = 0;

  auto fields() const {
    return std::make_tuple(device, dtype, tf32, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch,
                           stride_a, stride_b, stride_c, bias, gelu, fused_epilogue, align_a,
                           align_b, align_c, align_bias);
  }
  friend bool operator==(const Problem& x, const Problem& y) { return x.fields() == y.fields(); }
  template <class H>
  friend H AbslHashValue(H h, const Problem& p) {
    return H::combine(std::move(h), p.fields());
  }
};

// The heuristic's pick for a problem, and whether it runs the epilogue fused (else the
// epilogue kernel follows the plain product).
struct AlgoChoice {
  cublasLtMatmulAlgo_t algo;
  bool fused_epilogue;
};

class LtContext {
 public:
  // Leaked on purpose (see the file comment).
  static LtContext& instance() {
    static LtContext* const context = new LtContext();
    return *context;
  }

  cublasLtHandle_t handle(int device) {
    absl::MutexLock lock(&mu_);
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cublasLtHandle_t h = nullptr;
    RD_CUBLAS_CHECK(lt().create(&h));
    handles_.emplace(device, h);
    return h;
  }

  void* workspace(int device, cudaStream_t stream, Allocator& scratch) {
    const std::pair<int, uintptr_t> key(device, reinterpret_cast<uintptr_t>(stream));
    absl::MutexLock lock(&mu_);
    auto it = workspaces_.find(key);
    if (it != workspaces_.end()) return it->second;
    void* w = scratch.allocate(kWorkspaceBytes);
    workspaces_.emplace(key, w);
    return w;
  }

  std::optional<AlgoChoice> find(const Problem& p) {
    absl::MutexLock lock(&mu_);
    auto it = algos_.find(p);
    if (it == algos_.end()) return std::nullopt;
    return it->second;
  }

  void insert(const Problem& p, const AlgoChoice& choice) {
    absl::MutexLock lock(&mu_);
    algos_.emplace(p, choice);
  }

 private:
  LtContext() = default;

  absl::Mutex mu_;
  absl::flat_hash_map<int, cublasLtHandle_t> handles_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uintptr_t>, void*> workspaces_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Problem, AlgoChoice> algos_ ABSL_GUARDED_BY(mu_);
};

struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { lt().matmul_desc_destroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const { lt().matrix_layout_destroy(d); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const { lt().matmul_preference_destroy(d); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

template <class Handle, class Setter, class Attr, class V>
void set_attribute(Handle h, Setter setter, Attr attr, const V& value) {
  RD_CUBLAS_CHECK(setter(h, attr, &value, sizeof(value)));
}

// A column-major rows x cols layout with leading dim ld (and the batch, when > 1).
Layout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                   int64_t stride) {
  cublasLtMatrixLayout_t raw = nullptr;
  RD_CUBLAS_CHECK(lt().matrix_layout_create(&raw, type, static_cast<uint64_t>(rows),
                                            static_cast<uint64_t>(cols), ld));
  Layout layout(raw);
  if (batch > 1) {
    set_attribute(raw, lt().matrix_layout_set_attribute, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                  static_cast<int32_t>(batch));
    set_attribute(raw, lt().matrix_layout_set_attribute,
                  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
  }
  return layout;
}

// The descriptors of one cuBLASLt call: D (= C) = alpha * op1(B) op2(A) + beta * C.
struct Descriptors {
  MatmulDesc matmul;
  Layout first;   // our stored B
  Layout second;  // our stored A
  Layout c;       // our C^T, also used as D's layout (in place)
};

Descriptors make_descriptors(const Problem& p, const void* bias) {
  const cudaDataType_t type = cuda_type(p.dtype);
  const bool f64 = p.dtype == DType::kFloat64;
  const cublasComputeType_t compute = f64      ? CUBLAS_COMPUTE_64F
                                      : p.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                               : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale_type = f64 ? CUDA_R_64F : CUDA_R_32F;
  Descriptors d;
  cublasLtMatmulDesc_t raw = nullptr;
  RD_CUBLAS_CHECK(lt().matmul_desc_create(&raw, compute, scale_type));
  d.matmul.reset(raw);
  const int32_t op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attribute(raw, lt().matmul_desc_set_attribute, CUBLASLT_MATMUL_DESC_TRANSA, op_first);
  set_attribute(raw, lt().matmul_desc_set_attribute, CUBLASLT_MATMUL_DESC_TRANSB, op_second);
  if (p.fused_epilogue) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (p.bias && p.gelu) {
      epilogue = CUBLASLT_EPILOGUE_GELU_BIAS;
    } else if (p.bias) {
      epilogue = CUBLASLT_EPILOGUE_BIAS;
    } else if (p.gelu) {
      epilogue = CUBLASLT_EPILOGUE_GELU;
    }
    set_attribute(raw, lt().matmul_desc_set_attribute, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    if (p.bias) {
      set_attribute(raw, lt().matmul_desc_set_attribute, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
      set_attribute(raw, lt().matmul_desc_set_attribute, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    static_cast<int32_t>(type));
    }
  }
  // Column-major shapes of the stored operands (row-major rows x cols -> cols x rows).
  d.first = p.trans_b ? make_layout(type, p.k, p.n, p.ldb, p.batch, p.stride_b)
                      : make_layout(type, p.n, p.k, p.ldb, p.batch, p.stride_b);
  d.second = p.trans_a ? make_layout(type, p.m, p.k, p.lda, p.batch, p.stride_a)
                       : make_layout(type, p.k, p.m, p.lda, p.batch, p.stride_a);
  d.c = make_layout(type, p.n, p.m, p.ldc, p.batch, p.stride_c);
  return d;
}

// The heuristic's best algorithm for `p` within the workspace, or nullopt if it has none.
std::optional<cublasLtMatmulAlgo_t> query_algo(cublasLtHandle_t handle, const Problem& p,
                                               const void* bias) {
  const Descriptors d = make_descriptors(p, bias);
  cublasLtMatmulPreference_t raw = nullptr;
  RD_CUBLAS_CHECK(lt().matmul_preference_create(&raw));
  const Preference preference(raw);
  const uint64_t workspace = kWorkspaceBytes;
  set_attribute(raw, lt().matmul_preference_set_attribute, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                workspace);
  // Our first operand is B, the second A (see the file comment).
  set_attribute(raw, lt().matmul_preference_set_attribute,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align_b);
  set_attribute(raw, lt().matmul_preference_set_attribute,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align_a);
  set_attribute(raw, lt().matmul_preference_set_attribute,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align_c);
  set_attribute(raw, lt().matmul_preference_set_attribute,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align_c);
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t status =
      lt().matmul_algo_get_heuristic(handle, d.matmul.get(), d.first.get(), d.second.get(),
                                     d.c.get(), d.c.get(), raw, 1, &result, &returned);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return std::nullopt;
  // Some epilogue/type combinations are refused as invalid rather than unsupported; the
  // plain product (queried next) still reports real errors.
  if (status == CUBLAS_STATUS_INVALID_VALUE && p.fused_epilogue) return std::nullopt;
  RD_CUBLAS_CHECK(status);
  if (returned == 0 || result.state != CUBLAS_STATUS_SUCCESS) return std::nullopt;
  return result.algo;
}

std::string problem_str(const Problem& p) {
  return str_cat("dtype=", dtype_name(p.dtype), " m=", p.m, " n=", p.n, " k=", p.k,
                 " trans_a=", p.trans_a, " trans_b=", p.trans_b, " lda=", p.lda, " ldb=", p.ldb,
                 " ldc=", p.ldc, " batch=", p.batch, " bias=", p.bias, " gelu=", p.gelu,
                 " tf32=", p.tf32);
}

// The cached choice for `p` (with p.fused_epilogue unset), querying cuBLASLt on a miss: the
// fused epilogue first when one is asked for, else (or when that has no algorithm) the
// plain product.
AlgoChoice choose_algo(LtContext& context, cublasLtHandle_t handle, const Problem& p,
                       const void* bias) {
  if (std::optional<AlgoChoice> cached = context.find(p)) return *cached;
  Problem q = p;
  std::optional<cublasLtMatmulAlgo_t> algo;
  // cuBLASLt's fused GELU is not double-exact for float64 (seen on an H100: errors of
  // ~1e-10 relative), so float64 GELU runs in our epilogue kernel, which computes in double.
  const bool fused_is_exact = !(p.gelu && p.dtype == DType::kFloat64);
  if ((p.bias || p.gelu) && fused_is_exact) {
    q.fused_epilogue = true;
    algo = query_algo(handle, q, bias);
  }
  if (!algo) {
    q.fused_epilogue = false;
    algo = query_algo(handle, q, bias);
  }
  RD_CHECK(algo.has_value(), kUnimplemented, "gemm: cuBLASLt has no algorithm for ",
           problem_str(p));
  const AlgoChoice choice{*algo, q.fused_epilogue};
  context.insert(p, choice);
  return choice;
}

}  // namespace

void gemm(const GemmArgs& g, Allocator& scratch, cudaStream_t stream) {
  RD_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 0, kInvalidArgument,
           "gemm: sizes must be non-negative, got m=", g.m, " n=", g.n, " k=", g.k,
           " batch=", g.batch);
  cuda_type(g.dtype);  // rejects non-floating dtypes
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const StoredMatrix sa = g.trans_a ? gemm_stored_matrix("lda", g.k, g.m, g.lda)
                                    : gemm_stored_matrix("lda", g.m, g.k, g.lda);
  const StoredMatrix sb = g.trans_b ? gemm_stored_matrix("ldb", g.n, g.k, g.ldb)
                                    : gemm_stored_matrix("ldb", g.k, g.n, g.ldb);
  RD_CHECK(g.ldc >= g.n || g.m == 1, kInvalidArgument, "gemm: argument 'ldc' is ", g.ldc,
           " but C has ", g.n, " columns");
  RD_CHECK(g.batch <= INT32_MAX, kInvalidArgument, "gemm: batch ", g.batch,
           " exceeds cuBLASLt's limit ", INT32_MAX);
  RD_CHECK(g.batch == 1 || g.stride_c != 0, kInvalidArgument,
           "gemm: argument 'stride_c' is 0 with batch=", g.batch,
           ": every batch entry would write the same C");
  const int64_t ldc = g.m == 1 ? std::max<int64_t>(g.n, 1) : g.ldc;
  const bool epilogue = g.bias != nullptr || g.gelu;

  if (g.k == 0 || g.alpha == 0.0) {  // no product term (and A, B are not read, as in BLAS)
    if (g.beta == 1.0 && !epilogue) return;
    gemm_epilogue({g.dtype, g.c, g.m, g.n, ldc, g.batch, g.stride_c, g.beta, g.bias, g.gelu},
                  stream);
    return;
  }

  int device = 0;
  RD_CUDA_CHECK(cudaGetDevice(&device));
  const size_t element = dtype_size(g.dtype);
  Problem p;
  p.device = device;
  p.dtype = g.dtype;
  p.tf32 = g.allow_tf32 && g.dtype == DType::kFloat32;
  p.trans_a = g.trans_a;
  p.trans_b = g.trans_b;
  p.m = g.m;
  p.n = g.n;
  p.k = g.k;
  p.lda = sa.ld;
  p.ldb = sb.ld;
  p.ldc = ldc;
  p.batch = g.batch;
  if (g.batch > 1) {
    p.stride_a = g.stride_a;
    p.stride_b = g.stride_b;
    p.stride_c = g.stride_c;
  }
  p.bias = g.bias != nullptr;
  p.gelu = g.gelu;
  p.align_a = alignment_of(g.a, p.stride_a, p.batch, element);
  p.align_b = alignment_of(g.b, p.stride_b, p.batch, element);
  p.align_c = alignment_of(g.c, p.stride_c, p.batch, element);
  p.align_bias = p.bias ? alignment_of(g.bias, 0, 1, element) : 0;

  LtContext& context = LtContext::instance();
  const cublasLtHandle_t handle = context.handle(device);
  void* workspace = context.workspace(device, stream, scratch);
  const AlgoChoice choice = choose_algo(context, handle, p, g.bias);
  Problem run = p;
  run.fused_epilogue = choice.fused_epilogue;
  const Descriptors d = make_descriptors(run, g.bias);
  const float alpha32 = static_cast<float>(g.alpha), beta32 = static_cast<float>(g.beta);
  const bool f64 = g.dtype == DType::kFloat64;
  const void* alpha = f64 ? static_cast<const void*>(&g.alpha) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&g.beta) : &beta32;
  RD_CUBLAS_CHECK(lt().matmul(handle, d.matmul.get(), alpha, g.b, d.first.get(), g.a,
                              d.second.get(), beta, g.c, d.c.get(), g.c, d.c.get(), &choice.algo,
                              workspace, kWorkspaceBytes, stream));
  if (epilogue && !choice.fused_epilogue) {
    gemm_epilogue({g.dtype, g.c, g.m, g.n, ldc, g.batch, g.stride_c, 1.0, g.bias, g.gelu}, stream);
  }
}

}  // namespace rd::kernels::cuda
