// Streams and events above kernels/cuda: where a thread's device work is queued, how work on
// two streams is ordered, and record_stream, which keeps a tensor's memory from being
// reused while another stream still uses it. On the CPU, work runs as it is called: every
// call here is a no-op there.
#pragma once

#include <memory>

#include "ringdilated/kernels/device.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {

// A queue of work on one device. Copies share the same queue; a stream from create() is
// destroyed with its last copy (after its work finished).
class Stream {
 public:
  // The stream this thread queues `device`'s work on: the one a StreamGuard made current,
  // else the device's default stream.
  static Stream current(Device device);
  // A new stream of `device`, ordered with no other (non-blocking).
  static Stream create(Device device);

  Device device() const { return device_; }
  // The host waits until the work queued so far has finished.
  void synchronize() const;
  // The backend's handle (a cudaStream_t on CUDA; null for the CPU and the default stream).
  void* native() const { return handle_; }
  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }

 private:
  Stream(Device device, void* handle, std::shared_ptr<void> owner)
      : device_(device), handle_(handle), owner_(std::move(owner)) {}
  Device device_;
  void* handle_ = nullptr;
  std::shared_ptr<void> owner_;  // set for created streams
};

// Makes `stream` the current stream of its device on this thread while the guard lives.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream stream_;
  void* previous_ = nullptr;
};

// A point in a stream's work: record() marks the work queued so far, block() makes another
// stream wait for it without the host waiting.
class Event {
 public:
  Event() = default;
  void record(const Stream& stream);
  void block(const Stream& stream) const;  // `stream` waits for the recorded work
  void synchronize() const;                // the host waits for it
  bool query() const;                      // whether it has finished (true when unrecorded)

 private:
  Device device_;
  std::shared_ptr<void> event_;
};

// Declares that work queued on `stream` uses t's memory, so that when t's storage is freed
// its memory is not reused before that work has finished. Needed whenever a tensor
// allocated on one stream is read or written by another, unless the allocating stream
// itself waits for that work (an Event) before the tensor is freed. `stream` must outlive
// t's storage: the free records an event on it.
void record_stream(const Tensor& t, const Stream& stream);

}  // namespace rd
