// Document masks for packed sequences (AttentionCallContext::document_starts): every mode
// equals the naive float64 reference that keeps only a query's own document's keys (rows of
// one document, rows split at boundaries, documents of one position, documents crossing
// segments); gradients match central differences; across ranks the result and gradients
// equal one device's, documents crossing rank boundaries, both layouts; bad starts are named.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/piece_calls.h"
#include "ringdilated/nn/rank_plan_cache.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "testing/dilated_reference.h"
#include "testing/elementwise_close.h"
#include "testing/gradcheck.h"
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
using nn::HeadMixing;
using nn::OffsetRule;

constexpr int64_t kB = 3, kN = 40, kH = 6, kD = 5;

// Row 0: one document; row 1: documents of 5, 8, 1 and 16 positions then the rest, which
// cross segments of every pair; row 2: three documents.
const std::vector<std::vector<int64_t>> kDocuments = {{}, {0, 5, 13, 14, 30}, {0, 9, 17}};

DilatedAttentionOptions options_for(HeadMixing mixing, OffsetRule rule, bool causal) {
  DilatedAttentionOptions o;
  o.segment_lengths = {4, 8, 16};
  o.dilation_rates = {1, 2, 4};
  o.mixing = mixing;
  o.offset_rule = rule;
  o.causal = causal;
  return o;
}

using Mode = std::tuple<HeadMixing, OffsetRule, bool>;

std::string mode_name(const ::testing::TestParamInfo<Mode>& info) {
  const auto [mixing, rule, causal] = info.param;
  return std::string(mixing == HeadMixing::kAllHeads ? "allheads" : "groups") + "_" +
         (rule == OffsetRule::kRotating ? "rotating" : "constant") + (causal ? "_causal" : "");
}

class DocumentMask : public ::testing::TestWithParam<Mode> {};

TEST_P(DocumentMask, EqualsTheReferenceWithinDocuments) {
  const auto [mixing, rule, causal] = GetParam();
  const DilatedAttentionOptions o = options_for(mixing, rule, causal);
  Generator gen(21);
  const TensorOptions f64(DType::kFloat64);
  const Tensor q = randn({kB, kN, kH, kD}, gen, f64), k = randn({kB, kN, kH, kD}, gen, f64),
               v = randn({kB, kN, kH, kD}, gen, f64);
  nn::AttentionCallContext context;
  context.document_starts = &kDocuments;
  const nn::DilatedAttentionResult got = nn::dilated_attention_with_lse(q, k, v, o, context);
  const test::DilatedReferenceResult want = test::dilated_attention_reference(
      test::heads_array_of(q), test::heads_array_of(k), test::heads_array_of(v), o, &kDocuments);
  test::expect_tensors_close("out", got.out, from_vector<double>(want.out.values, {kB, kN, kH, kD}),
                             1e-10);
  // The lse is float32, like the call's without documents.
  test::expect_tensors_close("lse", got.lse, from_vector<double>(want.lse, {kB, kH, kN}), 1e-6);
  // The documents change the result: without them it differs.
  const Tensor plain = nn::dilated_attention(q, k, v, o);
  EXPECT_GT(max(abs(sub(plain, got.out))).item<double>(), 1e-3);
}

TEST_P(DocumentMask, GradientsMatchCentralDifferences) {
  const auto [mixing, rule, causal] = GetParam();
  const DilatedAttentionOptions o = options_for(mixing, rule, causal);
  Generator gen(22);
  const TensorOptions f64(DType::kFloat64);
  const std::vector<std::vector<int64_t>> documents = {{0, 3, 11}, {0, 7}};
  const Tensor q = randn({2, 20, 3, 4}, gen, f64), k = randn({2, 20, 3, 4}, gen, f64),
               v = randn({2, 20, 3, 4}, gen, f64);
  DilatedAttentionOptions small = o;
  small.segment_lengths = {4, 8};
  small.dilation_rates = {1, 2};
  nn::AttentionCallContext context;
  context.document_starts = &documents;
  EXPECT_TRUE(test::gradcheck(
      [&](const std::vector<Tensor>& in) {
        // The output only: the lse is rounded to float32, too coarse for central differences.
        return std::vector<Tensor>{
            nn::dilated_attention_with_lse(in[0], in[1], in[2], small, context).out};
      },
      {q, k, v}));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DocumentMask,
    ::testing::Combine(::testing::Values(HeadMixing::kHeadGroups, HeadMixing::kAllHeads),
                       ::testing::Values(OffsetRule::kConstant, OffsetRule::kRotating),
                       ::testing::Bool()),
    mode_name);

// How run_with_documents passes q, k and v: three tensors; views of one [B, N, H + 2 H_kv, D]
// tensor, as a module's projection gives them; or one tensor three times (kv_heads = H).
struct DocumentInputs {
  enum class Layout { kSeparate, kPacked, kAliased } layout = Layout::kSeparate;
  int64_t kv_heads = 4;
};

