// Datasets: synthetic tasks by sample index, and windows of token files in a per-epoch
// Feistel permutation (no table: any position of any epoch is computed directly, so a
// resumed run needs only (epoch, index)).
#include "ringdilated/train/dataset.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/number_text.h"
#include "ringdilated/kernels/philox.h"

namespace rd::train {
namespace {

constexpr std::string_view kTextPrefix = "text:";
constexpr std::string_view kTokensPrefix = "tokens:";
// Luby-Rackoff: four rounds already give a pseudo-random permutation; six for margin.
constexpr uint32_t kFeistelRounds = 6;

void check_batch_size(std::string_view what, int64_t batch_size) {
  RD_CHECK(batch_size > 0, kInvalidArgument, what, ": batch_size must be positive, got ",
           batch_size);
}

Batch empty_batch(int64_t batch_size, int64_t seq_len) {
  const size_t n = static_cast<size_t>(batch_size * seq_len);
  Batch batch{batch_size, seq_len, {}, {}, {}, {}};
  batch.inputs.resize(n);
  batch.targets.resize(n);
  batch.answer.resize(n);
  return batch;
}

// A pseudo-random permutation of [0, n) keyed by (seed, epoch): a balanced Feistel network
// on the smallest even-bit power of two >= n, with cycle walking back into [0, n) (each
// step lands inside with probability > 1/4).
class WindowPermutation {
 public:
  WindowPermutation(uint64_t seed, uint64_t epoch, uint64_t n) : seed_(seed), epoch_(epoch), n_(n) {
    const int bits = std::max(2, static_cast<int>(std::bit_width(n - 1)));
    half_bits_ = (bits + 1) / 2;
    half_mask_ = (uint64_t{1} << half_bits_) - 1;
  }

  uint64_t operator()(uint64_t i) const {
    uint64_t x = i;
    do {
      x = feistel(x);
    } while (x >= n_);
    return x;
  }

 private:
  uint64_t feistel(uint64_t x) const {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (uint32_t round = 0; round < kFeistelRounds; ++round) {
      const kernels::Philox4x32 counter = {{static_cast<uint32_t>(right), round,
                                            static_cast<uint32_t>(epoch_),
                                            static_cast<uint32_t>(epoch_ >> 32)}};
      const kernels::Philox4x32 r = kernels::philox4x32_10(counter, static_cast<uint32_t>(seed_),
                                                           static_cast<uint32_t>(seed_ >> 32));
      const uint64_t mixed = left ^ (r.w[0] & half_mask_);
      left = right;
      right = mixed;
    }
    return (left << half_bits_) | right;
  }

  uint64_t seed_, epoch_, n_;
  int half_bits_;
  uint64_t half_mask_;
};

template <class T>
AccuracyCounts score(const Batch& batch, std::span<const T> predictions) {
  const int64_t expected = batch.batch_size * batch.seq_len;
  RD_CHECK(static_cast<int64_t>(predictions.size()) == expected, kShapeMismatch,
           "score_predictions: ", predictions.size(), " predictions for a batch of [",
           batch.batch_size, ", ", batch.seq_len, "] (", expected, " positions)");
  AccuracyCounts counts;
  for (int64_t b = 0; b < batch.batch_size; ++b) {
    int64_t answers = 0, correct = 0;
    for (int64_t i = b * batch.seq_len; i < (b + 1) * batch.seq_len; ++i) {
      if (!batch.answer[i]) continue;
      ++answers;
      correct += predictions[i] == static_cast<T>(batch.targets[i]) ? 1 : 0;
    }
    counts.answer_tokens += answers;
    counts.correct_tokens += correct;
    if (answers > 0) {
      ++counts.samples;
      counts.exact_samples += correct == answers ? 1 : 0;
    }
  }
  return counts;
}

double ratio(int64_t part, int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

// The bytes of a --documents=separator:<text> value, C escapes decoded.
std::vector<int32_t> unescape_separator(std::string_view text, std::string_view spec) {
  std::vector<int32_t> bytes;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      bytes.push_back(static_cast<uint8_t>(text[i]));
      continue;
    }
    RD_CHECK(i + 1 < text.size(), kInvalidArgument, "--documents=", spec,
             ": the separator ends in a lone backslash");
    const char escaped = text[++i];
    switch (escaped) {
      case 'n': bytes.push_back('\n'); break;
      case 't': bytes.push_back('\t'); break;
      case 'r': bytes.push_back('\r'); break;
      case '0': bytes.push_back(0); break;
      case '\\': bytes.push_back('\\'); break;
      case 'x': {
        const std::string hex(text.substr(i + 1, 2));
        RD_CHECK(hex.size() == 2 && std::isxdigit(static_cast<unsigned char>(hex[0])) &&
                     std::isxdigit(static_cast<unsigned char>(hex[1])),
                 kInvalidArgument, "--documents=", spec, ": \\x takes two hex digits, got '", hex,
                 "'");
        bytes.push_back(std::stoi(hex, nullptr, 16));
        i += 2;
        break;
      }
      default:
        RD_FAIL(kInvalidArgument, "--documents=", spec, ": unknown escape '\\", escaped,
                "' (known: \\n \\t \\r \\0 \\\\ \\xHH)");
    }
  }
  RD_CHECK(!bytes.empty(), kInvalidArgument, "--documents=", spec, ": the separator is empty");
  return bytes;
}

// Where documents start after each occurrence of `separator` in `source` (the position after
// it, when that is inside the source), read in chunks that overlap by the separator's length.
std::vector<int64_t> starts_after_separators(const TokenSource& source,
                                             std::span<const int32_t> separator) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t length = static_cast<int64_t>(separator.size());
  std::vector<int64_t> starts;
  std::vector<int32_t> chunk;
  for (int64_t begin = 0; begin + length <= source.size(); begin += kChunk) {
    const int64_t end = std::min(source.size(), begin + kChunk + length - 1);
    chunk.resize(static_cast<size_t>(end - begin));
    source.read(begin, chunk);
    const auto found = [&](int64_t at) {
      return std::equal(separator.begin(), separator.end(), chunk.begin() + at);
    };
    for (int64_t at = 0; at + length <= end - begin && at < kChunk; ++at) {
      if (found(at) && begin + at + length < source.size()) starts.push_back(begin + at + length);
    }
  }
  return starts;
}

