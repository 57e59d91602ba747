// LrSchedule (nn/lr_schedule.h): option checks and the piecewise closed form.
#include "ringdilated/nn/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "LrSchedule";

bool decays(LrDecay decay) { return decay != LrDecay::kConstant; }

void check_options(const LrScheduleOptions& o) {
  RD_CHECK(std::isfinite(o.peak_lr) && o.peak_lr > 0, kInvalidArgument, kOp,
           ": option 'peak_lr' must be finite and > 0, got ", o.peak_lr);
  RD_CHECK(o.warmup_steps >= 0, kInvalidArgument, kOp,
           ": option 'warmup_steps' must be >= 0, got ", o.warmup_steps);
  RD_CHECK(o.warmup_start_factor >= 0 && o.warmup_start_factor <= 1, kInvalidArgument, kOp,
           ": option 'warmup_start_factor' must be in [0, 1], got ", o.warmup_start_factor);
  RD_CHECK(o.min_lr >= 0 && o.min_lr <= o.peak_lr, kInvalidArgument, kOp,
           ": option 'min_lr' must be in [0, peak_lr = ", o.peak_lr, "], got ", o.min_lr);
  RD_CHECK(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, kInvalidArgument, kOp,
           ": option 'min_lr_ratio' must be in [0, 1], got ", o.min_lr_ratio);
  RD_CHECK(o.min_lr == 0 || o.min_lr_ratio == 0, kInvalidArgument, kOp,
           ": set option 'min_lr' (", o.min_lr, ") or 'min_lr_ratio' (", o.min_lr_ratio,
           "), not both");
  RD_CHECK(!decays(o.decay) || o.total_steps > o.warmup_steps, kInvalidArgument, kOp,
           ": option 'total_steps' must be > warmup_steps = ", o.warmup_steps,
           " for a decaying schedule, got ", o.total_steps);
}

}  // namespace

LrSchedule::LrSchedule(LrScheduleOptions options)
    : options_(options), min_lr_(options.min_lr + options.min_lr_ratio * options.peak_lr) {
  check_options(options_);
}

double LrSchedule::lr_at(int64_t step) const {
  RD_CHECK(step >= 0, kInvalidArgument, kOp, ".lr_at: argument 'step' must be >= 0, got ",
           step);
  const LrScheduleOptions& o = options_;
  if (step < o.warmup_steps) {
    const double f = o.warmup_start_factor;
    return o.peak_lr * (f + (1 - f) * static_cast<double>(step) / o.warmup_steps);
  }
  if (!decays(o.decay)) return o.peak_lr;
  if (step >= o.total_steps) return min_lr_;
  const double progress = static_cast<double>(step - o.warmup_steps) /
                          static_cast<double>(o.total_steps - o.warmup_steps);
  if (o.decay == LrDecay::kLinear) return o.peak_lr + (min_lr_ - o.peak_lr) * progress;
  return min_lr_ + (o.peak_lr - min_lr_) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
}

}  // namespace rd::nn
