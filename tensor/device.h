// Runtime device queries and the CPU thread count. The Device type itself is in
// kernels/device.h.
#pragma once

#include <cstdint>
#include <string>

#include "ringdilated/kernels/device.h"

namespace rd {

// True when this build has the CUDA backend and a CUDA device is visible at run time.
bool cuda_available();

// How many CUDA devices are visible (0 without the CUDA backend).
int cuda_device_count();

// Compute capability of a CUDA device as major * 10 + minor (90 for an H100), or 0 for the
// CPU and in builds without CUDA.
int cuda_compute_capability(Device device);

// Blocks the calling thread until the work it queued on `device` (on its current stream) has
// finished, then raises any asynchronous error (below). Nothing to wait for on the CPU.
void synchronize(Device device);

// The threads later CPU ops use (>= 1; as torch.set_num_threads): OpenMP's count for the
// calling thread and OpenBLAS's for GEMMs, set together so the two never compete for more
// cores than asked (kernels/cpu/parallel.h says why). Our own kernels' results never depend
// on it; OpenBLAS's GEMMs can round some shapes differently with the thread count. The
// default is OpenMP's (OMP_NUM_THREADS, else every core). Throws rd::Error when < 1.
void set_num_threads(int threads);
int num_threads();
// The CPU's GEMM library, its version and kernel set ("OpenBLAS 0.3.21 Cooperlake"): a CPU of
// another kernel set can round differently, so a run retraces another bit for bit only on the same
// one (and thread count).
std::string cpu_gemm_kernels();

// Asynchronous errors. On CUDA, index ops (embedding, index_select, gather, scatter,
// scatter_add and their backward passes) and cross_entropy do not check index values on the
// host, which would cost a host synchronization per call: the kernels check them as they
// run, skip an out-of-range element (a read gives 0, a write is dropped, a cross-entropy
// loss is NaN; nothing outside a tensor is touched) and record the first bad value on the
// device. The next synchronization the library performs with the device (synchronize,
// Stream/Event::synchronize, a copy to the host such as Tensor::to(cpu) or item(), or
// check_async_errors) throws it as rd::Error kOutOfRange naming the op and the index, and
// clears it; results computed in between are not meaningful. Work still running on another
// stream reports at a later synchronization. The CPU checks indices before any work and
// throws at once.
//
// Waits like synchronize(device) and throws a recorded error; no-op on the CPU.
void check_async_errors(Device device);

// How many times the library made the host wait for `device` (through the points above),
// for tests and debugging: a training step should add none. Waits inside the caching
// allocator (only when it must reclaim memory freed on other streams) are not counted. 0 on
// the CPU.
int64_t host_sync_count(Device device);

}  // namespace rd
