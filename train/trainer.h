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
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/lr_schedule.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/train/dataset.h"
#include "ringdilated/train/model.h"

namespace rd::train {

struct TrainConfig {
  ModelConfig model;
  std::string data = "passkey";  // make_dataset's spec
  DatasetOptions data_options;   // data_options.task.seq_len is the sequence length
  // Sequences per micro-batch on each data-parallel rank, and the target batch of one
  // optimizer step in tokens (over every rank): the gradient is accumulated over
  // tokens_per_step / (batch_size x seq_len x data-parallel ranks) micro-batches (at least 1).
  int64_t batch_size = 8;
  int64_t tokens_per_step = 0;  // 0: one micro-batch per step
  int64_t steps = 1000;

  // AdamW with decoupled weight decay (not on norms and embeddings), linear warmup then
  // decay, global gradient-norm clipping (0: off).
  double lr = 1e-3;
  double min_lr_ratio = 0.1;
  int64_t warmup_steps = 50;
  nn::LrDecay decay = nn::LrDecay::kCosine;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;

  // Compute dtype: float32, bfloat16 or float16 (with dynamic loss scaling), or empty for
  // nn::recommended_dtype(device). Lower precision keeps float32 master weights.
  std::string dtype;
  Device device = Device::cpu();

  int64_t eval_every = 100;  // 0: only at the end
  // Stop training at the first periodic evaluation whose held-out exact match is at least
  // this (tasks with answers; 0: off): the run then ends as if its last step were reached
  // (final evaluation on final_eval_batches, checkpoint). How long the passkey task takes
  // depends on a sudden, run-dependent learning transition; stopping once it has happened
  // saves the steps after it. Not part of the saved configuration: it may change on resume.
  double stop_at_exact_match = 0;
  int64_t eval_batches = 8;  // of batch_size held-out sequences
  int64_t final_eval_batches = 32;  // the evaluation at the end (the reported accuracy)
  int64_t log_every = 10;
  int64_t checkpoint_every = 0;  // 0: only at the end (and on a stop request)
  int keep_checkpoints = 3;
  std::string out_dir = "runs/default";  // checkpoints/, metrics.jsonl
  // Resume from the newest checkpoint in out_dir/checkpoints ("auto": if there is one),
  // or from this checkpoint folder.
  std::string resume;
  // Resuming refuses a configuration that changes what the run computes (the data, model and
  // optimization fields config_to_json saves, and the world size), naming each difference;
  // true resumes anyway, with a note. Logging, evaluation, checkpoint and memory settings,
  // the device and the sequence-parallel strategy may always change.
  bool allow_config_change = false;
  uint64_t seed = 0;

  // Ranks of a context-parallel group (the sequence is split among them); the others are
  // data parallel. Must divide the world size and the sequence length.
  int context_parallel = 1;
  nn::DistStrategy strategy = nn::DistStrategy::kAuto;
  // How the context-parallel ranks split each sequence (kAuto: zigzag, which balances the
  // causal work, when 2 x context_parallel divides the sequence length).
  nn::SequenceLayout cp_layout = nn::SequenceLayout::kAuto;
  bool quiet = false;  // no console output (tests)
};

// Checks a configuration; throws rd::Error naming the field and value.
void check_train_config(const TrainConfig& config, int world_size);

// The configuration as JSON text (stored in every checkpoint's trainer.json) and back.
std::string config_to_json(const TrainConfig& config);
TrainConfig config_from_json(const std::string& json);
// The configuration a checkpoint's trainer state (CheckpointContents::trainer_state) holds.
TrainConfig config_from_checkpoint(const std::string& trainer_state);

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
  // What the constructor noticed and went on with (printed to stderr unless quiet): a lock
  // taken over from a killed run, leftovers of interrupted saves removed, step folders
  // skipped for lack of a manifest, configuration changes allowed on resume.
  const std::vector<std::string>& notes() const;

  struct State;  // defined in trainer.cc

 private:
  std::unique_ptr<State> s_;
};

// Greedy or sampled continuation of `prompt` tokens (batch of one) by `model`, on the
// model's device: temperature 0 is greedy; top_k 0 keeps every token.
std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, double temperature, int64_t top_k,
                              uint64_t seed);

}  // namespace rd::train
