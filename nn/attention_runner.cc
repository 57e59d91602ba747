// The attention calls of one dilated-attention call (see attention_runner.h).
#include "ringdilated/nn/attention_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {

using kernels::AttentionKernel;

const char* path_name(AttentionPath path) {
  return path == AttentionPath::kAuto ? "auto" : kernels::kernel_name(kernel_of(path));
}

namespace {

// Kernels from the fastest to the slowest: the fallback order, and the order `slower` ranks.
constexpr AttentionKernel kFastestFirst[] = {AttentionKernel::kCudnn, AttentionKernel::kFlash,
                                             AttentionKernel::kMath};

int speed_rank(AttentionKernel kernel) {
  for (int i = 0; i < 3; ++i) {
    if (kFastestFirst[i] == kernel) return i;
  }
  return 3;
}

// Whether a kernel builds state for each distinct call shape before it runs (cuDNN's graphs).
bool builds_per_shape(AttentionKernel kernel) { return kernel == AttentionKernel::kCudnn; }

}  // namespace

AttentionKernel slower(AttentionKernel a, AttentionKernel b) {
  return speed_rank(a) >= speed_rank(b) ? a : b;
}

AttentionPath requested_path(AttentionPath option, const char* op) {
  if (option != AttentionPath::kAuto) return option;
  const char* env = std::getenv("RD_ATTENTION_PATH");
  if (env == nullptr) return option;
  const std::string value(env);
  if (value == "cudnn") return AttentionPath::kCudnn;
  if (value == "flash") return AttentionPath::kFlash;
  if (value == "math") return AttentionPath::kMath;
  RD_CHECK(value == "auto" || value.empty(), kInvalidArgument, op,
           ": environment variable RD_ATTENTION_PATH is '", value,
           "', expected auto, cudnn, flash or math");
  return option;
}

std::vector<AttentionKernel> candidate_kernels(AttentionPath requested, Device device) {
  if (device.is_cpu()) return {AttentionKernel::kMath};
  std::vector<AttentionKernel> kernels;
  bool reached = requested == AttentionPath::kAuto;
  for (AttentionKernel kernel : kFastestFirst) {
    reached = reached || path_of(kernel) == requested;
    if (reached) kernels.push_back(kernel);
  }
  return kernels;
}

AttentionRunner::AttentionRunner(const char* op, const DilatedAttentionOptions& options,
                                 const AttentionCallContext& context, const Tensor& q,
                                 int64_t seq_len)
    : op_(op), device_(q.device()) {
  params_.scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  params_.causal = options.causal;
  const AttentionPath requested = requested_path(options.path, op);
  kernels_ = candidate_kernels(requested, q.device());
  forced_ = requested != AttentionPath::kAuto;
  hilbert_ = options.use_hilbert;
  patterns_ = context.patterns != nullptr ? context.patterns : &global_pattern_cache();
  plans_ = context.plans;
  backward_piece_elements_ = context.backward_piece_elements;
  counts_ = context.counts;
  if (context.training && options.dropout > 0) {
    params_.dropout = options.dropout;
    params_.seed = context.generator->seed();
    pair_offsets_ = draw_dropout_pair_offsets(*context.generator,
                                              static_cast<int>(options.segment_lengths.size()),
                                              q.size(0), q.size(2), seq_len);
  }
}

kernels::AttentionParams AttentionRunner::call_params(
    int pair, bool causal, const kernels::DropoutIndexing& indexing) const {
  kernels::AttentionParams params = params_;
  params.causal = causal;
  if (dropout()) {
    params.offset = pair_offsets_[static_cast<size_t>(pair)];
    params.dropout_indexing = indexing;
  }
  return params;
}

Tensor AttentionRunner::key_order(int64_t n, Device device) const {
  return hilbert_ ? hilbert_indices(*patterns_, n, device) : Tensor();
}

void AttentionRunner::forward(const kernels::AttentionForwardArgs& args) {
  slowest_ = slower(slowest_, *run(args, nullptr));
}

bool AttentionRunner::forward_if_supported(const kernels::AttentionForwardArgs& args) {
  const std::optional<AttentionKernel> kernel = run(args, nullptr, /*optional=*/true);
  if (kernel) slowest_ = slower(slowest_, *kernel);
  return kernel.has_value();
}

void AttentionRunner::backward(const kernels::AttentionForwardArgs& fwd,
                               const kernels::AttentionBackwardArgs& args) {
  run(fwd, &args);
}

bool AttentionRunner::backward_if_supported(const kernels::AttentionForwardArgs& fwd,
                                            const kernels::AttentionBackwardArgs& args) {
  return run(fwd, &args, /*optional=*/true).has_value();
}

bool AttentionRunner::backward_supported(const kernels::AttentionForwardArgs& fwd,
                                         const kernels::AttentionBackwardArgs& args) const {
  return std::any_of(kernels_.begin(), kernels_.end(),
                     [&](AttentionKernel kernel) { return refusal(kernel, fwd, &args).empty(); });
}