// The document starts of `source` under `split`: its files' and tables', and those after
// separators; empty when that makes at most one document (nothing to mask).
std::vector<int64_t> document_starts_of(const TokenSource& source, const DocumentSplit& split) {
  if (!split.enabled) return {};
  std::vector<int64_t> starts = source.document_starts();
  for (const int32_t token : split.separator) {
    RD_CHECK(token < source.vocab_size(), kInvalidArgument, "--documents: the separator's token ",
             token, " is outside the data's vocabulary [0, ", source.vocab_size(), ")");
  }
  if (!split.separator.empty()) {
    const std::vector<int64_t> after = starts_after_separators(source, split.separator);
    std::vector<int64_t> merged;
    std::ranges::set_union(starts, after, std::back_inserter(merged));
    starts = std::move(merged);
  }
  if (starts.size() <= 1) starts.clear();
  return starts;
}

// The files a data spec's <paths> name: comma-separated, a folder for the regular files
// below it in name order.
std::vector<std::string> expand_data_paths(std::string_view paths, std::string_view spec) {
  std::vector<std::string> files;
  for (size_t begin = 0; begin <= paths.size();) {
    const size_t comma = std::min(paths.find(',', begin), paths.size());
    const std::string path(paths.substr(begin, comma - begin));
    begin = comma + 1;
    RD_CHECK(!path.empty(), kInvalidArgument, "--data=", spec, ": an empty path");
    if (!std::filesystem::is_directory(path)) {
      files.push_back(path);
      continue;
    }
    std::vector<std::string> inside;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(path)) {
      if (entry.is_regular_file()) inside.push_back(entry.path().string());
    }
    RD_CHECK(!inside.empty(), kInvalidArgument, "--data=", spec, ": the folder '", path,
             "' holds no files");
    std::ranges::sort(inside);
    files.insert(files.end(), inside.begin(), inside.end());
  }
  return files;
}

}  // namespace

// --- Batch and accuracy ---

Batch::Tensors Batch::to_tensors() const {
  const Shape shape = {batch_size, seq_len};
  return {from_vector(std::vector<int64_t>(inputs.begin(), inputs.end()), shape),
          from_vector(std::vector<int64_t>(targets.begin(), targets.end()), shape)};
}

double AccuracyCounts::token_accuracy() const { return ratio(correct_tokens, answer_tokens); }
double AccuracyCounts::exact_match() const { return ratio(exact_samples, samples); }

AccuracyCounts& AccuracyCounts::operator+=(const AccuracyCounts& other) {
  correct_tokens += other.correct_tokens;
  answer_tokens += other.answer_tokens;
  exact_samples += other.exact_samples;
  samples += other.samples;
  return *this;
}

AccuracyCounts score_predictions(const Batch& batch, std::span<const int64_t> predictions) {
  return score(batch, predictions);
}

AccuracyCounts score_predictions(const Batch& batch, std::span<const int32_t> predictions) {
  return score(batch, predictions);
}

