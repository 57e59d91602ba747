// Tests of safetensors I/O: round trips, the byte format laid down by hand, every bounds
// check of the parser, truncation and byte-flip robustness, and atomic saving.
#include "ringdilated/tensor/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/tensor/atomic_file.h"
#include "ringdilated/tensor/checksum.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {
namespace {

namespace fs = std::filesystem;

using Bytes = std::vector<uint8_t>;

// --- helpers ---

// A file in the published layout: u64 little-endian header length, header, data.
Bytes make_file(const std::string& header, const Bytes& data) {
  Bytes out;
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(length >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// The bytes of a contiguous CPU tensor, in memory order.
Bytes bytes_of(const Tensor& t) {
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.device().is_cpu());
  const size_t n = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
  Bytes out(n);
  if (n != 0) std::memcpy(out.data(), t.raw_data(), n);
  return out;
}

template <class T>
std::vector<T> values_of(const Tensor& t) {
  EXPECT_EQ(sizeof(T), dtype_size(t.dtype()));
  Bytes bytes = bytes_of(t);
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

template <class T>
void append_value(Bytes* out, T value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out->insert(out->end(), p, p + sizeof(T));
}

// Random non-zero values of `dtype` (bool: random 0/1), as raw little-endian bytes.
Bytes random_bytes(DType dtype, int64_t numel, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> magnitude(0.1, 2.0);
  auto nonzero = [&] { return (rng() % 2 ? 1.0 : -1.0) * magnitude(rng); };
  Bytes out;
  for (int64_t i = 0; i < numel; ++i) {
    switch (dtype) {
      case DType::kFloat32: append_value(&out, static_cast<float>(nonzero())); break;
      case DType::kFloat64: append_value(&out, nonzero()); break;
      case DType::kBFloat16: append_value(&out, BFloat16(static_cast<float>(nonzero())).bits); break;
      case DType::kFloat16: append_value(&out, Float16(static_cast<float>(nonzero())).bits); break;
      case DType::kInt32: append_value(&out, (static_cast<int32_t>(rng() % 2000001) - 1000000) | 1); break;
      case DType::kInt64: append_value(&out, static_cast<int64_t>(rng()) | 1); break;
      case DType::kBool: out.push_back(static_cast<uint8_t>(rng() % 2)); break;
    }
  }
  return out;
}

Tensor tensor_from_bytes(const Shape& shape, DType dtype, const Bytes& bytes) {
  Tensor t = empty(shape, TensorOptions(dtype));
  EXPECT_EQ(bytes.size(), static_cast<size_t>(t.numel()) * dtype_size(dtype));
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

// Expects parse_safetensors(bytes) to throw `code` with every piece in the message.
void expect_parse_error(const Bytes& bytes, ErrorCode code,
                        std::initializer_list<std::string> pieces) {
  try {
    parse_safetensors(bytes, "test.safetensors");
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find("test.safetensors"), std::string::npos) << message;
    for (const std::string& piece : pieces) {
      EXPECT_NE(message.find(piece), std::string::npos)
          << "message lacks \"" << piece << "\": " << message;
    }
  }
}

// A small valid file: three tensors and metadata.
Bytes small_valid_file() {
  std::mt19937_64 rng(99);
  std::map<std::string, Tensor> tensors;
  tensors["w"] = tensor_from_bytes({3, 2}, DType::kFloat32, random_bytes(DType::kFloat32, 6, rng));
  tensors["n"] = tensor_from_bytes({2}, DType::kInt64, random_bytes(DType::kInt64, 2, rng));
  tensors["m"] = tensor_from_bytes({4}, DType::kBool, random_bytes(DType::kBool, 4, rng));
  tensors["s"] = tensor_from_bytes({}, DType::kBFloat16, random_bytes(DType::kBFloat16, 1, rng));
  return serialize_safetensors(tensors, {{"format", "pt"}});
}

// --- round trips ---

TEST(SafetensorsTest, RoundTripsEveryDTypeAndShape) {
  std::mt19937_64 rng(2024);
  const Shape shapes[] = {{}, {5}, {3, 4}, {2, 0, 3}, {2, 3, 4}};
  std::map<std::string, Tensor> tensors;
  std::map<std::string, Bytes> expected;
  for (DType dtype : kAllDTypes) {
    for (size_t s = 0; s < std::size(shapes); ++s) {
      const std::string name = std::string(dtype_name(dtype)) + "_" + std::to_string(s);
      int64_t numel = 1;
      for (int64_t d : shapes[s]) numel *= d;
      expected[name] = random_bytes(dtype, numel, rng);
      tensors[name] = tensor_from_bytes(shapes[s], dtype, expected[name]);
    }
  }
  const SafetensorsFile file = parse_safetensors(serialize_safetensors(tensors));
  ASSERT_EQ(file.tensors.size(), tensors.size());
  EXPECT_TRUE(file.metadata.empty());
  for (const auto& [name, original] : tensors) {
    SCOPED_TRACE(name);
    auto it = file.tensors.find(name);
    ASSERT_NE(it, file.tensors.end());
    const Tensor& loaded = it->second;
    EXPECT_EQ(loaded.dtype(), original.dtype());
    EXPECT_EQ(loaded.shape(), original.shape());
    EXPECT_EQ(bytes_of(loaded), expected[name]);
    EXPECT_FALSE(loaded.storage()->data() == original.storage()->data() &&
                 loaded.numel() > 0);  // a copy, not an alias
  }
}

TEST(SafetensorsTest, WritesNonContiguousViewsInLogicalOrder) {
  std::vector<float> base_values(12);
  for (int i = 0; i < 12; ++i) base_values[i] = 1.0f + 1.5f * static_cast<float>(i);
  Bytes raw(48);
  std::memcpy(raw.data(), base_values.data(), 48);
  Tensor base = tensor_from_bytes({3, 4}, DType::kFloat32, raw);
  std::map<std::string, Tensor> tensors{{"transposed", base.transpose(0, 1)},
                                        {"strided", base.slice(1, 0, 4, 2)}};
  ASSERT_FALSE(tensors["transposed"].is_contiguous());
  ASSERT_FALSE(tensors["strided"].is_contiguous());
  const SafetensorsFile file = parse_safetensors(serialize_safetensors(tensors));

  const Tensor& transposed = file.tensors.at("transposed");
  EXPECT_EQ(transposed.shape(), (Shape{4, 3}));
  std::vector<float> want_transposed;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) want_transposed.push_back(base_values[j * 4 + i]);
  }
  EXPECT_EQ(values_of<float>(transposed), want_transposed);

  const Tensor& strided = file.tensors.at("strided");
  EXPECT_EQ(strided.shape(), (Shape{3, 2}));
  std::vector<float> want_strided;
  for (int i = 0; i < 3; ++i) {
    for (int k = 0; k < 2; ++k) want_strided.push_back(base_values[i * 4 + 2 * k]);
  }
  EXPECT_EQ(values_of<float>(strided), want_strided);
}

TEST(SafetensorsTest, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata{
      {"format", "pt"}, {"step", "1200"}, {"note", "quotes \" and \\ and unicode \u00e9"},
      {"empty", ""}};
  std::mt19937_64 rng(5);
  std::map<std::string, Tensor> tensors{
      {"x", tensor_from_bytes({2}, DType::kFloat64, random_bytes(DType::kFloat64, 2, rng))}};
  const SafetensorsFile file = parse_safetensors(serialize_safetensors(tensors, metadata));
  EXPECT_EQ(file.metadata, metadata);
  EXPECT_EQ(file.tensors.size(), 1u);
  // Metadata alone, without tensors, is a valid file too.
  const SafetensorsFile only_metadata = parse_safetensors(serialize_safetensors({}, metadata));
  EXPECT_EQ(only_metadata.metadata, metadata);
  EXPECT_TRUE(only_metadata.tensors.empty());
}

TEST(SafetensorsTest, EmptyFileRoundTrips) {
  const Bytes bytes = serialize_safetensors({});
  const SafetensorsFile file = parse_safetensors(bytes);
  EXPECT_TRUE(file.tensors.empty());
  EXPECT_TRUE(file.metadata.empty());
}

// --- the byte format ---

TEST(SafetensorsTest, WriterLaysOutThePublishedFormat) {
  Bytes a_bytes;
  append_value(&a_bytes, 1.5f);
  append_value(&a_bytes, -2.0f);
  Bytes b_bytes;
  append_value(&b_bytes, int32_t{7});
  // Inserted out of name order: the data must still follow name order ("a" before "b").
  std::map<std::string, Tensor> tensors;
  tensors["b"] = tensor_from_bytes({}, DType::kInt32, b_bytes);
  tensors["a"] = tensor_from_bytes({2}, DType::kFloat32, a_bytes);
  const Bytes out = serialize_safetensors(tensors, {{"k", "v"}});

  ASSERT_GE(out.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{out[i]} << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "the header is padded to a multiple of 8";
  ASSERT_EQ(out.size(), 8 + n + 12);
  const std::string header(out.begin() + 8, out.begin() + 8 + static_cast<ptrdiff_t>(n));
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}')) << "pads with spaces";
  for (const char* piece : {"\"a\":{", "\"data_offsets\":[0,8]", "\"dtype\":\"F32\"",
                            "\"shape\":[2]", "\"b\":{", "\"data_offsets\":[8,12]",
                            "\"dtype\":\"I32\"", "\"shape\":[]",
                            "\"__metadata__\":{\"k\":\"v\"}"}) {
    EXPECT_NE(header.find(piece), std::string::npos) << piece << " not in " << header;
  }
  const Bytes data(out.begin() + 8 + static_cast<ptrdiff_t>(n), out.end());
  EXPECT_EQ(data, (Bytes{0x00, 0x00, 0xc0, 0x3f,    // 1.5f
                         0x00, 0x00, 0x00, 0xc0,    // -2.0f
                         0x07, 0x00, 0x00, 0x00}));  // int32 7
}

TEST(SafetensorsTest, ParsesAFileLaidDownByHand) {
  // As another writer might produce it: keys in no particular order, spaces, offsets
  // not in key order, trailing padding, and no __metadata__ sorting assumptions.
  const std::string header =
      "{\"weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 16]},"
      " \"count\": {\"shape\": [1, 1], \"dtype\": \"I32\", \"data_offsets\": [43, 47]},"
      " \"bias\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [16, 20]},"
      " \"__metadata__\": {\"format\": \"pt\"},"
      " \"step\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": [20, 28]},"
      " \"mask\": {\"dtype\": \"BOOL\", \"shape\": [3], \"data_offsets\": [28, 31]},"
      " \"half\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [31, 35]},"
      " \"dbl\": {\"data_offsets\": [35, 43], \"dtype\": \"F64\", \"shape\": [1]}}   ";
  const Bytes data = {
      0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0,  // weight: 1.0f, -2.5f
      0x00, 0x00, 0x20, 0x3e, 0x00, 0x00, 0x40, 0x40,  //         0.15625f, 3.0f
      0x80, 0x3f, 0x00, 0xbf,                          // bias: bf16 1.0, -0.5
      0x14, 0x1a, 0x99, 0xbe, 0x1c, 0x00, 0x00, 0x00,  // step: 123456789012
      0x01, 0x00, 0x01,                                // mask: true, false, true
      0x00, 0x3c, 0x00, 0xb8,                          // half: f16 1.0, -0.5
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xd8, 0x3f,  // dbl: 0.375
      0xf9, 0xff, 0xff, 0xff};                         // count: -7
  const SafetensorsFile file = parse_safetensors(make_file(header, data));

  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.tensors.size(), 7u);
  const Tensor& weight = file.tensors.at("weight");
  EXPECT_EQ(weight.dtype(), DType::kFloat32);
  EXPECT_EQ(weight.shape(), (Shape{2, 2}));
  EXPECT_EQ(values_of<float>(weight), (std::vector<float>{1.0f, -2.5f, 0.15625f, 3.0f}));

  const Tensor& bias = file.tensors.at("bias");
  EXPECT_EQ(bias.dtype(), DType::kBFloat16);
  EXPECT_EQ(values_of<uint16_t>(bias), (std::vector<uint16_t>{0x3f80, 0xbf00}));
  EXPECT_EQ(static_cast<float>(BFloat16::from_bits(0xbf00)), -0.5f);

  const Tensor& step = file.tensors.at("step");
  EXPECT_EQ(step.dtype(), DType::kInt64);
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(values_of<int64_t>(step), (std::vector<int64_t>{123456789012}));

  const Tensor& mask = file.tensors.at("mask");
  EXPECT_EQ(mask.dtype(), DType::kBool);
  EXPECT_EQ(values_of<uint8_t>(mask), (Bytes{1, 0, 1}));

  const Tensor& half = file.tensors.at("half");
  EXPECT_EQ(half.dtype(), DType::kFloat16);
  const std::vector<uint16_t> half_bits = values_of<uint16_t>(half);
  ASSERT_EQ(half_bits.size(), 2u);
  EXPECT_EQ(static_cast<float>(Float16::from_bits(half_bits[0])), 1.0f);
  EXPECT_EQ(static_cast<float>(Float16::from_bits(half_bits[1])), -0.5f);

  const Tensor& dbl = file.tensors.at("dbl");
  EXPECT_EQ(dbl.dtype(), DType::kFloat64);
  EXPECT_EQ(values_of<double>(dbl), (std::vector<double>{0.375}));

  const Tensor& count = file.tensors.at("count");
  EXPECT_EQ(count.dtype(), DType::kInt32);
  EXPECT_EQ(count.shape(), (Shape{1, 1}));
  EXPECT_EQ(values_of<int32_t>(count), (std::vector<int32_t>{-7}));
}

