// The rd_train and rd_launch programs as a user meets them: --help, flag errors that name the
// flag, the device checked before the data, sampling from a checkpoint whose optimizer file
// is damaged, a text run's closing line, a busy out_dir, and a resume with changed flags.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/train/checkpoint.h"
#include "ringdilated/train/run_lock.h"
#include "ringdilated/train/trainer.h"
#include "testing/temp_dir.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;

// A program's path: the variable `name` when set (the GPU runner carries the programs
// elsewhere), else where this build put it.
std::string program(const char* name, const char* built) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : built;
}

struct Outcome {
  int code = -1;       // the exit status
  std::string output;  // stdout and stderr
};

// Runs `args` (the program first) through the shell, each argument single-quoted.
Outcome run(const std::vector<std::string>& args) {
  std::string command;
  for (const std::string& arg : args) {
    std::string quoted = "'";
    for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    command += quoted + "' ";
  }
  command += "2>&1";
  Outcome o;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return o;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) o.output.append(buffer, n);
  const int status = ::pclose(pipe);
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return o;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class TrainCliTest : public ::testing::Test {
 protected:
  // rd_train with a tiny model on the CPU, one thread (the CI has 2 cores), into `run`.
  std::vector<std::string> train(const std::string& run, std::vector<std::string> extra = {}) const {
    std::vector<std::string> args = {trainer_,        "--device=cpu",     "--threads=1",
                                     "--dim=32",      "--depth=1",        "--heads=4",
                                     "--seq_len=64",  "--segments=16,64", "--dilations=1,2",
                                     "--batch_size=2", "--steps=1",       "--eval_batches=1",
                                     "--final_eval_batches=1", "--data=copy",
                                     "--out_dir=" + (dir_ / run).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  test::TestTempDir temp_;
  fs::path dir_ = temp_.path();
  std::string trainer_ = program("RD_TRAIN", RD_TRAIN_PATH);
  std::string launcher_ = program("RD_LAUNCH", RD_LAUNCH_PATH);
};

TEST_F(TrainCliTest, HelpListsTheFlagsAndExitsZero) {
  for (const char* flag : {"--help", "-h", "--helpshort"}) {
    const Outcome o = run({trainer_, flag});
    EXPECT_EQ(o.code, 0) << flag << ":\n" << o.output;
    EXPECT_FALSE(has(o.output, "No flags matched")) << o.output;
    for (const char* listed : {"--segments", "--seq_len", "--out_dir", "--allow_config_change"}) {
      EXPECT_TRUE(has(o.output, listed)) << flag << " does not list " << listed;
    }
  }
  const Outcome launch = run({launcher_, "--help"});
  EXPECT_EQ(launch.code, 0) << launch.output;
  EXPECT_TRUE(has(launch.output, "usage: rd_launch -n N")) << launch.output;
}

// --help lists the flag of every field of the configuration's description once, with
// rd_train's default, and its help text.
TEST_F(TrainCliTest, HelpListsEveryConfigurationFlagOnceWithItsDefault) {
  const Outcome o = run({trainer_, "--help"});
  ASSERT_EQ(o.code, 0) << o.output;
  const auto count = [&](const std::string& part) {
    size_t n = 0;
    for (size_t at = o.output.find(part); at != std::string::npos; at = o.output.find(part, at + 1)) {
      ++n;
    }
    return n;
  };
  for (const ConfigField& f : config_fields()) {
    if (f.flag.empty()) continue;
    const std::string flag = "  --" + std::string(f.flag) + " (default: ";
    const std::string value = cli_default_text(f);
    EXPECT_EQ(count(flag), 1u) << flag << "\n" << o.output;
    EXPECT_EQ(count(flag + (value.empty() ? "empty" : value) + ")\n"), 1u) << flag << value;
    const std::string help(f.help.substr(0, f.help.find(' ', 20)));  // before any line break
    EXPECT_TRUE(has(o.output, help)) << f.name() << ": " << help;
  }
}

// The fields that drifted (no flag, or not saved) reach the checkpoint's configuration from
// their flags.
TEST_F(TrainCliTest, OffsetRuleAndMlpChunksAreFlagsAndSaved) {
  const Outcome o = run(train("saved", {"--offset_rule=rotating", "--recompute",
                                        "--mlp_chunk_tokens=32", "--beta2=0.99"}));
  ASSERT_EQ(o.code, 0) << o.output;
  const std::optional<std::string> ck = latest_checkpoint((dir_ / "saved" / "checkpoints").string());
  ASSERT_TRUE(ck.has_value());
  const TrainConfig c =
      config_from_checkpoint(load_checkpoint(*ck, CheckpointParts::kWeights).trainer_state);
  EXPECT_EQ(c.model.attention.offset_rule, nn::OffsetRule::kRotating);
  EXPECT_TRUE(c.model.recompute);
  EXPECT_EQ(c.model.mlp_chunk_tokens, 32);
  EXPECT_EQ(c.beta2, 0.99);
  const Outcome bad = run(train("bad_rule", {"--offset_rule=sometimes"}));
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_TRUE(has(bad.output, "rd_train: --offset_rule must be one of constant, rotating, got "
                              "'sometimes'")) << bad.output;
}

// Each bad flag is refused before anything runs, by a message naming the flag and value,
// with one "rd_train: " prefix.
TEST_F(TrainCliTest, FlagErrorsNameTheFlagAndValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--threads=-3", "--threads must be >= 0 (0: OMP_NUM_THREADS, else every core), got -3"},
      {"--context_parallel=0", "--context_parallel must be >= 1"},
      {"--segments=16,32,64", "--segments has 3 values and --dilations 2"},
      {"--segments=16,x", "--segments has 'x', not an integer"},
      {"--dilations=1,3", "--segments and --dilations: pair 2 (segment length 64, dilation 3)"},
      {"--device=cuda:x", "--device must be auto, cpu or cuda[:N], got 'cuda:x'"},
      {"--lr=0", "--lr must be > 0, got 0"},
      {"--loss_on=some", "--loss_on must be one of answers, all, got 'some'"},
      {"--stop_at_exact_match=1.5", "--stop_at_exact_match must be >= 0 and <= 1, got 1.5"},
      {"--dtype=int8", "--dtype must be float32, bfloat16, float16, float64 or empty"}};
  for (const auto& [flag, message] : cases) {
    const Outcome o = run(train("bad", {flag}));
    EXPECT_EQ(o.code, 1) << flag << ":\n" << o.output;
    EXPECT_TRUE(has(o.output, "rd_train: " + message)) << flag << ":\n" << o.output;
    EXPECT_FALSE(has(o.output, "rd_train: rd_train:")) << o.output;
    EXPECT_FALSE(has(o.output, "segment_lengths")) << o.output;
  }
  EXPECT_FALSE(fs::exists(dir_ / "bad")) << "a refused run wrote its folder";
}

TEST_F(TrainCliTest, AMissingGpuIsNamedBeforeTheDataIsRead) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible";
  const Outcome o = run(train("gpu", {"--device=cuda", "--data=text:/nonexistent/corpus.txt"}));
  EXPECT_EQ(o.code, 1) << o.output;
  EXPECT_TRUE(has(o.output, "rd_train: --device=cuda: ")) << o.output;
  EXPECT_FALSE(has(o.output, "corpus.txt")) << "the data was read first:\n" << o.output;
}

