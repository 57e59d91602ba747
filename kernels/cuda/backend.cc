// CudaBackend: forwards each KernelBackend call to the kernels of kernels/cuda/kernels.h on
// the device's current stream, with that device made current and its pool as scratch. It
// owns the device's AsyncErrors (the record of bad indices found by running kernels).
#include "ringdilated/kernels/cuda/backend.h"

#include <memory>
#include <mutex>
#include <vector>

#include "ringdilated/kernels/cuda/async_error.h"
#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"

namespace rd::kernels::cuda {

namespace {

class CudaBackend final : public KernelBackend {
 public:
  explicit CudaBackend(int device) : device_(device), errors_(device) {}
  const char* name() const override { return "cuda"; }
  AsyncErrors& errors() { return errors_; }

  void fill(const StridedView& out, double value) override {
    Scope s(device_);
    cuda::fill(out, value, s.stream);
  }
  void arange(const StridedView& out, double start, double step) override {
    Scope s(device_);
    cuda::arange(out, start, step, s.stream);
  }
  void copy(const StridedView& out, const StridedView& in) override {
    Scope s(device_);
    cuda::copy(out, in, s.stream);
  }
  void accumulate(const StridedView& out, const StridedView& in) override {
    Scope s(device_);
    cuda::accumulate(out, in, s.stream);
  }
  void random(const StridedView& out, Distribution dist, double a, double b, uint64_t seed,
              uint64_t offset) override {
    Scope s(device_);
    cuda::random(out, dist, a, b, seed, offset, s.stream);
  }
  void unary(UnaryOp op, const StridedView& out, const StridedView& in,
             const UnaryParams& params) override {
    Scope s(device_);
    cuda::unary(op, out, in, params, s.stream);
  }
  void binary(BinaryOp op, const StridedView& out, const StridedView& a,
              const StridedView& b) override {
    Scope s(device_);
    cuda::binary(op, out, a, b, s.stream);
  }
  void where(const StridedView& out, const StridedView& cond, const StridedView& a,
             const StridedView& b) override {
    Scope s(device_);
    cuda::where(out, cond, a, b, s.stream);
  }
  void reduce(ReduceOp op, const StridedView& out, const StridedView& in,
              uint32_t dims_mask) override {
    Scope s(device_);
    cuda::reduce(op, out, in, dims_mask, scratch(), s.stream);
  }
  void cumsum(const StridedView& out, const StridedView& in, int dim, bool reverse) override {
    Scope s(device_);
    cuda::cumsum(out, in, dim, reverse, s.stream);
  }
  void gemm(const GemmArgs& args) override {
    Scope s(device_);
    cuda::gemm(args, scratch(), s.stream);
  }
  void softmax(const SoftmaxArgs& args) override {
    Scope s(device_);
    cuda::softmax(args, s.stream);
  }
  void softmax_backward(const SoftmaxBackwardArgs& args) override {
    Scope s(device_);
    cuda::softmax_backward(args, s.stream);
  }
  void norm(const NormArgs& args) override {
    Scope s(device_);
    cuda::norm(args, s.stream);
  }
  void norm_backward(const NormBackwardArgs& args) override {
    Scope s(device_);
    cuda::norm_backward(args, scratch(), s.stream);
  }
  void cross_entropy(const CrossEntropyArgs& args) override {
    Scope s(device_);
    cuda::cross_entropy(args, errors_, s.stream);
  }
  void cross_entropy_backward(const CrossEntropyBackwardArgs& args) override {
    Scope s(device_);
    cuda::cross_entropy_backward(args, errors_, s.stream);
  }
  void rotary_embedding(const StridedView& out, const StridedView& x, int64_t position_offset,
                        double base, bool inverse) override {
    Scope s(device_);
    cuda::rotary_embedding(out, x, position_offset, base, inverse, s.stream);
  }
  void swiglu(const SwigluArgs& args) override {
    Scope s(device_);
    cuda::swiglu(args, s.stream);
  }
  void swiglu_backward(const SwigluBackwardArgs& args) override {
    Scope s(device_);
    cuda::swiglu_backward(args, s.stream);
  }
  bool attention_supports(AttentionKernel kernel, const AttentionForwardArgs& forward,
                          const AttentionBackwardArgs* backward, std::string* why_not) override {
    DeviceGuard guard(device_);
    return cuda::attention_supports(kernel, forward, backward, why_not);
  }
  void attention_forward(AttentionKernel kernel, const AttentionForwardArgs& args) override {
    Scope s(device_);
    cuda::attention_forward(kernel, args, scratch(), s.stream);
  }
  void attention_backward(AttentionKernel kernel, const AttentionBackwardArgs& args) override {
    Scope s(device_);
    cuda::attention_backward(kernel, args, scratch(), s.stream);
  }
  void attention_merge(const StridedView& acc_out, const StridedView& acc_lse,
                       const StridedView& part_out, const StridedView& part_lse) override {
    Scope s(device_);
    cuda::attention_merge(acc_out, acc_lse, part_out, part_lse, s.stream);
  }
  void adamw(std::span<const AdamWTensor> tensors, DType dtype, const AdamWStep& step) override {
    Scope s(device_);
    cuda::adamw(tensors, dtype, step, s.stream);
  }
  void multi_tensor_scale(std::span<const MultiTensorCopy> tensors, DType src_dtype,
                          DType dst_dtype, double scale, const float* device_scale) override {
    Scope s(device_);
    cuda::multi_tensor_scale(tensors, src_dtype, dst_dtype, scale, device_scale, s.stream);
  }
  void multi_tensor_sum_squares(std::span<const MultiTensorInput> tensors, DType dtype,
                                double* partials) override {
    Scope s(device_);
    cuda::multi_tensor_sum_squares(tensors, dtype, partials, s.stream);
  }
  void index_select(const StridedView& out, const StridedView& in, int dim,
                    const StridedView& index) override {
    Scope s(device_);
    cuda::index_select(out, in, dim, index, errors_, s.stream);
  }
  void index_add(const StridedView& out, int dim, const StridedView& index,
                 const StridedView& src) override {
    Scope s(device_);
    cuda::index_add(out, dim, index, src, errors_, s.stream);
  }
  void gather(const StridedView& out, const StridedView& in, int dim,
              const StridedView& index) override {
    Scope s(device_);
    cuda::gather(out, in, dim, index, errors_, s.stream);
  }
  void scatter(const StridedView& out, int dim, const StridedView& index, const StridedView& src,
               bool accumulate) override {
    Scope s(device_);
    cuda::scatter(out, dim, index, src, accumulate, errors_, s.stream);
  }

 private:
  // Makes the backend's device current for one call and names the stream to queue on.
  struct Scope {
    explicit Scope(int device) : guard(device), stream(current_stream(device)) {}
    DeviceGuard guard;
    cudaStream_t stream;
  };

  Allocator& scratch() const { return cuda_caching_allocator(device_); }

  int device_;
  AsyncErrors errors_;
};

// The backend of `device`, created on first use and kept for the process (like the pools).
CudaBackend& cuda_backend_of(int device) {
  int count = device_count();
  RD_CHECK(device >= 0 && device < count, kDeviceMismatch, "cuda_backend: device cuda:", device,
           " does not exist (", count, " CUDA devices visible)");
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaBackend>>* backends =
      new std::vector<std::unique_ptr<CudaBackend>>();
  std::lock_guard<std::mutex> lock(mutex);
  if (backends->size() < static_cast<size_t>(count)) backends->resize(count);
  auto& slot = (*backends)[device];
  if (slot == nullptr) slot = std::make_unique<CudaBackend>(device);
  return *slot;
}

}  // namespace

KernelBackend& cuda_backend(int device) { return cuda_backend_of(device); }

AsyncErrors& async_errors(int device) { return cuda_backend_of(device).errors(); }

}  // namespace rd::kernels::cuda
