// launch_local (see local_launch.h): fork/exec per rank with two pipes each, one poll(2) loop
// that forwards lines and reaps children, and a stop sequence (SIGTERM to each rank's process
// group, SIGKILL after the grace period).
#include "ringdilated/dist/local_launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "ringdilated/kernels/error.h"

extern char** environ;

namespace rd::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How long output is still read after every rank exited: a rank's own children may keep its
// pipes open, and they must not keep the launcher waiting.
constexpr milliseconds kDrainAfterExit{1000};

// This process's environment with `overrides` applied, as "NAME=value" strings.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [name, value] : overrides) vars[name] = value;
  std::vector<std::string> out;
  for (const auto& [name, value] : vars) out.push_back(name + "=" + value);
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// One output stream of one rank: the read end of its pipe and the partial line so far.
struct Stream {
  int rank = 0;
  bool is_stderr = false;
  int fd = -1;
  std::string partial;
};

struct Child {
  pid_t pid = -1;
  bool running = true;
  int status = 0;
  int open_streams = 2;
  // When both its streams reached end of file, as an order among the ranks: a process closes
  // its files as it starts to exit, so this orders exits that one reaping sweep finds together.
  uint64_t output_ended = std::numeric_limits<uint64_t>::max();
};

// The file `program` names: itself when it has a slash, else the first executable of that
// name in PATH (found before fork, since the child may only make async-signal-safe calls),
// else itself (exec then fails with ENOENT, which the child reports).
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  while (begin <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', begin), dirs.size());
    const std::string dir = end > begin ? dirs.substr(begin, end - begin) : ".";
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    begin = end + 1;
  }
  return program;
}

// Forks a rank: its stdout and stderr go to the write ends given, stdin is /dev/null, it
// leads its own process group, and it receives SIGKILL when the launcher dies.
pid_t spawn(std::vector<std::string> argv, std::vector<std::string> envp, int out_fd, int err_fd) {
  std::string file = resolve_program(argv[0]);
  std::vector<char*> c_argv = c_strings(argv);
  std::vector<char*> c_envp = c_strings(envp);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  RD_CHECK(pid >= 0, kIo, "launch_local: fork failed: ", std::strerror(errno));
  if (pid > 0) {
    ::setpgid(pid, pid);  // as the child does: whichever runs first, a stop finds the group
    return pid;
  }
  // The child: only async-signal-safe calls until exec.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(126);  // the launcher died before prctl took effect
  ::setpgid(0, 0);
  const int null_fd = ::open("/dev/null", O_RDONLY);
  ::dup2(null_fd, 0);
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  ::execve(file.c_str(), c_argv.data(), c_envp.data());
  const char* reason = std::strerror(errno);
  const char prefix[] = "launch_local: cannot run ";
  (void)!::write(2, prefix, sizeof(prefix) - 1);
  (void)!::write(2, c_argv[0], std::strlen(c_argv[0]));
  (void)!::write(2, ": ", 2);
  (void)!::write(2, reason, std::strlen(reason));
  (void)!::write(2, "\n", 1);
  ::_exit(127);
}

