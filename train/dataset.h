// The data side of rd_train: batches of token windows, the Dataset interface the trainer
// reads (training stream with a resumable position, held-out batches by index), the
// synthetic-task and file-backed datasets, and make_dataset() from a spec string.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ringdilated/tensor/tensor.h"
#include "ringdilated/train/synthetic_tasks.h"
#include "ringdilated/train/token_file.h"
#include "ringdilated/train/tokenizer.h"

namespace rd::train {

// B samples of T tokens, row-major: sample b is [b * T, (b + 1) * T) of each vector.
// targets[i] is the token after inputs[i], or kIgnoreIndex where the loss skips it;
// answer[i] is 1 where targets[i] is an answer token (for text, every position).
struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  std::vector<uint8_t> answer;
  // Packed documents: per sample, the positions where its documents start (the first 0,
  // strictly increasing; nn::DocumentStarts); the model attends within documents. Empty:
  // the data packs no documents (one per sample).
  std::vector<std::vector<int64_t>> documents;

  struct Tensors {
    Tensor inputs;   // int64 [B, T], CPU
    Tensor targets;  // int64 [B, T], CPU
  };
  // The trainer moves them to its device.
  Tensors to_tensors() const;
};

// Answer accuracy of predicted token ids (argmax of the logits), one per target position,
// [B * T] row-major like the batch. A sample counts as an exact match when every answer
// token is predicted right; samples without answer tokens are not counted.
struct AccuracyCounts {
  int64_t correct_tokens = 0;
  int64_t answer_tokens = 0;
  int64_t exact_samples = 0;
  int64_t samples = 0;

  double token_accuracy() const;  // correct / answer tokens; 0 when there are none
  double exact_match() const;     // exact / counted samples; 0 when there are none
  AccuracyCounts& operator+=(const AccuracyCounts& other);
};
AccuracyCounts score_predictions(const Batch& batch, std::span<const int64_t> predictions);
AccuracyCounts score_predictions(const Batch& batch, std::span<const int32_t> predictions);
// predictions: int32 or int64 [B, T] (any device; copied to the host).
AccuracyCounts score_predictions(const Batch& batch, const Tensor& predictions);

// The position of a dataset's training stream: text datasets visit their windows in a
// shuffled order per epoch; synthetic ones count samples (epoch stays 0). Saving it in a
// checkpoint and setting it back continues the same stream bit for bit.
struct DataState {
  int64_t epoch = 0;
  int64_t index = 0;  // the next sample within the epoch
  friend bool operator==(const DataState&, const DataState&) = default;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The next batch_size training samples; advances state().
  virtual Batch next_batch(int64_t batch_size) = 0;
  // Held-out samples [index * batch_size, (index + 1) * batch_size), never seen in
  // training; text datasets wrap around their validation windows. Does not touch state().
  virtual Batch eval_batch(int64_t batch_size, int64_t index) const = 0;
  // How many distinct held-out samples exist (text: validation windows); nullopt: unlimited.
  virtual std::optional<int64_t> eval_size() const = 0;
  virtual DataState state() const = 0;
  virtual void set_state(const DataState& state) = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t seq_len() const = 0;
  virtual std::string name() const = 0;
  // How many documents the data packs when batches carry their starts (Batch::documents);
  // 0 when they do not (synthetic tasks, one document, --documents=off).
  virtual int64_t document_count() const { return 0; }
  bool packs_documents() const { return document_count() > 0; }
};

// Options of make_dataset; each dataset reads the ones it needs.
struct DatasetOptions {
  TaskOptions task;  // task.seq_len is every dataset's seq_len
  uint64_t seed = 0;
  LossOn loss_on = LossOn::kAnswers;  // synthetic tasks; text datasets train on all tokens
  // Text and token files: the last val_fraction of the tokens is the validation split.
  double val_fraction = 0.05;
  // Text and token files: where the documents packed in them start (parse_documents).
  std::string documents = "auto";
};

