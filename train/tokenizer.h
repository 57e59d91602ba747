// ByteTokenizer: the byte-level vocabulary of rd_train. Tokens 0..255 are bytes, then a few
// special tokens; every string encodes and every byte sequence decodes back losslessly.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace rd::train {

// Targets equal to this add nothing to the loss (rd::cross_entropy's default ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;

class ByteTokenizer {
 public:
  static constexpr int32_t kByteTokens = 256;  // tokens 0..255 are the bytes themselves
  static constexpr int32_t kBos = 256;  // begins every synthetic sample
  static constexpr int32_t kEos = 257;
  static constexpr int32_t kPad = 258;
  static constexpr int32_t kSep = 259;  // separates a task's context from its queries
  static constexpr int32_t kVocabSize = 260;

  static constexpr int64_t vocab_size() { return kVocabSize; }
  static constexpr bool is_byte(int32_t token) { return token >= 0 && token < kByteTokens; }

  // One token per byte of `text`.
  static std::vector<int32_t> encode(std::string_view text);
  // Bytes as themselves, specials as "<bos>", "<eos>", "<pad>", "<sep>", the ignore index
  // as "<ignore>" and anything else outside the vocabulary as "<?N>", so that a model's
  // predictions always print.
  static std::string decode(std::span<const int32_t> tokens);
  // The text of one token, as decode() writes it.
  static std::string token_text(int32_t token);
};

}  // namespace rd::train
