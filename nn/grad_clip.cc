// clip_grad_norm_ (nn/grad_clip.h): the norm, the clip factor as device tensors, then the
// scaling in place: for the 2-norm of float32/16-bit gradients in two multi-tensor passes,
// otherwise one norm and one scaling per gradient.
#include "ringdilated/nn/grad_clip.h"

#include <cmath>
#include <map>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "clip_grad_norm_";
constexpr const char* kNormOp = "grad_norm";
// Keeps the factor finite for a zero norm (torch uses the same constant).
constexpr double kNormEpsilon = 1e-6;

void check_norm_type(double norm_type, const char* op) {
  RD_CHECK(norm_type > 0 && !std::isnan(norm_type), kInvalidArgument, op,
           ": argument 'norm_type' must be > 0 (or kInfNorm), got ", norm_type);
}

void check_arguments(double max_norm, double norm_type) {
  RD_CHECK(std::isfinite(max_norm) && max_norm > 0, kInvalidArgument, kOp,
           ": argument 'max_norm' must be finite and > 0, got ", max_norm);
  check_norm_type(norm_type, kOp);
}

// The defined gradients, checked to share one device (named by parameter index in errors).
std::vector<Tensor> defined_gradients(const std::vector<Tensor>& parameters, const char* op) {
  std::vector<Tensor> grads;
  for (size_t i = 0; i < parameters.size(); ++i) {
    RD_CHECK(parameters[i].defined(), kInvalidArgument, op, ": parameters[", i,
             "] is undefined");
    Tensor grad = parameters[i].grad();
    if (!grad.defined()) continue;
    RD_CHECK(grads.empty() || grad.device() == grads[0].device(), kDeviceMismatch, op,
             ": the gradient of parameters[", i, "] is on ", grad.device().str(),
             " but an earlier one is on ", grads[0].device().str());
    grads.push_back(std::move(grad));
  }
  return grads;
}

// float64 when any gradient is float64, else float32.
DType norm_dtype(const std::vector<Tensor>& grads) {
  for (const Tensor& g : grads) {
    if (g.dtype() == DType::kFloat64) return DType::kFloat64;
  }
  return DType::kFloat32;
}

// The contribution of one gradient: max |g| for kInfNorm, else sum |g|^p (0-dim).
Tensor partial_norm(const Tensor& grad, DType dtype, double norm_type) {
  const Tensor g = grad.to(dtype);
  if (std::isinf(norm_type)) return max(abs(g));
  if (norm_type == 2.0) return sum(square(g));
  if (norm_type == 1.0) return sum(abs(g));
  return sum(pow(abs(g), norm_type));
}

Tensor total_norm(const std::vector<Tensor>& grads, DType dtype, double norm_type) {
  std::vector<Tensor> partials;
  partials.reserve(grads.size());
  for (const Tensor& g : grads) {
    if (g.numel() > 0) partials.push_back(partial_norm(g, dtype, norm_type));
  }
  if (partials.empty()) {
    return scalar_tensor(0.0, TensorOptions(dtype).with_device(grads[0].device()));
  }
  const Tensor all = stack(partials);
  if (std::isinf(norm_type)) return max(all);
  const Tensor combined = sum(all);
  if (norm_type == 2.0) return sqrt(combined);
  if (norm_type == 1.0) return combined;
  return pow(combined, 1.0 / norm_type);
}

// The 2-norm of gradients none of which is float64, with the multi-tensor ops: one pass over
// all gradients of a dtype (contiguous copies of strided ones), float32.
Tensor l2_norm_multi_tensor(const std::vector<Tensor>& grads) {
  std::map<DType, std::vector<Tensor>> readable;
  for (const Tensor& g : grads) {
    if (g.numel() > 0) readable[g.dtype()].push_back(g.contiguous());
  }
  Tensor squares = scalar_tensor(0.0, TensorOptions(DType::kFloat64).with_device(grads[0].device()));
  for (const auto& [dtype, group] : readable) squares = add(squares, foreach_sum_squares(group));
  return sqrt(squares).to(DType::kFloat32);
}

// The common case (2-norm, no float64 gradient) with the multi-tensor ops: two passes over
// all gradients of a dtype (the squares, then the scaling in float32), a few launches in
// all rather than four per gradient.
Tensor clip_l2_multi_tensor(const std::vector<Tensor>& grads, double max_norm) {
  // The scaling writes contiguous gradients in one launch per dtype, strided ones one by one.
  std::map<DType, std::vector<Tensor>> scalable;
  std::vector<Tensor> strided;
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    if (g.is_contiguous()) {
      scalable[g.dtype()].push_back(g);
    } else {
      strided.push_back(g);
    }
  }
  const Tensor norm = l2_norm_multi_tensor(grads);
  const Tensor factor = clamp(max_norm / (norm + kNormEpsilon), std::nullopt, 1.0);
  for (const auto& [dtype, group] : scalable) foreach_scaled_copy_(group, group, 1.0, factor);
  for (Tensor& g : strided) g.copy_(mul(g, factor));
  return norm;
}

}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& parameters, double max_norm, double norm_type) {
  check_arguments(max_norm, norm_type);
  autograd::NoGradGuard no_grad;
  std::vector<Tensor> grads = defined_gradients(parameters, kOp);
  if (grads.empty()) {
    const Device device = parameters.empty() ? Device::cpu() : parameters[0].device();
    return scalar_tensor(0.0, TensorOptions(DType::kFloat32).with_device(device));
  }
  const DType dtype = norm_dtype(grads);
  if (norm_type == 2.0 && dtype == DType::kFloat32) return clip_l2_multi_tensor(grads, max_norm);
  const Tensor norm = total_norm(grads, dtype, norm_type);
  // min(1, max_norm / (norm + eps)) stays on the device: no branch on the norm's value.
  const Tensor factor = clamp(max_norm / (norm + kNormEpsilon), std::nullopt, 1.0);
  // Each gradient is scaled in the norm's type and rounded to its own dtype once.
  for (Tensor& g : grads) g.copy_(mul(g, factor));
  return norm;
}

Tensor grad_norm(const std::vector<Tensor>& parameters, double norm_type) {
  check_norm_type(norm_type, kNormOp);
  autograd::NoGradGuard no_grad;
  const std::vector<Tensor> grads = defined_gradients(parameters, kNormOp);
  if (grads.empty()) {
    const Device device = parameters.empty() ? Device::cpu() : parameters[0].device();
    return scalar_tensor(0.0, TensorOptions(DType::kFloat32).with_device(device));
  }
  const DType dtype = norm_dtype(grads);
  if (norm_type == 2.0 && dtype == DType::kFloat32) return l2_norm_multi_tensor(grads);
  return total_norm(grads, dtype, norm_type);
}

Tensor clip_grad_norm_(const std::vector<std::pair<std::string, Tensor>>& named_parameters,
                       double max_norm, double norm_type) {
  std::vector<Tensor> parameters;
  parameters.reserve(named_parameters.size());
  for (const auto& [name, p] : named_parameters) {
    RD_CHECK(p.defined(), kInvalidArgument, kOp, ": parameter '", name, "' is undefined");
    parameters.push_back(p);
  }
  return clip_grad_norm_(parameters, max_norm, norm_type);
}

}  // namespace rd::nn
