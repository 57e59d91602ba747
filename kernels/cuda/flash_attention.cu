// The host side of the kFlash attention path: support checks with reasons, kernel
// parameters from StridedViews (strides, alignment, dropout threshold) and the scratch of
// the backward. The kernels are in flash_forward.cu and flash_backward.cu.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ringdilated/kernels/cuda/flash_attention.h"
#include "ringdilated/kernels/cuda/flash_common.cuh"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

using flash::BackwardParams;
using flash::ForwardParams;
using flash::Operand;
using flash::Problem;

constexpr int64_t kMaxGrid = 2147483647;

bool refuse(std::string* why_not, std::string reason) {
  if (why_not != nullptr) *why_not = std::move(reason);
  return false;
}

int batch_dims(const StridedView& q) { return q.ndim - 2; }

int64_t batch_count(const StridedView& q) {
  int64_t n = 1;
  for (int d = 0; d < batch_dims(q); ++d) n *= q.shape[d];
  return n;
}

// The checks both directions share: dtype, head dim, unit-stride head dims, the device.
bool supports_common(const StridedView& q,
                     std::initializer_list<std::pair<const char*, const StridedView*>> views,
                     size_t smem_bytes, int64_t blocks_bound, std::string* why_not) {
  if (q.ndim < 2) return refuse(why_not, str_cat("argument 'q' has ", q.ndim, " dims, needs >= 2"));
  if (q.dtype != DType::kFloat32 && q.dtype != DType::kBFloat16 && q.dtype != DType::kFloat16) {
    return refuse(why_not, str_cat("flash attention serves float32, bfloat16 and float16, "
                                   "argument 'q' is ",
                                   dtype_name(q.dtype)));
  }
  const int64_t d = q.shape[q.ndim - 1];
  if (d > 256) {
    return refuse(why_not, str_cat("head dim D = ", d,
                                   " of argument 'q' is over 256, the "
                                   "largest flash bucket"));
  }
  for (const auto& [name, view] : views) {
    if (view->ndim >= 1 && view->shape[view->ndim - 1] > 1 && view->strides[view->ndim - 1] != 1) {
      return refuse(why_not, str_cat("argument '", name, "' has head-dim stride ",
                                     view->strides[view->ndim - 1],
                                     "; flash attention needs a unit-stride head dim"));
    }
  }
  if (blocks_bound > kMaxGrid) {
    return refuse(
        why_not, str_cat("the problem needs ", blocks_bound, " thread blocks, over one CUDA grid"));
  }
  int device = 0, major = 0, minor = 0, smem_optin = 0;
  RD_CUDA_CHECK(cudaGetDevice(&device));
  RD_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RD_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  RD_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (major < 8) {
    return refuse(why_not, str_cat("flash attention needs compute capability 8.0 or newer, "
                                   "device ",
                                   device, " is ", major, ".", minor));
  }
  if (smem_bytes > static_cast<size_t>(smem_optin)) {
    return refuse(why_not, str_cat("the ", dtype_name(q.dtype), " D = ", d, " kernel needs ",
                                   smem_bytes, " bytes of shared memory per block, device ", device,
                                   " allows ", smem_optin));
  }
  return true;
}

flash::BatchShape batch_shape(const StridedView& q) {
  flash::BatchShape s;
  s.ndim = batch_dims(q);
  for (int d = 0; d < s.ndim; ++d) s.shape[d] = q.shape[d];
  return s;
}

Problem make_problem(const StridedView& q, const StridedView& k, const AttentionParams& params) {
  Problem pr;
  pr.batch = batch_shape(q);
  pr.batch_count = batch_count(q);
  pr.lq = q.shape[q.ndim - 2];
  pr.lk = k.shape[k.ndim - 2];
  pr.d = static_cast<int>(q.shape[q.ndim - 1]);
  pr.scale = static_cast<float>(params.scale);
  pr.scale_log2 = static_cast<float>(params.scale * 1.4426950408889634);
  pr.causal = params.causal;
  // As the math kernels: an offset of lk or more shows every key, one of -(lq + 1) or less
  // none, so clamping keeps the mask and keeps the kernels' index arithmetic from
  // overflowing on huge offsets.
  pr.causal_offset = std::clamp<int64_t>(params.causal_offset, -(pr.lq + 1), pr.lk);
  pr.dropout = params.dropout > 0.0;
  if (pr.dropout) {
    // philox_bernoulli(1 - dropout) keeps iff (w0 >> 8) * 2^-24 < 1 - dropout, i.e. iff the
    // integer (w0 >> 8) is below ceil((1 - dropout) * 2^24) (scaling by 2^24 is exact).
    const double keep = 1.0 - params.dropout;
    pr.keep_threshold = static_cast<uint32_t>(std::ceil(keep * 16777216.0));
    pr.keep_rescale = static_cast<float>(1.0 / keep);
  }
  pr.seed = params.seed;
  pr.offset = params.offset;
  pr.numbering = resolve_dropout_indexing(params.dropout_indexing, pr.batch.shape, pr.batch.ndim,
                                          pr.lq, pr.lk);
  return pr;
}

