// Runtime device queries and the CPU thread count. The Device type itself is in
// kernels/device.h.
#pragma once

#include "ringdilated/kernels/device.h"

namespace rd {

// True when this build has the CUDA backend and a CUDA device is visible at run time.
bool cuda_available();

// Compute capability of a CUDA device as major * 10 + minor (90 for an H100), or 0 for the
// CPU and in builds without CUDA.
int cuda_compute_capability(Device device);

// Blocks the calling thread until the work it queued on `device` (on its current stream) has
// finished. Nothing to wait for on the CPU.
void synchronize(Device device);

// The threads later CPU ops use (>= 1; as torch.set_num_threads): OpenMP's count for the
// calling thread and OpenBLAS's for GEMMs, set together so the two never compete for more
// cores than asked (kernels/cpu/parallel.h says why). Results never depend on it. The
// default is OpenMP's (OMP_NUM_THREADS, else every core). Throws rd::Error when < 1.
void set_num_threads(int threads);
int num_threads();

}  // namespace rd