// --- malformed input ---

TEST(SafetensorsTest, EveryTruncationIsCorrupt) {
  const Bytes valid = small_valid_file();
  ASSERT_NO_THROW(parse_safetensors(valid));
  for (size_t length = 0; length < valid.size(); ++length) {
    SCOPED_TRACE(length);
    const Bytes prefix(valid.begin(), valid.begin() + static_cast<ptrdiff_t>(length));
    try {
      parse_safetensors(prefix, "cut");
      ADD_FAILURE() << "a " << length << "-byte prefix parsed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kCorruptFile) << e.what();
    }
  }
}

TEST(SafetensorsTest, FileShorterThanTheLengthField) {
  expect_parse_error({1, 2, 3}, ErrorCode::kCorruptFile, {"3 bytes"});
}

TEST(SafetensorsTest, HeaderLengthBeyondTheFile) {
  Bytes bytes = make_file("{}", {});
  bytes[0] = 0xe8;  // 1000
  bytes[1] = 0x03;
  expect_parse_error(bytes, ErrorCode::kCorruptFile, {"1000", "2 bytes"});
}

TEST(SafetensorsTest, AbsurdHeaderLength) {
  Bytes bytes = make_file("{}", {});
  const uint64_t length = 200'000'000;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(length >> (8 * i));
  expect_parse_error(bytes, ErrorCode::kCorruptFile, {"200000000", "100000000"});
  for (int i = 0; i < 8; ++i) bytes[i] = 0xff;  // u64 max must not overflow any sum
  expect_parse_error(bytes, ErrorCode::kCorruptFile, {"18446744073709551615"});
}

