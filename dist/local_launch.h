// Runs the ranks of a job as child processes on this machine: what rd_launch does (and the
// multi-process tests), apart from parsing a command line. Each rank's output comes back line
// by line; when one rank fails, the others are stopped (SIGTERM, then SIGKILL after a grace
// period; optionally after a settling time in which they may end on their own), so a failed
// job ends instead of hanging.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace rd::dist {

struct LocalLaunchOptions {
  std::vector<std::string> command;  // the program (searched in PATH) and its arguments
  int nprocs = 1;
  // Variables added to (or replacing in) this process's environment for rank i.
  std::function<std::vector<std::pair<std::string, std::string>>(int rank)> env;
  // Stops every rank when the job runs longer; 0 means no limit.
  std::chrono::milliseconds timeout{0};
  // After a rank failed, how long the others may take to end on their own (with their own
  // error, which usually names the cause) before they are stopped. 0: stop them at once.
  std::chrono::milliseconds settle{0};
  // How long a stopped rank has between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  // Each complete line a rank writes (without its newline), in the order the lines arrive.
  std::function<void(int rank, bool is_stderr, const std::string& line)> on_line;
  // Polled a few times a second; true stops every rank (rd_launch: SIGINT or SIGTERM).
  std::function<bool()> should_stop;
};

struct LocalLaunchResult {
  std::vector<int> wait_statuses;  // waitpid's status of each rank's process
  // The rank that failed (exited non-zero or was killed) first, before any rank was stopped.
  std::optional<int> first_failure;
  bool timed_out = false;  // options.timeout passed
  bool stopped = false;    // options.should_stop asked to stop
  bool ok() const;         // every rank exited 0
  // "exited with status 3", "was killed by signal 9 (Killed)".
  std::string status_str(int rank) const;
};

// Starts options.nprocs copies of options.command and waits for all of them. Each child gets
// stdin from /dev/null, its own process group (a stop reaches its own children too) and dies
// with this process. Throws rd::Error (kInvalidArgument, kIo) only when it cannot start them.
LocalLaunchResult launch_local(const LocalLaunchOptions& options);

// A TCP port on `host` that is free now (free until someone binds it), chosen at random below
// the kernel's ephemeral range so that outgoing connections cannot take it in the meantime.
int pick_free_port(const std::string& host = "127.0.0.1");

// The cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// The torchrun-style variables of rank `rank` of a job of `nprocs` ranks on this machine:
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and, unless this
// process's environment sets it, OMP_NUM_THREADS = available_cores() / nprocs (at least 1),
// so that the ranks' CPU threads together fill the cores once instead of nprocs times.
std::vector<std::pair<std::string, std::string>> local_rank_env(int rank, int nprocs,
                                                                const std::string& master_addr,
                                                                int master_port);

}  // namespace rd::dist
