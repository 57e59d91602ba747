// A sampling profiler of the host for machines without perf: preloaded into any program, it
// takes a backtrace of the running thread every millisecond of CPU time (or of the main thread
// every millisecond of wall time) and writes them, with the process's memory map, at exit,
// for tools/host_profile.py to symbolize and sum.
//
//   LD_PRELOAD=librd_host_sampler.so RD_HOST_SAMPLES=samples.txt rd_train ...
//
// RD_HOST_SAMPLE_CLOCK=wall samples the main thread every millisecond of wall time instead,
// blocked or not: where it waits (a synchronization, a full launch queue) shows too.
// Only the program named by RD_HOST_SAMPLE_PROGRAM (default rd_train) samples, so wrappers
// that the preload reaches too (timeout, rd_launch) run untouched. Under rd_launch (RANK and
// WORLD_SIZE > 1 set) rank r writes samples.txt.rank<r>.
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace {

constexpr int kDepth = 48;
constexpr size_t kMaxSamples = size_t{1} << 18;  // 4.4 minutes of CPU time at 1 kHz
constexpr int kIntervalUs = 1000;

struct Sample {
  int64_t time_ns;  // CLOCK_MONOTONIC
  int depth;
  void* frames[kDepth];
};

Sample* g_samples = nullptr;  // preallocated: the handler must not allocate
std::atomic<size_t> g_count{0};
std::string* g_path = nullptr;

timer_t g_wall_timer = nullptr;  // RD_HOST_SAMPLE_CLOCK=wall
bool g_wall = false;

void stop_timer() {
  itimerval off{};
  setitimer(ITIMER_PROF, &off, nullptr);
  if (g_wall_timer != nullptr) timer_delete(g_wall_timer);
  g_wall_timer = nullptr;
}

// A monotonic timer that signals the calling (main) thread itself: ITIMER_REAL would signal
// whichever thread the kernel picks. Such timers do not survive exec.
bool start_wall_timer() {
  sigevent event{};
  event.sigev_notify = SIGEV_THREAD_ID;
  event.sigev_signo = SIGPROF;
  event._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
  if (timer_create(CLOCK_MONOTONIC, &event, &g_wall_timer) != 0) return false;
  const itimerspec every{{0, kIntervalUs * 1000}, {0, kIntervalUs * 1000}};
  return timer_settime(g_wall_timer, 0, &every, nullptr) == 0;
}

// backtrace() is not async-signal-safe on its first call (it loads libgcc's unwinder); the
// constructor makes that call, so the handler only walks frames into preallocated memory.
void on_profiling_signal(int) {
  const size_t index = g_count.fetch_add(1, std::memory_order_relaxed);
  if (index >= kMaxSamples) return;
  Sample& sample = g_samples[index];
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  sample.time_ns = int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
  sample.depth = backtrace(sample.frames, kDepth);
}

// One line per sample (its time in ns, then hex return addresses, innermost first), then the
// memory map, so that addresses can be turned into (module, offset) and symbolized on
// another machine.
void write_samples() {
  stop_timer();
  const size_t count = std::min(g_count.load(), kMaxSamples);
  const std::string temporary = *g_path + ".tmp";
  FILE* out = std::fopen(temporary.c_str(), "w");
  if (out == nullptr) return;
  std::fprintf(out, "# samples %zu interval_us %d clock %s\n", count, kIntervalUs,
               g_wall ? "wall" : "cpu");
  for (size_t i = 0; i < count; ++i) {
    std::fprintf(out, "%lld ", static_cast<long long>(g_samples[i].time_ns));
    for (int f = 0; f < g_samples[i].depth; ++f) std::fprintf(out, "%p ", g_samples[i].frames[f]);
    std::fputc('\n', out);
  }
  std::fprintf(out, "# maps\n");
  if (FILE* maps = std::fopen("/proc/self/maps", "r")) {
    char line[4096];
    while (std::fgets(line, sizeof line, maps)) std::fputs(line, out);
    std::fclose(maps);
  }
  const bool ok = std::fclose(out) == 0 && std::rename(temporary.c_str(), g_path->c_str()) == 0;
  std::fprintf(stderr, "rd_host_sampler: %s %zu samples to %s\n", ok ? "wrote" : "FAILED writing",
               count, g_path->c_str());
}

// Whether this process runs the program to sample (the file name of /proc/self/exe).
bool is_sampled_program() {
  const char* wanted = std::getenv("RD_HOST_SAMPLE_PROGRAM");
  char exe[4096];
  const ssize_t length = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (length <= 0) return false;
  exe[length] = '\0';
  const char* name = std::strrchr(exe, '/');
  return std::strcmp(name ? name + 1 : exe, wanted ? wanted : "rd_train") == 0;
}

__attribute__((constructor)) void start_sampling() {
  const char* path = std::getenv("RD_HOST_SAMPLES");
  if (path == nullptr || *path == '\0' || !is_sampled_program()) return;
  g_path = new std::string(path);
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::strcmp(world, "1") != 0) {
    *g_path += std::string(".rank") + rank;
  }
  g_samples = static_cast<Sample*>(std::calloc(kMaxSamples, sizeof(Sample)));
  void* warm[2];
  backtrace(warm, 2);
  struct sigaction action {};
  action.sa_handler = on_profiling_signal;
  action.sa_flags = SA_RESTART;
  sigaction(SIGPROF, &action, nullptr);
  const char* clock = std::getenv("RD_HOST_SAMPLE_CLOCK");
  if (clock != nullptr && std::strcmp(clock, "wall") == 0) {
    g_wall = true;
    if (!start_wall_timer()) std::fprintf(stderr, "rd_host_sampler: timer_create failed\n");
  } else {
    itimerval every{{0, kIntervalUs}, {0, kIntervalUs}};
    setitimer(ITIMER_PROF, &every, nullptr);
  }
  std::atexit(write_samples);
}

}  // namespace

// An interval timer outlives execve while the handler does not: a sampled program that
// executes itself again (rd_train does, to set its threads' environment) would die of the
// first SIGPROF before the new image's constructor runs. The timer stops first.
extern "C" int execv(const char* path, char* const argv[]) {
  stop_timer();
  using Execv = int (*)(const char*, char* const[]);
  static const auto real = reinterpret_cast<Execv>(dlsym(RTLD_NEXT, "execv"));
  return real(path, argv);
}

extern "C" int execve(const char* path, char* const argv[], char* const envp[]) {
  stop_timer();
  using Execve = int (*)(const char*, char* const[], char* const[]);
  static const auto real = reinterpret_cast<Execve>(dlsym(RTLD_NEXT, "execve"));
  return real(path, argv, envp);
}
