// The CUDA kernel entry points behind CudaBackend, grouped by file. Each takes the stream to
// queue on; the backend has already made its device current. Semantics are those of the
// matching KernelBackend method in kernels/backend.h.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cuda/async_error.h"

namespace rd::kernels::cuda {

// elementwise.cu
void fill(const StridedView& out, double value, cudaStream_t stream);
void arange(const StridedView& out, double start, double step, cudaStream_t stream);
void copy(const StridedView& out, const StridedView& in, cudaStream_t stream);
// out += in; a bfloat16/float16 in adds into a float32 out widened per element (the contract
// of KernelBackend::accumulate).
void accumulate(const StridedView& out, const StridedView& in, cudaStream_t stream);
void unary(UnaryOp op, const StridedView& out, const StridedView& in, const UnaryParams& params,
           cudaStream_t stream);
void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b,
            cudaStream_t stream);
void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b, cudaStream_t stream);

// random.cu
void random(const StridedView& out, Distribution dist, double a, double b, uint64_t seed,
            uint64_t offset, cudaStream_t stream);

// indexing.cu: out-of-range index values are recorded in `errors` (the device's; see
// async_error.h) and their elements skipped, with no host synchronization.
void index_select(const StridedView& out, const StridedView& in, int dim,
                  const StridedView& index, AsyncErrors& errors, cudaStream_t stream);
void index_add(const StridedView& out, int dim, const StridedView& index, const StridedView& src,
               AsyncErrors& errors, cudaStream_t stream);
void gather(const StridedView& out, const StridedView& in, int dim, const StridedView& index,
            AsyncErrors& errors, cudaStream_t stream);
void scatter(const StridedView& out, int dim, const StridedView& index, const StridedView& src,
             bool accumulate, AsyncErrors& errors, cudaStream_t stream);
void cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse,
            cudaStream_t stream);

// reduce.cu (scratch memory comes from `scratch`, the device's caching allocator)
void reduce(ReduceOp op, const StridedView& out, const StridedView& in, uint32_t dims_mask,
            Allocator& scratch, cudaStream_t stream);

// rowwise.cu
void softmax(const SoftmaxArgs& args, cudaStream_t stream);
void softmax_backward(const SoftmaxBackwardArgs& args, cudaStream_t stream);
void norm(const NormArgs& args, cudaStream_t stream);
void norm_backward(const NormBackwardArgs& args, Allocator& scratch, cudaStream_t stream);

// cross_entropy.cu: out-of-range targets are recorded in `errors` (their losses and
// gradients are NaN), with no host synchronization.
void cross_entropy(const CrossEntropyArgs& args, AsyncErrors& errors, cudaStream_t stream);
void cross_entropy_backward(const CrossEntropyBackwardArgs& args, AsyncErrors& errors,
                            cudaStream_t stream);

// rotary.cu
void rotary_embedding(const StridedView& out, const StridedView& x, int64_t position_offset,
                      double base, bool inverse, cudaStream_t stream);

// swiglu.cu
void swiglu(const SwigluArgs& args, cudaStream_t stream);
void swiglu_backward(const SwigluBackwardArgs& args, cudaStream_t stream);

// adamw.cu (one launch for the whole tensor list)
void adamw(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step,
           cudaStream_t stream);

// multi_tensor.cu (one launch per list)
void multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                        DType dst_dtype, double scale, const float* device_scale,
                        cudaStream_t stream);
void multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                              double* partials, cudaStream_t stream);

// attention_dispatch.cc: the attention kernels (math, flash, cuDNN) behind one entry point
bool attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                        const AttentionBackwardArgs* backward, std::string* why_not);
void attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args,
                       Allocator& scratch, cudaStream_t stream);
void attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args,
                        Allocator& scratch, cudaStream_t stream);

// attention_merge.cu (kernels/attention_merge.h's value rule)
void attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                     const StridedView& part_out, const StridedView& part_lse,
                     cudaStream_t stream);

// gemm.cc (cuBLASLt)
void gemm(const GemmArgs& args, Allocator& scratch, cudaStream_t stream);

}  // namespace rd::kernels::cuda
