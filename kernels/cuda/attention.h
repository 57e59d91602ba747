// The CUDA attention kernels of kernels/attention.h's primitive, as free functions that the
// backend's attention entry points (attention_dispatch.cc) call; each takes the stream to
// queue on, and the caller has made the device current.
#pragma once

#include <cuda_runtime.h>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/attention.h"

namespace rd::kernels::cuda {

// attention_math.cu: the math fallback. Runs every valid call (any strides, the four float
// dtypes, any D, causal offsets, dropout) with the CPU kernel's semantics and the same
// dropout mask bits; one warp per row, no atomics, bitwise reproducible, not fast. Checks
// its arguments first (check_attention_forward_args / check_attention_backward_args).
void attention_math_forward(const AttentionForwardArgs& args, cudaStream_t stream);
// Adds the gradients into grad_q/k/v; takes B * Lq floats (doubles for float64 data) of
// stream-ordered scratch from `scratch`.
void attention_math_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                             cudaStream_t stream);

}  // namespace rd::kernels::cuda