// A bad RD_CUDNN_GRAPH_CACHE is named before training, not after it (the cache reads the
// variable when first used). The run is on the GPU, where cuDNN may be used.
TEST_F(TrainCliTest, CudaABadGraphCacheSizeIsNamedBeforeTraining) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  std::vector<std::string> args = train("cache", {"--device=cuda"});
  for (const char* value : {"0", "lots", "99999999999999999999999"}) {
    args.insert(args.begin(), {"env", std::string("RD_CUDNN_GRAPH_CACHE=") + value});
    const Outcome o = run(args);
    args.erase(args.begin(), args.begin() + 2);
    EXPECT_EQ(o.code, 1) << value << ":\n" << o.output;
    EXPECT_TRUE(
        has(o.output,
            std::string("RD_CUDNN_GRAPH_CACHE must be a whole number >= 1, got '") + value + "'"))
        << o.output;
    EXPECT_FALSE(has(o.output, "step 1/")) << "it trained first:\n" << o.output;
  }
}

TEST_F(TrainCliTest, SamplingNeedsOnlyTheWeights) {
  ASSERT_EQ(run(train("sample")).code, 0);
  const std::optional<std::string> ck = latest_checkpoint((dir_ / "sample" / "checkpoints").string());
  ASSERT_TRUE(ck.has_value());
  {
    std::fstream f(fs::path(*ck) / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('\x7f');
  }
  const Outcome o = run({trainer_, "sample", "--device=cpu", "--checkpoint=" + (dir_ / "sample").string(),
                         "--prompt=ab", "--max_new_tokens=3"});
  EXPECT_EQ(o.code, 0) << o.output;
  EXPECT_TRUE(has(o.output, "ab")) << o.output;
  // Resuming needs the optimizer: it names the damaged file.
  const Outcome resume = run(train("sample"));
  EXPECT_EQ(resume.code, 1) << resume.output;
  EXPECT_TRUE(has(resume.output, "optimizer.safetensors")) << resume.output;
}

TEST_F(TrainCliTest, SamplingSaysItsRateAndRunsInTheDeviceDtypeOrDtype) {
  ASSERT_EQ(run(train("rate")).code, 0);
  const std::vector<std::string> sample = {
      trainer_,       "sample",
      "--device=cpu", "--checkpoint=" + (dir_ / "rate").string(),
      "--prompt=ab",  "--max_new_tokens=4"};
  const Outcome plain = run(sample);
  EXPECT_EQ(plain.code, 0) << plain.output;
  // The CPU's recommendation is float32.
  EXPECT_TRUE(has(plain.output, "sample: 4 tokens after a 2-token prompt in ")) << plain.output;
  EXPECT_TRUE(has(plain.output, " tokens/s), float32 on cpu")) << plain.output;
  std::vector<std::string> bf16 = sample;
  bf16.push_back("--dtype=bfloat16");
  const Outcome low = run(bf16);
  EXPECT_EQ(low.code, 0) << low.output;
  EXPECT_TRUE(has(low.output, " tokens/s), bfloat16 on cpu")) << low.output;
  std::vector<std::string> quiet = sample;
  quiet.push_back("--quiet");
  const Outcome silent = run(quiet);
  EXPECT_EQ(silent.code, 0) << silent.output;
  EXPECT_FALSE(has(silent.output, "sample: ")) << silent.output;
  EXPECT_TRUE(has(silent.output, "ab")) << silent.output;
}

TEST_F(TrainCliTest, ATextRunEndsWithItsLossPerByte) {
  const fs::path text = dir_ / "corpus.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "a text of bytes, line " << i % 9 << ". ";
  }
  const Outcome o = run(train("text", {"--data=text:" + text.string(), "--steps=2"}));
  EXPECT_EQ(o.code, 0) << o.output;
  EXPECT_TRUE(has(o.output, "held-out loss ")) << o.output;
  EXPECT_TRUE(has(o.output, " bits per byte (")) << o.output;
  EXPECT_FALSE(has(o.output, "exact match")) << o.output;
}