// One call with documents and the backward of a loss reading out (and lse, with
// `loss_reads_lse`), on `device` in `dtype`; inputs drawn in float64 and rounded to bfloat16,
// so that every run sees the same values (H = 4; k and v of `inputs.kv_heads`). Returns out,
// lse and the three gradients in float64 on the host (aliased inputs: their one gradient
// three times); `path_used`, when given, receives the path the call reported.
std::vector<Tensor> run_with_documents(const DilatedAttentionOptions& o,
                                       const std::vector<std::vector<int64_t>>& documents,
                                       DType dtype, Device device, bool loss_reads_lse = true,
                                       nn::AttentionPath* path_used = nullptr,
                                       nn::AttentionCallCounts* counts = nullptr,
                                       DocumentInputs inputs = {}) {
  using Layout = DocumentInputs::Layout;
  Generator gen(33);
  const Shape shape{2, 64, 4, 16}, kv_shape{2, 64, inputs.kv_heads, 16};
  auto draw = [&](const Shape& s) {
    return randn(s, gen, TensorOptions(DType::kFloat64))
        .to(DType::kBFloat16)
        .to(dtype)
        .to(device)
        .detach();
  };
  Tensor q = draw(shape), k = draw(kv_shape), v = draw(kv_shape);
  const Tensor w_out = draw(shape);
  const Tensor w_lse = draw({2, 4, 64}).to(DType::kFloat64);
  Tensor qkv;
  if (inputs.layout == Layout::kPacked) {
    qkv = cat({q, k, v}, 2);
    qkv.set_requires_grad(true);
    q = qkv.narrow(2, 0, 4);
    k = qkv.narrow(2, 4, inputs.kv_heads);
    v = qkv.narrow(2, 4 + inputs.kv_heads, inputs.kv_heads);
  } else if (inputs.layout == Layout::kAliased) {
    q.set_requires_grad(true);
    k = v = q;
  } else {
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  }
  nn::AttentionCallContext context;
  context.document_starts = &documents;
  context.counts = counts;
  const nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(q, k, v, o, context);
  if (path_used != nullptr) *path_used = r.path_used;
  const Tensor lse = r.lse.to(DType::kFloat64);
  const Tensor finite_lse = where(gt(lse, -1e300), lse, 0.0);
  const Tensor out_term = sum(mul(r.out.to(DType::kFloat64), w_out.to(DType::kFloat64)));
  (loss_reads_lse ? add(out_term, sum(mul(finite_lse, w_lse))) : out_term).backward();
  auto host = [](const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::kFloat64); };
  if (inputs.layout == Layout::kPacked) {
    const Tensor grad = qkv.grad();
    return {host(r.out), host(r.lse), host(grad.narrow(2, 0, 4)),
            host(grad.narrow(2, 4, inputs.kv_heads)),
            host(grad.narrow(2, 4 + inputs.kv_heads, inputs.kv_heads))};
  }
  return {host(r.out), host(r.lse), host(q.grad()), host(k.grad()), host(v.grad())};
}

// The GPU cases' documents: crossing segments of every pair, one of a single position, one at
// the end.
const std::vector<std::vector<int64_t>> kGpuDocuments = {{0, 5, 13, 14, 30}, {0, 20, 21, 50, 63}};

// A GPU call's out, lse and three gradients against the CPU's on the same bf16 values, to
// bf16's rounding (8 units of 2^-8 for out and lse, 32 for the gradients).
void expect_bf16_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  const char* names[] = {"out", "lse", "grad_q", "grad_k", "grad_v"};
  const double unit = std::ldexp(1.0, -8);
  const double tolerances[] = {8 * unit, 8 * unit, 32 * unit, 32 * unit, 32 * unit};
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    test::expect_tensors_close(names[i], got[i], want[i], tolerances[i]);
  }
}

// On the GPU every path (math, flash, cuDNN) with documents, causal or not, both mixings,
// gives the float64 CPU call's out, lse and gradients on the same bf16 values, to bf16's
// rounding (the CPU call is checked against the independent reference above), with a loss
// that reads the lse and one that does not (cuDNN's backward has no lse gradient: only then
// does it run the backward over pieces). Under kAuto the pieces run as one cuDNN call over
// pieces (ragged offsets), never one flash call per piece, and without an lse gradient no
// backward call (pieces or boundary-free segments) leaves cuDNN.
TEST(DocumentMaskCuda, EveryPathMatchesTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::vector<int64_t>>& documents = kGpuDocuments;
  for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
    for (const bool causal : {false, true}) {
      for (const bool reads_lse : {true, false}) {
        DilatedAttentionOptions o = options_for(mixing, OffsetRule::kRotating, causal);
        o.segment_lengths = {16, 32, 64};
        const std::vector<Tensor> want =
            run_with_documents(o, documents, DType::kFloat64, Device::cpu(), reads_lse);
        for (const nn::AttentionPath path :
             {nn::AttentionPath::kMath, nn::AttentionPath::kFlash, nn::AttentionPath::kCudnn,
              nn::AttentionPath::kAuto}) {
          SCOPED_TRACE(std::string(nn::path_name(path)) +
                       (mixing == HeadMixing::kAllHeads ? ", all heads" : ", head groups") +
                       (causal ? ", causal" : "") + (reads_lse ? ", loss reads lse" : ""));
          o.path = path;
          nn::AttentionPath used = nn::AttentionPath::kAuto;
          nn::AttentionCallCounts counts;
          expect_bf16_close(run_with_documents(o, documents, DType::kBFloat16, Device::cuda(0),
                                               reads_lse, &used, &counts),
                            want);
          if (path == nn::AttentionPath::kAuto) {
            EXPECT_EQ(used, nn::AttentionPath::kCudnn) << nn::path_name(used);
            // Without an lse gradient the backward has no reason to leave cuDNN either.
            const nn::AttentionCallCounts::Calls& b = counts.backward;
            if (!reads_lse) {
              EXPECT_EQ(b.flash + b.math, 0) << b.flash << " flash, " << b.math << " math calls";
              EXPECT_GT(b.over_pieces, 0);
            }
          }
        }
      }
    }
  }
}

