// Byte copies between the host and CUDA devices, and between devices: what Tensor::to(Device)
// uses to move a contiguous tensor. Free of CUDA headers so tensor/ can include it.
#pragma once

#include <cstddef>

#include "ringdilated/kernels/device.h"

namespace rd::kernels::cuda {

// Host<->device copies move through pinned staging buffers of at most this many bytes each,
// so a huge tensor does not need as much pinned memory as its own size.
inline constexpr size_t kStagingChunkBytes = size_t{32} << 20;  // 32 MiB

// Copies `nbytes` from `src` on `src_device` to `dst` on `dst_device`; both ranges are
// contiguous. Copies are ordered with the work queued on the current streams
// (current_stream()) of the devices involved:
//   host -> device: `src` is read before the call returns; the copy is queued on the
//     destination's current stream, so later work on that stream sees the data.
//   device -> host: queued on the source's current stream after the work already there;
//     `dst` holds the data when the call returns.
//   device -> same device: queued on the device's current stream.
//   device -> other device: runs after the work already queued on both current streams;
//     later work on the destination's current stream sees the data.
//   host -> host: a plain memcpy.
// Work on other streams that touches the memory must synchronize with these streams itself.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                size_t nbytes);

}  // namespace rd::kernels::cuda
