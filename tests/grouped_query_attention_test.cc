// Grouped-query attention (k and v with H_kv heads dividing q's H): on one device every
// mode equals the same call on key/value heads repeated to the query heads (an independent
// path: index_select copies, whose autograd sums the shared heads' gradients), in float64,
// forward and backward, with dropout and the Hilbert order too; across ranks the result
// equals one device's (every strategy, both layouts); the decoding step too. Bad head counts
// are named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_decode.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/key_exchange.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "testing/elementwise_close.h"
#include "testing/poisoned_pool.h"
#include "testing/raises.h"
#include "testing/ring_invariance.h"

namespace rd {
namespace {

// Every test here runs with new blocks of the CPU and GPU pools holding NaN
// (testing/poisoned_pool.h): an element of an output or gradient that the engine neither
// writes nor zeroes shows.
[[maybe_unused]] ::testing::Environment* const kPoisonedPools =
    ::testing::AddGlobalTestEnvironment(new test::PoisonedPoolEnvironment);

using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::HeadMixing;
using nn::OffsetRule;

struct GqaShape {
  int64_t heads, kv_heads;
};

DilatedAttentionOptions options_for(DilationVariant variant, HeadMixing mixing, OffsetRule rule,
                                    bool causal, int pairs) {
  DilatedAttentionOptions o;
  o.segment_lengths = {4, 10, 24, 8};
  o.dilation_rates = {1, 2, 4, 2};
  o.segment_lengths.resize(static_cast<size_t>(pairs));
  o.dilation_rates.resize(static_cast<size_t>(pairs));
  o.variant = variant;
  o.mixing = mixing;
  o.offset_rule = rule;
  o.causal = causal;
  return o;
}

Tensor kv_index(int64_t heads, int64_t kv_heads) {
  std::vector<int64_t> index;
  for (int64_t h = 0; h < heads; ++h) index.push_back(h / (heads / kv_heads));
  return from_vector<int64_t>(index, {heads});
}

struct CallResult {
  Tensor out, lse, grad_q, grad_k, grad_v;
  nn::AttentionPath path_used = nn::AttentionPath::kAuto;  // the forward's
};

// One call and the backward of a loss reading out and lse (out only unless
// `loss_reads_lse`). `repeat`: the reference path, k and v repeated to the query heads by
// index_select before an ordinary call. `projected`: q, k and v are the [B, N, H, D],
// [B, N, H_kv, D] and [B, N, H_kv, D] views of one [B, N, H + 2 H_kv, D] tensor, as the
// grouped-query module passes them (gradient buffers then lie otherwise than the inputs).
CallResult run(const DilatedAttentionOptions& o, GqaShape shape, bool repeat, uint64_t seed,
               DType dtype = DType::kFloat64, Device device = Device::cpu(),
               DType rounded_to = DType::kFloat64, const nn::DocumentStarts* documents = nullptr,
               bool loss_reads_lse = true, bool projected = false) {
  constexpr int64_t kB = 2, kN = 24, kD = 8;
  Generator gen(seed);
  const TensorOptions f64(DType::kFloat64);
  // Drawn in float64 and rounded to `rounded_to`: a float64 run can see a bfloat16 run's values.
  auto draw = [&](Shape s) {
    return randn(std::move(s), gen, f64).to(rounded_to).to(dtype).to(device).detach();
  };
  const int64_t width = shape.heads + 2 * shape.kv_heads;
  Tensor qkv = projected ? draw({kB, kN, width, kD}) : Tensor();
  Tensor q = projected ? qkv.narrow(2, 0, shape.heads) : draw({kB, kN, shape.heads, kD});
  Tensor k =
      projected ? qkv.narrow(2, shape.heads, shape.kv_heads) : draw({kB, kN, shape.kv_heads, kD});
  Tensor v = projected ? qkv.narrow(2, shape.heads + shape.kv_heads, shape.kv_heads)
                       : draw({kB, kN, shape.kv_heads, kD});
  const Tensor w_out = draw({kB, kN, shape.heads, kD});
  const Tensor w_lse = randn({kB, shape.heads, kN}, gen, f64).to(device);
  if (projected) {
    qkv.set_requires_grad(true);  // q, k and v: views of it, built again to record them
    q = qkv.narrow(2, 0, shape.heads);
    k = qkv.narrow(2, shape.heads, shape.kv_heads);
    v = qkv.narrow(2, shape.heads + shape.kv_heads, shape.kv_heads);
  } else {
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  }
  const Tensor index = kv_index(shape.heads, shape.kv_heads).to(device);
  const Tensor kk = repeat ? index_select(k, 2, index) : k;
  const Tensor vv = repeat ? index_select(v, 2, index) : v;
  Generator dropout_gen(99);
  nn::AttentionCallContext context;
  context.training = o.dropout > 0;
  context.generator = &dropout_gen;
  context.document_starts = documents;
  const nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(q, kk, vv, o, context);
  const Tensor finite_lse =
      where(gt(r.lse.to(DType::kFloat64), -1e300), r.lse.to(DType::kFloat64), 0.0);
  const Tensor out_term = sum(mul(r.out.to(DType::kFloat64), w_out.to(DType::kFloat64)));
  (loss_reads_lse ? add(out_term, sum(mul(finite_lse, w_lse))) : out_term).backward();
  auto host = [](const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::kFloat64); };
  if (projected) {
    const Tensor grad = qkv.grad();
    return {host(r.out),
            host(r.lse),
            host(grad.narrow(2, 0, shape.heads)),
            host(grad.narrow(2, shape.heads, shape.kv_heads)),
            host(grad.narrow(2, shape.heads + shape.kv_heads, shape.kv_heads)),
            r.path_used};
  }
  return {host(r.out), host(r.lse), host(q.grad()), host(k.grad()), host(v.grad()), r.path_used};
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what,
                  double tol = 1e-10) {
  test::expect_tensors_close(what, got, want, tol);
}

// Variant, mixing, offset rule, causal.
using Mode = std::tuple<DilationVariant, HeadMixing, OffsetRule, bool>;

class GroupedQuery : public ::testing::TestWithParam<Mode> {};

TEST_P(GroupedQuery, EqualsRepeatedKeyValueHeads) {
  const auto [variant, mixing, rule, causal] = GetParam();
  // Groups of 4 aligned with head groups; multi-query; 3 heads per group against groups of 4
  // (head groups straddle key/value heads); 2 of 4 under 3 pairs.
  const std::vector<std::pair<GqaShape, int>> shapes = {
      {{8, 2}, 4}, {{8, 1}, 4}, {{12, 3}, 4}, {{8, 4}, 3}};
  for (const auto& [shape, pairs] : shapes) {
    for (const double dropout : {0.0, 0.25}) {
      SCOPED_TRACE("H " + std::to_string(shape.heads) + ", H_kv " + std::to_string(shape.kv_heads) +
                   ", dropout " + std::to_string(dropout));
      DilatedAttentionOptions o = options_for(variant, mixing, rule, causal, pairs);
      if (variant == DilationVariant::kGlobal) o.mixing = HeadMixing::kHeadGroups;
      o.dropout = dropout;
      const CallResult got = run(o, shape, /*repeat=*/false, 7);
      const CallResult want = run(o, shape, /*repeat=*/true, 7);
      expect_close(got.out, want.out, "out");
      expect_close(got.lse, want.lse, "lse");
      expect_close(got.grad_q, want.grad_q, "grad_q");
      expect_close(got.grad_k, want.grad_k, "grad_k");
      expect_close(got.grad_v, want.grad_v, "grad_v");
    }
  }
}

std::string mode_name(const ::testing::TestParamInfo<Mode>& info) {
  const auto [variant, mixing, rule, causal] = info.param;
  return std::string(variant == DilationVariant::kGlobal ? "global" : "fixed") + "_" +
         (mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + "_" +
         (rule == OffsetRule::kRotating ? "rotating" : "constant") + (causal ? "_causal" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Modes, GroupedQuery,
    ::testing::Combine(::testing::Values(DilationVariant::kSegmentLocal, DilationVariant::kGlobal),
                       ::testing::Values(HeadMixing::kHeadGroups, HeadMixing::kAllHeads),
                       ::testing::Values(OffsetRule::kConstant, OffsetRule::kRotating),
                       ::testing::Bool()),
    mode_name);

// Document masks (kN = 24, documents starting inside segments of every pair) with shared key/
// value heads: each document piece's call stores or adds its dK/dV by the same rule as whole
// segments, and the result is the repeated call's.
TEST(GroupedQueryDocuments, EqualsRepeatedKeyValueHeads) {
  const nn::DocumentStarts documents = {{0, 5, 11, 12, 19}, {0, 13}};
  const std::vector<std::pair<GqaShape, int>> shapes = {{{8, 2}, 4}, {{12, 3}, 4}, {{8, 1}, 4}};
  for (const auto& [shape, pairs] : shapes) {
    for (const auto& [causal, projected] : {std::pair{false, false}, {true, false}, {true, true}}) {
      SCOPED_TRACE("H " + std::to_string(shape.heads) + ", H_kv " + std::to_string(shape.kv_heads) +
                   (causal ? ", causal" : "") + (projected ? ", views of one projection" : ""));
      const DilatedAttentionOptions o =
          options_for(DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups,
                      OffsetRule::kRotating, causal, pairs);
      const CallResult got = run(o, shape, /*repeat=*/false, 9, DType::kFloat64, Device::cpu(),
                                 DType::kFloat64, &documents, true, projected);
      const CallResult want = run(o, shape, /*repeat=*/true, 9, DType::kFloat64, Device::cpu(),
                                  DType::kFloat64, &documents, true, projected);
      expect_close(got.out, want.out, "out");
      expect_close(got.lse, want.lse, "lse");
      expect_close(got.grad_q, want.grad_q, "grad_q");
      expect_close(got.grad_k, want.grad_k, "grad_k");
      expect_close(got.grad_v, want.grad_v, "grad_v");
    }
  }
}

TEST(GroupedQueryHilbert, EqualsRepeatedKeyValueHeads) {
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kAllHeads,
                                          OffsetRule::kConstant, true, 3);
  o.use_hilbert = true;
  const CallResult got = run(o, {8, 2}, false, 8), want = run(o, {8, 2}, true, 8);
  expect_close(got.out, want.out, "out");
  expect_close(got.grad_k, want.grad_k, "grad_k");
}

// Across ranks (threads in this process): every strategy and layout gives one device's rows.
using test::RingCase;

class GroupedQueryRing : public ::testing::TestWithParam<RingCase> {};

TEST_P(GroupedQueryRing, MatchesOneDevice) {
  const auto [P, strategy, mixing, causal, layout] = GetParam();
  const DilatedAttentionOptions o =
      options_for(DilationVariant::kSegmentLocal, mixing, OffsetRule::kConstant, causal, 3);
  // Without documents, and with documents that cross the ranks' blocks.
  for (const nn::DocumentStarts& documents :
       {nn::DocumentStarts{}, nn::DocumentStarts{{0, 5, 11, 17}, {0, 13}}}) {
    SCOPED_TRACE(documents.empty() ? "no documents" : "documents");
    const test::FullSequence f =
        test::single_device(o, DType::kFloat64, 40 + static_cast<uint64_t>(P), Device::cpu(),
                            test::RingDims{2, 24, 8, 8, /*kv_heads=*/2}, documents);
    test::expect_ranks_match(test::run_in_process_ranks(f, o, P, strategy, layout), f,
                             {1e-10, 1e-10, 1e-10});
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GroupedQueryRing, ::testing::ValuesIn(test::every_ring_case()),
                         test::ring_case_name);

// One GPU shared by P ranks (threads): 8 query heads on 2 key/value heads in bf16, on the path
// one GPU picks, against the single-GPU call (both layouts, both strategies, causal).
TEST(GroupedQueryRingCuda, RanksSharingOneGpuMatchIt) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kAllHeads,
                                          OffsetRule::kConstant, true, 3);
  o.segment_lengths = {128, 256, 512};
  o.dilation_rates = {1, 2, 4};
  const test::FullSequence f = test::single_device(o, DType::kBFloat16, 43, Device::cuda(0),
                                                   test::RingDims{2, 512, 8, 64, /*kv_heads=*/2});
  test::expect_every_split_matches(f, o, test::gpu_ring_tolerance(DType::kBFloat16));
}

// Only the key/value rows travel: with head groups that each share one key/value head (16
// heads in 4 groups, 4 key/value heads: the benchmark's shape), the ring sends H_kv / H of
// the bytes of the same call without grouping.
TEST(GroupedQueryRingTraffic, SendsTheKeyValueHeadsOnly) {
  const DilatedAttentionOptions o = options_for(
      DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups, OffsetRule::kConstant, false, 4);
  const test::FullSequence gqa =
      test::single_device(o, DType::kFloat64, 50, Device::cpu(), test::RingDims{2, 24, 16, 8, 4});
  const test::FullSequence full =
      test::single_device(o, DType::kFloat64, 50, Device::cpu(), test::RingDims{2, 24, 16, 8, 16});
  const auto gqa_ranks = test::run_in_process_ranks(gqa, o, 4, nn::DistStrategy::kRing);
  const auto full_ranks = test::run_in_process_ranks(full, o, 4, nn::DistStrategy::kRing);
  int64_t gqa_bytes = 0, full_bytes = 0;
  for (const auto& r : gqa_ranks) gqa_bytes += r.info.forward_bytes_sent;
  for (const auto& r : full_ranks) full_bytes += r.info.forward_bytes_sent;
  ASSERT_GT(full_bytes, 0);
  EXPECT_EQ(gqa_bytes * 4, full_bytes);
}

// The decoding step reads the shared key/value heads of the cache.
TEST(GroupedQueryDecode, EveryStepEqualsTheFullForwardsRow) {
  for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
    DilatedAttentionOptions o =
        options_for(DilationVariant::kSegmentLocal, mixing, OffsetRule::kRotating, true, 4);
    Generator gen(9);
    const TensorOptions f64(DType::kFloat64);
    const Tensor q = randn({1, 24, 12, 8}, gen, f64);
    const Tensor k = randn({1, 24, 3, 8}, gen, f64), v = randn({1, 24, 3, 8}, gen, f64);
    const std::vector<double> full = nn::dilated_attention(q, k, v, o).to_vector<double>();
    nn::DilatedKVCache cache(1, 4, 3, 8, f64);
    for (int64_t p = 0; p < 24; ++p) {
      cache.append(k.narrow(1, p, 1), v.narrow(1, p, 1));
      const std::vector<double> step =
          nn::dilated_attention_decode_step(q.narrow(1, p, 1), cache, o).out.to_vector<double>();
      for (size_t i = 0; i < step.size(); ++i) {
        ASSERT_NEAR(step[i], full[static_cast<size_t>(p) * step.size() + i], 1e-12) << "p " << p;
      }
    }
  }
}

