// rd_train's training loop on the CPU: bit-exact resume (2n steps == n, stop, n resumed),
// resume's refusal of a changed configuration and its notes, the run folder's lock,
// evaluation of text runs, context- and data-parallel gradients equal to one rank's, the
// model's causality, and sampling.
#include "ringdilated/train/trainer.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/train/checkpoint.h"
#include "ringdilated/train/run_lock.h"
#include "testing/temp_dir.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  // A tiny model on the copy task: 2 layers of width 32, 4 heads, sequences of 64.
  TrainConfig tiny(const std::string& run) const {
    TrainConfig c;
    c.model.dim = 32;
    c.model.depth = 2;
    c.model.heads = 4;
    c.model.attention.segment_lengths = {16, 64};
    c.model.attention.dilation_rates = {1, 2};
    c.data = "copy";
    c.data_options.task.seq_len = 64;
    c.data_options.seed = 5;
    c.batch_size = 4;
    c.steps = 6;
    c.warmup_steps = 2;
    c.eval_every = 3;
    c.eval_batches = 2;
    c.final_eval_batches = 2;
    c.log_every = 2;
    c.out_dir = (dir_ / run).string();
    c.seed = 11;
    c.quiet = true;
    return c;
  }

  // A small text file (a few repeated sentences) for text runs.
  fs::path write_corpus() const {
    const fs::path text = dir_ / "corpus.txt";
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "the quick brown fox " << i % 7 << " jumps. ";
    return text;
  }

  test::TestTempDir temp_;
  fs::path dir_ = temp_.path();
};

std::map<std::string, Tensor> weights(Trainer& t) {
  std::map<std::string, Tensor> w;
  for (const auto& [name, p] : t.model().named_parameters()) w[name] = p.detach().clone();
  return w;
}

void expect_bit_equal(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(allclose(t, b.at(name), 0.0, 0.0)) << name;
}

std::vector<std::string> train_lines(const std::string& metrics) {
  std::ifstream in(metrics);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    // Times and throughput differ between runs; the rest must not.
    if (line.find("\"split\":\"train\"") == std::string::npos) continue;
    const size_t loss = line.find("\"loss\":");
    lines.push_back(line.substr(loss, line.find(',', loss) - loss));
  }
  return lines;
}

TEST_F(TrainerTest, ResumingContinuesBitExactly) {
  TrainConfig straight = tiny("straight");
  straight.model.attention.dropout = 0.1;  // the generator state must survive the checkpoint
  straight.log_every = 3;
  Trainer a(straight);
  a.run();
  const std::map<std::string, Tensor> want = weights(a);

  // The same run stopped at its first logged step (a stop request, as Ctrl-C makes), which
  // writes a checkpoint, then resumed from it by a new trainer.
  TrainConfig halves = straight;
  halves.out_dir = (dir_ / "halves").string();
  {
    Trainer b(halves);
    std::atomic<bool> stop{true};
    const TrainResult r = b.run(&stop);
    EXPECT_TRUE(r.stopped);
    EXPECT_EQ(r.steps_done, 3);
  }
  halves.resume = "latest";
  Trainer c(halves);
  EXPECT_EQ(c.step(), 3);
  const TrainResult r = c.run();
  EXPECT_EQ(r.steps_done, 6);
  expect_bit_equal(want, weights(c));
  // The metrics file holds each step once, with the same losses.
  EXPECT_EQ(train_lines((fs::path(halves.out_dir) / "metrics.jsonl").string()),
            train_lines((fs::path(straight.out_dir) / "metrics.jsonl").string()));
}

TEST_F(TrainerTest, LossFallsAndMetricsAreWritten) {
  TrainConfig c = tiny("falls");
  c.steps = 30;
  c.lr = 3e-3;
  c.eval_every = 10;
  c.log_every = 5;
  TrainResult r;
  {  // (a second trainer of a live one's out_dir is refused: this one ends first)
    Trainer t(c);
    const double first = t.compute_gradients().loss;
    r = t.run();
    EXPECT_LT(r.last_loss, 0.8 * first);
  }
  const std::string metrics = (fs::path(c.out_dir) / "metrics.jsonl").string();
  EXPECT_EQ(train_lines(metrics).size(), 6u);
  EXPECT_TRUE(latest_checkpoint((fs::path(c.out_dir) / "checkpoints").string()).has_value());
  EXPECT_GT(r.final_eval.accuracy.samples, 0);

  // Resuming the finished run trains nothing but still evaluates the model.
  c.resume = "latest";
  Trainer again(c);
  const TrainResult resumed = again.run();
  EXPECT_EQ(resumed.steps_done, c.steps);
  EXPECT_EQ(resumed.final_eval.accuracy.samples, r.final_eval.accuracy.samples);
  EXPECT_EQ(resumed.final_eval.loss, r.final_eval.loss);
}

