// Trainer: the training step (micro-batches, mixed precision, gradient all-reduce, clipping,
// AdamW), evaluation, checkpoints and resume, metrics and the console line.
#include "ringdilated/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/grad_clip.h"
#include "ringdilated/nn/gradient_buckets.h"
#include "ringdilated/nn/optimizer.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/train/checkpoint.h"
#include "ringdilated/train/metrics_log.h"
#include "ringdilated/train/progress.h"
#include "ringdilated/train/run_lock.h"

namespace rd::train {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kOp = "Trainer";

// Dense bf16/fp16 tensor-core peak of the device, for MFU; 0 where unknown (the CPU).
double peak_flops(Device device) {
  const int cc = cuda_compute_capability(device);
  if (cc >= 90) return 989e12;  // H100 / H200 SXM
  if (cc >= 80) return 312e12;  // A100
  return 0;
}

// The rows [row0, row0 + rows) of a batch, and of each row the positions of `pieces`, in
// order (a context-parallel rank's share of the sequence).
Batch slice(const Batch& b, int64_t row0, int64_t rows, const std::vector<nn::Block>& pieces) {
  Batch s;
  s.batch_size = rows;
  s.seq_len = 0;
  for (const nn::Block& piece : pieces) s.seq_len += piece.size();
  for (int64_t r = row0; r < row0 + rows; ++r) {
    for (const nn::Block& piece : pieces) {
      const auto at = static_cast<ptrdiff_t>(r * b.seq_len + piece.begin);
      const auto end = at + static_cast<ptrdiff_t>(piece.size());
      s.inputs.insert(s.inputs.end(), b.inputs.begin() + at, b.inputs.begin() + end);
      s.targets.insert(s.targets.end(), b.targets.begin() + at, b.targets.begin() + end);
      s.answer.insert(s.answer.end(), b.answer.begin() + at, b.answer.begin() + end);
    }
  }
  // Document starts stay global positions: the attention places them in the layout.
  if (!b.documents.empty()) {
    s.documents.assign(b.documents.begin() + row0, b.documents.begin() + row0 + rows);
  }
  return s;
}

// The model's view of a batch's documents: null when it packs none.
const nn::DocumentStarts* documents_of(const Batch& b) {
  return b.documents.empty() ? nullptr : &b.documents;
}

int64_t scored_tokens(const Batch& b) {
  return std::count_if(b.targets.begin(), b.targets.end(),
                       [](int32_t t) { return t != kIgnoreIndex; });
}

}  // namespace

std::optional<DType> compute_dtype_named(std::string_view name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    if (name == dtype_name(d)) return d;
  }
  return std::nullopt;
}

DType compute_dtype(const TrainConfig& c) {
  if (c.dtype.empty()) return nn::recommended_dtype(c.device);
  if (const std::optional<DType> named = compute_dtype_named(c.dtype)) return *named;
  RD_FAIL(kInvalidArgument, "dtype (--dtype): unknown dtype '", c.dtype,
          "' (float32, bfloat16, float16 or float64; empty: the device's recommendation)");
}

// ---------------------------------------------------------------------------------------
// Configuration.

void check_train_config(const TrainConfig& c, int world_size) {
  check_model_config(c.model);
  RD_CHECK(c.batch_size >= 1, kInvalidArgument, kOp, ": batch_size must be >= 1, got ",
           c.batch_size);
  RD_CHECK(c.steps >= 1, kInvalidArgument, kOp, ": steps must be >= 1, got ", c.steps);
  RD_CHECK(c.tokens_per_step >= 0, kInvalidArgument, kOp, ": tokens_per_step must be >= 0, got ",
           c.tokens_per_step);
  RD_CHECK(c.lr > 0 && std::isfinite(c.lr), kInvalidArgument, kOp, ": lr must be > 0, got ", c.lr);
  RD_CHECK(c.grad_clip >= 0, kInvalidArgument, kOp, ": grad_clip must be >= 0, got ", c.grad_clip);
  RD_CHECK(c.eval_every >= 0 && c.log_every >= 1 && c.checkpoint_every >= 0 &&
               c.eval_batches >= 1 && c.final_eval_batches >= 1,
           kInvalidArgument, kOp,
           ": eval_every and checkpoint_every must be >= 0, log_every and "
           "eval_batches >= 1, got ",
           c.eval_every, ", ", c.checkpoint_every, ", ", c.log_every, ", ", c.eval_batches);
  RD_CHECK(c.stop_at_exact_match >= 0 && c.stop_at_exact_match <= 1, kInvalidArgument, kOp,
           ": stop_at_exact_match must be in [0, 1] (0: off), got ", c.stop_at_exact_match);
  RD_CHECK(c.keep_checkpoints >= 1, kInvalidArgument, kOp, ": keep_checkpoints must be >= 1, got ",
           c.keep_checkpoints);
  RD_CHECK(c.context_parallel >= 1, kInvalidArgument, kOp,
           ": context_parallel (ranks per context-parallel group) must be >= 1, got ",
           c.context_parallel);
  RD_CHECK(world_size % c.context_parallel == 0, kInvalidArgument, kOp, ": context_parallel ",
           c.context_parallel, " must divide the world size ", world_size);
  const int64_t seq_len = c.data_options.task.seq_len;
  RD_CHECK(seq_len % c.context_parallel == 0, kInvalidArgument, kOp, ": seq_len ", seq_len,
           " must be a multiple of context_parallel ", c.context_parallel);
  RD_CHECK(c.cp_layout != nn::SequenceLayout::kZigzag || seq_len % (2 * c.context_parallel) == 0,
           kInvalidArgument, kOp, ": cp_layout zigzag splits seq_len ", seq_len,
           " into 2 x "
           "context_parallel = ",
           2 * c.context_parallel, " pieces, which it is not a multiple of");
  parse_documents(c.data_options.documents, data_kind(c.data) == DataKind::kTokens);
  // Checked here, before the trainer reads or generates any data.
  RD_CHECK(c.device.is_cpu() || c.device.index < cuda_device_count(), kDeviceMismatch, kOp,
           ": device ", c.device.str(), " is not available (", cuda_device_count(),
           " CUDA devices visible", cuda_device_count() == 0 ? " to this build" : "", ")");
  compute_dtype(c);
}

