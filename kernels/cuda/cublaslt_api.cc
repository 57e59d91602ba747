// Loads cuBLASLt on first use and resolves the entry points of CublasLtApi.
#include "ringdilated/kernels/cuda/cublaslt_api.h"

#include <string>
#include <vector>

#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/shared_library.h"

namespace rd::kernels::cuda {
namespace {

// The loaded entry points, or why they cannot be used.
struct LoadedCublasLt {
  CublasLtApi api;
  std::string problem;  // "" when usable
};

// The soname of the major version the headers describe (the ABI we were compiled against)
// through the loader's search path first, then in the toolkit that the build found, where a
// program run from the build tree found it when cuBLASLt was linked.
std::vector<std::string> library_candidates() {
  const std::string soname = str_cat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  std::vector<std::string> candidates = {soname};
#if defined(RD_CUDA_LIBRARY_DIR)
  candidates.push_back(str_cat(RD_CUDA_LIBRARY_DIR, "/", soname));
#endif
  return candidates;
}

// Loaded once per process and never changed after (read-only state, like a linked library).
const LoadedCublasLt& loaded_cublaslt() {
  static const LoadedCublasLt* const loaded = [] {
    auto* result = new LoadedCublasLt;
    SharedLibrary library = open_shared_library("cuBLASLt", library_candidates());
    CublasLtApi& a = result->api;
    library.resolve("cublasLtCreate", &a.create);
    library.resolve("cublasLtGetStatusName", &a.get_status_name);
    library.resolve("cublasLtGetStatusString", &a.get_status_string);
    library.resolve("cublasLtMatmulDescCreate", &a.matmul_desc_create);
    library.resolve("cublasLtMatmulDescDestroy", &a.matmul_desc_destroy);
    library.resolve("cublasLtMatmulDescSetAttribute", &a.matmul_desc_set_attribute);
    library.resolve("cublasLtMatrixLayoutCreate", &a.matrix_layout_create);
    library.resolve("cublasLtMatrixLayoutDestroy", &a.matrix_layout_destroy);
    library.resolve("cublasLtMatrixLayoutSetAttribute", &a.matrix_layout_set_attribute);
    library.resolve("cublasLtMatmulPreferenceCreate", &a.matmul_preference_create);
    library.resolve("cublasLtMatmulPreferenceDestroy", &a.matmul_preference_destroy);
    library.resolve("cublasLtMatmulPreferenceSetAttribute", &a.matmul_preference_set_attribute);
    library.resolve("cublasLtMatmulAlgoGetHeuristic", &a.matmul_algo_get_heuristic);
    library.resolve("cublasLtMatmul", &a.matmul);
    result->problem = library.problem;
    return result;
  }();
  return *loaded;
}

}  // namespace

const CublasLtApi& cublaslt_api(const char* op) {
  const LoadedCublasLt& loaded = loaded_cublaslt();
  RD_CHECK(loaded.problem.empty(), kUnimplemented, op,
           ": cuBLASLt, which CUDA matrix products need, is not available: ", loaded.problem);
  return loaded.api;
}

}  // namespace rd::kernels::cuda