// Whether the element offsets of every row and the data pointer are multiples of `elems`
// elements (alignment of `elems * size` bytes), with D a multiple of `elems` too.
bool rows_aligned(const StridedView& v, int row_dims, int64_t d, int64_t elems) {
  const auto size = static_cast<int64_t>(dtype_size(v.dtype));
  if (reinterpret_cast<uintptr_t>(v.data) % static_cast<uintptr_t>(elems * size) != 0) return false;
  if (d % elems != 0) return false;
  for (int i = 0; i < row_dims; ++i) {
    if (v.shape[i] > 1 && v.strides[i] % elems != 0) return false;
  }
  return true;
}

// A [batch..., rows, D] view (or a [batch..., rows] statistic when `statistic`).
Operand make_operand(const StridedView& v, int nb, bool statistic = false) {
  Operand op;
  op.data = v.data;
  op.is_float32 = v.dtype == DType::kFloat32;
  for (int i = 0; i < nb; ++i) op.batch_strides[i] = v.shape[i] == 1 ? 0 : v.strides[i];
  op.row_stride = v.shape[nb] == 1 ? 0 : v.strides[nb];
  if (!statistic) {
    const int64_t d = v.shape[nb + 1];
    const int64_t chunk = 16 / static_cast<int64_t>(dtype_size(v.dtype));
    op.vec = rows_aligned(v, nb + 1, d, chunk);
    op.pairs = rows_aligned(v, nb + 1, d, 2);
  }
  return op;
}

// A contiguous float32 [batch..., lq, d] operand at `data` (the dQ scratch).
Operand contiguous_operand(void* data, const StridedView& q) {
  Operand op;
  op.data = data;
  op.is_float32 = true;
  const int nb = batch_dims(q);
  int64_t stride = q.shape[nb] * q.shape[nb + 1];
  for (int i = nb - 1; i >= 0; --i) {
    op.batch_strides[i] = stride;
    stride *= q.shape[i];
  }
  op.row_stride = q.shape[nb + 1];
  op.vec = q.shape[nb + 1] % 4 == 0;  // cudaMalloc'd: rows of whole 16-byte chunks are aligned
  op.pairs = q.shape[nb + 1] % 2 == 0;
  return op;
}

// Forward or backward params with the problem and the inputs both read (q, k, v, out) set
// from `args`, an AttentionForwardArgs or AttentionBackwardArgs.
template <class Params, class Args>
Params params_with_inputs(const Args& args) {
  const int nb = batch_dims(args.q);
  Params p;
  p.pr = make_problem(args.q, args.k, args.params);
  p.q = make_operand(args.q, nb);
  p.k = make_operand(args.k, nb);
  p.v = make_operand(args.v, nb);
  p.out = make_operand(args.out, nb);
  return p;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr const char* kKeyOrderRefusal =
    "a key_order is given (flash tiles read keys in storage order; the math path takes one)";

}  // namespace

bool flash_attention_supports(const AttentionForwardArgs& args, std::string* why_not) {
  const StridedView& q = args.q;
  if (q.ndim < 2) return refuse(why_not, str_cat("argument 'q' has ", q.ndim, " dims, needs >= 2"));
  if (args.params.key_order != nullptr) return refuse(why_not, kKeyOrderRefusal);
  // The forward folds the scale into exp2 after taking the row max of the raw scores,
  // which needs scale > 0 (the backward takes any scale).
  if (!(args.params.scale > 0)) {
    return refuse(why_not,
                  str_cat("flash attention needs a positive scale, got ", args.params.scale));
  }
  const int d = static_cast<int>(std::min<int64_t>(q.shape[q.ndim - 1], 1 << 20));
  // 64 is the smallest query tile of any forward config: a bound on the grid.
  const int64_t blocks = ceil_div(q.shape[q.ndim - 2], 64) * batch_count(q);
  return supports_common(q, {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"out", &args.out}},
                         flash::forward_smem_bytes(q.dtype, d), blocks, why_not);
}

