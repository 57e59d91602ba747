// AsyncErrors: the per-device record of errors found by running kernels, and the host
// synchronizations that raise them.
#include "ringdilated/kernels/cuda/async_error.h"

#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/rowwise.h"

namespace rd::kernels::cuda {

const char* async_error_op_name(AsyncErrorOp op) {
  switch (op) {
    case AsyncErrorOp::kNone: return "?";
    case AsyncErrorOp::kIndexSelect: return "index_select";
    case AsyncErrorOp::kIndexAdd: return "index_add";
    case AsyncErrorOp::kGather: return "gather";
    case AsyncErrorOp::kScatter: return "scatter";
    case AsyncErrorOp::kCrossEntropy: return "cross_entropy";
    case AsyncErrorOp::kCrossEntropyBackward: return "cross_entropy_backward";
  }
  return "?";
}

AsyncErrors::AsyncErrors(int device) : device_(device) {
  DeviceGuard guard(device);
  void* host = nullptr;
  RD_CUDA_CHECK(cudaHostAlloc(&host, sizeof(AsyncErrorRecord),
                              cudaHostAllocMapped | cudaHostAllocPortable));
  host_record_ = static_cast<AsyncErrorRecord*>(host);
  *host_record_ = AsyncErrorRecord{0, 0, -1, static_cast<int32_t>(AsyncErrorOp::kNone)};
  void* device_record = nullptr;
  RD_CUDA_CHECK(cudaHostGetDevicePointer(&device_record, host, 0));
  device_record_ = static_cast<AsyncErrorRecord*>(device_record);
  void* claim = nullptr;
  RD_CUDA_CHECK(cudaMalloc(&claim, sizeof(unsigned int)));
  claim_ = static_cast<unsigned int*>(claim);
  // Once per device and process: the claim must read 0 before any kernel of any stream
  // (non-blocking ones included) can see it.
  RD_CUDA_CHECK(cudaMemset(claim_, 0, sizeof(unsigned int)));
  RD_CUDA_CHECK(cudaDeviceSynchronize());
}

AsyncErrors::~AsyncErrors() {
  // Destructors must not throw; a failure here only leaks a few bytes.
  static_cast<void>(cudaFree(claim_));
  static_cast<void>(cudaFreeHost(host_record_));
}

void AsyncErrors::raise_pending(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  volatile AsyncErrorRecord* record = host_record_;
  const auto op = static_cast<AsyncErrorOp>(record->op);
  if (op == AsyncErrorOp::kNone) return;
  const int64_t value = record->value;
  const int64_t limit = record->limit;
  const int64_t position = record->position;
  record->op = static_cast<int32_t>(AsyncErrorOp::kNone);
  {
    DeviceGuard guard(device_);
    RD_CUDA_CHECK(cudaMemsetAsync(claim_, 0, sizeof(unsigned int), stream));
  }
  const bool target = op == AsyncErrorOp::kCrossEntropy ||
                      op == AsyncErrorOp::kCrossEntropyBackward;
  const char* where = " (found by a kernel on cuda:";
  if (target) {
    RD_FAIL(kOutOfRange,
            cross_entropy_target_message(async_error_op_name(op), value, position, limit), where,
            device_, ", raised at the next synchronization)");
  }
  RD_FAIL(kOutOfRange, async_error_op_name(op), ": index ", value,
          " is out of range for a dim of size ", limit, where, device_,
          ", raised at the next synchronization)");
}

void synchronize_stream(int device, cudaStream_t stream) {
  DeviceGuard guard(device);
  RD_CUDA_CHECK(cudaStreamSynchronize(stream));
  AsyncErrors& errors = async_errors(device);
  errors.note_host_sync();
  errors.raise_pending(stream);
}

void after_host_wait(int device) {
  AsyncErrors& errors = async_errors(device);
  errors.note_host_sync();
  errors.raise_pending(current_stream(device));
}

}  // namespace rd::kernels::cuda
