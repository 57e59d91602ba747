// CpuBackend's attention methods: the CPU runs the math kernel (kernels/cpu/attention.cc)
// only; asking for flash or cuDNN here is answered "not supported" so callers fall back.
#include <string>

#include "ringdilated/kernels/cpu/attention.h"
#include "ringdilated/kernels/cpu/backend.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cpu {

bool CpuBackend::attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                                    const AttentionBackwardArgs* backward, std::string* why_not) {
  if (kernel != AttentionKernel::kMath) {
    if (why_not != nullptr) *why_not = str_cat(kernel_name(kernel), " kernels need a CUDA device");
    return false;
  }
  if (forward.pieces != nullptr) {
    if (why_not != nullptr) *why_not = kPiecesUnsupported;
    return false;
  }
  if (backward != nullptr && attention_grads_shared(*backward)) {
    if (why_not != nullptr) *why_not = kSharedGradsUnsupported;
    return false;
  }
  return true;
}

void CpuBackend::attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args) {
  RD_CHECK(kernel == AttentionKernel::kMath, kUnimplemented, "attention: the ", kernel_name(kernel),
           " kernel does not run on the CPU");
  RD_CHECK(args.pieces == nullptr, kUnimplemented, "attention: ", kPiecesUnsupported);
  cpu::attention_forward(args);
}

void CpuBackend::attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args) {
  RD_CHECK(kernel == AttentionKernel::kMath, kUnimplemented, "attention_backward: the ",
           kernel_name(kernel), " kernel does not run on the CPU");
  RD_CHECK(args.pieces == nullptr, kUnimplemented, "attention_backward: ", kPiecesUnsupported);
  // The reference only accumulates: a call that overwrites its gradients zeroes them first.
  for (const StridedView* grad : overwritten_grads(args)) fill(*grad, 0.0);
  cpu::attention_backward(args);
}

}  // namespace rd::kernels::cpu
