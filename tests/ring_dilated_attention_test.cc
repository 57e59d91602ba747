// World-size invariance of sequence-parallel dilated attention: P = 1..4 ranks as threads
// (the in-process communicator), every strategy, variant, mixing mode, offset rule and causal
// setting, forward and backward, against the single-device call on the whole sequence
// (itself checked against the float64 reference in dilated_attention_test). Also: traffic
// only for pairs that cross blocks, and the errors of bad calls.
#include "ringdilated/nn/ring_dilated_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/nn/ring_dilated_attention_modules.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/poisoned_pool.h"
#include "testing/raises.h"
#include "testing/ring_invariance.h"
#include "testing/tensor_util.h"

namespace rd {
namespace {

// Every test here runs with new blocks of the CPU and GPU pools holding NaN
// (testing/poisoned_pool.h): an element of an output or gradient that the engine neither
// writes nor zeroes shows.
[[maybe_unused]] ::testing::Environment* const kPoisonedPools =
    ::testing::AddGlobalTestEnvironment(new test::PoisonedPoolEnvironment);

using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::DistStrategy;
using nn::HeadMixing;
using nn::OffsetRule;
using nn::SequenceLayout;

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
                                  DistStrategy strategy,
                                  SequenceLayout layout = SequenceLayout::kAuto) {
  return test::run_in_process_ranks(f, o, P, strategy, layout);
}

void expect_invariant(const DilatedAttentionOptions& o, DType dtype, int P, DistStrategy strategy,
                      SequenceLayout layout, double tol) {
  const FullSequence f = single_device(o, dtype, 1234 + static_cast<uint64_t>(P));
  test::expect_ranks_match(run_ranks(f, o, P, strategy, layout), f, {tol, tol, tol});
}

// Ranks, strategy, variant, mixing, offset rule, causal, layout.
using Case =
    std::tuple<int, DistStrategy, DilationVariant, HeadMixing, OffsetRule, bool, SequenceLayout>;

class RingInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(RingInvariance, Float64MatchesOneDeviceTo1e10) {
  const auto [P, strategy, variant, mixing, rule, causal, layout] = GetParam();
  expect_invariant(options_for(variant, mixing, rule, causal), DType::kFloat64, P, strategy,
                   layout, 1e-10);
}

// The dropout mask is numbered by global positions, so each rank's blocks draw exactly the
// single-device mask.
TEST_P(RingInvariance, WithDropoutFloat64MatchesOneDeviceTo1e10) {
  const auto [P, strategy, variant, mixing, rule, causal, layout] = GetParam();
  DilatedAttentionOptions o = options_for(variant, mixing, rule, causal);
  o.dropout = 0.3;
  expect_invariant(o, DType::kFloat64, P, strategy, layout, 1e-10);
}

TEST_P(RingInvariance, Float32MatchesOneDeviceTo1e5) {
  const auto [P, strategy, variant, mixing, rule, causal, layout] = GetParam();
  expect_invariant(options_for(variant, mixing, rule, causal), DType::kFloat32, P, strategy,
                   layout, 1e-5);
}

// All heads merge each pair's partial, and each unit's partial per block of keys, without
// zeroing it (the merge reads only rows a call wrote). With every new block of the CPU pool
// filled with 0xff (kPoisonedPools: NaN in float32), a row read unwritten would show as
// NaN on some rank.
TEST(RingDilatedAttention, AllHeadsPartialsAreReadOnlyWhereWritten) {
  for (const SequenceLayout layout : {SequenceLayout::kContiguous, SequenceLayout::kZigzag}) {
    for (const DistStrategy strategy : {DistStrategy::kRing, DistStrategy::kAllGather}) {
      for (const bool causal : {false, true}) {
        SCOPED_TRACE(std::string(nn::layout_name(layout)) + " " + nn::strategy_name(strategy) +
                     (causal ? " causal" : ""));
        expect_invariant(options_for(DilationVariant::kSegmentLocal, HeadMixing::kAllHeads,
                                     OffsetRule::kRotating, causal),
                         DType::kFloat32, 3, strategy, layout, 1e-5);
      }
    }
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [P, strategy, variant, mixing, rule, causal, layout] = info.param;
  return "P" + std::to_string(P) + "_" + nn::strategy_name(strategy) + "_" +
         (variant == DilationVariant::kGlobal ? "global" : "fixed") + "_" +
         (mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + "_" +
         (rule == OffsetRule::kRotating ? "rotating" : "constant") + (causal ? "_causal" : "") +
         "_" + nn::layout_name(layout);
}

const auto kStrategies =
    ::testing::Values(DistStrategy::kRing, DistStrategy::kAllGather, DistStrategy::kAuto);
// Both layouts in every mode (N = 24 splits into 2P pieces for P = 1..4): zigzag pieces of
// 3 and 6 rows are not multiples of every rate, so both the strided and the whole-row
// exchange of the zigzag layout run.
const auto kLayouts = ::testing::Values(SequenceLayout::kContiguous, SequenceLayout::kZigzag);

INSTANTIATE_TEST_SUITE_P(Fixed, RingInvariance,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), kStrategies,
                                            ::testing::Values(DilationVariant::kSegmentLocal),
                                            ::testing::Values(HeadMixing::kHeadGroups,
                                                              HeadMixing::kAllHeads),
                                            ::testing::Values(OffsetRule::kConstant,
                                                              OffsetRule::kRotating),
                                            ::testing::Bool(), kLayouts),
                         case_name);

INSTANTIATE_TEST_SUITE_P(Global, RingInvariance,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), kStrategies,
                                            ::testing::Values(DilationVariant::kGlobal),
                                            ::testing::Values(HeadMixing::kHeadGroups),
                                            ::testing::Values(OffsetRule::kConstant),
                                            ::testing::Bool(), kLayouts),
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
      const std::vector<RankResult> rs = run_ranks(f, o, P, s, SequenceLayout::kContiguous);
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

