// One attention call split into blocks of query rows and of keys, each block a call of its own
// that numbers its dropout elements by their place in the whole call
// (kernels::DropoutIndexing), merged through the log-sum-exp: the tests of the dropout
// numbering run the same splits on every device and kernel. Also the numbering's formula,
// written here from kernels/attention.h, and the keep test it feeds.
#pragma once

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

#include "ringdilated/kernels/attention.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::test {

// A whole call: q [batch..., lq, d], k and v [batch..., lk, d] of one floating dtype on one
// device; grad_out and grad_lse are the loss's gradients at out and lse, in the
// accumulation dtype (float32, float64 for float64 inputs).
struct SplitAttention {
  Tensor q, k, v;
  kernels::AttentionParams params;
  Tensor grad_out, grad_lse;
};

// What make_split_attention draws: the batch dims, the lengths, and whether v is one-hot
// (v[b, j] = e_j, d >= lk), which makes out[b, i, j] = p[i, j] * keep(b, i, j) / (1 - p):
// zero exactly where an element is dropped or masked, so a mask can be read off the output.
struct SplitShape {
  std::vector<int64_t> batch;
  int64_t lq = 0, lk = 0, d = 0;
  bool one_hot_v = false;
};

// Random non-zero q and k (and v unless one-hot), grad_out and grad_lse, in `dtype` on
// `device`, with `params`.
SplitAttention make_split_attention(const SplitShape& shape, DType dtype, Device device,
                                    const kernels::AttentionParams& params, std::mt19937_64& rng);

// Results in the accumulation dtype; the gradients are undefined without a backward.
struct SplitResult {
  Tensor out, lse;
  Tensor grad_q, grad_k, grad_v;
};

// Runs `a` as one call per (row block, key block), the blocks cut at row_cuts (ascending,
// inside (0, lq)) and col_cuts (inside (0, lk)); no cuts: the whole call. A block of rows
// [r0, r1) and keys [c0, c1) gets causal_offset + r0 - c0 and the whole call's dropout
// numbering shifted to its first element; the key blocks of a row block are merged through
// the log-sum-exp. With `backward`, every block's backward adds its share of the gradients,
// given the merged out and lse. Every view is narrowed in place: no block is copied.
SplitResult run_split(const SplitAttention& a, kernels::AttentionKernel kernel,
                      const std::vector<int64_t>& row_cuts, const std::vector<int64_t>& col_cuts,
                      bool backward);

// One case of the split tables: the whole call's numbering (the default or
// scattered_numbering()), a causal setting, and where to cut rows and keys of a
// [2, 2, 70, 150] call (several CPU query blocks and key tiles, flash tiles on the GPU).
struct SplitCase {
  std::string name;
  bool custom = false;
  bool causal = false;
  int64_t causal_offset = 0;
  std::vector<int64_t> row_cuts, col_cuts;
};
inline void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.name; }
std::vector<SplitCase> split_cases();

// The default numbering (b * lq + i) * lk + j written out as custom strides, for batch dims
// `batch` (computed here, not by the library).
kernels::DropoutIndexing default_as_custom(const std::vector<int64_t>& batch, int64_t lq,
                                           int64_t lk);
// A numbering unlike the default: a base 40 below 2^64 (the numbers wrap around), a negative
// batch stride, rows and columns spread apart as in a dilated selection. Two batch dims.
kernels::DropoutIndexing scattered_numbering();

// make_split_attention with `params` set to the case's causal setting and numbering.
SplitAttention make_case_attention(const SplitCase& c, const SplitShape& shape, DType dtype,
                                   Device device, kernels::AttentionParams params,
                                   std::mt19937_64& rng);
// The case's numbering written out (what zeros_are_the_mask takes).
kernels::DropoutIndexing case_numbering(const SplitCase& c, const SplitShape& shape);

// Whether `got` matches `expected` (out, lse and, where both have them, the gradients) within
// the rounding of `dtype` over d + lk terms; gradients, which cancel in the softmax
// Jacobian, relative to their largest magnitude.
::testing::AssertionResult split_results_close(const SplitResult& expected, const SplitResult& got,
                                               DType dtype, int64_t d, int64_t lk);

// Element number of (batch indices `batch_index`, i, j) by the formula of kernels/attention.h:
// base + sum_d b_d * batch_strides[d] + i * row_stride + j * col_stride, mod 2^64.
uint64_t custom_dropout_number(const kernels::DropoutIndexing& ix,
                               const std::vector<int64_t>& batch_index, int64_t i, int64_t j);

// For a one-hot v: whether out is zero exactly at the elements that the causal mask hides
// or dropout drops by the numbering `ix` (the whole call's, resolved), computed with
// custom_dropout_number and dropout_keeps.
::testing::AssertionResult zeros_are_the_mask(const Tensor& out, const SplitAttention& a,
                                              const kernels::DropoutIndexing& ix);

// Whether element number n of the stream (seed, offset) survives dropout p: the top 24 bits
// of word 0 of its Philox4x32-10 block, as a fraction of 2^24, are below 1 - p.
bool dropout_keeps(uint64_t seed, uint64_t offset, double p, uint64_t n);

}  // namespace rd::test
