// World-size invariance of sequence-parallel dilated attention: P = 1..4 ranks as threads
// (the in-process communicator), every strategy, variant, mixing mode, offset rule and causal
// setting, forward and backward, against the single-device call on the whole sequence
// (itself checked against the float64 reference in dilated_attention_test). Also: traffic
// only for pairs that cross blocks, and the errors of bad calls.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/nn/ring_dilated_attention_modules.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"
#include "testing/ring_invariance.h"
#include "testing/tensor_util.h"

namespace rd {
namespace {

using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::DistStrategy;
using nn::HeadMixing;
using nn::OffsetRule;

// N = 24 splits into blocks of 24, 12, 8 and 6. The pairs mix segments shorter than a block,
// segments that do not divide it (so they straddle boundaries), a short last segment (10
// does not divide 24) and one segment over the whole sequence.
constexpr test::RingDims kCpuDims{2, 24, 4, 8};
constexpr int64_t kB = kCpuDims.batch, kN = kCpuDims.seq, kH = kCpuDims.heads, kD = kCpuDims.dim;

DilatedAttentionOptions options_for(DilationVariant variant, HeadMixing mixing, OffsetRule rule,
                                    bool causal) {
  DilatedAttentionOptions o;
  o.segment_lengths = {4, 10, 24};
  o.dilation_rates = {1, 2, 4};
  o.variant = variant;
  o.mixing = mixing;
  o.offset_rule = rule;
  o.causal = causal;
  return o;
}

using test::FullSequence;
using test::RankResult;
using test::joined;
using test::relative_error;

FullSequence single_device(const DilatedAttentionOptions& o, DType dtype, uint64_t seed) {
  return test::single_device(o, dtype, seed, Device::cpu(), kCpuDims);
}

std::vector<RankResult> run_ranks(const FullSequence& f, const DilatedAttentionOptions& o, int P,
                                  DistStrategy strategy) {
  return test::run_in_process_ranks(f, o, P, strategy);
}

void expect_invariant(const DilatedAttentionOptions& o, DType dtype, int P, DistStrategy strategy,
                      double tol) {
  const FullSequence f = single_device(o, dtype, 1234 + static_cast<uint64_t>(P));
  test::expect_ranks_match(run_ranks(f, o, P, strategy), f, {tol, tol, tol});
}

using Case = std::tuple<int, DistStrategy, DilationVariant, HeadMixing, OffsetRule, bool>;

class RingInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(RingInvariance, Float64MatchesOneDeviceTo1e10) {
  const auto [P, strategy, variant, mixing, rule, causal] = GetParam();
  expect_invariant(options_for(variant, mixing, rule, causal), DType::kFloat64, P, strategy,
                   1e-10);
}

// The dropout mask is numbered by global positions, so each rank's blocks draw exactly the
// single-device mask.
TEST_P(RingInvariance, WithDropoutFloat64MatchesOneDeviceTo1e10) {
  const auto [P, strategy, variant, mixing, rule, causal] = GetParam();
  DilatedAttentionOptions o = options_for(variant, mixing, rule, causal);
  o.dropout = 0.3;
  expect_invariant(o, DType::kFloat64, P, strategy, 1e-10);
}

TEST_P(RingInvariance, Float32MatchesOneDeviceTo1e5) {
  const auto [P, strategy, variant, mixing, rule, causal] = GetParam();
  expect_invariant(options_for(variant, mixing, rule, causal), DType::kFloat32, P, strategy,
                   1e-5);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [P, strategy, variant, mixing, rule, causal] = info.param;
  return "P" + std::to_string(P) + "_" + nn::strategy_name(strategy) + "_" +
         (variant == DilationVariant::kGlobal ? "global" : "fixed") + "_" +
         (mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + "_" +
         (rule == OffsetRule::kRotating ? "rotating" : "constant") + (causal ? "_causal" : "");
}

const auto kStrategies =
    ::testing::Values(DistStrategy::kRing, DistStrategy::kAllGather, DistStrategy::kAuto);

INSTANTIATE_TEST_SUITE_P(Fixed, RingInvariance,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), kStrategies,
                                            ::testing::Values(DilationVariant::kSegmentLocal),
                                            ::testing::Values(HeadMixing::kHeadGroups,
                                                              HeadMixing::kAllHeads),
                                            ::testing::Values(OffsetRule::kConstant,
                                                              OffsetRule::kRotating),
                                            ::testing::Bool()),
                         case_name);

INSTANTIATE_TEST_SUITE_P(Global, RingInvariance,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), kStrategies,
                                            ::testing::Values(DilationVariant::kGlobal),
                                            ::testing::Values(HeadMixing::kHeadGroups),
                                            ::testing::Values(OffsetRule::kConstant),
                                            ::testing::Bool()),
                         case_name);

