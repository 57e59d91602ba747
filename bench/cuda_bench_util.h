// CUDA resources the GPU benches share: device detection, an owned event, raw device memory
// for ceilings that must not depend on the library's allocator, and event timing of calls.
#pragma once

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "ringdilated/kernels/cuda/runtime.h"

namespace rd::bench {

inline bool have_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

class CudaEvent {
 public:
  CudaEvent() { RD_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~CudaEvent() { cudaEventDestroy(event_); }  // a destructor cannot throw; nothing to recover
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    RD_CUDA_CHECK(cudaMalloc(&data_, std::max<size_t>(bytes, 16)));
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

// GPU seconds of `calls` back-to-back calls of `op`, between two events on `stream` (host
// gaps between queued kernels count: they are part of a call's cost).
template <class Op>
double gpu_seconds_of_calls(const Op& op, int64_t calls, cudaStream_t stream) {
  CudaEvent start, stop;
  RD_CUDA_CHECK(cudaEventRecord(start.get(), stream));
  for (int64_t i = 0; i < calls; ++i) op();
  RD_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
  RD_CUDA_CHECK(cudaEventSynchronize(stop.get()));
  float milliseconds = 0.0f;
  RD_CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start.get(), stop.get()));
  return static_cast<double>(milliseconds) * 1e-3;
}

}  // namespace rd::bench

#endif  // RD_WITH_CUDA
