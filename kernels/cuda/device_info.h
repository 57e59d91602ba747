// CUDA device discovery; only declared in builds with RD_WITH_CUDA.
#pragma once

namespace rd::kernels::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device.
int device_count();

}  // namespace rd::kernels::cuda