// The message of the error `make` throws (a failure when it throws none).
template <class F>
std::string error_of(F&& make) {
  try {
    make();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool any_note_has(const Trainer& t, const std::string& part) {
  for (const std::string& note : t.notes()) {
    if (has(note, part)) return true;
  }
  return false;
}

// Resuming with settings that change what the run computes is refused, naming every
// differing field with both values; settings of logging, evaluation, checkpoints and memory
// may change; allow_config_change resumes anyway and notes the changes.
TEST_F(TrainerTest, ResumingWithAnotherConfigurationIsRefusedNamingEachField) {
  TrainConfig c = tiny("config");
  c.steps = 2;
  c.resume = "auto";
  Trainer(c).run();
  TrainConfig changed = c;
  changed.lr = 2e-3;
  changed.data_options.seed = 6;
  changed.steps = 4;  // a cosine schedule over other steps: every learning rate differs
  const std::string what = error_of([&] { Trainer t(changed); });
  EXPECT_TRUE(has(what, "train.lr: saved 0.001, now 0.002")) << what;
  EXPECT_TRUE(has(what, "data.seed: saved 5, now 6")) << what;
  EXPECT_TRUE(has(what, "train.steps: saved 2, now 4")) << what;
  EXPECT_TRUE(has(what, "allow_config_change")) << what;
  EXPECT_FALSE(has(what, "model.")) << what;

  TrainConfig harmless = c;  // logging, evaluation, checkpoints, memory
  harmless.log_every = 1;
  harmless.eval_every = 1;
  harmless.eval_batches = 1;
  harmless.checkpoint_every = 1;
  harmless.keep_checkpoints = 5;
  harmless.model.recompute = true;
  {
    Trainer t(harmless);
    EXPECT_EQ(t.step(), 2);
    EXPECT_TRUE(t.notes().empty());
  }

  changed.allow_config_change = true;
  Trainer allowed(changed);
  EXPECT_EQ(allowed.step(), 2);
  EXPECT_TRUE(any_note_has(allowed, "train.lr: saved 0.001, now 0.002"));
  EXPECT_EQ(allowed.run().steps_done, 4);
}

// With a constant learning rate after the same warmup, more steps change no step's rate:
// such a run may be extended.
TEST_F(TrainerTest, AConstantScheduleMayBeExtendedOnResume) {
  TrainConfig c = tiny("extend");
  c.decay = nn::LrDecay::kConstant;
  c.warmup_steps = 1;
  c.steps = 2;
  c.resume = "auto";
  Trainer(c).run();
  c.steps = 3;
  Trainer t(c);
  EXPECT_EQ(t.step(), 2);
  EXPECT_EQ(t.run().steps_done, 3);
}

// (step, exact match) of each periodic evaluation in a run's metrics, before its last step.
std::vector<std::pair<int64_t, double>> periodic_exact_matches(const std::string& metrics,
                                                               int64_t last) {
  std::ifstream in(metrics);
  std::vector<std::pair<int64_t, double>> evals;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"split\":\"eval\"") == std::string::npos) continue;
    const nlohmann::json r = nlohmann::json::parse(line);
    if (r["step"] < last) evals.emplace_back(r["step"], r["exact_match"]);
  }
  return evals;
}

