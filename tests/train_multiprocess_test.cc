// rd_train on several processes of the CPU over Gloo: data parallel and context parallel
// through rd_launch, and both at once started by hand with torchrun-style variables. A few
// steps of a tiny model; the training losses and gradient norms rank 0 logs must equal those
// of one process on the same global batch, to float32 tolerance. The Cuda cases do the same
// on 2 and 4 GPUs over NCCL in bfloat16 (skipped where fewer GPUs are visible), and resume a
// context-parallel run on the same world size.
#include <gtest/gtest.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/dist/gloo.h"
#include "ringdilated/dist/local_launch.h"
#include "ringdilated/dist/nccl.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "testing/temp_dir.h"

namespace rd {
namespace {

namespace fs = std::filesystem;
using Env = std::vector<std::pair<std::string, std::string>>;

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 4;

// One logged training step of metrics.jsonl.
struct StepRecord {
  double loss = 0, grad_norm = 0;
};

// The number after "key": in a JSON line (the trainer writes flat records).
double number_field(const std::string& line, const std::string& key) {
  const std::string quoted = str_cat("\"", key, "\":");
  const size_t at = line.find(quoted);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(line.c_str() + at + quoted.size(), nullptr);
}

std::vector<StepRecord> train_records(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<StepRecord> out;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"split\":\"train\"") == std::string::npos) continue;
    out.push_back({number_field(line, "loss"), number_field(line, "grad_norm")});
  }
  return out;
}

// A program's path: the variable `name` when set (the GPU runner carries the programs
// elsewhere), else where this build put it.
std::string program(const char* name, const char* built) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : built;
}

class TrainMultiprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!dist::gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  }

  // rd_train's flags for a tiny model on the copy task, `batch` sequences per data-parallel
  // rank, logging every step to `run`'s folder. One thread per process: the CI has 2 cores.
  std::vector<std::string> train_args(const std::string& run, int batch, int context) const {
    std::vector<std::string> args = {
        program("RD_TRAIN", RD_TRAIN_PATH), "--data=copy", "--dim=32", "--depth=2", "--heads=4",
        str_cat("--steps=", steps_), "--warmup_steps=1", "--lr=0.01", "--log_every=1",
        "--eval_every=0", "--eval_batches=1", "--checkpoint_every=0", "--resume=",
        str_cat("--batch_size=", batch), str_cat("--context_parallel=", context),
        str_cat("--out_dir=", (dir_ / run).string())};
    args.insert(args.end(), device_args_.begin(), device_args_.end());
    args.insert(args.end(), extra_args_.begin(), extra_args_.end());
    return args;
  }

  // Runs `command` as `nprocs` processes with env(rank); expects every one to exit 0, and
  // returns the training records rank 0 wrote to `run`'s metrics.
  std::vector<StepRecord> run_job(const std::string& run, std::vector<std::string> command,
                                  int nprocs, std::function<Env(int)> env) {
    std::string output;
    dist::LocalLaunchOptions o;
    o.command = std::move(command);
    o.nprocs = nprocs;
    o.env = std::move(env);
    o.timeout = std::chrono::seconds(120);
    o.on_line = [&](int rank, bool, const std::string& line) {
      output += str_cat("[", rank, "] ", line, "\n");
    };
    const dist::LocalLaunchResult r = dist::launch_local(o);
    EXPECT_TRUE(r.ok()) << run << ":\n" << output;
    return train_records(dir_ / run / "metrics.jsonl");
  }

  // One process (no launcher) on the whole batch.
  std::vector<StepRecord> one_process() {
    return run_job("one", train_args("one", kGlobalBatch, 1), 1, [](int) {
      return Env{{"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_SIZE", ""}};
    });
  }

  // rd_launch -n nprocs -- rd_train ..., `context` ranks per context-parallel group.
  std::vector<StepRecord> through_rd_launch(const std::string& run, int nprocs, int context) {
    const int data_parallel = nprocs / context;
    std::vector<std::string> command = {program("RD_LAUNCH", RD_LAUNCH_PATH), "-n",
                                        std::to_string(nprocs), "--"};
    const std::vector<std::string> args = train_args(run, kGlobalBatch / data_parallel, context);
    command.insert(command.end(), args.begin(), args.end());
    return run_job(run, command, 1, nullptr);
  }

  test::TestTempDir temp_;
  fs::path dir_ = temp_.path();
  int steps_ = kSteps;
  // CPU: one thread per process (the CI has 2 cores), sequences of 64.
  std::vector<std::string> device_args_ = {"--device=cpu", "--threads=1", "--seq_len=64",
                                           "--segments=16,64", "--dilations=1,2"};
  std::vector<std::string> extra_args_;  // a test's own flags, for every run
};