AccuracyCounts score_predictions(const Batch& batch, const Tensor& predictions) {
  RD_CHECK(predictions.dtype() == DType::kInt64 || predictions.dtype() == DType::kInt32,
           kDTypeMismatch, "score_predictions: predictions must be int32 or int64, got ",
           dtype_name(predictions.dtype()));
  RD_CHECK(predictions.shape() == Shape({batch.batch_size, batch.seq_len}), kShapeMismatch,
           "score_predictions: predictions of shape ", shape_str(predictions.shape()),
           " for a batch of [", batch.batch_size, ", ", batch.seq_len, "]");
  const std::vector<int64_t> values =
      predictions.to(Device::cpu()).to(DType::kInt64).to_vector<int64_t>();
  return score(batch, std::span<const int64_t>(values));
}

// --- SyntheticDataset ---

SyntheticDataset::SyntheticDataset(Task task, const DatasetOptions& options)
    : task_(task), options_(options) {
  check_task_options(task, options.task);
}

Batch SyntheticDataset::batch(SampleStream stream, int64_t first, int64_t batch_size) const {
  const int64_t seq_len = options_.task.seq_len;
  Batch batch = empty_batch(batch_size, seq_len);
  for (int64_t b = 0; b < batch_size; ++b) {
    const Sample sample = make_sample(
        generate_task(task_, options_.task, options_.seed, stream, first + b), options_.loss_on);
    std::ranges::copy(sample.inputs, batch.inputs.begin() + b * seq_len);
    std::ranges::copy(sample.targets, batch.targets.begin() + b * seq_len);
    std::ranges::copy(sample.answer, batch.answer.begin() + b * seq_len);
  }
  return batch;
}

Batch SyntheticDataset::next_batch(int64_t batch_size) {
  check_batch_size(name() + " next_batch", batch_size);
  Batch result = batch(SampleStream::kTrain, state_.index, batch_size);
  state_.index += batch_size;
  return result;
}

Batch SyntheticDataset::eval_batch(int64_t batch_size, int64_t index) const {
  check_batch_size(name() + " eval_batch", batch_size);
  RD_CHECK(index >= 0, kInvalidArgument, name(), " eval_batch: index must be >= 0, got ", index);
  return batch(SampleStream::kEval, index * batch_size, batch_size);
}

void SyntheticDataset::set_state(const DataState& state) {
  RD_CHECK(state.epoch == 0 && state.index >= 0, kInvalidArgument, name(),
           " set_state: a synthetic stream has epoch 0 and index >= 0, got epoch ", state.epoch,
           ", index ", state.index);
  state_ = state;
}

// --- WindowDataset ---

WindowDataset::WindowDataset(TokenSource source, std::string name, const DatasetOptions& options)
    : source_(std::move(source)),
      name_(std::move(name)),
      seq_len_(options.task.seq_len),
      seed_(options.seed) {
  RD_CHECK(seq_len_ > 0, kInvalidArgument, name_, ": seq_len must be positive, got ", seq_len_);
  RD_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0, kInvalidArgument, name_,
           ": val_fraction must be in [0, 1), got ", options.val_fraction);
  const int64_t total = source_.size();
  const int64_t window = seq_len_ + 1;
  int64_t val_tokens = 0;
  if (options.val_fraction > 0.0) {
    val_tokens = std::max<int64_t>(
        static_cast<int64_t>(std::ceil(options.val_fraction * static_cast<double>(total))), window);
  }
  const int64_t needed = window + val_tokens;
  RD_CHECK(total >= needed, kInvalidArgument, name_, ": '", source_.path(), "' holds ", total,
           " tokens, too few for one training window of seq_len + 1 = ", window, " tokens",
           val_tokens > 0 ? str_cat(" and a validation split of ", val_tokens, " tokens") : "",
           " (needs at least ", needed, ")");
  val_begin_ = total - val_tokens;
  train_windows_ = (val_begin_ - 1) / seq_len_;
  val_windows_ = val_tokens > 0 ? (val_tokens - 1) / seq_len_ : 0;
  document_starts_ =
      document_starts_of(source_, parse_documents(options.documents, !source_.is_text()));
}

int64_t WindowDataset::train_window_start(int64_t epoch, int64_t position) const {
  WindowPermutation permutation(seed_, static_cast<uint64_t>(epoch),
                                static_cast<uint64_t>(train_windows_));
  return static_cast<int64_t>(permutation(static_cast<uint64_t>(position))) * seq_len_;
}

void WindowDataset::read_window(int64_t start, int64_t row, Batch& batch) const {
  std::vector<int32_t> window(static_cast<size_t>(seq_len_ + 1));
  source_.read(start, window);
  const auto offset = row * seq_len_;
  std::copy(window.begin(), window.end() - 1, batch.inputs.begin() + offset);
  std::copy(window.begin() + 1, window.end(), batch.targets.begin() + offset);
  std::fill_n(batch.answer.begin() + offset, seq_len_, uint8_t{1});
  if (!document_starts_.empty()) mark_documents(start, row, batch);
}

