// RDTOK reading and writing, and read-only memory maps. Integers are assembled byte by byte
// as little-endian, so files read the same on any host.
#include "ringdilated/train/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
constexpr int64_t kDocumentCountOffset = 32;   // version 2
constexpr int64_t kDocumentsHeaderBytes = 40;  // version 2
constexpr int64_t kDocumentStartBytes = 8;
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

// Throws unless `starts` is empty or 0, then strictly increasing below `count`; `what`
// names the caller and the file.
void check_document_starts(std::span<const int64_t> starts, int64_t count, const std::string& what,
                           ErrorCode code) {
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t low = i == 0 ? 0 : starts[i - 1] + 1;
    const int64_t high = i == 0 ? 0 : count - 1;
    if (starts[i] < low || starts[i] > high) {
      throw Error(code, str_cat(what, ": document start ", i, " is ", starts[i],
                                "; starts must be 0, then strictly increasing below the token "
                                "count ",
                                count));
    }
  }
}

}  // namespace

MappedFile::MappedFile(const std::string& path, std::string_view what) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  RD_CHECK(fd.get() >= 0, kIo, what, ": cannot open '", path, "': ", std::strerror(errno));
  struct stat info {};
  RD_CHECK(::fstat(fd.get(), &info) == 0, kIo, what, ": cannot stat '", path,
           "': ", std::strerror(errno));
  RD_CHECK(S_ISREG(info.st_mode), kIo, what, ": '", path, "' is not a regular file");
  size_ = static_cast<size_t>(info.st_size);
  if (size_ == 0) return;  // mmap refuses length 0; an empty file is just no bytes
  void* data = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  RD_CHECK(data != MAP_FAILED, kIo, what, ": cannot map '", path, "' (", size_,
           " bytes): ", std::strerror(errno));
  data_ = static_cast<const uint8_t*>(data);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void write_token_file(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size,
                      std::optional<TokenDType> dtype, std::span<const int64_t> document_starts) {
  RD_CHECK(vocab_size > 0 && vocab_size <= kMaxVocab, kInvalidArgument,
           "write_token_file: vocab_size must be in [1, ", kMaxVocab, "], got ", vocab_size);
  const TokenDType type =
      dtype.value_or(vocab_size <= kMaxUInt16Vocab ? TokenDType::kUInt16 : TokenDType::kUInt32);
  RD_CHECK(type == TokenDType::kUInt16 || type == TokenDType::kUInt32, kInvalidArgument,
           "write_token_file: unknown dtype ", static_cast<uint32_t>(type));
  RD_CHECK(type != TokenDType::kUInt16 || vocab_size <= kMaxUInt16Vocab, kInvalidArgument,
           "write_token_file: vocab_size ", vocab_size, " does not fit uint16 tokens (at most ",
           kMaxUInt16Vocab, ")");
  check_document_starts(document_starts, static_cast<int64_t>(tokens.size()), "write_token_file",
                        ErrorCode::kInvalidArgument);
  const bool with_documents = !document_starts.empty();
  const int width = static_cast<int>(type);
  std::vector<uint8_t> bytes(kTokenFileMagic.begin(), kTokenFileMagic.end());
  bytes.reserve(kDocumentsHeaderBytes + tokens.size() * width +
                document_starts.size() * kDocumentStartBytes);
  store_le(with_documents ? kTokenFileDocumentsVersion : kTokenFileVersion, 4, bytes);
  store_le(static_cast<uint32_t>(type), 4, bytes);
  store_le(tokens.size(), 8, bytes);
  store_le(static_cast<uint64_t>(vocab_size), 8, bytes);
  if (with_documents) store_le(document_starts.size(), 8, bytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    RD_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, kInvalidArgument, "write_token_file: token ",
             i, " is ", tokens[i], ", outside [0, ", vocab_size, ")");
    store_le(static_cast<uint32_t>(tokens[i]), width, bytes);
  }
  for (const int64_t start : document_starts) {
    store_le(static_cast<uint64_t>(start), kDocumentStartBytes, bytes);
  }
  write_file_atomically(path, bytes);
}

