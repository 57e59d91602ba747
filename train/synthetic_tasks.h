// Synthetic long-context tasks (passkey retrieval, multi-query associative recall, copy),
// generated from (seed, stream, sample index) in byte tokens so that samples read as text.
// Every sample is exactly seq_len + 1 tokens: inputs are tokens[:-1], targets tokens[1:].
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "ringdilated/train/sample_rng.h"

namespace rd::train {

enum class Task { kPasskey, kMqar, kCopy };

// "passkey", "mqar", "copy".
std::string_view task_name(Task task);
std::optional<Task> task_from_name(std::string_view name);

struct TaskOptions {
  int64_t seq_len = 1024;  // inputs (and targets) per sample
  // passkey: "The pass key is <digits>. Remember it. " hidden in filler sentences, then
  // "What is the pass key? The pass key is <digits>" at the end.
  int64_t passkey_digits = 5;
  // mqar: `mqar_pairs` pairs "<key>:<value> " (keys distinct lower-case letters, values
  // decimal digits), filler, <sep>, then `mqar_queries` of the keys again with their values.
  int64_t mqar_pairs = 32;
  int64_t mqar_queries = 8;
  int64_t mqar_key_len = 4;
  int64_t mqar_value_len = 3;
  // copy: <bos> s <sep> s <eos> <pad>..., s random lower-case letters; 0: as long as fits.
  int64_t copy_length = 0;
};

// The smallest seq_len `task` fits in with these options.
int64_t min_seq_len(Task task, const TaskOptions& options);
// Throws rd::Error(kInvalidArgument) naming the option when the options are out of range
// or the task does not fit in options.seq_len.
void check_task_options(Task task, const TaskOptions& options);

// One sample's seq_len + 1 tokens; answer[i] is 1 where tokens[i] is an answer token.
struct TaskTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> answer;
};

// The sample `index` of `stream`: the same arguments always give the same tokens.
TaskTokens generate_task(Task task, const TaskOptions& options, uint64_t seed,
                         SampleStream stream, uint64_t index);

// Which targets the loss sees: only answer tokens (the others become kIgnoreIndex), or all.
enum class LossOn { kAnswers, kAll };

// A training sample: seq_len inputs, targets and answer flags (answer[t] marks targets[t]).
struct Sample {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  std::vector<uint8_t> answer;
};

// Shifts seq_len + 1 tokens into inputs and targets.
Sample make_sample(const TaskTokens& task_tokens, LossOn loss_on);

}  // namespace rd::train
