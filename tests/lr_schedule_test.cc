// LrSchedule at the boundary steps of each phase (first and last warmup step, the peak, the
// decay's middle and end, past the end) against the closed forms written out here, for each
// decay kind, warmup start factor and floor; and the option checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include "ringdilated/nn/lr_schedule.h"
#include "testing/raises.h"

namespace rd {
namespace {

using nn::LrDecay;
using nn::LrSchedule;
using nn::LrScheduleOptions;

constexpr double kPeak = 3e-4;
constexpr double kTol = 1e-15;  // the closed forms below are evaluated the same few ways

LrScheduleOptions options(LrDecay decay, int64_t warmup, int64_t total, double min_lr = 0,
                          double min_ratio = 0, double start_factor = 0) {
  LrScheduleOptions o;
  o.peak_lr = kPeak;
  o.warmup_steps = warmup;
  o.total_steps = total;
  o.decay = decay;
  o.min_lr = min_lr;
  o.min_lr_ratio = min_ratio;
  o.warmup_start_factor = start_factor;
  return o;
}

TEST(LrSchedule, CosineWithWarmupFromZero) {
  const LrSchedule s(options(LrDecay::kCosine, 10, 110, 3e-5));
  EXPECT_EQ(s.lr_at(0), 0.0);
  EXPECT_NEAR(s.lr_at(1), kPeak / 10, kTol);
  EXPECT_NEAR(s.lr_at(5), kPeak / 2, kTol);
  EXPECT_NEAR(s.lr_at(9), kPeak * 0.9, kTol);
  EXPECT_NEAR(s.lr_at(10), kPeak, kTol);  // the end of warmup is the peak
  // Cosine from the peak to 3e-5 over 100 steps: halfway at step 60, a quarter at 35.
  EXPECT_NEAR(s.lr_at(60), (kPeak + 3e-5) / 2, kTol);
  EXPECT_NEAR(s.lr_at(35), 3e-5 + (kPeak - 3e-5) * (1 + std::cos(std::numbers::pi / 4)) / 2,
              kTol);
  EXPECT_NEAR(s.lr_at(109), 3e-5 + (kPeak - 3e-5) * (1 + std::cos(std::numbers::pi * 0.99)) / 2,
              kTol);
  EXPECT_GT(s.lr_at(109), 3e-5);
  EXPECT_EQ(s.lr_at(110), 3e-5);
  EXPECT_EQ(s.lr_at(1000000), 3e-5);
  EXPECT_EQ(s.min_lr(), 3e-5);
}

TEST(LrSchedule, LinearDecayWithRatioFloorAndWarmupStartFactor) {
  // Warmup from 0.1 * peak over 4 steps; linear decay to 0.1 * peak at step 24.
  const LrSchedule s(options(LrDecay::kLinear, 4, 24, 0, 0.1, 0.1));
  const double floor = 0.1 * kPeak;
  EXPECT_NEAR(s.min_lr(), floor, kTol);
  EXPECT_NEAR(s.lr_at(0), 0.1 * kPeak, kTol);
  EXPECT_NEAR(s.lr_at(2), kPeak * (0.1 + 0.9 * 0.5), kTol);
  EXPECT_NEAR(s.lr_at(3), kPeak * (0.1 + 0.9 * 0.75), kTol);
  EXPECT_NEAR(s.lr_at(4), kPeak, kTol);
  EXPECT_NEAR(s.lr_at(5), kPeak - (kPeak - floor) / 20, kTol);
  EXPECT_NEAR(s.lr_at(14), (kPeak + floor) / 2, kTol);
  EXPECT_NEAR(s.lr_at(23), floor + (kPeak - floor) / 20, kTol);
  EXPECT_NEAR(s.lr_at(24), floor, kTol);
  EXPECT_NEAR(s.lr_at(99), floor, kTol);
}

TEST(LrSchedule, NoWarmupStartsAtThePeak) {
  const LrSchedule cosine(options(LrDecay::kCosine, 0, 8));
  EXPECT_EQ(cosine.lr_at(0), kPeak);
  EXPECT_NEAR(cosine.lr_at(4), kPeak / 2, kTol);
  EXPECT_EQ(cosine.lr_at(8), 0.0);
  const LrSchedule linear(options(LrDecay::kLinear, 0, 1));
  EXPECT_EQ(linear.lr_at(0), kPeak);
  EXPECT_EQ(linear.lr_at(1), 0.0);
}

TEST(LrSchedule, ConstantAfterWarmupIgnoresTotalSteps) {
  const LrSchedule s(options(LrDecay::kConstant, 2, 0));
  EXPECT_EQ(s.lr_at(0), 0.0);
  EXPECT_NEAR(s.lr_at(1), kPeak / 2, kTol);
  EXPECT_EQ(s.lr_at(2), kPeak);
  EXPECT_EQ(s.lr_at(1 << 30), kPeak);
}

TEST(LrSchedule, RejectsBadOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    LrScheduleOptions o;
    std::string fragment;
  };
  auto with = [](auto change) {
    LrScheduleOptions o = options(LrDecay::kCosine, 10, 100);
    change(o);
    return o;
  };
  const Case cases[] = {
      {with([](LrScheduleOptions& o) { o.peak_lr = 0; }), "'peak_lr'"},
      {with([&](LrScheduleOptions& o) { o.peak_lr = nan; }), "'peak_lr'"},
      {with([](LrScheduleOptions& o) { o.warmup_steps = -1; }), "'warmup_steps'"},
      {with([](LrScheduleOptions& o) { o.warmup_start_factor = 1.5; }), "'warmup_start_factor'"},
      {with([](LrScheduleOptions& o) { o.min_lr = 2 * kPeak; }), "'min_lr'"},
      {with([](LrScheduleOptions& o) { o.min_lr = -1e-9; }), "'min_lr'"},
      {with([&](LrScheduleOptions& o) { o.min_lr_ratio = nan; }), "'min_lr_ratio'"},
      {with([](LrScheduleOptions& o) { o.min_lr = 1e-5, o.min_lr_ratio = 0.1; }), "not both"},
      {with([](LrScheduleOptions& o) { o.total_steps = 10; }), "'total_steps'"},
      {with([](LrScheduleOptions& o) { o.decay = LrDecay::kLinear, o.total_steps = 0; }),
       "'total_steps'"},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(test::raises([&] { LrSchedule s(c.o); }, {ErrorCode::kInvalidArgument},
                             {"LrSchedule", c.fragment}));
  }
  const LrSchedule s(options(LrDecay::kCosine, 1, 2));
  EXPECT_TRUE(test::raises([&] { (void)s.lr_at(-1); }, {ErrorCode::kInvalidArgument},
                           {"LrSchedule.lr_at", "'step'", "-1"}));
}

}  // namespace
}  // namespace rd
