// The GEMM epilogue (scale, bias, GELU) as a standalone CUDA kernel, for the GEMMs that
// cuBLASLt cannot run fused: no product term (k == 0 or alpha == 0), or an epilogue
// cuBLASLt offers no algorithm for with this problem.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ringdilated/kernels/dtype.h"

namespace rd::kernels::cuda {

struct GemmEpilogueArgs {
  DType dtype = DType::kFloat32;  // of C and bias (a floating dtype)
  void* c = nullptr;              // row-major m x n with row stride ldc, per batch entry
  int64_t m = 0, n = 0, ldc = 0;
  int64_t batch = 1, stride_c = 0;
  double scale = 1.0;          // C is first multiplied by this; 0 means C is not read
  const void* bias = nullptr;  // n elements added to every row, or null
  bool gelu = false;           // then the tanh GELU
};

// C = act(scale * C + bias) elementwise; scale == 0 writes act(bias) (or 0) without reading
// C, so NaN or garbage in C does not survive (BLAS's beta == 0 rule).
void gemm_epilogue(const GemmEpilogueArgs& args, cudaStream_t stream);

}  // namespace rd::kernels::cuda
