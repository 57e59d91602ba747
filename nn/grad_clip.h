// clip_grad_norm_: rescales the gradients of a set of parameters so that their global norm is
// at most max_norm, as torch.nn.utils.clip_grad_norm_, without waiting for the device.
#pragma once

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// The norm_type of the largest absolute value (torch's float('inf')).
inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

// Measures the global norm of the parameters' gradients (the norm of all their elements
// together: (sum_i |g_i|^p)^(1/p), or max_i |g_i| for kInfNorm) and, in place, multiplies
// every gradient by min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping as a
// 0-dim tensor on the parameters' device: float32, or float64 when a gradient is float64
// (the norm accumulates in that type whatever the gradients' dtype; bfloat16 and float16
// gradients are read as float32 and rounded once when scaled).
//
// Nothing is read back to the host, so on CUDA the work is only queued and a training step
// stays free of host synchronization; a non-finite norm (a NaN or inf gradient) makes every
// gradient NaN or zero, as in PyTorch, and is for the caller to check on the returned norm.
//
// Parameters whose gradient is undefined are skipped; with no gradient at all the result is
// 0 (on the CPU when there are no parameters). Throws rd::Error when max_norm is not finite
// and > 0, norm_type is not > 0 (finite, or kInfNorm), a parameter is undefined, or the
// gradients are on different devices.
Tensor clip_grad_norm_(const std::vector<Tensor>& parameters, double max_norm,
                       double norm_type = 2.0);
// The global norm clip_grad_norm_ measures, without clipping: the gradients are left as they
// are. Same dtype, device, skipping of undefined gradients and errors (named grad_norm).
Tensor grad_norm(const std::vector<Tensor>& parameters, double norm_type = 2.0);
// The same over named parameters (Module::named_parameters(), AdamW's input).
Tensor clip_grad_norm_(const std::vector<std::pair<std::string, Tensor>>& named_parameters,
                       double max_norm, double norm_type = 2.0);

}  // namespace rd::nn