// One malformed header per bounds check, with what its message must name.
struct BadHeader {
  const char* test_name;
  std::string header;
  size_t data_bytes;
  std::vector<std::string> message_pieces;
  ErrorCode code = ErrorCode::kCorruptFile;
};

void PrintTo(const BadHeader& bad, std::ostream* os) { *os << bad.test_name; }

class SafetensorsBadHeaderTest : public ::testing::TestWithParam<BadHeader> {};

TEST_P(SafetensorsBadHeaderTest, IsRefusedWithAClearMessage) {
  const BadHeader& bad = GetParam();
  SCOPED_TRACE(bad.header);
  try {
    parse_safetensors(make_file(bad.header, Bytes(bad.data_bytes, 0)), "test.safetensors");
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), bad.code) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find("test.safetensors"), std::string::npos) << message;
    for (const std::string& piece : bad.message_pieces) {
      EXPECT_NE(message.find(piece), std::string::npos)
          << "message lacks \"" << piece << "\": " << message;
    }
  }
}

#define ENTRY(dtype, shape, offsets) \
  "{\"dtype\":" dtype ",\"shape\":" shape ",\"data_offsets\":" offsets "}"

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsBadHeaderTest,
    ::testing::Values(
        BadHeader{"NotJson", "{\"x\": ", 0, {"not valid JSON"}},
        BadHeader{"InvalidUtf8", "{\"x\xff\": 1}", 0, {"not valid JSON"}},
        BadHeader{"NotAnObject", "[1, 2]", 0, {"array", "not an object"}},
        BadHeader{"EntryNotAnObject", "{\"x\": 5}", 0, {"'x'", "number"}},
        BadHeader{"MissingDtype", "{\"x\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                  {"'x'", "\"dtype\""}},
        BadHeader{"UnknownDtype", "{\"x\":" ENTRY("\"F33\"", "[2]", "[0,8]") "}", 8,
                  {"'x'", "F33"}},
        BadHeader{"DtypeNotAString", "{\"x\":" ENTRY("32", "[2]", "[0,8]") "}", 8,
                  {"'x'", "32"}},
        BadHeader{"UnsupportedDtype",
                  "{\"x\":" ENTRY("\"U8\"", "[8]", "[0,8]") "}",
                  8,
                  {"'x'", "U8", "not supported"},
                  ErrorCode::kDTypeMismatch},
        BadHeader{"MissingShape", "{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8,
                  {"'x'", "\"shape\""}},
        BadHeader{"ShapeNotAnArray", "{\"x\":" ENTRY("\"F32\"", "\"2\"", "[0,8]") "}", 8,
                  {"'x'", "\"2\""}},
        BadHeader{"NegativeDim", "{\"x\":" ENTRY("\"F32\"", "[-2]", "[0,8]") "}", 8,
                  {"'x'", "-2"}},
        BadHeader{"FractionalDim", "{\"x\":" ENTRY("\"F32\"", "[2.5]", "[0,8]") "}", 8,
                  {"'x'", "2.5"}},
        BadHeader{"DimBeyondInt64",
                  "{\"x\":" ENTRY("\"F32\"", "[9223372036854775808]", "[0,8]") "}", 8,
                  {"'x'", "9223372036854775808"}},
        BadHeader{"MissingOffsets", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8,
                  {"'x'", "\"data_offsets\""}},
        BadHeader{"OneOffset", "{\"x\":" ENTRY("\"F32\"", "[2]", "[0]") "}", 8,
                  {"'x'", "[0]"}},
        BadHeader{"NegativeOffset", "{\"x\":" ENTRY("\"F32\"", "[2]", "[-1,7]") "}", 8,
                  {"'x'", "[-1,7]"}},
        BadHeader{"OffsetsBackwards", "{\"x\":" ENTRY("\"F32\"", "[2]", "[8,0]") "}", 8,
                  {"'x'", "begin 8", "end 0"}},
        BadHeader{"EndBeyondData", "{\"x\":" ENTRY("\"F32\"", "[4]", "[0,16]") "}", 8,
                  {"'x'", "16", "8-byte"}},
        BadHeader{"SizeMismatch", "{\"x\":" ENTRY("\"F32\"", "[3]", "[0,8]") "}", 8,
                  {"'x'", "[3]", "needs 12", "8 bytes"}},
        BadHeader{"ElementCountOverflow",
                  "{\"x\":" ENTRY("\"F32\"", "[4294967296,4294967296]", "[0,8]") "}", 8,
                  {"'x'", "[4294967296, 4294967296]"}},
        BadHeader{"ZeroSizeWithOverflowingDims",
                  "{\"x\":" ENTRY("\"F32\"",
                                  "[4611686018427387904,4611686018427387904,0]", "[0,0]") "}",
                  0, {"'x'", "4611686018427387904"}},
        BadHeader{"ByteCountOverflow",
                  "{\"x\":" ENTRY("\"F32\"", "[4611686018427387904]", "[0,8]") "}", 8,
                  {"'x'", "4611686018427387904", "bytes"}},
        BadHeader{"Overlap",
                  "{\"a\":" ENTRY("\"F32\"", "[2]", "[0,8]") ",\"b\":" ENTRY(
                      "\"F32\"", "[2]", "[4,12]") "}",
                  12, {"'a'", "'b'", "overlap", "[4, 12)"}},
        BadHeader{"SameRangeTwice",
                  "{\"a\":" ENTRY("\"F32\"", "[2]", "[0,8]") ",\"b\":" ENTRY(
                      "\"F32\"", "[2]", "[0,8]") "}",
                  8, {"overlap"}},
        BadHeader{"Gap",
                  "{\"a\":" ENTRY("\"F32\"", "[1]", "[0,4]") ",\"b\":" ENTRY(
                      "\"F32\"", "[1]", "[8,12]") "}",
                  12, {"'b'", "[4, 8)"}},
        BadHeader{"TrailingData", "{\"x\":" ENTRY("\"F32\"", "[2]", "[0,8]") "}", 12,
                  {"12 bytes", "only 8"}},
        BadHeader{"MetadataNotAnObject", "{\"__metadata__\": \"pt\"}", 0,
                  {"__metadata__", "string"}},
        BadHeader{"MetadataValueNotAString", "{\"__metadata__\": {\"epoch\": 3}}", 0,
                  {"'epoch'", "3"}},
        BadHeader{"UnknownKeyInEntry",
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],"
                  "\"extra\":1}}",
                  8, {"'x'", "'extra'"}},
        BadHeader{"RepeatedName",
                  "{\"x\":" ENTRY("\"F32\"", "[1]", "[0,4]") ",\"x\":" ENTRY(
                      "\"F32\"", "[1]", "[4,8]") "}",
                  8, {"'x'", "twice"}},
        BadHeader{"DeeplyNested",
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":" + std::string(100000, '[') +
                      std::string(100000, ']') + ",\"data_offsets\":[0,0]}}",
                  0, {"deeper than"}},
        BadHeader{"EmptyName", "{\"\":" ENTRY("\"F32\"", "[2]", "[0,8]") "}", 8, {"empty"}}),
    [](const ::testing::TestParamInfo<BadHeader>& info) { return info.param.test_name; });

