// Synthetic tasks: each builds its sample left to right with SampleBuilder, drawing from a
// SampleRng of (seed, stream, index), and checks that it filled exactly seq_len + 1 tokens.
#include "ringdilated/train/synthetic_tasks.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <unordered_set>

#include "ringdilated/kernels/error.h"
#include "ringdilated/train/tokenizer.h"

namespace rd::train {
namespace {

// Filler without digits or colons, so that the answers of passkey and mqar stay unique.
constexpr std::string_view kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
    "again. ";
constexpr std::string_view kKeyPrefix = "The pass key is ";
constexpr std::string_view kKeySuffix = ". Remember it. ";
constexpr std::string_view kQuestion = "\nWhat is the pass key? The pass key is ";
constexpr int64_t kLetters = 26;
constexpr int64_t kDigits = 10;
constexpr int64_t kPairSeparators = 2;  // ':' between key and value, ' ' after the value
constexpr int64_t kBosAndSep = 2;

struct TaskEntry {
  Task task;
  std::string_view name;
};
constexpr TaskEntry kTasks[] = {
    {Task::kPasskey, "passkey"}, {Task::kMqar, "mqar"}, {Task::kCopy, "copy"}};

// Appends tokens with their answer flags.
class SampleBuilder {
 public:
  explicit SampleBuilder(int64_t total) {
    tokens_.reserve(total);
    answer_.reserve(total);
  }

  void add(int32_t token, bool answer = false) {
    tokens_.push_back(token);
    answer_.push_back(answer ? 1 : 0);
  }

  void add(std::string_view text, bool answer = false) {
    for (char c : text) add(static_cast<int32_t>(static_cast<unsigned char>(c)), answer);
  }

  // `count` characters of the filler repeated, starting `phase` characters into it.
  void add_filler(int64_t count, int64_t phase = 0) {
    for (int64_t i = 0; i < count; ++i) {
      add(static_cast<int32_t>(kFiller[static_cast<size_t>((phase + i) % kFiller.size())]));
    }
  }

  TaskTokens finish(Task task, int64_t expected) && {
    RD_CHECK(static_cast<int64_t>(tokens_.size()) == expected, kInternal, task_name(task),
             ": built ", tokens_.size(), " tokens, expected ", expected);
    return {std::move(tokens_), std::move(answer_)};
  }

