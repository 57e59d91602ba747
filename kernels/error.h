// The library's one error model: rd::Error exceptions carrying an ErrorCode and a message
// that names the op, the argument and the offending shapes or values.
#pragma once

#include <cstdint>
#include <exception>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace rd {

enum class ErrorCode : uint8_t {
  kInvalidArgument,  // a value is out of its domain (negative size, bad option, ...)
  kShapeMismatch,    // shapes cannot be combined
  kDTypeMismatch,    // a dtype is not supported or dtypes disagree
  kDeviceMismatch,   // tensors live on different devices, or the device is unavailable
  kOutOfRange,       // an index or dim is outside its bounds
  kOutOfMemory,      // an allocator could not satisfy a request
  kIo,               // a file could not be read or written
  kCorruptFile,      // a file's contents break its format
  kAutograd,         // misuse of the autograd graph (second backward, no grad_fn, ...)
  kUnimplemented,    // a valid request this build cannot serve
  kTimeout,          // a wait (rendezvous, collective, receive) passed its deadline
  kAborted,          // a communicator was aborted, e.g. because another rank failed
  kInternal,         // a bug in the library
};

std::string_view error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// Concatenates anything streamable (strings, string_views, numbers) into one message.
// Used instead of absl::StrCat because Debian's Abseil does not take std::string_view.
template <class... Pieces>
std::string str_cat(const Pieces&... pieces) {
  std::ostringstream out;
  out.precision(10);
  (out << ... << pieces);
  return out.str();
}

// "[2, 3, 4]": shapes in messages always print this way.
inline std::string shape_str(std::span<const int64_t> shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}
inline std::string shape_str(const std::vector<int64_t>& shape) {
  return shape_str(std::span<const int64_t>(shape));
}

// Writes "[ringdilated] <message>" to stderr the first time the process logs this message;
// repeats are dropped, so a warning does not flood a long run. Thread-safe. The library's
// one log (path fallbacks, failures in destructors).
void log_once(const std::string& message);

// Logs, once per distinct text, that `what` failed in a destructor for `reason`. Never
// throws: what it cannot log it drops.
void log_destructor_failure(const char* what, const char* reason) noexcept;

// For destructors, which must not throw (an exception leaving one ends the process through
// std::terminate): runs `release` and turns anything it throws into a log line naming `what`
// (e.g. "Storage: returning 4096 bytes to the cpu pool"). The resource is then leaked.
template <class F>
void release_in_destructor(const char* what, F&& release) noexcept {
  try {
    release();
  } catch (const std::exception& e) {
    log_destructor_failure(what, e.what());
  } catch (...) {
    log_destructor_failure(what, "an exception that is not a std::exception");
  }
}

}  // namespace rd

// RD_CHECK(cond, code, pieces...): throws rd::Error(code, str_cat(pieces...)) when cond fails.
// Messages start with the op name, e.g. RD_CHECK(ok, kShapeMismatch, "matmul: ...").
#define RD_CHECK(cond, code, ...)                                               \
  do {                                                                          \
    if (!(cond)) [[unlikely]] {                                                 \
      throw ::rd::Error(::rd::ErrorCode::code, ::rd::str_cat(__VA_ARGS__));    \
    }                                                                           \
  } while (false)

#define RD_FAIL(code, ...) throw ::rd::Error(::rd::ErrorCode::code, ::rd::str_cat(__VA_ARGS__))