// stop_at_exact_match: a run stops at the first periodic evaluation that reaches the target,
// after the same steps as a run without it, then runs the final evaluation on
// final_eval_batches and saves; resumed, it trains nothing more, unless the target is off.
// The target is taken from a full run's first evaluation with a right answer (one-digit keys:
// an untrained guess is right one time in ten), so the test needs no learning.
TEST_F(TrainerTest, AReachedExactMatchTargetStopsTrainingAndTheFinalEvaluationReports) {
  TrainConfig c = tiny("full");
  c.data = "passkey";
  c.data_options.task.passkey_digits = 1;
  c.data_options.task.seq_len = 128;  // the key sentence and the question need 72 tokens
  c.steps = 30;
  c.eval_every = 5;
  c.eval_batches = 8;         // 32 samples per evaluation
  c.final_eval_batches = 16;  // 64
  const TrainResult full = Trainer(c).run();
  EXPECT_FALSE(full.target_step.has_value());
  const std::string full_metrics = (fs::path(c.out_dir) / "metrics.jsonl").string();
  std::optional<std::pair<int64_t, double>> first_right;
  for (const auto& e : periodic_exact_matches(full_metrics, c.steps)) {
    if (e.second > 0 && !first_right) first_right = e;
  }
  ASSERT_TRUE(first_right.has_value()) << "no periodic evaluation got a sample right";
  const auto [target_step, target] = *first_right;

  c.out_dir = (dir_ / "stop").string();
  c.stop_at_exact_match = target;
  c.resume = "auto";
  const TrainResult r = Trainer(c).run();
  ASSERT_TRUE(r.target_step.has_value());
  EXPECT_EQ(*r.target_step, target_step);
  EXPECT_EQ(r.target_exact_match, target);
  EXPECT_EQ(r.steps_done, target_step);
  EXPECT_EQ(r.final_eval.accuracy.samples, c.final_eval_batches * c.batch_size);
  EXPECT_EQ(checkpoint_step(r.checkpoint), target_step);
  const std::vector<std::string> full_losses = train_lines(full_metrics);
  const std::vector<std::string> stop_losses =
      train_lines((fs::path(c.out_dir) / "metrics.jsonl").string());
  ASSERT_LT(stop_losses.size(), full_losses.size());
  const std::vector<std::string> full_prefix(full_losses.begin(),
                                             full_losses.begin() + stop_losses.size());
  EXPECT_EQ(stop_losses, full_prefix);  // the same steps, up to the stop

  const TrainResult again = Trainer(c).run();  // resumed: the target stands
  EXPECT_EQ(again.steps_done, target_step);
  EXPECT_EQ(again.target_step, r.target_step);

  c.stop_at_exact_match = 0;  // off: the run trains on to its last step
  const TrainResult on = Trainer(c).run();
  EXPECT_EQ(on.steps_done, c.steps);
  EXPECT_FALSE(on.target_step.has_value());
}

// Text has no exact match: a target never stops it.
TEST_F(TrainerTest, AnExactMatchTargetDoesNotStopTextRuns) {
  const fs::path text = write_corpus();
  TrainConfig c = tiny("text_target");
  c.data = "text:" + text.string();
  c.eval_every = 1;
  c.stop_at_exact_match = 1e-9;
  const TrainResult r = Trainer(c).run();
  EXPECT_EQ(r.steps_done, c.steps);
  EXPECT_FALSE(r.target_step.has_value());
}

// Two trainers on one out_dir: the second is refused, naming the first's process and host;
// once the first ends, the folder is free again.
TEST_F(TrainerTest, ASecondRunOnTheSameFolderIsRefused) {
  const TrainConfig c = tiny("busy");
  {
    Trainer first(c);
    const std::string what = error_of([&] { Trainer second(c); });
    EXPECT_TRUE(has(what, "in use by another run")) << what;
    EXPECT_TRUE(has(what, "pid " + std::to_string(::getpid()))) << what;
    EXPECT_TRUE(has(what, c.out_dir)) << what;
    EXPECT_TRUE(fs::exists(fs::path(c.out_dir) / kRunLockFile));
  }
  EXPECT_FALSE(fs::exists(fs::path(c.out_dir) / kRunLockFile)) << "released at the end";
  Trainer again(c);
  EXPECT_TRUE(again.notes().empty());
}

// A lock file left by a killed run (its process gone) is taken over, with a note.
TEST_F(TrainerTest, AStaleLockIsTakenOverWithANote) {
  const TrainConfig c = tiny("stale");
  const pid_t child = ::fork();  // a process id that no longer runs
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  fs::create_directories(c.out_dir);
  std::ofstream(fs::path(c.out_dir) / kRunLockFile)
      << "{\"pid\": " << child << ", \"host\": \"" << host << "\", \"started\": \"then\"}\n";
  Trainer t(c);
  EXPECT_TRUE(any_note_has(t, "pid " + std::to_string(child))) << t.notes().size();
  EXPECT_TRUE(any_note_has(t, "no longer running"));
}

