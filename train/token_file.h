// Token corpora on disk, read through read-only memory maps: plain files as byte tokens
// (text), and RDTOK files of pre-tokenized uint16 or uint32 tokens.
//
// RDTOK layout (all integers little-endian), 32 header bytes, then the tokens:
//   offset  0: magic "RDTOK\0\0\0" (8 bytes)
//   offset  8: uint32 version (1)
//   offset 12: uint32 bytes per token: 2 (uint16) or 4 (uint32)
//   offset 16: uint64 token count
//   offset 24: uint64 vocab size (every token is below it)
//   offset 32: count tokens; the file ends right after them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace rd::train {

inline constexpr std::string_view kTokenFileMagic{"RDTOK\0\0\0", 8};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 32;

// The stored width of a token; the value is its size in bytes.
enum class TokenDType : uint32_t { kUInt16 = 2, kUInt32 = 4 };

// Writes `tokens` as an RDTOK file, atomically (readers see the old file or the whole new
// one). dtype defaults to uint16 when vocab_size <= 65536, else uint32. Throws
// rd::Error(kInvalidArgument) for a token outside [0, vocab_size) or a vocab_size the dtype
// cannot hold, kIo when the file cannot be written.
void write_token_file(const std::string& path, std::span<const int32_t> tokens,
                      int64_t vocab_size, std::optional<TokenDType> dtype = std::nullopt);

// A whole regular file mapped read-only; unmapped when the last owner goes.
class MappedFile {
 public:
  // `what` names the caller in errors ("text dataset"). Throws rd::Error(kIo) when the
  // file is missing, unreadable or not a regular file. An empty file maps to no bytes.
  MappedFile(const std::string& path, std::string_view what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A read-only sequence of tokens on disk: a text file (one token per byte, the byte
// tokenizer's vocabulary) or an RDTOK file. Reads check every token against vocab_size.
class TokenSource {
 public:
  // Throws rd::Error(kIo) for a missing or unreadable file, kInvalidArgument for an empty one.
  static TokenSource open_text(const std::string& path);
  // Throws rd::Error(kIo) as above and kCorruptFile for a truncated header, a wrong magic,
  // an unknown version or dtype, or a size that disagrees with the header's count.
  static TokenSource open_token_file(const std::string& path);

  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  const std::string& path() const { return file_->path(); }
  // Copies tokens [begin, begin + out.size()) into out. Throws rd::Error(kOutOfRange) for a
  // range past the end, kCorruptFile for a stored token >= vocab_size.
  void read(int64_t begin, std::span<int32_t> out) const;

 private:
  TokenSource(std::shared_ptr<const MappedFile> file, int64_t offset, int64_t count,
              int bytes_per_token, int64_t vocab_size);

  std::shared_ptr<const MappedFile> file_;
  int64_t offset_;  // bytes before the first token
  int64_t count_;
  int bytes_per_token_;
  int64_t vocab_size_;
};

}  // namespace rd::train
