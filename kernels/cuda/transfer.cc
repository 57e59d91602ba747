// Host<->device copies staged through pinned buffers, and device<->device copies ordered
// with the current streams of both devices.
#include "ringdilated/kernels/cuda/transfer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "ringdilated/kernels/cuda/async_error.h"
#include "ringdilated/kernels/cuda/pinned_pool.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

// A buffer from the pinned pool. If the scope ends before release_after() handed it over
// (an exception before any copy was queued), it goes straight back to the pool.
class StagingBuffer {
 public:
  explicit StagingBuffer(size_t nbytes) : ptr_(pinned_host_pool().allocate(nbytes)) {}
  ~StagingBuffer() {
    if (ptr_ == nullptr) return;
    release_in_destructor("StagingBuffer: returning a pinned buffer",
                          [&] { pinned_host_pool().release(ptr_); });
  }
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  void* get() const { return ptr_; }
  // Hands the buffer back once the work queued so far on `stream` of `device` completes.
  void release_after(int device, cudaStream_t stream) {
    pinned_host_pool().release_after(std::exchange(ptr_, nullptr), device, stream);
  }

 private:
  void* ptr_;
};

// An event destroyed on scope exit. Destroying a recorded event that has not completed is
// allowed: CUDA frees it once it completes, and waits already queued on it still hold.
class ScopedEvent {
 public:
  // Creates the event on the current device.
  ScopedEvent() { RD_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~ScopedEvent() { static_cast<void>(cudaEventDestroy(event_)); }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Makes work queued from now on on `waiter` (a stream of `waiter_device`) wait for the
// work queued so far on `signaller` (a stream of `signaller_device`).
void stream_wait(int waiter_device, cudaStream_t waiter, int signaller_device,
                 cudaStream_t signaller) {
  DeviceGuard signaller_guard(signaller_device);
  ScopedEvent event;  // an event must belong to the device of the stream it is recorded on
  RD_CUDA_CHECK(cudaEventRecord(event.get(), signaller));
  DeviceGuard waiter_guard(waiter_device);
  RD_CUDA_CHECK(cudaStreamWaitEvent(waiter, event.get(), 0));
}

void host_to_device(void* dst, int device, const void* src, size_t nbytes) {
  DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  for (size_t offset = 0; offset < nbytes; offset += kStagingChunkBytes) {
    const size_t chunk = std::min(kStagingChunkBytes, nbytes - offset);
    // A fresh buffer per chunk: the pool hands back one whose copy has finished, if any,
    // so the host fills one chunk while the previous one is still in flight.
    StagingBuffer staging(chunk);
    std::memcpy(staging.get(), static_cast<const char*>(src) + offset, chunk);
    RD_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + offset, staging.get(), chunk,
                                  cudaMemcpyHostToDevice, stream));
    staging.release_after(device, stream);
  }
}

void device_to_host(void* dst, const void* src, int device, size_t nbytes) {
  DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  // One buffer for every chunk: each chunk is waited for before the next is queued.
  StagingBuffer staging(std::min(kStagingChunkBytes, nbytes));
  for (size_t offset = 0; offset < nbytes; offset += kStagingChunkBytes) {
    const size_t chunk = std::min(kStagingChunkBytes, nbytes - offset);
    RD_CUDA_CHECK(cudaMemcpyAsync(staging.get(), static_cast<const char*>(src) + offset, chunk,
                                  cudaMemcpyDeviceToHost, stream));
    synchronize_stream(device, stream);  // raises what earlier kernels recorded
    std::memcpy(static_cast<char*>(dst) + offset, staging.get(), chunk);
  }
}  // the stream is idle with respect to `staging`: it returns to the pool at once

void device_to_device(void* dst, int dst_device, const void* src, int src_device,
                      size_t nbytes) {
  if (dst_device == src_device) {
    DeviceGuard guard(dst_device);
    RD_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice,
                                  current_stream(dst_device)));
    return;
  }
  const cudaStream_t src_stream = current_stream(src_device);
  const cudaStream_t dst_stream = current_stream(dst_device);
  // The copy runs on the source's stream, after the work producing `src`. `dst` may be a
  // block that earlier work on the destination's stream still uses (the pool reuses blocks
  // in stream order), so wait for that stream too; then let the destination's stream wait
  // for the copy, so the block stays ordered on its own stream.
  stream_wait(src_device, src_stream, dst_device, dst_stream);
  {
    DeviceGuard guard(src_device);
    RD_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, src_stream));
  }
  stream_wait(dst_device, dst_stream, src_device, src_stream);
}

}  // namespace

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                size_t nbytes) {
  if (nbytes == 0) return;
  RD_CHECK(dst != nullptr && src != nullptr, kInvalidArgument, "copy_bytes: null ",
           dst == nullptr ? "destination" : "source", " pointer for a copy of ", nbytes,
           " bytes from ", src_device.str(), " to ", dst_device.str());
  if (src_device.is_cpu() && dst_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
  } else if (src_device.is_cpu()) {
    host_to_device(dst, dst_device.index, src, nbytes);
  } else if (dst_device.is_cpu()) {
    device_to_host(dst, src, src_device.index, nbytes);
  } else {
    device_to_device(dst, dst_device.index, src, src_device.index, nbytes);
  }
}

}  // namespace rd::kernels::cuda