// ---------------------------------------------------------------------------------------
// The trainer's state.

struct Trainer::State {
  // Rank 0 holds the run folder's lock while the trainer lives (destroyed last).
  std::unique_ptr<RunLock> lock;
  std::vector<std::string> notes;
  TrainConfig config;
  std::shared_ptr<dist::Communicator> world;     // null: one process
  std::shared_ptr<dist::Communicator> sequence;  // the context-parallel group (null: none)
  int rank = 0, world_size = 1;
  int cp_rank = 0, cp_size = 1, dp_rank = 0, dp_size = 1;
  // The context-parallel split of a sequence (resolved) and this rank's pieces of it.
  nn::SequenceLayout layout = nn::SequenceLayout::kContiguous;
  std::vector<nn::Block> pieces;
  DType dtype = DType::kFloat32;
  std::unique_ptr<LanguageModel> model;
  // Lower precision: the model computes in `dtype` and these float32 copies of its
  // parameters (same names, same order) are what the optimizer updates.
  std::vector<std::pair<std::string, Tensor>> masters;
  std::unique_ptr<nn::AdamW> optimizer;
  std::unique_ptr<nn::LrSchedule> schedule;
  std::unique_ptr<Dataset> data;
  std::unique_ptr<MetricsLog> metrics;
  double loss_scale = 1.0;  // float16 only: dynamic loss scaling
  int64_t good_steps = 0;   // float16: steps since the scale last changed
  int64_t micro_batches = 1;
  double flops_per_step = 0;
  double elapsed_before = 0;  // training seconds before run_start (of the runs resumed)
  std::optional<Clock::time_point> run_start;  // set while run() is training
  int64_t tokens_before = 0;
  std::string last_checkpoint;
  // The step and exact match of the evaluation that reached config.stop_at_exact_match, once
  // one has (also restored on resume, so a finished run is not trained further).
  std::optional<std::pair<int64_t, double>> target;
  // Sums the gradients over every rank during the last micro-batch's backward (world_size
  // > 1); made by the first accumulate_gradients.
  std::unique_ptr<nn::GradientBuckets> buckets;

  bool lower_precision() const { return dtype != DType::kFloat32 && dtype != DType::kFloat64; }
  bool is_root() const { return rank == 0; }
  // Every rank keeps the notes; rank 0 prints them.
  void note(const std::string& text) {
    notes.push_back(text);
    if (is_root() && !config.quiet) std::fprintf(stderr, "note: %s\n", text.c_str());
  }
  std::string checkpoint_root() const {
    return (fs::path(config.out_dir) / "checkpoints").string();
  }
  int64_t step() const { return optimizer->step_count(); }
  // Training seconds so far, over every resumed run.
  double elapsed() const {
    return elapsed_before +
           (run_start ? std::chrono::duration<double>(Clock::now() - *run_start).count() : 0.0);
  }
  // The parameters the optimizer steps: the masters, or the model's own.
  std::vector<std::pair<std::string, Tensor>> optimized() const {
    return lower_precision() ? masters : model->named_parameters();
  }
  void all_reduce(const Tensor& t) const {
    if (world && world_size > 1) world->all_reduce(t);
  }
  void barrier() const {
    if (world && world_size > 1) world->barrier();
  }
};

