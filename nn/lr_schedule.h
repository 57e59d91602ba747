// Learning-rate schedules: linear warmup to a peak, then cosine, linear or no decay to a
// floor, as a pure function of the step (feed it to AdamW::set_lr before each step()).
#pragma once

#include <cstdint>

namespace rd::nn {

enum class LrDecay {
  kCosine,    // min_lr + (peak - min_lr) * (1 + cos(pi * progress)) / 2
  kLinear,    // peak + (min_lr - peak) * progress
  kConstant,  // peak for every step after warmup (min_lr and total_steps unused)
};

// A schedule over optimizer steps 0, 1, 2, ... (the value of AdamW::step_count() before the
// step that uses it). With W = warmup_steps and T = total_steps:
//   step < W        peak * (f + (1 - f) * step / W), f = warmup_start_factor: linear from
//                   peak * f at step 0 (0 by default, as Hugging Face's warmup) to peak at W
//   W <= step < T   the decay, progress = (step - W) / (T - W) going from 0 to 1
//   step >= T       min_lr (peak for kConstant)
// The floor is min_lr, or min_lr_ratio * peak_lr; at most one of the two may be non-zero.
struct LrScheduleOptions {
  double peak_lr = 1e-3;
  int64_t warmup_steps = 0;
  double warmup_start_factor = 0.0;
  int64_t total_steps = 0;  // > warmup_steps for kCosine and kLinear
  LrDecay decay = LrDecay::kCosine;
  double min_lr = 0.0;
  double min_lr_ratio = 0.0;
};

class LrSchedule {
 public:
  // Throws rd::Error naming the option for: peak_lr not finite and > 0, warmup_steps < 0,
  // warmup_start_factor outside [0, 1], min_lr outside [0, peak_lr], min_lr_ratio outside
  // [0, 1], both floors non-zero, total_steps <= warmup_steps for a decaying schedule.
  explicit LrSchedule(LrScheduleOptions options);

  // The learning rate at `step` (>= 0; throws rd::Error otherwise).
  double lr_at(int64_t step) const;
  // The floor the decay ends at (min_lr, or min_lr_ratio * peak_lr).
  double min_lr() const { return min_lr_; }
  const LrScheduleOptions& options() const { return options_; }

 private:
  LrScheduleOptions options_;
  double min_lr_;
};

}  // namespace rd::nn