class Job {
 public:
  explicit Job(const LocalLaunchOptions& options) : options_(options) {}
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // After an exception (a failed start, a throwing on_line) ranks may still run: none outlives
  // the job.
  ~Job() {
    for (Child& c : children_) {
      if (!c.running) continue;
      ::kill(-c.pid, SIGKILL);
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &c.status, 0);
    }
    for (Stream& s : streams_) {
      if (s.fd >= 0) ::close(s.fd);
    }
  }

  LocalLaunchResult run() {
    start();
    const Clock::time_point start_time = Clock::now();
    std::optional<Clock::time_point> all_exited;
    while (!streams_.empty() || running() > 0) {
      poll_streams();
      reap();
      if (options_.timeout.count() > 0 && Clock::now() - start_time > options_.timeout &&
          !result_.timed_out && running() > 0) {
        result_.timed_out = true;
        stop();
      }
      if (options_.should_stop && !result_.stopped && running() > 0 && options_.should_stop()) {
        result_.stopped = true;
        stop();
      }
      if (stop_at_ && Clock::now() >= *stop_at_) stop();
      if (kill_at_ && Clock::now() >= *kill_at_) signal_running(SIGKILL);
      if (running() == 0) {
        if (!all_exited) all_exited = Clock::now();
        if (Clock::now() - *all_exited > kDrainAfterExit) break;
      }
    }
    for (Stream& s : streams_) close_stream(s);
    for (const Child& c : children_) result_.wait_statuses.push_back(c.status);
    return result_;
  }

 private:
  void start() {
    for (int rank = 0; rank < options_.nprocs; ++rank) {
      int out[2], err[2];
      RD_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0, kIo,
               "launch_local: pipe failed: ", std::strerror(errno));
      std::vector<std::pair<std::string, std::string>> env;
      if (options_.env) env = options_.env(rank);
      const pid_t pid = spawn(options_.command, child_environment(env), out[1], err[1]);
      ::close(out[1]);
      ::close(err[1]);
      children_.emplace_back().pid = pid;
      streams_.push_back(Stream{rank, false, out[0], {}});
      streams_.push_back(Stream{rank, true, err[0], {}});
    }
  }

  int running() const {
    return static_cast<int>(std::count_if(children_.begin(), children_.end(),
                                          [](const Child& c) { return c.running; }));
  }

  // Reads whatever the ranks wrote (waiting up to 50 ms for something) and forwards lines.
  void poll_streams() {
    if (streams_.empty()) {
      std::this_thread::sleep_for(milliseconds(50));
      return;
    }
    std::vector<pollfd> fds;
    for (const Stream& s : streams_) fds.push_back({s.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 50);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) read_stream(streams_[i]);
    }
    streams_.erase(
        std::remove_if(streams_.begin(), streams_.end(), [](const Stream& s) { return s.fd < 0; }),
        streams_.end());
  }

  void read_stream(Stream& s) {
    char buffer[65536];
    const ssize_t n = ::read(s.fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) return;
    if (n <= 0) {
      close_stream(s);
      return;
    }
    s.partial.append(buffer, static_cast<size_t>(n));
    size_t newline;
    while ((newline = s.partial.find('\n')) != std::string::npos) {
      emit(s, s.partial.substr(0, newline));
      s.partial.erase(0, newline + 1);
    }
  }

  void close_stream(Stream& s) {
    if (s.fd < 0) return;
    if (!s.partial.empty()) emit(s, s.partial);  // a last line without its newline
    s.partial.clear();
    ::close(s.fd);
    s.fd = -1;
    Child& c = children_[static_cast<size_t>(s.rank)];
    if (--c.open_streams == 0) c.output_ended = next_output_end_++;
  }

  void emit(const Stream& s, const std::string& line) {
    if (options_.on_line) options_.on_line(s.rank, s.is_stderr, line);
  }

  // Collects exited ranks; the first that failed stops the others. A rank whose failure
  // makes another fail moments later (its peers' connections break) may be found exited in
  // the same sweep as that one (it becomes reapable only after its output closed): the one
  // whose output ended first failed first.
  void reap() {
    std::optional<size_t> first;
    for (size_t rank = 0; rank < children_.size(); ++rank) {
      Child& c = children_[rank];
      if (!c.running || ::waitpid(c.pid, &c.status, WNOHANG) != c.pid) continue;
      c.running = false;
      const bool failed = !WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0;
      if (failed && (!first || c.output_ended < children_[*first].output_ended)) first = rank;
    }
    if (first && !stopping_ && !stop_at_) {
      result_.first_failure = static_cast<int>(*first);
      stop_at_ = Clock::now() + options_.settle;
    }
  }

  void stop() {
    if (stopping_) return;
    stopping_ = true;
    signal_running(SIGTERM);
    kill_at_ = Clock::now() + options_.grace;
  }

  // To each running rank's process group, so that its own children get it too.
  void signal_running(int sig) {
    for (const Child& c : children_) {
      if (c.running && ::kill(-c.pid, sig) != 0) ::kill(c.pid, sig);
    }
  }

  const LocalLaunchOptions& options_;
  std::vector<Child> children_;
  std::vector<Stream> streams_;
  LocalLaunchResult result_;
  uint64_t next_output_end_ = 0;
  bool stopping_ = false;
  std::optional<Clock::time_point> stop_at_;  // a rank failed: stop the others then
  std::optional<Clock::time_point> kill_at_;  // SIGKILL what SIGTERM left
};

}  // namespace

