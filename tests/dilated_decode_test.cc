// Decoding with a KV cache (nn/dilated_decode.h): the step for position p equals row p of
// the naive float64 reference (tests/testing/dilated_reference.h) and of the full forward,
// for every p of a sequence (prompts ending inside a segment, at a boundary, on positions
// some pair does not select), both mixing modes, both offset rules; the cache grows; bad
// input is named.
#include "ringdilated/nn/dilated_decode.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "testing/dilated_reference.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"

namespace rd {
namespace {

using nn::DilatedAttentionOptions;
using nn::DilatedKVCache;
using nn::HeadMixing;
using nn::OffsetRule;

constexpr int64_t kBatch = 2, kSeq = 37, kHeads = 6, kDim = 5;

DilatedAttentionOptions causal_options(HeadMixing mixing, OffsetRule rule) {
  DilatedAttentionOptions o;
  o.segment_lengths = {4, 8, 16};  // N = 37 ends inside a short last segment of each pair
  o.dilation_rates = {1, 2, 4};
  o.mixing = mixing;
  o.offset_rule = rule;
  o.causal = true;
  return o;
}

class DecodeStep : public ::testing::TestWithParam<std::tuple<HeadMixing, OffsetRule>> {};

// Appending one position at a time, every step equals row p of the reference and of the
// forward over the whole sequence (rows before p do not see later keys: causal).
TEST_P(DecodeStep, EveryPositionEqualsTheFullForwardsRow) {
  const auto [mixing, rule] = GetParam();
  const DilatedAttentionOptions o = causal_options(mixing, rule);
  Generator gen(31);
  const TensorOptions f64(DType::kFloat64);
  const Tensor q = randn({kBatch, kSeq, kHeads, kDim}, gen, f64);
  const Tensor k = randn({kBatch, kSeq, kHeads, kDim}, gen, f64);
  const Tensor v = randn({kBatch, kSeq, kHeads, kDim}, gen, f64);
  const test::DilatedReferenceResult want = test::dilated_attention_reference(
      test::heads_array_of(q), test::heads_array_of(k), test::heads_array_of(v), o);
  const nn::DilatedAttentionResult full = nn::dilated_attention_with_lse(q, k, v, o);
  const std::vector<double> full_out = full.out.contiguous().to_vector<double>();
  DilatedKVCache cache(kBatch, /*capacity=*/3, kHeads, kDim, f64);  // grows on the way
  int unselected_rows = 0;
  for (int64_t p = 0; p < kSeq; ++p) {
    cache.append(k.narrow(1, p, 1), v.narrow(1, p, 1));
    const nn::DilatedAttentionResult step =
        nn::dilated_attention_decode_step(q.narrow(1, p, 1), cache, o);
    const std::vector<double> out = step.out.contiguous().to_vector<double>();
    const std::vector<double> lse = step.lse.to(DType::kFloat64).to_vector<double>();
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const double want_lse = want.lse_at(b, h, p);
        const double got_lse = lse[static_cast<size_t>(b * kHeads + h)];
        if (std::isinf(want_lse)) {
          ++unselected_rows;
          EXPECT_TRUE(std::isinf(got_lse) && got_lse < 0) << "p " << p << " h " << h;
        } else {
          // The step's lse is float32 like the forward's.
          EXPECT_NEAR(got_lse, want_lse, 1e-5 * std::max(1.0, std::abs(want_lse)))
              << "p " << p << " h " << h;
        }
        for (int64_t d = 0; d < kDim; ++d) {
          const double got = out[static_cast<size_t>((b * kHeads + h) * kDim + d)];
          EXPECT_NEAR(got, want.out.at(b, p, h, d), 1e-10) << "p " << p << " h " << h;
          EXPECT_NEAR(got, full_out[static_cast<size_t>(((b * kSeq + p) * kHeads + h) * kDim + d)],
                      1e-12)
              << "p " << p << " h " << h;
        }
      }
    }
  }
  EXPECT_EQ(cache.length(), kSeq);
  EXPECT_GE(cache.capacity(), kSeq);
  // Head groups leave the rows a group's pair does not select empty: the case is covered.
  if (mixing == HeadMixing::kHeadGroups) {
    EXPECT_GT(unselected_rows, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DecodeStep,
    ::testing::Combine(::testing::Values(HeadMixing::kHeadGroups, HeadMixing::kAllHeads),
                       ::testing::Values(OffsetRule::kConstant, OffsetRule::kRotating)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == HeadMixing::kHeadGroups ? "groups"
                                                                            : "allheads") +
             (std::get<1>(info.param) == OffsetRule::kConstant ? "_constant" : "_rotating");
    });

// A prompt appended at once, then steps: the same as appending one by one (float32).
TEST(DecodeCache, APromptAppendedAtOnceThenStepsMatchesTheForward) {
  const DilatedAttentionOptions o = causal_options(HeadMixing::kAllHeads, OffsetRule::kConstant);
  Generator gen(32);
  const Tensor q = randn({1, kSeq, kHeads, kDim}, gen);
  const Tensor k = randn({1, kSeq, kHeads, kDim}, gen);
  const Tensor v = randn({1, kSeq, kHeads, kDim}, gen);
  const std::vector<double> full =
      nn::dilated_attention(q, k, v, o).to(DType::kFloat64).to_vector<double>();
  const int64_t prompt = 16;  // ends at a boundary of every pair's segments
  DilatedKVCache cache(1, 64, kHeads, kDim, TensorOptions(DType::kFloat32));
  cache.append(k.narrow(1, 0, prompt), v.narrow(1, 0, prompt));
  for (int64_t p = prompt; p < kSeq; ++p) {
    cache.append(k.narrow(1, p, 1), v.narrow(1, p, 1));
    const std::vector<double> out = nn::dilated_attention_decode_step(q.narrow(1, p, 1), cache, o)
                                        .out.to(DType::kFloat64)
                                        .to_vector<double>();
    for (int64_t i = 0; i < kHeads * kDim; ++i) {
      EXPECT_NEAR(out[static_cast<size_t>(i)], full[static_cast<size_t>(p * kHeads * kDim + i)],
                  1e-5)
          << "p " << p;
    }
  }
}

// On the GPU, every path (its fallbacks allowed) and float32 / bfloat16: every step equals
// the float64 reference on the same (rounded) inputs, to the dtype's rounding. kAuto takes
// flash: a step's key count grows by one each step, and cuDNN would build a graph for each.
TEST(DecodeStepCuda, EveryPathMatchesTheFloat64Reference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Device gpu = Device::cuda(0);
  for (const HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (const nn::AttentionPath path : {nn::AttentionPath::kMath, nn::AttentionPath::kFlash,
                                           nn::AttentionPath::kCudnn, nn::AttentionPath::kAuto}) {
        SCOPED_TRACE(std::string(nn::path_name(path)) + " " + std::string(dtype_name(dtype)) +
                     (mixing == HeadMixing::kAllHeads ? " all heads" : " head groups"));
        DilatedAttentionOptions o = causal_options(mixing, OffsetRule::kRotating);
        o.path = path;
        Generator gen(34);
        // The inputs rounded to the dtype; the reference computes on exactly these values.
        auto rounded = [&] {
          return randn({1, kSeq, kHeads, kDim}, gen, TensorOptions(DType::kFloat64))
              .to(dtype)
              .to(DType::kFloat64);
        };
        const Tensor q = rounded(), k = rounded(), v = rounded();
        const test::DilatedReferenceResult want = test::dilated_attention_reference(
            test::heads_array_of(q), test::heads_array_of(k), test::heads_array_of(v), o);
        const double tol = 16 * test::unit_roundoff(dtype) * 4.0;  // |v| < ~4
        nn::DilatedKVCache cache(1, 8, kHeads, kDim, TensorOptions(dtype).with_device(gpu));
        for (int64_t p = 0; p < kSeq; ++p) {
          cache.append(k.narrow(1, p, 1).to(dtype).to(gpu), v.narrow(1, p, 1).to(dtype).to(gpu));
          const nn::DilatedAttentionResult step =
              nn::dilated_attention_decode_step(q.narrow(1, p, 1).to(dtype).to(gpu), cache, o);
          if (path == nn::AttentionPath::kAuto) {
            EXPECT_EQ(step.path_used, nn::AttentionPath::kFlash) << nn::path_name(step.path_used);
          }
          const std::vector<double> out =
              step.out.to(Device::cpu()).to(DType::kFloat64).to_vector<double>();
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t d = 0; d < kDim; ++d) {
              ASSERT_NEAR(out[static_cast<size_t>(h * kDim + d)], want.out.at(0, p, h, d), tol)
                  << "p " << p << " h " << h;
            }
          }
        }
      }
    }
  }
}

