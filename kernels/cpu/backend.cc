// cpu_backend() and the CPU backend's thread-count control (OpenMP and OpenBLAS together).
#include "ringdilated/kernels/cpu/backend.h"

#include <cblas.h>
#include <omp.h>

#include <cstdlib>

#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels {

namespace {

// Gives OpenBLAS OpenMP's thread count once, so OMP_NUM_THREADS bounds both thread pools
// (see parallel.h), unless the user chose OpenBLAS's count through its own variable.
cpu::CpuBackend make_cpu_backend() {
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    openblas_set_num_threads(omp_get_max_threads());
  }
  return cpu::CpuBackend();
}

}  // namespace

KernelBackend& cpu_backend() {
  static cpu::CpuBackend backend = make_cpu_backend();  // stateless: safe to share
  return backend;
}

namespace cpu {

void set_num_threads(int threads) {
  RD_CHECK(threads >= 1, kInvalidArgument, "set_num_threads: argument 'threads' must be >= 1, got ",
           threads);
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

int blas_num_threads() { return openblas_get_num_threads(); }

std::string blas_kernel_set() {
  // openblas_get_config() starts "OpenBLAS <version> ..."; the version is its second word.
  const std::string config = openblas_get_config() != nullptr ? openblas_get_config() : "";
  const size_t start = config.find(' ');
  const std::string version =
      start == std::string::npos
          ? ""
          : config.substr(start + 1, config.find(' ', start + 1) - start - 1);
  const char* name = openblas_get_corename();
  return (version.empty() ? "" : version + " ") + (name != nullptr ? name : "unknown");
}

}  // namespace cpu
}  // namespace rd::kernels
