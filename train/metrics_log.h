// The metrics file of a run: JSON Lines, one object per record, appended line by line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace rd::train {

// Appends records to a JSON Lines file. Each record goes out in one write() to a file opened
// with O_APPEND, so a reader (or a crash) sees whole lines only, and a line is on disk
// before the next step starts. Records carry an integer "step".
class MetricsLog {
 public:
  // Opens `path` (created if missing). With `keep_through_step` (a run resumed from that
  // step's checkpoint), the lines of later steps, written by the run being resumed after its
  // checkpoint, are dropped first (the file is rewritten atomically), so the resumed run's
  // records follow on without duplicates.
  explicit MetricsLog(std::string path, std::optional<int64_t> keep_through_step = {});
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Appends `json_object` (one JSON object, no newline) as a line.
  void append(const std::string& json_object);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace rd::train
