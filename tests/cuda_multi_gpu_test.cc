// Sequence-parallel dilated attention on several GPUs through NCCL, against one GPU: P = 2
// and 4 ranks as threads of this process (make_nccl_group), and as processes, one per GPU
// (this program run again by launch_local with torchrun-style variables, joining through
// init_process_group). Every strategy, both variants, both mixing modes, causal and not,
// float32 and bfloat16, forward and backward. Also: a rank killed in the middle of a ring
// step makes the others fail with an error naming it, in bounded time. Cases that need more
// GPUs than are visible are skipped.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ringdilated/dist/bootstrap.h"
#include "ringdilated/dist/local_launch.h"
#include "ringdilated/dist/nccl.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "testing/raises.h"
#include "testing/ring_invariance.h"

namespace rd {
namespace {

using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::DistStrategy;
using nn::HeadMixing;
using test::FullSequence;
using test::RankResult;

// Blocks of N / P = 512 at P = 4: pair 0 stays inside blocks, pair 1 spans two blocks, pair
// 2 all four (at P = 2: inside, one, both).
constexpr test::RingDims kDims{1, 2048, 8, 64};
constexpr uint64_t kSeed = 2024;
// The variable that turns a run of this program into one rank of a multi-process case.
constexpr const char* kWorkerVariable = "RD_MULTI_GPU_WORKER";

struct Case {
  DType dtype;
  DistStrategy strategy;
  DilationVariant variant;
  HeadMixing mixing;
  bool causal;
  nn::SequenceLayout layout = nn::SequenceLayout::kAuto;
  int64_t kv_heads = 0;    // grouped-query attention: key/value heads (0: as many as q's)
  bool documents = false;  // document masks (kDocuments)
};

// Documents crossing the ranks' blocks (of 512 at P = 4), one of a single position.
const nn::DocumentStarts kDocuments = {{0, 300, 301, 700, 1500}};

// f of one case: its inputs, documents and single-GPU results.
FullSequence single_gpu(const Case& c, const DilatedAttentionOptions& o, Device gpu) {
  test::RingDims dims = kDims;
  dims.kv_heads = c.kv_heads;
  return test::single_device(o, c.dtype, kSeed, gpu, dims,
                             c.documents ? kDocuments : nn::DocumentStarts{});
}

DilatedAttentionOptions options_of(const Case& c) {
  DilatedAttentionOptions o;
  o.segment_lengths = {256, 1024, 2048};
  o.dilation_rates = {1, 2, 4};
  o.variant = c.variant;
  o.mixing = c.mixing;
  o.causal = c.causal;
  return o;
}

std::string case_name(const Case& c) {
  return str_cat(dtype_name(c.dtype), "_", nn::strategy_name(c.strategy), "_",
                 c.variant == DilationVariant::kGlobal ? "original" : "fixed", "_",
                 c.mixing == HeadMixing::kAllHeads ? "allheads" : "groups",
                 c.causal ? "_causal" : "", "_", nn::layout_name(c.layout),
                 c.kv_heads > 0 ? str_cat("_kv", c.kv_heads) : "", c.documents ? "_documents" : "");
}

// Every combination the library supports (the original (global) variant mixes heads in
// groups only), in both sequence layouts.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather, DistStrategy::kAuto}) {
      for (bool causal : {false, true}) {
        for (nn::SequenceLayout layout : {nn::SequenceLayout::kContiguous, nn::SequenceLayout::kZigzag}) {
          cases.push_back({dtype, s, DilationVariant::kSegmentLocal, HeadMixing::kHeadGroups, causal, layout});
          cases.push_back({dtype, s, DilationVariant::kSegmentLocal, HeadMixing::kAllHeads, causal, layout});
          cases.push_back({dtype, s, DilationVariant::kGlobal, HeadMixing::kHeadGroups, causal, layout});
        }
      }
    }
  }
  // Issue 21's features through NCCL: grouped-query attention (8 heads on 2), document
  // masks and both together, bf16, causal, both layouts and both explicit strategies.
  for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather}) {
    for (nn::SequenceLayout layout : {nn::SequenceLayout::kContiguous, nn::SequenceLayout::kZigzag}) {
      const Case base{DType::kBFloat16, s, DilationVariant::kSegmentLocal, HeadMixing::kAllHeads,
                      true, layout};
      Case grouped = base, packed = base, both = base;
      grouped.kv_heads = 2;
      packed.documents = true;
      // Both, with head groups: grouped-query document pieces as cuDNN calls over pieces.
      both.kv_heads = 2;
      both.documents = true;
      both.mixing = HeadMixing::kHeadGroups;
      cases.push_back(grouped);
      cases.push_back(packed);
      cases.push_back(both);
    }
  }
  return cases;
}

