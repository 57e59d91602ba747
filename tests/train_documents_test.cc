// Packed documents in rd_train's data: RDTOK version 2 (a document table), text and token
// datasets over several files and folders, separators (--documents), and the windows'
// document starts and unscored cross-document targets, each checked against a per-token
// document id computed here from the files themselves.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/train/dataset.h"
#include "ringdilated/train/token_file.h"
#include "ringdilated/train/tokenizer.h"
#include "testing/raises.h"
#include "testing/temp_dir.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;
using rd::test::raises;
using Bytes = std::vector<uint8_t>;

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const Bytes& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

uint64_t load_le64(const Bytes& bytes, size_t at) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[at + static_cast<size_t>(i)];
  return value;
}

DatasetOptions window_options(int64_t seq_len, const std::string& documents) {
  DatasetOptions options;
  options.task.seq_len = seq_len;
  options.seed = 77;
  options.val_fraction = 0.1;
  options.documents = documents;
  return options;
}

// Letters without the separator byte, so documents end only where a test puts a separator.
Bytes random_letters(size_t count, std::mt19937_64& rng) {
  Bytes bytes(count);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>('a' + rng() % 26);
  return bytes;
}

// The reference: the document of every token of the stream, from where documents start.
std::vector<int64_t> document_ids(int64_t tokens, const std::vector<int64_t>& starts) {
  std::vector<int64_t> ids(static_cast<size_t>(tokens), 0);
  for (int64_t i = 1; i < tokens; ++i) {
    const bool starts_here = std::ranges::binary_search(starts, i);
    ids[static_cast<size_t>(i)] = ids[static_cast<size_t>(i - 1)] + (starts_here ? 1 : 0);
  }
  return ids;
}

// Each sample of `batch`, read from window starts `window_starts`, carries the starts of the
// documents of its inputs and leaves unscored the targets in another document than their
// input; everything else scored, with the stream's tokens.
void expect_windows_follow_documents(const Batch& batch, const std::vector<int64_t>& window_starts,
                                     const std::vector<int64_t>& ids,
                                     const std::vector<int32_t>& stream) {
  const int64_t seq_len = batch.seq_len;
  ASSERT_EQ(batch.documents.size(), static_cast<size_t>(batch.batch_size));
  for (int64_t row = 0; row < batch.batch_size; ++row) {
    const int64_t start = window_starts[static_cast<size_t>(row)];
    std::vector<int64_t> want_starts = {0};
    for (int64_t i = 1; i < seq_len; ++i) {
      if (ids[static_cast<size_t>(start + i)] != ids[static_cast<size_t>(start + i - 1)]) {
        want_starts.push_back(i);
      }
    }
    EXPECT_EQ(batch.documents[static_cast<size_t>(row)], want_starts) << "window at " << start;
    for (int64_t i = 0; i < seq_len; ++i) {
      const size_t at = static_cast<size_t>(row * seq_len + i);
      const auto here = static_cast<size_t>(start + i);
      EXPECT_EQ(batch.inputs[at], stream[here]);
      const bool crosses = ids[here + 1] != ids[here];
      EXPECT_EQ(batch.targets[at], crosses ? kIgnoreIndex : stream[here + 1])
          << "window at " << start << ", position " << i;
      EXPECT_EQ(batch.answer[at], crosses ? 0 : 1);
    }
  }
}

class TrainDocumentsTest : public ::testing::Test {
 protected:
  test::TestTempDir temp_;
  fs::path dir_ = temp_.path();
};

TEST_F(TrainDocumentsTest, TokenFilesCarryTheirDocumentTable) {
  std::mt19937_64 rng(3);
  std::vector<int32_t> tokens(500);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 1000);
  const std::vector<int64_t> starts = {0, 17, 18, 250, 499};
  const std::string path = (dir_ / "docs.rdtok").string();
  write_token_file(path, tokens, 1000, std::nullopt, starts);
  const Bytes bytes = read_bytes(path);
  // Version 2: the document count at 32, the tokens from 40, the table after them.
  ASSERT_EQ(bytes.size(), 40 + tokens.size() * 2 + starts.size() * 8);
  EXPECT_EQ(bytes[8], 2);
  EXPECT_EQ(load_le64(bytes, 32), starts.size());
  EXPECT_EQ(bytes[40] | (bytes[41] << 8), tokens[0]);
  for (size_t i = 0; i < starts.size(); ++i) {
    EXPECT_EQ(load_le64(bytes, 40 + tokens.size() * 2 + 8 * i), static_cast<uint64_t>(starts[i]));
  }
  const TokenSource source = TokenSource::open_token_file(path);
  EXPECT_EQ(source.document_starts(), starts);
  std::vector<int32_t> back(tokens.size());
  source.read(0, back);
  EXPECT_EQ(back, tokens);

  // Without a table: version 1, one document.
  write_token_file(path, tokens, 1000);
  EXPECT_EQ(read_bytes(path)[8], 1);
  EXPECT_EQ(TokenSource::open_token_file(path).document_starts(), std::vector<int64_t>{0});
}

