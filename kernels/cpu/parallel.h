// Thread-count control of the CPU backend (OpenMP underneath, and OpenBLAS for GEMMs). Public
// so tests and tools can pin the thread count without depending on OpenMP themselves.
#pragma once

namespace rd::kernels::cpu {

// Threads used by later parallel CPU kernels started from the calling thread (>= 1; it sets
// OpenMP's per-thread default) and by every later OpenBLAS call (OpenBLAS keeps one count
// per process). Results never depend on it.
//
// Both counts are set because Debian's default OpenBLAS is the pthread build, which keeps a
// thread pool of its own beside OpenMP's: left at its default (all cores) it would run a
// GEMM on every core while OpenMP was pinned to fewer, and the two pools would compete.
// The first use of the CPU backend aligns OpenBLAS with OpenMP's count in the same way,
// unless OPENBLAS_NUM_THREADS is set, which then keeps the last word until this is called.
void set_num_threads(int threads);
int num_threads();
// The threads OpenBLAS uses for one call (its openblas_get_num_threads()).
int blas_num_threads();

}  // namespace rd::kernels::cpu
