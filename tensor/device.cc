// Runtime device queries and the device -> kernel backend dispatch.
#include "ringdilated/tensor/device.h"

#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/shape_util.h"

#if defined(RD_WITH_CUDA)
#include "ringdilated/kernels/cuda/async_error.h"
#include "ringdilated/kernels/cuda/backend.h"
#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace rd {

bool cuda_available() { return cuda_device_count() > 0; }

int cuda_device_count() {
#if defined(RD_WITH_CUDA)
  return kernels::cuda::device_count();
#else
  return 0;
#endif
}

int cuda_compute_capability(Device device) {
#if defined(RD_WITH_CUDA)
  if (!device.is_cpu() && device.index < kernels::cuda::device_count()) {
    return kernels::cuda::compute_capability(device.index);
  }
#else
  (void)device;
#endif
  return 0;
}

void synchronize(Device device) {
  if (device.is_cpu()) return;
#if defined(RD_WITH_CUDA)
  kernels::cuda::synchronize_stream(device.index, kernels::cuda::current_stream(device.index));
#else
  RD_FAIL(kDeviceMismatch, "synchronize: this build has no CUDA backend (asked for ",
          device.str(), ")");
#endif
}

void check_async_errors(Device device) { synchronize(device); }

int64_t host_sync_count(Device device) {
  if (device.is_cpu()) return 0;
#if defined(RD_WITH_CUDA)
  return kernels::cuda::async_errors(device.index).host_syncs();
#else
  RD_FAIL(kDeviceMismatch, "host_sync_count: this build has no CUDA backend (asked for ",
          device.str(), ")");
#endif
}

kernels::KernelBackend& backend_for(Device device) {
  if (device.is_cpu()) return kernels::cpu_backend();
#if defined(RD_WITH_CUDA)
  return kernels::cuda::cuda_backend(device.index);
#else
  RD_FAIL(kDeviceMismatch, "backend_for: this build has no CUDA backend (asked for ",
          device.str(), "); configure with RD_CUDA=AUTO or ON on a machine with nvcc");
#endif
}

kernels::StridedView kernel_view(const Tensor& t, const char* op) {
  RD_CHECK(t.dim() <= kernels::kMaxDims, kInvalidArgument, op, ": tensors may have at most ",
           kernels::kMaxDims, " dims, got ", t.dim(), " (shape ", shape_str(t.shape()), ")");
  kernels::StridedView v;
  v.data = t.raw_data();
  v.dtype = t.dtype();
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.shape()[d];
    v.strides[d] = t.strides()[d];
  }
  return v;
}

void set_num_threads(int threads) { kernels::cpu::set_num_threads(threads); }

int num_threads() { return kernels::cpu::num_threads(); }

std::string cpu_gemm_kernels() { return kernels::cpu::blas_kernel_set(); }

}  // namespace rd
