// Tests of rd_train's data: the byte tokenizer, the synthetic tasks (determinism and layout,
// checked by parsing the decoded text independently), accuracy counting, windows of text
// and RDTOK files (split disjointness, coverage, shuffling, resumable state) and the errors
// for bad files.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/train/dataset.h"
#include "ringdilated/train/synthetic_tasks.h"
#include "ringdilated/train/token_file.h"
#include "ringdilated/train/tokenizer.h"
#include "testing/raises.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;
using rd::test::raises;
using Bytes = std::vector<uint8_t>;

constexpr Task kAllTasks[] = {Task::kPasskey, Task::kMqar, Task::kCopy};
constexpr uint64_t kSeed = 1234;

TaskOptions options_with_seq_len(int64_t seq_len) {
  TaskOptions options;
  options.seq_len = seq_len;
  return options;
}

std::string decode(const std::vector<int32_t>& tokens, size_t begin, size_t end) {
  return ByteTokenizer::decode(std::span<const int32_t>(tokens).subspan(begin, end - begin));
}

// The positions whose answer flag is set.
std::vector<size_t> answer_positions(const TaskTokens& t) {
  std::vector<size_t> positions;
  for (size_t i = 0; i < t.answer.size(); ++i) {
    if (t.answer[i]) positions.push_back(i);
  }
  return positions;
}

size_t count_occurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// --- tokenizer ---

TEST(ByteTokenizer, EveryByteRoundTripsAndSpecialsHaveNames) {
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  const std::vector<int32_t> tokens = ByteTokenizer::encode(all_bytes);
  ASSERT_EQ(tokens.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[b], b);
  EXPECT_EQ(ByteTokenizer::decode(tokens), all_bytes);

  const std::vector<int32_t> mixed = {ByteTokenizer::kBos, 'h', 'i', ByteTokenizer::kSep,
                                      ByteTokenizer::kEos, ByteTokenizer::kPad, kIgnoreIndex,
                                      ByteTokenizer::kVocabSize};
  EXPECT_EQ(ByteTokenizer::decode(mixed), "<bos>hi<sep><eos><pad><ignore><?260>");
  EXPECT_EQ(ByteTokenizer::vocab_size(), 260);
  // Every special token lies inside the vocabulary and outside the bytes.
  for (int32_t special : {ByteTokenizer::kBos, ByteTokenizer::kEos, ByteTokenizer::kPad,
                          ByteTokenizer::kSep}) {
    EXPECT_FALSE(ByteTokenizer::is_byte(special));
    EXPECT_LT(special, ByteTokenizer::vocab_size());
  }
}

// --- synthetic tasks: determinism ---

TEST(SyntheticTasks, SameKeyGivesSameSampleAndOtherKeysDiffer) {
  const TaskOptions options = options_with_seq_len(400);
  for (Task task : kAllTasks) {
    SCOPED_TRACE(std::string(task_name(task)));
    const TaskTokens a = generate_task(task, options, kSeed, SampleStream::kTrain, 7);
    const TaskTokens again = generate_task(task, options, kSeed, SampleStream::kTrain, 7);
    EXPECT_EQ(a.tokens, again.tokens);
    EXPECT_EQ(a.answer, again.answer);
    EXPECT_NE(a.tokens, generate_task(task, options, kSeed, SampleStream::kTrain, 8).tokens);
    EXPECT_NE(a.tokens, generate_task(task, options, kSeed + 1, SampleStream::kTrain, 7).tokens);
    EXPECT_NE(a.tokens, generate_task(task, options, kSeed, SampleStream::kEval, 7).tokens);
  }
}

TEST(SyntheticTasks, EverySampleHasSeqLenPlusOneTokensStartingWithBos) {
  for (Task task : kAllTasks) {
    for (int64_t seq_len : {min_seq_len(task, TaskOptions{}), int64_t{401}, int64_t{1000}}) {
      SCOPED_TRACE(std::string(task_name(task)) + " seq_len " + std::to_string(seq_len));
      const TaskTokens t =
          generate_task(task, options_with_seq_len(seq_len), kSeed, SampleStream::kTrain, 3);
      ASSERT_EQ(static_cast<int64_t>(t.tokens.size()), seq_len + 1);
      ASSERT_EQ(t.answer.size(), t.tokens.size());
      EXPECT_EQ(t.tokens[0], ByteTokenizer::kBos);
      EXPECT_FALSE(answer_positions(t).empty());
    }
  }
}