// P = 8 with segments of 2 blocks and of 4: all-gather sub-groups of two spans, where ranks
// 0 and 1 form group 0 of both. Each span must get its own sub-group (a cache keyed by
// rank / span alone once handed the span-4 gather the span-2 group).
TEST(RingDilatedAttention, GatherGroupsOfTwoSpansAtP8) {
  DilatedAttentionOptions o;
  o.segment_lengths = {6, 12};  // N = 24, blocks of 3: spans 2 and 4
  o.dilation_rates = {1, 2};
  const FullSequence f = single_device(o, DType::kFloat64, 31);
  const std::vector<RankResult> rs =
      run_ranks(f, o, 8, DistStrategy::kAllGather, SequenceLayout::kContiguous);
  test::expect_ranks_match(rs, f, {1e-10, 1e-10, 1e-10});
}

TEST(RingDilatedAttention, CausalRingSkipsBlocksAfterTheQueries) {
  DilatedAttentionOptions o;
  o.segment_lengths = {12};
  o.dilation_rates = {1};
  o.causal = true;
  const FullSequence f = single_device(o, DType::kFloat64, 11);
  // Blocks of 6: segment [0, 12) spans ranks 0-1 and [12, 24) ranks 2-3. Causal: rank 1
  // needs rank 0 only, so the ring takes one step and rank 0 receives nothing it uses.
  const std::vector<RankResult> rs =
      run_ranks(f, o, 4, DistStrategy::kRing, SequenceLayout::kContiguous);
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
// Both layouts (kAuto is zigzag here: the attention is causal); the zigzag ranks' rotary
// positions follow their two pieces.
class RingModules : public ::testing::TestWithParam<SequenceLayout> {};

TEST_P(RingModules, MultiheadOnPRanksEqualsTheSingleDeviceModule) {
  const SequenceLayout layout = GetParam();
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
                                             mo, layout);
      const SequenceLayout resolved = ring.layout_for(kN);
      Tensor xb = nn::sequence_block(x_full, comm.rank(), P, resolved).contiguous().detach();
      xb.set_requires_grad(true);
      const Tensor yb = ring.forward(xb);
      sum(mul(yb, nn::sequence_block(w, comm.rank(), P, resolved))).backward();
      ys[static_cast<size_t>(comm.rank())] = yb.detach();
      dxs[static_cast<size_t>(comm.rank())] = xb.grad();
      params[static_cast<size_t>(comm.rank())] = ring.named_parameters();
    });
    const SequenceLayout resolved = nn::resolve_layout(layout, o, kN, P);
    EXPECT_LE(relative_error(nn::sequence_from_blocks(ys, resolved), y.detach()), 1e-10)
        << "P = " << P << ", " << nn::layout_name(resolved);
    EXPECT_LE(relative_error(nn::sequence_from_blocks(dxs, resolved), x.grad()), 1e-10)
        << "P = " << P << ", " << nn::layout_name(resolved);
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