TEST_F(TrainDocumentsTest, BadDocumentTablesAreRefused) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  const std::string path = (dir_ / "bad.rdtok").string();
  struct Case {
    std::vector<int64_t> starts;
    const char* says;
  };
  for (const Case& c : {Case{{1, 2}, "document start 0 is 1"}, Case{{0, 2, 2}, "start 2 is 2"},
                        Case{{0, 4}, "start 1 is 4"}}) {
    EXPECT_TRUE(raises([&] { write_token_file(path, tokens, 10, std::nullopt, c.starts); },
                       {ErrorCode::kInvalidArgument}, {"write_token_file", c.says}));
  }
  write_token_file(path, tokens, 10, std::nullopt, std::vector<int64_t>{0, 2});
  const Bytes good = read_bytes(path);
  const auto damaged = [&](const std::string& name, auto&& edit) {
    Bytes copy = good;
    edit(copy);
    write_bytes(dir_ / name, copy);
    return (dir_ / name).string();
  };
  const std::string decreasing = damaged("decreasing.rdtok", [](Bytes& b) { b[b.size() - 8] = 0; });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(decreasing); }, {ErrorCode::kCorruptFile},
                     {decreasing, "start 1 is 0"}));
  const std::string count = damaged("count.rdtok", [](Bytes& b) { b[32] = 3; });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(count); }, {ErrorCode::kCorruptFile},
                     {count, "3 document starts"}));
  const std::string empty_table = damaged("empty.rdtok", [](Bytes& b) {
    b[32] = 0;
    b.resize(b.size() - 16);
  });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(empty_table); }, {ErrorCode::kCorruptFile},
                     {empty_table, "empty document table"}));
}

TEST_F(TrainDocumentsTest, FoldersAndListsOfFilesAreDocumentsInOrder) {
  std::mt19937_64 rng(5);
  // Name order, nested folders included; an empty file adds no document.
  const std::vector<std::string> names = {"a.txt", "b/c.txt", "b/d.txt", "e.txt", "f.txt"};
  const std::vector<size_t> sizes = {40, 300, 0, 77, 150};
  std::vector<int32_t> stream;
  std::vector<int64_t> starts;
  for (size_t i = 0; i < names.size(); ++i) {
    const Bytes bytes = random_letters(sizes[i], rng);
    write_bytes(dir_ / "corpus" / names[i], bytes);
    if (!bytes.empty()) starts.push_back(static_cast<int64_t>(stream.size()));
    stream.insert(stream.end(), bytes.begin(), bytes.end());
  }
  const auto data = make_dataset("text:" + (dir_ / "corpus").string(), window_options(32, "auto"));
  const auto& windows = dynamic_cast<const WindowDataset&>(*data);
  EXPECT_TRUE(windows.packs_documents());
  EXPECT_EQ(windows.document_starts(), starts);
  // Reads span files as one stream.
  const TokenSource source = TokenSource::open_text((dir_ / "corpus" / "b" / "c.txt").string());
  EXPECT_EQ(source.size(), 300);
  const auto listed = make_dataset(
      "text:" + (dir_ / "corpus" / "a.txt").string() + "," + (dir_ / "corpus" / "b").string(),
      window_options(16, "auto"));
  EXPECT_EQ(dynamic_cast<const WindowDataset&>(*listed).document_starts(),
            (std::vector<int64_t>{0, 40}));

  const std::vector<int64_t> ids = document_ids(static_cast<int64_t>(stream.size()), starts);
  auto training = make_dataset("text:" + (dir_ / "corpus").string(), window_options(32, "auto"));
  const auto& train_windows = dynamic_cast<const WindowDataset&>(*training);
  const Batch batch = training->next_batch(train_windows.train_windows());
  std::vector<int64_t> window_starts;
  for (int64_t w = 0; w < train_windows.train_windows(); ++w) {
    window_starts.push_back(train_windows.train_window_start(0, w));
  }
  expect_windows_follow_documents(batch, window_starts, ids, stream);
  const Batch eval = training->eval_batch(1, 0);
  expect_windows_follow_documents(eval, {train_windows.val_begin()}, ids, stream);
}

