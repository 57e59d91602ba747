// Attention path policy (see attention_path.h).
#include "ringdilated/nn/attention_path.h"

#include <cstdlib>
#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/dispatch.h"

namespace rd::nn {

using kernels::AttentionKernel;

const char* path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kAuto: return "auto";
    case AttentionPath::kCudnn: return "cudnn";
    case AttentionPath::kFlash: return "flash";
    case AttentionPath::kMath: return "math";
  }
  return "?";
}

AttentionPath path_of(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kCudnn: return AttentionPath::kCudnn;
    case AttentionKernel::kFlash: return AttentionPath::kFlash;
    case AttentionKernel::kMath: return AttentionPath::kMath;
  }
  return AttentionPath::kMath;
}

AttentionKernel slower(AttentionKernel a, AttentionKernel b) {
  return static_cast<int>(path_of(a)) >= static_cast<int>(path_of(b)) ? a : b;
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
  switch (requested) {
    case AttentionPath::kMath: return {AttentionKernel::kMath};
    case AttentionPath::kFlash: return {AttentionKernel::kFlash, AttentionKernel::kMath};
    default: return {AttentionKernel::kCudnn, AttentionKernel::kFlash, AttentionKernel::kMath};
  }
}

AttentionKernel run_with_fallback(kernels::KernelBackend& backend,
                                  const std::vector<AttentionKernel>& kernels,
                                  const kernels::AttentionForwardArgs& args,
                                  const kernels::AttentionBackwardArgs* backward, bool forced,
                                  const char* op,
                                  const std::function<void(AttentionKernel)>& run) {
  std::string reasons;
  for (AttentionKernel kernel : kernels) {
    std::string why;
    if (!backend.attention_supports(kernel, args, backward, &why)) {
      reasons += str_cat(kernels::kernel_name(kernel), ": ", why, "; ");
      continue;
    }
    try {
      run(kernel);
    } catch (const Error& e) {
      // Only "this kernel cannot serve this call", which kernels raise before queueing
      // work, is safe to retry elsewhere.
      if (e.code() != ErrorCode::kUnimplemented || kernel == AttentionKernel::kMath) throw;
      log_once(str_cat(op, ": the ", kernels::kernel_name(kernel), " path cannot run this call (",
                       e.what(), "); falling back"));
      reasons += str_cat(kernels::kernel_name(kernel), ": ", e.what(), "; ");
      continue;
    }
    if (forced && kernel != kernels.front()) {
      log_once(str_cat(op, ": the ", kernels::kernel_name(kernels.front()),
                       " path cannot run this call (", reasons, "); using ",
                       kernels::kernel_name(kernel)));
    }
    return kernel;
  }
  RD_FAIL(kUnimplemented, op, ": no attention path can run this call: ", reasons);
}

kernels::AttentionBackwardArgs backward_args(const char* op,
                                             const kernels::AttentionForwardArgs& fwd,
                                             const Tensor& grad_out, const Tensor& grad_lse,
                                             const Tensor& grad_q, const Tensor& grad_k,
                                             const Tensor& grad_v) {
  kernels::AttentionBackwardArgs b;
  b.q = fwd.q;
  b.k = fwd.k;
  b.v = fwd.v;
  b.out = fwd.out;
  b.lse = fwd.lse;
  b.grad_out = kernel_view(grad_out, op);
  b.grad_lse = grad_lse.defined() ? kernel_view(grad_lse, op) : kernels::StridedView{};
  b.grad_q = kernel_view(grad_q, op);
  b.grad_k = kernel_view(grad_k, op);
  b.grad_v = kernel_view(grad_v, op);
  b.params = fwd.params;
  return b;
}

}  // namespace rd::nn
