// rd_launch: starts the ranks of a job on this machine with the torchrun-style variables set
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT), prefixes their output
// with "[rank i] ", and when one fails stops the others and exits non-zero naming it.
//   rd_launch -n 4 [--master-port P] [--timeout-s S] [--settle-s T] [--grace-s G] -- prog args...
//   rd_launch --help (or -h): the usage, exit 0
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ringdilated/dist/local_launch.h"
#include "ringdilated/kernels/error.h"

namespace {

constexpr const char* kUsage =
    "usage: rd_launch -n N [--master-port P] [--timeout-s S] [--settle-s T] [--grace-s G]\n"
    "                 -- prog [args...]\n"
    "       rd_launch --help\n"
    "  -n N            number of ranks (processes) to start on this machine\n"
    "  --master-port P the port rank 0 serves the store on (default: a free one)\n"
    "  --timeout-s S   stop every rank when the job runs longer than S seconds (default: none)\n"
    "  --settle-s T    after a rank failed, seconds the others get to end on their own (and\n"
    "                  print their own error) before they are stopped (default: 0)\n"
    "  --grace-s G     seconds between SIGTERM and SIGKILL when stopping ranks (default: 5)\n"
    "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and\n"
    "MASTER_PORT. Exits 0 only when every rank exited 0.\n";

struct Args {
  bool help = false;  // --help or -h: print the usage, start nothing
  int nprocs = 0;
  int master_port = 0;
  double timeout_s = 0;
  double settle_s = 0;
  double grace_s = 5;
  std::vector<std::string> command;
};

// A number after `flag`, or a usage error.
double number_arg(int& i, int argc, char** argv) {
  const std::string flag = argv[i];
  RD_CHECK(i + 1 < argc, kInvalidArgument, "rd_launch: ", flag, " needs a value");
  const std::string text = argv[++i];
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  RD_CHECK(end != text.c_str() && *end == '\0' && value >= 0, kInvalidArgument, "rd_launch: ", flag,
           " needs a non-negative number, got '", text, "'");
  return value;
}

Args parse(int argc, char** argv) {
  Args args;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      args.help = true;
      return args;
    }
    if (arg == "-n" || arg == "--nprocs") {
      args.nprocs = static_cast<int>(number_arg(i, argc, argv));
    } else if (arg == "--master-port") {
      args.master_port = static_cast<int>(number_arg(i, argc, argv));
    } else if (arg == "--timeout-s") {
      args.timeout_s = number_arg(i, argc, argv);
    } else if (arg == "--settle-s") {
      args.settle_s = number_arg(i, argc, argv);
    } else if (arg == "--grace-s") {
      args.grace_s = number_arg(i, argc, argv);
    } else {
      RD_FAIL(kInvalidArgument, "rd_launch: unknown argument '", arg, "'");
    }
  }
  for (; i < argc; ++i) args.command.push_back(argv[i]);
  RD_CHECK(args.nprocs >= 1, kInvalidArgument, "rd_launch: -n N (N >= 1) is required");
  RD_CHECK(args.master_port <= 65535, kInvalidArgument, "rd_launch: --master-port ",
           args.master_port, " is not a port");
  RD_CHECK(!args.command.empty(), kInvalidArgument, "rd_launch: no program given after --");
  return args;
}

volatile sig_atomic_t g_stop_signal = 0;  // set by SIGINT / SIGTERM: stop the ranks

void on_stop_signal(int sig) { g_stop_signal = sig; }

int run(const Args& args) {
  const std::string master_addr = "127.0.0.1";
  const int port = args.master_port > 0 ? args.master_port : rd::dist::pick_free_port(master_addr);
  rd::dist::LocalLaunchOptions options;
  options.command = args.command;
  options.nprocs = args.nprocs;
  options.env = [&](int rank) {
    return rd::dist::local_rank_env(rank, args.nprocs, master_addr, port);
  };
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  options.settle = std::chrono::milliseconds(static_cast<int64_t>(args.settle_s * 1000));
  options.grace = std::chrono::milliseconds(static_cast<int64_t>(args.grace_s * 1000));
  options.on_line = [](int rank, bool is_stderr, const std::string& line) {
    std::FILE* out = is_stderr ? stderr : stdout;
    std::fprintf(out, "[rank %d] %s\n", rank, line.c_str());
    std::fflush(out);
  };
  options.should_stop = [] { return g_stop_signal != 0; };
  const rd::dist::LocalLaunchResult result = rd::dist::launch_local(options);
  if (result.ok()) return 0;
  if (result.first_failure) {
    std::fprintf(stderr, "rd_launch: rank %d failed first: it %s\n", *result.first_failure,
                 result.status_str(*result.first_failure).c_str());
  } else if (result.timed_out) {
    std::fprintf(stderr, "rd_launch: the job ran longer than --timeout-s %g; stopped every rank\n",
                 args.timeout_s);
  } else if (result.stopped) {
    std::fprintf(stderr, "rd_launch: stopped every rank on signal %d\n",
                 static_cast<int>(g_stop_signal));
  }
  for (int rank = 0; rank < args.nprocs; ++rank) {
    std::fprintf(stderr, "rd_launch: rank %d %s\n", rank, result.status_str(rank).c_str());
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    if (args.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    struct sigaction stop {};
    stop.sa_handler = on_stop_signal;
    sigemptyset(&stop.sa_mask);
    sigaction(SIGINT, &stop, nullptr);
    sigaction(SIGTERM, &stop, nullptr);
    return run(args);
  } catch (const rd::Error& e) {
    const bool usage = e.code() == rd::ErrorCode::kInvalidArgument;
    std::fprintf(stderr, "%s\n%s", e.what(), usage ? kUsage : "");
    return 2;
  }
}
