// Internal glue from tensors to kernels: which backend serves a device, and the raw
// StridedView of a tensor. Used by op implementations, not by users.
#pragma once

#include "ringdilated/kernels/backend.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {

// The kernel backend of `device`; throws kDeviceMismatch if this build lacks it.
kernels::KernelBackend& backend_for(Device device);

// The kernel view of `t` (data pointer with offset applied). `op` names the caller in the
// error raised when t has more than kernels::kMaxDims dims.
kernels::StridedView kernel_view(const Tensor& t, const char* op = "kernel_view");

}  // namespace rd
