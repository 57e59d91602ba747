// Whole-file I/O for serialization: crash-safe atomic writes and whole-file reads.
// Failures throw rd::Error(kIo) naming the path and the system's reason.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace rd {

// Replaces `path` with `bytes` so that readers (and a crash) see either the old file or the
// complete new one, never a mix: writes a temporary file in the same folder, fsyncs it,
// renames it over `path` and fsyncs the folder. On failure the temporary file is removed.
// The new file gets the default permissions (0666 masked by the umask).
void write_file_atomically(const std::string& path, std::span<const uint8_t> bytes);

// The size and CRC-32 (tensor/checksum.h) of a file written by AtomicFileWriter.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

// write_file_atomically for content produced piece by piece (a checkpoint streamed tensor by
// tensor, never whole in memory): write() appends to a temporary file in `path`'s folder,
// commit() fsyncs it, renames it over `path` and fsyncs the folder. Destroyed uncommitted
// (an error on the way), it removes the temporary file and leaves `path` as it was.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(std::span<const uint8_t> bytes);
  // Makes the file durable under its name and returns what was written. Once only.
  FileDigest commit();

 private:
  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  FileDigest digest_;
};

// fsyncs a folder, making the renames and creations inside it durable (a no-op on file
// systems that cannot fsync a folder).
void sync_folder(const std::string& folder);

// Reads a whole regular file.
std::vector<uint8_t> read_whole_file(const std::string& path);

}  // namespace rd