// The newest step folder has no manifest (a save killed before it finished, or a deletion
// killed half-way): resuming uses the older checkpoint and says which folder it skipped.
// Leftovers of killed saves are removed at the start, with a note.
TEST_F(TrainerTest, ResumeSaysWhichCheckpointItSkippedAndCleansLeftovers) {
  TrainConfig c = tiny("skip");
  c.steps = 4;
  c.checkpoint_every = 2;
  c.resume = "auto";
  Trainer(c).run();
  const fs::path root = fs::path(c.out_dir) / "checkpoints";
  fs::remove(root / "step_000000004" / "manifest.json");
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string leftover = ".tmp-step_000000006-" + std::to_string(child) + "-0";
  fs::create_directories(root / leftover);
  Trainer t(c);
  EXPECT_EQ(t.step(), 2);
  EXPECT_TRUE(any_note_has(t, "skipping '" + (root / "step_000000004").string() + "'"));
  EXPECT_TRUE(any_note_has(t, "no manifest.json"));
  EXPECT_TRUE(any_note_has(t, "resuming from '" + (root / "step_000000002").string() + "'"));
  EXPECT_TRUE(any_note_has(t, leftover));
  EXPECT_FALSE(fs::exists(root / leftover));
}

// Text has no answers: evaluation reports the loss, perplexity and bits per byte, and the
// metrics record no exact match (which would be 0 of every window).
TEST_F(TrainerTest, TextRunsReportBitsPerByteNotExactMatch) {
  const fs::path text = write_corpus();
  TrainConfig c = tiny("text");
  c.data = "text:" + text.string();
  c.steps = 2;
  const TrainResult r = Trainer(c).run();
  const EvalResult& e = r.final_eval;
  EXPECT_FALSE(e.has_answers);
  ASSERT_TRUE(e.bits_per_byte.has_value());
  EXPECT_NEAR(*e.bits_per_byte, e.loss / std::log(2.0), 1e-12);
  EXPECT_GT(e.tokens, 0);
  std::ifstream in(fs::path(c.out_dir) / "metrics.jsonl");
  int evals = 0;
  for (std::string line; std::getline(in, line);) {
    if (!has(line, "\"split\":\"eval\"")) continue;
    ++evals;
    EXPECT_TRUE(has(line, "\"bits_per_byte\":")) << line;
    EXPECT_TRUE(has(line, "\"perplexity\":")) << line;
    EXPECT_FALSE(has(line, "exact_match")) << line;
  }
  EXPECT_GT(evals, 0);

  // A task keeps its exact match.
  const TrainResult task = Trainer(tiny("task")).run();
  EXPECT_TRUE(task.final_eval.has_answers);
  EXPECT_FALSE(task.final_eval.bits_per_byte.has_value());
}

// bfloat16 compute with float32 masters (CPU): after the run the model's weights are its
// masters (the checkpoint's float32 weights) rounded once, and training moved the masters.
TEST_F(TrainerTest, LowPrecisionWeightsAreTheRoundedMasters) {
  TrainConfig c = tiny("bf16");
  c.dtype = "bfloat16";
  c.steps = 3;
  Trainer t(c);
  const std::map<std::string, Tensor> initial = weights(t);
  t.run();
  const std::optional<std::string> path =
      latest_checkpoint((fs::path(c.out_dir) / "checkpoints").string());
  ASSERT_TRUE(path.has_value());
  const CheckpointContents ck = load_checkpoint(*path);
  for (const auto& [name, p] : t.model().named_parameters()) {
    ASSERT_EQ(p.dtype(), DType::kBFloat16) << name;
    const Tensor& master = ck.model.at(name);
    ASSERT_EQ(master.dtype(), DType::kFloat32) << name;
    EXPECT_TRUE(allclose(master.to(DType::kBFloat16), p, 0.0, 0.0)) << name;
    // (The update may be below bfloat16's spacing, so the masters show it: norm weights.)
    EXPECT_FALSE(allclose(master, initial.at(name).to(DType::kFloat32), 0.0, 0.0))
        << name << " did not train";
  }
}

struct Split {
  int world, context;
};

