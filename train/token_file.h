// Token corpora on disk, read through read-only memory maps: plain files as byte tokens
// (text), and RDTOK files of pre-tokenized uint16 or uint32 tokens, with the boundaries of
// the documents packed in them.
//
// RDTOK layout (all integers little-endian):
//   offset  0: magic "RDTOK\0\0\0" (8 bytes)
//   offset  8: uint32 version: 1 (no document table) or 2
//   offset 12: uint32 bytes per token: 2 (uint16) or 4 (uint32)
//   offset 16: uint64 token count
//   offset 24: uint64 vocab size (every token is below it)
//   version 1: offset 32: count tokens; the file ends right after them (one document).
//   version 2: offset 32: uint64 document count D (>= 1); offset 40: count tokens; then D
//              uint64 document starts (token indices, the first 0, strictly increasing,
//              below count); the file ends right after them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace rd::train {

inline constexpr std::string_view kTokenFileMagic{"RDTOK\0\0\0", 8};
inline constexpr uint32_t kTokenFileVersion = 1;           // without documents
inline constexpr uint32_t kTokenFileDocumentsVersion = 2;  // with a document table
inline constexpr int64_t kTokenFileHeaderBytes = 32;       // version 1's; version 2's is 40

// The stored width of a token; the value is its size in bytes.
enum class TokenDType : uint32_t { kUInt16 = 2, kUInt32 = 4 };

// Writes `tokens` as an RDTOK file, atomically (readers see the old file or the whole new
// one): version 1 when `document_starts` is empty, else version 2 with that table. dtype
// defaults to uint16 when vocab_size <= 65536, else uint32. Throws
// rd::Error(kInvalidArgument) for a token outside [0, vocab_size), a vocab_size the dtype
// cannot hold or document starts that are not 0, then strictly increasing below the token
// count; kIo when the file cannot be written.
void write_token_file(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size,
                      std::optional<TokenDType> dtype = std::nullopt,
                      std::span<const int64_t> document_starts = {});

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

// A read-only sequence of tokens on disk, from one file or several read one after another:
// text files (one token per byte, the byte tokenizer's vocabulary) or RDTOK files. Each file
// is a document, or the documents of its RDTOK table. Reads check every token against
// vocab_size.
class TokenSource {
 public:
  // Text files in order; an empty one adds nothing. Throws rd::Error(kIo) for a missing or
  // unreadable file, kInvalidArgument when no paths are given or they hold no bytes at all.
  static TokenSource open_text(const std::vector<std::string>& paths);
  static TokenSource open_text(const std::string& path) {
    return open_text(std::vector<std::string>{path});
  }
  // RDTOK files in order, one vocabulary. Throws rd::Error(kIo) as above; kCorruptFile for a
  // truncated header, a wrong magic, an unknown version or dtype, a size that disagrees with
  // the header or a bad document table; kInvalidArgument for an empty file or files whose
  // vocabulary sizes differ.
  static TokenSource open_token_files(const std::vector<std::string>& paths);
  static TokenSource open_token_file(const std::string& path) {
    return open_token_files(std::vector<std::string>{path});
  }

  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  // Whether the tokens are the bytes of text files (open_text).
  bool is_text() const { return text_; }
  // The first file's path, and how many more there are: for messages.
  std::string path() const;
  // Where documents start (token indices, the first 0, strictly increasing): each file's
  // first token and its RDTOK table's starts.
  const std::vector<int64_t>& document_starts() const { return document_starts_; }
  // Copies tokens [begin, begin + out.size()) into out. Throws rd::Error(kOutOfRange) for a
  // range past the end, kCorruptFile for a stored token >= vocab_size.
  void read(int64_t begin, std::span<int32_t> out) const;

 private:
  // One file's tokens: `count` of them, `bytes_per_token` each from byte `offset`; they are
  // tokens [first, first + count) of the source.
  struct Part {
    std::shared_ptr<const MappedFile> file;
    int64_t offset = 0;
    int64_t first = 0;
    int64_t count = 0;
    int bytes_per_token = 1;
  };
  TokenSource(std::vector<Part> parts, int64_t vocab_size, std::vector<int64_t> document_starts,
              bool text);
  void read_part(const Part& part, int64_t begin, std::span<int32_t> out) const;

  std::vector<Part> parts_;  // in order, non-empty
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  std::vector<int64_t> document_starts_;
  bool text_ = false;
};

}  // namespace rd::train
