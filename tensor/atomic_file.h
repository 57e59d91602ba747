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

// Reads a whole regular file.
std::vector<uint8_t> read_whole_file(const std::string& path);

}  // namespace rd
