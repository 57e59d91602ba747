// The CUDA attention entry points: which kernel (math, flash, cuDNN) can run a call, and
// running it. The kernels live in attention_math.cu, flash_*.cu and cudnn_attention.cc;
// path selection and fallback policy live above, in nn/dilated_attention.cc.
#include <string>

#include "ringdilated/kernels/cuda/attention.h"
#include "ringdilated/kernels/cuda/cudnn_attention.h"
#include "ringdilated/kernels/cuda/flash_attention.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {

bool attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                        const AttentionBackwardArgs* backward, std::string* why_not) {
  if (kernel != AttentionKernel::kCudnn && backward != nullptr &&
      attention_grads_shared(*backward)) {
    if (why_not != nullptr) *why_not = kSharedGradsUnsupported;
    return false;
  }
  if (kernel != AttentionKernel::kCudnn && forward.pieces != nullptr) {
    if (why_not != nullptr) *why_not = kPiecesUnsupported;
    return false;
  }
  switch (kernel) {
    case AttentionKernel::kMath: return true;
    case AttentionKernel::kFlash:
      return flash_attention_supports(forward, why_not) &&
             (backward == nullptr || flash_attention_supports_backward(*backward, why_not));
    case AttentionKernel::kCudnn:
      if (!cudnn_attention_available()) {
        if (why_not != nullptr) *why_not = "cuDNN (version 9 or newer) is not available";
        return false;
      }
      return cudnn_attention_supports(forward, why_not) &&
             (backward == nullptr || cudnn_attention_supports_backward(*backward, why_not));
  }
  return false;
}

void attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args, Allocator& scratch,
                       cudaStream_t stream) {
  RD_CHECK(args.pieces == nullptr || kernel == AttentionKernel::kCudnn, kUnimplemented,
           "attention: ", kPiecesUnsupported);
  switch (kernel) {
    case AttentionKernel::kMath: return attention_math_forward(args, stream);
    case AttentionKernel::kFlash: return flash_attention_forward(args, stream);
    case AttentionKernel::kCudnn: return cudnn_attention_forward(args, scratch, stream);
  }
  RD_FAIL(kInvalidArgument, "attention: unknown kernel ", static_cast<int>(kernel));
}

void attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args,
                        Allocator& scratch, cudaStream_t stream) {
  RD_CHECK(args.pieces == nullptr || kernel == AttentionKernel::kCudnn, kUnimplemented,
           "attention_backward: ", kPiecesUnsupported);
  if (kernel != AttentionKernel::kCudnn) {
    // The math and flash kernels only accumulate: a call that overwrites zeroes first. This
    // is queued before the kernel's own checks (the runner asked attention_supports before);
    // a call refused after it and retried elsewhere overwrites the same views again.
    for (const StridedView* grad : overwritten_grads(args)) fill(*grad, 0.0, stream);
  }
  switch (kernel) {
    case AttentionKernel::kMath: return attention_math_backward(args, scratch, stream);
    case AttentionKernel::kFlash: return flash_attention_backward(args, scratch, stream);
    case AttentionKernel::kCudnn: return cudnn_attention_backward(args, scratch, stream);
  }
  RD_FAIL(kInvalidArgument, "attention_backward: unknown kernel ", static_cast<int>(kernel));
}

}  // namespace rd::kernels::cuda
