// CpuBackend: the KernelBackend for host memory. Its methods are defined by concern across
// kernels/cpu/*.cc (copy, elementwise, reduce, gemm, rowwise, cross_entropy, rotary, swiglu,
// adamw, multi_tensor, indexing, random).
#pragma once

#include "ringdilated/kernels/backend.h"

namespace rd::kernels::cpu {

class CpuBackend final : public KernelBackend {
 public:
  const char* name() const override { return "cpu"; }

  // copy.cc
  void fill(const StridedView& out, double value) override;
  void arange(const StridedView& out, double start, double step) override;
  void copy(const StridedView& out, const StridedView& in) override;
  void accumulate(const StridedView& out, const StridedView& in) override;

  // elementwise.cc
  void unary(UnaryOp op, const StridedView& out, const StridedView& in,
             const UnaryParams& params) override;
  void binary(BinaryOp op, const StridedView& out, const StridedView& a,
              const StridedView& b) override;
  void where(const StridedView& out, const StridedView& cond, const StridedView& a,
             const StridedView& b) override;

  // random.cc
  void random(const StridedView& out, Distribution dist, double a, double b, uint64_t seed,
              uint64_t offset) override;

  // reduce.cc
  void reduce(ReduceOp op, const StridedView& out, const StridedView& in,
              uint32_t dims_mask) override;
  void cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse) override;

  // gemm.cc
  void gemm(const GemmArgs& args) override;

  // rowwise.cc
  void softmax(const SoftmaxArgs& args) override;
  void softmax_backward(const SoftmaxBackwardArgs& args) override;
  void norm(const NormArgs& args) override;
  void norm_backward(const NormBackwardArgs& args) override;

  // cross_entropy.cc
  void cross_entropy(const CrossEntropyArgs& args) override;
  void cross_entropy_backward(const CrossEntropyBackwardArgs& args) override;

  // rotary.cc
  void rotary_embedding(const StridedView& out, const StridedView& x, int64_t position_offset,
                        double base, bool inverse) override;

  // swiglu.cc
  void swiglu(const SwigluArgs& args) override;
  void swiglu_backward(const SwigluBackwardArgs& args) override;

  // attention_backend.cc (the math kernels of kernels/cpu/attention.cc)
  bool attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                          const AttentionBackwardArgs* backward, std::string* why_not) override;
  void attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args) override;
  void attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args) override;
  // attention_merge.cc
  void attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                       const StridedView& part_out, const StridedView& part_lse) override;

  // adamw.cc
  void adamw(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step) override;
  // multi_tensor.cc
  void multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                          DType dst_dtype, double scale, const float* device_scale) override;
  void multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                                double* partials) override;

  // indexing.cc
  void index_select(const StridedView& out, const StridedView& in, int dim,
                    const StridedView& index) override;
  void index_add(const StridedView& out, int dim, const StridedView& index,
                 const StridedView& src) override;
  void gather(const StridedView& out, const StridedView& in, int dim,
              const StridedView& index) override;
  void scatter(const StridedView& out, int dim, const StridedView& index,
               const StridedView& src, bool accumulate) override;
};

}  // namespace rd::kernels::cpu
