// CUDA resources the GPU benches share: device detection, an owned event, and raw device
// memory for ceilings that must not depend on the library's allocator.
#pragma once

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

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

}  // namespace rd::bench

#endif  // RD_WITH_CUDA
