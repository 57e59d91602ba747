// Numbers written as text (flags, environment variables, data specs), parsed one way
// everywhere: the whole text, nothing else, in T's range.
#pragma once

#include <charconv>
#include <optional>
#include <string_view>
#include <system_error>

namespace rd {

// The whole of `text` as a T (std::from_chars: no locale, no leading spaces or '+'), or
// nullopt for empty text, trailing characters or a value outside T's range.
template <class T>
std::optional<T> number_from_text(std::string_view text) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end) return std::nullopt;
  return value;
}

}  // namespace rd