INSTANTIATE_TEST_SUITE_P(Layouts, RingModules,
                         ::testing::Values(SequenceLayout::kAuto, SequenceLayout::kContiguous),
                         [](const ::testing::TestParamInfo<SequenceLayout>& info) {
                           return std::string(nn::layout_name(info.param));
                         });

TEST(RingLayout, UnevenSplitIsAClearError) {
  EXPECT_TRUE(test::raises(
      [] { nn::sequence_block(zeros({1, 10, 2}), 0, 4, SequenceLayout::kContiguous); },
      {ErrorCode::kShapeMismatch}, {"sequence_block", "10", "4", "N % P = 2"}));
  EXPECT_TRUE(test::raises(
      [] { nn::sequence_block(zeros({1, 12, 2}), 0, 4, SequenceLayout::kZigzag); },
      {ErrorCode::kShapeMismatch}, {"sequence_block", "zigzag", "12", "2P = 8"}));
  dist::run_in_process(2, [&](dist::Communicator& comm) {
    DilatedAttentionOptions o;
    o.segment_lengths = {6};
    o.dilation_rates = {1};
    const Tensor x = ones({1, 3, 2, 4}, DType::kFloat32);  // N = 6: 2P = 4 does not divide it
    EXPECT_TRUE(test::raises(
        [&] {
          nn::ring_dilated_attention(x, x, x, o, comm, DistStrategy::kRing, {},
                                     SequenceLayout::kZigzag);
        },
        {ErrorCode::kShapeMismatch}, {"ring_dilated_attention", "zigzag", "6", "2P = 4"}));
  });
}

// kAuto: zigzag for causal calls unless it would split segments that tile the contiguous
// blocks (at N = 1M and P = 4 the pair (262144, 16) is local to each block of 262144 but
// would span two zigzag pieces of 131072); contiguous without a causal mask.
TEST(RingLayout, AutoPicksZigzagWhereItAddsNoTraffic) {
  DilatedAttentionOptions o;
  o.segment_lengths = {2048, 16384, 262144, int64_t{1} << 22};
  o.dilation_rates = {1, 4, 16, 64};
  o.causal = true;
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 22, 4), SequenceLayout::kZigzag);
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 20, 4),
            SequenceLayout::kContiguous);
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 20, 2), SequenceLayout::kZigzag);
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 22, 1),
            SequenceLayout::kContiguous);
  o.variant = DilationVariant::kGlobal;  // no segments to keep local
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 20, 4), SequenceLayout::kZigzag);
  o.causal = false;
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kAuto, o, int64_t{1} << 22, 4),
            SequenceLayout::kContiguous);
  // An explicit layout is kept.
  EXPECT_EQ(nn::resolve_layout(SequenceLayout::kZigzag, o, int64_t{1} << 20, 4), SequenceLayout::kZigzag);
}