TEST_F(TrainDocumentsTest, SeparatorsAndEndTokensStartDocumentsAfterThem) {
  std::mt19937_64 rng(8);
  std::vector<int32_t> stream;
  std::vector<int64_t> starts = {0};
  for (int doc = 0; doc < 30; ++doc) {
    const Bytes bytes = random_letters(1 + rng() % 60, rng);
    stream.insert(stream.end(), bytes.begin(), bytes.end());
    stream.push_back('\n');
    stream.push_back('\n');
    starts.push_back(static_cast<int64_t>(stream.size()));
  }
  starts.pop_back();  // the file ends with a separator: no document after it
  write_bytes(dir_ / "sep.txt", Bytes(stream.begin(), stream.end()));
  const std::string text = "text:" + (dir_ / "sep.txt").string();
  auto data = make_dataset(text, window_options(64, "separator:\\n\\n"));
  EXPECT_EQ(dynamic_cast<const WindowDataset&>(*data).document_starts(), starts);
  // One newline ends a document too with eos:10; \x0a is the same byte.
  std::vector<int64_t> every_newline;
  for (size_t i = 0; i + 1 < stream.size(); ++i) {
    if (stream[i] == '\n') every_newline.push_back(static_cast<int64_t>(i + 1));
  }
  every_newline.insert(every_newline.begin(), 0);
  for (const char* spec : {"eos:10", "separator:\\x0a"}) {
    auto split = make_dataset(text, window_options(64, spec));
    EXPECT_EQ(dynamic_cast<const WindowDataset&>(*split).document_starts(), every_newline) << spec;
  }
  const std::vector<int64_t> ids = document_ids(static_cast<int64_t>(stream.size()), starts);
  const auto& windows = dynamic_cast<const WindowDataset&>(*data);
  const Batch batch = data->next_batch(5);
  std::vector<int64_t> window_starts;
  for (int64_t w = 0; w < 5; ++w) window_starts.push_back(windows.train_window_start(0, w));
  expect_windows_follow_documents(batch, window_starts, ids, stream);

  // End tokens in a token file, on top of its table.
  std::vector<int32_t> tokens(400);
  for (int32_t& t : tokens) t = static_cast<int32_t>(1 + rng() % 500);
  tokens[100] = tokens[101] = tokens[399] = 0;
  write_token_file((dir_ / "eos.rdtok").string(), tokens, 501, std::nullopt,
                   std::vector<int64_t>{0, 50});
  auto eos = make_dataset("tokens:" + (dir_ / "eos.rdtok").string(), window_options(16, "eos:0"));
  EXPECT_EQ(dynamic_cast<const WindowDataset&>(*eos).document_starts(),
            (std::vector<int64_t>{0, 50, 101, 102}));
}

TEST_F(TrainDocumentsTest, OneDocumentOrOffPacksNothingAndReadsAsBefore) {
  std::mt19937_64 rng(2);
  const Bytes bytes = random_letters(2000, rng);
  write_bytes(dir_ / "one.txt", bytes);
  write_bytes(dir_ / "two.txt", bytes);
  const std::string one = "text:" + (dir_ / "one.txt").string();
  const std::string two = one + "," + (dir_ / "two.txt").string();
  auto single = make_dataset(one, window_options(64, "auto"));
  auto off = make_dataset(two, window_options(64, "off"));
  EXPECT_FALSE(single->packs_documents());
  EXPECT_FALSE(off->packs_documents());
  const Batch batch = single->next_batch(4);
  EXPECT_TRUE(batch.documents.empty());
  EXPECT_EQ(std::ranges::count(batch.targets, kIgnoreIndex), 0);
  EXPECT_TRUE(off->next_batch(4).documents.empty());
  EXPECT_TRUE(make_dataset(two, window_options(64, "auto"))->packs_documents());
}

TEST_F(TrainDocumentsTest, BadDocumentOptionsAreNamed) {
  write_bytes(dir_ / "x.txt", Bytes(100, 'x'));
  const std::string text = "text:" + (dir_ / "x.txt").string();
  struct Case {
    const char* spec;
    const char* says;
  };
  for (const Case& c :
       {Case{"bogus", "expected auto, off"}, Case{"separator:", "is empty"},
        Case{"separator:a\\q", "unknown escape"}, Case{"separator:\\x4", "two hex digits"},
        Case{"separator:ab\\", "lone backslash"}, Case{"eos:-1", "whole number"},
        Case{"eos:", "whole number"}, Case{"eos:3x", "whole number"},
        Case{"eos:4294967296", "whole number"}}) {
    EXPECT_TRUE(raises([&] { make_dataset(text, window_options(8, c.spec)); },
                       {ErrorCode::kInvalidArgument}, {"--documents=", c.spec, c.says}))
        << c.spec;
  }
  write_token_file((dir_ / "t.rdtok").string(), std::vector<int32_t>(100, 1), 10);
  EXPECT_TRUE(raises(
      [&] {
        make_dataset("tokens:" + (dir_ / "t.rdtok").string(), window_options(8, "separator:x"));
      },
      {ErrorCode::kInvalidArgument}, {"--documents=separator:x", "eos:<token id>"}));
  EXPECT_TRUE(raises([&] { make_dataset(text, window_options(8, "eos:300")); },
                     {ErrorCode::kInvalidArgument},
                     {"--documents", "token 300", "vocabulary [0, 260)"}));
  fs::create_directories(dir_ / "nothing");
  EXPECT_TRUE(raises(
      [&] { make_dataset("text:" + (dir_ / "nothing").string(), window_options(8, "auto")); },
      {ErrorCode::kInvalidArgument}, {"holds no files"}));
  write_token_file((dir_ / "v20.rdtok").string(), std::vector<int32_t>(100, 1), 20);
  EXPECT_TRUE(raises(
      [&] {
        make_dataset("tokens:" + (dir_ / "t.rdtok").string() + "," + (dir_ / "v20.rdtok").string(),
                     window_options(8, "auto"));
      },
      {ErrorCode::kInvalidArgument}, {"vocab size 20", "share one"}));
}

}  // namespace
}  // namespace rd::train
