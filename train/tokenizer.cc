// ByteTokenizer: bytes map to themselves; the specials print as names in angle brackets.
#include "ringdilated/train/tokenizer.h"

namespace rd::train {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<int32_t> tokens;
  tokens.reserve(text.size());
  for (char c : text) tokens.push_back(static_cast<unsigned char>(c));
  return tokens;
}

std::string ByteTokenizer::token_text(int32_t token) {
  if (is_byte(token)) return std::string(1, static_cast<char>(token));
  switch (token) {
    case kBos: return "<bos>";
    case kEos: return "<eos>";
    case kPad: return "<pad>";
    case kSep: return "<sep>";
    case kIgnoreIndex: return "<ignore>";
    default: return "<?" + std::to_string(token) + ">";
  }
}

std::string ByteTokenizer::decode(std::span<const int32_t> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (int32_t token : tokens) {
    if (is_byte(token)) {
      text.push_back(static_cast<char>(token));
    } else {
      text += token_text(token);
    }
  }
  return text;
}

}  // namespace rd::train
