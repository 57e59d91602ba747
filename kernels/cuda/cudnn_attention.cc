// cuDNN fused attention (kCudnn) through the cudnn-frontend graph API: argument analysis
// (which views fold into cuDNN's [B, H, L, D]), the graph cache, and forward / backward.
// The semantics and limits are documented in cudnn_attention.h.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9), through the frontend's own dynamic
// loading mode (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): nothing links libcudnn, so every
// program runs where cuDNN is missing (this path then reports itself unavailable), and the
// frontend's experimental NVRTC engines, which its headers always reference, need no
// libnvrtc either. The frontend finds the CUDA runtime the same way (libcudart.so.12 or .13;
// the environment variable CUDNN_FRONTEND_CUDART_LIB_NAME picks one where both exist): that
// is a second copy of the runtime, since ours is linked statically (no program of a CUDA
// build needs libcudart to start), which is fine: both drive the same driver contexts,
// streams and memory, as the copies inside libcudnn and libcublasLt already do. It is opened
// with cuDNN (loaded_cudnn), and where it is missing the path is unavailable.
//
// Process-wide state, never freed (destroying cuDNN handles during static destruction can
// run after the CUDA driver shut down, as in gemm.cc): the loaded library and its version
// (set once, thread-safely, on first use), a pool of cuDNN handles per device behind a mutex
// (a handle is used by one thread at a time), and the LRU cache of built graphs.
#include "ringdilated/kernels/cuda/cudnn_attention.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/lru_map.h"
#include "ringdilated/kernels/number_text.h"
#include "ringdilated/kernels/shared_library.h"
#include "ringdilated/kernels/view_checks.h"

#if defined(RD_WITH_CUDNN)
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn.h>
#include <cudnn_frontend.h>

// The handle through which the frontend resolves every cuDNN call; set once, by
// loaded_cudnn() below, before any call.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend
#endif