// --- synthetic tasks: layout ---

TEST(SyntheticTasks, PasskeyAppearsOnceInTheContextAndIsTheAnswerAtTheEnd) {
  TaskOptions options = options_with_seq_len(400);
  options.passkey_digits = 6;
  const std::string question = "What is the pass key? The pass key is ";
  int64_t min_depth = options.seq_len, max_depth = 0;
  for (uint64_t index = 0; index < 200; ++index) {
    const TaskTokens t = generate_task(Task::kPasskey, options, kSeed, SampleStream::kTrain, index);
    const size_t total = t.tokens.size();
    const size_t digits = static_cast<size_t>(options.passkey_digits);
    // The answer: exactly the last `digits` tokens, all decimal digits.
    std::vector<size_t> expected_positions(digits);
    for (size_t i = 0; i < digits; ++i) expected_positions[i] = total - digits + i;
    ASSERT_EQ(answer_positions(t), expected_positions);
    const std::string key = decode(t.tokens, total - digits, total);
    ASSERT_TRUE(std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }))
        << key;
    // The question right before it, and the key exactly once in the context before that.
    const std::string before = decode(t.tokens, 1, total - digits);
    ASSERT_TRUE(before.ends_with(question)) << before;
    const std::string context = before.substr(0, before.size() - question.size());
    EXPECT_EQ(count_occurrences(context, key), 1u) << context;
    EXPECT_EQ(std::count_if(context.begin(), context.end(),
                            [](char c) { return c >= '0' && c <= '9'; }),
              options.passkey_digits)
        << "the only digits of the context are the key's";
    const size_t depth = context.find("The pass key is " + key + ".");
    ASSERT_NE(depth, std::string::npos) << context;
    min_depth = std::min<int64_t>(min_depth, depth);
    max_depth = std::max<int64_t>(max_depth, depth);
  }
  // The key's position varies over (nearly) the whole context.
  EXPECT_LT(min_depth, options.seq_len / 10);
  EXPECT_GT(max_depth, options.seq_len * 6 / 10);
}

TEST(SyntheticTasks, MqarQueriesAnswerWithTheirPairsValues) {
  TaskOptions options = options_with_seq_len(512);
  options.mqar_pairs = 20;
  options.mqar_queries = 6;
  options.mqar_key_len = 3;
  options.mqar_value_len = 2;
  const size_t pair_len = 3 + 1 + 2 + 1;
  for (uint64_t index = 0; index < 50; ++index) {
    const TaskTokens t = generate_task(Task::kMqar, options, kSeed, SampleStream::kTrain, index);
    const auto sep = std::find(t.tokens.begin(), t.tokens.end(), ByteTokenizer::kSep);
    ASSERT_NE(sep, t.tokens.end());
    const size_t sep_at = static_cast<size_t>(sep - t.tokens.begin());
    // Pairs "kkk:vv " from token 1 on; keys distinct.
    std::map<std::string, std::string> pairs;
    for (int64_t p = 0; p < options.mqar_pairs; ++p) {
      const std::string pair = decode(t.tokens, 1 + p * pair_len, 1 + (p + 1) * pair_len);
      ASSERT_EQ(pair[3], ':');
      ASSERT_EQ(pair[6], ' ');
      ASSERT_TRUE(pairs.emplace(pair.substr(0, 3), pair.substr(4, 2)).second) << "duplicate key";
    }
    // Queries after <sep>, to the very end; the answer flags cover exactly their values.
    ASSERT_EQ(t.tokens.size() - sep_at - 1, options.mqar_queries * pair_len);
    std::vector<size_t> expected_answers;
    std::set<std::string> queried;
    for (int64_t q = 0; q < options.mqar_queries; ++q) {
      const size_t begin = sep_at + 1 + q * pair_len;
      const std::string query = decode(t.tokens, begin, begin + pair_len);
      const std::string key = query.substr(0, 3);
      ASSERT_TRUE(pairs.contains(key)) << query;
      EXPECT_EQ(query.substr(4, 2), pairs[key]);
      EXPECT_TRUE(queried.insert(key).second) << "a key is queried twice";
      expected_answers.push_back(begin + 4);
      expected_answers.push_back(begin + 5);
    }
    EXPECT_EQ(answer_positions(t), expected_answers);
  }
}