// Truncating rolls positions back: re-appending other rows gives their step, not a mix.
TEST(DecodeCache, TruncateRollsPositionsBack) {
  const DilatedAttentionOptions o = causal_options(HeadMixing::kAllHeads, OffsetRule::kConstant);
  Generator gen(35);
  const TensorOptions f64(DType::kFloat64);
  const Tensor k = randn({1, 12, kHeads, kDim}, gen, f64),
               v = randn({1, 12, kHeads, kDim}, gen, f64);
  const Tensor other = randn({1, 12, kHeads, kDim}, gen, f64);
  const Tensor q = randn({1, 1, kHeads, kDim}, gen, f64);
  DilatedKVCache fresh(1, 4, kHeads, kDim, f64), rolled(1, 4, kHeads, kDim, f64);
  fresh.append(k, v);
  rolled.append(k.narrow(1, 0, 7), v.narrow(1, 0, 7));
  rolled.append(other.narrow(1, 7, 5), other.narrow(1, 7, 5));  // a draft, then rolled back
  rolled.truncate(7);
  rolled.append(k.narrow(1, 7, 5), v.narrow(1, 7, 5));
  const std::vector<double> want =
      nn::dilated_attention_decode_step(q, fresh, o).out.to_vector<double>();
  const std::vector<double> got =
      nn::dilated_attention_decode_step(q, rolled, o).out.to_vector<double>();
  EXPECT_EQ(got, want);
}