TEST_F(TrainCliTest, ABusyOutDirIsRefusedNamingItsHolder) {
  RunLock held((dir_ / "busy").string());
  const Outcome o = run(train("busy"));
  EXPECT_EQ(o.code, 1) << o.output;
  EXPECT_TRUE(has(o.output, "is in use by another run: pid " + std::to_string(::getpid())))
      << o.output;
}

TEST_F(TrainCliTest, ResumingWithChangedFlagsNeedsAllowConfigChange) {
  ASSERT_EQ(run(train("resume")).code, 0);
  const Outcome refused = run(train("resume", {"--steps=2", "--seq_len=32", "--segments=16,32"}));
  EXPECT_EQ(refused.code, 1) << refused.output;
  EXPECT_TRUE(has(refused.output, "data.seq_len: saved 64, now 32")) << refused.output;
  EXPECT_TRUE(has(refused.output, "model.segment_lengths: saved [16,64], now [16,32]"))
      << refused.output;
  EXPECT_TRUE(has(refused.output, "train.steps: saved 1, now 2")) << refused.output;
  // Logging and evaluation settings may change.
  EXPECT_EQ(run(train("resume", {"--log_every=5", "--eval_every=3"})).code, 0);
  const Outcome allowed = run(train("resume", {"--steps=2", "--allow_config_change"}));
  EXPECT_EQ(allowed.code, 0) << allowed.output;
  EXPECT_TRUE(has(allowed.output, "note: resuming")) << allowed.output;
  EXPECT_TRUE(has(allowed.output, "done: 2 steps")) << allowed.output;
}

TEST_F(TrainCliTest, AResumeNamesTheCheckpointItResumesFrom) {
  ASSERT_EQ(run(train("first", {"--steps=2", "--checkpoint_every=1"})).code, 0);
  const fs::path step_1 = dir_ / "first" / "checkpoints" / "step_000000001";
  ASSERT_TRUE(fs::is_directory(step_1));
  // Another run folder resumes from the first run's step 1: the line names that folder.
  const Outcome o = run(train("second", {"--steps=2", "--resume=" + step_1.string()}));
  EXPECT_EQ(o.code, 0) << o.output;
  EXPECT_TRUE(has(o.output, "resuming at step 1 from " + step_1.string())) << o.output;
  EXPECT_TRUE(has(o.output, "done: 2 steps")) << o.output;
}

}  // namespace
}  // namespace rd::train
