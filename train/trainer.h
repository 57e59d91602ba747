// The training loop of rd_train: a LanguageModel on a Dataset with AdamW, schedules,
// clipping, gradient accumulation, mixed precision, evaluation, checkpoints with bit-exact
// resume, metrics, and data / context parallelism over a communicator.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/lr_schedule.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/train/dataset.h"
#include "ringdilated/train/model.h"
#include "ringdilated/train/train_config.h"

namespace rd::train {

// Checks a configuration; throws rd::Error naming the field and value.
void check_train_config(const TrainConfig& config, int world_size);

struct EvalResult {
  double loss = 0;  // mean over scored tokens
  double perplexity = 0;
  int64_t tokens = 0;  // the scored held-out tokens
  // Synthetic tasks have answers: `accuracy` counts them. Text and token files have none
  // (every token is scored; exact match of whole windows means nothing): they report the
  // loss, and byte-level text (text:<file>) the bits per byte, loss / ln 2.
  bool has_answers = true;
  AccuracyCounts accuracy;
  std::optional<double> bits_per_byte;
};

struct TrainResult {
  int64_t steps_done = 0;   // the step count reached (a resumed run counts from 0)
  bool stopped = false;     // ended early on a stop request
  // Ended early because an evaluation reached config.stop_at_exact_match: at this step,
  // with that evaluation's exact match (the final evaluation is in final_eval).
  std::optional<int64_t> target_step;
  double target_exact_match = 0;
  double last_loss = 0;     // the mean training loss of the last logged steps
  EvalResult final_eval;
  std::string checkpoint;   // the last checkpoint written
  double seconds = 0;
};

class Trainer {
 public:
  // `world`: every rank of the job (nullptr: a single process). Every rank constructs the
  // trainer with the same configuration.
  Trainer(TrainConfig config, std::shared_ptr<dist::Communicator> world = nullptr);
  ~Trainer();

  // Trains from the current step to config.steps, evaluating, logging and checkpointing as
  // configured; returns early (after a checkpoint) once *stop becomes true on any rank.
  TrainResult run(const std::atomic<bool>* stop = nullptr);
  // Loss, perplexity and answer accuracy on `batches` held-out batches (the same ones every
  // time: held-out batches 0, 1, ...).
  EvalResult evaluate(int64_t batches);
  // Writes a checkpoint of the current state (rank 0 writes; every rank must call).
  std::string save();

  // The loss and gradients of the next step's batch, summed over every rank, without an
  // update (the data stream advances): what the distributed tests compare with one rank.
  struct Gradients {
    double loss = 0;  // mean over every rank's scored tokens
    std::map<std::string, Tensor> grads;  // of the model's parameters (compute dtype)
  };
  Gradients compute_gradients();

  int64_t step() const;
  LanguageModel& model();
  const TrainConfig& config() const;
  // The checkpoint folder this run resumed from or last wrote; empty before either.
  const std::string& last_checkpoint() const;
  // What the constructor noticed and went on with (printed to stderr unless quiet): a lock
  // taken over from a killed run, leftovers of interrupted saves removed, step folders
  // skipped for lack of a manifest, configuration changes allowed on resume.
  const std::vector<std::string>& notes() const;

  struct State;  // defined in trainer.cc

 private:
  std::unique_ptr<State> s_;
};

// The compute dtype a configuration's dtype names (float32, bfloat16, float16, float64), or
// none for any other name.
std::optional<DType> compute_dtype_named(std::string_view name);

// The dtype `config` computes in: its dtype, or nn::recommended_dtype(config.device) where
// that is empty. Throws rd::Error (kInvalidArgument) for an unknown name.
DType compute_dtype(const TrainConfig& config);

// Greedy or sampled continuation of `prompt` tokens (batch of one) by `model`, on the
// model's device: temperature 0 is greedy; top_k 0 keeps every token.
std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, double temperature, int64_t top_k,
                              uint64_t seed);

}  // namespace rd::train
