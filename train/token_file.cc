// RDTOK reading and writing, and read-only memory maps. Integers are assembled byte by byte
// as little-endian, so files read the same on any host.
#include "ringdilated/train/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/atomic_file.h"
#include "ringdilated/train/tokenizer.h"

namespace rd::train {
namespace {

constexpr int64_t kVersionOffset = 8;
constexpr int64_t kDTypeOffset = 12;
constexpr int64_t kCountOffset = 16;
constexpr int64_t kVocabOffset = 24;
constexpr int64_t kMaxUInt16Vocab = int64_t{1} << 16;
// Tokens reach the trainer as int32, so a larger vocabulary could not be represented.
constexpr int64_t kMaxVocab = int64_t{std::numeric_limits<int32_t>::max()} + 1;

uint64_t load_le(const uint8_t* bytes, int width) {
  uint64_t value = 0;
  for (int i = width - 1; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

void store_le(uint64_t value, int width, std::vector<uint8_t>& out) {
  for (int i = 0; i < width; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

// The file descriptor of an open, closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

MappedFile::MappedFile(const std::string& path, std::string_view what) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  RD_CHECK(fd.get() >= 0, kIo, what, ": cannot open '", path, "': ", std::strerror(errno));
  struct stat info {};
  RD_CHECK(::fstat(fd.get(), &info) == 0, kIo, what, ": cannot stat '", path, "': ",
           std::strerror(errno));
  RD_CHECK(S_ISREG(info.st_mode), kIo, what, ": '", path, "' is not a regular file");
  size_ = static_cast<size_t>(info.st_size);
  if (size_ == 0) return;  // mmap refuses length 0; an empty file is just no bytes
  void* data = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  RD_CHECK(data != MAP_FAILED, kIo, what, ": cannot map '", path, "' (", size_, " bytes): ",
           std::strerror(errno));
  data_ = static_cast<const uint8_t*>(data);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void write_token_file(const std::string& path, std::span<const int32_t> tokens,
                      int64_t vocab_size, std::optional<TokenDType> dtype) {
  RD_CHECK(vocab_size > 0 && vocab_size <= kMaxVocab, kInvalidArgument,
           "write_token_file: vocab_size must be in [1, ", kMaxVocab, "], got ", vocab_size);
  const TokenDType type =
      dtype.value_or(vocab_size <= kMaxUInt16Vocab ? TokenDType::kUInt16 : TokenDType::kUInt32);
  RD_CHECK(type == TokenDType::kUInt16 || type == TokenDType::kUInt32, kInvalidArgument,
           "write_token_file: unknown dtype ", static_cast<uint32_t>(type));
  RD_CHECK(type != TokenDType::kUInt16 || vocab_size <= kMaxUInt16Vocab, kInvalidArgument,
           "write_token_file: vocab_size ", vocab_size, " does not fit uint16 tokens (at most ",
           kMaxUInt16Vocab, ")");
  const int width = static_cast<int>(type);
  std::vector<uint8_t> bytes(kTokenFileMagic.begin(), kTokenFileMagic.end());
  bytes.reserve(kTokenFileHeaderBytes + tokens.size() * width);
  store_le(kTokenFileVersion, 4, bytes);
  store_le(static_cast<uint32_t>(type), 4, bytes);
  store_le(tokens.size(), 8, bytes);
  store_le(static_cast<uint64_t>(vocab_size), 8, bytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    RD_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, kInvalidArgument,
             "write_token_file: token ", i, " is ", tokens[i], ", outside [0, ", vocab_size, ")");
    store_le(static_cast<uint32_t>(tokens[i]), width, bytes);
  }
  write_file_atomically(path, bytes);
}

TokenSource::TokenSource(std::shared_ptr<const MappedFile> file, int64_t offset, int64_t count,
                         int bytes_per_token, int64_t vocab_size)
    : file_(std::move(file)),
      offset_(offset),
      count_(count),
      bytes_per_token_(bytes_per_token),
      vocab_size_(vocab_size) {}

TokenSource TokenSource::open_text(const std::string& path) {
  auto file = std::make_shared<const MappedFile>(path, "text dataset");
  const int64_t size = static_cast<int64_t>(file->bytes().size());
  RD_CHECK(size > 0, kInvalidArgument, "text dataset: '", path, "' is empty");
  return TokenSource(std::move(file), 0, size, 1, ByteTokenizer::kVocabSize);
}

TokenSource TokenSource::open_token_file(const std::string& path) {
  auto file = std::make_shared<const MappedFile>(path, "token file");
  const std::span<const uint8_t> bytes = file->bytes();
  const int64_t size = static_cast<int64_t>(bytes.size());
  RD_CHECK(size >= kTokenFileHeaderBytes, kCorruptFile, "token file: '", path,
           "' has a truncated header (", size, " bytes, the header is ", kTokenFileHeaderBytes,
           ")");
  RD_CHECK(std::memcmp(bytes.data(), kTokenFileMagic.data(), kTokenFileMagic.size()) == 0,
           kCorruptFile, "token file: '", path, "' has the wrong magic (not an RDTOK file)");
  const uint64_t version = load_le(bytes.data() + kVersionOffset, 4);
  RD_CHECK(version == kTokenFileVersion, kCorruptFile, "token file: '", path,
           "' has version ", version, "; this build reads version ", kTokenFileVersion);
  const uint64_t width = load_le(bytes.data() + kDTypeOffset, 4);
  RD_CHECK(width == static_cast<uint32_t>(TokenDType::kUInt16) ||
               width == static_cast<uint32_t>(TokenDType::kUInt32),
           kCorruptFile, "token file: '", path, "' has token width ", width,
           " bytes; expected 2 (uint16) or 4 (uint32)");
  const uint64_t count = load_le(bytes.data() + kCountOffset, 8);
  const uint64_t vocab = load_le(bytes.data() + kVocabOffset, 8);
  RD_CHECK(vocab > 0 && vocab <= static_cast<uint64_t>(kMaxVocab), kCorruptFile, "token file: '",
           path, "' has vocab size ", vocab, "; expected 1 to ", kMaxVocab);
  const uint64_t data_bytes = static_cast<uint64_t>(size - kTokenFileHeaderBytes);
  RD_CHECK(count <= data_bytes / width && count * width == data_bytes, kCorruptFile,
           "token file: '", path, "' holds ", data_bytes, " data bytes, but its header says ",
           count, " tokens of ", width, " bytes");
  RD_CHECK(count > 0, kInvalidArgument, "token file: '", path, "' holds no tokens");
  return TokenSource(std::move(file), kTokenFileHeaderBytes, static_cast<int64_t>(count),
                     static_cast<int>(width), static_cast<int64_t>(vocab));
}

void TokenSource::read(int64_t begin, std::span<int32_t> out) const {
  const int64_t count = static_cast<int64_t>(out.size());
  RD_CHECK(begin >= 0 && begin <= count_ - count, kOutOfRange, "TokenSource::read: tokens [",
           begin, ", ", begin + count, ") of '", path(), "' are outside [0, ", count_, ")");
  const uint8_t* data = file_->bytes().data() + offset_ + begin * bytes_per_token_;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t token = load_le(data + i * bytes_per_token_, bytes_per_token_);
    RD_CHECK(token < static_cast<uint64_t>(vocab_size_), kCorruptFile, "token file: '", path(),
             "' holds token ", token, " at position ", begin + i, ", outside its vocab size ",
             vocab_size_);
    out[i] = static_cast<int32_t>(token);
  }
}

}  // namespace rd::train