bool flash_attention_supports_backward(const AttentionBackwardArgs& args, std::string* why_not) {
  const StridedView& q = args.q;
  if (q.ndim < 2) return refuse(why_not, str_cat("argument 'q' has ", q.ndim, " dims, needs >= 2"));
  if (args.params.key_order != nullptr) return refuse(why_not, kKeyOrderRefusal);
  const int d = static_cast<int>(std::min<int64_t>(q.shape[q.ndim - 1], 1 << 20));
  // 32 is the smallest key tile of any backward config; rows go 8 to a block elsewhere.
  const int64_t blocks = std::max(ceil_div(args.k.shape[args.k.ndim - 2], 32) * batch_count(q),
                                  ceil_div(q.shape[q.ndim - 2] * batch_count(q), 8));
  return supports_common(q,
                         {{"q", &args.q},
                          {"k", &args.k},
                          {"v", &args.v},
                          {"out", &args.out},
                          {"grad_out", &args.grad_out},
                          {"grad_q", &args.grad_q},
                          {"grad_k", &args.grad_k},
                          {"grad_v", &args.grad_v}},
                         flash::backward_smem_bytes(q.dtype, d), blocks, why_not);
}

void flash_attention_forward(const AttentionForwardArgs& args, cudaStream_t stream) {
  check_attention_forward_args(args);
  std::string why_not;
  RD_CHECK(flash_attention_supports(args, &why_not), kUnimplemented,
           "flash_attention_forward: ", why_not);
  auto p = params_with_inputs<ForwardParams>(args);
  if (p.pr.batch_count == 0 || p.pr.lq == 0) return;
  if (args.lse.data != nullptr) {
    p.lse = make_operand(args.lse, batch_dims(args.q), /*statistic=*/true);
  }
  flash::launch_forward(args.q.dtype, p, stream);
}

void flash_attention_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                              cudaStream_t stream) {
  check_attention_backward_args(args);
  std::string why_not;
  RD_CHECK(flash_attention_supports_backward(args, &why_not), kUnimplemented,
           "flash_attention_backward: ", why_not);
  auto p = params_with_inputs<BackwardParams>(args);
  // No rows or no keys: every gradient term is an empty sum, nothing to add.
  if (p.pr.batch_count == 0 || p.pr.lq == 0 || p.pr.lk == 0) return;
  const int nb = batch_dims(args.q);
  p.grad_out = make_operand(args.grad_out, nb);
  p.lse = make_operand(args.lse, nb, /*statistic=*/true);
  if (args.grad_lse.data != nullptr) p.grad_lse = make_operand(args.grad_lse, nb, true);
  p.grad_q = make_operand(args.grad_q, nb);
  p.grad_k = make_operand(args.grad_k, nb);
  p.grad_v = make_operand(args.grad_v, nb);

  const int64_t rows = p.pr.batch_count * p.pr.lq;
  ScratchBuffer delta(scratch, static_cast<size_t>(rows) * sizeof(float));
  p.delta = static_cast<float*>(delta.get());
  // dQ is summed over key tiles by atomics: into grad_q itself when it is float32, else into
  // zeroed float32 scratch that the last kernel adds into grad_q.
  const bool direct_dq = args.grad_q.dtype == DType::kFloat32;
  const size_t dq_bytes = direct_dq ? 0 : static_cast<size_t>(rows) * p.pr.d * sizeof(float);
  ScratchBuffer dq(scratch, dq_bytes);
  if (direct_dq) {
    p.dq_accum = p.grad_q;
  } else {
    p.dq_accum = contiguous_operand(dq.get(), args.q);
    RD_CUDA_CHECK(cudaMemsetAsync(dq.get(), 0, dq_bytes, stream));
  }
  flash::launch_backward(args.q.dtype, p, stream);
}

}  // namespace rd::kernels::cuda