namespace {

using State = Trainer::State;

// Rank 0 owns the run folder while it trains: it takes the folder's lock (another run there
// is an error naming it) and removes what killed saves left in checkpoints/.
void take_run_folder(State& s) {
  s.lock = std::make_unique<RunLock>(s.config.out_dir);
  if (!s.lock->note().empty()) s.note(s.lock->note());
  const std::vector<std::string> removed = clean_checkpoint_root(s.checkpoint_root());
  if (removed.empty()) return;
  std::string names;
  for (const std::string& name : removed) names += (names.empty() ? "" : ", ") + name;
  s.note(str_cat("removed what interrupted saves left in '", s.checkpoint_root(), "': ", names));
}

// The checkpoint to resume from: the newest of out_dir ("auto": if any; "latest": it must
// exist) or the folder given. Newer step folders without a manifest (saves or deletions that
// did not finish) are skipped with a note: resuming from an older step silently would look
// like lost training.
std::optional<std::string> checkpoint_to_resume(State& s) {
  const TrainConfig& c = s.config;
  if (c.resume.empty()) return std::nullopt;
  if (c.resume != "auto" && c.resume != "latest") return c.resume;
  const std::optional<std::string> from = latest_checkpoint(s.checkpoint_root());
  for (const std::string& skipped :
       incomplete_checkpoints(s.checkpoint_root(), from ? checkpoint_step(*from) : -1)) {
    s.note(str_cat("skipping '", skipped,
                   "': it has no manifest.json (its save or deletion did not finish), so it is "
                   "not a checkpoint; ",
                   from ? "resuming from '" + *from + "'" : std::string("no older checkpoint")));
  }
  RD_CHECK(from || c.resume == "auto", kInvalidArgument, kOp, ": --resume=latest but '",
           s.checkpoint_root(), "' holds no checkpoint");
  return from;
}

// Refuses to resume `from` (trainer state `trainer`) with a configuration that changes what
// the run computes, listing every difference, unless allow_config_change (then it notes them
// and the new values hold).
void check_resumed_config(State& s, const CheckpointContents& ck, const Json& trainer,
                          const std::string& from) {
  std::vector<std::string> changes =
      config_changes(config_from_checkpoint(ck.trainer_state), s.config);
  // batch_size is per data-parallel rank: other world sizes train on other global batches.
  const int saved_world = trainer.value("world_size", s.world_size);
  if (saved_world != s.world_size) {
    changes.push_back(str_cat("world_size (ranks): saved ", saved_world, ", now ", s.world_size));
  }
  if (changes.empty()) return;
  std::string list;
  for (const std::string& change : changes) list += "\n  " + change;
  if (s.config.allow_config_change) {
    s.note(
        str_cat("resuming '", from, "' with a changed configuration (allow_config_change):", list));
    return;
  }
  RD_FAIL(kInvalidArgument, kOp, ": cannot resume '", from,
          "' with a different configuration:", list,
          "\nRun with the checkpoint's settings, start a new run (another out_dir, or "
          "resume empty to start over), or pass allow_config_change (--allow_config_change) to "
          "continue with the new values");
}

// Restores the state of checkpoint `from`: weights (and masters), optimizer, data position,
// loss scale and clocks.
void resume_from(State& s, const std::string& from) {
  const CheckpointContents ck = load_checkpoint(from);
  const Json trainer = Json::parse(ck.trainer_state);
  check_resumed_config(s, ck, trainer, from);
  std::map<std::string, Tensor> weights = ck.model;
  if (s.lower_precision()) {
    autograd::NoGradGuard no_grad;
    for (auto& [name, master] : s.masters) {
      RD_CHECK(weights.count(name), kCorruptFile, kOp, ": checkpoint '", from, "' has no weight '",
               name, "'");
      Tensor m = master;
      m.copy_(weights.at(name).to(m.device()));  // checkpoints load on the CPU
    }
  }
  const nn::LoadStateDictResult r = s.model->load_state_dict(weights, /*strict=*/true);
  (void)r;
  s.optimizer->load_state_dict(ck.optimizer);
  s.data->set_state(
      {trainer.at("data_epoch").get<int64_t>(), trainer.at("data_index").get<int64_t>()});
  s.loss_scale = trainer.value("loss_scale", s.loss_scale);
  s.good_steps = trainer.value("good_steps", int64_t{0});
  s.elapsed_before = trainer.value("elapsed_s", 0.0);
  s.tokens_before = trainer.value("tokens", int64_t{0});
  s.last_checkpoint = from;
  // A run that stopped at its target stays stopped while the target is no higher (0 or a
  // higher one trains on).
  if (const auto it = trainer.find("target_reached"); it != trainer.end() && it->is_object()) {
    const double reached = it->value("exact_match", 0.0);
    if (s.config.stop_at_exact_match > 0 && reached >= s.config.stop_at_exact_match) {
      s.target = std::make_pair(it->value("step", s.step()), reached);
    }
  }
}

// Packed documents: the attention masks them (the segment-local variant only) and says so.
void note_documents(Trainer::State& s) {
  if (!s.data->packs_documents()) return;
  const TrainConfig& c = s.config;
  RD_CHECK(c.model.attention.variant == nn::DilationVariant::kSegmentLocal, kInvalidArgument,
           "--documents=", c.data_options.documents, ": ", c.data,
           " packs documents, but the original (global) variant has no document masks; use "
           "--variant=fixed, or --documents=off to attend across documents");
  s.note(str_cat(c.data, ": ", s.data->document_count(),
                 " documents (--documents=", c.data_options.documents,
                 "); attention stays within each, and the last token of a document is not "
                 "scored on the next one's first"));
}

}  // namespace