// q, k and v as views of one packed projection (a module's layout, full heads and grouped
// queries), as one tensor passed three times, and grouped queries apart, under cuDNN: its
// backward over pieces runs into scratch laid out like the projection (all heads) where that
// cannot alias, else into compact scratch; the gradients are the float64 CPU call's on the
// same values.
TEST(DocumentMaskCuda, PackedAndAliasedInputsMatchTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  using Layout = DocumentInputs::Layout;
  const std::pair<const char*, DocumentInputs> cases[] = {
      {"packed", {Layout::kPacked, 4}},
      {"packed, H_kv = 2", {Layout::kPacked, 2}},
      {"aliased", {Layout::kAliased, 4}},
      {"separate, H_kv = 2", {Layout::kSeparate, 2}}};
  for (const auto& [name, inputs] : cases) {
    for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
      for (const bool causal : {false, true}) {
        SCOPED_TRACE(std::string(name) +
                     (mixing == HeadMixing::kAllHeads ? ", all heads" : ", head groups") +
                     (causal ? ", causal" : ""));
        DilatedAttentionOptions o = options_for(mixing, OffsetRule::kRotating, causal);
        o.segment_lengths = {16, 32, 64};
        const std::vector<Tensor> want = run_with_documents(
            o, kGpuDocuments, DType::kFloat64, Device::cpu(), false, nullptr, nullptr, inputs);
        nn::AttentionCallCounts counts;
        expect_bf16_close(run_with_documents(o, kGpuDocuments, DType::kBFloat16, Device::cuda(0),
                                             false, nullptr, &counts, inputs),
                          want);
        EXPECT_GT(counts.backward.over_pieces, 0);
      }
    }
  }
}

// Ranks (threads) against one device: rows, lse and gradients, documents crossing the ranks'
// blocks (N = 40 over 2 or 4 ranks: blocks of 20 or 10, zigzag pieces of 10 or 5).
using test::RingCase;

class DocumentMaskRing : public ::testing::TestWithParam<RingCase> {};

TEST_P(DocumentMaskRing, MatchesOneDevice) {
  const auto [P, strategy, mixing, causal, layout] = GetParam();
  const DilatedAttentionOptions o = options_for(mixing, OffsetRule::kConstant, causal);
  const test::FullSequence f = test::single_device(o, DType::kFloat64, 23, Device::cpu(),
                                                   test::RingDims{kB, kN, kH, kD}, kDocuments);
  test::expect_ranks_match(test::run_in_process_ranks(f, o, P, strategy, layout), f,
                           test::RingTolerance{1e-10, 1e-10, 1e-10});
}

// One GPU shared by P ranks (threads): documents crossing the ranks' blocks, bf16 on the
// path one GPU picks, against the single-GPU call (both layouts, both strategies, causal).
TEST(DocumentMaskRingCuda, RanksSharingOneGpuMatchIt) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  DilatedAttentionOptions o = options_for(HeadMixing::kAllHeads, OffsetRule::kRotating, true);
  o.segment_lengths = {128, 256, 512};
  const nn::DocumentStarts documents = {{0, 37, 200, 201, 390}, {0, 128, 300}};
  const test::FullSequence f = test::single_device(o, DType::kBFloat16, 41, Device::cuda(0),
                                                   test::RingDims{2, 512, 8, 64}, documents);
  test::expect_every_split_matches(f, o, test::gpu_ring_tolerance(DType::kBFloat16));
}

