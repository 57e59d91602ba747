// World-size invariance helpers for sequence-parallel attention: the single-device call on
// random inputs (the reference), one rank's call on its block, and the comparison. Used by the
// in-process suite (ring_dilated_attention_test) and the NCCL suite on several GPUs
// (cuda_multi_gpu_test), so both check exactly the same thing.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::test {

struct RingDims {
  int64_t batch, seq, heads, dim;
  int64_t kv_heads = 0;  // grouped-query attention: k and v heads; 0: as many as q's
};

// The dropout generator's seed: the single device and every rank hold one seeded alike.
constexpr uint64_t kRingDropoutSeed = 777;

// A scalar loss that reads out and the finite entries of lse with fixed random weights, so
// both gradients reach the attention (out only where w_lse is undefined).
Tensor ring_loss(const Tensor& out, const Tensor& lse, const Tensor& w_out, const Tensor& w_lse);

// Inputs, loss weights and the single-device results on the whole sequence.
struct FullSequence {
  Tensor q, k, v, w_out, w_lse;             // inputs and loss weights
  Tensor out, lse, grad_q, grad_k, grad_v;  // single-device results
  nn::AttentionPath path = nn::AttentionPath::kMath;
  nn::DocumentStarts documents;  // the document masks of every call; empty: none
  nn::AttentionCallCounts counts;  // the single-device call's kernel calls
};

// Random inputs (drawn on the CPU from `seed`, then moved to `device`), the single-device
// result and its gradients. Dropout (options.dropout > 0) runs in training mode. With
// `documents` (per batch row, AttentionCallContext::document_starts), every call of f, the
// ranks' too, masks them. `loss_reads_lse` false: the loss (of every call of f) reads out
// only, so no lse gradient reaches the backward (cuDNN's backward then runs).
FullSequence single_device(const nn::DilatedAttentionOptions& o, DType dtype, uint64_t seed,
                           Device device, RingDims dims, nn::DocumentStarts documents = {},
                           bool loss_reads_lse = true);

// f's inputs and loss weights copied to `device` (results stay where they are). Ranks that
// are threads driving one GPU each must not read another GPU's memory once the ring runs:
// the copy would queue on that GPU's stream behind NCCL work waiting for this very rank.
FullSequence inputs_on(const FullSequence& f, Device device);

struct RankResult {
  Tensor out, lse, grad_q, grad_k, grad_v;
  nn::RingAttentionResult info;
  nn::AttentionCallCounts counts;  // the rank's kernel calls, forward and backward
  nn::SequenceLayout layout = nn::SequenceLayout::kContiguous;  // resolved
};

// Rank comm.rank() of comm.size(): its rows of f's inputs under `layout` (copied to
// `device`), the sequence-parallel call, and backward through the same loss.
RankResult run_rank(const FullSequence& f, const nn::DilatedAttentionOptions& o,
                    dist::Communicator& comm, nn::DistStrategy strategy, Device device,
                    nn::SequenceLayout layout = nn::SequenceLayout::kAuto);

// P in-process ranks (threads) on f's device, each run_rank.
std::vector<RankResult> run_in_process_ranks(const FullSequence& f,
                                             const nn::DilatedAttentionOptions& o, int P,
                                             nn::DistStrategy strategy,
                                             nn::SequenceLayout layout = nn::SequenceLayout::kAuto);

// The ranks' rows of one field, put back in sequence order along `dim` (on the first rank's
// device).
Tensor joined(const std::vector<RankResult>& rs, Tensor RankResult::*field, int64_t dim);

// ||got - want|| / ||want|| over the finite entries (and -inf exactly where want has it);
// NaNs and mismatched infinities are reported as gtest failures.
double relative_error(const Tensor& got, const Tensor& want);

// Rank `rank` of `P`'s block of f's results (for a process that holds only its own rank's).
FullSequence block_of(const FullSequence& f, int rank, int P, nn::SequenceLayout layout);

// Tolerances for comparing ranks with one device (max relative error per result).
struct RingTolerance {
  double out, lse, grads;
};

// On a GPU: both sides round the same float32 results to the dtype once, but the ranks merge
// float32 partials where one call summed whole rows: a few units of the dtype's roundoff.
RingTolerance gpu_ring_tolerance(DType dtype);

// Each result of the joined ranks against f, within `tol`; returns whether all hold (gtest
// failures name the result).
bool expect_ranks_match(const std::vector<RankResult>& rs, const FullSequence& f,
                        RingTolerance tol);

// A parameterized ring case: P ranks, strategy, mixing, causal, layout.
using RingCase = std::tuple<int, nn::DistStrategy, nn::HeadMixing, bool, nn::SequenceLayout>;

// Every RingCase of P = 2 and 4, ring and all-gather, both mixings, causal or not, both
// layouts (P outermost, layout innermost), and each one's test name ("P2_ring_groups_causal_
// contiguous").
std::vector<RingCase> every_ring_case();
std::string ring_case_name(const ::testing::TestParamInfo<RingCase>& info);

// expect_ranks_match for P = 2 and 4 in-process ranks on f's device, with the ring and the
// all-gather strategy, in the contiguous and the zigzag layout.
void expect_every_split_matches(const FullSequence& f, const nn::DilatedAttentionOptions& o,
                                RingTolerance tol);

}  // namespace rd::test
