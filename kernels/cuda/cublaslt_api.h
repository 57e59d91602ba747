// cuBLASLt opened at run time (dlopen of libcublasLt.so.<major>) instead of linked: the entry
// points that gemm.cc calls, resolved on the first GEMM, so that every program of a CUDA build
// starts, and runs on the CPU, where cuBLASLt is not installed.
#pragma once

#include <cublasLt.h>

namespace rd::kernels::cuda {

// The cuBLASLt entry points the CUDA backend uses, named as the function less its prefix.
struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetStatusName) get_status_name = nullptr;
  decltype(&cublasLtGetStatusString) get_status_string = nullptr;
  decltype(&cublasLtMatmulDescCreate) matmul_desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) matmul_desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) matrix_layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) matrix_layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) matrix_layout_set_attribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) matmul_preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) matmul_preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) matmul_preference_set_attribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) matmul_algo_get_heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

// The process's cuBLASLt, loaded by the first call (thread-safe) and kept for the process's
// lifetime. Throws rd::Error kUnimplemented, starting with `op` and naming the library and
// the loader's reason, when the library cannot be loaded or lacks one of the entry points.
const CublasLtApi& cublaslt_api(const char* op);

}  // namespace rd::kernels::cuda
