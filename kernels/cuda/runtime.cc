// CUDA runtime plumbing: error reporting, current streams, device guard.
#include "ringdilated/kernels/cuda/runtime.h"

#include <array>

namespace rd::kernels::cuda {

namespace {
// Enough for any single host; devices beyond it are refused with a clear error.
constexpr int kMaxDevices = 64;

// Per thread, like CUDA's own current device: each thread picks its stream independently.
thread_local std::array<cudaStream_t, kMaxDevices> current_streams{};

cudaStream_t& stream_slot(int device) {
  RD_CHECK(device >= 0 && device < kMaxDevices, kDeviceMismatch, "cuda: device index ", device,
           " is out of range [0, ", kMaxDevices, ")");
  return current_streams[device];
}
}  // namespace

void throw_cuda_error(cudaError_t status, const char* expression, const char* file, int line) {
  cudaGetLastError();  // clear a sticky non-fatal error so later calls are not blamed
  ErrorCode code =
      status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal;
  throw Error(code, str_cat("CUDA error ", cudaGetErrorName(status), " (",
                            cudaGetErrorString(status), ") in ", expression, " at ", file, ":",
                            line));
}

cudaStream_t current_stream(int device) { return stream_slot(device); }

void set_current_stream(int device, cudaStream_t stream) {
  RD_CHECK(stream != cudaStreamPerThread, kInvalidArgument, "cuda: device ", device,
           ": cudaStreamPerThread cannot be a current stream (one handle, a different stream "
           "on each thread, which caches keyed by stream cannot tell apart); create a stream "
           "per thread (rd::Stream::create)");
  stream_slot(device) = stream;
}

StreamGuard::StreamGuard(int device, cudaStream_t stream)
    : device_(device), previous_(stream_slot(device)) {
  set_current_stream(device, stream);
}

StreamGuard::~StreamGuard() { current_streams[device_] = previous_; }

DeviceGuard::DeviceGuard(int device) {
  RD_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    RD_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);  // destructors must not throw
}

}  // namespace rd::kernels::cuda