Trainer::Trainer(TrainConfig config, std::shared_ptr<dist::Communicator> world)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.world = std::move(world);
  s.world_size = s.world ? s.world->size() : 1;
  s.rank = s.world ? s.world->rank() : 0;
  check_train_config(config, s.world_size);
  s.config = std::move(config);
  const TrainConfig& c = s.config;
  if (s.is_root()) take_run_folder(s);
  s.dtype = compute_dtype(c);
  s.cp_size = c.context_parallel;
  s.dp_size = s.world_size / s.cp_size;
  s.cp_rank = s.rank % s.cp_size;
  s.dp_rank = s.rank / s.cp_size;
  if (s.cp_size > 1) s.sequence = s.world->split(s.dp_rank, s.cp_rank);

  s.data = make_dataset(c.data, c.data_options);
  note_documents(s);
  // The attention is causal: kAuto balances its work across the ranks with the zigzag split
  // where that does not split segments the contiguous one keeps local.
  s.layout =
      nn::resolve_layout(c.cp_layout, causal_attention(c.model), s.data->seq_len(), s.cp_size);
  s.pieces = nn::sequence_pieces(s.layout, s.data->seq_len(), s.cp_rank, s.cp_size);
  ModelConfig mc = c.model;
  mc.vocab_size = s.data->vocab_size();
  s.config.model.vocab_size = mc.vocab_size;
  Generator init(c.seed);
  s.model = std::make_unique<LanguageModel>(mc, init,
                                            TensorOptions(DType::kFloat32).with_device(c.device),
                                            s.sequence, c.strategy, s.layout);
  if (s.lower_precision()) {
    for (auto& [name, p] : s.model->named_parameters())
      s.masters.emplace_back(name, p.detach().clone());
    s.model->to(s.dtype);
  }
  nn::AdamWOptions ao;
  ao.lr = c.lr;
  ao.beta1 = c.beta1;
  ao.beta2 = c.beta2;
  ao.weight_decay = c.weight_decay;
  s.optimizer =
      std::make_unique<nn::AdamW>(nn::default_param_groups(s.optimized(), c.weight_decay), ao);
  nn::LrScheduleOptions lo;
  lo.peak_lr = c.lr;
  lo.warmup_steps = std::min(c.warmup_steps, c.steps - 1);
  lo.total_steps = c.steps;
  lo.decay = c.decay;
  lo.min_lr_ratio = c.decay == nn::LrDecay::kConstant ? 0.0 : c.min_lr_ratio;
  s.schedule = std::make_unique<nn::LrSchedule>(lo);
  if (s.dtype == DType::kFloat16) s.loss_scale = 65536.0;

  const int64_t seq_len = s.data->seq_len();
  const int64_t micro_tokens = c.batch_size * seq_len * s.dp_size;
  s.micro_batches = std::max<int64_t>(1, (c.tokens_per_step + micro_tokens - 1) / micro_tokens);
  s.flops_per_step = train_flops_per_sequence(mc, seq_len) *
                     static_cast<double>(c.batch_size * s.dp_size * s.micro_batches);

  if (const std::optional<std::string> from = checkpoint_to_resume(s)) resume_from(s, *from);
  if (s.is_root()) {
    s.metrics = std::make_unique<MetricsLog>((fs::path(c.out_dir) / "metrics.jsonl").string(),
                                             std::optional<int64_t>(s.step()));
  }
}

Trainer::~Trainer() = default;

int64_t Trainer::step() const { return s_->step(); }
LanguageModel& Trainer::model() { return *s_->model; }
const TrainConfig& Trainer::config() const { return s_->config; }
const std::vector<std::string>& Trainer::notes() const { return s_->notes; }
const std::string& Trainer::last_checkpoint() const { return s_->last_checkpoint; }

std::string Trainer::save() {
  State& s = *s_;
  std::string path = checkpoint_path(s.checkpoint_root(), s.step());
  if (s.is_root()) {
    CheckpointContents ck;
    ck.model = s.model->state_dict();
    for (const auto& [name, master] : s.masters) ck.model[name] = master;  // float32 weights
    ck.optimizer = s.optimizer->state_dict();
    const DataState ds = s.data->state();
    Json t = {{"step", s.step()},
              {"data_epoch", ds.epoch},
              {"data_index", ds.index},
              {"loss_scale", s.loss_scale},
              {"good_steps", s.good_steps},
              {"elapsed_s", s.elapsed()},
              {"tokens", s.tokens_before},
              {"world_size", s.world_size},
              {"config", Json::parse(config_to_json(s.config))}};
    if (s.target)
      t["target_reached"] = {{"step", s.target->first}, {"exact_match", s.target->second}};
    ck.trainer_state = t.dump();
    path = save_checkpoint(s.checkpoint_root(), s.step(), ck, s.config.keep_checkpoints);
  }
  s.barrier();  // nobody goes on (or exits) before the checkpoint is complete
  s.last_checkpoint = path;
  return path;
}

// ---------------------------------------------------------------------------------------
// Evaluation.