// On the GPU each path (with its fallbacks) in bfloat16 gives the CPU float64 result on the
// same rounded inputs, forward and backward, to bfloat16's rounding (a shared key/value
// head's gradient sums several query heads', hence the looser gradient tolerance). The shapes
// cover key/value heads that two head groups share (the second pair's dK/dV add to the
// first's stored ones), that head groups straddle, and that four pairs share (float32
// accumulation); each without and with document masks. A loss that reads out only lets
// cuDNN run the backward too (it has no lse gradient); with documents its calls then run
// over pieces (one ragged call per pair and heads, storing or adding dK/dV by the same rule).
// Documents must not change kAuto's path: their pieces take cuDNN (one call over pieces)
// wherever the call without them does, not one flash call per piece. Forced flash with such a
// loss plans the groups and then runs their calls one by one (flash takes no calls over pieces).
TEST(GroupedQueryCuda, EveryPathMatchesTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::pair<GqaShape, int>> shapes = {
      {{8, 2}, 4}, {{12, 3}, 4}, {{8, 4}, 3}, {{8, 1}, 4}};
  const nn::DocumentStarts documents = {{0, 5, 11, 12, 19}, {0, 13}};
  using nn::AttentionPath;
  // (path, loss reads lse, q/k/v views of one projection)
  const std::vector<std::tuple<AttentionPath, bool, bool>> paths = {
      {AttentionPath::kMath, true, false},   {AttentionPath::kFlash, true, false},
      {AttentionPath::kFlash, false, false}, {AttentionPath::kCudnn, true, false},
      {AttentionPath::kCudnn, false, false}, {AttentionPath::kAuto, false, false},
      {AttentionPath::kCudnn, false, true}};
  std::map<std::pair<size_t, HeadMixing>, AttentionPath> auto_path_without_documents;
  for (const nn::DocumentStarts* docs :
       {static_cast<const nn::DocumentStarts*>(nullptr), &documents}) {
    for (size_t shape_index = 0; shape_index < shapes.size(); ++shape_index) {
      const auto& [shape, pairs] = shapes[shape_index];
      for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
        for (const auto& [path, reads_lse, projected] : paths) {
          SCOPED_TRACE(std::string(nn::path_name(path)) +
                       (mixing == HeadMixing::kAllHeads ? " all heads" : " head groups") + ", H " +
                       std::to_string(shape.heads) + ", H_kv " + std::to_string(shape.kv_heads) +
                       (docs != nullptr ? ", documents" : "") +
                       (reads_lse ? ", loss reads lse" : "") +
                       (projected ? ", views of one projection" : ""));
          DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, mixing,
                                                  OffsetRule::kConstant, true, pairs);
          const CallResult want = run(o, shape, false, 11, DType::kFloat64, Device::cpu(),
                                      DType::kBFloat16, docs, reads_lse, projected);
          o.path = path;
          CallResult got;
          try {
            got = run(o, shape, false, 11, DType::kBFloat16, Device::cuda(0), DType::kBFloat16,
                      docs, reads_lse, projected);
          } catch (const std::exception& e) {
            // Named with the case (SCOPED_TRACE shows only on assertions); the device may be
            // unusable after a failed kernel, so the test stops here.
            FAIL() << e.what();
          }
          const double unit = std::ldexp(1.0, -8);
          expect_close(got.out, want.out, "out", 8 * unit);
          expect_close(got.lse, want.lse, "lse", 8 * unit);
          for (const auto& [g, w, name] : {std::tuple{&got.grad_q, &want.grad_q, "grad_q"},
                                           std::tuple{&got.grad_k, &want.grad_k, "grad_k"},
                                           std::tuple{&got.grad_v, &want.grad_v, "grad_v"}}) {
            expect_close(*g, *w, name, 32 * unit);
          }
          if (path == AttentionPath::kAuto && docs == nullptr) {
            auto_path_without_documents[{shape_index, mixing}] = got.path_used;
          } else if (path == AttentionPath::kAuto) {
            const auto found = auto_path_without_documents.find({shape_index, mixing});
            ASSERT_NE(found, auto_path_without_documents.end());  // runs without documents first
            const AttentionPath without = found->second;
            EXPECT_EQ(got.path_used, without) << nn::path_name(got.path_used) << " with documents, "
                                              << nn::path_name(without) << " without";
          }
        }
      }
    }
  }
}

