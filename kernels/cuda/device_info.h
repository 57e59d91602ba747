// CUDA device discovery; only declared in builds with RD_WITH_CUDA.
#pragma once

namespace rd::kernels::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device.
int device_count();

// major * 10 + minor (90 for an H100); 0 when the device cannot be queried.
int compute_capability(int device);

}  // namespace rd::kernels::cuda
