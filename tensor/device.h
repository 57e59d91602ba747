// Runtime device queries. The Device type itself is in kernels/device.h.
#pragma once

#include "ringdilated/kernels/device.h"

namespace rd {

// True when this build has the CUDA backend and a CUDA device is visible at run time.
bool cuda_available();

}  // namespace rd
