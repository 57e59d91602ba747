// Thread-count control of the CPU backend (OpenMP underneath). Public so tests and tools can
// pin the thread count without depending on OpenMP themselves.
#pragma once

namespace rd::kernels::cpu {

// Threads used by later parallel CPU kernels started from the calling thread (>= 1; it sets
// OpenMP's per-thread default). Results never depend on it.
void set_num_threads(int threads);
int num_threads();

}  // namespace rd::kernels::cpu
