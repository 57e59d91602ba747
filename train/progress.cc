// Progress: rd_train's start-up summary and live progress line.
#include "ringdilated/train/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/device.h"

namespace rd::train {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s % 3600 / 60));
  } else if (s >= 60) {
    std::snprintf(text, sizeof(text), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(text, sizeof(text), "%llds", static_cast<long long>(s));
  }
  return text;
}

std::string format_count(double value) {
  char text[32];
  if (value >= 1e9) {
    std::snprintf(text, sizeof(text), "%.2fG", value / 1e9);
  } else if (value >= 1e6) {
    std::snprintf(text, sizeof(text), "%.2fM", value / 1e6);
  } else if (value >= 1e3) {
    std::snprintf(text, sizeof(text), "%.1fk", value / 1e3);
  } else {
    std::snprintf(text, sizeof(text), "%.0f", value);
  }
  return text;
}

Progress::Progress(int64_t total_steps, bool silent)
    : total_steps_(total_steps), silent_(silent), tty_(::isatty(STDOUT_FILENO) != 0) {}

void Progress::print_summary(const LanguageModel& model, DType dtype, Device device,
                             bool master_weights, int64_t micro_batches,
                             int64_t tokens_per_step) const {
  if (silent_) return;
  const ModelConfig& c = model.config();
  const double params = static_cast<double>(model.num_parameters());
  const double weight_bytes = params * static_cast<double>(dtype_size(dtype));
  // AdamW keeps two float32 moments; lower precision adds float32 master weights.
  const double state_bytes = params * 4.0 * (master_weights ? 3.0 : 2.0);
  std::printf("model: %s parameters (%lld layers, width %lld, %lld heads, vocab %lld), %s on %s\n",
              format_count(params).c_str(), static_cast<long long>(c.depth),
              static_cast<long long>(c.dim), static_cast<long long>(c.heads),
              static_cast<long long>(c.vocab_size), std::string(dtype_name(dtype)).c_str(),
              device.str().c_str());
  // On the CPU a run retraces another only on the same kernel set (kernels/cpu/parallel.h).
  if (!device.is_cuda()) {
    // OPENBLAS_NUM_THREADS can give GEMMs another count, which changes their rounding too.
    const int threads = num_threads(), blas_threads = kernels::cpu::blas_num_threads();
    const std::string blas_note =
        blas_threads == threads ? "" : str_cat(" (OpenBLAS ", blas_threads, ")");
    std::printf("cpu: %d thread%s%s, %s kernels\n", threads, threads == 1 ? "" : "s",
                blas_note.c_str(), cpu_gemm_kernels().c_str());
  }
  std::printf("memory: weights %sB, optimizer%s %sB", format_count(weight_bytes).c_str(),
              master_weights ? " + float32 masters" : "", format_count(state_bytes).c_str());
  if (device.is_cuda()) {
    const MemoryStats m = allocator_for(device).stats();
    std::printf(", device allocated %sB", format_count(static_cast<double>(m.allocated_bytes)).c_str());
  }
  std::printf("\nbatch: %s tokens per step (%lld micro-batch%s)\n",
              format_count(static_cast<double>(tokens_per_step)).c_str(),
              static_cast<long long>(micro_batches), micro_batches == 1 ? "" : "es");
  std::fflush(stdout);
}

void Progress::update(int64_t step, double loss, double lr, double grad_norm,
                      double tokens_per_s, double mfu) {
  if (silent_) return;
  // The ETA extrapolates the steps since the last update (the first update's window also
  // holds start-up costs, and a resumed run starts late).
  const auto now = std::chrono::steady_clock::now();
  const double window = std::chrono::duration<double>(now - last_time_).count();
  const double per_step = window / static_cast<double>(std::max<int64_t>(step - last_step_, 1));
  const double eta = last_step_ < 0 ? -1 : per_step * static_cast<double>(total_steps_ - step);
  last_time_ = now;
  last_step_ = step;
  char line[256];
  int n = std::snprintf(line, sizeof(line), "step %lld/%lld | loss %.4f", static_cast<long long>(step),
                        static_cast<long long>(total_steps_), loss);
  if (!last_eval_.empty()) n += std::snprintf(line + n, sizeof(line) - n, " | %s", last_eval_.c_str());
  n += std::snprintf(line + n, sizeof(line) - n, " | lr %.2e | gnorm %.3f | %s tok/s", lr, grad_norm,
                     format_count(tokens_per_s).c_str());
  if (mfu > 0) n += std::snprintf(line + n, sizeof(line) - n, " | MFU %.1f%%", 100 * mfu);
  std::snprintf(line + n, sizeof(line) - n, " | ETA %s", format_duration(eta).c_str());
  if (tty_) {
    std::printf("\r\033[K%s", line);
    line_open_ = true;
  } else {
    std::printf("%s\n", line);
  }
  std::fflush(stdout);
}

void Progress::eval(int64_t step, double loss, double token_accuracy, double exact_match) {
  char headline[32];
  std::snprintf(headline, sizeof(headline), "acc %.1f%%", 100 * exact_match);
  last_eval_ = headline;
  if (silent_) return;
  finish();
  std::printf("eval @ step %lld | loss %.4f | perplexity %.3f | answer tokens %.1f%% | exact match %.1f%%\n",
              static_cast<long long>(step), loss, std::exp(loss), 100 * token_accuracy,
              100 * exact_match);
  std::fflush(stdout);
}

void Progress::eval_text(int64_t step, double loss, std::optional<double> bits_per_byte) {
  char headline[48];
  if (bits_per_byte) {
    std::snprintf(headline, sizeof(headline), "val %.3f bits/byte", *bits_per_byte);
  } else {
    std::snprintf(headline, sizeof(headline), "val loss %.4f", loss);
  }
  last_eval_ = headline;
  if (silent_) return;
  finish();
  std::printf("eval @ step %lld | loss %.4f | perplexity %.3f", static_cast<long long>(step), loss,
              std::exp(loss));
  if (bits_per_byte) std::printf(" | %.3f bits per byte", *bits_per_byte);
  std::printf("\n");
  std::fflush(stdout);
}

void Progress::target_reached(int64_t step, double exact_match, double target) {
  if (silent_) return;
  finish();
  std::printf("target reached at step %lld: held-out exact match %.1f%% >= %.1f%% "
              "(stop_at_exact_match); stopping early, the final evaluation follows\n",
              static_cast<long long>(step), 100 * exact_match, 100 * target);
  std::fflush(stdout);
}

void Progress::finish() {
  if (line_open_) std::printf("\n");
  line_open_ = false;
}

}  // namespace rd::train
