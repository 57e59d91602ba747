// Thread-count control of the CPU backend (OpenMP underneath, and OpenBLAS for GEMMs). Public
// so tests and tools can pin the thread count without depending on OpenMP themselves.
#pragma once

#include <string>

namespace rd::kernels::cpu {

// Threads used by later parallel CPU kernels started from the calling thread (>= 1; it sets
// OpenMP's per-thread default) and by every later OpenBLAS call (OpenBLAS keeps one count
// per process). Our own kernels split their work the same way for every count, so their
// results never depend on it; OpenBLAS's GEMMs can round some shapes differently with it
// (tensor_api_test checks the former).
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

// OpenBLAS, its version and the kernel set it chose for this CPU ("OpenBLAS 0.3.21
// Cooperlake": the first words of openblas_get_config(), then openblas_get_corename()). The
// CPU's instruction set picks OpenBLAS's kernels (and the C library's math functions), so a
// training run retraces another bit for bit only with the same kernel set (and, for GEMMs,
// the same thread count).
std::string blas_kernel_set();

}  // namespace rd::kernels::cpu