 private:
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> answer_;
};

std::string random_chars(SampleRng& rng, int64_t count, char first, int64_t range) {
  std::string text(static_cast<size_t>(count), first);
  for (char& c : text) c = static_cast<char>(first + rng.below(range));
  return text;
}

// Moves a position of the repeated filler back to the start of its sentence, so that the
// inserted passkey sentence does not split one.
int64_t sentence_start(int64_t position) {
  int64_t in_filler = position % static_cast<int64_t>(kFiller.size());
  int64_t start = in_filler;
  while (start > 0 && !(kFiller[start - 1] == ' ' && kFiller[start - 2] == '.')) --start;
  return position - (in_filler - start);
}

int64_t passkey_sentence_len(const TaskOptions& o) {
  return static_cast<int64_t>(kKeyPrefix.size() + kKeySuffix.size()) + o.passkey_digits;
}

int64_t mqar_pair_len(const TaskOptions& o) {
  return o.mqar_key_len + o.mqar_value_len + kPairSeparators;
}

// 26^key_len, saturated: how many distinct mqar keys exist.
int64_t distinct_keys(int64_t key_len) {
  int64_t count = 1;
  for (int64_t i = 0; i < key_len && count < (int64_t{1} << 40); ++i) count *= kLetters;
  return count;
}

int64_t copy_len(const TaskOptions& o) {
  return o.copy_length > 0 ? o.copy_length : (o.seq_len - 1) / 2;
}

TaskTokens passkey(const TaskOptions& o, SampleRng& rng) {
  const int64_t total = o.seq_len + 1;
  const std::string key = random_chars(rng, o.passkey_digits, '0', kDigits);
  const int64_t filler = total - 1 - static_cast<int64_t>(kQuestion.size()) -
                         o.passkey_digits - passkey_sentence_len(o);
  const int64_t depth = sentence_start(static_cast<int64_t>(rng.below(filler + 1)));
  SampleBuilder b(total);
  b.add(ByteTokenizer::kBos);
  b.add_filler(depth);
  b.add(kKeyPrefix);
  b.add(key);
  b.add(kKeySuffix);
  b.add_filler(filler - depth, depth);
  b.add(kQuestion);
  b.add(key, /*answer=*/true);
  return std::move(b).finish(Task::kPasskey, total);
}

TaskTokens mqar(const TaskOptions& o, SampleRng& rng) {
  const int64_t total = o.seq_len + 1;
  std::vector<std::string> keys, values;
  std::unordered_set<std::string> seen;
  while (static_cast<int64_t>(keys.size()) < o.mqar_pairs) {
    std::string key = random_chars(rng, o.mqar_key_len, 'a', kLetters);
    if (!seen.insert(key).second) continue;  // keys must be distinct to have one answer
    keys.push_back(std::move(key));
    values.push_back(random_chars(rng, o.mqar_value_len, '0', kDigits));
  }
  // The queried pairs: the first mqar_queries of a partial Fisher-Yates shuffle.
  std::vector<int64_t> order(static_cast<size_t>(o.mqar_pairs));
  std::iota(order.begin(), order.end(), 0);
  for (int64_t i = 0; i < o.mqar_queries; ++i) {
    std::swap(order[i], order[i + rng.below(o.mqar_pairs - i)]);
  }
  SampleBuilder b(total);
  b.add(ByteTokenizer::kBos);
  for (int64_t i = 0; i < o.mqar_pairs; ++i) {
    b.add(keys[i]);
    b.add(":");
    b.add(values[i]);
    b.add(" ");
  }
  b.add_filler(total - kBosAndSep - (o.mqar_pairs + o.mqar_queries) * mqar_pair_len(o));
  b.add(ByteTokenizer::kSep);
  for (int64_t q = 0; q < o.mqar_queries; ++q) {
    b.add(keys[order[q]]);
    b.add(":");
    b.add(values[order[q]], /*answer=*/true);
    b.add(" ");
  }
  return std::move(b).finish(Task::kMqar, total);
}

TaskTokens copy(const TaskOptions& o, SampleRng& rng) {
  const int64_t total = o.seq_len + 1;
  const int64_t length = copy_len(o);
  const std::string text = random_chars(rng, length, 'a', kLetters);
  SampleBuilder b(total);
  b.add(ByteTokenizer::kBos);
  b.add(text);
  b.add(ByteTokenizer::kSep);
  b.add(text, /*answer=*/true);
  const int64_t rest = total - kBosAndSep - 2 * length;
  if (rest > 0) b.add(ByteTokenizer::kEos);
  for (int64_t i = 1; i < rest; ++i) b.add(ByteTokenizer::kPad);
  return std::move(b).finish(Task::kCopy, total);
}

}  // namespace

std::string_view task_name(Task task) {
  for (const TaskEntry& entry : kTasks) {
    if (entry.task == task) return entry.name;
  }
  RD_FAIL(kInternal, "task_name: unknown task ", static_cast<int>(task));
}

std::optional<Task> task_from_name(std::string_view name) {
  for (const TaskEntry& entry : kTasks) {
    if (entry.name == name) return entry.task;
  }
  return std::nullopt;
}

int64_t min_seq_len(Task task, const TaskOptions& o) {
  switch (task) {
    case Task::kPasskey:
      // <bos>, the key sentence, the question and the answer: seq_len + 1 tokens.
      return passkey_sentence_len(o) + static_cast<int64_t>(kQuestion.size()) +
             o.passkey_digits;
    case Task::kMqar:
      return 1 + (o.mqar_pairs + o.mqar_queries) * mqar_pair_len(o);
    case Task::kCopy:
      return 1 + 2 * std::max<int64_t>(o.copy_length, 1);
  }
  RD_FAIL(kInternal, "min_seq_len: unknown task ", static_cast<int>(task));
}

void check_task_options(Task task, const TaskOptions& o) {
  const std::string_view name = task_name(task);
  auto positive = [&](int64_t value, std::string_view option) {
    RD_CHECK(value > 0, kInvalidArgument, name, ": ", option, " must be positive, got ", value);
  };
  positive(o.seq_len, "seq_len");
  if (task == Task::kPasskey) positive(o.passkey_digits, "passkey_digits");
  if (task == Task::kMqar) {
    positive(o.mqar_pairs, "mqar_pairs");
    positive(o.mqar_queries, "mqar_queries");
    positive(o.mqar_key_len, "mqar_key_len");
    positive(o.mqar_value_len, "mqar_value_len");
    RD_CHECK(o.mqar_queries <= o.mqar_pairs, kInvalidArgument, name, ": mqar_queries (",
             o.mqar_queries, ") must not exceed mqar_pairs (", o.mqar_pairs, ")");
    // At most half of the keys in use, so drawing distinct ones by rejection stays quick.
    RD_CHECK(2 * o.mqar_pairs <= distinct_keys(o.mqar_key_len), kInvalidArgument, name,
             ": mqar_pairs (", o.mqar_pairs, ") needs more distinct keys than mqar_key_len ",
             o.mqar_key_len, " gives (", distinct_keys(o.mqar_key_len),
             " keys; at most half may be used)");
  }
  if (task == Task::kCopy) {
    RD_CHECK(o.copy_length >= 0, kInvalidArgument, name, ": copy_length must be >= 0, got ",
             o.copy_length);
  }
  RD_CHECK(o.seq_len >= min_seq_len(task, o), kInvalidArgument, name, ": seq_len ", o.seq_len,
           " is too short for these options (needs at least ", min_seq_len(task, o), ")");
}

TaskTokens generate_task(Task task, const TaskOptions& options, uint64_t seed,
                         SampleStream stream, uint64_t index) {
  check_task_options(task, options);
  SampleRng rng(seed, stream, index);
  switch (task) {
    case Task::kPasskey: return passkey(options, rng);
    case Task::kMqar: return mqar(options, rng);
    case Task::kCopy: return copy(options, rng);
  }
  RD_FAIL(kInternal, "generate_task: unknown task ", static_cast<int>(task));
}

Sample make_sample(const TaskTokens& task_tokens, LossOn loss_on) {
  const size_t total = task_tokens.tokens.size();
  RD_CHECK(total >= 2 && task_tokens.answer.size() == total, kInvalidArgument,
           "make_sample: needs at least 2 tokens with one answer flag each, got ", total,
           " tokens and ", task_tokens.answer.size(), " flags");
  const size_t seq_len = total - 1;
  Sample sample;
  sample.inputs.assign(task_tokens.tokens.begin(), task_tokens.tokens.end() - 1);
  sample.targets.assign(task_tokens.tokens.begin() + 1, task_tokens.tokens.end());
  sample.answer.assign(task_tokens.answer.begin() + 1, task_tokens.answer.end());
  if (loss_on == LossOn::kAnswers) {
    for (size_t t = 0; t < seq_len; ++t) {
      if (!sample.answer[t]) sample.targets[t] = kIgnoreIndex;
    }
  }
  return sample;
}

}  // namespace rd::train