#undef ENTRY

TEST(SafetensorsTest, BoolBytesMustBeZeroOrOne) {
  const std::string header = "{\"m\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[0,3]}}";
  ASSERT_NO_THROW(parse_safetensors(make_file(header, {1, 0, 1})));
  expect_parse_error(make_file(header, {1, 0, 2}), ErrorCode::kCorruptFile,
                     {"'m'", "byte 2", "element 2"});
}

// Parsing must take time linear in the number of tensors. nlohmann's callback parser, used
// for the header checks before, rescanned the whole header object at the end of each entry:
// 10k tensors took 0.9 s, 80k over a minute, so 100k would take minutes where a linear
// parser takes well under a second (a few under sanitizers). The budget is generous enough
// never to fail a linear parser on a loaded machine, and far below the quadratic time.
TEST(SafetensorsTest, ParsingManyTinyTensorsTakesLinearTime) {
  constexpr int kTensors = 100'000;
  std::mt19937_64 rng(4242);
  std::uniform_real_distribution<float> uniform(0.5f, 2.0f);
  std::vector<float> values(kTensors);
  for (float& v : values) v = uniform(rng) * (rng() % 2 ? 1.0f : -1.0f);
  // Entries in a shuffled order, data in index order: the layout check must sort them.
  std::vector<int> order(kTensors);
  for (int i = 0; i < kTensors; ++i) order[static_cast<size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::string header = "{";
  for (int i : order) {
    if (header.size() > 1) header += ",";
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[1],";
    header += "\"data_offsets\":[" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  header += "}";
  Bytes data(values.size() * sizeof(float));
  std::memcpy(data.data(), values.data(), data.size());
  const Bytes file = make_file(header, data);

  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile parsed = parse_safetensors(file, "many");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 20.0) << "parsing " << kTensors << " tensors is not linear";

  ASSERT_EQ(parsed.tensors.size(), static_cast<size_t>(kTensors));
  for (int probe = 0; probe < 1000; ++probe) {
    const int i = static_cast<int>(rng() % kTensors);
    const Tensor& t = parsed.tensors.at("t" + std::to_string(i));
    ASSERT_EQ(t.shape(), Shape({1}));
    ASSERT_EQ(values_of<float>(t), std::vector<float>{values[static_cast<size_t>(i)]})
        << "t" << i;
  }
}

TEST(SafetensorsTest, RandomByteFlipsNeverCrash) {
  const Bytes valid = small_valid_file();
  std::mt19937_64 rng(31337);
  int parsed = 0;
  int refused = 0;
  for (int iteration = 0; iteration < 2000; ++iteration) {
    Bytes bytes = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      uint8_t& byte = bytes[rng() % bytes.size()];
      if (rng() % 2) {
        byte ^= static_cast<uint8_t>(1u << (rng() % 8));
      } else {
        byte = static_cast<uint8_t>(rng());
      }
    }
    try {
      const SafetensorsFile file = parse_safetensors(bytes, "flipped");
      for (const auto& [name, tensor] : file.tensors) {
        ASSERT_TRUE(tensor.is_contiguous()) << name;
        (void)bytes_of(tensor);  // every parsed tensor must be fully readable
      }
      ++parsed;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iteration << " threw a non-rd exception: " << e.what();
    }
  }
  // Flips in tensor data leave a valid file, flips in the header mostly do not: both
  // paths must have been exercised.
  EXPECT_GT(parsed, 0);
  EXPECT_GT(refused, 0);
}

