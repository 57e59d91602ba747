// cpu_backend() and the CPU backend's thread-count control (OpenMP and OpenBLAS together).
#include "ringdilated/kernels/cpu/backend.h"

#include <cblas.h>
#include <omp.h>

#include <cstdlib>
#include <sstream>
#include <string>

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
  // openblas_get_config() starts "OpenBLAS <version> ...": its first two words.
  const char* config = openblas_get_config();
  std::istringstream words(config != nullptr ? config : "OpenBLAS");
  std::string library, version;
  words >> library >> version;
  const char* core = openblas_get_corename();
  return str_cat(library, version.empty() ? "" : " ", version, " ",
                 core != nullptr ? core : "unknown");
}

}  // namespace cpu
}  // namespace rd::kernels
