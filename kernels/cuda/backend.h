// The CUDA implementation of KernelBackend, one instance per device.
#pragma once

#include "ringdilated/kernels/backend.h"

namespace rd::kernels::cuda {

// The backend of CUDA device `device`, created on first use. Each call makes the device
// current, queues its work on the thread's current stream of that device and returns
// without waiting.
KernelBackend& cuda_backend(int device);
// (async_errors(device), declared in async_error.h, is the error record this backend owns.)

}  // namespace rd::kernels::cuda