// Rank r of P holds pieces r and 2P - 1 - r of 2P; sequence_from_blocks undoes the split.
TEST(RingLayout, ZigzagPiecesAndTheirInverse) {
  using nn::Block;
  const std::vector<Block> r0 = nn::sequence_pieces(SequenceLayout::kZigzag, 16, 0, 2);
  const std::vector<Block> r1 = nn::sequence_pieces(SequenceLayout::kZigzag, 16, 1, 2);
  ASSERT_EQ(r0.size(), 2u);
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r0[0].begin, 0);
  EXPECT_EQ(r0[1].begin, 12);
  EXPECT_EQ(r1[0].begin, 4);
  EXPECT_EQ(r1[1].begin, 8);
  EXPECT_EQ(r1[1].end, 12);
  Generator gen(3);
  const Tensor x = randn({2, 24, 3}, gen, DType::kFloat64);
  for (SequenceLayout layout : {SequenceLayout::kContiguous, SequenceLayout::kZigzag}) {
    for (int P : {1, 2, 3, 4}) {
      std::vector<Tensor> blocks;
      for (int r = 0; r < P; ++r) blocks.push_back(nn::sequence_block(x, r, P, layout));
      EXPECT_TRUE(allclose(nn::sequence_from_blocks(blocks, layout), x, 0.0, 0.0))
          << nn::layout_name(layout) << " P = " << P;
    }
  }
  // Rank 1 of 2, zigzag: positions 6..11 then 12..17 of 24.
  const Tensor block = nn::sequence_block(x, 1, 2, SequenceLayout::kZigzag);
  EXPECT_TRUE(allclose(block.narrow(1, 0, 6), x.narrow(1, 6, 6), 0.0, 0.0));
  EXPECT_TRUE(allclose(block.narrow(1, 6, 6), x.narrow(1, 12, 6), 0.0, 0.0));
}

// Largest over mean of the plan's attended pairs per rank.
double work_imbalance(const DilatedAttentionOptions& o, int64_t seq_len, int P,
                      SequenceLayout layout) {
  const std::vector<int64_t> work = nn::attended_pairs_per_rank(o, seq_len, 16, P, layout);
  double total = 0, largest = 0;
  for (int64_t w : work) {
    total += static_cast<double>(w);
    largest = std::max(largest, static_cast<double>(w));
  }
  return largest / (total / P);
}

// The reference pairs of docs/benchmarks.md, causal: with power-of-two segments and N the
// zigzag layout gives every rank the same work within 5% for P = 2..16 (the contiguous one
// puts up to twice the mean on the last rank), and the two layouts do the same total work.
// Also the table of docs/distributed.md ("Causal load balance"), printed.
TEST(RingLayout, ZigzagBalancesCausalWork) {
  for (DilationVariant variant : {DilationVariant::kSegmentLocal, DilationVariant::kGlobal}) {
    for (int64_t seq_len : {int64_t{1} << 20, int64_t{1} << 22}) {
      DilatedAttentionOptions o;
      o.segment_lengths = {2048, 16384, 262144, seq_len};
      o.dilation_rates = {1, 4, 16, 64};
      o.causal = true;
      o.variant = variant;
      for (int P : {2, 4, 8, 16}) {
        const double zigzag = work_imbalance(o, seq_len, P, SequenceLayout::kZigzag);
        const double contiguous = work_imbalance(o, seq_len, P, SequenceLayout::kContiguous);
        std::printf("%s N=%lld P=%d: imbalance contiguous %.4f, zigzag %.4f\n",
                    variant == DilationVariant::kGlobal ? "original" : "fixed",
                    static_cast<long long>(seq_len), P, contiguous, zigzag);
        EXPECT_LE(zigzag, 1.05) << "P = " << P << ", N = " << seq_len;
        EXPECT_GT(contiguous, zigzag) << "P = " << P << ", N = " << seq_len;
        int64_t total_zigzag = 0, total_contiguous = 0;
        for (int64_t w : nn::attended_pairs_per_rank(o, seq_len, 16, P, SequenceLayout::kZigzag)) {
          total_zigzag += w;
        }
        for (int64_t w :
             nn::attended_pairs_per_rank(o, seq_len, 16, P, SequenceLayout::kContiguous)) {
          total_contiguous += w;
        }
        EXPECT_EQ(total_zigzag, total_contiguous);
      }
    }
  }
}

// The work count itself, on a case small enough to count by hand: one causal pair (8, 1)
// over N = 8, one head, P = 2. Contiguous: rank 0 holds queries 0..3 (1+2+3+4 = 10 pairs),
// rank 1 queries 4..7 (5+6+7+8 = 26). Zigzag: pieces of 2; rank 0 holds 0,1 and 6,7
// (1+2+7+8 = 18), rank 1 holds 2..5 (3+4+5+6 = 18).
TEST(RingLayout, AttendedPairsCountedByHand) {
  DilatedAttentionOptions o;
  o.segment_lengths = {8};
  o.dilation_rates = {1};
  o.causal = true;
  EXPECT_EQ(nn::attended_pairs_per_rank(o, 8, 1, 2, SequenceLayout::kContiguous),
            (std::vector<int64_t>{10, 26}));
  EXPECT_EQ(nn::attended_pairs_per_rank(o, 8, 1, 2, SequenceLayout::kZigzag),
            (std::vector<int64_t>{18, 18}));
  o.causal = false;
  EXPECT_EQ(nn::attended_pairs_per_rank(o, 8, 1, 2, SequenceLayout::kZigzag),
            (std::vector<int64_t>{32, 32}));
}