TEST(SafetensorsTest, WriterRefusesBadNames) {
  std::map<std::string, Tensor> tensors{{"", empty({1})}};
  try {
    serialize_safetensors(tensors);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("empty"), std::string::npos) << e.what();
  }
  tensors = {{"__metadata__", empty({1})}};
  try {
    serialize_safetensors(tensors);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'__metadata__'"), std::string::npos) << e.what();
  }
  tensors = {{"undefined", Tensor()}};
  EXPECT_THROW(serialize_safetensors(tensors), Error);
}

// --- files ---

class SafetensorsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("rd_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::mt19937_64 rng(17);
    tensors_["a"] = tensor_from_bytes({2, 3}, DType::kFloat32, random_bytes(DType::kFloat32, 6, rng));
    tensors_["b"] = tensor_from_bytes({4}, DType::kInt64, random_bytes(DType::kInt64, 4, rng));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::recursive_directory_iterator(dir_)) {
      names.push_back(entry.path().lexically_relative(dir_).string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }
  static Bytes read_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
  std::map<std::string, Tensor> tensors_;
};

TEST_F(SafetensorsFileTest, SaveThenLoadRoundTrips) {
  const std::string path = (dir_ / "model.safetensors").string();
  save_safetensors(path, tensors_, {{"epoch", "3"}});
  EXPECT_EQ(entries(), std::vector<std::string>{"model.safetensors"}) << "no temporary left";
  EXPECT_EQ(read_file(path), serialize_safetensors(tensors_, {{"epoch", "3"}}));
  const SafetensorsFile file = load_safetensors(path);
  EXPECT_EQ(file.metadata.at("epoch"), "3");
  for (const auto& [name, tensor] : tensors_) {
    EXPECT_EQ(bytes_of(file.tensors.at(name)), bytes_of(tensor)) << name;
  }
}