// Under kAuto with a loss that does not read the lse, every document piece runs inside a
// cuDNN call over pieces, on one device and on each rank, forward and backward: the calls on
// a rank's own keys and those on keys from other ranks (segments of 256 and 512 cross the
// blocks of 2 ranks), both mixings (all heads: the gradients go through scratch), causal or
// not, ring and all-gather. Every segment holds a boundary, so no call is without pieces;
// the rows and gradients still equal one device's.
TEST(DocumentMaskRingCuda, PiecesRunAsCallsOverPiecesOnEveryRank) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const nn::DocumentStarts documents = {{0, 37, 130, 200, 300, 390, 450}, {0, 100, 180, 290, 400}};
  for (const HeadMixing mixing : {HeadMixing::kAllHeads, HeadMixing::kHeadGroups}) {
    for (const bool causal : {false, true}) {
      DilatedAttentionOptions o = options_for(mixing, OffsetRule::kRotating, causal);
      o.segment_lengths = {128, 256, 512};
      const test::FullSequence f =
          test::single_device(o, DType::kBFloat16, 44, Device::cuda(0),
                              test::RingDims{2, 512, 8, 64}, documents, /*loss_reads_lse=*/false);
      auto expect_pieces_only = [](const nn::AttentionCallCounts& counts, const std::string& who) {
        for (const auto& [direction, calls] :
             {std::pair{"forward", counts.forward}, {"backward", counts.backward}}) {
          EXPECT_EQ(calls.flash + calls.math, 0) << who << " " << direction << ": " << calls.flash
                                                 << " flash, " << calls.math << " math calls";
          EXPECT_GT(calls.over_pieces, 0) << who << " " << direction;
        }
      };
      SCOPED_TRACE(std::string(mixing == HeadMixing::kAllHeads ? "all heads" : "head groups") +
                   (causal ? ", causal" : ""));
      expect_pieces_only(f.counts, "one device");
      for (const nn::DistStrategy strategy :
           {nn::DistStrategy::kRing, nn::DistStrategy::kAllGather}) {
        const std::vector<test::RankResult> ranks =
            test::run_in_process_ranks(f, o, 2, strategy, nn::SequenceLayout::kContiguous);
        test::expect_ranks_match(ranks, f, test::gpu_ring_tolerance(DType::kBFloat16));
        for (size_t r = 0; r < ranks.size(); ++r) {
          expect_pieces_only(ranks[r].counts, "rank " + std::to_string(r) + " (" +
                                                  nn::strategy_name(strategy) + ")");
        }
      }
    }
  }
}

// The zigzag layout with documents that span three or more pieces, and a loss that does not
// read the lse (so the backward runs over pieces on other ranks' keys too): a rank's two query
// pieces read the same key rows of another rank within one document, which must not share
// one call over pieces (split_shared_keys). The rate-1 pair's pieces on a rank's own rows run
// first and store their scratch over every row of both pieces; with rotating offsets a pair's
// head sets run as one call. Gradients equal one GPU's.
TEST(DocumentMaskRingCuda, ZigzagPiecesSharingRemoteKeysMatchOneGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const nn::DocumentStarts documents = {{0, 400}, {0, 37, 450}};
  for (const auto [causal, rule] : {std::pair{true, OffsetRule::kConstant},
                                    {false, OffsetRule::kConstant},
                                    {true, OffsetRule::kRotating},
                                    {false, OffsetRule::kRotating}}) {
    DilatedAttentionOptions o = options_for(HeadMixing::kAllHeads, rule, causal);
    o.segment_lengths = {128, 256, 512};
    const test::FullSequence f =
        test::single_device(o, DType::kBFloat16, 45, Device::cuda(0), test::RingDims{2, 512, 8, 64},
                            documents, /*loss_reads_lse=*/false);
    for (const int P : {2, 4}) {
      SCOPED_TRACE(std::string(causal ? "causal" : "not causal") +
                   (rule == OffsetRule::kRotating ? ", rotating" : ", constant") +
                   ", P = " + std::to_string(P));
      test::expect_ranks_match(
          test::run_in_process_ranks(f, o, P, nn::DistStrategy::kRing, nn::SequenceLayout::kZigzag),
          f, test::gpu_ring_tolerance(DType::kBFloat16));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DocumentMaskRing, ::testing::ValuesIn(test::every_ring_case()),
                         test::ring_case_name);

// The module with rotary positions: a document starting at 16 (a boundary of the segments of
// 4 and 8; the segment of 32 spans both documents) is attended as if it were a sequence of
// its own (constant offsets select the same relative positions, and rotary scores depend
// only on relative positions), and so is the document before it: an independent check of
// the module path, both mixing modes.
TEST(DocumentMaskModule, DocumentsAttendAsSeparateSequences) {
  for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
    DilatedAttentionOptions o = options_for(mixing, OffsetRule::kConstant, true);
    o.segment_lengths = {4, 8, 32};  // the last pair spans both documents
    nn::MultiheadOptions mo;
    mo.rope_base = 10000.0;
    mo.tensor_options = TensorOptions(DType::kFloat64);
    Generator init(25);
    nn::MultiheadDilatedAttention layer(24, 3, o, init, mo);
    Generator gen(26);
    const Tensor x = randn({1, 32, 24}, gen, TensorOptions(DType::kFloat64));
    const nn::DocumentStarts documents = {{0, 16}};
    const Tensor packed = layer.forward_documents(x, &documents);
    test::expect_tensors_close("document 1", packed.narrow(1, 0, 16),
                               layer.forward(x.narrow(1, 0, 16)), 1e-10);
    test::expect_tensors_close("document 2", packed.narrow(1, 16, 16),
                               layer.forward(x.narrow(1, 16, 16)), 1e-10);
    // And without the mask the second document reads the first.
    EXPECT_GT(
        max(abs(sub(layer.forward(x).narrow(1, 16, 16), packed.narrow(1, 16, 16)))).item<double>(),
        1e-3);
  }
}

TEST(DocumentMaskErrors, BadStartsAreNamed) {
  const DilatedAttentionOptions o = options_for(HeadMixing::kAllHeads, OffsetRule::kConstant, true);
  Generator gen(24);
  const Tensor q = randn({2, 16, 3, 4}, gen);
  nn::AttentionCallContext context;
  const std::vector<std::vector<int64_t>> one_row = {{0, 4}};
  context.document_starts = &one_row;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, q, q, o, context); },
                           {ErrorCode::kInvalidArgument},
                           {"document_starts", "1 rows", "batch of 2"}));
  const std::vector<std::vector<int64_t>> unsorted = {{0, 8, 4}, {0}};
  context.document_starts = &unsorted;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, q, q, o, context); },
                           {ErrorCode::kInvalidArgument}, {"batch row 0", "entry 2", "4"}));
  const std::vector<std::vector<int64_t>> late_first = {{2}, {0}};
  context.document_starts = &late_first;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, q, q, o, context); },
                           {ErrorCode::kInvalidArgument}, {"from 0", "entry 0"}));
  DilatedAttentionOptions global = o;
  global.variant = nn::DilationVariant::kGlobal;
  global.mixing = HeadMixing::kHeadGroups;
  const std::vector<std::vector<int64_t>> fine = {{0, 8}, {0}};
  context.document_starts = &fine;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention(q, q, q, global, context); },
                           {ErrorCode::kUnimplemented}, {"segment-local"}));
}