// Where kAuto takes cuDNN without documents (segments that tile the sequence), it takes cuDNN
// with them too: each pair's grouped-query document pieces as one call over pieces (a flash
// call per piece would report flash), with results to bfloat16's rounding of the CPU's.
TEST(GroupedQueryCuda, DocumentPiecesRunOnCudnn) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  // A boundary in every segment of row 0, so that no run of segments without one (which
  // batches segments that do not tile the rows: flash) is left.
  const nn::DocumentStarts documents = {{0, 2, 5, 11, 12, 19, 22}, {0, 13}};
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups,
                                          OffsetRule::kConstant, true, 4);
  // Head groups of 3 over key/value heads of 4 query heads: shared and straddled heads.
  o.segment_lengths = {4, 8, 12, 24};
  o.dilation_rates = {1, 2, 4, 2};
  for (const bool projected : {false, true}) {
    SCOPED_TRACE(projected ? "views of one projection" : "q, k, v of their own");
    for (const nn::DocumentStarts* docs :
         {static_cast<const nn::DocumentStarts*>(nullptr), &documents}) {
      const CallResult want = run(o, {12, 3}, false, 5, DType::kFloat64, Device::cpu(),
                                  DType::kBFloat16, docs, false, projected);
      const CallResult got = run(o, {12, 3}, false, 5, DType::kBFloat16, Device::cuda(0),
                                 DType::kBFloat16, docs, false, projected);
      EXPECT_EQ(got.path_used, nn::AttentionPath::kCudnn)
          << nn::path_name(got.path_used) << (docs != nullptr ? " with documents" : "");
      const double unit = std::ldexp(1.0, -8);
      expect_close(got.out, want.out, "out", 8 * unit);
      expect_close(got.grad_q, want.grad_q, "grad_q", 32 * unit);
      expect_close(got.grad_k, want.grad_k, "grad_k", 32 * unit);
      expect_close(got.grad_v, want.grad_v, "grad_v", 32 * unit);
    }
  }
}