TEST(DecodeCache, BadInputIsNamed) {
  DilatedAttentionOptions o = causal_options(HeadMixing::kHeadGroups, OffsetRule::kConstant);
  DilatedKVCache cache(1, 8, kHeads, kDim, TensorOptions(DType::kFloat32));
  Generator gen(33);
  const Tensor row = randn({1, 1, kHeads, kDim}, gen);
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention_decode_step(row, cache, o); },
                           {ErrorCode::kInvalidArgument},
                           {"dilated_attention_decode_step", "empty"}));
  cache.append(row, row);
  EXPECT_TRUE(test::raises(
      [&] {
        nn::dilated_attention_decode_step(randn({1, 2, kHeads, kDim}, gen), cache, o);
      },
      {ErrorCode::kShapeMismatch}, {"'q'", "[1, 1, H, 5]", "6 key/value heads", "[1, 2, 6, 5]"}));
  o.causal = false;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention_decode_step(row, cache, o); },
                           {ErrorCode::kInvalidArgument}, {"causal"}));
  o.causal = true;
  o.variant = nn::DilationVariant::kGlobal;
  EXPECT_TRUE(test::raises([&] { nn::dilated_attention_decode_step(row, cache, o); },
                           {ErrorCode::kUnimplemented}, {"global variant", "recomputing"}));
  EXPECT_TRUE(test::raises(
      [&] {
        cache.append(randn({1, 1, kHeads + 1, kDim}, gen), row);
      },
      {ErrorCode::kShapeMismatch}, {"append", "'k'"}));
  EXPECT_TRUE(test::raises([&] { cache.truncate(2); }, {ErrorCode::kInvalidArgument},
                           {"truncate", "[0, 1]", "2"}));
  EXPECT_TRUE(test::raises([&] { DilatedKVCache(1, 0, kHeads, kDim, TensorOptions()); },
                           {ErrorCode::kInvalidArgument}, {"DilatedKVCache", "capacity"}));
}

}  // namespace
}  // namespace rd
