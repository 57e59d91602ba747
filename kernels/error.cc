// Names of error codes, for messages and tests, and the log.
#include "ringdilated/kernels/error.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace rd {

void log_once(const std::string& message) {
  // Never destroyed: destructors of other statics may still log at exit.
  static std::mutex* const mutex = new std::mutex();
  static std::set<std::string>* const seen = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(*mutex);
  if (seen->insert(message).second) std::fprintf(stderr, "[ringdilated] %s\n", message.c_str());
}

void log_destructor_failure(const char* what, const char* reason) noexcept {
  try {
    log_once(str_cat(what, " failed in a destructor, which must not throw (", reason,
                     "); the resource is leaked"));
  } catch (...) {
    std::fputs("[ringdilated] a destructor's release failed (and so did logging it)\n", stderr);
  }
}

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kShapeMismatch: return "ShapeMismatch";
    case ErrorCode::kDTypeMismatch: return "DTypeMismatch";
    case ErrorCode::kDeviceMismatch: return "DeviceMismatch";
    case ErrorCode::kOutOfRange: return "OutOfRange";
    case ErrorCode::kOutOfMemory: return "OutOfMemory";
    case ErrorCode::kIo: return "Io";
    case ErrorCode::kCorruptFile: return "CorruptFile";
    case ErrorCode::kAutograd: return "Autograd";
    case ErrorCode::kUnimplemented: return "Unimplemented";
    case ErrorCode::kTimeout: return "Timeout";
    case ErrorCode::kAborted: return "Aborted";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

}  // namespace rd
