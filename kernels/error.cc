// Names of error codes, for messages and tests.
#include "ringdilated/kernels/error.h"

namespace rd {

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