// Segments that fit in a block never communicate, whatever the strategy.
TEST(RingDilatedAttention, PairsInsideBlocksSendNothing) {
  DilatedAttentionOptions o;
  o.segment_lengths = {2, 6};
  o.dilation_rates = {1, 2};
  for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather, DistStrategy::kAuto}) {
    const FullSequence f = single_device(o, DType::kFloat64, 7);
    const std::vector<RankResult> rs = run_ranks(f, o, 4, s);  // blocks of 6
    for (const RankResult& r : rs) {
      EXPECT_EQ(r.info.forward_bytes_sent, 0) << nn::strategy_name(s);
      EXPECT_EQ(r.info.ring_steps, 0);
    }
    EXPECT_LE(relative_error(joined(rs, &RankResult::out, 1), f.out), 1e-12);
  }
}

// One pair whose segment spans every block: only its heads at its selected positions move.
// Ring and all-gather each send every other rank's selected rows once: (P - 1) blocks of
// C / r rows x its H / G heads x D x (K and V).
TEST(RingDilatedAttention, OnlySelectedRowsOfTheHeadsThatUseThemTravel) {
  DilatedAttentionOptions o;
  o.segment_lengths = {2, 24};
  o.dilation_rates = {1, 4};  // pair 1: heads 2 and 3, positions == 1 mod 4
  const int P = 3;
  const int64_t C = kN / P, rows = C / 4, heads = kH / 2;
  const int64_t expected = (P - 1) * rows * heads * kD * 2 * kB * 8;  // float64
  for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather}) {
    const FullSequence f = single_device(o, DType::kFloat64, 9);
    const std::vector<RankResult> rs = run_ranks(f, o, P, s);
    for (const RankResult& r : rs) {
      EXPECT_EQ(r.info.forward_bytes_sent, expected) << nn::strategy_name(s);
      EXPECT_EQ(s == DistStrategy::kRing ? r.info.ring_pairs : r.info.gathered_pairs, 1);
    }
    EXPECT_LE(relative_error(joined(rs, &RankResult::out, 1), f.out), 1e-12);
  }
}

// Segments of two blocks at P = 4: ranks {0, 1} and {2, 3} share segments, so each rank
// exchanges only with its partner: the all-gather runs in sub-groups of 2 and the ring
// within each pair, one step, one block of the unit's rows sent (not P - 1 blocks);
// forward and backward still equal the single-device call.
TEST(RingDilatedAttention, AllGatherStaysAmongTheRanksSharingASegment) {
  DilatedAttentionOptions o;
  o.segment_lengths = {3, 12};
  o.dilation_rates = {1, 2};  // pair 1: heads 2 and 3, positions == 1 mod 2
  const int P = 4;
  const int64_t C = kN / P, rows = C / 2, heads = kH / 2;
  const int64_t one_block = rows * heads * kD * 2 * kB * 8;  // float64 K and V
  for (bool causal : {false, true}) {
    o.causal = causal;
    const FullSequence f = single_device(o, DType::kFloat64, 13);
    for (DistStrategy s : {DistStrategy::kAllGather, DistStrategy::kRing}) {
      const std::vector<RankResult> rs = run_ranks(f, o, P, s);
      for (const RankResult& r : rs) {
        EXPECT_EQ(r.info.forward_bytes_sent, one_block) << nn::strategy_name(s);
        EXPECT_EQ(r.info.ring_steps, s == DistStrategy::kRing ? 1 : 0);
      }
      EXPECT_LE(relative_error(joined(rs, &RankResult::out, 1), f.out), 1e-12);
      EXPECT_LE(relative_error(joined(rs, &RankResult::grad_q, 1), f.grad_q), 1e-12);
      EXPECT_LE(relative_error(joined(rs, &RankResult::grad_k, 1), f.grad_k), 1e-12);
      EXPECT_LE(relative_error(joined(rs, &RankResult::grad_v, 1), f.grad_v), 1e-12);
    }
  }
}

