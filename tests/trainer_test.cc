// rd_train's training loop on the CPU: bit-exact resume (2n steps == n, stop, n resumed),
// context- and data-parallel gradients equal to one rank's, the model's causality, and
// sampling.
#include "ringdilated/train/trainer.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/train/checkpoint.h"
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
  Trainer t(c);
  const double first = t.compute_gradients().loss;
  const TrainResult r = t.run();
  EXPECT_LT(r.last_loss, 0.8 * first);
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
}

}  // namespace
}  // namespace rd::train