EvalResult Trainer::evaluate(int64_t batches) {
  State& s = *s_;
  const TrainConfig& c = s.config;
  s.model->eval();
  autograd::NoGradGuard no_grad;
  const Device dev = c.device;
  const int64_t seq_len = s.data->seq_len(), local_len = seq_len / s.cp_size;
  // [loss sum, scored tokens, correct answer tokens, answer tokens, exact samples, samples]
  Tensor totals = zeros({6}, TensorOptions(DType::kFloat64).with_device(dev));
  for (int64_t i = 0; i < batches; ++i) {
    const Batch global = s.data->eval_batch(c.batch_size * s.dp_size, i);
    const Batch mine = slice(global, s.dp_rank * c.batch_size, c.batch_size, s.pieces);
    const Batch::Tensors t = mine.to_tensors();
    const Tensor logits = s.model->forward(t.inputs.to(dev), documents_of(mine));
    const int64_t vocab = logits.size(2);
    const Tensor loss_sum =
        cross_entropy(logits.view({-1, vocab}).to(DType::kFloat32), t.targets.to(dev).view({-1}),
                      kIgnoreIndex, Reduction::kSum);
    Tensor predictions = argmax(logits, 2);
    if (s.cp_size > 1) {  // every rank of the group scores the whole sequence
      Tensor all = empty({s.cp_size, c.batch_size, local_len},
                         TensorOptions(predictions.dtype()).with_device(predictions.device()));
      s.sequence->all_gather(all, predictions.contiguous());
      std::vector<Tensor> blocks;
      for (int r = 0; r < s.cp_size; ++r) blocks.push_back(all.select(0, r));
      predictions = nn::sequence_from_blocks(blocks, s.layout);
    }
    const Batch rows = slice(global, s.dp_rank * c.batch_size, c.batch_size, {{0, seq_len}});
    const AccuracyCounts acc = score_predictions(rows, predictions);
    const bool counts_here = s.cp_rank == 0;  // count each sample once
    const std::vector<double> host = {0.0,
                                      counts_here ? static_cast<double>(scored_tokens(rows)) : 0.0,
                                      counts_here ? static_cast<double>(acc.correct_tokens) : 0.0,
                                      counts_here ? static_cast<double>(acc.answer_tokens) : 0.0,
                                      counts_here ? static_cast<double>(acc.exact_samples) : 0.0,
                                      counts_here ? static_cast<double>(acc.samples) : 0.0};
    Tensor add_counts = from_vector<double>(host, {6}).to(dev);
    totals = add(totals, add_counts);
    Tensor loss_slot = zeros({6}, TensorOptions(DType::kFloat64).with_device(dev));
    loss_slot.narrow(0, 0, 1).copy_(loss_sum.to(DType::kFloat64).view({1}));
    totals = add(totals, loss_slot);
  }
  s.all_reduce(totals);
  const std::vector<double> v = totals.to(Device::cpu()).to_vector<double>();
  s.model->train();
  EvalResult r;
  r.loss = v[1] > 0 ? v[0] / v[1] : 0.0;
  r.perplexity = std::exp(r.loss);
  r.tokens = static_cast<int64_t>(v[1]);
  const DataKind kind = data_kind(c.data);
  r.has_answers = kind == DataKind::kTask;
  if (kind == DataKind::kText) r.bits_per_byte = r.loss / std::log(2.0);  // one token a byte
  r.accuracy.correct_tokens = static_cast<int64_t>(v[2]);
  r.accuracy.answer_tokens = static_cast<int64_t>(v[3]);
  r.accuracy.exact_samples = static_cast<int64_t>(v[4]);
  r.accuracy.samples = static_cast<int64_t>(v[5]);
  return r;
}

// ---------------------------------------------------------------------------------------
// Training.

namespace {

struct Accumulated {
  Tensor loss_sum;            // float32 on the device: this rank's summed token losses
  int64_t scored_tokens = 0;  // over every rank
};

// One optimizer step's gradients: forward and backward over its micro-batches, scaled so
// that they sum to the gradient of the mean token loss over every rank (times the loss
// scale), then summed over every rank (data and context parallel) in buckets that are
// reduced during the last micro-batch's backward, as soon as their gradients are final.
//
// Every rank draws the whole global batch of each micro-batch (cheap, deterministic) and
// keeps its rows (data parallel) and positions (context parallel); so every rank knows the
// global count of scored tokens, the loss's denominator, without communicating.
Accumulated accumulate_gradients(Trainer::State& s) {
  const TrainConfig& c = s.config;
  const Device dev = c.device;
  std::vector<Batch> micro;
  Accumulated a;
  a.loss_sum = zeros({}, TensorOptions(DType::kFloat32).with_device(dev));
  for (int64_t m = 0; m < s.micro_batches; ++m) {
    micro.push_back(s.data->next_batch(c.batch_size * s.dp_size));
    a.scored_tokens += scored_tokens(micro.back());
  }
  const double denominator = static_cast<double>(std::max<int64_t>(a.scored_tokens, 1));
  if (s.buckets == nullptr && s.world != nullptr && s.world_size > 1) {
    s.buckets = std::make_unique<nn::GradientBuckets>(s.model->parameters(), s.world);
  }
  for (const Batch& global : micro) {
    // Only the last micro-batch's backward communicates; the others accumulate locally.
    if (s.buckets != nullptr) s.buckets->set_sync(&global == &micro.back());
    const Batch mine = slice(global, s.dp_rank * c.batch_size, c.batch_size, s.pieces);
    const Batch::Tensors t = mine.to_tensors();
    const Tensor logits = s.model->forward(t.inputs.to(dev), documents_of(mine));
    // The loss in float32 whatever the compute dtype (the logits are [tokens, vocab], small).
    const Tensor loss_sum =
        cross_entropy(logits.view({-1, logits.size(2)}).to(DType::kFloat32),
                      t.targets.to(dev).view({-1}), kIgnoreIndex, Reduction::kSum);
    mul(loss_sum, s.loss_scale / denominator).backward();
    a.loss_sum = add(a.loss_sum, loss_sum.detach().to(DType::kFloat32));
  }
  if (s.buckets != nullptr) s.buckets->finish();
  return a;
}

}  // namespace

