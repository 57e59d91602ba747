// Jobs of 2 and 4 processes over the gloo communicator, run by tests/dist_worker_main.cc:
// through rd_launch, and started by hand with torchrun-style or Open MPI variables. Every
// collective, sequence-parallel dilated attention, a rank that aborts or exits while the
// others wait in a collective, a rank that joins too late, and a rendezvous that never
// completes. Each job takes seconds, and every job has a deadline: none can hang.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "ringdilated/dist/gloo.h"
#include "ringdilated/dist/local_launch.h"
#include "ringdilated/kernels/error.h"

namespace rd {
namespace {

using Env = std::vector<std::pair<std::string, std::string>>;
using Clock = std::chrono::steady_clock;

#define SKIP_WITHOUT_GLOO()                                                                  \
  if (!dist::gloo_available()) {                                                             \
    GTEST_SKIP() << "this build has no Gloo backend (libgloo-dev was not found when it was " \
                    "configured)";                                                           \
  }

struct Job {
  dist::LocalLaunchResult result;
  std::vector<std::string> lines;  // "[rank i] ...", and rd_launch's own lines
  double seconds = 0;

  // The lines rank `rank` printed, without the prefix.
  std::string of_rank(int rank) const {
    const std::string prefix = str_cat("[rank ", rank, "] ");
    std::string out;
    for (const std::string& line : lines) {
      if (line.rfind(prefix, 0) == 0) out += line.substr(prefix.size()) + "\n";
    }
    return out;
  }
  std::string all() const {
    std::string out;
    for (const std::string& line : lines) out += line + "\n";
    return out;
  }
  int exit_code(int process) const {
    const int status = result.wait_statuses.at(static_cast<size_t>(process));
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

// Runs `command` as `nprocs` processes with env(i), gathering their lines ("[rank i] "
// prefixed, except for rd_launch's, which prefixes its ranks' lines itself). A rank that
// fails leaves the others `settle` to end on their own; the whole job has 60 s.
Job run(std::vector<std::string> command, int nprocs, std::function<Env(int)> env,
        std::chrono::milliseconds settle) {
  // rd_launch (possibly behind `env`) prefixes its ranks' lines itself.
  const bool is_launcher =
      std::find(command.begin(), command.end(), RD_LAUNCH_PATH) != command.end();
  Job job;
  dist::LocalLaunchOptions o;
  o.command = std::move(command);
  o.nprocs = nprocs;
  o.env = std::move(env);
  o.timeout = std::chrono::seconds(60);
  o.settle = settle;
  o.grace = std::chrono::seconds(2);
  o.on_line = [&](int rank, bool, const std::string& line) {
    job.lines.push_back(is_launcher ? line : str_cat("[rank ", rank, "] ", line));
  };
  const Clock::time_point start = Clock::now();
  job.result = dist::launch_local(o);
  job.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return job;
}

// rd_launch -n nprocs [flags] -- dist_worker args...
Job launch(int nprocs, const std::vector<std::string>& args,
           const std::vector<std::string>& flags = {}) {
  std::vector<std::string> command = {RD_LAUNCH_PATH, "-n", std::to_string(nprocs)};
  command.insert(command.end(), flags.begin(), flags.end());
  command.push_back("--");
  command.push_back(RD_DIST_WORKER_PATH);
  command.insert(command.end(), args.begin(), args.end());
  return run(command, 1, nullptr, std::chrono::milliseconds(0));
}

// dist_worker args... as nprocs processes started here, rank i with env(i).
Job by_hand(int nprocs, const std::function<Env(int)>& env, const std::vector<std::string>& args) {
  std::vector<std::string> command = {RD_DIST_WORKER_PATH};
  command.insert(command.end(), args.begin(), args.end());
  return run(command, nprocs, env, std::chrono::seconds(15));
}

Env torchrun_env(int rank, int nprocs, const std::string& addr, int port) {
  return {{"RANK", std::to_string(rank)},        {"WORLD_SIZE", std::to_string(nprocs)},
          {"LOCAL_RANK", std::to_string(rank)},  {"MASTER_ADDR", addr},
          {"MASTER_PORT", std::to_string(port)}, {"OMPI_COMM_WORLD_RANK", ""}};
}

// The S of a worker's "error (<code>) after S s: ..." line; -1 when there is none.
// (No std::regex: GCC 12 warns inside it at -O1 with the sanitizers.)
double error_seconds(const std::string& text) {
  const size_t error = text.find("error (");
  const size_t after = text.find(") after ", error);
  if (error == std::string::npos || after == std::string::npos) return -1;
  return std::strtod(text.c_str() + after + 8, nullptr);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every process of the job exited 0, and each of the `nprocs` ranks printed that `command`
// passed all its checks.
void expect_all_ok(const Job& job, int nprocs, const std::string& command) {
  for (size_t p = 0; p < job.result.wait_statuses.size(); ++p) {
    EXPECT_EQ(job.exit_code(static_cast<int>(p)), 0) << job.all();
  }
  for (int r = 0; r < nprocs; ++r) {
    EXPECT_TRUE(contains(job.of_rank(r), str_cat("rank ", r, ": ", command, ": OK"))) << job.all();
  }
}

// --- through rd_launch ---------------------------------------------------------------------

class ThroughRdLaunch : public ::testing::TestWithParam<int> {};

TEST_P(ThroughRdLaunch, EveryCollectiveAndTransfer) {
  SKIP_WITHOUT_GLOO();
  const int P = GetParam();
  expect_all_ok(launch(P, {"collectives"}), P, "collectives");
}

TEST_P(ThroughRdLaunch, RingDilatedAttentionMatchesOneDevice) {
  SKIP_WITHOUT_GLOO();
  const int P = GetParam();
  expect_all_ok(launch(P, {"ring"}), P, "ring");
}

// Rank 1 aborts while its own receive is pending and the others wait in an all_reduce: its
// receive fails with kAborted, and every other rank fails naming rank 1 and the reason, long
// before the 30 s timeout.
TEST_P(ThroughRdLaunch, EveryRankNamesTheRankThatAborted) {
  SKIP_WITHOUT_GLOO();
  const int P = GetParam();
  const Job job = launch(P, {"fail-abort", "--timeout-ms", "30000"}, {"--settle-s", "20"});
  EXPECT_EQ(job.exit_code(0), 1) << job.all();
  for (int r = 0; r < P; ++r) {
    const std::string out = job.of_rank(r);
    EXPECT_TRUE(contains(out, "error (Aborted)") &&
                contains(out, "rank 1 aborted: injected failure"))
        << "rank " << r << ":\n"
        << job.all();
    EXPECT_LT(error_seconds(out), 10.0) << job.all();
  }
  EXPECT_TRUE(contains(job.all(), "rd_launch: rank 1 exited with status 2")) << job.all();
  EXPECT_LT(job.seconds, 15.0);
}

// Rank 1's process exits while the others wait in an all_reduce: they fail naming it.
TEST_P(ThroughRdLaunch, EveryRankNamesTheRankThatExited) {
  SKIP_WITHOUT_GLOO();
  const int P = GetParam();
  const Job job = launch(P, {"fail-exit", "--timeout-ms", "30000"}, {"--settle-s", "20"});
  EXPECT_EQ(job.exit_code(0), 1) << job.all();
  EXPECT_TRUE(contains(job.all(), "rd_launch: rank 1 failed first: it exited with status 3"))
      << job.all();
  for (int r = 0; r < P; ++r) {
    if (r == 1) continue;
    const std::string out = job.of_rank(r);
    EXPECT_TRUE(contains(out, "error (Aborted)") && contains(out, "because rank 1 left"))
        << "rank " << r << ":\n"
        << job.all();
    EXPECT_LT(error_seconds(out), 10.0) << job.all();
    EXPECT_TRUE(contains(job.all(), str_cat("rd_launch: rank ", r, " exited with status 2")));
  }
  EXPECT_LT(job.seconds, 15.0);
}

// The last rank reaches the all_reduce only after the others' 2 s timeout: they fail with
// kTimeout after about 2 s, and the late rank fails at once, naming a rank that timed out.
TEST_P(ThroughRdLaunch, RanksLeftWaitingTimeOut) {
  SKIP_WITHOUT_GLOO();
  const int P = GetParam();
  const Job job = launch(P, {"timeout", "--timeout-ms", "2000"}, {"--settle-s", "20"});
  EXPECT_EQ(job.exit_code(0), 1) << job.all();
  for (int r = 0; r < P - 1; ++r) {
    const std::string out = job.of_rank(r);
    EXPECT_TRUE(contains(out, "error (Timeout)") && contains(out, "2000 ms") &&
                contains(out, "all_reduce (collective #1)"))
        << "rank " << r << ":\n"
        << job.all();
    const double seconds = error_seconds(out);
    EXPECT_GE(seconds, 1.9) << job.all();
    EXPECT_LT(seconds, 6.0) << job.all();
  }
  const std::string late = job.of_rank(P - 1);
  EXPECT_TRUE(contains(late, "barrier (collective #1) failed")) << job.all();
  EXPECT_LT(error_seconds(late), 3.0) << job.all();
  EXPECT_LT(job.seconds, 15.0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThroughRdLaunch, ::testing::Values(2, 4),
                         [](const auto& info) { return str_cat("P", info.param); });

// Without --settle-s, rd_launch stops the others as soon as one rank fails.
TEST(RdLaunch, NamesTheFailedRankAndStopsTheOthers) {
  const Job job = run({RD_LAUNCH_PATH, "-n", "3", "--grace-s", "1", "--", "sh", "-c",
                       "echo up; if [ $RANK = 2 ]; then sleep 0.5; exit 7; fi; exec sleep 30"},
                      1, nullptr, std::chrono::milliseconds(0));
  EXPECT_EQ(job.exit_code(0), 1) << job.all();
  EXPECT_TRUE(contains(job.all(), "rd_launch: rank 2 failed first: it exited with status 7"))
      << job.all();
  EXPECT_TRUE(contains(job.all(), "rd_launch: rank 0 was killed by signal 15")) << job.all();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(job.of_rank(r), "up\n") << job.all();
  EXPECT_LT(job.seconds, 10.0);
}

// Unless the launcher's environment sets OMP_NUM_THREADS, rd_launch gives each of its ranks
// an equal share of the cores (at least 1), so n CPU ranks do not run n threads a core.
TEST(RdLaunch, SharesTheCoresAmongTheRanksUnlessOmpNumThreadsIsSet) {
  const auto threads_of_ranks = [](int ranks, const std::vector<std::string>& env_args) {
    std::vector<std::string> command = {"env"};
    command.insert(command.end(), env_args.begin(), env_args.end());
    command.insert(command.end(), {RD_LAUNCH_PATH, "-n", std::to_string(ranks), "--", "sh", "-c",
                                   "echo threads=${OMP_NUM_THREADS:-unset}"});
    return run(command, 1, nullptr, std::chrono::milliseconds(0));
  };
  const int cores = dist::available_cores();
  const Job alone = threads_of_ranks(1, {"-u", "OMP_NUM_THREADS"});
  EXPECT_EQ(alone.of_rank(0), str_cat("threads=", cores, "\n")) << alone.all();
  const Job shared = threads_of_ranks(2, {"-u", "OMP_NUM_THREADS"});
  const Job kept = threads_of_ranks(2, {"OMP_NUM_THREADS=97"});  // no machine's share here
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(shared.of_rank(r), str_cat("threads=", std::max(1, cores / 2), "\n")) << shared.all();
    EXPECT_EQ(kept.of_rank(r), "threads=97\n") << kept.all();
  }
}

// --- started by hand -----------------------------------------------------------------------

TEST(ByHand, TorchrunStyleVariables) {
  SKIP_WITHOUT_GLOO();
  const int port = dist::pick_free_port();
  // localhost: the store resolves names, and a loopback master keeps gloo on 127.0.0.1.
  expect_all_ok(
      by_hand(4, [&](int r) { return torchrun_env(r, 4, "localhost", port); }, {"collectives"}), 4,
      "collectives");
}

TEST(ByHand, OpenMpiVariables) {
  SKIP_WITHOUT_GLOO();
  const int port = dist::pick_free_port();
  const Job job = by_hand(2,
                          [&](int r) {
                            return Env{{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                                       {"OMPI_COMM_WORLD_SIZE", "2"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                       {"RANK", ""},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", std::to_string(port)}};
                          },
                          {"ring"});
  expect_all_ok(job, 2, "ring");
}

TEST(ByHand, RanksNameTheRankThatExitedAndExitNonZero) {
  SKIP_WITHOUT_GLOO();
  const int port = dist::pick_free_port();
  const Job job = by_hand(2, [&](int r) { return torchrun_env(r, 2, "127.0.0.1", port); },
                          {"fail-exit", "--timeout-ms", "30000"});
  EXPECT_EQ(job.exit_code(1), 3) << job.all();
  EXPECT_EQ(job.exit_code(0), 2) << job.all();
  EXPECT_TRUE(contains(job.of_rank(0), "because rank 1 left")) << job.all();
  EXPECT_LT(job.seconds, 15.0);
}

// Rank `rank` of a job of 2 started alone, with a 1.5 s rendezvous timeout: it must give up
// with kTimeout naming the store's address. Returns its output.
std::string start_alone(int rank, int port) {
  const Job job = by_hand(1, [&](int) { return torchrun_env(rank, 2, "127.0.0.1", port); },
                          {"barrier", "--rendezvous-timeout-ms", "1500"});
  const std::string out = job.of_rank(0);
  EXPECT_EQ(job.exit_code(0), 2) << out;
  EXPECT_TRUE(contains(out, "error (Timeout)") && contains(out, str_cat("127.0.0.1:", port)) &&
              contains(out, "1500 ms"))
      << out;
  EXPECT_LT(job.seconds, 10.0);
  return out;
}

// Only rank 0: the store never gets rank 1's address.
TEST(ByHand, RendezvousWithAMissingRankTimesOutNamingTheAddress) {
  SKIP_WITHOUT_GLOO();
  EXPECT_TRUE(contains(start_alone(0, dist::pick_free_port()), "did all 2 ranks start?"));
}

// Only rank 1: nobody serves the store, and its connection attempts give up.
TEST(ByHand, RendezvousWithoutRankZeroTimesOutNamingTheAddress) {
  SKIP_WITHOUT_GLOO();
  EXPECT_TRUE(contains(start_alone(1, dist::pick_free_port()), "could not connect to"));
}

TEST(ByHand, AMissingVariableIsNamed) {
  const Job job = by_hand(1,
                          [&](int) {
                            Env env = torchrun_env(0, 1, "127.0.0.1", 1234);
                            env.push_back({"MASTER_PORT", ""});
                            return env;
                          },
                          {"barrier"});
  EXPECT_EQ(job.exit_code(0), 2) << job.all();
  EXPECT_TRUE(contains(job.of_rank(0), "environment variable MASTER_PORT is not set")) << job.all();
}

}  // namespace
}  // namespace rd