// A plan depends on every option, the layout, the strategy, the element size and the
// documents' starts: changing any one changes the key (an unchanged call keeps it).
TEST(RankPlanCache, TheKeyNamesEverythingAPlanReads) {
  const DilatedAttentionOptions o =
      options_for(HeadMixing::kHeadGroups, OffsetRule::kConstant, true);
  const nn::RankLayout l{kB, kN / 2, kH, kD, 1, 2, true, 3};
  const auto key = [](const DilatedAttentionOptions& options, const nn::RankLayout& layout,
                      nn::DistStrategy strategy, int64_t bytes, const nn::DocumentStarts* docs) {
    return nn::rank_plan_key(options, layout, strategy, bytes, docs);
  };
  const std::string base = key(o, l, nn::DistStrategy::kAuto, 2, &kDocuments);
  EXPECT_EQ(key(o, l, nn::DistStrategy::kAuto, 2, &kDocuments), base);
  std::vector<std::string> others;
  const auto with = [&](auto change) {
    DilatedAttentionOptions options = o;
    nn::RankLayout layout = l;
    change(options, layout);
    others.push_back(key(options, layout, nn::DistStrategy::kAuto, 2, &kDocuments));
  };
  using O = DilatedAttentionOptions;
  using L = nn::RankLayout;
  with([](O& x, L&) { x.segment_lengths = {4, 8, 8}; });
  with([](O& x, L&) { x.dilation_rates = {1, 2, 2}; });
  with([](O& x, L&) { x.variant = nn::DilationVariant::kGlobal; });
  with([](O& x, L&) { x.mixing = HeadMixing::kAllHeads; });
  with([](O& x, L&) { x.offset_rule = OffsetRule::kRotating; });
  with([](O& x, L&) { x.causal = false; });
  with([](O& x, L&) { x.dropout = 0.1; });
  with([](O& x, L&) { x.scale = 0.5; });
  with([](O& x, L&) { x.use_hilbert = true; });
  with([](O& x, L&) { x.path = nn::AttentionPath::kMath; });
  with([](O&, L& x) { x.batch = 2; });
  with([](O&, L& x) { x.rows_per_rank = 10; });
  with([](O&, L& x) { x.heads = 3; });
  with([](O&, L& x) { x.head_dim = 4; });
  with([](O&, L& x) { x.rank = 0; });
  with([](O&, L& x) { x.ranks = 4; });
  with([](O&, L& x) { x.zigzag = false; });
  with([](O&, L& x) { x.kv_heads = 6; });
  others.push_back(key(o, l, nn::DistStrategy::kRing, 2, &kDocuments));
  others.push_back(key(o, l, nn::DistStrategy::kAuto, 4, &kDocuments));
  others.push_back(key(o, l, nn::DistStrategy::kAuto, 2, nullptr));
  nn::DocumentStarts moved = kDocuments;
  moved[1][2] += 1;
  others.push_back(key(o, l, nn::DistStrategy::kAuto, 2, &moved));
  // The same starts split between rows otherwise.
  const nn::DocumentStarts regrouped = {{0}, {5, 13, 14, 30}, {0, 9, 17}};
  others.push_back(key(o, l, nn::DistStrategy::kAuto, 2, &regrouped));
  for (size_t i = 0; i < others.size(); ++i) {
    EXPECT_NE(others[i], base) << "change " << i;
    for (size_t j = 0; j < i; ++j) EXPECT_NE(others[i], others[j]) << i << " and " << j;
  }
}

TEST(RankPlanCache, AHitReturnsTheStoredPlanAndTheLeastRecentlyUsedGoesFirst) {
  nn::RankPlanCache cache(2);
  int made = 0;
  const auto make = [&] {
    ++made;
    nn::RankPlan plan;
    plan.num_pairs = made;
    return plan;
  };
  const std::shared_ptr<const nn::RankPlan> a = cache.get("a", make);
  EXPECT_EQ(cache.get("a", make), a);  // a hit: the same plan, nothing made
  EXPECT_EQ(made, 1);
  cache.get("b", make);
  cache.get("a", make);  // a is now the most recently used
  cache.get("c", make);  // evicts b
  EXPECT_EQ(made, 3);
  EXPECT_EQ(cache.get("a", make), a);
  EXPECT_EQ(made, 3);
  cache.get("b", make);
  EXPECT_EQ(made, 4);
  const nn::RankPlanCacheStats stats = cache.stats();
  EXPECT_EQ(stats.hits, 3);
  EXPECT_EQ(stats.misses, 4);
  EXPECT_EQ(stats.entries, 2);
  EXPECT_THROW(nn::RankPlanCache(0), Error);
}