TEST(SyntheticTasks, CopyRepeatsTheStringAfterTheSeparator) {
  for (int64_t copy_length : {int64_t{0}, int64_t{50}}) {
    TaskOptions options = options_with_seq_len(201);
    options.copy_length = copy_length;
    const size_t length = copy_length > 0 ? copy_length : 100;
    const TaskTokens t = generate_task(Task::kCopy, options, kSeed, SampleStream::kEval, 5);
    ASSERT_EQ(t.tokens[1 + length], ByteTokenizer::kSep);
    EXPECT_EQ(decode(t.tokens, 1, 1 + length), decode(t.tokens, 2 + length, 2 + 2 * length));
    std::vector<size_t> expected(length);
    for (size_t i = 0; i < length; ++i) expected[i] = 2 + length + i;
    EXPECT_EQ(answer_positions(t), expected);
    // What is left: <eos>, then padding.
    if (t.tokens.size() > 2 + 2 * length) {
      EXPECT_EQ(t.tokens[2 + 2 * length], ByteTokenizer::kEos);
    }
    for (size_t i = 3 + 2 * length; i < t.tokens.size(); ++i) {
      EXPECT_EQ(t.tokens[i], ByteTokenizer::kPad);
    }
  }
}

TEST(SyntheticTasks, SamplesShiftTargetsByOneAndIgnoreNonAnswersWhenAsked) {
  const TaskTokens t =
      generate_task(Task::kMqar, options_with_seq_len(400), kSeed, SampleStream::kTrain, 1);
  const Sample all = make_sample(t, LossOn::kAll);
  const Sample answers = make_sample(t, LossOn::kAnswers);
  const size_t seq_len = t.tokens.size() - 1;
  ASSERT_EQ(all.inputs.size(), seq_len);
  ASSERT_EQ(all.targets.size(), seq_len);
  EXPECT_EQ(answers.inputs, all.inputs);
  EXPECT_EQ(answers.answer, all.answer);
  for (size_t i = 0; i < seq_len; ++i) {
    EXPECT_EQ(all.inputs[i], t.tokens[i]);
    EXPECT_EQ(all.targets[i], t.tokens[i + 1]);
    EXPECT_EQ(all.answer[i], t.answer[i + 1]);
    EXPECT_EQ(answers.targets[i], t.answer[i + 1] ? t.tokens[i + 1] : kIgnoreIndex);
  }
}

TEST(SyntheticTasks, OptionsThatDoNotFitAreRefusedByName) {
  TaskOptions options = options_with_seq_len(20);
  EXPECT_TRUE(raises([&] { check_task_options(Task::kPasskey, options); },
                     {ErrorCode::kInvalidArgument}, {"passkey", "seq_len 20", "at least"}));
  options = options_with_seq_len(4096);
  options.mqar_queries = options.mqar_pairs + 1;
  EXPECT_TRUE(raises([&] { check_task_options(Task::kMqar, options); },
                     {ErrorCode::kInvalidArgument}, {"mqar_queries", "mqar_pairs"}));
  options = options_with_seq_len(4096);
  options.mqar_key_len = 1;  // 26 keys cannot hold 32 distinct pairs
  EXPECT_TRUE(raises([&] { check_task_options(Task::kMqar, options); },
                     {ErrorCode::kInvalidArgument}, {"mqar_key_len", "32"}));
}

// --- batches and accuracy ---

TEST(SyntheticDataset, BatchesFollowTheSampleIndexAndEvalIsASeparateStream) {
  DatasetOptions options;
  options.task = options_with_seq_len(128);
  options.seed = kSeed;
  SyntheticDataset data(Task::kCopy, options);
  EXPECT_EQ(data.name(), "copy");
  EXPECT_EQ(data.vocab_size(), ByteTokenizer::kVocabSize);
  const Batch first = data.next_batch(3);
  const Batch second = data.next_batch(2);
  EXPECT_EQ(data.state(), (DataState{0, 5}));
  // Row b of the second batch is training sample 3 + b.
  for (int64_t b = 0; b < 2; ++b) {
    const Sample expected = make_sample(
        generate_task(Task::kCopy, options.task, kSeed, SampleStream::kTrain, 3 + b),
        options.loss_on);
    EXPECT_TRUE(std::equal(expected.inputs.begin(), expected.inputs.end(),
                           second.inputs.begin() + b * 128));
    EXPECT_TRUE(std::equal(expected.targets.begin(), expected.targets.end(),
                           second.targets.begin() + b * 128));
  }
  const Batch eval = data.eval_batch(3, 0);
  EXPECT_EQ(data.state(), (DataState{0, 5})) << "eval must not move the training stream";
  EXPECT_NE(eval.inputs, first.inputs);
  EXPECT_EQ(eval.inputs, data.eval_batch(3, 0).inputs);
  // Eval batch 1 of size 2 holds eval samples 2 and 3: the tail of batch 0 of size 4.
  const Batch eval4 = data.eval_batch(4, 0);
  const Batch eval_tail = data.eval_batch(2, 1);
  EXPECT_TRUE(std::equal(eval_tail.inputs.begin(), eval_tail.inputs.end(),
                         eval4.inputs.begin() + 2 * 128));
}