// ---------------------------------------------------------------------------------------
// Ranks as threads of this process, one GPU each.

class NcclThreads : public ::testing::TestWithParam<int> {
 protected:
  // One NCCL group per world size, made once: ncclCommInitAll costs about a second.
  static std::vector<std::shared_ptr<dist::Communicator>>& group(int P) {
    static auto* groups = new std::map<int, std::vector<std::shared_ptr<dist::Communicator>>>();
    auto& comms = (*groups)[P];
    if (comms.empty()) {
      std::vector<Device> devices;
      for (int r = 0; r < P; ++r) devices.push_back(Device::cuda(r));
      // RD_NCCL_THREAD_OVERLAP=1: the benches' mode (dist::NcclOptions::thread_ranks_overlap),
      // to check it on the same cases (with CUDA_MODULE_LOADING=EAGER).
      dist::NcclOptions options;
      options.thread_ranks_overlap = std::getenv("RD_NCCL_THREAD_OVERLAP") != nullptr;
      comms = dist::make_nccl_group(devices, options);
    }
    return comms;
  }

  void SetUp() override {
    std::string why;
    if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
    if (cuda_device_count() < GetParam()) {
      GTEST_SKIP() << "needs " << GetParam() << " GPUs, " << cuda_device_count() << " visible";
    }
  }