Trainer::Gradients Trainer::compute_gradients() {
  State& s = *s_;
  s.model->train();
  for (Tensor p : s.model->parameters()) p.set_grad(Tensor());
  const Accumulated a = accumulate_gradients(s);
  Tensor loss = a.loss_sum.to(DType::kFloat64).view({1});
  s.all_reduce(loss);
  Gradients g;
  g.loss = loss.item<double>() / static_cast<double>(std::max<int64_t>(a.scored_tokens, 1));
  for (auto& [name, p] : s.model->named_parameters()) {
    if (p.grad().defined()) g.grads[name] = mul(p.grad(), 1.0 / s.loss_scale);
    p.set_grad(Tensor());
  }
  return g;
}

namespace {

// The float32 masters' gradients: the model's (16-bit) gradients unscaled by the loss scale,
// in one pass over all of them (one op per parameter would cost ~90 launches a step).
void set_master_gradients(Trainer::State& s,
                          const std::vector<std::pair<std::string, Tensor>>& params) {
  std::vector<Tensor> model_grads, master_grads;
  std::vector<size_t> indices;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& g = params[i].second.grad();
    if (!g.defined()) continue;
    model_grads.push_back(g.contiguous());
    master_grads.push_back(
        empty(g.shape(), TensorOptions(DType::kFloat32).with_device(g.device())));
    indices.push_back(i);
  }
  if (model_grads.empty()) return;
  foreach_scaled_copy_(master_grads, model_grads, 1.0 / s.loss_scale);
  for (size_t k = 0; k < indices.size(); ++k) {
    Tensor master = s.masters[indices[k]].second;
    master.set_grad(master_grads[k]);
  }
}

// Whether a periodic evaluation reached the configured held-out target (tasks only: text
// has no exact match).
bool reaches_target(const TrainConfig& c, const EvalResult& e) {
  return c.stop_at_exact_match > 0 && e.has_answers && e.accuracy.samples > 0 &&
         e.accuracy.exact_match() >= c.stop_at_exact_match;
}

// The training between two logged steps, which a logged step reports.
struct LogWindow {
  Tensor loss_sum;    // this rank's summed token losses (float32, on the device)
  double tokens = 0;  // this rank's share of the scored tokens
  int64_t steps = 0;
  double start = 0;  // training seconds at its start
};

LogWindow open_window(const State& s, double start) {
  LogWindow w;
  w.loss_sum = zeros({}, TensorOptions(DType::kFloat32).with_device(s.config.device));
  w.start = start;
  return w;
}

// What an optimizer step leaves for the logged step that reports it.
struct StepOutcome {
  Tensor grad_norm;  // undefined without clipping (its norm is then not measured)
  double lr = 0;
};

// float16: a step whose gradient norm is not finite is skipped and halves the loss scale;
// 1000 finite steps in a row double it. Reads the norm: one host synchronization. Returns
// whether to skip the update.
bool skip_for_loss_scale(State& s, const Tensor& grad_norm, const std::vector<Tensor>& stepped) {
  const Tensor norm = grad_norm.defined() ? grad_norm : nn::grad_norm(stepped);
  const bool skip = !std::isfinite(norm.item<double>());
  s.loss_scale = skip ? std::max(1.0, s.loss_scale / 2) : s.loss_scale;
  s.good_steps = skip ? 0 : s.good_steps + 1;
  if (s.good_steps >= 1000) {
    s.loss_scale *= 2;
    s.good_steps = 0;
  }
  return skip;
}

// The updated float32 masters rounded into the model's weights, in one pass.
void copy_masters_to_model(State& s, const std::vector<std::pair<std::string, Tensor>>& params) {
  std::vector<Tensor> weights, masters;
  for (size_t i = 0; i < params.size(); ++i) {
    weights.push_back(params[i].second);
    masters.push_back(s.masters[i].second);
  }
  foreach_scaled_copy_(weights, masters);
}