TEST(RingDilatedAttention, CausalRingSkipsBlocksAfterTheQueries) {
  DilatedAttentionOptions o;
  o.segment_lengths = {12};
  o.dilation_rates = {1};
  o.causal = true;
  const FullSequence f = single_device(o, DType::kFloat64, 11);
  // Blocks of 6: segment [0, 12) spans ranks 0-1 and [12, 24) ranks 2-3. Causal: rank 1
  // needs rank 0 only, so the ring takes one step and rank 0 receives nothing it uses.
  const std::vector<RankResult> rs = run_ranks(f, o, 4, DistStrategy::kRing);
  for (const RankResult& r : rs) EXPECT_EQ(r.info.ring_steps, 1);
  EXPECT_LE(relative_error(joined(rs, &RankResult::out, 1), f.out), 1e-12);
  EXPECT_LE(relative_error(joined(rs, &RankResult::grad_k, 1), f.grad_k), 1e-12);
}

TEST(RingDilatedAttention, BadCallsNameTheOpAndTheArgument) {
  DilatedAttentionOptions o;
  o.segment_lengths = {4};
  o.dilation_rates = {1};
  dist::run_in_process(2, [&](dist::Communicator& comm) {
    const Tensor x = ones({1, 4, 2, 8}, DType::kFloat32);
    EXPECT_TRUE(test::raises(
        [&] { nn::ring_dilated_attention(x, x, ones({1, 4, 2, 4}, DType::kFloat32), o, comm); },
        {ErrorCode::kShapeMismatch}, {"ring_dilated_attention", "[1, 4, 2, 4]"}));
    DilatedAttentionOptions drop = o;
    drop.dropout = 0.1;
    nn::AttentionCallContext training{true, nullptr};
    EXPECT_TRUE(test::raises(
        [&] { nn::ring_dilated_attention(x, x, x, drop, comm, DistStrategy::kRing, training); },
        {ErrorCode::kInvalidArgument}, {"ring_dilated_attention", "dropout", "generator"}));
  });
}

// The modules: P ranks of RingMultiheadDilatedAttention built from generators of one seed
// equal one MultiheadDilatedAttention: the output and input gradient blocks, and the
// parameter gradients summed over ranks (each rank's are those of its tokens).
TEST(RingModules, MultiheadOnPRanksEqualsTheSingleDeviceModule) {
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kAllHeads,
                                          OffsetRule::kConstant, true);
  nn::MultiheadOptions mo;
  mo.tensor_options = TensorOptions(DType::kFloat64);
  constexpr int64_t kEmbed = 32;  // 4 heads of 8
  Generator gen(17);
  const Tensor x_full = randn({kB, kN, kEmbed}, gen, DType::kFloat64);
  const Tensor w = randn({kB, kN, kEmbed}, gen, DType::kFloat64);
  constexpr uint64_t kInitSeed = 5;
  Generator single_init(kInitSeed);
  nn::MultiheadDilatedAttention single(kEmbed, kH, o, single_init, mo);
  Tensor x = x_full.detach();
  x.set_requires_grad(true);
  const Tensor y = single.forward(x);
  sum(mul(y, w)).backward();
  const auto single_params = single.named_parameters();
  for (int P : {1, 2, 3, 4}) {
    std::vector<Tensor> ys(static_cast<size_t>(P)), dxs(static_cast<size_t>(P));
    std::vector<std::vector<std::pair<std::string, Tensor>>> params(static_cast<size_t>(P));
    dist::run_in_process(P, [&](dist::Communicator& comm) {
      std::shared_ptr<dist::Communicator> shared(&comm, [](dist::Communicator*) {});
      Generator init(kInitSeed);
      nn::RingMultiheadDilatedAttention ring(kEmbed, kH, o, shared, init, DistStrategy::kAuto,
                                             mo);
      Tensor xb = nn::sequence_block(x_full, comm.rank(), P).contiguous().detach();
      xb.set_requires_grad(true);
      const Tensor yb = ring.forward(xb);
      sum(mul(yb, nn::sequence_block(w, comm.rank(), P))).backward();
      ys[static_cast<size_t>(comm.rank())] = yb.detach();
      dxs[static_cast<size_t>(comm.rank())] = xb.grad();
      params[static_cast<size_t>(comm.rank())] = ring.named_parameters();
    });
    EXPECT_LE(relative_error(cat(ys, 1), y.detach()), 1e-10) << "P = " << P;
    EXPECT_LE(relative_error(cat(dxs, 1), x.grad()), 1e-10) << "P = " << P;
    for (size_t i = 0; i < single_params.size(); ++i) {
      Tensor summed = zeros_like(single_params[i].second);
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(params[static_cast<size_t>(r)][i].first, single_params[i].first);
        summed = add(summed, params[static_cast<size_t>(r)][i].second.grad());
      }
      EXPECT_LE(relative_error(summed, single_params[i].second.grad()), 1e-10)
          << single_params[i].first << ", P = " << P;
    }
  }
}

