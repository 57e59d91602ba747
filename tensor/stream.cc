// Streams and events (see stream.h): thin owners of CUDA streams and events, and
// record_stream through the device's caching allocator.
#include "ringdilated/tensor/stream.h"

#include "ringdilated/kernels/error.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/async_error.h"
#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace rd {

#if defined(RD_WITH_CUDA)

namespace {

cudaStream_t native_of(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

}  // namespace

Stream Stream::current(Device device) {
  if (device.is_cpu()) return Stream(device, nullptr, nullptr);
  return Stream(device, kernels::cuda::current_stream(device.index), nullptr);
}

Stream Stream::create(Device device) {
  if (device.is_cpu()) return Stream(device, nullptr, nullptr);
  kernels::cuda::DeviceGuard guard(device.index);
  cudaStream_t stream = nullptr;
  RD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The last copy destroys it; cudaStreamDestroy lets queued work finish first.
  std::shared_ptr<void> owner(stream, [](void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); });
  return Stream(device, stream, std::move(owner));
}

void Stream::synchronize() const {
  if (device_.is_cpu()) return;
  kernels::cuda::synchronize_stream(device_.index, native_of(*this));
}

StreamGuard::StreamGuard(const Stream& stream) : stream_(stream) {
  if (stream_.device().is_cpu()) return;
  previous_ = kernels::cuda::current_stream(stream_.device().index);
  kernels::cuda::set_current_stream(stream_.device().index, native_of(stream_));
}

StreamGuard::~StreamGuard() {
  if (stream_.device().is_cpu()) return;
  kernels::cuda::set_current_stream(stream_.device().index, static_cast<cudaStream_t>(previous_));
}

void Event::record(const Stream& stream) {
  if (stream.device().is_cpu()) return;
  kernels::cuda::DeviceGuard guard(stream.device().index);
  if (!event_ || !(device_ == stream.device())) {
    cudaEvent_t e = nullptr;
    RD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event_.reset(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
    device_ = stream.device();
  }
  RD_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_.get()), native_of(stream)));
}

void Event::block(const Stream& stream) const {
  if (!event_ || stream.device().is_cpu()) return;
  kernels::cuda::DeviceGuard guard(stream.device().index);
  RD_CUDA_CHECK(cudaStreamWaitEvent(native_of(stream), static_cast<cudaEvent_t>(event_.get()), 0));
}

void Event::synchronize() const {
  if (!event_) return;
  RD_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_.get())));
  kernels::cuda::after_host_wait(device_.index);
}

bool Event::query() const {
  if (!event_) return true;
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_.get()));
  if (status == cudaErrorNotReady) return false;
  RD_CUDA_CHECK(status);
  return true;
}

void record_stream(const Tensor& t, const Stream& stream) {
  RD_CHECK(t.defined(), kInvalidArgument, "record_stream: argument 't' is undefined");
  RD_CHECK(t.device() == stream.device(), kDeviceMismatch, "record_stream: the tensor is on ",
           t.device().str(), " but the stream on ", stream.device().str());
  // User memory (from_blob) is the user's to keep alive; only the pool reuses memory.
  if (t.device().is_cpu() || !t.storage()->pool_owned() || t.storage()->nbytes() == 0) return;
  kernels::cuda::cuda_caching_allocator(t.device().index)
      .record_stream(t.storage()->data(), native_of(stream));
}

#else  // no CUDA in this build: only the CPU exists, where every call is a no-op

Stream Stream::current(Device device) { return Stream(device, nullptr, nullptr); }
Stream Stream::create(Device device) { return Stream(device, nullptr, nullptr); }
void Stream::synchronize() const {}
StreamGuard::StreamGuard(const Stream& stream) : stream_(stream) {}
StreamGuard::~StreamGuard() = default;
void Event::record(const Stream&) {}
void Event::block(const Stream&) const {}
void Event::synchronize() const {}
bool Event::query() const { return true; }
void record_stream(const Tensor& t, const Stream& stream) {
  RD_CHECK(t.defined(), kInvalidArgument, "record_stream: argument 't' is undefined");
  RD_CHECK(t.device() == stream.device(), kDeviceMismatch, "record_stream: the tensor is on ",
           t.device().str(), " but the stream on ", stream.device().str());
}

#endif

}  // namespace rd