TEST(SyntheticDataset, RestoredStateContinuesTheSameStream) {
  DatasetOptions options;
  options.task = options_with_seq_len(200);
  options.seed = 99;
  SyntheticDataset a(Task::kPasskey, options);
  a.next_batch(4);
  const DataState saved = a.state();
  const Batch expected = a.next_batch(3);
  SyntheticDataset b(Task::kPasskey, options);
  b.set_state(saved);
  const Batch resumed = b.next_batch(3);
  EXPECT_EQ(resumed.inputs, expected.inputs);
  EXPECT_EQ(resumed.targets, expected.targets);
  EXPECT_TRUE(raises([&] { b.set_state({1, 0}); }, {ErrorCode::kInvalidArgument},
                     {"set_state", "epoch 1"}));
}

TEST(Batch, ToTensorsGivesInt64BatchBySeqLen) {
  DatasetOptions options;
  options.task = options_with_seq_len(64);
  options.task.mqar_pairs = 4;
  options.task.mqar_queries = 2;
  SyntheticDataset small(Task::kMqar, options);
  const Batch batch = small.next_batch(3);
  const Batch::Tensors tensors = batch.to_tensors();
  EXPECT_EQ(tensors.inputs.shape(), Shape({3, 64}));
  EXPECT_EQ(tensors.targets.dtype(), DType::kInt64);
  EXPECT_EQ(tensors.inputs.device(), Device::cpu());
  const std::vector<int64_t> inputs = tensors.inputs.to_vector<int64_t>();
  const std::vector<int64_t> targets = tensors.targets.to_vector<int64_t>();
  EXPECT_TRUE(std::equal(inputs.begin(), inputs.end(), batch.inputs.begin()));
  EXPECT_TRUE(std::equal(targets.begin(), targets.end(), batch.targets.begin()));
}

TEST(Accuracy, CountsAnswerTokensAndExactMatches) {
  // Two samples of 4 positions; answers at positions 2, 3 of sample 0 and 1..3 of sample 1.
  Batch batch{2, 4, {}, {}, {}, {}};
  batch.inputs = {1, 2, 3, 4, 5, 6, 7, 8};
  batch.targets = {kIgnoreIndex, kIgnoreIndex, 30, 40, kIgnoreIndex, 60, 70, 80};
  batch.answer = {0, 0, 1, 1, 0, 1, 1, 1};
  // Right on every answer, wrong elsewhere: all correct.
  std::vector<int64_t> predictions = {9, 9, 30, 40, 9, 60, 70, 80};
  AccuracyCounts counts = score_predictions(batch, std::span<const int64_t>(predictions));
  EXPECT_EQ(counts.correct_tokens, 5);
  EXPECT_EQ(counts.answer_tokens, 5);
  EXPECT_DOUBLE_EQ(counts.exact_match(), 1.0);
  // One wrong answer token in sample 1: 4 of 5 tokens, 1 of 2 samples.
  predictions[6] = 71;
  counts = score_predictions(batch, std::span<const int64_t>(predictions));
  EXPECT_DOUBLE_EQ(counts.token_accuracy(), 4.0 / 5.0);
  EXPECT_DOUBLE_EQ(counts.exact_match(), 0.5);
  // The int32 and tensor overloads agree.
  const std::vector<int32_t> narrow(predictions.begin(), predictions.end());
  const AccuracyCounts from_int32 = score_predictions(batch, std::span<const int32_t>(narrow));
  const AccuracyCounts from_tensor =
      score_predictions(batch, from_vector(predictions, {2, 4}));
  for (const AccuracyCounts& c : {from_int32, from_tensor}) {
    EXPECT_EQ(c.correct_tokens, 4);
    EXPECT_EQ(c.exact_samples, 1);
    EXPECT_EQ(c.samples, 2);
  }
  AccuracyCounts sum = counts;
  sum += counts;
  EXPECT_EQ(sum.answer_tokens, 10);
  EXPECT_DOUBLE_EQ(sum.token_accuracy(), 0.8);
  EXPECT_DOUBLE_EQ(AccuracyCounts{}.token_accuracy(), 0.0);
  EXPECT_TRUE(raises([&] { score_predictions(batch, from_vector(predictions, {8})); },
                     {ErrorCode::kShapeMismatch}, {"score_predictions", "[8]", "[2, 4]"}));
}