namespace {

// One RDTOK file's header and document table, checked against the file's size.
struct TokenFileLayout {
  int64_t data_offset = 0;  // bytes before the first token
  int64_t count = 0;
  int bytes_per_token = 0;
  int64_t vocab_size = 0;
  std::vector<int64_t> document_starts;  // {0} for version 1
};

TokenFileLayout read_token_file_layout(const MappedFile& file) {
  const std::string& path = file.path();
  const std::span<const uint8_t> bytes = file.bytes();
  const int64_t size = static_cast<int64_t>(bytes.size());
  RD_CHECK(size >= kTokenFileHeaderBytes, kCorruptFile, "token file: '", path,
           "' has a truncated header (", size, " bytes, the header is ", kTokenFileHeaderBytes,
           ")");
  RD_CHECK(std::memcmp(bytes.data(), kTokenFileMagic.data(), kTokenFileMagic.size()) == 0,
           kCorruptFile, "token file: '", path, "' has the wrong magic (not an RDTOK file)");
  const uint64_t version = load_le(bytes.data() + kVersionOffset, 4);
  RD_CHECK(version == kTokenFileVersion || version == kTokenFileDocumentsVersion, kCorruptFile,
           "token file: '", path, "' has version ", version, "; this build reads versions ",
           kTokenFileVersion, " and ", kTokenFileDocumentsVersion);
  const bool with_documents = version == kTokenFileDocumentsVersion;
  RD_CHECK(!with_documents || size >= kDocumentsHeaderBytes, kCorruptFile, "token file: '", path,
           "' has a truncated header (", size, " bytes, version 2's is ", kDocumentsHeaderBytes,
           ")");
  const uint64_t width = load_le(bytes.data() + kDTypeOffset, 4);
  RD_CHECK(width == static_cast<uint32_t>(TokenDType::kUInt16) ||
               width == static_cast<uint32_t>(TokenDType::kUInt32),
           kCorruptFile, "token file: '", path, "' has token width ", width,
           " bytes; expected 2 (uint16) or 4 (uint32)");
  const uint64_t count = load_le(bytes.data() + kCountOffset, 8);
  const uint64_t vocab = load_le(bytes.data() + kVocabOffset, 8);
  RD_CHECK(vocab > 0 && vocab <= static_cast<uint64_t>(kMaxVocab), kCorruptFile, "token file: '",
           path, "' has vocab size ", vocab, "; expected 1 to ", kMaxVocab);
  const uint64_t documents = with_documents ? load_le(bytes.data() + kDocumentCountOffset, 8) : 1;
  const int64_t header = with_documents ? kDocumentsHeaderBytes : kTokenFileHeaderBytes;
  const uint64_t data_bytes = static_cast<uint64_t>(size - header);
  const uint64_t table_bytes = with_documents ? documents * kDocumentStartBytes : 0;
  RD_CHECK(count <= data_bytes / width && documents <= data_bytes / kDocumentStartBytes &&
               count * width + table_bytes == data_bytes,
           kCorruptFile, "token file: '", path, "' holds ", data_bytes,
           " bytes after its header, but the header says ", count, " tokens of ", width, " bytes",
           with_documents ? str_cat(" and ", documents, " document starts of 8") : "");
  RD_CHECK(count > 0, kInvalidArgument, "token file: '", path, "' holds no tokens");
  TokenFileLayout layout{header,
                         static_cast<int64_t>(count),
                         static_cast<int>(width),
                         static_cast<int64_t>(vocab),
                         {0}};
  if (with_documents) {
    RD_CHECK(documents >= 1, kCorruptFile, "token file: '", path,
             "' has an empty document table (version 2 holds at least one start)");
    const uint8_t* table = bytes.data() + header + count * width;
    layout.document_starts.resize(documents);
    for (uint64_t i = 0; i < documents; ++i) {
      layout.document_starts[i] =
          static_cast<int64_t>(load_le(table + i * kDocumentStartBytes, kDocumentStartBytes));
    }
    check_document_starts(layout.document_starts, layout.count, str_cat("token file: '", path, "'"),
                          ErrorCode::kCorruptFile);
  }
  return layout;
}

}  // namespace

