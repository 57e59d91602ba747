// Which allocator serves a device. The Allocator interface itself is in kernels/allocator.h.
#pragma once

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/tensor/device.h"

namespace rd {

// The process-wide allocator of a device. The pool is deliberately per process, as a
// device's memory is: every tensor on that device shares it.
Allocator& allocator_for(Device device);

}  // namespace rd