// A group of document pieces that must add its dK/dV adds q-dtype scratch into gradients
// that may be float32 (three or more pairs per key/value head): the float32 sums must keep
// their precision (the add once rounded them to bfloat16).
TEST(GroupedQueryAddInto, AFloat32TargetKeepsItsPrecisionUnderABFloat16Addend) {
  const double fine = 1.0 + std::ldexp(1.0, -12);  // not a bfloat16 value
  const Tensor target = full({3}, fine, TensorOptions(DType::kFloat32));
  const Tensor addend = full({3}, 0.125, TensorOptions(DType::kBFloat16));
  nn::add_into(target, addend);
  for (const double got : target.to_vector<double>()) EXPECT_EQ(got, fine + 0.125);
  // A bfloat16 target takes one rounding of the float32 sum.
  const Tensor narrow = full({2}, 1.0, TensorOptions(DType::kBFloat16));
  nn::add_into(narrow, full({2}, std::ldexp(1.0, -7), TensorOptions(DType::kFloat32)));
  for (const double got : narrow.to_vector<double>()) EXPECT_EQ(got, 1.0 + std::ldexp(1.0, -7));
}

// The backward's pieces (AttentionCallContext::backward_piece_elements) count the query
// heads of a grouped call, not its key/value heads: 8 query heads on one key/value head over
// 6 segments of 512 q elements each run in 3 pieces at 1024 elements (counting the key/value
// head alone gave one piece of 8 times the bound). Pieces of any size give the whole call's
// gradients.
TEST(GroupedQueryPieces, CountQueryHeadsAndGiveTheWholeCallsGradients) {
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups,
                                          OffsetRule::kConstant, false, 1);
  Generator gen(11);
  const TensorOptions f64(DType::kFloat64);
  const Tensor q0 = randn({2, 24, 8, 8}, gen, f64), k0 = randn({2, 24, 1, 8}, gen, f64),
               v0 = randn({2, 24, 1, 8}, gen, f64), w = randn({2, 24, 8, 8}, gen, f64);
  struct Grads {
    Tensor q, k, v;
    int64_t backward_calls;
  };
  auto grads = [&](int64_t piece_elements) {
    Tensor q = q0.detach(), k = k0.detach(), v = v0.detach();
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
    nn::AttentionCallCounts counts;
    nn::AttentionCallContext context;
    context.backward_piece_elements = piece_elements;
    context.counts = &counts;
    sum(mul(nn::dilated_attention(q, k, v, o, context), w)).backward();
    const nn::AttentionCallCounts::Calls& b = counts.backward;
    return Grads{q.grad(), k.grad(), v.grad(), b.cudnn + b.flash + b.math};
  };
  const Grads whole = grads(int64_t{1} << 26);
  EXPECT_EQ(whole.backward_calls, 1);
  EXPECT_EQ(grads(1024).backward_calls, 3);
  for (const int64_t piece_elements : {1, 700, 1024, 2048, 2600}) {
    SCOPED_TRACE("piece_elements " + std::to_string(piece_elements));
    const Grads got = grads(piece_elements);
    expect_close(got.q, whole.q, "grad_q", 1e-12);
    expect_close(got.k, whole.k, "grad_k", 1e-12);
    expect_close(got.v, whole.v, "grad_v", 1e-12);
  }
}

