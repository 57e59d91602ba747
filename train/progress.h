// The console of rd_train: a start-up summary (parameters, memory, batch) and a live
// progress line (step, loss, the last evaluation, learning rate, gradient norm, tokens/s,
// MFU, ETA).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "ringdilated/train/model.h"

namespace rd::train {

class Progress {
 public:
  // Silent: prints nothing (other ranks, tests). On a terminal the progress line is
  // rewritten in place; otherwise each update is a line of its own.
  Progress(int64_t total_steps, bool silent);

  void print_summary(const LanguageModel& model, DType dtype, Device device,
                     bool master_weights, int64_t micro_batches, int64_t tokens_per_step) const;
  // A training update; `mfu` 0 leaves it out (unknown peak, e.g. the CPU).
  void update(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s,
              double mfu);
  // An evaluation of a task with answers; its exact match then shows on the progress line.
  void eval(int64_t step, double loss, double token_accuracy, double exact_match);
  // An evaluation of text or tokens (no answers): the loss, perplexity and, for byte-level
  // text, bits per byte, which then shows on the progress line (else the held-out loss).
  void eval_text(int64_t step, double loss, std::optional<double> bits_per_byte);
  // The evaluation at `step` reached the exact-match target: training stops there.
  void target_reached(int64_t step, double exact_match, double target);
  // Ends the in-place line.
  void finish();

 private:
  int64_t total_steps_;
  bool silent_;
  bool tty_;
  bool line_open_ = false;
  std::chrono::steady_clock::time_point last_time_ = std::chrono::steady_clock::now();
  int64_t last_step_ = -1;  // the step of the last update; -1 before the first
  std::string last_eval_;    // the last eval's headline for the progress line ("acc 40.6%")
};

// "1h02m", "3m05s", "42s".
std::string format_duration(double seconds);
// "1.23M", "45.6k", "789".
std::string format_count(double value);

}  // namespace rd::train
