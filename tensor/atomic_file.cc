// Atomic file replacement (temporary file + fsync + rename) and whole-file reads, on POSIX.
#include "ringdilated/tensor/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/checksum.h"

namespace rd {
namespace {

// Single write()/read() calls are capped: Linux transfers at most about 2 GiB per call.
constexpr size_t kMaxChunkBytes = size_t{1} << 30;

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

[[noreturn]] void fail_io(const char* op, const std::string& what, const std::string& path,
                          int err) {
  RD_FAIL(kIo, op, ": ", what, " '", path, "': ", errno_text(err));
}

std::string folder_of(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// A file descriptor closed on scope exit; errors on that path are moot (we are failing).
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closes now and returns close()'s errno (0 on success): a failed close can mean lost data.
  int close() {
    const int result = ::close(std::exchange(fd_, -1));
    return result == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// Removes the temporary file on scope exit unless it was renamed into place.
class TemporaryPath {
 public:
  explicit TemporaryPath(std::string path) : path_(std::move(path)) {}
  ~TemporaryPath() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TemporaryPath(const TemporaryPath&) = delete;
  TemporaryPath& operator=(const TemporaryPath&) = delete;
  const std::string& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

// Creates "<path>.tmp.<pid>.<n>" exclusively. The process id and a per-process counter keep
// concurrent writers (threads or processes) to the same path from sharing a temporary file.
int create_temporary(const std::string& path, std::string* temp_path) {
  static std::atomic<uint64_t> counter{0};
  for (;;) {
    *temp_path = str_cat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
    const int fd = ::open(temp_path->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    if (errno != EEXIST) {
      fail_io("write_file_atomically", str_cat("cannot create a temporary file for '",
                                                    path, "' as"),
              *temp_path, errno);
    }
  }
}

void write_all(int fd, std::span<const uint8_t> bytes, const std::string& temp_path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const size_t chunk = std::min(bytes.size() - done, kMaxChunkBytes);
    const ssize_t written = ::write(fd, bytes.data() + done, chunk);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_io("write_file_atomically", "cannot write", temp_path, errno);
    }
    done += static_cast<size_t>(written);
  }
}


// Reads into `buffer` until it is full or the file ends; returns the bytes read.
size_t read_up_to(int fd, std::span<uint8_t> buffer, const std::string& path) {
  size_t done = 0;
  while (done < buffer.size()) {
    const size_t chunk = std::min(buffer.size() - done, kMaxChunkBytes);
    const ssize_t got = ::read(fd, buffer.data() + done, chunk);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail_io("read_whole_file", "cannot read", path, errno);
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

}  // namespace

// Makes the rename itself durable. Some file systems cannot fsync a folder (EINVAL): there
// the rename is as durable as that file system allows, which is not our error.
void sync_folder(const std::string& folder) {
  FileDescriptor dir(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) fail_io("sync_folder", "cannot open folder", folder, errno);
  if (::fsync(dir.get()) != 0 && errno != EINVAL) {
    fail_io("sync_folder", "cannot fsync folder", folder, errno);
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  RD_CHECK(!path_.empty(), kIo, "write_file_atomically: the path is empty");
  fd_ = create_temporary(path_, &temp_path_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
}

void AtomicFileWriter::write(std::span<const uint8_t> bytes) {
  RD_CHECK(fd_ >= 0, kInvalidArgument, "write_file_atomically: '", path_,
           "' was already committed");
  write_all(fd_, bytes, temp_path_);
  digest_.bytes += bytes.size();
  digest_.crc32 = crc32_update(digest_.crc32, bytes);
}

FileDigest AtomicFileWriter::commit() {
  RD_CHECK(fd_ >= 0, kInvalidArgument, "write_file_atomically: '", path_,
           "' was already committed");
  FileDescriptor file(std::exchange(fd_, -1));
  TemporaryPath temp(std::exchange(temp_path_, std::string()));
  if (::fsync(file.get()) != 0) {
    fail_io("write_file_atomically", "cannot fsync", temp.path(), errno);
  }
  if (const int err = file.close(); err != 0) {
    fail_io("write_file_atomically", "cannot close", temp.path(), err);
  }
  if (::rename(temp.path().c_str(), path_.c_str()) != 0) {
    fail_io("write_file_atomically", str_cat("cannot rename '", temp.path(), "' to"), path_,
            errno);
  }
  temp.release();
  sync_folder(folder_of(path_));
  return digest_;
}

void write_file_atomically(const std::string& path, std::span<const uint8_t> bytes) {
  AtomicFileWriter writer(path);
  writer.write(bytes);
  writer.commit();
}

std::vector<uint8_t> read_whole_file(const std::string& path) {
  // POSIX calls rather than std::ifstream: a folder opens "successfully" as a stream and
  // errno is then unreliable, while fstat tells us exactly what we opened.
  FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (file.get() < 0) fail_io("read_whole_file", "cannot open", path, errno);
  struct stat info {};
  if (::fstat(file.get(), &info) != 0) fail_io("read_whole_file", "cannot stat", path, errno);
  RD_CHECK(S_ISREG(info.st_mode), kIo, "read_whole_file: '", path, "' is not a regular file");
  std::vector<uint8_t> bytes(static_cast<size_t>(info.st_size));
  bytes.resize(read_up_to(file.get(), bytes, path));
  if (bytes.size() == static_cast<size_t>(info.st_size)) {
    // The file may have grown since fstat: append whatever follows, up to end of file.
    std::vector<uint8_t> tail(4096);
    while (const size_t got = read_up_to(file.get(), tail, path)) {
      bytes.insert(bytes.end(), tail.begin(), tail.begin() + static_cast<ptrdiff_t>(got));
    }
  }
  return bytes;
}

}  // namespace rd
