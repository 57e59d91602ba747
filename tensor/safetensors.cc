// safetensors serialization: the JSON header through nlohmann-json, tensor bytes copied raw,
// and every field of an untrusted header checked before any byte is read through it.
#include "ringdilated/tensor/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/atomic_file.h"

namespace rd {
namespace {

// Tensor bytes are copied as they lie in memory, and the format is little-endian.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O copies raw bytes and needs a little-endian host");

using Json = nlohmann::json;

constexpr size_t kLengthFieldBytes = 8;
// A header this large is a corrupt length field, not a real file (the reference
// implementation refuses the same size).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";
// A valid header nests 3 levels deep (header, entry, shape); 8 leaves room to spare.
constexpr int kMaxJsonDepth = 8;
// Messages quote JSON values cut to this length, so a huge bad value cannot flood them.
constexpr size_t kMaxQuotedChars = 80;

struct DTypeName {
  DType dtype;
  std::string_view name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::kFloat32, "F32"}, {DType::kFloat64, "F64"}, {DType::kBFloat16, "BF16"},
    {DType::kFloat16, "F16"}, {DType::kInt32, "I32"},   {DType::kInt64, "I64"},
    {DType::kBool, "BOOL"}};
// Valid in the format, but RingDilated has no such dtype: not corrupt, just unsupported.
constexpr std::string_view kUnsupportedDTypeNames[] = {
    "U8", "I8", "U16", "I16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3",
    "F6_E3M2", "F4", "C64"};

std::string_view safetensors_name(DType dtype) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  RD_FAIL(kInternal, "safetensors: no format name for dtype ", dtype_name(dtype));
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

// The JSON text of `value`, cut short for messages.
std::string quote(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kMaxQuotedChars) text = str_cat(text.substr(0, kMaxQuotedChars), "...");
  return text;
}

// --- parsing ---

struct Entry {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data buffer
  uint64_t end = 0;
};

// Errors of one input: every message starts "parse_safetensors: <source>: ".
class Reader {
 public:
  explicit Reader(std::string_view source) : source_(source) {}

  template <class... Pieces>
  [[noreturn]] void corrupt(const Pieces&... pieces) const {
    throw Error(ErrorCode::kCorruptFile,
                str_cat("parse_safetensors: ", source_, ": ", pieces...));
  }

  uint64_t read_header_length(std::span<const uint8_t> bytes) const;
  Json parse_header(std::span<const uint8_t> text) const;
  Entry parse_entry(const std::string& name, const Json& value) const;
  void check_layout(std::vector<Entry>& entries, uint64_t data_bytes) const;
  std::map<std::string, std::string> parse_metadata(const Json& value) const;
  Tensor make_tensor(const Entry& entry, std::span<const uint8_t> data) const;

 private:
  DType parse_dtype(const std::string& name, const Json& entry) const;
  Shape parse_shape(const std::string& name, const Json& entry) const;
  void parse_offsets(const Json& entry, Entry* out) const;
  uint64_t checked_nbytes(const Entry& entry) const;
  const Json& field(const std::string& name, const Json& entry, const char* key) const;

  std::string source_;
};

uint64_t Reader::read_header_length(std::span<const uint8_t> bytes) const {
  if (bytes.size() < kLengthFieldBytes) {
    corrupt("the file has ", bytes.size(), " bytes, fewer than the 8-byte header length");
  }
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthFieldBytes; ++i) length |= uint64_t{bytes[i]} << (8 * i);
  if (length > kMaxHeaderBytes) {
    corrupt("the header length ", length, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  }
  if (length > bytes.size() - kLengthFieldBytes) {
    corrupt("the header length ", length, " exceeds the ", bytes.size() - kLengthFieldBytes,
            " bytes that follow the length field");
  }
  return length;
}