  // Rank r of the group on its own thread and GPU; the first error of any rank is rethrown.
  static std::vector<RankResult> run_on_gpus(const FullSequence& f,
                                             const DilatedAttentionOptions& o, int P,
                                             DistStrategy strategy, nn::SequenceLayout layout) {
    auto& comms = group(P);
    std::vector<FullSequence> inputs;
    for (int r = 0; r < P; ++r) inputs.push_back(test::inputs_on(f, Device::cuda(r)));
    for (int r = 0; r < P; ++r) synchronize(Device::cuda(r));
    std::vector<RankResult> results(static_cast<size_t>(P));
    std::vector<std::exception_ptr> errors(static_cast<size_t>(P));
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) {
      threads.emplace_back([&, r] {
        const auto i = static_cast<size_t>(r);
        try {
          results[i] =
              test::run_rank(inputs[i], o, *comms[i], strategy, Device::cuda(r), layout);
          synchronize(Device::cuda(r));
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const std::exception_ptr& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    return results;
  }
};

TEST_P(NcclThreads, EveryCaseMatchesOneGpu) {
  const int P = GetParam();
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(case_name(c));
    const DilatedAttentionOptions o = options_of(c);
    const FullSequence f = single_gpu(c, o, Device::cuda(0));
    const std::vector<RankResult> rs = run_on_gpus(f, o, P, c.strategy, c.layout);
    test::expect_ranks_match(rs, f, test::gpu_ring_tolerance(c.dtype));
    // Every rank's traffic went through NCCL and was counted.
    if (c.strategy != DistStrategy::kAuto) {
      for (const RankResult& r : rs) EXPECT_GT(r.info.forward_bytes_sent, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclThreads, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return str_cat("P", info.param);
                         });

// ---------------------------------------------------------------------------------------
// Ranks as processes, one GPU each: this program again, launched with torchrun-style
// variables and kWorkerVariable set to the worker test's mode.

std::string this_program() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

bool is_worker(const char* mode) {
  const char* value = std::getenv(kWorkerVariable);
  return value != nullptr && std::string(value) == mode;
}

// Runs `P` processes of the worker test `test_name` in `mode`; returns the launch result
// and every line they wrote (for failure messages).
struct Job {
  dist::LocalLaunchResult result;
  std::string output;
  double seconds = 0;
};

Job launch_workers(int P, const std::string& test_name, const std::string& mode) {
  Job job;
  dist::LocalLaunchOptions o;
  o.command = {this_program(), "--gtest_filter=MultiGpuWorker." + test_name, "--gtest_brief=1"};
  o.nprocs = P;
  const int port = dist::pick_free_port();
  o.env = [=](int rank) {
    auto env = dist::local_rank_env(rank, P, "127.0.0.1", port);
    env.emplace_back(kWorkerVariable, mode);
    env.emplace_back("NCCL_NVLS_ENABLE", "0");
    return env;
  };
  o.timeout = std::chrono::seconds(240);
  // A surviving rank must end by itself (with its own error) well before this.
  o.settle = std::chrono::seconds(60);
  o.on_line = [&](int rank, bool, const std::string& line) {
    job.output += str_cat("[rank ", rank, "] ", line, "\n");
  };
  const auto start = std::chrono::steady_clock::now();
  job.result = dist::launch_local(o);
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return job;
}

class NcclProcesses : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    std::string why;
    if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
    if (cuda_device_count() < GetParam()) {
      GTEST_SKIP() << "needs " << GetParam() << " GPUs, " << cuda_device_count() << " visible";
    }
  }
};

TEST_P(NcclProcesses, EveryCaseMatchesOneGpu) {
  const Job job = launch_workers(GetParam(), "EveryCaseMatchesOneGpu", "invariance");
  EXPECT_TRUE(job.result.ok()) << job.output;
}

// The last rank, or rank 0 (which also serves the store), dies without a word in the middle
// of a ring step: its forward is still running on its GPU. The others are then in the
// backward's ring, waiting for blocks that never come; they must end by themselves, with an
// error naming the rank, within seconds (the watchdog's look plus NcclOptions::peer_grace).
TEST_P(NcclProcesses, AKilledRankStopsTheOthersWithAnErrorNamingIt) {
  const int P = GetParam();
  for (int victim : {P - 1, 0}) {
    SCOPED_TRACE(str_cat("rank ", victim, " killed"));
    const Job job = launch_workers(P, "KilledRankStopsTheOthers", str_cat("kill:", victim));
    ASSERT_EQ(job.result.wait_statuses.size(), static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const std::string status = job.result.status_str(r);
      if (r == victim) {
        EXPECT_NE(status.find("signal 9"), std::string::npos) << status << "\n" << job.output;
      } else {
        // exit 0: the worker test saw the error it expects (it checks the message).
        EXPECT_EQ(status, "exited with status 0") << "rank " << r << "\n" << job.output;
      }
    }
    EXPECT_LT(job.seconds, 60.0) << job.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclProcesses, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return str_cat("P", info.param);
                         });

// The workers: each joins the job through init_process_group (backend "nccl", the GPU of
// its LOCAL_RANK). They skip unless launched by the tests above.

std::shared_ptr<dist::Communicator> join_job() {
  dist::ProcessGroupOptions options;
  options.backend = "nccl";
  options.timeout = std::chrono::seconds(120);
  return dist::init_process_group(options);
}

// Each process computes the single-GPU reference on its own GPU from the same seed and
// checks its block of every result.
TEST(MultiGpuWorker, EveryCaseMatchesOneGpu) {
  if (!is_worker("invariance")) GTEST_SKIP() << "run by NcclProcesses";
  const std::shared_ptr<dist::Communicator> comm = join_job();
  const Device gpu = comm->device();
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(case_name(c));
    const DilatedAttentionOptions o = options_of(c);
    const FullSequence f = single_gpu(c, o, gpu);
    const RankResult mine = test::run_rank(f, o, *comm, c.strategy, gpu, c.layout);
    test::expect_ranks_match({mine}, test::block_of(f, comm->rank(), comm->size(), mine.layout),
                             test::gpu_ring_tolerance(c.dtype));
  }
  comm->barrier();
}

TEST(MultiGpuWorker, KilledRankStopsTheOthers) {
  const char* mode = std::getenv(kWorkerVariable);
  if (mode == nullptr || std::string(mode).rfind("kill:", 0) != 0) {
    GTEST_SKIP() << "run by NcclProcesses";
  }
  const int victim = std::atoi(mode + 5);
  const std::shared_ptr<dist::Communicator> comm = join_job();
  const Device gpu = comm->device();
  // Long enough that a forward is in flight when the victim dies.
  const Case c{DType::kBFloat16, DistStrategy::kRing, DilationVariant::kSegmentLocal,
               HeadMixing::kHeadGroups, false};
  const DilatedAttentionOptions o = options_of(c);
  const FullSequence f = single_gpu(c, o, gpu);
  test::run_rank(f, o, *comm, c.strategy, gpu);  // a healthy step: connections are up
  comm->barrier();
  if (comm->rank() == victim) {
    Tensor q = f.q.detach().narrow(1, 0, kDims.seq / comm->size()).contiguous();
    nn::ring_dilated_attention(q, q, q, o, *comm, c.strategy);  // queued, not waited for
    ::kill(::getpid(), SIGKILL);
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::raises(
      [&] {
        for (int step = 0; step < 100; ++step) {  // each waits in the ring for the victim
          test::run_rank(f, o, *comm, c.strategy, gpu);
          comm->barrier();
        }
      },
      {ErrorCode::kAborted, ErrorCode::kTimeout},
      {victim == 0 ? std::string("rank 0, which serves the store") : str_cat("rank ", victim, " left")}));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0);
}

}  // namespace
}  // namespace rd