// --- files ---

class TrainDataFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("rd_train_data_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const Bytes& bytes) const {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  static Bytes random_bytes(size_t count, uint64_t seed) {
    std::mt19937_64 rng(seed);
    Bytes bytes(count);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    return bytes;
  }

  static Bytes read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  static DatasetOptions text_options(int64_t seq_len, double val_fraction) {
    DatasetOptions options;
    options.task.seq_len = seq_len;
    options.seed = kSeed;
    options.val_fraction = val_fraction;
    return options;
  }

  fs::path dir_;
};

TEST_F(TrainDataFileTest, TextWindowsCoverTheTrainSplitOncePerEpochAndNeverTheValidation) {
  const int64_t seq_len = 16;
  const Bytes file = random_bytes(1000, 1);
  const std::string path = write("corpus.txt", file);
  auto data = make_dataset("text:" + path, text_options(seq_len, 0.1));
  auto* windows = dynamic_cast<WindowDataset*>(data.get());
  ASSERT_NE(windows, nullptr);
  EXPECT_EQ(data->name(), "text:" + path);
  EXPECT_EQ(data->vocab_size(), ByteTokenizer::kVocabSize);
  // 100 validation tokens at the end; 900 training tokens hold (900 - 1) / 16 windows.
  EXPECT_EQ(windows->val_begin(), 900);
  EXPECT_EQ(windows->train_windows(), 56);
  EXPECT_EQ(data->eval_size(), (99 / 16));

  // One epoch, batch by batch: every window start once, each window wholly in the train
  // split, with the file's bytes.
  const int64_t train_windows = windows->train_windows();
  std::set<int64_t> starts;
  std::vector<int64_t> order;
  for (int64_t i = 0; i < train_windows; ++i) {
    const Batch batch = data->next_batch(1);
    const int64_t start = windows->train_window_start(0, i);
    ASSERT_EQ(start % seq_len, 0);
    ASSERT_LE(start + seq_len + 1, windows->val_begin());
    starts.insert(start);
    order.push_back(start);
    for (int64_t t = 0; t < seq_len; ++t) {
      ASSERT_EQ(batch.inputs[t], file[start + t]);
      ASSERT_EQ(batch.targets[t], file[start + t + 1]);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(starts.size()), train_windows);
  EXPECT_EQ(*starts.rbegin(), (train_windows - 1) * seq_len);
  EXPECT_EQ(data->state(), (DataState{0, train_windows}));
  // Shuffled, and differently in the next epoch.
  EXPECT_FALSE(std::is_sorted(order.begin(), order.end()));
  std::vector<int64_t> next_epoch;
  for (int64_t i = 0; i < train_windows; ++i) {
    next_epoch.push_back(windows->train_window_start(1, i));
  }
  EXPECT_NE(next_epoch, order);
  data->next_batch(1);
  EXPECT_EQ(data->state(), (DataState{1, 1}));

  // Validation windows in file order from val_begin, wrapping around.
  const int64_t val_windows = *data->eval_size();
  const Batch eval = data->eval_batch(val_windows + 1, 0);
  for (int64_t w = 0; w <= val_windows; ++w) {
    const int64_t start = windows->val_begin() + (w % val_windows) * seq_len;
    for (int64_t t = 0; t < seq_len; ++t) {
      ASSERT_EQ(eval.inputs[w * seq_len + t], file[start + t]);
      ASSERT_EQ(eval.targets[w * seq_len + t], file[start + t + 1]);
    }
  }
  EXPECT_TRUE(std::all_of(eval.answer.begin(), eval.answer.end(), [](uint8_t a) { return a; }));
}

TEST_F(TrainDataFileTest, WindowOrderIsAPermutationForAnyCount) {
  const int64_t seq_len = 4;
  for (int64_t windows : {1, 2, 3, 5, 17, 64, 65, 1000}) {
    const std::string path = write("w.txt", random_bytes(windows * seq_len + 1, windows));
    WindowDataset data(TokenSource::open_text(path), "w", text_options(seq_len, 0.0));
    ASSERT_EQ(data.train_windows(), windows);
    std::set<int64_t> starts;
    for (int64_t i = 0; i < windows; ++i) starts.insert(data.train_window_start(3, i) / seq_len);
    EXPECT_EQ(static_cast<int64_t>(starts.size()), windows) << windows << " windows";
    EXPECT_EQ(*starts.rbegin(), windows - 1);
    EXPECT_TRUE(raises([&] { data.eval_batch(1, 0); }, {ErrorCode::kInvalidArgument},
                       {"no validation split"}));
  }
}

TEST_F(TrainDataFileTest, RestoredStateContinuesAcrossEpochsBitForBit) {
  const std::string path = write("corpus.txt", random_bytes(300, 2));
  const DatasetOptions options = text_options(32, 0.2);
  auto a = make_dataset("text:" + path, options);
  for (int i = 0; i < 3; ++i) a->next_batch(3);  // 7 windows an epoch: into epoch 1
  const DataState saved = a->state();
  EXPECT_EQ(saved, (DataState{1, 2}));
  std::vector<Batch> expected;
  for (int i = 0; i < 4; ++i) expected.push_back(a->next_batch(3));
  auto b = make_dataset("text:" + path, options);
  b->set_state(saved);
  for (const Batch& batch : expected) {
    const Batch resumed = b->next_batch(3);
    EXPECT_EQ(resumed.inputs, batch.inputs);
    EXPECT_EQ(resumed.targets, batch.targets);
  }
  EXPECT_EQ(b->state(), a->state());
  // Another seed shuffles differently.
  DatasetOptions other = options;
  other.seed = kSeed + 1;
  auto c = make_dataset("text:" + path, other);
  auto d = make_dataset("text:" + path, options);
  EXPECT_NE(c->next_batch(7).inputs, d->next_batch(7).inputs);
  EXPECT_TRUE(raises([&] { b->set_state({0, 8}); }, {ErrorCode::kInvalidArgument},
                     {"set_state", "index 8"}));
}

TEST_F(TrainDataFileTest, TokenFilesRoundTripInBothWidths) {
  struct Case {
    int64_t vocab_size;
    TokenDType stored;
  };
  for (const Case& c : {Case{1000, TokenDType::kUInt16}, Case{65536, TokenDType::kUInt16},
                        Case{100000, TokenDType::kUInt32}}) {
    std::mt19937_64 rng(c.vocab_size);
    std::vector<int32_t> tokens(777);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab_size);
    tokens[0] = static_cast<int32_t>(c.vocab_size - 1);  // the largest token survives
    const std::string path = (dir_ / "t.rdtok").string();
    write_token_file(path, tokens, c.vocab_size);
    const Bytes bytes = read_file(path);
    const size_t width = static_cast<size_t>(c.stored);
    // The header's fields where the layout puts them.
    ASSERT_EQ(bytes.size(), 32 + tokens.size() * width);
    EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 5), "RDTOK");
    EXPECT_EQ(bytes[8], 1);   // version
    EXPECT_EQ(bytes[12], width);
    EXPECT_EQ(bytes[16] | (bytes[17] << 8), 777);  // count
    EXPECT_EQ(bytes[32] | (bytes[33] << 8), (c.vocab_size - 1) & 0xFFFF);  // first token

    const TokenSource source = TokenSource::open_token_file(path);
    EXPECT_EQ(source.size(), 777);
    EXPECT_EQ(source.vocab_size(), c.vocab_size);
    std::vector<int32_t> back(tokens.size());
    source.read(0, back);
    EXPECT_EQ(back, tokens);

    auto data = make_dataset("tokens:" + path, text_options(50, 0.1));
    EXPECT_EQ(data->vocab_size(), c.vocab_size);
    const Batch eval = data->eval_batch(1, 0);
    const int64_t val_begin = 777 - 78;  // ceil(77.7) validation tokens
    EXPECT_TRUE(std::equal(eval.inputs.begin(), eval.inputs.end(), tokens.begin() + val_begin));
  }
  EXPECT_TRUE(raises([&] { write_token_file((dir_ / "x").string(), std::vector<int32_t>{5}, 5); },
                     {ErrorCode::kInvalidArgument}, {"write_token_file", "token 0 is 5"}));
  EXPECT_TRUE(raises(
      [&] { write_token_file((dir_ / "x").string(), std::vector<int32_t>{1}, 70000,
                             TokenDType::kUInt16); },
      {ErrorCode::kInvalidArgument}, {"70000", "uint16"}));
}

