// MetricsLog: JSON Lines appended with one write() per record; resumed runs drop the lines
// written after their checkpoint.
#include "ringdilated/train/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <system_error>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/atomic_file.h"

namespace rd::train {
namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// The lines of `path` whose "step" is at most `last_step` (lines that do not parse, such as
// a torn last line, are dropped too).
std::string lines_through(const std::string& path, int64_t last_step) {
  const std::vector<uint8_t> bytes = read_whole_file(path);
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string kept, line;
  while (std::getline(in, line)) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_discarded() || !record.is_object()) continue;
    const auto step = record.find("step");
    if (step == record.end() || !step->is_number_integer() || step->get<int64_t>() > last_step) {
      continue;
    }
    kept += line + "\n";
  }
  return kept;
}

}  // namespace

MetricsLog::MetricsLog(std::string path, std::optional<int64_t> keep_through_step)
    : path_(std::move(path)) {
  RD_CHECK(!path_.empty(), kInvalidArgument, "MetricsLog: the path is empty");
  std::error_code ec;
  if (keep_through_step && std::filesystem::exists(path_, ec)) {
    const std::string kept = lines_through(path_, *keep_through_step);
    write_file_atomically(path_, std::span<const uint8_t>(
                                     reinterpret_cast<const uint8_t*>(kept.data()), kept.size()));
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
  RD_CHECK(fd_ >= 0, kIo, "MetricsLog: cannot open '", path_, "': ", errno_text(errno));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::append(const std::string& json_object) {
  RD_CHECK(json_object.find('\n') == std::string::npos, kInvalidArgument,
           "MetricsLog::append: a record must be one line");
  const std::string line = json_object + "\n";
  // One write: O_APPEND makes it atomic with respect to other appenders. A short write (a
  // full disk) is an error, not a silent half line.
  ssize_t written;
  do {
    written = ::write(fd_, line.data(), line.size());
  } while (written < 0 && errno == EINTR);
  RD_CHECK(written == static_cast<ssize_t>(line.size()), kIo, "MetricsLog: cannot append to '",
           path_, "': ", written < 0 ? errno_text(errno) : std::string("short write"));
}

}  // namespace rd::train