TEST_F(SafetensorsFileTest, SaveReturnsTheSizeAndCrcOfWhatItWrote) {
  const std::string path = (dir_ / "model.safetensors").string();
  const FileDigest digest = save_safetensors(path, tensors_);
  const Bytes bytes = read_file(path);
  EXPECT_EQ(digest.bytes, bytes.size());
  EXPECT_EQ(digest.crc32, crc32_update(0, bytes));
}

// CRC-32 check values: the standard "123456789" vector, and piecewise == whole.
TEST(Crc32Test, MatchesTheStandardCheckValueAndContinues) {
  const std::string digits = "123456789";
  const std::span<const uint8_t> all(reinterpret_cast<const uint8_t*>(digits.data()), digits.size());
  EXPECT_EQ(crc32_update(0, all), 0xCBF43926u);
  EXPECT_EQ(crc32_update(0, {}), 0u);
  std::mt19937_64 rng(5);
  Bytes data(1000);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{500}, size_t{999}}) {
    const std::span<const uint8_t> whole(data);
    EXPECT_EQ(crc32_update(crc32_update(0, whole.first(cut)), whole.subspan(cut)),
              crc32_update(0, whole))
        << cut;
  }
}

TEST_F(SafetensorsFileTest, AnUncommittedWriterLeavesTheOldFile) {
  const fs::path path = dir_ / "state.bin";
  write_file_atomically(path.string(), Bytes{1, 2, 3});
  {
    AtomicFileWriter writer(path.string());
    writer.write(Bytes(1000, 7));
    // Destroyed without commit(): as an exception on the way would.
  }
  EXPECT_EQ(read_file(path), (Bytes{1, 2, 3}));
  EXPECT_EQ(entries(), std::vector<std::string>{"state.bin"}) << "no temporary left";
}