TEST_F(TrainDataFileTest, BadFilesAreRefusedWithTheirPathAndReason) {
  const std::string missing = (dir_ / "missing.txt").string();
  EXPECT_TRUE(raises([&] { make_dataset("text:" + missing, text_options(8, 0.1)); },
                     {ErrorCode::kIo}, {"cannot open", missing}));
  EXPECT_TRUE(raises([&] { TokenSource::open_text(dir_.string()); }, {ErrorCode::kIo},
                     {"not a regular file"}));
  const std::string empty = write("empty.txt", {});
  EXPECT_TRUE(raises([&] { make_dataset("text:" + empty, text_options(8, 0.1)); },
                     {ErrorCode::kInvalidArgument}, {empty, "is empty"}));
  const std::string short_text = write("short.txt", random_bytes(12, 3));
  EXPECT_TRUE(raises([&] { make_dataset("text:" + short_text, text_options(8, 0.1)); },
                     {ErrorCode::kInvalidArgument}, {short_text, "12 tokens", "at least 18"}));
  EXPECT_TRUE(raises([&] { make_dataset("text:" + short_text, text_options(8, 1.0)); },
                     {ErrorCode::kInvalidArgument}, {"val_fraction"}));

  // A good file, then damaged copies of it.
  const std::string good = (dir_ / "good.rdtok").string();
  write_token_file(good, std::vector<int32_t>{1, 2, 3, 4}, 300);
  const Bytes bytes = read_file(good);
  auto damaged = [&](const std::string& name, auto&& edit) {
    Bytes copy = bytes;
    edit(copy);
    return write(name, copy);
  };
  const std::string truncated_header =
      damaged("header.rdtok", [](Bytes& b) { b.resize(20); });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(truncated_header); },
                     {ErrorCode::kCorruptFile},
                     {truncated_header, "truncated header", "20 bytes"}));
  const std::string magic = damaged("magic.rdtok", [](Bytes& b) { b[2] = 'X'; });
  EXPECT_TRUE(raises([&] { make_dataset("tokens:" + magic, text_options(2, 0.0)); },
                     {ErrorCode::kCorruptFile}, {magic, "wrong magic"}));
  const std::string version = damaged("version.rdtok", [](Bytes& b) { b[8] = 9; });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(version); }, {ErrorCode::kCorruptFile},
                     {"version 9"}));
  const std::string width = damaged("width.rdtok", [](Bytes& b) { b[12] = 3; });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(width); }, {ErrorCode::kCorruptFile},
                     {"token width 3"}));
  const std::string truncated_data = damaged("data.rdtok", [](Bytes& b) { b.pop_back(); });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(truncated_data); },
                     {ErrorCode::kCorruptFile}, {"7 bytes after its header", "4 tokens of 2 bytes"}));
  const std::string huge_count = damaged("count.rdtok", [](Bytes& b) { b[23] = 0x40; });
  EXPECT_TRUE(raises([&] { TokenSource::open_token_file(huge_count); }, {ErrorCode::kCorruptFile},
                     {"header says"}));
  // A stored token at or above the vocab size shows when it is read.
  const std::string bad_token = damaged("token.rdtok", [](Bytes& b) { b[36] = 0x2C; b[37] = 1; });
  const TokenSource source = TokenSource::open_token_file(bad_token);
  std::vector<int32_t> out(4);
  EXPECT_TRUE(raises([&] { source.read(0, out); }, {ErrorCode::kCorruptFile},
                     {"token 300", "position 2", "vocab size 300"}));
  EXPECT_TRUE(raises([&] { source.read(2, out); }, {ErrorCode::kOutOfRange}, {"[2, 6)"}));
  EXPECT_TRUE(raises([&] { make_dataset("wikitext", text_options(8, 0.1)); },
                     {ErrorCode::kInvalidArgument}, {"unknown dataset 'wikitext'"}));
}

}  // namespace
}  // namespace rd::train