// The zigzag layout's traffic: one causal pair over the whole sequence (P = 2, pieces of 6).
// Rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2; every rank's queries need keys of the
// other rank, so each sends its whole selected rows once: (C / r) rows of the pair's heads.
TEST(RingLayout, ZigzagSendsEachRanksSelectedRowsOnce) {
  DilatedAttentionOptions o;
  o.segment_lengths = {2, 24};
  o.dilation_rates = {1, 2};  // pair 1: heads 2 and 3, positions == 1 mod 2
  o.causal = true;
  const int P = 2;
  const int64_t C = kN / P, rows = C / 2, heads = kH / 2;
  const int64_t expected = rows * heads * kD * 2 * kB * 8;  // float64 K and V
  const FullSequence f = single_device(o, DType::kFloat64, 21);
  for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather}) {
    const std::vector<RankResult> rs = run_ranks(f, o, P, s, SequenceLayout::kZigzag);
    for (const RankResult& r : rs) {
      EXPECT_EQ(r.layout, SequenceLayout::kZigzag);
      EXPECT_EQ(r.info.forward_bytes_sent, expected) << nn::strategy_name(s);
    }
    EXPECT_LE(relative_error(joined(rs, &RankResult::out, 1), f.out), 1e-12);
    EXPECT_LE(relative_error(joined(rs, &RankResult::grad_k, 1), f.grad_k), 1e-12);
  }
}

// The plan of the benchmarks' configuration (4M, P = 4, causal zigzag), every rank: the
// pair over the whole sequence makes one causal call on the rank's own rows, over both
// pieces, and one call per other rank (the piece-by-piece plan made 3 and 2); dropout keeps
// the piece-by-piece calls (its mask numbering needs one run of global positions).
TEST(RingLayout, ZigzagJoinsTheCallsOfTheWholeSequencePair) {
  constexpr int64_t kLongN = int64_t{1} << 22, kLongH = 16, kLongD = 128;
  constexpr int P = 4;
  DilatedAttentionOptions o;
  o.segment_lengths = {2048, 16384, 262144, kLongN};
  o.dilation_rates = {1, 4, 16, 64};
  o.causal = true;
  auto calls_of_pair = [](const std::vector<nn::LocalCall>& calls, int pair) {
    return std::count_if(calls.begin(), calls.end(),
                         [pair](const nn::LocalCall& c) { return c.pair == pair; });
  };
  for (int rank = 0; rank < P; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const nn::RankLayout layout{1, kLongN / P, kLongH, kLongD, rank, P, /*zigzag=*/true};
    const nn::RankPlan plan = nn::make_rank_plan(o, layout, DistStrategy::kRing, 2);
    const int64_t piece_rows = kLongN / (2 * P) / 64;  // pair 3's selected rows per piece
    ASSERT_EQ(calls_of_pair(plan.local_calls, 3), 1);
    const auto own = std::find_if(plan.local_calls.begin(), plan.local_calls.end(),
                                  [](const nn::LocalCall& c) { return c.pair == 3; });
    EXPECT_TRUE(own->causal);
    EXPECT_EQ(own->q.count, 2 * piece_rows);
    EXPECT_EQ(own->k.count, 2 * piece_rows);
    for (int src = 0; src < P; ++src) {
      EXPECT_EQ(calls_of_pair(plan.calls[static_cast<size_t>(src)], 3), src == rank ? 0 : 1)
          << "source " << src;
    }
    DilatedAttentionOptions with_dropout = o;
    with_dropout.dropout = 0.1;
    const nn::RankPlan pieces = nn::make_rank_plan(with_dropout, layout, DistStrategy::kRing, 2);
    EXPECT_EQ(calls_of_pair(pieces.local_calls, 3), 2);
    EXPECT_EQ(calls_of_pair(pieces.calls[static_cast<size_t>(rank)], 3), 1);
  }
}