// Each logged step's loss and gradient norm equal the one-process run's, to float32
// tolerance (the sums over ranks add in another order; three steps of AdamW follow them).
void expect_same_training(const std::vector<StepRecord>& got, const std::vector<StepRecord>& want,
                          double tol = 1e-5) {
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, tol * want[i].loss) << "step " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, tol * want[i].grad_norm) << "step " << i + 1;
  }
  // The steps did train: the loss moved (else equal losses would prove little).
  EXPECT_GT(std::abs(want.back().loss - want.front().loss), 1e-3 * want.front().loss);
}

TEST_F(TrainMultiprocessTest, DataParallelThroughRdLaunchEqualsOneProcess) {
  const std::vector<StepRecord> want = one_process();
  expect_same_training(through_rd_launch("dp2", 2, 1), want);
}

TEST_F(TrainMultiprocessTest, ContextParallelThroughRdLaunchEqualsOneProcess) {
  const std::vector<StepRecord> want = one_process();
  expect_same_training(through_rd_launch("cp2", 2, 2), want);
}

// 4 processes: 2 data-parallel groups of 2 context-parallel ranks, started here with the
// variables torchrun sets.
TEST_F(TrainMultiprocessTest, BothStartedWithTorchrunVariablesEqualOneProcess) {
  const std::vector<StepRecord> want = one_process();
  const int port = dist::pick_free_port();
  const std::vector<StepRecord> got = run_job(
      "dp2cp2", train_args("dp2cp2", kGlobalBatch / 2, 2), 4, [port](int rank) {
        Env env = dist::local_rank_env(rank, 4, "127.0.0.1", port);
        env.emplace_back("OMPI_COMM_WORLD_RANK", "");
        return env;
      });
  expect_same_training(got, want);
}

// ---------------------------------------------------------------------------------------
// On GPUs: NCCL, one GPU per rank, bfloat16 compute with float32 master weights. A model
// whose sequence of 1024 tokens spans the ranks' blocks (pairs (128, 1), (1024, 4)).

class TrainMultiGpuTest : public TrainMultiprocessTest {
 protected:
  void SetUp() override {
    std::string why;
    if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
    device_args_ = {"--device=cuda", "--dtype=bfloat16", "--seq_len=1024", "--segments=128,1024",
                    "--dilations=1,4"};
  }
  static bool lacks_gpus(int n) { return cuda_device_count() < n; }
};

// bfloat16 rounds activations (8 bits of mantissa) and the ranks sum gradients in another
// order than one GPU: the first steps agree to a few units of bfloat16 roundoff.
constexpr double kBf16StepTolerance = 2e-2;

TEST_F(TrainMultiGpuTest, CudaDataParallelOn2GpusMatchesOneGpu) {
  if (lacks_gpus(2)) GTEST_SKIP() << "needs 2 GPUs";
  expect_same_training(through_rd_launch("dp2", 2, 1), one_process(), kBf16StepTolerance);
}

