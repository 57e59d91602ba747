// The kCudnn attention path: cuDNN's fused scaled-dot-product attention (flash attention)
// through the cudnn-frontend graph API, forward and backward, with the contract of
// kernels/attention.h. Declared in every CUDA build; without cuDNN (RD_WITH_CUDNN unset)
// cudnn_attention_available() is false and the other calls throw kUnimplemented. cuDNN is
// opened at run time (libcudnn.so.9), so a program runs where it is missing; the path is
// then unavailable, with the reason in cudnn_attention_supports().
//
// What cuDNN serves (cudnn_attention_supports* say why not, in words, for everything else):
// - bf16 or fp16 q/k/v on sm_80 or newer; out in the same dtype (forward); head dim a
//   multiple of 8, at most 256; at least one key.
// - No dropout: cuDNN draws its own Philox mask, which cannot reproduce ours
//   (philox_bernoulli of element number e(b, i, j) of the stream (seed, offset), by default
//   or custom numbering), so a cuDNN run with dropout would differ from every other path.
// - Causal with causal_offset >= 0: cuDNN's diagonal band with top-left alignment keeps key j
//   for query i iff j <= i + right_bound, which is our rule with right_bound =
//   causal_offset. Negative offsets (whole rows masked) are refused by cuDNN.
// - Views: the batch dims [batch..., L, D] must fold into cuDNN's two, [B, H, L, D]: size-1
//   dims are dropped, then the rest is split once into an outer group (B) and an inner group
//   (H), each of which must be one stride apart (stride[d] == stride[d + 1] * shape[d + 1])
//   in every view; a single batch dim is B with H = 1. The head dim must be contiguous
//   (stride 1), the other strides of q/k/v/out (and the backward's grad_out) positive
//   multiples of 8 elements and the pointers 16-byte aligned; lse strides must be positive.
//   So a dilated selection, e.g. q as [B, segments, heads, w / r, D] with sequence stride
//   r * H * D over a contiguous [B, N, H, D] tensor, runs in place.
// - Backward: no grad_lse (its term is not part of cuDNN's SDPA backward); out and grad_out
//   may be float32 (they are rounded to q's dtype in scratch memory first).
//
// Softmax statistics: cuDNN's "Stats" output is max + log(sum exp(s - max)) of the scaled,
// masked scores in natural log, which is our lse exactly, so it is written straight into
// args.lse. Gradients: cuDNN overwrites dQ/dK/dV, while our contract accumulates, so they
// are written to scratch memory (q's dtype) and added to grad_q/k/v afterwards.
//
// Graphs are built once per (device, dtype, direction, dims, every view's strides, causal
// bound, scale, whether lse is written) and kept in a bounded, thread-safe LRU cache;
// building one takes tens to hundreds of milliseconds. A graph cuDNN cannot build throws
// rd::Error with kUnimplemented and cuDNN's message (the failure is cached too, so it is
// not retried), so the caller can fall back to another path and log why.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/attention.h"

namespace rd::kernels::cuda {

// True when this build has cuDNN and the cuDNN library in use reports version 9 or newer.
// Computed once per process.
bool cudnn_attention_available();

// The version of the cuDNN library in use (e.g. 91400 for 9.14.0), or 0 without cuDNN.
int cudnn_runtime_version();

// Whether cudnn_attention_forward/backward can serve these arguments on the current
// device. When not, and why_not is non-null, *why_not says why (one sentence, naming the
// argument and value). A true answer can still meet a graph that cuDNN refuses to build.
bool cudnn_attention_supports(const AttentionForwardArgs& args, std::string* why_not);
bool cudnn_attention_supports_backward(const AttentionBackwardArgs& args,
                                       std::string* why_not);

// The contract of kernels/attention.h on the current device, queued on `stream`. Workspace,
// staging and gradient buffers come from `scratch` (the device's caching allocator, whose
// blocks must be stream-ordered with `stream`). Throws rd::Error kShapeMismatch for views
// whose shapes break kernels/attention.h, kUnimplemented for calls cuDNN cannot serve (with
// the reason) or a graph cuDNN cannot build (with cuDNN's message).
void cudnn_attention_forward(const AttentionForwardArgs& args, Allocator& scratch,
                             cudaStream_t stream);
void cudnn_attention_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                              cudaStream_t stream);

struct CudnnGraphCacheStats {
  int64_t hits = 0;        // calls that found their graph (or its cached failure)
  int64_t builds = 0;      // graphs built (successfully or not)
  int64_t failures = 0;    // builds cuDNN refused
  int64_t evictions = 0;   // entries dropped to stay within capacity
  // Of those, graphs kept alive rather than destroyed: a process that drives several GPUs
  // never unloads a graph's kernels while it runs (see GraphCache).
  int64_t retired = 0;
  int64_t size = 0;        // entries held now
  int64_t capacity = 0;    // most entries held at once
};
CudnnGraphCacheStats cudnn_graph_cache_stats();

}  // namespace rd::kernels::cuda