// A module's second call on the same documents reuses the first's plan, and both equal the
// functional call, which plans anew.
TEST(RankPlanCache, AModuleReusesItsPlanWithTheSameResults) {
  const DilatedAttentionOptions o = options_for(HeadMixing::kAllHeads, OffsetRule::kConstant, true);
  nn::DilatedAttention module(o);
  Generator gen(31);
  const TensorOptions f64(DType::kFloat64);
  const Tensor q = randn({kB, kN, kH, kD}, gen, f64), k = randn({kB, kN, kH, kD}, gen, f64),
               v = randn({kB, kN, kH, kD}, gen, f64);
  const nn::DilatedAttentionResult first = module.forward_with_lse(q, k, v, &kDocuments);
  const nn::DilatedAttentionResult second = module.forward_with_lse(q, k, v, &kDocuments);
  nn::AttentionCallContext context;
  context.document_starts = &kDocuments;
  const nn::DilatedAttentionResult fresh = nn::dilated_attention_with_lse(q, k, v, o, context);
  EXPECT_EQ(module.plan_cache().stats().misses, 1);
  EXPECT_EQ(module.plan_cache().stats().hits, 1);
  // Bit for bit (-inf LSEs included).
  const auto values = [](const Tensor& t) {
    return t.to(DType::kFloat64).contiguous().to_vector<double>();
  };
  for (const nn::DilatedAttentionResult* r : {&first, &second}) {
    EXPECT_EQ(values(r->out), values(fresh.out));
    EXPECT_EQ(values(r->lse), values(fresh.lse));
  }
}

}  // namespace
}  // namespace rd

