// CUDA device discovery for the runtime checks above the kernel layer.
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/device_info.h"

namespace rd::kernels::cuda {

int device_count() {
  int count = 0;
  // No driver or no device both mean "no CUDA here"; clear the sticky error either way.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

int compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

}  // namespace rd::kernels::cuda