// A first, validating pass over the header's JSON events: refuses a repeated tensor name
// (nlohmann keeps the last of repeated keys, but the two entries could not both be honoured)
// and nesting deeper than kMaxJsonDepth (printing or freeing a deeply nested value recurses
// and could overflow the stack). Kept apart from building the value because nlohmann's
// callback parser, which could do both at once, rescans the enclosing object at the end of
// every entry (to drop discarded values): quadratic in the number of tensors.
class HeaderChecker final : public nlohmann::json_sax<Json> {
 public:
  explicit HeaderChecker(const Reader& reader) : reader_(reader) {}

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return close(); }
  bool key(string_t& name) override {
    value();
    if (open_ == 1 && !names_.insert(name).second) {
      reader_.corrupt("the header names '", name, "' twice");
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    reader_.corrupt("the header is not valid JSON: ", e.what());
  }

 private:
  // Depths as nlohmann's callback parser counted them: a container by the containers around
  // it, a key or value by the containers it is in.
  bool value() const {
    if (open_ > kMaxJsonDepth) {
      reader_.corrupt("the header nests JSON deeper than ", kMaxJsonDepth, " levels");
    }
    return true;
  }
  bool open() {
    value();
    ++open_;
    return true;
  }
  bool close() {
    --open_;
    return true;
  }

  const Reader& reader_;
  int open_ = 0;  // containers open around the current event
  std::set<std::string> names_;
};

Json Reader::parse_header(std::span<const uint8_t> text) const {
  HeaderChecker checker(*this);
  Json::sax_parse(text.begin(), text.end(), &checker);
  Json header;
  try {
    header = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // not expected: the checker parsed the same text
    corrupt("the header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) {
    corrupt("the header is a JSON ", header.type_name(), ", not an object");
  }
  return header;
}

const Json& Reader::field(const std::string& name, const Json& entry, const char* key) const {
  auto it = entry.find(key);
  if (it == entry.end()) corrupt("tensor '", name, "': the entry has no \"", key, "\"");
  return *it;
}

DType Reader::parse_dtype(const std::string& name, const Json& entry) const {
  const Json& value = field(name, entry, "dtype");
  if (!value.is_string()) corrupt("tensor '", name, "': dtype ", quote(value), " is not a string");
  const std::string& text = value.get_ref<const std::string&>();
  if (std::optional<DType> dtype = dtype_from_name(text)) return *dtype;
  if (std::ranges::find(kUnsupportedDTypeNames, text) != std::end(kUnsupportedDTypeNames)) {
    RD_FAIL(kDTypeMismatch, "parse_safetensors: ", source_, ": tensor '", name, "': dtype ",
            text, " is valid safetensors but not supported (supported: F32, F64, BF16, F16, "
            "I32, I64, BOOL)");
  }
  corrupt("tensor '", name, "': unknown dtype ", quote(value));
}

Shape Reader::parse_shape(const std::string& name, const Json& entry) const {
  const Json& value = field(name, entry, "shape");
  if (!value.is_array()) corrupt("tensor '", name, "': shape ", quote(value), " is not an array");
  Shape shape;
  for (const Json& dim : value) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      corrupt("tensor '", name, "': shape ", quote(value), " has ", quote(dim),
              ", not a non-negative 64-bit integer");
    }
    shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  }
  return shape;
}

void Reader::parse_offsets(const Json& entry, Entry* out) const {
  const Json& value = field(out->name, entry, "data_offsets");
  const bool two_unsigned = value.is_array() && value.size() == 2 &&
                            value[0].is_number_unsigned() && value[1].is_number_unsigned();
  if (!two_unsigned) {
    corrupt("tensor '", out->name, "': data_offsets ", quote(value),
            " is not two non-negative integers");
  }
  out->begin = value[0].get<uint64_t>();
  out->end = value[1].get<uint64_t>();
  if (out->begin > out->end) {
    corrupt("tensor '", out->name, "': data_offsets begin ", out->begin, " exceeds end ",
            out->end);
  }
}

Entry Reader::parse_entry(const std::string& name, const Json& value) const {
  if (!value.is_object()) {
    corrupt("tensor '", name, "': the entry is a JSON ", value.type_name(), ", not an object");
  }
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      corrupt("tensor '", name, "': unknown key '", key, "' in the entry");
    }
  }
  Entry entry;
  entry.name = name;
  entry.dtype = parse_dtype(name, value);
  entry.shape = parse_shape(name, value);
  parse_offsets(value, &entry);
  return entry;
}

