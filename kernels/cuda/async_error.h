// Errors that CUDA kernels find while they run (an out-of-range index or target), recorded
// on the device without making the host wait, and raised at the next host synchronization
// the library performs. Also counts those synchronizations, for tests that check a training
// step makes none.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "ringdilated/kernels/half.h"  // RD_HOST_DEVICE

namespace rd::kernels::cuda {

// The op that recorded an error; names it in the message.
enum class AsyncErrorOp : int32_t {
  kNone = 0,
  kIndexSelect,
  kIndexAdd,
  kGather,
  kScatter,
  kCrossEntropy,
  kCrossEntropyBackward,
};

const char* async_error_op_name(AsyncErrorOp op);

// The first error recorded since the last one was raised. It lives in mapped pinned host
// memory: the one thread that claims it writes the fields over the bus (only ever on the
// error path), and the host reads them after a synchronization without a copy. `op` is
// written last, after a system-wide fence.
struct AsyncErrorRecord {
  int64_t value;     // the offending index
  int64_t limit;     // valid values are [0, limit)
  int64_t position;  // the row (cross-entropy position) that held it, or -1 when not told
  int32_t op;        // an AsyncErrorOp; kNone while nothing is recorded
};

// What a kernel reports through, passed by value.
struct AsyncErrorSink {
  unsigned int* claim = nullptr;       // device memory: 0 until a thread claims the record
  AsyncErrorRecord* record = nullptr;  // the record's device address
  AsyncErrorOp op = AsyncErrorOp::kNone;

  // Records (value, limit, position) unless an error is recorded already (the first claim
  // wins; which of several bad values of one launch wins is unspecified). The caller then
  // skips the access: nothing is read or written out of bounds.
  RD_HOST_DEVICE void report(int64_t value, int64_t limit, int64_t position = -1) const {
#if defined(__CUDA_ARCH__)
    if (atomicCAS(claim, 0u, 1u) != 0u) return;
    volatile AsyncErrorRecord* r = record;
    r->value = value;
    r->limit = limit;
    r->position = position;
    __threadfence_system();
    r->op = static_cast<int32_t>(op);
#else  // host emulation of kernel bodies (strided_index.cuh): runs in order
    if (*claim != 0u) return;
    *claim = 1u;
    record->value = value;
    record->limit = limit;
    record->position = position;
    record->op = static_cast<int32_t>(op);
#endif
  }
};

// The error record of one device and its count of host synchronizations, owned by the
// device's CudaBackend and allocated once with it (a few bytes of device memory and of
// mapped pinned host memory).
//
// Semantics: a kernel that finds a bad index records it and skips that element (a gather
// writes 0, a scatter writes nothing, cross_entropy makes the loss NaN); the host goes on.
// The next synchronization the library makes with the device (rd::synchronize,
// Stream/Event::synchronize, a device-to-host copy, rd::check_async_errors) raises it as
// rd::Error kOutOfRange naming the op and the index (for cross-entropy, the message of
// kernels/rowwise.h's cross_entropy_target_message, row included), and clears it. Work on another stream
// that has not finished at that point reports at a later synchronization.
class AsyncErrors {
 public:
  explicit AsyncErrors(int device);
  ~AsyncErrors();
  AsyncErrors(const AsyncErrors&) = delete;
  AsyncErrors& operator=(const AsyncErrors&) = delete;

  AsyncErrorSink sink(AsyncErrorOp op) const { return {claim_, device_record_, op}; }

  // Throws the recorded error, if any, and clears it; `stream` (idle) orders the reset of
  // the claim before later kernels. Call only after the host waited for the work that may
  // have recorded it.
  void raise_pending(cudaStream_t stream);

  // Counts one host wait for this device's work.
  void note_host_sync() { host_syncs_.fetch_add(1, std::memory_order_relaxed); }
  int64_t host_syncs() const { return host_syncs_.load(std::memory_order_relaxed); }

 private:
  int device_;
  unsigned int* claim_ = nullptr;
  AsyncErrorRecord* host_record_ = nullptr;
  AsyncErrorRecord* device_record_ = nullptr;
  std::mutex mutex_;  // one raiser at a time
  std::atomic<int64_t> host_syncs_{0};
};

// The AsyncErrors of CUDA device `device` (those of its backend; kernels/cuda/backend.cc).
AsyncErrors& async_errors(int device);

// Makes the host wait for `stream` of `device`, counts it, and raises what the device's
// kernels recorded: every host synchronization the library makes with a stream goes
// through here (waits for events call after_host_wait).
void synchronize_stream(int device, cudaStream_t stream);

// Counts a host wait on `device` that did not go through synchronize_stream (an event) and
// raises what the device recorded.
void after_host_wait(int device);

}  // namespace rd::kernels::cuda