// How a text or token dataset finds its documents, from rd_train's --documents:
//   "auto": each file is a document, and so is each entry of an RDTOK file's table;
//   "off": no documents (one stream, attention across everything, as before packing);
//   "separator:<text>": also after each occurrence of the bytes of <text> (C escapes \n \t
//     \r \0 \\ \xHH), text data only;
//   "eos:<token id>": also after each occurrence of that token.
// The separator or end-of-sequence token ends its document (it is that document's last).
struct DocumentSplit {
  bool enabled = true;
  std::vector<int32_t> separator;  // empty: files and tables only
};
// Throws rd::Error(kInvalidArgument) naming --documents for an unknown form, a bad escape or
// token id, or a separator for token files (`tokens`).
DocumentSplit parse_documents(std::string_view spec, bool tokens = false);

// A synthetic task: training sample i is generate_task(..., kTrain, i), held-out sample i
// is generate_task(..., kEval, i).
class SyntheticDataset final : public Dataset {
 public:
  SyntheticDataset(Task task, const DatasetOptions& options);
  Batch next_batch(int64_t batch_size) override;
  Batch eval_batch(int64_t batch_size, int64_t index) const override;
  std::optional<int64_t> eval_size() const override { return std::nullopt; }
  DataState state() const override { return state_; }
  void set_state(const DataState& state) override;
  int64_t vocab_size() const override { return ByteTokenizer::kVocabSize; }
  int64_t seq_len() const override { return options_.task.seq_len; }
  std::string name() const override { return std::string(task_name(task_)); }

 private:
  Batch batch(SampleStream stream, int64_t first, int64_t batch_size) const;

  Task task_;
  DatasetOptions options_;
  DataState state_;
};

// Windows of seq_len + 1 tokens of a TokenSource, every seq_len tokens (a window's last token
// is the next one's first input). The last val_fraction of the tokens (at least one
// window's worth when val_fraction > 0) is the validation split; training windows lie wholly
// before it, so the two never share a token. Each epoch visits every training window once,
// in a permutation of (seed, epoch); validation windows are read in file order.
class WindowDataset final : public Dataset {
 public:
  // Throws rd::Error(kInvalidArgument) naming the file when it is too short for one
  // training window (and one validation window when val_fraction > 0). With documents
  // (options.documents), each sample carries the starts of the documents inside its window,
  // and the position before a start, whose next token is another document's, is not scored.
  WindowDataset(TokenSource source, std::string name, const DatasetOptions& options);
  Batch next_batch(int64_t batch_size) override;
  Batch eval_batch(int64_t batch_size, int64_t index) const override;
  std::optional<int64_t> eval_size() const override { return val_windows_; }
  DataState state() const override { return state_; }
  void set_state(const DataState& state) override;
  int64_t vocab_size() const override { return source_.vocab_size(); }
  int64_t seq_len() const override { return seq_len_; }
  std::string name() const override { return name_; }
  int64_t document_count() const override { return static_cast<int64_t>(document_starts_.size()); }

  int64_t train_windows() const { return train_windows_; }
  // Where the documents start (token indices, the first 0); empty with at most one document.
  const std::vector<int64_t>& document_starts() const { return document_starts_; }
  int64_t val_begin() const { return val_begin_; }  // first token of the validation split
  // The first token of training window `position` of `epoch`'s order.
  int64_t train_window_start(int64_t epoch, int64_t position) const;

 private:
  void read_window(int64_t start, int64_t row, Batch& batch) const;
  // The documents of the window of inputs [start, start + seq_len) into `row` of batch.
  void mark_documents(int64_t start, int64_t row, Batch& batch) const;

  TokenSource source_;
  std::vector<int64_t> document_starts_;
  std::string name_;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t val_begin_;
  int64_t train_windows_;
  int64_t val_windows_;
  DataState state_;
};

// What the samples of a make_dataset spec are, which decides what evaluation reports:
// synthetic tasks have answers (exact match), text files are bytes (bits per byte), token
// files are tokens of some tokenizer (loss and perplexity per token).
enum class DataKind { kTask, kText, kTokens };
DataKind data_kind(std::string_view spec);

// "passkey", "mqar", "copy", "text:<paths>" (bytes of files) or "tokens:<paths>" (RDTOK
// files); <paths> is one path or several, comma-separated, a folder standing for the regular
// files below it in name order. Throws rd::Error(kInvalidArgument) for an unknown spec or a
// folder without files, plus the datasets' errors.
std::unique_ptr<Dataset> make_dataset(std::string_view spec, const DatasetOptions& options);

}  // namespace rd::train