namespace rd {
namespace {

// The document pieces of one pair, head set and heads form one group (one call over pieces
// where cuDNN takes it); calls for every row stay single; so does a grouped-query block whose
// query heads are not one run.
TEST(PieceCalls, GroupByPairHeadSetAndHeads) {
  DilatedAttentionOptions o = options_for(HeadMixing::kHeadGroups, OffsetRule::kConstant, false);
  std::vector<nn::LocalCall> calls;
  for (const nn::BlockCall& c : nn::plan_block_calls(o, kN, kH, {0, kN}, {0, kN}, 1, &kDocuments)) {
    nn::LocalCall local;
    static_cast<nn::BlockCall&>(local) = c;
    calls.push_back(local);
  }
  const nn::PieceGroups all = nn::group_piece_calls(calls, [](const nn::LocalCall&) { return true; });
  size_t grouped = 0;
  for (const std::vector<const nn::LocalCall*>& group : all.groups) {
    ASSERT_FALSE(group.empty());
    for (const nn::LocalCall* c : group) {
      EXPECT_GE(c->batch_row, 0);
      EXPECT_EQ(c->pair, group.front()->pair);
      EXPECT_EQ(c->head_set, group.front()->head_set);
      EXPECT_EQ(c->q.first_head, group.front()->q.first_head);
      EXPECT_EQ(c->q.head_count, group.front()->q.head_count);
    }
    grouped += group.size();
  }
  for (const nn::LocalCall* c : all.singles) EXPECT_LT(c->batch_row, 0);
  EXPECT_EQ(grouped + all.singles.size(), calls.size());
  // Three pairs of head groups: one group each, since rows 1 and 2 split segments of each.
  EXPECT_EQ(all.groups.size(), o.segment_lengths.size());
  // A filter keeps only what it accepts.
  const nn::PieceGroups pair0 =
      nn::group_piece_calls(calls, [](const nn::LocalCall& c) { return c.pair == 0; });
  for (const std::vector<const nn::LocalCall*>& group : pair0.groups) {
    EXPECT_EQ(group.front()->pair, 0);
  }
  // Grouped-query attention, 6 query heads over 2 key/value heads: the blocks' query heads
  // are each one run (a key/value head's query heads follow the previous one's), so they
  // group like full heads, repeat and all.
  std::vector<nn::LocalCall> shared;
  for (const nn::BlockCall& c : nn::plan_block_calls(o, kN, kH, {0, kN}, {0, kN}, 3, &kDocuments)) {
    nn::LocalCall local;
    static_cast<nn::BlockCall&>(local) = c;
    shared.push_back(local);
  }
  const nn::PieceGroups gqa =
      nn::group_piece_calls(shared, [](const nn::LocalCall&) { return true; });
  size_t gqa_grouped = 0, repeated = 0;
  for (const std::vector<const nn::LocalCall*>& group : gqa.groups) {
    for (const nn::LocalCall* c : group) {
      EXPECT_TRUE(c->q.head_count == 1 || c->q.head_repeat == 1 ||
                  c->q.head_stride == c->q.head_repeat * c->q.repeat_stride);
      EXPECT_EQ(c->q.head_repeat, group.front()->q.head_repeat);
      repeated += c->q.head_repeat > 1 ? 1 : 0;
    }
    gqa_grouped += group.size();
  }
  for (const nn::LocalCall* c : gqa.singles) EXPECT_LT(c->batch_row, 0);
  EXPECT_GT(repeated, 0u);
  EXPECT_EQ(gqa_grouped + gqa.singles.size(), shared.size());
  // A grouped call made to read two key/value heads' pairs of query heads: as one run
  // (heads 0-3) it groups; three heads apart (0, 1, 3, 4) it stays single, since cuDNN's
  // grouped-query layout cannot address such heads.
  ASSERT_FALSE(gqa.groups.empty());
  nn::LocalCall one_run = *gqa.groups.front().front();
  one_run.q.head_count = 2;
  one_run.q.head_repeat = 2;
  one_run.q.repeat_stride = 1;
  one_run.q.head_stride = 2;
  one_run.k.head_count = 2;
  one_run.k.head_repeat = 2;
  nn::LocalCall scattered = one_run;
  scattered.q.head_stride = 3;
  const std::vector<nn::LocalCall> both = {one_run, scattered};
  const nn::PieceGroups apart =
      nn::group_piece_calls(both, [](const nn::LocalCall&) { return true; });
  ASSERT_EQ(apart.groups.size(), 1u);
  EXPECT_EQ(apart.groups.front().size(), 1u);
  EXPECT_EQ(apart.groups.front().front()->q.head_stride, 2);
  ASSERT_EQ(apart.singles.size(), 1u);
  EXPECT_EQ(apart.singles.front()->q.head_stride, 3);
}

// With full heads the document pieces of every head set of a pair with one head count and
// stride form one group (one call over pieces, each piece at its own heads): all heads with
// rotating offsets at rate 2 over 6 heads, sets {0, 2, 4} and {1, 3, 5}, one group. Distinct
// head sets of a group never share a head (their pieces store distinct gradient rows).
// Grouped-query head sets, which may share key/value heads, stay a group each.
TEST(PieceCalls, FullHeadsGroupTheHeadSetsOfAPair) {
  const DilatedAttentionOptions o =
      options_for(HeadMixing::kAllHeads, OffsetRule::kRotating, false);
  // `group` query heads per key/value head.
  auto plan = [&](int64_t group) {
    std::vector<nn::LocalCall> calls;
    for (const nn::BlockCall& c :
         nn::plan_block_calls(o, kN, kH, {0, kN}, {0, kN}, group, &kDocuments)) {
      nn::LocalCall local;
      static_cast<nn::BlockCall&>(local) = c;
      calls.push_back(local);
    }
    return calls;
  };
  const std::vector<nn::LocalCall> full = plan(1);
  const nn::PieceGroups groups =
      nn::group_piece_calls(full, [](const nn::LocalCall&) { return true; });
  int merged = 0;
  size_t grouped = 0;
  for (const std::vector<const nn::LocalCall*>& group : groups.groups) {
    std::map<int, std::set<int64_t>> heads_of_set;
    for (const nn::LocalCall* c : group) {
      EXPECT_EQ(c->pair, group.front()->pair);
      EXPECT_EQ(c->q.rate, group.front()->q.rate);
      EXPECT_EQ(c->q.head_count, group.front()->q.head_count);
      for (int64_t h = 0; h < c->q.head_count; ++h) {
        heads_of_set[c->head_set].insert(c->q.first_head + c->q.head_stride * h);
      }
    }
    std::set<int64_t> seen;
    for (const auto& [set, heads] : heads_of_set) {
      for (int64_t h : heads) EXPECT_TRUE(seen.insert(h).second) << "head " << h << " in two sets";
    }
    if (heads_of_set.size() > 1) {
      ++merged;
      for (const nn::LocalCall* c : group) {
        EXPECT_EQ(c->q.first_head, c->k.first_head);
        EXPECT_EQ(c->q.head_count, c->k.head_count);
        EXPECT_EQ(c->k.head_repeat, 1);
      }
    }
    if (group.front()->q.rate == 2) EXPECT_EQ(heads_of_set.size(), 2u);
    grouped += group.size();
  }
  EXPECT_GT(merged, 0);
  EXPECT_EQ(grouped + groups.singles.size(), full.size());
  const std::vector<nn::LocalCall> shared = plan(3);
  const nn::PieceGroups gqa =
      nn::group_piece_calls(shared, [](const nn::LocalCall&) { return true; });
  for (const std::vector<const nn::LocalCall*>& group : gqa.groups) {
    for (const nn::LocalCall* c : group) {
      EXPECT_EQ(c->head_set, group.front()->head_set);
      EXPECT_TRUE(nn::same_heads(c->q, group.front()->q));
    }
  }
}

// The CPU has no kernel for a call over pieces: it says so, and refuses to run one.
TEST(PieceCalls, TheCpuRefusesACallOverPieces) {
  Generator gen(5);
  const Tensor q = randn({1, 8, 2, 4}, gen);
  kernels::AttentionPieces pieces;
  pieces.batch_row = {0};
  pieces.q_position = pieces.k_position = {0};
  pieces.q_rows = pieces.k_rows = {8};
  kernels::AttentionForwardArgs args;
  args.q = args.k = args.v = kernel_view(q.narrow(1, 0, 1).transpose(1, 2));
  const Tensor out = zeros_like(q);
  args.out = kernel_view(out.narrow(1, 0, 1).transpose(1, 2));
  args.pieces = &pieces;
  kernels::KernelBackend& backend = backend_for(Device::cpu());
  std::string why;
  EXPECT_FALSE(backend.attention_supports(kernels::AttentionKernel::kMath, args, nullptr, &why));
  EXPECT_NE(why.find("pieces"), std::string::npos) << why;
  EXPECT_THROW(backend.attention_forward(kernels::AttentionKernel::kMath, args), Error);
}

// A call over pieces stores each piece's dK/dV, so pieces that read the same keys of one
// batch row go to separate parts: duplicates and overlaps split, other rows and disjoint
// keys stay together.
TEST(PieceCalls, SplitSharedKeysSeparatesPiecesReadingTheSameKeys) {
  auto call = [](int64_t row, int64_t first, int64_t count) {
    nn::LocalCall c;
    c.batch_row = row;
    c.k.first_position = first;
    c.k.count = count;
    c.k.rate = 2;  // keys first, first + 2, ...
    return c;
  };
  // Row 0: [0, 9], [10, 19], [0, 9] again, [8, 17] (overlaps both [0, 9]s); row 1: [0, 9].
  const std::vector<nn::LocalCall> calls = {call(0, 0, 5), call(0, 10, 5), call(0, 0, 5),
                                            call(0, 8, 5), call(1, 0, 5)};
  std::vector<const nn::LocalCall*> group;
  for (const nn::LocalCall& c : calls) group.push_back(&c);
  const auto parts = nn::split_shared_keys(group);
  size_t placed = 0;
  for (const auto& part : parts) {
    placed += part.size();
    for (size_t a = 0; a < part.size(); ++a) {
      for (size_t b = a + 1; b < part.size(); ++b) {
        const nn::LocalCall &x = *part[a], &y = *part[b];
        const bool overlap = x.batch_row == y.batch_row &&
                             x.k.first_position < y.k.first_position + 2 * y.k.count - 1 &&
                             y.k.first_position < x.k.first_position + 2 * x.k.count - 1;
        EXPECT_FALSE(overlap) << "rows " << x.batch_row << " keys " << x.k.first_position << " and "
                              << y.k.first_position;
      }
    }
  }
  EXPECT_EQ(placed, calls.size());
  EXPECT_EQ(parts.size(), 3u);  // [0, 9] twice and [8, 17]: three overlap pairwise
  // Disjoint keys: one part.
  EXPECT_EQ(nn::split_shared_keys({&calls[0], &calls[1], &calls[4]}).size(), 1u);
}

// The case that needs the split: the zigzag layout on 2 ranks holds pieces 1 and 2 of 4 on
// rank 1, and within one document both read rank 0's key piece 0 (causal), so their calls
// on those keys read the same key rows and fall into one group.
TEST(PieceCalls, ZigzagQueryPiecesShareRemoteKeysWithinADocument) {
  DilatedAttentionOptions o = options_for(HeadMixing::kAllHeads, OffsetRule::kConstant, true);
  o.segment_lengths = {128, 256, 512};
  o.dilation_rates = {1, 2, 4};
  const nn::DocumentStarts documents = {{0, 400}};
  const nn::RankLayout layout{1, 256, 4, 8, /*rank=*/1, /*ranks=*/2, /*zigzag=*/true};
  const nn::RankPlan plan = nn::make_rank_plan(o, layout, nn::DistStrategy::kRing, 2, &documents);
  const nn::PieceGroups groups =
      nn::group_piece_calls(plan.calls[0], [](const nn::LocalCall&) { return true; });
  size_t shared = 0;
  for (const std::vector<const nn::LocalCall*>& group : groups.groups) {
    const size_t parts = nn::split_shared_keys(group).size();
    shared += parts > 1 ? 1 : 0;
  }
  EXPECT_GT(shared, 0u) << "no group of rank 1's calls on rank 0's keys shares keys";
}

// AttentionCallCounts on the CPU: every call runs on the math kernels, forward and backward,
// none over pieces; documents split calls into pieces, so they count more calls.
TEST(PieceCalls, TheCpuCountsOneMathCallPerPiece) {
  const DilatedAttentionOptions o =
      options_for(HeadMixing::kHeadGroups, OffsetRule::kConstant, false);
  const test::RingDims dims{kB, kN, kH, kD};
  const test::FullSequence plain =
      test::single_device(o, DType::kFloat64, 5, Device::cpu(), dims, {}, false);
  const test::FullSequence split =
      test::single_device(o, DType::kFloat64, 5, Device::cpu(), dims, kDocuments, false);
  for (const test::FullSequence* f : {&plain, &split}) {
    for (const nn::AttentionCallCounts::Calls& calls : {f->counts.forward, f->counts.backward}) {
      EXPECT_GT(calls.math, 0);
      EXPECT_EQ(calls.cudnn + calls.flash + calls.over_pieces, 0);
    }
  }
  EXPECT_GT(split.counts.forward.math, plain.counts.forward.math);
  EXPECT_GT(split.counts.backward.math, plain.counts.backward.math);
}

}  // namespace
}  // namespace rd