// The loss and summed gradients of one step of `base` with the world split into context-
// and data-parallel groups equal one rank's on the same global batch.
void expect_parallel_gradients_equal_one_rank(const TrainConfig& base, const fs::path& dir,
                                              const std::vector<Split>& splits) {
  Trainer one(base);
  const Trainer::Gradients want = one.compute_gradients();
  for (const Split sp : splits) {
    SCOPED_TRACE(std::to_string(sp.world) + " ranks, context parallel " + std::to_string(sp.context));
    TrainConfig c = base;
    c.out_dir = (dir / ("p" + std::to_string(sp.world) + "c" + std::to_string(sp.context))).string();
    c.context_parallel = sp.context;
    c.batch_size = base.batch_size / (sp.world / sp.context);  // the same global batch
    std::vector<Trainer::Gradients> got(static_cast<size_t>(sp.world));
    dist::run_in_process(sp.world, [&](dist::Communicator& comm) {
      std::shared_ptr<dist::Communicator> world(&comm, [](dist::Communicator*) {});
      Trainer t(c, world);
      got[static_cast<size_t>(comm.rank())] = t.compute_gradients();
    });
    for (const Trainer::Gradients& g : got) {
      EXPECT_NEAR(g.loss, want.loss, 1e-5 * want.loss);
      ASSERT_EQ(g.grads.size(), want.grads.size());
      for (const auto& [name, grad] : want.grads) {
        const double scale = max(abs(grad)).item<double>();
        EXPECT_TRUE(allclose(g.grads.at(name), grad, 1e-4, 1e-5 * scale)) << name;
      }
    }
  }
}

TEST_F(TrainerTest, ParallelGradientsEqualOneRank) {
  TrainConfig base = tiny("one");
  base.batch_size = 4;
  expect_parallel_gradients_equal_one_rank(
      base, dir_, {Split{2, 2}, Split{2, 1}, Split{4, 2}, Split{4, 4}});
}

// Grouped-query attention (2 key/value heads for 4 query heads) in the model: context and
// data parallel equal one rank, the zigzag layout's rotary positions included.
TEST_F(TrainerTest, GroupedQueryParallelGradientsEqualOneRank) {
  TrainConfig base = tiny("one");
  base.batch_size = 4;
  base.model.kv_heads = base.model.heads / 2;
  expect_parallel_gradients_equal_one_rank(base, dir_, {Split{2, 2}, Split{4, 2}});
}

// Two micro-batches per step: the first's backward only accumulates locally, the second's
// sums over the ranks (bucket by bucket, during backward).
TEST_F(TrainerTest, ParallelGradientsOverMicroBatchesEqualOneRank) {
  TrainConfig base = tiny("one");
  base.batch_size = 4;
  base.tokens_per_step = 2 * base.batch_size * base.data_options.task.seq_len;
  expect_parallel_gradients_equal_one_rank(base, dir_, {Split{4, 2}});
}

// Recomputed blocks whose MLP runs in chunks smaller than a rank's block of the sequence
// (8 tokens; the rank holds 32 at context parallel 2), over two micro-batches, with the
// gradient summed in buckets during backward: context parallel, data parallel and both equal
// one rank. Each chunk reads the MLP's weights; their gradients must still reach the buckets
// once per step (they once got one per chunk, which the buckets refuse).
TEST_F(TrainerTest, RecomputedChunkedMlpParallelGradientsEqualOneRank) {
  TrainConfig base = tiny("one");
  base.batch_size = 4;
  base.model.recompute = true;
  base.model.mlp_chunk_tokens = 8;
  base.tokens_per_step = 2 * base.batch_size * base.data_options.task.seq_len;
  expect_parallel_gradients_equal_one_rank(base, dir_, {Split{2, 2}, Split{2, 1}, Split{4, 2}});
}

// Packed text documents of random lengths (a folder of files, boundaries inside ranks'
// blocks and across them), recomputation with chunked MLPs, two micro-batches: context
// parallel (zigzag), data parallel and both equal one rank. The masks are on (the gradients
// differ from --documents=off's) and the targets that cross documents are not scored.
TEST_F(TrainerTest, PackedDocumentsParallelGradientsEqualOneRank) {
  std::mt19937_64 rng(21);
  fs::create_directories(dir_ / "docs");
  for (int doc = 0; doc < 40; ++doc) {
    std::ofstream out(dir_ / "docs" / ("doc" + std::to_string(100 + doc) + ".txt"));
    const int length = 5 + static_cast<int>(rng() % 40);
    for (int i = 0; i < length; ++i) out << static_cast<char>('a' + rng() % 26);
  }
  TrainConfig base = tiny("one");
  base.data = "text:" + (dir_ / "docs").string();
  base.batch_size = 4;
  base.model.recompute = true;
  base.model.mlp_chunk_tokens = 8;
  base.tokens_per_step = 2 * base.batch_size * base.data_options.task.seq_len;
  expect_parallel_gradients_equal_one_rank(base, dir_, {Split{2, 2}, Split{2, 1}, Split{4, 2}});

  Trainer masked(base);
  const Trainer::Gradients with_masks = masked.compute_gradients();
  TrainConfig unmasked_config = base;
  unmasked_config.data_options.documents = "off";
  unmasked_config.out_dir = (dir_ / "off").string();
  Trainer unmasked(unmasked_config);
  const Trainer::Gradients without = unmasked.compute_gradients();
  EXPECT_NE(with_masks.loss, without.loss);
  const Tensor& grad = with_masks.grads.at("blocks.0.attn.qkv.weight");
  EXPECT_FALSE(allclose(grad, without.grads.at("blocks.0.attn.qkv.weight"), 1e-3,
                        1e-3 * max(abs(grad)).item<double>()));
}

