// Multi-tensor ops (foreach_sum_squares, foreach_scaled_copy_): one kernel pass over a list of
// tensors (KernelBackend::multi_tensor_*), for an optimizer step's bookkeeping over many small
// tensors, where one op per tensor costs the host more than the device.
#include <cstdint>
#include <string>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/multi_tensor.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd {
namespace {

// Checks that `tensors` is a non-empty list of defined, contiguous tensors of one device and
// one floating dtype; `arg` names the list in errors.
void check_list(const std::vector<Tensor>& tensors, const char* op, const char* arg) {
  RD_CHECK(!tensors.empty(), kInvalidArgument, op, ": argument '", arg, "' is an empty list");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    RD_CHECK(t.defined(), kInvalidArgument, op, ": ", arg, "[", i, "] is undefined");
    RD_CHECK(is_floating(t.dtype()), kDTypeMismatch, op, ": ", arg, "[", i,
             "] must be floating, got ", dtype_name(t.dtype()));
    RD_CHECK(t.dtype() == tensors[0].dtype(), kDTypeMismatch, op, ": ", arg, "[", i, "] is ",
             dtype_name(t.dtype()), " but ", arg, "[0] is ", dtype_name(tensors[0].dtype()),
             " (one dtype per list)");
    RD_CHECK(t.device() == tensors[0].device(), kDeviceMismatch, op, ": ", arg, "[", i,
             "] is on ", t.device().str(), " but ", arg, "[0] is on ", tensors[0].device().str());
    RD_CHECK(t.is_contiguous(), kInvalidArgument, op, ": ", arg, "[", i, "] (shape ",
             shape_str(t.shape()), ") must be contiguous");
  }
}

}  // namespace

Tensor foreach_sum_squares(const std::vector<Tensor>& tensors) {
  constexpr const char* kOp = "foreach_sum_squares";
  check_list(tensors, kOp, "tensors");
  std::vector<kernels::MultiTensorInput> inputs;
  inputs.reserve(tensors.size());
  for (const Tensor& t : tensors) inputs.push_back({t.raw_data(), t.numel()});
  const Device device = tensors[0].device();
  const TensorOptions float64 = TensorOptions(DType::kFloat64).with_device(device);
  const int64_t chunks = kernels::multi_tensor_chunks(inputs);
  if (chunks == 0) return scalar_tensor(0.0, float64);
  Tensor partials = empty({chunks}, float64);
  backend_for(device).multi_tensor_sum_squares(inputs, tensors[0].dtype(),
                                               partials.data_ptr<double>());
  return sum(partials);
}

void foreach_scaled_copy_(const std::vector<Tensor>& dst, const std::vector<Tensor>& src,
                          double scale, const Tensor& device_scale) {
  constexpr const char* kOp = "foreach_scaled_copy_";
  check_list(dst, kOp, "dst");
  check_list(src, kOp, "src");
  RD_CHECK(dst.size() == src.size(), kInvalidArgument, kOp, ": got ", dst.size(),
           " dst tensors for ", src.size(), " src tensors");
  const Device device = dst[0].device();
  RD_CHECK(src[0].device() == device, kDeviceMismatch, kOp, ": src is on ", src[0].device().str(),
           " but dst on ", device.str());
  const float* factor = nullptr;
  if (device_scale.defined()) {
    RD_CHECK(device_scale.numel() == 1 && device_scale.dtype() == DType::kFloat32 &&
                 device_scale.device() == device,
             kInvalidArgument, kOp, ": argument 'device_scale' must be one float32 on ",
             device.str(), ", got ", dtype_name(device_scale.dtype()), " of shape ",
             shape_str(device_scale.shape()), " on ", device_scale.device().str());
    factor = static_cast<const float*>(device_scale.raw_data());
  }
  std::vector<kernels::MultiTensorCopy> copies;
  copies.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    RD_CHECK(dst[i].shape() == src[i].shape(), kShapeMismatch, kOp, ": dst[", i, "] has shape ",
             shape_str(dst[i].shape()), " but src[", i, "] has shape ", shape_str(src[i].shape()));
    copies.push_back({src[i].raw_data(), dst[i].raw_data(), dst[i].numel()});
  }
  backend_for(device).multi_tensor_scale(copies, src[0].dtype(), dst[0].dtype(), scale, factor);
}

}  // namespace rd
