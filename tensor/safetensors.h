// Reading and writing safetensors files (the format of PyTorch and Hugging Face): an 8-byte
// little-endian header length, a JSON header, then the raw little-endian tensor bytes.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ringdilated/tensor/atomic_file.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // contiguous CPU tensors
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" entry
};

// Serializes tensors (any device, any layout; written contiguous) to bytes.
std::vector<uint8_t> serialize_safetensors(const std::map<std::string, Tensor>& tensors,
                                           const std::map<std::string, std::string>& metadata = {});
// Parses bytes with full bounds checks; `source` names the input in error messages.
// Malformed input throws rd::Error(kCorruptFile).
SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes,
                                  std::string_view source = "<memory>");

// Writes atomically: a temporary file in the same folder, flushed and fsynced, then renamed
// over `path`, so a crash never leaves a half-written file. I/O failures throw kIo. Streams:
// tensors are copied to the host and written one at a time, never the whole file in
// memory. Returns the file's size and CRC-32.
FileDigest save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace rd