// With document masks, a document's logits do not depend on the other documents' tokens,
// wherever the boundaries fall in the segments (here inside them; the longest segment spans
// every document); without the masks they do.
TEST(LanguageModelTest, PackedDocumentsDoNotSeeEachOther) {
  ModelConfig c;
  c.vocab_size = 40;
  c.dim = 32;
  c.heads = 4;
  c.attention.segment_lengths = {8, 48};
  c.attention.dilation_rates = {1, 2};
  Generator gen(4);
  LanguageModel model(c, gen, TensorOptions(DType::kFloat64));
  std::mt19937_64 rng(6);
  std::vector<int64_t> tokens(48);
  for (int64_t& t : tokens) t = static_cast<int64_t>(rng() % 40);
  const nn::DocumentStarts documents = {{0, 13, 29}};
  // The middle document [13, 29) with the others' tokens redrawn, then the last [29, 48)
  // with the middle one's redrawn.
  std::vector<int64_t> others = tokens, middle = tokens;
  for (int64_t i = 0; i < 48; ++i) {
    if (i < 13 || i >= 29) others[static_cast<size_t>(i)] = static_cast<int64_t>(rng() % 40);
    if (i >= 13 && i < 29) middle[static_cast<size_t>(i)] = static_cast<int64_t>(rng() % 40);
  }
  const auto logits = [&](const std::vector<int64_t>& t, const nn::DocumentStarts* docs) {
    return model.forward(from_vector<int64_t>(t, {1, 48}), docs);
  };
  const Tensor base = logits(tokens, &documents);
  EXPECT_TRUE(allclose(logits(others, &documents).narrow(1, 13, 16), base.narrow(1, 13, 16),
                       1e-12, 1e-12));
  EXPECT_TRUE(allclose(logits(middle, &documents).narrow(1, 29, 19), base.narrow(1, 29, 19),
                       1e-12, 1e-12));
  const Tensor unmasked = logits(tokens, nullptr);
  EXPECT_FALSE(allclose(logits(others, nullptr).narrow(1, 13, 16), unmasked.narrow(1, 13, 16),
                        1e-6, 1e-6));
  EXPECT_FALSE(allclose(logits(middle, nullptr).narrow(1, 29, 19), unmasked.narrow(1, 29, 19),
                        1e-6, 1e-6));
  // The first document is the unmasked model's (causal: it sees only itself either way).
  EXPECT_TRUE(allclose(base.narrow(1, 0, 13), unmasked.narrow(1, 0, 13), 1e-12, 1e-12));
}

// Every block plans the batch's attention alike: one plan serves them all, and the blocks'
// recomputed forwards in the backward too.
TEST(LanguageModelTest, ABatchIsPlannedOnceForEveryBlockAndItsRecomputation) {
  ModelConfig c;
  c.vocab_size = 40;
  c.dim = 16;
  c.heads = 2;
  c.depth = 3;
  c.recompute = true;
  c.attention.segment_lengths = {8, 32};
  c.attention.dilation_rates = {1, 2};
  Generator gen(12);
  LanguageModel model(c, gen, TensorOptions(DType::kFloat64));
  model.train();
  std::vector<int64_t> tokens(32);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7 + 3) % 40);
  const nn::DocumentStarts documents = {{0, 11, 20}};
  const Tensor logits = model.forward(from_vector<int64_t>(tokens, {1, 32}), &documents);
  sum(mul(logits, logits)).backward();
  nn::RankPlanCacheStats stats = model.plan_cache().stats();
  EXPECT_EQ(stats.misses, 1);
  EXPECT_EQ(stats.hits, 2 * c.depth - 1);
  // Other documents: another plan.
  const nn::DocumentStarts others = {{0, 12}};
  model.forward(from_vector<int64_t>(tokens, {1, 32}), &others);
  stats = model.plan_cache().stats();
  EXPECT_EQ(stats.misses, 2);
  EXPECT_EQ(stats.entries, 2);
}

