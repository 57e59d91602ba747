// The kFlash attention path: our own FlashAttention-2-style CUDA kernels for the primitive
// of kernels/attention.h (strided q/k/v, causal with an offset, in-kernel Philox dropout,
// float32 lse, accumulating backward with the merged out/lse and an optional grad_lse).
//
// What it serves (flash_attention_supports* say why not, in words, for everything else):
// - q/k/v in float32, bfloat16 or float16 (float64 goes to the math path); out, grad_out
//   and the gradients in q's dtype or float32; lse and grad_lse float32.
// - Head dim D from 1 to 256. Kernels exist for the buckets 32, 64, 128 and 256; a D in
//   between is zero-padded to the next bucket inside shared memory (never in global memory),
//   so it costs the bucket's arithmetic. D over 256 is refused.
// - Any strides for the batch dims and the sequence dim, negative and zero included, read
//   in place: a dilated selection (sequence stride r * H * D) is just a strided view. The
//   head dim must be unit-stride (else refused, so the caller falls back). Rows whose start
//   is 16-byte aligned with D a multiple of 16 bytes load through cp.async; anything else
//   (odd D, unaligned views, float32 grad_out for 16-bit q) loads element by element.
// - A positive scale (the forward folds it into exp2 after the row max).
// - Devices of compute capability 8.0 or newer (the build holds sm_80 and sm_90 code) whose
//   per-block shared memory holds the kernel's tiles (checked against the device).
//
// Forward (flash_forward.cu): one block per (batch, tile of query rows), looping over key
// tiles with an online softmax. bf16/fp16: 128x64 tiles on 4 warps of 32 rows (D = 256:
// 128x32 on 8 warps of 16 rows); K/V tiles double-buffered in shared memory through
// cp.async (rows padded by 16 bytes against ldmatrix bank conflicts); Q K^T and P V on
// mma.sync m16n8k16 with float32 accumulation, P kept in registers (the score accumulators
// are the A fragments of P V). The row max is taken on the raw scores and the scale folded
// into one FFMA before exp2 (so the scale must be positive); O is rescaled only when some
// row max of the warp moved; tiles that need no mask (all but the causal diagonal and a
// partial last tile) and calls without dropout run variants with no per-element test.
// float32: 64x32 tiles on 4 warps with exact float32 FMAs in the same register layout (no
// TF32), P staged in shared memory. Shared memory: bf16 D=128 104 KB (2 blocks per H100 SM),
// D=256 135 KB.
//
// Backward (flash_backward.cu), FlashAttention-2's structure:
// 1. delta = rowsum(dO * O) - grad_lse (one warp per row) into float32 scratch.
// 2. One block per (batch, tile of 64 keys), 8 warps: K and V tiles stay in shared memory,
//    dK and dV in registers, while the block loops over tiles of 64 query rows (Q, dO, lse
//    and delta double-buffered through cp.async): S = Q K^T and dP = dO V^T,
//    P = exp(scale * S - lse), dS = P * (dP - delta) (dropout applied to P and dP), then
//    dV += P^T dO, dK += dS^T Q and dQ += scale * dS K. P and dS go through shared memory
//    in q's dtype.
// 3. dQ: float32 atomics (red.add; on sm_90 lane pairs swap halves so that each adds four
//    consecutive floats with one vector reduction), straight into grad_q when it is float32,
//    otherwise into a zeroed float32 scratch [batch, Lq, D] from the Allocator that a third
//    kernel adds into grad_q. Chosen over a separate dQ pass because it needs no second
//    recomputation of S and dP; the price is the atomic traffic (and a run-to-run rounding
//    order in dQ: the backward is not bitwise reproducible, the forward is).
// dK and dV are added into grad_k/grad_v with plain read-modify-writes (one owner each).
//
// Dropout: keep(b, i, j) is computed in the kernel for every visible (row, key) element
// with philox_for_element(seed, offset, e(b, i, j)) and the threshold test of
// philox_bernoulli(1 - dropout), as the integer compare (w0 >> 8) < ceil((1 - p) * 2^24):
// the same bits as every other device. Forward and backward draw the same mask. The element
// number e is the affine numbering of AttentionParams::dropout_indexing (default
// (b * Lq + i) * Lk + j), resolved on the host; a block computes its batch's number once and
// each lane steps its elements' numbers by the row and column strides (no division).
//
// Causal offsets are clamped to [-(Lq + 1), Lk] as in the math kernels (the same mask), so
// the tile arithmetic cannot overflow on offsets near the int64 limits.
//
// Fully masked rows (nothing visible: causal with a negative offset, Lk = 0) give out 0 and
// lse -inf; in the backward a row with lse -inf has P = 0. Never NaN.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/attention.h"

namespace rd::kernels::cuda {

// Whether flash_attention_forward/backward can serve these (already valid) arguments on
// the current device. When not, and why_not is non-null, *why_not says why in one sentence
// naming the argument and value, so path selection can fall back and log it.
bool flash_attention_supports(const AttentionForwardArgs& args, std::string* why_not);
bool flash_attention_supports_backward(const AttentionBackwardArgs& args, std::string* why_not);

// The contract of kernels/attention.h on the current device, queued on `stream`. Checks the
// arguments first (check_attention_*_args), then throws rd::Error kUnimplemented with the
// reason for anything flash_attention_supports* refuses. The backward takes its scratch
// (delta and, for a non-float32 grad_q, the dQ accumulator) from `scratch`.
void flash_attention_forward(const AttentionForwardArgs& args, cudaStream_t stream);
void flash_attention_backward(const AttentionBackwardArgs& args, Allocator& scratch,
                              cudaStream_t stream);

}  // namespace rd::kernels::cuda
