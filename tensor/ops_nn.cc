// Neural-network ops: softmax, log_softmax, layer/RMS norm, embedding, dropout and
// cross-entropy, with their backward passes (fused row-wise kernels where they exist).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {
namespace {

using op_util::contiguous_data;
using op_util::options_like;

void check_defined_floating(const Tensor& t, const char* op, const char* arg) {
  RD_CHECK(t.defined(), kInvalidArgument, op, ": argument '", arg, "' is undefined");
  check_floating(t, op, arg);
}

// --- softmax family: the kernels work on contiguous [rows, cols] data, so the softmax dim
// is moved last (a permute plus a copy when it is not last already) and moved back after.

// The permutation that moves `dim` last and keeps the other dims in order.
std::vector<int64_t> dim_last_perm(int64_t ndim, int64_t dim) {
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < ndim; ++d) {
    if (d != dim) perm.push_back(d);
  }
  perm.push_back(dim);
  return perm;
}

std::vector<int64_t> inverse_perm(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

// t with `dim` moved last, contiguous. A 0-dim tensor becomes [1].
Tensor dim_last_contiguous(const Tensor& t, int64_t dim) {
  if (t.dim() == 0) return t.reshape({1});
  if (dim == t.dim() - 1) return t.contiguous();
  return t.permute(dim_last_perm(t.dim(), dim)).contiguous();
}

// Undoes dim_last_contiguous: a contiguous tensor of `shape`.
Tensor undo_dim_last(const Tensor& t, const Shape& shape, int64_t dim) {
  const auto ndim = static_cast<int64_t>(shape.size());
  if (ndim == 0) return t.reshape({});
  if (dim == ndim - 1) return t;
  return t.permute(inverse_perm(dim_last_perm(ndim, dim))).contiguous();
}

// Softmax (or log-softmax) of the contiguous tensor t along its last dim.
Tensor softmax_rows(const Tensor& t, bool log, const char* op) {
  Tensor out = empty(t.shape(), options_like(t));
  if (t.numel() == 0) return out;
  const int64_t cols = t.size(-1);
  backend_for(t.device())
      .softmax(contiguous_data(out, op), contiguous_data(t, op), t.dtype(), t.numel() / cols,
               cols, log);
  return out;
}

Tensor softmax_backward_rows(const Tensor& grad, const Tensor& y, bool log, const char* op) {
  Tensor grad_in = empty(y.shape(), options_like(y));
  if (y.numel() == 0) return grad_in;
  const int64_t cols = y.size(-1);
  backend_for(y.device())
      .softmax_backward(contiguous_data(grad_in, op), contiguous_data(grad, op),
                        contiguous_data(y, op), y.dtype(), y.numel() / cols, cols, log);
  return grad_in;
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_defined_floating(x, op, "x");
  dim = normalize_dim(dim, x.dim(), op);  // a 0-dim x takes dim 0 or -1
  const Shape shape = x.shape();
  Tensor out =
      undo_dim_last(softmax_rows(dim_last_contiguous(x.detach(), dim), log, op), shape, dim);
  if (autograd::needs_grad({&x})) {
    // Saves the output detached: capturing `out` itself would make a reference cycle
    // through its own grad_fn.
    autograd::record(out, op, {x},
                     [y = out.detach(), dim, log, op, shape](const Tensor& g) {
                       Tensor grad_rows = softmax_backward_rows(
                           dim_last_contiguous(g.to(y.dtype()), dim),
                           dim_last_contiguous(y, dim), log, op);
                       return std::vector<Tensor>{undo_dim_last(grad_rows, shape, dim)};
                     });
  }
  return out;
}

// --- layer norm and RMS norm over the trailing dims given by normalized_shape.

void check_norm_param(const Tensor& param, const Tensor& x, const Shape& normalized_shape,
                      const char* op, const char* arg) {
  if (!param.defined()) return;
  check_defined_floating(param, op, arg);
  check_same_device({&x, &param}, op);
  RD_CHECK(param.shape() == normalized_shape, kShapeMismatch, op, ": argument '", arg,
           "' has shape ", shape_str(param.shape()), " but normalized_shape is ",
           shape_str(normalized_shape));
}

// The parameter converted to the kernel's layout: x's dtype, contiguous (undefined stays).
Tensor kernel_param(const Tensor& param, DType dtype) {
  return param.defined() ? param.detach().to(dtype).contiguous() : Tensor();
}

const void* data_or_null(const Tensor& t, const char* op) {
  return t.defined() ? contiguous_data(t, op) : nullptr;
}

// The float32 scratch buffers (mean, rstd, parameter grads) as device pointers.
float* float_data(const Tensor& t, const char* op) {
  return t.defined() ? static_cast<float*>(contiguous_data(t, op)) : nullptr;
}

Tensor norm_impl(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                 const Tensor& bias, double eps, bool rms) {
  const char* op = rms ? "rms_norm" : "layer_norm";
  check_defined_floating(x, op, "x");
  const auto norm_dims = static_cast<int64_t>(normalized_shape.size());
  RD_CHECK(norm_dims > 0, kInvalidArgument, op, ": normalized_shape must not be empty");
  RD_CHECK(x.dim() >= norm_dims &&
               std::equal(normalized_shape.begin(), normalized_shape.end(),
                          x.shape().end() - norm_dims),
           kShapeMismatch, op, ": normalized_shape ", shape_str(normalized_shape),
           " does not match the trailing dims of argument 'x' of shape ", shape_str(x.shape()));
  check_norm_param(weight, x, normalized_shape, op, "weight");
  check_norm_param(bias, x, normalized_shape, op, "bias");
  RD_CHECK(eps >= 0.0, kInvalidArgument, op, ": argument 'eps' must be >= 0, got ", eps);

  const DType dtype = x.dtype();
  const int64_t cols = shape_numel(normalized_shape);
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - norm_dims; ++d) rows *= x.size(d);

  Tensor xc = x.detach().contiguous();
  Tensor wc = kernel_param(weight, dtype);
  Tensor bc = kernel_param(bias, dtype);
  Tensor out = empty(x.shape(), options_like(x));
  // mean is unused by RMS norm but allocated anyway so the kernel never sees null.
  Tensor mean = empty({rows}, options_like(x, DType::kFloat32));
  Tensor rstd = empty({rows}, options_like(x, DType::kFloat32));
  if (x.numel() > 0) {
    backend_for(x.device())
        .norm(contiguous_data(out, op), float_data(mean, op), float_data(rstd, op),
              contiguous_data(xc, op), data_or_null(wc, op), data_or_null(bc, op), dtype, rows,
              cols, eps, rms);
  }

  // Only defined tensors are graph inputs; the closure returns grads in the same order.
  std::vector<Tensor> inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  if (!autograd::needs_grad(inputs)) return out;

  const bool want_weight = weight.defined() && weight.requires_grad();
  const bool want_bias = bias.defined() && bias.requires_grad();
  autograd::record(
      out, op, inputs,
      [xc, wc, mean, rstd, rows, cols, rms, op, want_weight, want_bias,
       has_weight = weight.defined(), has_bias = bias.defined(),
       weight_dtype = weight.defined() ? weight.dtype() : dtype,
       bias_dtype = bias.defined() ? bias.dtype() : dtype,
       normalized_shape](const Tensor& g) {
        const DType dtype = xc.dtype();
        Tensor gc = g.to(dtype).contiguous();
        Tensor grad_x = empty(xc.shape(), options_like(xc));
        // Zeros so that an empty batch gives zero parameter gradients.
        Tensor grad_w = want_weight ? zeros({cols}, options_like(xc, DType::kFloat32)) : Tensor();
        Tensor grad_b = want_bias ? zeros({cols}, options_like(xc, DType::kFloat32)) : Tensor();
        if (xc.numel() > 0) {
          backend_for(xc.device())
              .norm_backward(contiguous_data(grad_x, op), float_data(grad_w, op),
                             float_data(grad_b, op), contiguous_data(gc, op),
                             contiguous_data(xc, op), float_data(mean, op),
                             float_data(rstd, op),
                             data_or_null(wc, op), dtype, rows, cols, rms);
        }
        std::vector<Tensor> grads{grad_x};
        if (has_weight) {
          grads.push_back(want_weight ? grad_w.to(weight_dtype).view(normalized_shape)
                                      : Tensor());
        }
        if (has_bias) {
          grads.push_back(want_bias ? grad_b.to(bias_dtype).view(normalized_shape) : Tensor());
        }
        return grads;
      });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, /*log=*/false); }

Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, /*log=*/true); }

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  return norm_impl(x, normalized_shape, weight, bias, eps, /*rms=*/false);
}

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                double eps) {
  return norm_impl(x, normalized_shape, weight, Tensor(), eps, /*rms=*/true);
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  constexpr const char* kOp = "embedding";
  RD_CHECK(weight.defined(), kInvalidArgument, kOp, ": argument 'weight' is undefined");
  RD_CHECK(weight.dim() == 2, kShapeMismatch, kOp,
           ": argument 'weight' must be 2-D [num_embeddings, embedding_dim], got shape ",
           shape_str(weight.shape()));
  Tensor index = op_util::int64_index(indices, kOp, "indices");
  check_same_device({&weight, &indices}, kOp);
  op_util::check_index_bounds(index, weight.size(0), kOp, "indices",
                              "num_embeddings (weight.size(0))");
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  // index_select supplies the gradient (index_add of the rows into zeros).
  return index_select(weight, 0, index.reshape({index.numel()})).view(out_shape);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  constexpr const char* kOp = "dropout";
  check_defined_floating(x, kOp, "x");
  RD_CHECK(p >= 0.0 && p <= 1.0, kInvalidArgument, kOp,
           ": argument 'p' must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  // The mask holds 0 or 1/(1-p), in x's dtype; mul() then supplies the gradient
  // grad * mask. With p == 1 every element is dropped (and 1/(1-p) would be inf).
  Tensor mask = empty(x.shape(), options_like(x));
  if (p == 1.0) {
    mask.zero_();
  } else {
    const auto count = static_cast<uint64_t>(x.numel());
    const uint64_t offset = gen.advance(count);
    if (count > 0) {
      backend_for(x.device())
          .random(kernel_view(mask.view({x.numel()}), kOp), kernels::Distribution::kBernoulli,
                  1.0 - p, 0.0, gen.seed(), offset);
    }
    mask.mul_(1.0 / (1.0 - p));
  }
  return mul(x, mask);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  constexpr const char* kOp = "cross_entropy";
  check_defined_floating(logits, kOp, "logits");
  RD_CHECK(logits.dim() == 1 || logits.dim() == 2, kShapeMismatch, kOp,
           ": argument 'logits' must be [N, C] or [C], got shape ", shape_str(logits.shape()));
  Tensor target = op_util::int64_index(targets, kOp, "targets");
  check_same_device({&logits, &targets}, kOp);
  const bool batched = logits.dim() == 2;
  const int64_t num_classes = logits.size(-1);
  const Shape expected_targets = batched ? Shape{logits.size(0)} : Shape{};
  RD_CHECK(targets.shape() == expected_targets, kShapeMismatch, kOp,
           ": argument 'targets' has shape ", shape_str(targets.shape()),
           " but logits of shape ", shape_str(logits.shape()), " need targets of shape ",
           shape_str(expected_targets));
  op_util::check_index_bounds(target, num_classes, kOp, "targets", "num_classes C",
                              ignore_index);

  // Composed from differentiable ops: the backward is gather's scatter into zeros followed
  // by the fused log-softmax backward, which is what a dedicated kernel would do.
  Tensor logits2 = batched ? logits : logits.unsqueeze(0);
  Tensor target1 = target.reshape({logits2.size(0)});
  Tensor log_probs = log_softmax(logits2, 1);
  Tensor valid = ne(target1, static_cast<double>(ignore_index));
  Tensor safe_target = where(valid, target1, 0.0);  // ignored rows pick class 0, then masked
  Tensor picked = gather(log_probs, 1, safe_target.unsqueeze(1)).squeeze(1);
  Tensor losses = where(valid, neg(picked), 0.0);
  switch (reduction) {
    case Reduction::kNone:
      return batched ? losses : losses.reshape({});
    case Reduction::kSum:
      return sum(losses);
    case Reduction::kMean: {
      // Divides by the count of targets not ignored (0/0 gives NaN, as PyTorch), in float32
      // at least: a 16-bit count would round above 256 targets.
      const DType acc = logits.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
      return div(sum(losses.to(acc)), sum(valid.to(acc))).to(logits.dtype());
    }
  }
  RD_FAIL(kInvalidArgument, kOp, ": unknown reduction ", static_cast<int>(reduction));
}

}  // namespace rd