TEST(RingModules, UnevenSplitIsAClearError) {
  EXPECT_TRUE(test::raises([] { nn::sequence_block(zeros({1, 10, 2}), 0, 4); },
                           {ErrorCode::kShapeMismatch}, {"sequence_block", "10", "4", "N % P = 2"}));
}

// ---------------------------------------------------------------------------------------
// One GPU shared by P ranks (threads with device copies): each dtype and attention path
// against the single-GPU call with the same dtype and path. Skipped without a GPU.

using CudaCase = std::tuple<DType, nn::AttentionPath, HeadMixing, bool, DistStrategy, int>;

class RingInvarianceCuda : public ::testing::TestWithParam<CudaCase> {};

TEST_P(RingInvarianceCuda, MatchesOneGpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, path, mixing, causal, strategy, P] = GetParam();
  // Blocks of N / P = 512 (P = 4): pair 0 stays inside blocks, pair 1 spans two blocks,
  // pair 2 all four.
  constexpr test::RingDims kDims{1, 2048, 8, 64};
  DilatedAttentionOptions o;
  o.segment_lengths = {256, 1024, 2048};
  o.dilation_rates = {1, 2, 4};
  o.mixing = mixing;
  o.causal = causal;
  o.path = path;
  const FullSequence f = test::single_device(o, dtype, 99, Device::cuda(), kDims);
  const std::vector<RankResult> rs = run_ranks(f, o, P, strategy);
  test::expect_ranks_match(rs, f, test::gpu_ring_tolerance(dtype));
  // Ring steps have full or diagonal-causal masks: they run on the path one GPU runs.
  for (const RankResult& r : rs) {
    EXPECT_EQ(r.info.attention.path_used, f.path)
        << "single GPU " << nn::path_name(f.path) << ", ring "
        << nn::path_name(r.info.attention.path_used);
  }
}

std::string cuda_case_name(const ::testing::TestParamInfo<CudaCase>& info) {
  const auto [dtype, path, mixing, causal, strategy, P] = info.param;
  return std::string(dtype_name(dtype)) + "_" + nn::path_name(path) + "_" +
         (mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + (causal ? "_causal_" : "_") +
         nn::strategy_name(strategy) + "_P" + std::to_string(P);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, RingInvarianceCuda,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(nn::AttentionPath::kCudnn, nn::AttentionPath::kFlash),
                       ::testing::Values(HeadMixing::kHeadGroups, HeadMixing::kAllHeads),
                       ::testing::Bool(),
                       ::testing::Values(DistStrategy::kRing, DistStrategy::kAllGather),
                       ::testing::Values(2, 4)),
    cuda_case_name);

}  // namespace
}  // namespace rd
