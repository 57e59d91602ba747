// cpu_backend() and the CPU backend's thread-count control.
#include "ringdilated/kernels/cpu/backend.h"

#include <omp.h>

#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels {

KernelBackend& cpu_backend() {
  static cpu::CpuBackend backend;  // stateless: safe to share
  return backend;
}

namespace cpu {

void set_num_threads(int threads) {
  RD_CHECK(threads >= 1, kInvalidArgument, "set_num_threads: argument 'threads' must be >= 1, got ",
           threads);
  omp_set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace cpu
}  // namespace rd::kernels
