// CUDA runtime plumbing shared by every CUDA file: checked calls that report file:line,
// the per-thread current stream of each device, and a current-device guard.
#pragma once

#include <cuda_runtime.h>

#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {

// Throws rd::Error naming the failed call, the CUDA error and where it happened.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expression, const char* file,
                                   int line);

// The stream that work for `device` is queued on by this thread (the legacy default stream
// unless a StreamGuard is active).
cudaStream_t current_stream(int device);

// Makes `stream` this thread's current stream of `device`. cudaStreamPerThread is refused
// (kInvalidArgument): its one handle names a different stream on every thread, which the
// caches keyed by stream (the allocator's free blocks, GEMM workspaces) cannot tell apart;
// create a stream per thread instead.
void set_current_stream(int device, cudaStream_t stream);

// Makes `stream` the current stream of `device` on this thread for the guard's lifetime.
class StreamGuard {
 public:
  StreamGuard(int device, cudaStream_t stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t previous_;
};

// Makes `device` current for the guard's lifetime and restores the previous one after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace rd::kernels::cuda

// RD_CUDA_CHECK(cudaMemcpyAsync(...)): throws rd::Error (kInternal, or kOutOfMemory for
// allocation failures) with the expression, the CUDA error string and file:line.
#define RD_CUDA_CHECK(expr)                                                            \
  do {                                                                                 \
    cudaError_t rd_cuda_status_ = (expr);                                              \
    if (rd_cuda_status_ != cudaSuccess) [[unlikely]] {                                 \
      ::rd::kernels::cuda::throw_cuda_error(rd_cuda_status_, #expr, __FILE__, __LINE__); \
    }                                                                                  \
  } while (false)

// RD_CUDA_CHECK_LAUNCH(): checks the launch just made (bad configuration, missing image).
#define RD_CUDA_CHECK_LAUNCH() RD_CUDA_CHECK(cudaGetLastError())