TokenSource::TokenSource(std::vector<Part> parts, int64_t vocab_size,
                         std::vector<int64_t> document_starts, bool text)
    : parts_(std::move(parts)),
      count_(parts_.back().first + parts_.back().count),
      vocab_size_(vocab_size),
      document_starts_(std::move(document_starts)),
      text_(text) {}

TokenSource TokenSource::open_text(const std::vector<std::string>& paths) {
  RD_CHECK(!paths.empty(), kInvalidArgument, "text dataset: no files given");
  std::vector<Part> parts;
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (const std::string& path : paths) {
    auto file = std::make_shared<const MappedFile>(path, "text dataset");
    const int64_t size = static_cast<int64_t>(file->bytes().size());
    if (size == 0) continue;  // an empty document adds nothing
    parts.push_back(Part{std::move(file), 0, total, size, 1});
    starts.push_back(total);
    total += size;
  }
  RD_CHECK(total > 0, kInvalidArgument, "text dataset: '", paths.front(), "'",
           paths.size() > 1 ? str_cat(" and the ", paths.size() - 1, " other files are") : " is",
           " empty");
  return TokenSource(std::move(parts), ByteTokenizer::kVocabSize, std::move(starts),
                     /*text=*/true);
}

TokenSource TokenSource::open_token_files(const std::vector<std::string>& paths) {
  RD_CHECK(!paths.empty(), kInvalidArgument, "token file: no files given");
  std::vector<Part> parts;
  std::vector<int64_t> starts;
  int64_t total = 0, vocab_size = 0;
  for (const std::string& path : paths) {
    auto file = std::make_shared<const MappedFile>(path, "token file");
    const TokenFileLayout layout = read_token_file_layout(*file);
    RD_CHECK(parts.empty() || layout.vocab_size == vocab_size, kInvalidArgument, "token file: '",
             path, "' has vocab size ", layout.vocab_size, ", but '", paths.front(), "' has ",
             vocab_size, " (the files of one dataset share one)");
    vocab_size = layout.vocab_size;
    for (const int64_t start : layout.document_starts) starts.push_back(total + start);
    parts.push_back(
        Part{std::move(file), layout.data_offset, total, layout.count, layout.bytes_per_token});
    total += layout.count;
  }
  return TokenSource(std::move(parts), vocab_size, std::move(starts), /*text=*/false);
}

std::string TokenSource::path() const {
  const std::string& first = parts_.front().file->path();
  return parts_.size() == 1 ? first : str_cat(first, " (+", parts_.size() - 1, " more files)");
}

void TokenSource::read(int64_t begin, std::span<int32_t> out) const {
  const int64_t count = static_cast<int64_t>(out.size());
  RD_CHECK(begin >= 0 && begin <= count_ - count, kOutOfRange, "TokenSource::read: tokens [", begin,
           ", ", begin + count, ") of '", path(), "' are outside [0, ", count_, ")");
  // The last part starting at or before `begin`, then on through the parts the range spans.
  auto part = std::upper_bound(parts_.begin(), parts_.end(), begin,
                               [](int64_t at, const Part& p) { return at < p.first; });
  --part;
  int64_t done = 0;
  while (done < count) {
    const int64_t at = begin + done - part->first;
    const int64_t take = std::min(count - done, part->count - at);
    read_part(*part, at, out.subspan(static_cast<size_t>(done), static_cast<size_t>(take)));
    done += take;
    ++part;
  }
}

void TokenSource::read_part(const Part& part, int64_t begin, std::span<int32_t> out) const {
  const uint8_t* data = part.file->bytes().data() + part.offset + begin * part.bytes_per_token;
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t token = load_le(data + i * part.bytes_per_token, part.bytes_per_token);
    RD_CHECK(token < static_cast<uint64_t>(vocab_size_), kCorruptFile, "token file: '",
             part.file->path(), "' holds token ", token, " at position ",
             begin + static_cast<int64_t>(i), ", outside its vocab size ", vocab_size_);
    out[i] = static_cast<int32_t>(token);
  }
}

}  // namespace rd::train