TEST_F(SafetensorsFileTest, SavingOverAnExistingFileReplacesItFully) {
  const fs::path path = dir_ / "model.safetensors";
  {
    std::ofstream old(path, std::ios::binary);
    old << std::string(100000, 'x');  // longer than the new content
  }
  save_safetensors(path.string(), tensors_);
  EXPECT_EQ(read_file(path), serialize_safetensors(tensors_));
  EXPECT_EQ(entries(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsFileTest, SavingIntoAMissingFolderIsAnIoError) {
  const std::string path = (dir_ / "missing" / "model.safetensors").string();
  try {
    save_safetensors(path, tensors_);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(entries().empty());
}

TEST_F(SafetensorsFileTest, FailedRenameRemovesTheTemporaryFile) {
  // The target is a non-empty folder: the temporary is written, then the rename fails.
  const fs::path path = dir_ / "model.safetensors";
  fs::create_directories(path / "inside");
  try {
    save_safetensors(path.string(), tensors_);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(), (std::vector<std::string>{"model.safetensors",
                                                 "model.safetensors/inside"}));
}

TEST_F(SafetensorsFileTest, LoadingAMissingFileIsAnIoError) {
  const std::string path = (dir_ / "absent.safetensors").string();
  try {
    load_safetensors(path);
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  try {
    load_safetensors(dir_.string());  // a folder
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsFileTest, LoadingACorruptFileNamesThePath) {
  const fs::path path = dir_ / "cut.safetensors";
  const Bytes valid = serialize_safetensors(tensors_);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(valid.data()),
              static_cast<std::streamsize>(valid.size() - 3));
  }
  try {
    load_safetensors(path.string());
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCorruptFile);
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rd