// One optimizer step: the gradients of its micro-batches (added to `window`), unscaled into
// the masters, clipped, then the update at the schedule's learning rate (unless float16's
// loss scaling skips it), and the masters back into the model.
StepOutcome train_step(State& s, LogWindow& window) {
  const TrainConfig& c = s.config;
  const Accumulated a = accumulate_gradients(s);
  window.loss_sum = add(window.loss_sum, a.loss_sum);
  // This rank's share of the scored tokens.
  window.tokens += static_cast<double>(a.scored_tokens) / s.cp_size / s.dp_size;
  const std::vector<std::pair<std::string, Tensor>> params = s.model->named_parameters();
  if (s.lower_precision()) set_master_gradients(s, params);
  std::vector<Tensor> stepped;
  for (const auto& [name, p] : s.optimized()) stepped.push_back(p);
  StepOutcome out;
  out.grad_norm = c.grad_clip > 0 ? nn::clip_grad_norm_(stepped, c.grad_clip) : Tensor();
  const bool skip = s.dtype == DType::kFloat16 && skip_for_loss_scale(s, out.grad_norm, stepped);
  out.lr = s.schedule->lr_at(s.step());
  s.optimizer->set_lr(out.lr);
  if (!skip) s.optimizer->step();
  s.optimizer->zero_grad();
  for (Tensor p : s.model->parameters()) p.set_grad(Tensor());
  if (s.lower_precision()) copy_masters_to_model(s, params);
  s.tokens_before += c.batch_size * s.data->seq_len() * s.dp_size * s.micro_batches;
  ++window.steps;
  return out;
}

// Reports the window that ends at `step` (metrics record and progress line, on rank 0):
// mean loss over every rank, learning rate, gradient norm, throughput and MFU; then opens
// the next. The one host synchronization of a logged step. Returns the mean loss.
double report_window(State& s, Progress& progress, LogWindow& w, const StepOutcome& last,
                     int64_t step) {
  const TrainConfig& c = s.config;
  Tensor loss = w.loss_sum.to(DType::kFloat64).view({1});
  s.all_reduce(loss);
  const double tokens_all = w.tokens * s.cp_size * s.dp_size;
  const double mean_loss = loss.item<double>() / std::max(tokens_all, 1.0);
  const double now = s.elapsed();
  const double dt = std::max(now - w.start, 1e-9);
  const int64_t tokens = c.batch_size * s.data->seq_len() * s.dp_size * s.micro_batches * w.steps;
  const double tokens_per_s = static_cast<double>(tokens) / dt;
  const double peak = peak_flops(c.device) * s.world_size;
  const double mfu = peak > 0 ? s.flops_per_step * w.steps / dt / peak : 0.0;
  const double norm = last.grad_norm.defined() ? last.grad_norm.item<double>() : 0.0;
  if (s.is_root()) {
    Json rec = {{"step", step},
                {"time_s", now},
                {"split", "train"},
                {"loss", mean_loss},
                {"lr", last.lr},
                {"grad_norm", norm},
                {"tokens", s.tokens_before},
                {"tokens_per_s", tokens_per_s}};
    if (mfu > 0) rec["mfu"] = mfu;
    if (s.dtype == DType::kFloat16) rec["loss_scale"] = s.loss_scale;
    s.metrics->append(rec.dump());
    progress.update(step, mean_loss, last.lr, norm, tokens_per_s, mfu);
  }
  w = open_window(s, now);
  return mean_loss;
}

// Whether any rank was asked to stop (Ctrl-C). Agreed on at logged steps, so that every rank
// stops together; every rank must call it.
bool any_rank_asked_to_stop(const State& s, const std::atomic<bool>* stop) {
  Tensor flag = full({1}, stop != nullptr && stop->load() ? 1.0 : 0.0,
                     TensorOptions(DType::kFloat64).with_device(s.config.device));
  s.all_reduce(flag);
  return flag.item<double>() > 0;
}

// An evaluation's metrics record and progress line (rank 0).
void report_eval(State& s, Progress& progress, const EvalResult& e, int64_t step) {
  if (!s.is_root()) return;
  Json rec = {{"step", step},
              {"time_s", s.elapsed()},
              {"split", "eval"},
              {"loss", e.loss},
              {"perplexity", e.perplexity}};
  if (e.has_answers) {
    rec["accuracy"] = e.accuracy.token_accuracy();
    rec["exact_match"] = e.accuracy.exact_match();
    progress.eval(step, e.loss, e.accuracy.token_accuracy(), e.accuracy.exact_match());
  } else {
    if (e.bits_per_byte) rec["bits_per_byte"] = *e.bits_per_byte;
    progress.eval_text(step, e.loss, e.bits_per_byte);
  }
  s.metrics->append(rec.dump());
}

// Ends run(): the checkpoint, the clocks and what the result reports of the whole run.
void finish_run(Trainer& trainer, State& s, TrainResult& result) {
  result.checkpoint = trainer.save();
  s.elapsed_before = s.elapsed();
  s.run_start.reset();
  result.steps_done = s.step();
  result.seconds = s.elapsed_before;
  if (s.target) {
    result.target_step = s.target->first;
    result.target_exact_match = s.target->second;
  }
}

}  // namespace

