// The lock of a run folder, so that one run at a time writes an out_dir: a file naming its
// holder (process id and host), locked with flock(2).
#pragma once

#include <string>

namespace rd::train {

// Holds <folder>/rd_train.lock for its lifetime. flock locks end with the process that
// holds them, so a run killed with SIGKILL leaves the file behind but not the lock: the next
// run takes it over and says so (note()). The file is opened close-on-exec, so programs a
// run starts do not keep it locked.
class RunLock {
 public:
  // Creates `folder` if missing and takes its lock. Throws rd::Error(kInvalidArgument) naming
  // the holder's process id, host and start time when another process, or another RunLock
  // of this one, holds it; kIo when the folder or the file cannot be made.
  explicit RunLock(const std::string& folder);
  // Removes the file, then unlocks it (in that order: a run waiting for the same folder then
  // makes a new file rather than locking the removed one).
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& path() const { return path_; }
  // What the lock file said about an earlier holder that no longer held the lock (a run that
  // was killed), or empty when the file was new.
  const std::string& note() const { return note_; }

 private:
  std::string path_;
  std::string note_;
  int fd_ = -1;
};

// The lock file's name in a run folder.
inline constexpr const char* kRunLockFile = "rd_train.lock";

}  // namespace rd::train