void WindowDataset::mark_documents(int64_t start, int64_t row, Batch& batch) const {
  batch.documents.resize(static_cast<size_t>(batch.batch_size));
  std::vector<int64_t>& starts = batch.documents[static_cast<size_t>(row)];
  starts = {0};
  // Starts in (start, start + seq_len]: documents beginning at an input of the window, and
  // the one whose first token is the window's last target.
  auto next = std::upper_bound(document_starts_.begin(), document_starts_.end(), start);
  for (; next != document_starts_.end() && *next <= start + seq_len_; ++next) {
    const int64_t position = *next - start;
    if (position < seq_len_) starts.push_back(position);
    // The input before a start predicts the next document's first token, which its own
    // document (all it attends to) says nothing about: not scored.
    const auto before = static_cast<size_t>(row * seq_len_ + position - 1);
    batch.targets[before] = kIgnoreIndex;
    batch.answer[before] = 0;
  }
}

Batch WindowDataset::next_batch(int64_t batch_size) {
  check_batch_size(name_ + " next_batch", batch_size);
  Batch batch = empty_batch(batch_size, seq_len_);
  for (int64_t b = 0; b < batch_size; ++b) {
    if (state_.index == train_windows_) state_ = {state_.epoch + 1, 0};
    read_window(train_window_start(state_.epoch, state_.index), b, batch);
    ++state_.index;
  }
  return batch;
}

Batch WindowDataset::eval_batch(int64_t batch_size, int64_t index) const {
  check_batch_size(name_ + " eval_batch", batch_size);
  RD_CHECK(val_windows_ > 0, kInvalidArgument, name_,
           " eval_batch: there is no validation split (val_fraction is 0)");
  RD_CHECK(index >= 0, kInvalidArgument, name_, " eval_batch: index must be >= 0, got ", index);
  Batch batch = empty_batch(batch_size, seq_len_);
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t window = (index * batch_size + b) % val_windows_;
    read_window(val_begin_ + window * seq_len_, b, batch);
  }
  return batch;
}

void WindowDataset::set_state(const DataState& state) {
  RD_CHECK(state.epoch >= 0 && state.index >= 0 && state.index <= train_windows_, kInvalidArgument,
           name_, " set_state: epoch ", state.epoch, ", index ", state.index,
           " is outside epoch >= 0, index in [0, ", train_windows_, "]");
  state_ = state;
}

// --- make_dataset ---

DataKind data_kind(std::string_view spec) {
  if (spec.starts_with(kTextPrefix)) return DataKind::kText;
  if (spec.starts_with(kTokensPrefix)) return DataKind::kTokens;
  return DataKind::kTask;
}

DocumentSplit parse_documents(std::string_view spec, bool tokens) {
  constexpr std::string_view kSeparator = "separator:", kEos = "eos:";
  DocumentSplit split;
  if (spec == "auto") return split;
  if (spec == "off") return DocumentSplit{false, {}};
  if (spec.starts_with(kSeparator)) {
    RD_CHECK(!tokens, kInvalidArgument, "--documents=", spec,
             ": a separator of bytes splits text data; token files take eos:<token id>");
    split.separator = unescape_separator(spec.substr(kSeparator.size()), spec);
    return split;
  }
  if (spec.starts_with(kEos)) {
    const std::optional<int32_t> id = number_from_text<int32_t>(spec.substr(kEos.size()));
    RD_CHECK(id && *id >= 0, kInvalidArgument, "--documents=", spec,
             ": the token id must be a whole number >= 0");
    split.separator = {*id};
    return split;
  }
  RD_FAIL(kInvalidArgument, "--documents=", spec,
          ": expected auto, off, separator:<text> or eos:<token id>");
}

std::unique_ptr<Dataset> make_dataset(std::string_view spec, const DatasetOptions& options) {
  if (std::optional<Task> task = task_from_name(spec)) {
    return std::make_unique<SyntheticDataset>(*task, options);
  }
  const std::string name(spec);
  if (spec.starts_with(kTextPrefix)) {
    return std::make_unique<WindowDataset>(
        TokenSource::open_text(expand_data_paths(spec.substr(kTextPrefix.size()), spec)), name,
        options);
  }
  if (spec.starts_with(kTokensPrefix)) {
    return std::make_unique<WindowDataset>(
        TokenSource::open_token_files(expand_data_paths(spec.substr(kTokensPrefix.size()), spec)),
        name, options);
  }
  RD_FAIL(kInvalidArgument, "make_dataset: unknown dataset '", spec,
          "'; expected passkey, mqar, copy, text:<paths> or tokens:<paths>");
}

}  // namespace rd::train
