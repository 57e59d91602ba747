// RunLock: an flock(2) lock on <out_dir>/rd_train.lock, the file naming the holder (process
// id, host, start time) for the message another run prints when it finds the folder busy.
#include "ringdilated/train/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ringdilated/kernels/error.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kOp = "RunLock";

struct Holder {
  int64_t pid = 0;
  std::string host;
  std::string started;  // UTC, ISO 8601
};

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// The holder the lock file names; nullopt when it is empty (a holder that has not written it
// yet) or unreadable.
std::optional<Holder> read_holder(int fd) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  if (n <= 0) return std::nullopt;
  text.resize(static_cast<size_t>(n));
  const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer()) {
    return std::nullopt;
  }
  return Holder{j["pid"].get<int64_t>(), j.value("host", "?"), j.value("started", "?")};
}

std::string describe(const Holder& h) {
  return str_cat("pid ", h.pid, " on host ", h.host, " (started ", h.started, ")");
}

bool same_file(int fd, const std::string& path) {
  struct stat open_file {}, named {};
  return ::fstat(fd, &open_file) == 0 && ::stat(path.c_str(), &named) == 0 &&
         open_file.st_dev == named.st_dev && open_file.st_ino == named.st_ino;
}

// Opens and locks `path`; throws naming the holder when it is locked.
int open_locked(const std::string& path, const std::string& folder) {
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    RD_CHECK(fd >= 0, kIo, kOp, ": cannot open the lock file '", path, "': ", std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      const std::optional<Holder> holder = read_holder(fd);
      ::close(fd);
      RD_CHECK(error == EWOULDBLOCK, kIo, kOp, ": cannot lock '", path, "': ", std::strerror(error));
      RD_FAIL(kInvalidArgument, kOp, ": out_dir '", folder, "' is in use by another run: ",
              holder ? describe(*holder) : std::string("its lock file does not name it yet"),
              "; lock file '", path, "'. Wait for that run to end, or pick another out_dir");
    }
    // The holder removes the file before it unlocks, so the file locked here may have been
    // removed after it was opened (and another run may have made a new one): try again.
    if (same_file(fd, path)) return fd;
    ::close(fd);
  }
}

// The note about an earlier holder whose lock file was left behind.
std::string takeover_note(const Holder& h, const std::string& path) {
  const bool here = h.host == this_host();
  const bool dead = here && ::kill(static_cast<pid_t>(h.pid), 0) != 0 && errno == ESRCH;
  return str_cat("took over the lock '", path, "' left by ", describe(h),
                 dead ? ", which is no longer running"
                      : ", which no longer holds it (it ended without removing the file)");
}

}  // namespace

RunLock::RunLock(const std::string& folder) : path_((fs::path(folder) / kRunLockFile).string()) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  RD_CHECK(!ec, kIo, kOp, ": cannot create folder '", folder, "': ", ec.message());
  fd_ = open_locked(path_, folder);
  if (const std::optional<Holder> earlier = read_holder(fd_)) note_ = takeover_note(*earlier, path_);
  // Written in place, not by rename: the lock belongs to this file (inode).
  const std::string text =
      Json{{"pid", static_cast<int64_t>(::getpid())}, {"host", this_host()}, {"started", utc_now()}}
          .dump() + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    const int error = errno;
    ::close(fd_);
    RD_FAIL(kIo, kOp, ": cannot write the lock file '", path_, "': ", std::strerror(error));
  }
}

RunLock::~RunLock() {
  if (same_file(fd_, path_)) ::unlink(path_.c_str());
  ::close(fd_);  // unlocks
}

}  // namespace rd::train