TEST(LanguageModelTest, LogitsDependOnlyOnEarlierTokens) {
  ModelConfig c;
  c.vocab_size = 50;
  c.dim = 32;
  c.heads = 4;
  c.attention.segment_lengths = {8, 32};
  c.attention.dilation_rates = {1, 4};
  Generator gen(3);
  LanguageModel model(c, gen);
  std::vector<int64_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7 + 3) % 50);
  const Tensor a = model.forward(from_vector<int64_t>(tokens, {2, 32}));
  EXPECT_EQ(a.shape(), (Shape{2, 32, 50}));
  tokens[20] = (tokens[20] + 1) % 50;  // sample 0, position 20
  const Tensor b = model.forward(from_vector<int64_t>(tokens, {2, 32}));
  EXPECT_TRUE(allclose(a.narrow(1, 0, 20), b.narrow(1, 0, 20), 0.0, 0.0));
  EXPECT_FALSE(allclose(a.select(0, 0).narrow(0, 20, 12), b.select(0, 0).narrow(0, 20, 12), 1e-6, 0.0));
  EXPECT_TRUE(allclose(a.select(0, 1), b.select(0, 1), 0.0, 0.0));
}

// Recomputed blocks whose MLP runs over sequence chunks (of 8, one of them short: 32 = 3 x 10
// + 2) give the loss and every gradient of the plain model, in float64 (chunked matmuls sum
// per token alike; the weight gradients sum the tokens in chunks, a roundoff apart).
TEST(LanguageModelTest, ChunkedRecomputedMlpEqualsThePlainModel) {
  ModelConfig c;
  c.vocab_size = 40;
  c.dim = 16;
  c.heads = 2;
  c.attention.segment_lengths = {8, 32};
  c.attention.dilation_rates = {1, 2};
  std::vector<int64_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 11 + 5) % 40);
  const Tensor batch = from_vector<int64_t>(tokens, {2, 32});
  auto run = [&](bool recompute, int64_t chunk) {
    ModelConfig cc = c;
    cc.recompute = recompute;
    cc.mlp_chunk_tokens = chunk;
    Generator gen(9);
    LanguageModel model(cc, gen, TensorOptions(DType::kFloat64));
    model.train();
    const Tensor logits = model.forward(batch);
    const Tensor loss = sum(mul(logits, logits));
    loss.backward();
    std::vector<Tensor> grads{loss.detach()};
    for (const auto& [name, p] : model.named_parameters()) grads.push_back(p.grad());
    return grads;
  };
  const std::vector<Tensor> plain = run(false, 0);
  for (int64_t chunk : {int64_t{8}, int64_t{10}}) {
    const std::vector<Tensor> chunked = run(true, chunk);
    ASSERT_EQ(chunked.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      // The norms' weight gradients come out of the norm kernels in float32 (each chunk's
      // rounded before they add up): float32 roundoff there, float64 elsewhere.
      EXPECT_TRUE(allclose(chunked[i], plain[i], 1e-6, 1e-9))
          << "chunk " << chunk << ", tensor " << i << "\n" << chunked[i] << "\n" << plain[i];
    }
  }
  c.mlp_chunk_tokens = -1;
  Generator gen(1);
  EXPECT_THROW(LanguageModel(c, gen), Error);
}

TEST(LanguageModelTest, GreedySamplingIsTopOne) {
  ModelConfig c;
  c.vocab_size = 30;
  c.dim = 16;
  c.heads = 2;
  c.depth = 1;
  c.attention.segment_lengths = {4};
  c.attention.dilation_rates = {1};
  Generator gen(4);
  LanguageModel model(c, gen);
  const std::vector<int32_t> prompt{1, 2, 3};
  const std::vector<int32_t> greedy = generate(model, prompt, 6, 0.0, 0, 1);
  EXPECT_EQ(greedy.size(), 9u);
  EXPECT_EQ(generate(model, prompt, 6, 0.7, 1, 2), greedy);
  EXPECT_EQ(generate(model, prompt, 6, 1.0, 0, 3), generate(model, prompt, 6, 1.0, 0, 3));
  EXPECT_THROW(generate(model, {}, 1, 0.0, 0, 1), Error);
}