// How many pairs read one key/value head decides whether dK/dV may be stored in the inputs'
// dtype (at most two) or accumulate in float32.
TEST(GroupedQueryPlan, PairsPerKeyValueHead) {
  DilatedAttentionOptions o = options_for(DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups,
                                          OffsetRule::kConstant, false, 3);
  // 16 heads in groups of 6, 5, 5: heads 4-5 and 6-7 share key/value head 1 (groups of 4).
  EXPECT_EQ(nn::max_pairs_per_kv_head(o, 16, 1), 1);
  EXPECT_EQ(nn::max_pairs_per_kv_head(o, 16, 4), 2);
  EXPECT_EQ(nn::max_pairs_per_kv_head(o, 16, 16), 3);
  EXPECT_EQ(nn::max_pairs_per_kv_head(o, 12, 4), 1);  // groups of 4 on groups of 4
  o.mixing = HeadMixing::kAllHeads;
  EXPECT_EQ(nn::max_pairs_per_kv_head(o, 16, 1), 3);
}

TEST(GroupedQueryErrors, HeadCountsThatDoNotDivideAreNamed) {
  Generator gen(10);
  const Tensor q = randn({1, 8, 6, 4}, gen), k = randn({1, 8, 4, 4}, gen);
  const DilatedAttentionOptions o = options_for(
      DilationVariant::kSegmentLocal, HeadMixing::kAllHeads, OffsetRule::kConstant, false, 2);
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, k, k, o); }, {ErrorCode::kShapeMismatch},
                           {"dilated_attention", "H_kv dividing", "[1, 8, 6, 4]", "[1, 8, 4, 4]"}));
  const Tensor v = randn({1, 8, 2, 4}, gen), k2 = randn({1, 8, 3, 4}, gen);
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, k2, v, o); }, {ErrorCode::kShapeMismatch},
                           {"one shape"}));
}

}  // namespace
}  // namespace rd