namespace rd::kernels::cuda {
namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kHeadDimMultiple = 8;  // cuDNN's fused kernels load 16-byte vectors
constexpr int64_t kStrideMultiple = 8;   // 16 bytes of a 16-bit dtype
constexpr uintptr_t kPointerAlignment = 16;
constexpr int kMinComputeCapability = 80;  // sm_80 (Ampere)
constexpr int kMinCudnnVersion = 90000;
constexpr size_t kDefaultGraphCacheCapacity = 256;

#if defined(RD_WITH_CUDNN)
namespace fe = cudnn_frontend;

// The cuDNN library of this process: its version, or why it could not be used.
struct LoadedCudnn {
  int version = 0;
  std::string problem;  // "" when usable
};

// The shared CUDA runtime of the major version we were compiled against, for the frontend
// (see the file comment): the loader's search path first, then the toolkit the build used.
std::vector<std::string> cudart_candidates() {
  const std::string soname = str_cat("libcudart.so.", CUDART_VERSION / 1000);
  return {soname, str_cat(RD_CUDA_LIBRARY_DIR, "/", soname)};
}

const LoadedCudnn& loaded_cudnn() {
  static const LoadedCudnn* const loaded = [] {
    auto* result = new LoadedCudnn();
    // The soname through the loader's search path first, then where CMake found cuDNN.
    const SharedLibrary cudnn = open_shared_library(
        "the cuDNN 9 library", {"libcudnn.so.9", str_cat(RD_CUDNN_LIBRARY_DIR, "/libcudnn.so.9")});
    if (!cudnn.usable()) {
      result->problem = cudnn.problem;
      return result;
    }
    // Loaded here, once, so that the frontend's dlopen by soname finds it even where the
    // toolkit is not on the loader's search path.
    const SharedLibrary cudart = open_shared_library(
        "the shared CUDA runtime (cudnn-frontend calls it)", cudart_candidates());
    if (!cudart.usable()) {
      result->problem = cudart.problem;
      return result;
    }
    fe::cudnn_dlhandle = cudnn.handle;
    try {
      result->version = static_cast<int>(fe::detail::get_backend_version());
    } catch (const std::exception& e) {
      result->problem = str_cat("the loaded cuDNN library has no version: ", e.what());
      return result;
    }
    if (result->version < kMinCudnnVersion) {
      result->problem =
          str_cat("the cuDNN library is version ", result->version, " (9.0.0 or newer is needed)");
    }
    return result;
  }();
  return *loaded;
}
#endif

// ---------------------------------------------------------------------------------------
// Argument analysis: shapes, dtypes, and the fold of [batch..., L, D] views into cuDNN's
// [B, H, L, D]. None of it needs cuDNN.

// A view as cuDNN sees it: dims and element strides of [B, H, L, D] (D = 1 for the lse).
struct View4 {
  std::array<int64_t, 4> dim{};
  std::array<int64_t, 4> stride{};
};

// How the batch dims are split: the size > 1 batch dims in order, and how many of them form
// B (the rest form H).
struct BatchFold {
  std::vector<int> dims;
  size_t outer_count = 0;
};

bool is_half_dtype(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

// Whether dims `first..last` (positions in fold.dims) of v sit one stride apart, so that
// they fold into one dim whose stride is that of the last.
bool group_folds(const StridedView& v, const std::vector<int>& dims, size_t first, size_t last) {
  for (size_t i = first; i + 1 < last; ++i) {
    const int a = dims[i], b = dims[i + 1];
    if (v.strides[a] != v.strides[b] * v.shape[b]) return false;
  }
  return true;
}

bool fold_fits(const StridedView& v, const BatchFold& fold) {
  return group_folds(v, fold.dims, 0, fold.outer_count) &&
         group_folds(v, fold.dims, fold.outer_count, fold.dims.size());
}

// The batch dims of v ([batch..., L, D]) of size > 1: those a fold arranges.
std::vector<int> foldable_dims(const StridedView& v) {
  std::vector<int> dims;
  for (int d = 0; d < v.ndim - 2; ++d) {
    if (v.shape[d] != 1) dims.push_back(d);
  }
  return dims;
}

// The first split of the batch dims that folds every view in `views` (all with the same
// batch shape), or nullopt.
std::optional<BatchFold> find_fold(std::initializer_list<const StridedView*> views) {
  BatchFold fold;
  fold.dims = foldable_dims(**views.begin());
  const size_t n = fold.dims.size();
  // No batch dim, or one (B = it, H = 1), or a split with both groups non-empty.
  const size_t lo = n <= 1 ? n : 1, hi = n <= 1 ? n : n - 1;
  for (size_t split = lo; split <= hi; ++split) {
    fold.outer_count = split;
    bool all = true;
    for (const StridedView* v : views) all = all && fold_fits(*v, fold);
    if (all) return fold;
  }
  return std::nullopt;
}

// The folds of one call: q (and out, lse) by `q`; k and v by `kv`, which leaves out the batch
// dims that k and v both read through stride 0. Those dims (grouped-query attention: query
// heads sharing a key/value head) must end q's head group, so that cuDNN's H_q = H_kv x G
// maps query head h to key/value head h / G, as the views do. Without them kv == q.
struct CallFold {
  BatchFold q;
  BatchFold kv;
};

// q's batch dims of size > 1 that `v` reads through stride 0.
std::vector<int> broadcast_dims(const StridedView& q, const StridedView& v) {
  std::vector<int> dims;
  for (int d : foldable_dims(q)) {
    if (v.strides[d] == 0) dims.push_back(d);
  }
  return dims;
}

// The fold of q, k and v; with `allow_broadcast`, k and v may broadcast the trailing dims of
// q's head group (CallFold). nullopt when no fold fits.
std::optional<CallFold> find_call_fold(const StridedView& q, const StridedView& k,
                                       const StridedView& v, bool allow_broadcast) {
  const std::vector<int> shared = broadcast_dims(q, k);
  if (shared.empty() || !allow_broadcast) {
    std::optional<BatchFold> fold = find_fold({&q, &k, &v});
    if (!fold) return std::nullopt;
    return CallFold{*fold, *fold};
  }
  if (broadcast_dims(q, v) != shared) return std::nullopt;  // k and v broadcast alike
  BatchFold fold;
  fold.dims = foldable_dims(q);
  const size_t n = fold.dims.size(), broadcast = shared.size();
  if (!std::equal(shared.begin(), shared.end(), fold.dims.end() - broadcast)) return std::nullopt;
  BatchFold kv;
  kv.dims.assign(fold.dims.begin(), fold.dims.end() - broadcast);
  for (size_t split = 0; split <= n - broadcast; ++split) {
    fold.outer_count = kv.outer_count = split;
    if (fold_fits(q, fold) && fold_fits(k, kv) && fold_fits(v, kv)) return CallFold{fold, kv};
  }
  return std::nullopt;
}

// v's entry `i` of batch dim d, that dim left of size 1.
StridedView at_index(const StridedView& v, int d, int64_t i) {
  if (v.data == nullptr) return v;  // an absent view (grad_lse) stays absent
  StridedView entry = v;
  entry.data =
      static_cast<char*>(v.data) + i * v.strides[d] * static_cast<int64_t>(dtype_size(v.dtype));
  entry.shape[d] = 1;
  return entry;
}

// A call whose batch dims do not fold into (B, H) but do once the outermost batch dim of size
// > 1 is taken one entry at a time: the batch rows of a rank's block of two zigzag pieces (a
// row's segments lie one segment apart, rows a whole block apart). That dim, run as one graph
// per entry; -1 where the call folds as it is or not even so. k and v must not broadcast it
// (each entry's dK/dV must be its own to store).
int peeled_batch_dim(const StridedView& q, const StridedView& k, const StridedView& v,
                     bool allow_broadcast) {
  const std::vector<int> dims = foldable_dims(q);
  if (dims.size() < 2 || find_call_fold(q, k, v, allow_broadcast)) return -1;
  const int d = dims.front();
  if (k.strides[d] == 0 || v.strides[d] == 0) return -1;
  const bool folds =
      find_call_fold(at_index(q, d, 0), at_index(k, d, 0), at_index(v, d, 0), allow_broadcast)
          .has_value();
  return folds ? d : -1;
}

// Why v cannot be read or written by cuDNN in place ("" when it can): the head dim
// contiguous, other strides of size > 1 dims positive multiples of 8 (or 0 where
// `allow_broadcast`: dims that find_call_fold leaves out), a 16-byte aligned pointer. An lse
// view ([batch..., L], float32) needs positive strides and L contiguous.
std::string layout_problem(const char* name, const StridedView& v, bool has_head_dim,
                           bool allow_broadcast = false) {
  const int seq_dim = has_head_dim ? v.ndim - 2 : v.ndim - 1;
  if (has_head_dim && v.shape[v.ndim - 1] > 1 && v.strides[v.ndim - 1] != 1) {
    return str_cat(name, " has head-dim stride ", v.strides[v.ndim - 1], " (cuDNN needs 1)");
  }
  if (!has_head_dim && v.shape[seq_dim] > 1 && v.strides[seq_dim] != 1) {
    return str_cat(name, " has sequence stride ", v.strides[seq_dim],
                   " (cuDNN's softmax stats need 1)");
  }
  for (int d = 0; d <= seq_dim; ++d) {
    if (v.shape[d] == 1) continue;
    if (allow_broadcast && d < seq_dim && v.strides[d] == 0) continue;
    if (v.strides[d] <= 0) {
      return str_cat(name, " has stride ", v.strides[d], " in dim ", d, " (cuDNN needs > 0)");
    }
    if (has_head_dim && v.strides[d] % kStrideMultiple != 0) {
      return str_cat(name, " has stride ", v.strides[d], " in dim ", d,
                     " (cuDNN needs a multiple of ", kStrideMultiple, ")");
    }
  }
  if (has_head_dim && reinterpret_cast<uintptr_t>(v.data) % kPointerAlignment != 0) {
    return str_cat(name, " is not ", kPointerAlignment, "-byte aligned");
  }
  return "";
}

// Shape and dtype agreement of the views of one call, per kernels/attention.h: "" when they
// agree, else what is wrong. A disagreement is the caller's bug, reported as kShapeMismatch
// or kDTypeMismatch by the entry points.
std::string shape_problem(const StridedView& q, const StridedView& k, const StridedView& v,
                          const StridedView* out, const StridedView* lse) {
  if (q.ndim < 2) return str_cat("q must be [batch..., Lq, D], got ", shape_of(q));
  auto same_batch = [&](const StridedView& x, int ndim) {
    if (x.ndim != ndim) return false;
    for (int d = 0; d < q.ndim - 2; ++d) {
      if (x.shape[d] != q.shape[d]) return false;
    }
    return true;
  };
  const int64_t head = q.shape[q.ndim - 1];
  if (!same_batch(k, q.ndim) || k.shape[k.ndim - 1] != head) {
    return str_cat("k ", shape_of(k), " does not match q ", shape_of(q));
  }
  if (!same_batch(v, q.ndim) || v.shape[v.ndim - 1] != head ||
      v.shape[v.ndim - 2] != k.shape[k.ndim - 2]) {
    return str_cat("v ", shape_of(v), " does not match k ", shape_of(k));
  }
  if (out != nullptr &&
      (!same_batch(*out, q.ndim) || out->shape[q.ndim - 2] != q.shape[q.ndim - 2] ||
       out->shape[q.ndim - 1] != head)) {
    return str_cat("out ", shape_of(*out), " does not match q ", shape_of(q));
  }
  if (lse != nullptr && lse->data != nullptr &&
      (!same_batch(*lse, q.ndim - 1) || lse->shape[q.ndim - 2] != q.shape[q.ndim - 2])) {
    return str_cat("lse ", shape_of(*lse), " does not match q ", shape_of(q), " minus D");
  }
  return "";
}

std::string dtype_problem(const StridedView& q, const StridedView& k, const StridedView& v) {
  if (!is_half_dtype(q.dtype)) {
    return str_cat("q is ", dtype_name(q.dtype), " (cuDNN attention takes bfloat16 or float16)");
  }
  if (k.dtype != q.dtype || v.dtype != q.dtype) {
    return str_cat("q, k, v dtypes differ (", dtype_name(q.dtype), ", ", dtype_name(k.dtype), ", ",
                   dtype_name(v.dtype), ")");
  }
  return "";
}

// The checks every call shares: availability, device, head dim, dropout, causal offset, and
// whether q/k/v fold into [B, H, L, D] in place (k and v broadcasting query heads where
// `grouped`: the forward, and the backward whose gradients are shared like k and v).
std::string common_problem(const StridedView& q, const StridedView& k, const StridedView& v,
                           const AttentionParams& params, bool grouped) {
  if (!cudnn_attention_available()) {
#if defined(RD_WITH_CUDNN)
    return loaded_cudnn().problem;
#else
    return "this build has no cuDNN (see cmake/RdCuda.cmake)";
#endif
  }
  int device = 0, major = 0, minor = 0;
  if (device_count() == 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // clear the error a failed query leaves
    return "no CUDA device is available";
  }
  const int capability = major * 10 + minor;
  if (capability < kMinComputeCapability) {
    return str_cat("device ", device, " is sm_", capability, " (cuDNN attention needs sm_80+)");
  }
  const int64_t head = q.shape[q.ndim - 1];
  if (head <= 0 || head % kHeadDimMultiple != 0 || head > kMaxHeadDim) {
    return str_cat("head dim ", head, " is not a multiple of ", kHeadDimMultiple, " in [",
                   kHeadDimMultiple, ", ", kMaxHeadDim, "]");
  }
  // Any dropout, with the default or a custom numbering (AttentionParams::dropout_indexing,
  // which without dropout draws nothing and so is no reason to refuse).
  if (params.dropout != 0.0) {
    return str_cat("dropout ", params.dropout,
                   params.dropout_indexing.custom ? " with a custom element numbering" : "",
                   " (cuDNN's own dropout mask cannot reproduce ours; use the flash path)");
  }
  if (params.key_order != nullptr) {
    return "a key_order is given (cuDNN visits keys in storage order; the math path takes one)";
  }
  if (params.causal && params.causal_offset < 0) {
    return str_cat("causal_offset ", params.causal_offset,
                   " is negative (cuDNN's diagonal band needs a right bound >= 0)");
  }
  if (q.numel() > 0 && k.shape[k.ndim - 2] == 0) return "there are no keys (Lk = 0)";
  using Named = std::pair<const char*, const StridedView*>;
  for (auto [name, view] : {Named{"q", &q}, Named{"k", &k}, Named{"v", &v}}) {
    std::string problem = layout_problem(name, *view, true, grouped && view != &q);
    if (!problem.empty()) return problem;
  }
  if (!find_call_fold(q, k, v, grouped) && peeled_batch_dim(q, k, v, grouped) < 0) {
    return str_cat("the batch dims of q ", shape_of(q),
                   " cannot be folded into cuDNN's two (B, H) for q, k and v alike",
                   grouped ? " (k and v may broadcast only the last dims of the head group)" : "");
  }
  return "";
}

// The graph tensors of cuDNN attention (their uids in a graph).
enum TensorUid : int64_t { kQ = 1, kK, kV, kO, kStats, kGradO, kGradQ, kGradK, kGradV };

// A tensor of a call over pieces: its uid, whether its rows follow the queries ('q') or the
// keys ('k'), and its view as cuDNN's [B, H, 1, D] (the lse [B, H, 1]; see piece_heads).
struct PieceTensor {
  TensorUid uid;
  char role;
  StridedView view;
};

// A view of a call over pieces with its heads in one dim. Grouped-query views come as
// [B, hc, repeat, 1, D] (lse [B, hc, repeat, 1]): a query-side view's hc * repeat heads fold
// into one dim where they are one run (stride[1] == repeat * stride[2]); a key-side view
// reads each key/value head `repeat` times through stride 0, so its repeat dim goes (cuDNN
// maps query head h to key/value head h / (H / H_kv) itself). Other views stay as they are,
// for pieces_problem to name.
StridedView piece_heads(const StridedView& v, char role, bool has_head_dim) {
  if (v.ndim != (has_head_dim ? 5 : 4)) return v;
  int64_t heads = v.shape[1], stride = v.strides[1];
  if (role == 'q' && v.shape[2] > 1) {
    if (v.shape[1] > 1 && v.strides[1] != v.shape[2] * v.strides[2]) {
      return v;  // query heads that are not one run
    }
    heads *= v.shape[2];
    stride = v.strides[2];
  } else if (role == 'k' && v.shape[2] > 1 && v.strides[2] != 0) {
    return v;  // key heads that are not repeated through stride 0
  }
  StridedView r = v;
  r.ndim = v.ndim - 1;
  r.shape[1] = heads;
  r.strides[1] = stride;
  for (int d = 2; d < r.ndim; ++d) {
    r.shape[d] = v.shape[d + 1];
    r.strides[d] = v.strides[d + 1];
  }
  return r;
}

PieceTensor piece_tensor(TensorUid uid, char role, const StridedView& view) {
  return {uid, role, piece_heads(view, role, uid != kStats)};
}

std::vector<PieceTensor> piece_tensors(const AttentionForwardArgs& a) {
  return {piece_tensor(kQ, 'q', a.q), piece_tensor(kK, 'k', a.k), piece_tensor(kV, 'k', a.v),
          piece_tensor(kO, 'q', a.out), piece_tensor(kStats, 'q', a.lse)};
}

std::vector<PieceTensor> piece_tensors(const AttentionBackwardArgs& a) {
  return {piece_tensor(kQ, 'q', a.q),
          piece_tensor(kK, 'k', a.k),
          piece_tensor(kV, 'k', a.v),
          piece_tensor(kO, 'q', a.out),
          piece_tensor(kGradO, 'q', a.grad_out),
          piece_tensor(kStats, 'q', a.lse),
          piece_tensor(kGradQ, 'q', a.grad_q),
          piece_tensor(kGradK, 'k', a.grad_k),
          piece_tensor(kGradV, 'k', a.grad_v)};
}

// Where piece i of `t` starts and ends (one past its last element), in elements from the
// view's data.
std::pair<int64_t, int64_t> piece_span(const AttentionPieces& p, const PieceTensor& t, size_t i) {
  const StridedView& v = t.view;
  const bool q_role = t.role == 'q';
  const int64_t row_stride = v.strides[2] / p.step;
  int64_t begin =
      p.batch_row[i] * v.strides[0] + (q_role ? p.q_position[i] : p.k_position[i]) * row_stride;
  if (p.has_heads()) {
    begin += q_role ? p.q_head[i] * (v.strides[1] / p.q_head_step)
                    : p.k_head[i] * (v.strides[1] / p.k_head_step);
  }
  const int64_t rows = q_role ? p.q_rows[i] : p.k_rows[i];
  return {begin, begin + (rows - 1) * v.strides[2] + (v.shape[1] - 1) * v.strides[1] +
                     (v.ndim == 4 ? v.shape[3] : 1)};
}

// A view's strides as text, "[s0, s1, ...]".
std::string strides_text(const StridedView& v) {
  return shape_str(std::span<const int64_t>(v.strides.data(), v.ndim));
}

// A call over pieces (AttentionPieces) runs as one graph with ragged offsets: [B, H, 1, D]
// views (lse [B, H, 1]) whose row strides are multiples of the step, pieces that each fit
// int32 offsets, the same heads for k and v as for q, and causal masks only on pieces whose
// queries are their keys.
std::string pieces_problem(const AttentionPieces& pieces, const AttentionParams& params,
                           const std::vector<PieceTensor>& tensors) {
  const size_t n = pieces.batch_row.size();
  if (n == 0 || pieces.q_position.size() != n || pieces.q_rows.size() != n ||
      pieces.k_position.size() != n || pieces.k_rows.size() != n || pieces.step < 1 ||
      pieces.q_head_step < 1 || pieces.k_head_step < 1) {
    return str_cat("pieces: ", n, " pieces with tables of unequal sizes or step ", pieces.step,
                   " (head steps ", pieces.q_head_step, " and ", pieces.k_head_step, ")");
  }
  if (pieces.has_heads() || !pieces.k_head.empty()) {
    if (pieces.q_head.size() != n || pieces.k_head.size() != n) {
      return str_cat("pieces: head tables of ", pieces.q_head.size(), " and ", pieces.k_head.size(),
                     " entries for ", n, " pieces");
    }
    for (size_t p = 0; p < n; ++p) {
      if (pieces.q_head[p] < 0 || pieces.k_head[p] < 0) {
        return str_cat("piece ", p, " starts before its views' first head");
      }
    }
  }
  for (size_t p = 0; p < n; ++p) {
    if (pieces.q_rows[p] < 1 || pieces.k_rows[p] < 1 || pieces.q_position[p] < 0 ||
        pieces.k_position[p] < 0 || pieces.batch_row[p] < 0) {
      return str_cat("piece ", p, " is empty or starts before its view");
    }
    if (params.causal &&
        (params.causal_offset != 0 || pieces.q_position[p] != pieces.k_position[p] ||
         pieces.q_rows[p] != pieces.k_rows[p])) {
      return str_cat("piece ", p, " is causal but its queries are not its keys");
    }
  }
  // Query-side views have the query heads, key-side ones the key/value heads, which divide
  // them (grouped-query attention).
  const int64_t q_heads = tensors.front().view.shape[1];
  const auto key_side = std::find_if(tensors.begin(), tensors.end(),
                                     [](const PieceTensor& t) { return t.role == 'k'; });
  const int64_t kv_heads = key_side == tensors.end() ? q_heads : key_side->view.shape[1];
  if (kv_heads < 1 || q_heads % kv_heads != 0) {
    return str_cat("pieces: ", kv_heads, " key/value heads do not divide ", q_heads,
                   " query heads");
  }
  for (const PieceTensor& t : tensors) {
    const StridedView& view = t.view;
    constexpr int seq_dim = 2;  // [B, H, rows, D] and [B, H, rows]
    const int64_t heads = t.role == 'q' ? q_heads : kv_heads;
    if ((view.ndim != 4 && view.ndim != 3) || view.shape[seq_dim] != 1 || view.shape[1] != heads ||
        view.strides[seq_dim] % pieces.step != 0 ||
        (pieces.has_heads() &&
         view.strides[1] % (t.role == 'q' ? pieces.q_head_step : pieces.k_head_step) != 0) ||
        view.strides[0] < 0 || view.strides[1] < 0 || view.strides[seq_dim] <= 0) {
      return str_cat("a view of the pieces is ", shape_of(t.view),
                     " (pieces need [B, H, 1, D] views, or grouped-query [B, hc, repeat, 1, D] "
                     "ones with the query heads in one run, row strides a multiple of the step ",
                     pieces.step, ", head strides of the head steps ", pieces.q_head_step, " and ",
                     pieces.k_head_step, ")");
    }
    // Pieces run in runs that int32 offsets reach from their lowest start; one piece must fit.
    for (size_t p = 0; p < n; ++p) {
      const auto [begin, end] = piece_span(pieces, t, p);
      if (end - begin > std::numeric_limits<int32_t>::max()) {
        return str_cat("piece ", p, " spans ", end - begin,
                       " elements, past cuDNN's int32 offsets");
      }
    }
  }
  return "";
}

// With as many key/value heads as query heads, cuDNN's ragged backward writes dK and dV where
// k and v lie: a dK laid out otherwise than k got writes out of bounds (H200, cuDNN 9.14;
// tests/cuda_cudnn_attention_test.cc). With fewer (grouped-query), its head reduction writes
// them through their own offsets; dQ and dO may be laid out otherwise than q and out either way.
std::string piece_key_grads_problem(const std::vector<PieceTensor>& tensors) {
  auto view_of = [&](TensorUid uid) -> const StridedView& {
    return std::find_if(tensors.begin(), tensors.end(),
                        [uid](const PieceTensor& t) { return t.uid == uid; })
        ->view;
  };
  if (view_of(kQ).shape[1] != view_of(kK).shape[1]) return "";
  using Pair = std::tuple<const char*, TensorUid, TensorUid>;
  for (auto [name, grad_uid, input_uid] :
       {Pair{"grad_k", kGradK, kK}, Pair{"grad_v", kGradV, kV}}) {
    const StridedView &grad = view_of(grad_uid), &input = view_of(input_uid);
    if (!std::equal(grad.strides.begin(), grad.strides.begin() + grad.ndim,
                    input.strides.begin())) {
      return str_cat("pieces: ", name, " is laid out otherwise than its input (strides ",
                     strides_text(grad), " and ", strides_text(input),
                     "); cuDNN's ragged backward with full heads needs them alike");
    }
  }
  return "";
}

std::string forward_problem(const AttentionForwardArgs& a) {
  std::string problem = dtype_problem(a.q, a.k, a.v);
  if (problem.empty() && a.out.dtype != a.q.dtype) {
    problem = str_cat("out is ", dtype_name(a.out.dtype), ", q is ", dtype_name(a.q.dtype),
                      " (cuDNN writes q's dtype)");
  }
  if (problem.empty() && a.lse.data != nullptr && a.lse.dtype != DType::kFloat32) {
    problem = str_cat("lse is ", dtype_name(a.lse.dtype), " (must be float32)");
  }
  if (problem.empty()) problem = shape_problem(a.q, a.k, a.v, &a.out, &a.lse);
  if (problem.empty()) problem = common_problem(a.q, a.k, a.v, a.params, /*grouped=*/true);
  if (problem.empty() && a.pieces != nullptr) {
    if (a.lse.data == nullptr) return "pieces: the lse is required";
    problem = pieces_problem(*a.pieces, a.params, piece_tensors(a));
  }
  return problem;
}

std::string backward_problem(const AttentionBackwardArgs& a) {
  std::string problem = dtype_problem(a.q, a.k, a.v);
  if (problem.empty() && a.grad_lse.data != nullptr) {
    problem = "grad_lse is given (cuDNN's SDPA backward has no lse gradient; use the flash path)";
  }
  if (problem.empty() && a.lse.data == nullptr) problem = "lse is missing (the backward needs it)";
  using Named = std::pair<const char*, const StridedView*>;
  for (auto [name, view] :
       {Named{"out", &a.out}, Named{"grad_out", &a.grad_out}, Named{"grad_q", &a.grad_q},
        Named{"grad_k", &a.grad_k}, Named{"grad_v", &a.grad_v}}) {
    if (problem.empty() && view->dtype != a.q.dtype && view->dtype != DType::kFloat32) {
      problem = str_cat(name, " is ", dtype_name(view->dtype), " (q's dtype or float32 expected)");
    }
  }
  if (problem.empty() && a.lse.dtype != DType::kFloat32) {
    problem = str_cat("lse is ", dtype_name(a.lse.dtype), " (must be float32)");
  }
  if (problem.empty()) problem = shape_problem(a.q, a.k, a.v, &a.out, &a.lse);
  if (problem.empty()) {
    if (shape_of(a.grad_out) != shape_of(a.q)) {
      problem = str_cat("grad_out ", shape_of(a.grad_out), " does not match q ", shape_of(a.q));
    } else if (shape_of(a.grad_q) != shape_of(a.q) || shape_of(a.grad_k) != shape_of(a.k) ||
               shape_of(a.grad_v) != shape_of(a.v)) {
      problem = str_cat("grad_q/k/v ", shape_of(a.grad_q), ", ", shape_of(a.grad_k), ", ",
                        shape_of(a.grad_v), " do not match q/k/v ", shape_of(a.q), ", ",
                        shape_of(a.k), ", ", shape_of(a.v));
    }
  }
  // Grouped-query attention natively only when the gradients are shared like k and v
  // (attention_grads_shared): cuDNN's dK and dV come per key/value head, not per query head.
  if (problem.empty()) problem = common_problem(a.q, a.k, a.v, a.params, attention_grads_shared(a));
  if (problem.empty() && a.pieces != nullptr) {
    // cuDNN overwrites its gradients: over pieces the call must be one that overwrites, in
    // q's dtype.
    if (!a.overwrite_grads) return "pieces: the call must overwrite its gradients";
    for (const StridedView* grad : {&a.grad_q, &a.grad_k, &a.grad_v, &a.out, &a.grad_out}) {
      if (grad->dtype != a.q.dtype) return "pieces: out and the gradients must be q's dtype";
    }
    const std::vector<PieceTensor> tensors = piece_tensors(a);
    problem = pieces_problem(*a.pieces, a.params, tensors);
    if (problem.empty()) problem = piece_key_grads_problem(tensors);
  }
  return problem;
}

// Throws the error a valid call cuDNN cannot serve gets (kUnimplemented: the caller may try
// another kernel). Calls that break the contract itself fail before, in
// check_attention_forward_args / check_attention_backward_args.
void throw_unsupported(const char* op, const std::string& problem) {
  RD_FAIL(kUnimplemented, op, ": cuDNN attention does not support this call: ", problem);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Availability.

int cudnn_runtime_version() {
#if defined(RD_WITH_CUDNN)
  return loaded_cudnn().version;
#else
  return 0;
#endif
}

bool cudnn_attention_available() {
#if defined(RD_WITH_CUDNN)
  return loaded_cudnn().problem.empty();
#else
  return false;
#endif
}

bool cudnn_attention_supports(const AttentionForwardArgs& args, std::string* why_not) {
  std::string problem = forward_problem(args);
  if (why_not != nullptr) *why_not = problem;
  return problem.empty();
}

bool cudnn_attention_supports_backward(const AttentionBackwardArgs& args, std::string* why_not) {
  std::string problem = backward_problem(args);
  if (why_not != nullptr) *why_not = problem;
  return problem.empty();
}

#if !defined(RD_WITH_CUDNN)

void cudnn_attention_forward(const AttentionForwardArgs& args, Allocator&, cudaStream_t) {
  throw_unsupported("cudnn_attention_forward", forward_problem(args));
}
void cudnn_attention_backward(const AttentionBackwardArgs& args, Allocator&, cudaStream_t) {
  throw_unsupported("cudnn_attention_backward", backward_problem(args));
}
CudnnGraphCacheStats cudnn_graph_cache_stats() { return {}; }

#else  // RD_WITH_CUDNN

namespace {

using GraphKey = std::vector<int64_t>;

// The head dim of a [batch..., L, D] view (1 for an lse view [batch..., L]).
int64_t trailing_dim(const StridedView& v, bool has_head_dim) {
  return has_head_dim ? v.shape[v.ndim - 1] : 1;
}

// v ([batch..., L, D], or [batch..., L] when !has_head_dim) folded by `fold`. Strides of
// size-1 dims do not address anything; they are given the values of a packed layout so that
// cuDNN sees an ordinary one.
View4 fold_view(const StridedView& v, const BatchFold& fold, bool has_head_dim) {
  const int seq_dim = has_head_dim ? v.ndim - 2 : v.ndim - 1;
  View4 r;
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < fold.dims.size(); ++i) {
    (i < fold.outer_count ? outer : inner) *= v.shape[fold.dims[i]];
  }
  const int64_t head = trailing_dim(v, has_head_dim);
  const int64_t len = v.shape[seq_dim];
  r.dim = {outer, inner, len, head};
  r.stride[3] = 1;
  r.stride[2] = len == 1 ? head : v.strides[seq_dim];
  r.stride[1] = fold.outer_count < fold.dims.size() ? v.strides[fold.dims.back()]
                                                    : r.stride[2] * std::max<int64_t>(len, 1);
  r.stride[0] =
      fold.outer_count > 0 ? v.strides[fold.dims[fold.outer_count - 1]] : r.stride[1] * inner;
  return r;
}

// A contiguous view of `shape_like`'s shape and `dtype` over `data`.
StridedView contiguous_like(const StridedView& shape_like, DType dtype, void* data) {
  StridedView r = shape_like;
  r.dtype = dtype;
  r.data = data;
  int64_t stride = 1;
  for (int d = r.ndim - 1; d >= 0; --d) {
    r.strides[d] = stride;
    stride *= std::max<int64_t>(r.shape[d], 1);
  }
  return r;
}

// Whether v's strides are those of a packed row-major tensor (size-1 dims aside).
bool is_packed(const StridedView& v) {
  int64_t expected = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (v.shape[d] != 1 && v.strides[d] != expected) return false;
    expected *= v.shape[d];
  }
  return true;
}

size_t view_bytes(const StridedView& v, DType dtype) {
  return static_cast<size_t>(v.numel()) * dtype_size(dtype);
}

// ---------------------------------------------------------------------------------------
// cuDNN handles: a pool per device, since a handle must not be used by two threads at once.

class HandlePool {
 public:
  // Leaked on purpose (see the file comment).
  static HandlePool& instance() {
    static HandlePool* const pool = new HandlePool();
    return *pool;
  }

  // A handle for the current device `device`, created when none is free.
  cudnnHandle_t acquire(int device) {
    {
      absl::MutexLock lock(&mu_);
      std::vector<cudnnHandle_t>& free = free_[device];
      if (!free.empty()) {
        cudnnHandle_t handle = free.back();
        free.pop_back();
        return handle;
      }
    }
    cudnnHandle_t handle = nullptr;
    const cudnnStatus_t status = fe::detail::create_handle(&handle);
    RD_CHECK(status == CUDNN_STATUS_SUCCESS, kUnimplemented,
             "cuDNN attention: cudnnCreate on device ", device,
             " failed: ", fe::detail::get_error_string(status));
    return handle;
  }

  void release(int device, cudnnHandle_t handle) {
    absl::MutexLock lock(&mu_);
    free_[device].push_back(handle);
  }

 private:
  HandlePool() = default;
  absl::Mutex mu_;
  absl::flat_hash_map<int, std::vector<cudnnHandle_t>> free_ ABSL_GUARDED_BY(mu_);
};

// A pooled handle of the current device, bound to `stream`, for one scope.
class HandleLease {
 public:
  explicit HandleLease(cudaStream_t stream) {
    RD_CUDA_CHECK(cudaGetDevice(&device_));
    handle_ = HandlePool::instance().acquire(device_);
    const cudnnStatus_t status = fe::detail::set_stream(handle_, stream);
    if (status != CUDNN_STATUS_SUCCESS) {
      HandlePool::instance().release(device_, handle_);
      RD_FAIL(kInternal,
              "cuDNN attention: cudnnSetStream failed: ", fe::detail::get_error_string(status));
    }
  }
  ~HandleLease() {
    release_in_destructor("cuDNN attention: returning a handle to the pool",
                          [&] { HandlePool::instance().release(device_, handle_); });
  }
  HandleLease(const HandleLease&) = delete;
  HandleLease& operator=(const HandleLease&) = delete;
  cudnnHandle_t get() const { return handle_; }
  int device() const { return device_; }

 private:
  int device_ = 0;
  cudnnHandle_t handle_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// The graph cache.

// A built graph, or the message of a build cuDNN refused.
struct GraphEntry {
  std::shared_ptr<fe::graph::Graph> graph;  // null when the build failed
  std::string failure;
  int64_t workspace_bytes = 0;
  // Graph::execute is not documented as thread-safe; launches through one graph are
  // serialized (they only enqueue work, so this costs little).
  absl::Mutex execute_mu;
};

class GraphCache {
 public:
  static GraphCache& instance() {
    static GraphCache* const cache = new GraphCache();
    return *cache;
  }

  // The entry for `key`, built by `build` on a miss. Two threads missing the same key at
  // once both build; the first insert wins.
  template <class Build>
  std::shared_ptr<GraphEntry> get(const GraphKey& key, Build&& build) {
    {
      absl::MutexLock lock(&mu_);
      if (const auto* entry = entries_.find(key)) {
        ++stats_.hits;
        return *entry;
      }
    }
    std::shared_ptr<GraphEntry> built = build();
    absl::MutexLock lock(&mu_);
    ++stats_.builds;
    if (built->graph == nullptr) ++stats_.failures;
    const auto [stored, inserted] = entries_.insert(key, built);
    if (!inserted) return *stored;
    devices_.insert(key[1]);  // GraphSpec::key() puts the device second
    while (entries_.size() > capacity_) {
      // Destroying a graph unloads its runtime-compiled kernels (cuLibraryUnload), which
      // waits for every GPU of the process while holding the driver's library lock. When
      // one process drives several GPUs (ranks as threads), an NCCL kernel on another GPU
      // may be waiting for a rank thread that is blocked on that lock, building a graph of
      // its own: a deadlock (cuda_multi_gpu_test at P = 4 after P = 2). Such a process
      // keeps its evicted graphs until it exits; one GPU per process frees them at once.
      if (devices_.size() > 1) {
        retired_.push_back(std::move(entries_.oldest()));
        ++stats_.retired;
      }
      entries_.pop_oldest();
      ++stats_.evictions;
    }
    return built;
  }

  CudnnGraphCacheStats stats() {
    absl::MutexLock lock(&mu_);
    CudnnGraphCacheStats s = stats_;
    s.size = static_cast<int64_t>(entries_.size());
    s.capacity = static_cast<int64_t>(capacity_);
    return s;
  }

 private:
  GraphCache() : capacity_(capacity_from_environment()) {}

  // RD_CUDNN_GRAPH_CACHE: how many graphs to hold (each holds compiled kernels, a few MB of
  // device memory); read once. Unset: kDefaultGraphCacheCapacity. A bad value is an error
  // naming the variable, at the first cuDNN attention call.
  static size_t capacity_from_environment() {
    const char* text = std::getenv("RD_CUDNN_GRAPH_CACHE");
    if (text == nullptr || *text == '\0') return kDefaultGraphCacheCapacity;
    const std::optional<size_t> value = number_from_text<size_t>(text);
    RD_CHECK(value && *value >= 1, kInvalidArgument,
             "RD_CUDNN_GRAPH_CACHE must be a whole number >= 1, got '", text, "'");
    return *value;
  }
  const size_t capacity_;
  absl::Mutex mu_;
  kernels::LruMap<GraphKey, std::shared_ptr<GraphEntry>> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int64_t> devices_ ABSL_GUARDED_BY(mu_);  // that built a graph
  std::vector<std::shared_ptr<GraphEntry>> retired_ ABSL_GUARDED_BY(mu_);
  CudnnGraphCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------------------
// Graph description and building.

// A call over pieces: each tensor's ragged offsets are tensor uid + kOffsetUid, and the
// pieces' query and key lengths kSeqLenQ and kSeqLenKv (int32, on the device).
constexpr int64_t kOffsetUid = 100, kSeqLenQ = 200, kSeqLenKv = 201;
enum class Direction : int64_t { kForward, kBackward };

// Everything a graph depends on; its fields, flattened, are the cache key.
struct GraphSpec {
  Direction direction = Direction::kForward;
  int device = 0;
  DType dtype = DType::kBFloat16;
  bool causal = false;      // after folding offsets that mask nothing into non-causal
  int64_t right_bound = 0;  // the causal offset
  float scale = 1.0f;
  bool stats = true;  // forward: whether the lse is written
  bool ragged = false;  // a call over pieces: padding mask, per-piece lengths and offsets
  // [uid] -> layout; forward uses q, k, v, o, stats; backward all but the gradients' inputs.
  std::vector<std::pair<TensorUid, View4>> tensors;

  GraphKey key() const {
    GraphKey k = {
        static_cast<int64_t>(direction), device, static_cast<int64_t>(dtype), causal, right_bound,
        std::bit_cast<int32_t>(scale),   stats, ragged};
    for (const auto& [uid, view] : tensors) {
      k.push_back(uid);
      k.insert(k.end(), view.dim.begin(), view.dim.end());
      k.insert(k.end(), view.stride.begin(), view.stride.end());
    }
    return k;
  }
  const View4& view(TensorUid uid) const {
    for (const auto& [u, v] : tensors) {
      if (u == uid) return v;
    }
    RD_FAIL(kInternal, "cuDNN attention: graph spec has no tensor ", static_cast<int>(uid));
  }
};

std::vector<int64_t> as_vector(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }

std::shared_ptr<fe::graph::Tensor_attributes> add_input(fe::graph::Graph& graph,
                                                        const GraphSpec& spec, TensorUid uid,
                                                        const char* name) {
  const View4& v = spec.view(uid);
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(as_vector(v.dim))
                          .set_stride(as_vector(v.stride)));
}

void mark_output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, const GraphSpec& spec,
                 TensorUid uid, std::optional<fe::DataType_t> dtype = std::nullopt) {
  const View4& v = spec.view(uid);
  t->set_output(true).set_uid(uid).set_dim(as_vector(v.dim)).set_stride(as_vector(v.stride));
  if (dtype) t->set_data_type(*dtype);
}

// An int32 [n, 1, 1, 1] index tensor (per-piece lengths, ragged offsets).
std::shared_ptr<fe::graph::Tensor_attributes> index_tensor(fe::graph::Graph& graph, int64_t uid,
                                                           int64_t n, const char* name) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({n, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

// Gives `t` its ragged offsets (one per piece and one past the last).
void set_ragged(fe::graph::Graph& graph, const GraphSpec& spec,
                const std::shared_ptr<fe::graph::Tensor_attributes>& t, TensorUid uid) {
  if (!spec.ragged) return;
  t->set_ragged_offset(index_tensor(graph, uid + kOffsetUid, spec.view(kQ).dim[0] + 1, "offsets"));
}

// The padding mask of a call over pieces: each piece's query and key count.
template <typename Attributes>
void set_piece_lengths(fe::graph::Graph& graph, const GraphSpec& spec, Attributes& options) {
  if (!spec.ragged) return;
  const int64_t pieces = spec.view(kQ).dim[0];
  options.set_padding_mask(true)
      .set_seq_len_q(index_tensor(graph, kSeqLenQ, pieces, "seq_len_q"))
      .set_seq_len_kv(index_tensor(graph, kSeqLenKv, pieces, "seq_len_kv"));
}

void describe_forward(fe::graph::Graph& graph, const GraphSpec& spec) {
  auto q = add_input(graph, spec, kQ, "q");
  auto k = add_input(graph, spec, kK, "k");
  auto v = add_input(graph, spec, kV, "v");
  auto options = fe::graph::SDPA_attributes()
                     .set_name("sdpa")
                     .set_generate_stats(spec.stats)
                     .set_attn_scale(spec.scale);
  if (spec.causal) {
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(static_cast<int>(spec.right_bound));
  }
  set_piece_lengths(graph, spec, options);
  set_ragged(graph, spec, q, kQ);
  set_ragged(graph, spec, k, kK);
  set_ragged(graph, spec, v, kV);
  auto [o, stats] = graph.sdpa(q, k, v, options);
  mark_output(o, spec, kO);
  set_ragged(graph, spec, o, kO);
  if (spec.stats) {
    mark_output(stats, spec, kStats, fe::DataType_t::FLOAT);
    set_ragged(graph, spec, stats, kStats);
  }
}

void describe_backward(fe::graph::Graph& graph, const GraphSpec& spec) {
  auto q = add_input(graph, spec, kQ, "q");
  auto k = add_input(graph, spec, kK, "k");
  auto v = add_input(graph, spec, kV, "v");
  auto o = add_input(graph, spec, kO, "o");
  auto grad_o = add_input(graph, spec, kGradO, "grad_o");
  auto stats = add_input(graph, spec, kStats, "stats");
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options =
      fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(spec.scale);
  if (spec.causal) {
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(static_cast<int>(spec.right_bound));
  }
  set_piece_lengths(graph, spec, options);
  for (auto [t, uid] : {std::pair{q, kQ}, std::pair{k, kK}, std::pair{v, kV}, std::pair{o, kO},
                        std::pair{grad_o, kGradO}, std::pair{stats, kStats}}) {
    set_ragged(graph, spec, t, uid);
  }
  auto [grad_q, grad_k, grad_v] = graph.sdpa_backward(q, k, v, o, grad_o, stats, options);
  mark_output(grad_q, spec, kGradQ);
  mark_output(grad_k, spec, kGradK);
  mark_output(grad_v, spec, kGradV);
  set_ragged(graph, spec, grad_q, kGradQ);
  set_ragged(graph, spec, grad_k, kGradK);
  set_ragged(graph, spec, grad_v, kGradV);
}

// Builds the graph of `spec`; a refusal is returned as an entry with the failing step and
// cuDNN's message, not thrown, so that it can be cached.
std::shared_ptr<GraphEntry> build_graph(const GraphSpec& spec, cudnnHandle_t handle) {
  auto entry = std::make_shared<GraphEntry>();
  auto graph = std::make_shared<fe::graph::Graph>();
  const char* step = "describe";
  auto fail = [&](const std::string& message) {
    entry->failure = str_cat("cuDNN could not build the ",
                             spec.direction == Direction::kForward ? "forward" : "backward",
                             " SDPA graph (", step, "): ", message);
    return entry;
  };
  try {
    graph
        ->set_io_data_type(spec.dtype == DType::kBFloat16 ? fe::DataType_t::BFLOAT16
                                                          : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    if (spec.direction == Direction::kForward) {
      describe_forward(*graph, spec);
    } else {
      describe_backward(*graph, spec);
    }
    fe::error_t status;
    step = "validate";
    if (status = graph->validate(); status.is_bad()) return fail(status.get_message());
    step = "build_operation_graph";
    if (status = graph->build_operation_graph(handle); status.is_bad()) {
      return fail(status.get_message());
    }
    step = "create_execution_plans";
    if (status = graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
        status.is_bad()) {
      return fail(status.get_message());
    }
    step = "check_support";
    if (status = graph->check_support(handle); status.is_bad()) return fail(status.get_message());
    step = "build_plans";
    if (status = graph->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); status.is_bad()) {
      return fail(status.get_message());
    }
    step = "get_workspace_size";
    if (status = graph->get_workspace_size(entry->workspace_bytes); status.is_bad()) {
      return fail(status.get_message());
    }
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  entry->graph = std::move(graph);
  return entry;
}

// Finds or builds the graph of `spec` and runs it on `stream` with `pointers` (uid -> data).
void run_graph(const char* op, const GraphSpec& spec, std::unordered_map<int64_t, void*> pointers,
               Allocator& scratch, cudaStream_t stream) {
  HandleLease handle(stream);
  std::shared_ptr<GraphEntry> entry =
      GraphCache::instance().get(spec.key(), [&] { return build_graph(spec, handle.get()); });
  RD_CHECK(entry->graph != nullptr, kUnimplemented, op, ": ", entry->failure);
  ScratchBuffer workspace(scratch, static_cast<size_t>(entry->workspace_bytes));
  fe::error_t status;
  try {
    absl::MutexLock lock(&entry->execute_mu);
    status = entry->graph->execute(handle.get(), pointers, workspace.get());
  } catch (const std::exception& e) {
    RD_FAIL(kInternal, op, ": cuDNN SDPA execution threw: ", e.what());
  }
  RD_CHECK(status.is_good(), kInternal, op,
           ": cuDNN SDPA execution failed: ", status.get_message());
}

// The spec fields shared by both directions.
GraphSpec base_spec(Direction direction, const StridedView& k, DType dtype,
                    const AttentionParams& params, int device) {
  GraphSpec spec;
  spec.direction = direction;
  spec.device = device;
  spec.dtype = dtype;
  const int64_t keys = k.shape[k.ndim - 2];
  // An offset that lets every query see every key masks nothing.
  spec.causal = params.causal && params.causal_offset < keys - 1;
  spec.right_bound = spec.causal ? params.causal_offset : 0;
  spec.scale = static_cast<float>(params.scale);
  return spec;
}

// A view cuDNN uses in place when it can, else a contiguous copy in scratch memory in
// `dtype` (an input is copied in before the graph runs; an output back after).
class Staged {
 public:
  // `packed`: stage unless the view is already a packed row-major tensor (cuDNN before 9.26
  // takes the backward's softmax stats only packed, and a dilated selection of the LSE is not).
  Staged(const StridedView& view, DType dtype, bool has_head_dim, const BatchFold& fold,
         bool copy_in, Allocator& scratch, cudaStream_t stream, bool packed = false)
      : user_(view), view_(view) {
    if (view.dtype == dtype && fold_fits(view, fold) &&
        layout_problem("", view, has_head_dim).empty() && (!packed || is_packed(view))) {
      return;
    }
    buffer_.emplace(scratch, view_bytes(view, dtype));
    view_ = contiguous_like(view, dtype, buffer_->get());
    if (copy_in) copy(view_, user_, stream);
  }
  const StridedView& view() const { return view_; }
  // Copies a staged output back into the caller's view.
  void copy_out(cudaStream_t stream) const {
    if (buffer_) copy(user_, view_, stream);
  }

 private:
  StridedView user_, view_;
  std::optional<ScratchBuffer> buffer_;
};

// Where cuDNN writes one gradient. cuDNN overwrites its outputs: where the call overwrites
// too (and the gradient is q's dtype in a layout cuDNN takes) it writes the view directly;
// otherwise into scratch, then added into the view (a call that accumulates) or copied
// there (one that overwrites).
class GradientTarget {
 public:
  GradientTarget(const StridedView& grad, DType dtype, const BatchFold& fold, bool overwrite,
                 Allocator& scratch)
      : user_(grad), view_(grad), overwrite_(overwrite) {
    if (overwrite && grad.dtype == dtype && fold_fits(grad, fold) &&
        layout_problem("", grad, true).empty()) {
      return;
    }
    buffer_.emplace(scratch, view_bytes(grad, dtype));
    view_ = contiguous_like(grad, dtype, buffer_->get());
  }
  const StridedView& view() const { return view_; }
  // Moves a staged gradient into the caller's view.
  void finish(cudaStream_t stream) const {
    if (!buffer_) return;
    if (overwrite_) {
      copy(user_, view_, stream);
    } else {
      accumulate(user_, view_, stream);  // a float32 user_ reads view_ widened
    }
  }

 private:
  StridedView user_, view_;
  bool overwrite_ = false;
  std::optional<ScratchBuffer> buffer_;
};

int current_device() {
  int device = 0;
  RD_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// ---------------------------------------------------------------------------------------
// Calls over pieces (AttentionPieces): one graph over every piece, each tensor addressed
// through per-piece ragged offsets and a padding mask of per-piece lengths.

int64_t next_power_of_two(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// The graph's piece count and row counts, rounded up to powers of two so that calls whose
// pieces differ (each batch of documents does) share a few graphs; padding pieces have no
// rows.
struct PieceShape {
  int64_t pieces = 1, q_rows = 1, k_rows = 1;
};

// Fewer rows would buy nothing (a tile is 64 or 128 rows) and cuDNN's backward refuses
// s_q = s_kv = 1.
constexpr int64_t kMinPieceRows = 64;

PieceShape piece_shape(const AttentionPieces& p) {
  const auto most = [](const std::vector<int64_t>& rows) {
    return next_power_of_two(std::max(kMinPieceRows, *std::max_element(rows.begin(), rows.end())));
  };
  PieceShape shape;
  shape.pieces = next_power_of_two(p.count());
  shape.q_rows = most(p.q_rows);
  shape.k_rows = most(p.k_rows);
  return shape;
}

// A [B, H, 1, D] view (lse [B, H, 1]) as the graph's [pieces, H, rows, D]. Each piece starts
// at its ragged offset; the batch stride given is that of packed rows.
View4 piece_view(const StridedView& v, int64_t pieces, int64_t rows) {
  View4 r;
  r.dim = {pieces, v.shape[1], rows, v.ndim == 4 ? v.shape[3] : 1};
  r.stride = {rows * v.strides[2], v.strides[1], v.strides[2], 1};
  return r;
}

// The pieces [first, end) of one graph: the most that every tensor addresses within int32
// offsets of their lowest start (cuDNN's ragged offsets are int32), at least one.
size_t chunk_end(const AttentionPieces& p, const std::vector<PieceTensor>& tensors, size_t first) {
  const size_t n = p.batch_row.size();
  std::vector<std::pair<int64_t, int64_t>> span(tensors.size(), {INT64_MAX, INT64_MIN});
  size_t end = first;
  for (; end < n; ++end) {
    bool fits = true;
    std::vector<std::pair<int64_t, int64_t>> grown = span;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const auto [begin, stop] = piece_span(p, tensors[t], end);
      grown[t] = {std::min(grown[t].first, begin), std::max(grown[t].second, stop)};
      fits = fits && grown[t].second - grown[t].first <= std::numeric_limits<int32_t>::max();
    }
    if (!fits && end > first) break;
    span = std::move(grown);
  }
  return end;
}

AttentionPieces slice(const AttentionPieces& p, size_t first, size_t end) {
  auto part = [&](const std::vector<int64_t>& v) {
    return std::vector<int64_t>(v.begin() + static_cast<std::ptrdiff_t>(first),
                                v.begin() + static_cast<std::ptrdiff_t>(end));
  };
  AttentionPieces s;
  s.step = p.step;
  s.batch_row = part(p.batch_row);
  s.q_position = part(p.q_position);
  s.q_rows = part(p.q_rows);
  s.k_position = part(p.k_position);
  s.k_rows = part(p.k_rows);
  s.q_head_step = p.q_head_step;
  s.k_head_step = p.k_head_step;
  if (p.has_heads()) {
    s.q_head = part(p.q_head);
    s.k_head = part(p.k_head);
  }
  return s;
}

// The per-piece lengths and each tensor's ragged offsets (elements from its base, the lowest
// start of its pieces), in one int32 device buffer; padding pieces repeat the last offset
// with no rows.
class PieceTables {
 public:
  PieceTables(const AttentionPieces& p, const PieceShape& shape,
              const std::vector<PieceTensor>& tensors, Allocator& scratch, cudaStream_t stream) {
    const auto n = static_cast<size_t>(p.count()), padded = static_cast<size_t>(shape.pieces);
    std::vector<int32_t> host(2 * padded, 0);
    for (size_t i = 0; i < n; ++i) {
      host[i] = static_cast<int32_t>(p.q_rows[i]);
      host[padded + i] = static_cast<int32_t>(p.k_rows[i]);
    }
    for (const PieceTensor& t : tensors) {
      int64_t base = INT64_MAX;
      for (size_t i = 0; i < n; ++i) base = std::min(base, piece_span(p, t, i).first);
      tensors_.push_back(
          {t.uid, host.size(), base * static_cast<int64_t>(dtype_size(t.view.dtype))});
      int64_t offset = 0;
      for (size_t i = 0; i <= padded; ++i) {
        if (i < n) offset = piece_span(p, t, i).first - base;
        host.push_back(static_cast<int32_t>(offset));
      }
    }
    const size_t bytes = host.size() * sizeof(int32_t);
    device_.emplace(scratch, bytes);
    // Pageable source: the call returns once the table is staged, so `host` may go.
    RD_CUDA_CHECK(
        cudaMemcpyAsync(device_->get(), host.data(), bytes, cudaMemcpyHostToDevice, stream));
    padded_ = padded;
  }

  // Each tensor's base (its data moved to the lowest start) and the tables' addresses.
  void add_pointers(const std::vector<PieceTensor>& tensors,
                    std::unordered_map<int64_t, void*>& pointers) const {
    auto* table = static_cast<int32_t*>(device_->get());
    pointers[kSeqLenQ] = table;
    pointers[kSeqLenKv] = table + padded_;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorEntry& e = tensors_[t];
      pointers[e.uid] = static_cast<char*>(tensors[t].view.data) + e.base_bytes;
      pointers[e.uid + kOffsetUid] = table + e.at;
    }
  }

 private:
  struct TensorEntry {
    TensorUid uid;
    size_t at;           // where its offsets start in the table
    int64_t base_bytes;  // its lowest start, in bytes from its view's data
  };
  std::optional<ScratchBuffer> device_;
  size_t padded_ = 0;
  std::vector<TensorEntry> tensors_;
};

// Runs the graph of `pieces` on `tensors` (each read or written in place).
void run_piece_graph(const char* op, Direction direction, const AttentionPieces& pieces,
                     const AttentionParams& params, DType dtype,
                     const std::vector<PieceTensor>& tensors, Allocator& scratch,
                     cudaStream_t stream) {
  const PieceShape shape = piece_shape(pieces);
  GraphSpec spec;
  spec.direction = direction;
  spec.device = current_device();
  spec.dtype = dtype;
  spec.causal = params.causal;  // causal pieces are their own keys (pieces_problem)
  spec.scale = static_cast<float>(params.scale);
  spec.ragged = true;
  for (const PieceTensor& t : tensors) {
    spec.tensors.push_back(
        {t.uid, piece_view(t.view, shape.pieces, t.role == 'q' ? shape.q_rows : shape.k_rows)});
  }
  std::unordered_map<int64_t, void*> pointers;
  const PieceTables tables(pieces, shape, tensors, scratch, stream);
  tables.add_pointers(tensors, pointers);
  run_graph(op, spec, std::move(pointers), scratch, stream);
}

// A call over pieces, as one graph per run of pieces that int32 offsets reach.
void run_pieces(const char* op, Direction direction, const AttentionPieces& pieces,
                const AttentionParams& params, DType dtype, const std::vector<PieceTensor>& tensors,
                Allocator& scratch, cudaStream_t stream) {
  const size_t n = pieces.batch_row.size();
  for (size_t first = 0; first < n;) {
    const size_t end = chunk_end(pieces, tensors, first);
    run_piece_graph(op, direction, slice(pieces, first, end), params, dtype, tensors, scratch,
                    stream);
    first = end;
  }
}

}  // namespace

void cudnn_attention_forward(const AttentionForwardArgs& args, Allocator& scratch,
                             cudaStream_t stream) {
  constexpr const char* kOp = "cudnn_attention_forward";
  check_attention_forward_args(args);  // the contract every kernel holds its callers to
  const std::string problem = forward_problem(args);
  if (!problem.empty()) throw_unsupported(kOp, problem);
  if (args.q.numel() == 0) return;
  if (args.pieces != nullptr) {
    run_pieces(kOp, Direction::kForward, *args.pieces, args.params, args.q.dtype,
               piece_tensors(args), scratch, stream);
    return;
  }

  if (const int d = peeled_batch_dim(args.q, args.k, args.v, true); d >= 0) {
    for (int64_t i = 0; i < args.q.shape[d]; ++i) {
      AttentionForwardArgs entry = args;
      for (StridedView* view : {&entry.q, &entry.k, &entry.v, &entry.out, &entry.lse}) {
        *view = at_index(*view, d, i);
      }
      cudnn_attention_forward(entry, scratch, stream);
    }
    return;
  }

  // Grouped-query attention runs natively: k and v fold to their own heads (CallFold).
  const CallFold fold = *find_call_fold(args.q, args.k, args.v, /*allow_broadcast=*/true);
  const bool with_lse = args.lse.data != nullptr;
  Staged out(args.out, args.q.dtype, true, fold.q, false, scratch, stream);
  std::optional<Staged> lse;
  if (with_lse) lse.emplace(args.lse, DType::kFloat32, false, fold.q, false, scratch, stream);

  GraphSpec spec =
      base_spec(Direction::kForward, args.k, args.q.dtype, args.params, current_device());
  spec.stats = with_lse;
  spec.tensors = {{kQ, fold_view(args.q, fold.q, true)},
                  {kK, fold_view(args.k, fold.kv, true)},
                  {kV, fold_view(args.v, fold.kv, true)},
                  {kO, fold_view(out.view(), fold.q, true)}};
  std::unordered_map<int64_t, void*> pointers = {
      {kQ, args.q.data}, {kK, args.k.data}, {kV, args.v.data}, {kO, out.view().data}};
  if (with_lse) {
    spec.tensors.push_back({kStats, fold_view(lse->view(), fold.q, false)});
    pointers[kStats] = lse->view().data;
  }
  run_graph(kOp, spec, std::move(pointers), scratch, stream);
  out.copy_out(stream);
  if (with_lse) lse->copy_out(stream);
}

void cudnn_attention_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                              cudaStream_t stream) {
  constexpr const char* kOp = "cudnn_attention_backward";
  check_attention_backward_args(args);  // e.g. gradients repeat only where k and v do
  const std::string problem = backward_problem(args);
  if (!problem.empty()) throw_unsupported(kOp, problem);
  if (args.q.numel() == 0) {  // no query: no gradient (an overwritten one is zero)
    for (const StridedView* grad : overwritten_grads(args)) fill(*grad, 0.0, stream);
    return;
  }
  if (args.pieces != nullptr) {  // an overwriting call: written in place
    run_pieces(kOp, Direction::kBackward, *args.pieces, args.params, args.q.dtype,
               piece_tensors(args), scratch, stream);
    return;
  }

  const DType dtype = args.q.dtype;
  // Shared gradients (grouped-query attention): k, v and their gradients as their own heads,
  // the shared dims cut to size 1, so that cuDNN's dK and dV land once per key/value head.
  const bool shared = attention_grads_shared(args);
  if (const int d = peeled_batch_dim(args.q, args.k, args.v, shared); d >= 0) {
    // Each entry's gradients are its own, so an entry may overwrite them as the call does:
    // gradients repeat only along k's broadcast dims (check_attention_backward_args) and
    // peeled_batch_dim refuses a d along which k or v repeat.
    for (int64_t i = 0; i < args.q.shape[d]; ++i) {
      AttentionBackwardArgs entry = args;
      for (StridedView* view :
           {&entry.q, &entry.k, &entry.v, &entry.out, &entry.lse, &entry.grad_out, &entry.grad_lse,
            &entry.grad_q, &entry.grad_k, &entry.grad_v}) {
        *view = at_index(*view, d, i);
      }
      cudnn_attention_backward(entry, scratch, stream);
    }
    return;
  }
  const CallFold fold = *find_call_fold(args.q, args.k, args.v, shared);
  const auto own = [shared](const StridedView& v) {
    return shared ? without_broadcast_dims(v) : v;
  };
  const Staged out(args.out, dtype, true, fold.q, true, scratch, stream);
  const Staged grad_out(args.grad_out, dtype, true, fold.q, true, scratch, stream);
  const Staged lse(args.lse, DType::kFloat32, false, fold.q, true, scratch, stream,
                   /*packed=*/true);
  const GradientTarget grad_q(args.grad_q, dtype, fold.q, overwrites_grad_q(args), scratch);
  const GradientTarget grad_k(own(args.grad_k), dtype, fold.kv, args.overwrite_grads, scratch);
  const GradientTarget grad_v(own(args.grad_v), dtype, fold.kv, args.overwrite_grads, scratch);

  GraphSpec spec = base_spec(Direction::kBackward, args.k, dtype, args.params, current_device());
  spec.tensors = {{kQ, fold_view(args.q, fold.q, true)},
                  {kK, fold_view(own(args.k), fold.kv, true)},
                  {kV, fold_view(own(args.v), fold.kv, true)},
                  {kO, fold_view(out.view(), fold.q, true)},
                  {kGradO, fold_view(grad_out.view(), fold.q, true)},
                  {kStats, fold_view(lse.view(), fold.q, false)},
                  {kGradQ, fold_view(grad_q.view(), fold.q, true)},
                  {kGradK, fold_view(grad_k.view(), fold.kv, true)},
                  {kGradV, fold_view(grad_v.view(), fold.kv, true)}};
  run_graph(kOp, spec,
            {{kQ, args.q.data},
             {kK, args.k.data},
             {kV, args.v.data},
             {kO, out.view().data},
             {kGradO, grad_out.view().data},
             {kStats, lse.view().data},
             {kGradQ, grad_q.view().data},
             {kGradK, grad_k.view().data},
             {kGradV, grad_v.view().data}},
            scratch, stream);
  for (const GradientTarget* grad : {&grad_q, &grad_k, &grad_v}) grad->finish(stream);
}

CudnnGraphCacheStats cudnn_graph_cache_stats() { return GraphCache::instance().stats(); }

#endif  // RD_WITH_CUDNN

}  // namespace rd::kernels::cuda