// Decoding with KV caches: a prompt and then one token at a time give the logits of the
// full forward's rows (float64, to rounding), for patterns whose pairs skip positions and
// segments that end inside the sequence; and generate(), which decodes so, picks the tokens
// that recomputing the prefix picks.
TEST(LanguageModelTest, CachedDecodingEqualsTheFullForward) {
  for (const auto& [mixing, kv_heads] :
       {std::pair{nn::HeadMixing::kHeadGroups, int64_t{0}},
        std::pair{nn::HeadMixing::kAllHeads, int64_t{0}},
        std::pair{nn::HeadMixing::kAllHeads, int64_t{1}}}) {  // multi-query
    ModelConfig c;
    c.kv_heads = kv_heads;
    c.vocab_size = 40;
    c.dim = 24;
    c.heads = 3;
    c.depth = 2;
    c.attention.segment_lengths = {4, 8, 16};
    c.attention.dilation_rates = {1, 2, 4};
    c.attention.mixing = mixing;
    c.attention.offset_rule = nn::OffsetRule::kRotating;
    Generator gen(5);
    LanguageModel model(c, gen, TensorOptions(DType::kFloat64));
    model.eval();
    autograd::NoGradGuard no_grad;
    std::mt19937 data(6);
    std::vector<int64_t> ids;
    for (int i = 0; i < 29; ++i) ids.push_back(static_cast<int64_t>(data() % 40));
    const Tensor tokens = from_vector<int64_t>(ids, {1, 29});
    const std::vector<double> full = model.forward(tokens).to_vector<double>();
    LanguageModel::DecodeState state = model.start_decoding(1, /*capacity=*/8);  // grows
    std::vector<double> cached = model.forward_cached(tokens.narrow(1, 0, 11), state).to_vector<double>();
    for (int64_t p = 11; p < 29; ++p) {
      const std::vector<double> row = model.forward_cached(tokens.narrow(1, p, 1), state).to_vector<double>();
      cached.insert(cached.end(), row.begin(), row.end());
    }
    EXPECT_EQ(state.length(), 29);
    ASSERT_EQ(cached.size(), full.size());
    for (size_t i = 0; i < full.size(); ++i) {
      ASSERT_NEAR(cached[i], full[i], 1e-10) << "logit " << i << (mixing == nn::HeadMixing::kAllHeads ? " all heads" : " head groups");
    }
    const std::vector<int32_t> prompt{1, 2, 3, 4, 5};
    // The reference: the prefix recomputed for every token, as generate() did before caches.
    std::vector<int32_t> want = prompt;
    for (int i = 0; i < 20; ++i) {
      std::vector<int64_t> prefix(want.begin(), want.end());
      const Tensor logits = model.forward(from_vector<int64_t>(prefix, {1, static_cast<int64_t>(prefix.size())}));
      const std::vector<double> last =
          logits.select(1, logits.size(1) - 1).view({-1}).to_vector<double>();
      want.push_back(static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
    }
    EXPECT_EQ(generate(model, prompt, 20, 0.0, 0, 1), want);
  }
}

TEST(TrainConfigTest, JsonRoundTripsAndBadValuesAreNamed) {
  TrainConfig c;
  c.model.attention.segment_lengths = {32, 128};
  c.model.attention.dilation_rates = {1, 4};
  c.model.attention.mixing = nn::HeadMixing::kAllHeads;
  c.data = "mqar";
  c.lr = 2e-4;
  c.context_parallel = 2;
  const TrainConfig back = config_from_json(config_to_json(c));
  EXPECT_EQ(config_to_json(back), config_to_json(c));
  c.batch_size = 0;
  try {
    check_train_config(c, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch_size"), std::string::npos) << e.what();
  }
  c.batch_size = 1;
  c.context_parallel = 0;
  try {
    check_train_config(c, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context_parallel (ranks per context-parallel group) "
                                         "must be >= 1, got 0"),
              std::string::npos) << e.what();
  }
  // A GPU that is not there is refused by the configuration check, before any data is read.
  c.context_parallel = 1;
  c.device = Device::cuda(cuda_device_count());
  try {
    check_train_config(c, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeviceMismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("not available"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rd::train