TrainResult Trainer::run(const std::atomic<bool>* stop) {
  State& s = *s_;
  const TrainConfig& c = s.config;
  Progress progress(c.steps, c.quiet || !s.is_root());
  if (s.is_root() && !c.quiet) {
    progress.print_summary(*s.model, s.dtype, c.device, s.lower_precision(), s.micro_batches,
                           c.batch_size * s.data->seq_len() * s.dp_size * s.micro_batches);
  }
  TrainResult result;
  s.run_start = Clock::now();
  LogWindow window = open_window(s, s.elapsed());
  s.model->train();
  const auto evaluate_and_report = [&](int64_t step, int64_t batches) {
    result.final_eval = evaluate(batches);
    report_eval(s, progress, result.final_eval, step);
    return result.final_eval;
  };

  bool final_evaluated = false;
  while (s.step() < c.steps && !s.target) {
    const StepOutcome outcome = train_step(s, window);
    const int64_t step = s.step();
    const bool last = step >= c.steps;
    if (step % c.log_every == 0 || last) {
      result.last_loss = report_window(s, progress, window, outcome, step);
      if (any_rank_asked_to_stop(s, stop) && !last) {
        result.stopped = true;
        break;
      }
    }
    if ((c.eval_every > 0 && step % c.eval_every == 0) || last) {
      const EvalResult e = evaluate_and_report(step, last ? c.final_eval_batches : c.eval_batches);
      final_evaluated = last;
      // Every rank sees the same all-reduced result, so all of them stop together.
      if (!last && reaches_target(c, e)) {
        s.target = std::make_pair(step, e.accuracy.exact_match());
        if (s.is_root())
          progress.target_reached(step, e.accuracy.exact_match(), c.stop_at_exact_match);
        break;  // the final evaluation and checkpoint follow
      }
    }
    if (c.checkpoint_every > 0 && step % c.checkpoint_every == 0 && !last) save();
  }
  // A run resumed at its last step trains nothing; its result still reports the model.
  if (!result.stopped && !final_evaluated) evaluate_and_report(s.step(), c.final_eval_batches);
  finish_run(*this, s, result);
  progress.finish();
  return result;
}

// ---------------------------------------------------------------------------------------
// Sampling.

namespace {

// The next token from the last position's logits [vocab]: greedy at temperature 0, else
// drawn from the softmax at `temperature` over the top_k most likely (0: all).
int32_t next_token(const std::vector<double>& logits, double temperature, int64_t top_k,
                   std::mt19937_64& rng) {
  if (temperature == 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  std::vector<int32_t> order(logits.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int32_t>(k);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const size_t keep = top_k > 0 ? std::min(order.size(), static_cast<size_t>(top_k)) : order.size();
  std::vector<double> weights(keep);
  for (size_t k = 0; k < keep; ++k) {
    weights[k] = std::exp((logits[order[k]] - logits[order[0]]) / temperature);
  }
  std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
  return order[pick(rng)];
}

// The logits [vocab] of the last position of `logits` [1, T, vocab], in float64 on the host.
std::vector<double> last_logits(const Tensor& logits) {
  return logits.select(1, logits.size(1) - 1)
      .view({-1})
      .to(DType::kFloat64)
      .to(Device::cpu())
      .to_vector<double>();
}

}  // namespace

std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, double temperature, int64_t top_k,
                              uint64_t seed) {
  RD_CHECK(!prompt.empty(), kInvalidArgument, "generate: the prompt is empty");
  RD_CHECK(max_new_tokens >= 0 && temperature >= 0 && top_k >= 0, kInvalidArgument,
           "generate: max_new_tokens, temperature and top_k must be >= 0, got ", max_new_tokens,
           ", ", temperature, ", ", top_k);
  const bool was_training = model.is_training();
  model.eval();
  autograd::NoGradGuard no_grad;
  const Device dev = model.parameters().front().device();
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens = prompt;
  auto as_tensor = [&](std::vector<int32_t>::const_iterator from) {
    std::vector<int64_t> ids(from, tokens.cend());
    return from_vector<int64_t>(ids, {1, static_cast<int64_t>(ids.size())}).to(dev);
  };
  // The global variant has no incremental form: it recomputes the prefix for every token.
  const bool cached = model.config().attention.variant == nn::DilationVariant::kSegmentLocal;
  if (!cached) {
    log_once(
        "generate: the global variant decodes by recomputing the prefix for every token "
        "(no KV cache: its index lists change with the length)");
  }
  LanguageModel::DecodeState state;
  if (cached) {
    state = model.start_decoding(1, static_cast<int64_t>(prompt.size()) + max_new_tokens);
  }
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    // Cached: the prompt once, then only the newest token.
    const auto from = !cached ? tokens.cbegin() : tokens.cbegin() + state.length();
    const Tensor logits =
        cached ? model.forward_cached(as_tensor(from), state) : model.forward(as_tensor(from));
    tokens.push_back(next_token(last_logits(logits), temperature, top_k, rng));
  }
  if (was_training) model.train();
  return tokens;
}

}  // namespace rd::train