// numel * dtype_size, refusing any overflow. Zero dims count as 1 in the overflow check,
// so a zero-size tensor cannot smuggle in dims whose strides would overflow.
uint64_t Reader::checked_nbytes(const Entry& entry) const {
  uint64_t numel = 1;
  uint64_t nonzero_product = 1;
  for (int64_t dim : entry.shape) {
    const uint64_t d = static_cast<uint64_t>(dim);
    if (__builtin_mul_overflow(nonzero_product, std::max<uint64_t>(d, 1), &nonzero_product) ||
        nonzero_product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      corrupt("tensor '", entry.name, "': shape ", shape_str(entry.shape),
              " has more elements than fit in 64 bits");
    }
    numel = d == 0 ? 0 : numel * d;  // numel <= nonzero_product: cannot overflow
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, uint64_t{dtype_size(entry.dtype)}, &nbytes)) {
    corrupt("tensor '", entry.name, "': shape ", shape_str(entry.shape), " of ",
            dtype_name(entry.dtype), " has more bytes than fit in 64 bits");
  }
  return nbytes;
}

// The format requires tensors to tile the data buffer exactly: in bounds, sized by their
// shape and dtype, and no overlaps, gaps or trailing bytes (which would let a file carry
// hidden content). Sorts `entries` by offset.
void Reader::check_layout(std::vector<Entry>& entries, uint64_t data_bytes) const {
  for (const Entry& entry : entries) {
    if (entry.end > data_bytes) {
      corrupt("tensor '", entry.name, "': data_offsets [", entry.begin, ", ", entry.end,
              "] end beyond the ", data_bytes, "-byte data buffer");
    }
    const uint64_t nbytes = checked_nbytes(entry);
    if (entry.end - entry.begin != nbytes) {
      corrupt("tensor '", entry.name, "': data_offsets [", entry.begin, ", ", entry.end,
              "] span ", entry.end - entry.begin, " bytes but shape ", shape_str(entry.shape),
              " of ", dtype_name(entry.dtype), " needs ", nbytes);
    }
  }
  std::ranges::sort(entries, [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;  // the data buffer's bytes [0, covered) belong to earlier tensors
  const Entry* previous = nullptr;
  for (const Entry& entry : entries) {
    if (entry.begin < covered) {
      corrupt("tensor '", entry.name, "': bytes [", entry.begin, ", ", entry.end,
              ") overlap tensor '", previous->name, "' at [", previous->begin, ", ",
              previous->end, ")");
    }
    if (entry.begin > covered) {
      corrupt("tensor '", entry.name, "': bytes [", covered, ", ", entry.begin,
              ") before it belong to no tensor");
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_bytes) {
    corrupt("the data buffer has ", data_bytes, " bytes but the tensors cover only ", covered);
  }
}

std::map<std::string, std::string> Reader::parse_metadata(const Json& value) const {
  if (!value.is_object()) {
    corrupt("\"__metadata__\" is a JSON ", value.type_name(), ", not an object");
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      corrupt("\"__metadata__\" entry '", key, "' is ", quote(item), ", not a string");
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

Tensor Reader::make_tensor(const Entry& entry, std::span<const uint8_t> data) const {
  const std::span<const uint8_t> bytes = data.subspan(entry.begin, entry.end - entry.begin);
  if (entry.dtype == DType::kBool) {
    // Any other byte would be an invalid C++ bool once read through bool*.
    auto bad = std::ranges::find_if(bytes, [](uint8_t b) { return b > 1; });
    if (bad != bytes.end()) {
      corrupt("tensor '", entry.name, "': BOOL byte ", int{*bad}, " at element ",
              bad - bytes.begin(), " is neither 0 nor 1");
    }
  }
  Tensor tensor = empty(entry.shape, TensorOptions(entry.dtype));
  if (!bytes.empty()) std::memcpy(tensor.raw_data(), bytes.data(), bytes.size());
  return tensor;
}

// --- writing ---

Json metadata_json(const std::map<std::string, std::string>& metadata) {
  Json object = Json::object();
  for (const auto& [key, value] : metadata) object[key] = value;
  return object;
}

// The header text, padded with spaces so the data buffer starts 8-byte aligned.
std::string header_text(const Json& header) {
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    RD_FAIL(kInvalidArgument, "serialize_safetensors: a tensor name or metadata string is not "
            "valid UTF-8: ", e.what());
  }
  text.resize((text.size() + 7) / 8 * 8, ' ');
  return text;
}

}  // namespace

namespace {

// The header of `tensors` in name order (std::map's), and the payload's total bytes. Reads
// only shapes and dtypes, so no tensor is copied yet.
std::string layout_header(const std::map<std::string, Tensor>& tensors,
                          const std::map<std::string, std::string>& metadata,
                          uint64_t* payload_bytes) {
  Json header = Json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata_json(metadata);
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    RD_CHECK(!name.empty(), kInvalidArgument, "serialize_safetensors: a tensor name is empty");
    RD_CHECK(name != kMetadataKey, kInvalidArgument, "serialize_safetensors: tensor name '",
             name, "' is reserved for metadata");
    RD_CHECK(tensor.defined(), kInvalidArgument, "serialize_safetensors: tensor '", name,
             "' is undefined");
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * dtype_size(tensor.dtype());
    header[name] = {{"dtype", safetensors_name(tensor.dtype())},
                    {"shape", tensor.shape()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  *payload_bytes = offset;
  return header_text(header);
}

// Writes the file's bytes through `sink(span)`: the length field, the header, then each
// tensor copied to the host (contiguous) one at a time, so at most one tensor's copy is
// held at once.
template <class Sink>
void write_safetensors(const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata, Sink&& sink) {
  uint64_t payload = 0;
  const std::string text = layout_header(tensors, metadata, &payload);
  std::array<uint8_t, kLengthFieldBytes> length{};
  for (size_t i = 0; i < kLengthFieldBytes; ++i) {
    length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  }
  sink(std::span<const uint8_t>(length));
  sink(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  for (const auto& [name, tensor] : tensors) {
    const Tensor host = tensor.to(Device::cpu()).contiguous();
    const size_t nbytes = static_cast<size_t>(host.numel()) * dtype_size(host.dtype());
    if (nbytes != 0) sink(std::span<const uint8_t>(static_cast<const uint8_t*>(host.raw_data()), nbytes));
  }
}

}  // namespace

std::vector<uint8_t> serialize_safetensors(const std::map<std::string, Tensor>& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  std::vector<uint8_t> out;
  write_safetensors(tensors, metadata, [&out](std::span<const uint8_t> bytes) {
    out.insert(out.end(), bytes.begin(), bytes.end());
  });
  return out;
}

SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes, std::string_view source) {
  const Reader reader(source);
  const uint64_t header_length = reader.read_header_length(bytes);
  const std::span<const uint8_t> data = bytes.subspan(kLengthFieldBytes + header_length);
  const Json header = reader.parse_header(bytes.subspan(kLengthFieldBytes, header_length));

  SafetensorsFile file;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      file.metadata = reader.parse_metadata(value);
    } else {
      if (key.empty()) reader.corrupt("a tensor name is empty");
      entries.push_back(reader.parse_entry(key, value));
    }
  }
  reader.check_layout(entries, data.size());
  for (const Entry& entry : entries) {
    file.tensors.emplace(entry.name, reader.make_tensor(entry, data));
  }
  return file;
}

FileDigest save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  AtomicFileWriter writer(path);
  write_safetensors(tensors, metadata, [&writer](std::span<const uint8_t> bytes) { writer.write(bytes); });
  return writer.commit();
}

SafetensorsFile load_safetensors(const std::string& path) {
  return parse_safetensors(read_whole_file(path), path);
}

}  // namespace rd
