// The event bookkeeping that the CUDA caching allocator and the pinned host pool share:
// reusing spare events, and retiring the pending events that guard memory reuse.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <deque>
#include <vector>

#include "ringdilated/kernels/cuda/runtime.h"

namespace rd::kernels::cuda {

// The last of `spare`, or a new event of the current device when none is left. Timing is
// never read; events without it are cheaper to record and query.
inline cudaEvent_t take_spare_event(std::vector<cudaEvent_t>& spare) {
  if (!spare.empty()) {
    cudaEvent_t event = spare.back();
    spare.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  RD_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

// Looks at each entry of `pending` (each with an `event`) once, waiting for its event when
// `wait`: a completed one leaves the queue and goes to `completed(entry)`, one still running
// goes to the back. A failing call throws and leaves its entry in place, so the caller's
// bookkeeping stays consistent for the error.
template <class Pending, class Completed>
void retire_completed_events(std::deque<Pending>& pending, bool wait, Completed&& completed) {
  for (size_t n = pending.size(); n > 0; --n) {
    const Pending entry = pending.front();
    const cudaError_t status =
        wait ? cudaEventSynchronize(entry.event) : cudaEventQuery(entry.event);
    if (status == cudaErrorNotReady) {
      static_cast<void>(cudaGetLastError());  // "not ready" is an answer, not an error
      pending.pop_front();
      pending.push_back(entry);
      continue;
    }
    if (status != cudaSuccess) {
      throw_cuda_error(status, wait ? "cudaEventSynchronize(event)" : "cudaEventQuery(event)",
                       __FILE__, __LINE__);
    }
    pending.pop_front();
    completed(entry);
  }
}

}  // namespace rd::kernels::cuda