// ---------------------------------------------------------------------------------------
// One GPU shared by P ranks (threads with device copies): each dtype and attention path
// against the single-GPU call with the same dtype and path. Skipped without a GPU.

using CudaCase =
    std::tuple<DType, nn::AttentionPath, HeadMixing, bool, DistStrategy, int, SequenceLayout>;

class RingInvarianceCuda : public ::testing::TestWithParam<CudaCase> {};

TEST_P(RingInvarianceCuda, MatchesOneGpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, path, mixing, causal, strategy, P, layout] = GetParam();
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
  const std::vector<RankResult> rs = run_ranks(f, o, P, strategy, layout);
  test::expect_ranks_match(rs, f, test::gpu_ring_tolerance(dtype));
  // Ring steps have full or diagonal-causal masks: they run on the path one GPU runs.
  for (const RankResult& r : rs) {
    EXPECT_EQ(r.info.attention.path_used, f.path)
        << "single GPU " << nn::path_name(f.path) << ", ring "
        << nn::path_name(r.info.attention.path_used);
  }
}

// Two batch rows in the zigzag layout: a rank's block holds two pieces, so a call's batch
// rows lie a block apart while its segments lie one segment apart, and batch and segments do
// not fold into one of cuDNN's dims. Under kAuto with a loss that does not read the lse,
// every call still runs on cuDNN (one graph per batch row), forward and backward, on each
// rank and on one GPU, and the ranks' rows equal one GPU's.
TEST(RingInvarianceCuda, ZigzagBatchRowsRunOnCudnn) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  constexpr test::RingDims kDims{2, 2048, 8, 64};
  for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
    DilatedAttentionOptions o;
    o.segment_lengths = {256, 1024, 2048};
    o.dilation_rates = {1, 2, 4};
    o.mixing = mixing;
    o.causal = true;
    const FullSequence f = test::single_device(o, DType::kBFloat16, 98, Device::cuda(), kDims, {},
                                               /*loss_reads_lse=*/false);
    auto expect_cudnn_only = [](const nn::AttentionCallCounts& counts, const std::string& who) {
      for (const nn::AttentionCallCounts::Calls& calls : {counts.forward, counts.backward}) {
        EXPECT_EQ(calls.flash + calls.math, 0)
            << who << ": " << calls.flash << " flash, " << calls.math << " math calls";
        EXPECT_GT(calls.cudnn, 0) << who;
      }
    };
    expect_cudnn_only(f.counts, "one GPU");
    for (const int P : {2, 4}) {
      SCOPED_TRACE(std::string(mixing == HeadMixing::kAllHeads ? "all heads" : "head groups") +
                   ", P = " + std::to_string(P));
      const std::vector<RankResult> rs =
          run_ranks(f, o, P, DistStrategy::kRing, SequenceLayout::kZigzag);
      test::expect_ranks_match(rs, f, test::gpu_ring_tolerance(DType::kBFloat16));
      for (size_t r = 0; r < rs.size(); ++r) {
        expect_cudnn_only(rs[r].counts, "rank " + std::to_string(r));
      }
    }
  }
}

std::string cuda_case_name(const ::testing::TestParamInfo<CudaCase>& info) {
  const auto [dtype, path, mixing, causal, strategy, P, layout] = info.param;
  return std::string(dtype_name(dtype)) + "_" + nn::path_name(path) + "_" +
         (mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + (causal ? "_causal_" : "_") +
         nn::strategy_name(strategy) + "_P" + std::to_string(P) + "_" + nn::layout_name(layout);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, RingInvarianceCuda,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(nn::AttentionPath::kCudnn, nn::AttentionPath::kFlash),
                       ::testing::Values(HeadMixing::kHeadGroups, HeadMixing::kAllHeads),
                       ::testing::Bool(),
                       ::testing::Values(DistStrategy::kRing, DistStrategy::kAllGather),
                       ::testing::Values(2, 4), kLayouts),
    cuda_case_name);

}  // namespace
}  // namespace rd