bool LocalLaunchResult::ok() const {
  return std::all_of(wait_statuses.begin(), wait_statuses.end(),
                     [](int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; });
}

std::string LocalLaunchResult::status_str(int rank) const {
  const int status = wait_statuses.at(static_cast<size_t>(rank));
  if (WIFEXITED(status)) return str_cat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return str_cat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                   ")");
  }
  return str_cat("ended with wait status ", status);
}

LocalLaunchResult launch_local(const LocalLaunchOptions& options) {
  RD_CHECK(!options.command.empty(), kInvalidArgument, "launch_local: no command given");
  RD_CHECK(options.nprocs >= 1, kInvalidArgument,
           "launch_local: option 'nprocs' must be >= 1, got ", options.nprocs);
  RD_CHECK(
      options.grace.count() >= 0 && options.timeout.count() >= 0 && options.settle.count() >= 0,
      kInvalidArgument, "launch_local: options 'grace', 'settle' and 'timeout' must not be ",
      "negative");
  return Job(options).run();
}

namespace {

// The first port of the kernel's ephemeral range (ports it hands to bind(:0) and to the source
// side of outgoing connections); 32768, Linux's default, where it cannot be read.
int ephemeral_port_floor() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  return range >> low && low > 0 ? low : 32768;
}

// Binds `port` (0: the kernel's pick) on `addr` as the store will (SO_REUSEADDR) and returns
// the bound port, or 0 and errno set when it cannot.
int try_bind(sockaddr_in addr, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  errno = err;
  return ok ? ntohs(addr.sin_port) : 0;
}

}  // namespace

int pick_free_port(const std::string& host) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  RD_CHECK(::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1, kInvalidArgument,
           "pick_free_port: '", host, "' is not an IPv4 address");
  // The port is free only until someone binds it, and the store binds it later, in another
  // process. A port the kernel picked (bind :0) comes from the ephemeral range, where any
  // outgoing connection (Gloo's pairs, another test) may take it as its source port in
  // between: CI saw exactly that. So pick at random below that range, where only explicit
  // binds land, and let the kernel pick only if every try there is taken.
  const int floor = ephemeral_port_floor();
  const int low = std::max(1024, floor - 12000);
  if (floor - low >= 1000) {
    std::mt19937 random(std::random_device{}());
    std::uniform_int_distribution<int> candidate(low, floor - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      if (const int port = try_bind(addr, candidate(random)); port > 0) return port;
    }
  }
  const int port = try_bind(addr, 0);
  RD_CHECK(port > 0, kIo, "pick_free_port: cannot bind ", host, ":0: ", std::strerror(errno));
  return port;
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::vector<std::pair<std::string, std::string>> local_rank_env(int rank, int nprocs,
                                                                const std::string& master_addr,
                                                                int master_port) {
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(nprocs)},
      {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(nprocs)},
      {"MASTER_ADDR", master_addr},         {"MASTER_PORT", std::to_string(master_port)}};
  // A rank's CPU work (OpenMP and OpenBLAS) takes every core by default: n ranks would run n
  // threads a core, each waiting on the others. The launcher's own OMP_NUM_THREADS is kept.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    env.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1, available_cores() / nprocs)));
  }
  return env;
}

}  // namespace rd::dist