TEST_F(TrainMultiGpuTest, CudaContextParallelOn2GpusMatchesOneGpu) {
  if (lacks_gpus(2)) GTEST_SKIP() << "needs 2 GPUs";
  expect_same_training(through_rd_launch("cp2", 2, 2), one_process(), kBf16StepTolerance);
}

TEST_F(TrainMultiGpuTest, CudaBothOn4GpusMatchOneGpu) {
  if (lacks_gpus(4)) GTEST_SKIP() << "needs 4 GPUs";
  const std::vector<StepRecord> want = one_process();
  std::vector<std::string> command = {program("RD_LAUNCH", RD_LAUNCH_PATH), "-n", "4", "--"};
  const std::vector<std::string> args = train_args("dp2cp2", kGlobalBatch / 2, 2);
  command.insert(command.end(), args.begin(), args.end());
  expect_same_training(run_job("dp2cp2", command, 1, nullptr), want, kBf16StepTolerance);
}

// Recomputation with MLP chunks smaller than a rank's block (128 of 256 tokens at context
// parallel 4), data and context parallel together: the flags long sequences need.
TEST_F(TrainMultiGpuTest, CudaRecomputedChunksOn4GpusMatchOneGpu) {
  if (lacks_gpus(4)) GTEST_SKIP() << "needs 4 GPUs";
  extra_args_ = {"--recompute", "--mlp_chunk_tokens=128"};
  const std::vector<StepRecord> want = one_process();
  expect_same_training(through_rd_launch("cp4", 4, 4), want, kBf16StepTolerance);
  std::vector<std::string> command = {program("RD_LAUNCH", RD_LAUNCH_PATH), "-n", "4", "--"};
  const std::vector<std::string> args = train_args("dp2cp2", kGlobalBatch / 2, 2);
  command.insert(command.end(), args.begin(), args.end());
  expect_same_training(run_job("dp2cp2", command, 1, nullptr), want, kBf16StepTolerance);
}

// 2 GPUs, context parallel: kSteps steps with a checkpoint, then kSteps more resumed from it,
// equal kSteps * 2 steps straight (the same world size reads back every rank's state).
TEST_F(TrainMultiGpuTest, CudaContextParallelResumesOnTheSameWorldSize) {
  if (lacks_gpus(2)) GTEST_SKIP() << "needs 2 GPUs";
  auto launch = [&](const std::string& run, int steps, const std::string& resume) {
    std::vector<std::string> command = {program("RD_LAUNCH", RD_LAUNCH_PATH), "-n", "2", "--"};
    steps_ = steps;
    std::vector<std::string> args = train_args(run, kGlobalBatch, 2);
    std::erase(args, std::string("--resume="));
    args.push_back("--resume=" + resume);
    args.push_back(str_cat("--decay=constant"));
    command.insert(command.end(), args.begin(), args.end());
    return run_job(run, command, 1, nullptr);
  };
  const std::vector<StepRecord> straight = launch("straight", 2 * kSteps, "");
  launch("halves", kSteps, "");
  const std::vector<StepRecord> resumed = launch("halves", 2 * kSteps, "auto");
  ASSERT_EQ(straight.size(), static_cast<size_t>(2 * kSteps));
  // The resumed run appends its steps to the same metrics file.
  ASSERT_EQ(resumed.size(), straight.size());
  // Equal up to the GPU kernels' own run-to-run variation (atomic float sums in a few
  // backward kernels flip bfloat16 roundings; cuda_trainer_test measures it on one GPU).
  double worst = 0;
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_NEAR(resumed[i].loss, straight[i].loss, 1e-2 * straight[i].loss) << "step " << i + 1;
    EXPECT_NEAR(resumed[i].grad_norm, straight[i].grad_norm, 1e-2 * straight[i].grad_norm)
        << "step " << i + 1;
    worst = std::max(worst, std::abs(resumed[i].loss - straight[i].loss) / straight[i].loss);
  }
  std::printf("resumed vs straight: largest relative loss difference %.3g\n", worst);
}

}  // namespace
}  // namespace rd
