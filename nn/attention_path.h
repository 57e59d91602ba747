// Attention path policy: which kernel (cuDNN, flash, math) runs an attention call, the
// RD_ATTENTION_PATH override, and the fallback to slower kernels when one cannot run.
#pragma once

#include <functional>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

AttentionPath path_of(kernels::AttentionKernel kernel);

// The slower of two kernels (math > flash > cudnn): what a call reports as its path.
kernels::AttentionKernel slower(kernels::AttentionKernel a, kernels::AttentionKernel b);

// The requested path: RD_ATTENTION_PATH (auto|cudnn|flash|math) overrides kAuto. Read per
// call, so there is no hidden state; a bad value is an rd::Error naming `op`.
AttentionPath requested_path(AttentionPath option, const char* op);

// Kernels to try, in order: the requested one, then the slower fallbacks. kAuto starts from
// the fastest the device may have; the CPU has only math.
std::vector<kernels::AttentionKernel> candidate_kernels(AttentionPath requested, Device device);

// Runs `run(kernel)` with the first candidate that supports `args` (and `backward`, for a
// backward call) and returns the kernel used. A kernel that reports it cannot serve the call
// (attention_supports false, or kUnimplemented thrown before it queued any work) falls back
// to the next; when `forced`, the fallback is logged once per distinct message. Every other
// error (out of memory, a failed launch) propagates: by then a backward kernel may already
// have accumulated into its gradients, and a retry would add them twice.
kernels::AttentionKernel run_with_fallback(kernels::KernelBackend& backend,
                                           const std::vector<kernels::AttentionKernel>& kernels,
                                           const kernels::AttentionForwardArgs& args,
                                           const kernels::AttentionBackwardArgs* backward,
                                           bool forced, const char* op,
                                           const std::function<void(kernels::AttentionKernel)>& run);

// The backward of a forward call: its inputs and (merged) results, the gradients arriving
// at out and lse (an undefined grad_lse: the lse was not used), and the q/k/v gradient
// tensors (views) it adds into. Views are taken with `op` named in errors.
kernels::AttentionBackwardArgs backward_args(const char* op,
                                             const kernels::AttentionForwardArgs& fwd,
                                             const Tensor& grad_out, const Tensor& grad_lse,
                                             const Tensor& grad_q, const Tensor& grad_k,
                                             const Tensor& grad_v);

}  // namespace rd::nn