std::string AttentionRunner::refusal(AttentionKernel kernel,
                                     const kernels::AttentionForwardArgs& fwd,
                                     const kernels::AttentionBackwardArgs* backward) const {
  if (builds_per_shape(kernel) && fwd.params.shape_follows_data && !forced_) {
    // A graph built for one document piece or decoding step would serve no other: every
    // call would build one (measured: a call of 131 documents 3000x slower than unmasked).
    return "its shape follows the data";
  }
  std::string why;
  if (!backend_for(device_).attention_supports(kernel, fwd, backward, &why)) {
    return why.empty() ? "not supported" : why;
  }
  return "";
}

std::optional<AttentionKernel> AttentionRunner::run(const kernels::AttentionForwardArgs& fwd,
                                                    const kernels::AttentionBackwardArgs* backward,
                                                    bool optional) {
  kernels::KernelBackend& backend = backend_for(device_);
  std::string reasons;
  for (AttentionKernel kernel : kernels_) {
    if (const std::string why = refusal(kernel, fwd, backward); !why.empty()) {
      reasons += str_cat(kernels::kernel_name(kernel), ": ", why, "; ");
      continue;
    }
    try {
      if (backward != nullptr) {
        backend.attention_backward(kernel, *backward);
      } else {
        backend.attention_forward(kernel, fwd);
      }
    } catch (const Error& e) {
      // Only "this kernel cannot serve this call", which kernels raise before queueing
      // work, is safe to retry elsewhere.
      if (e.code() != ErrorCode::kUnimplemented || kernel == AttentionKernel::kMath) throw;
      log_once(str_cat(op_, ": the ", kernels::kernel_name(kernel), " path cannot run this call (",
                       e.what(), "); falling back"));
      reasons += str_cat(kernels::kernel_name(kernel), ": ", e.what(), "; ");
      continue;
    }
    if (counts_ != nullptr) count_call(kernel, fwd.pieces != nullptr, backward != nullptr);
    if (forced_ && kernel != kernels_.front() && !optional) {
      log_once(str_cat(op_, ": the ", kernels::kernel_name(kernels_.front()),
                       " path cannot run this call (", reasons, "); using ",
                       kernels::kernel_name(kernel)));
    }
    return kernel;
  }
  if (optional) return std::nullopt;
  RD_FAIL(kUnimplemented, op_, ": no attention path can run this call: ", reasons);
}

void AttentionRunner::count_call(AttentionKernel kernel, bool over_pieces, bool backward) {
  AttentionCallCounts::Calls& calls = backward ? counts_->backward : counts_->forward;
  switch (kernel) {
    case AttentionKernel::kCudnn: ++calls.cudnn; break;
    case AttentionKernel::kFlash: ++calls.flash; break;
    case AttentionKernel::kMath: ++calls.math; break;
  }
  if (over_pieces) ++calls.over_pieces;
}

kernels::AttentionBackwardArgs backward_of(const kernels::AttentionForwardArgs& fwd) {
  kernels::AttentionBackwardArgs b;
  b.q = fwd.q;
  b.k = fwd.k;
  b.v = fwd.v;
  b.out = fwd.out;
  b.lse = fwd.lse;
  b.params = fwd.params;
  b.pieces = fwd.pieces;
  return b;
}

kernels::AttentionBackwardArgs backward_args(const char* op,
                                             const kernels::AttentionForwardArgs& fwd,
                                             const Tensor& grad_out, const Tensor& grad_lse,
                                             const Tensor& grad_q, const Tensor& grad_k,
                                             const Tensor& grad_v) {
  kernels::AttentionBackwardArgs b = backward_of(fwd);
  b.grad_out = kernel_view(grad_out, op);
  b.grad_lse = grad_lse.defined() ? kernel_view(grad_lse, op) : kernels::StridedView{};
  b.grad_q = kernel_view(grad_q, op);
  b.grad_k = kernel_view(grad_k, op);
  b.grad_v = kernel_view(grad_v, op);
  return b;
}

GradBuffers GradBuffers::uninitialized(const Shape& bnhd, int64_t kv_heads, GradDtypes dtypes,
                                       Device device, bool packed) {
  const TensorOptions q_opts = TensorOptions(dtypes.q).with_device(device);
  GradBuffers g;
  if (packed) {
    RD_CHECK(dtypes.q == dtypes.kv && kv_heads == bnhd[2], kInternal,
             "GradBuffers: packed q/k/v gradients share one dtype and head count");
    g.packed = rd::empty({bnhd[0], bnhd[1], 3, bnhd[2], bnhd[3]}, q_opts);
    for (int64_t i = 0; i < 3; ++i) g.qkv.push_back(g.packed.select(2, i));
  } else {
    const TensorOptions kv_opts = TensorOptions(dtypes.kv).with_device(device);
    const Shape kv_shape{bnhd[0], bnhd[1], kv_heads, bnhd[3]};
    g.qkv = {rd::empty(bnhd, q_opts), rd::empty(kv_shape, kv_opts), rd::empty(kv_shape, kv_opts)};
  }
  return g;
}

void GradBuffers::zero() const {
  for (Tensor t : packed.defined() ? std::vector<Tensor>{packed} : qkv) t.zero_();
}

std::vector<Tensor> GradBuffers::input_grads(DType dtype) const {
  if (packed.defined()) return {packed.to(dtype)};
  return {qkv[0].to(dtype), qkv[1].to(dtype), qkv[2].to(dtype)};
}

}  // namespace rd::nn
