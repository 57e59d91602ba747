// Neural-network ops: softmax, log_softmax, layer/RMS norm, embedding, rotary embedding,
// dropout and cross-entropy, with their backward passes (fused kernels where they exist).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
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
  kernels::SoftmaxArgs args;
  args.out = contiguous_data(out, op);
  args.in = contiguous_data(t, op);
  args.dtype = t.dtype();
  args.cols = t.size(-1);
  args.rows = t.numel() / args.cols;
  args.log = log;
  backend_for(t.device()).softmax(args);
  return out;
}

Tensor softmax_backward_rows(const Tensor& grad, const Tensor& y, bool log, const char* op) {
  Tensor grad_in = empty(y.shape(), options_like(y));
  if (y.numel() == 0) return grad_in;
  kernels::SoftmaxBackwardArgs args;
  args.grad_in = contiguous_data(grad_in, op);
  args.grad_out = contiguous_data(grad, op);
  args.out = contiguous_data(y, op);
  args.dtype = y.dtype();
  args.cols = y.size(-1);
  args.rows = y.numel() / args.cols;
  args.log = log;
  backend_for(y.device()).softmax_backward(args);
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

// --- layer norm and RMS norm over the trailing dims given by normalized_shape, optionally
// fused with a residual add (add_layer_norm / add_rms_norm).

void check_norm_param(const Tensor& param, const Tensor& x, const Shape& normalized_shape,
                      const char* op, const char* arg) {
  if (!param.defined()) return;
  check_defined_floating(param, op, arg);
  check_same_device({&x, &param}, op);
  RD_CHECK(param.shape() == normalized_shape, kShapeMismatch, op, ": argument '", arg,
           "' has shape ", shape_str(param.shape()), " but normalized_shape is ",
           shape_str(normalized_shape));
}

// The residual is added elementwise, without broadcasting: its gradient is then exactly x's.
void check_residual(const Tensor& residual, const Tensor& x, const char* op) {
  check_defined_floating(residual, op, "residual");
  check_same_device({&x, &residual}, op);
  RD_CHECK(residual.dtype() == x.dtype(), kDTypeMismatch, op, ": argument 'residual' has dtype ",
           dtype_name(residual.dtype()), " but argument 'x' has dtype ", dtype_name(x.dtype()));
  RD_CHECK(residual.shape() == x.shape(), kShapeMismatch, op, ": argument 'residual' has shape ",
           shape_str(residual.shape()), " but argument 'x' has shape ", shape_str(x.shape()),
           " (they must match; no broadcasting)");
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

const char* norm_op_name(bool rms, bool fused) {
  if (rms) return fused ? "add_rms_norm" : "rms_norm";
  return fused ? "add_layer_norm" : "layer_norm";
}

// What the backward pass of a norm needs, saved by the forward pass.
struct NormSaved {
  Tensor normalized;  // the rows that were normalized (x, or the sum x + residual), contiguous
  Tensor weight;      // kernel_param(weight), or undefined
  Tensor mean, rstd;  // float32 [rows]
  int64_t rows = 0, cols = 0;
  bool rms = false;
  bool fused = false;  // a residual was added: the node has a second output and input
  bool has_weight = false, has_bias = false;
  bool want_weight = false, want_bias = false;
  DType weight_dtype = DType::kFloat32, bias_dtype = DType::kFloat32;
  Shape normalized_shape;
};

// The gradients of the norm node's inputs (x, [residual], [weight], [bias]) from those of its
// outputs (out, [sum]); either output's gradient may be undefined.
std::vector<Tensor> norm_backward(const NormSaved& s, const std::vector<Tensor>& grads,
                                  const char* op) {
  const size_t num_inputs = 1 + (s.fused ? 1 : 0) + (s.has_weight ? 1 : 0) + (s.has_bias ? 1 : 0);
  std::vector<Tensor> result(num_inputs);
  const Tensor& grad_out = grads[0];
  const Tensor grad_sum = s.fused ? grads[1] : Tensor();
  if (!grad_out.defined() && !grad_sum.defined()) return result;

  const DType dtype = s.normalized.dtype();
  Tensor grad_sum_c = grad_sum.defined() ? grad_sum.to(dtype).contiguous() : Tensor();
  // Only the sum output got a gradient: it reaches x and residual unchanged.
  Tensor grad_x = grad_sum_c;
  Tensor grad_w, grad_b;
  if (grad_out.defined()) {
    Tensor gc = grad_out.to(dtype).contiguous();
    grad_x = empty(s.normalized.shape(), options_like(s.normalized));
    // Zeros so that an empty batch gives zero parameter gradients.
    const TensorOptions f32 = options_like(s.normalized, DType::kFloat32);
    if (s.want_weight) grad_w = zeros({s.cols}, f32);
    if (s.want_bias) grad_b = zeros({s.cols}, f32);
    if (s.normalized.numel() > 0) {
      kernels::NormBackwardArgs args;
      args.grad_in = contiguous_data(grad_x, op);
      args.grad_weight = float_data(grad_w, op);
      args.grad_bias = float_data(grad_b, op);
      args.grad_out = contiguous_data(gc, op);
      args.grad_sum = data_or_null(grad_sum_c, op);
      args.in = contiguous_data(s.normalized, op);
      args.mean = float_data(s.mean, op);
      args.rstd = float_data(s.rstd, op);
      args.weight = data_or_null(s.weight, op);
      args.dtype = dtype;
      args.rows = s.rows;
      args.cols = s.cols;
      args.rms = s.rms;
      backend_for(s.normalized.device()).norm_backward(args);
    }
  }
  size_t i = 0;
  result[i++] = grad_x;
  if (s.fused) result[i++] = grad_x;  // d(x + residual)/d(residual) = d/dx
  if (s.has_weight) {
    result[i++] =
        grad_w.defined() ? grad_w.to(s.weight_dtype).view(s.normalized_shape) : Tensor();
  }
  if (s.has_bias) {
    result[i++] = grad_b.defined() ? grad_b.to(s.bias_dtype).view(s.normalized_shape) : Tensor();
  }
  return result;
}

// The tensor-level checks of a norm (residual may be undefined).
void check_norm_inputs(const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
                       const Tensor& weight, const Tensor& bias, double eps, const char* op) {
  check_defined_floating(x, op, "x");
  if (residual.defined()) check_residual(residual, x, op);
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
}

// Layer or RMS norm of x, or of x + residual when residual is defined (then `sum` is that
// sum, the new residual stream; otherwise it is undefined).
AddNormResult norm_impl(const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
                        const Tensor& weight, const Tensor& bias, double eps, bool rms) {
  const bool fused = residual.defined();
  const char* op = norm_op_name(rms, fused);
  check_norm_inputs(x, residual, normalized_shape, weight, bias, eps, op);
  const auto norm_dims = static_cast<int64_t>(normalized_shape.size());

  NormSaved s;
  s.rms = rms;
  s.fused = fused;
  s.normalized_shape = normalized_shape;
  const DType dtype = x.dtype();
  s.cols = shape_numel(normalized_shape);
  s.rows = 1;
  for (int64_t d = 0; d < x.dim() - norm_dims; ++d) s.rows *= x.size(d);

  Tensor xc = x.detach().contiguous();
  Tensor rc = fused ? residual.detach().contiguous() : Tensor();
  s.weight = kernel_param(weight, dtype);
  Tensor bc = kernel_param(bias, dtype);
  AddNormResult result;
  result.out = empty(x.shape(), options_like(x));
  if (fused) result.sum = empty(x.shape(), options_like(x));
  // mean is unused by RMS norm but allocated anyway so the kernel never sees null.
  s.mean = empty({s.rows}, options_like(x, DType::kFloat32));
  s.rstd = empty({s.rows}, options_like(x, DType::kFloat32));
  if (x.numel() > 0) {
    kernels::NormArgs args;
    args.out = contiguous_data(result.out, op);
    args.in = contiguous_data(xc, op);
    args.residual = data_or_null(rc, op);
    args.sum = fused ? contiguous_data(result.sum, op) : nullptr;
    args.weight = data_or_null(s.weight, op);
    args.bias = data_or_null(bc, op);
    args.mean = float_data(s.mean, op);
    args.rstd = float_data(s.rstd, op);
    args.dtype = dtype;
    args.rows = s.rows;
    args.cols = s.cols;
    args.eps = eps;
    args.rms = rms;
    backend_for(x.device()).norm(args);
  }

  // Only defined tensors are graph inputs; the backward returns grads in the same order.
  std::vector<Tensor> inputs{x};
  if (fused) inputs.push_back(residual);
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  if (!autograd::needs_grad(inputs)) return result;

  // The sum is saved detached: capturing the output itself would make a reference cycle
  // through its own grad_fn.
  s.normalized = fused ? result.sum.detach() : xc;
  s.has_weight = weight.defined();
  s.has_bias = bias.defined();
  s.want_weight = s.has_weight && weight.requires_grad();
  s.want_bias = s.has_bias && bias.requires_grad();
  if (s.has_weight) s.weight_dtype = weight.dtype();
  if (s.has_bias) s.bias_dtype = bias.dtype();
  std::vector<Tensor> outputs{result.out};
  if (fused) outputs.push_back(result.sum);
  autograd::record(outputs, op, inputs, [s = std::move(s), op](const std::vector<Tensor>& grads) {
    return norm_backward(s, grads, op);
  });
  return result;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, /*log=*/false); }

Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, /*log=*/true); }

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  return norm_impl(x, Tensor(), normalized_shape, weight, bias, eps, /*rms=*/false).out;
}

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                double eps) {
  return norm_impl(x, Tensor(), normalized_shape, weight, Tensor(), eps, /*rms=*/true).out;
}

AddNormResult add_layer_norm(const Tensor& x, const Tensor& residual,
                             const Shape& normalized_shape, const Tensor& weight,
                             const Tensor& bias, double eps) {
  RD_CHECK(residual.defined(), kInvalidArgument,
           "add_layer_norm: argument 'residual' is undefined");
  return norm_impl(x, residual, normalized_shape, weight, bias, eps, /*rms=*/false);
}

AddNormResult add_rms_norm(const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
                           const Tensor& weight, double eps) {
  RD_CHECK(residual.defined(), kInvalidArgument,
           "add_rms_norm: argument 'residual' is undefined");
  return norm_impl(x, residual, normalized_shape, weight, Tensor(), eps, /*rms=*/true);
}

namespace {

// On a GPU a vocabulary this small gets its embedding gradient from a one-hot GEMM: its
// cost is at most that of a [tokens, dim] x [dim, 1024] projection.
constexpr int64_t kOneHotMaxEmbeddings = 1024;

// The embedding's weight gradient [num_embeddings, D]: row v sums the rows of g [N, D]
// whose index is v, in float32 for 16-bit dtypes. Scattering with atomic adds serializes on
// a small vocabulary, where every row takes thousands of adds to the same addresses (26 ms
// for 64K tokens of a 260-symbol vocabulary on an H100); on the GPU such a vocabulary goes
// through a one-hot matrix instead, one_hot^T g, whose GEMM accumulates in float32 in a
// fixed order (deterministic, no atomics). Elsewhere index_add (in order on the CPU).
Tensor embedding_backward(const Tensor& g, const Tensor& index, int64_t num_embeddings) {
  const int64_t dim = g.size(1);
  if (g.device().is_cuda() && num_embeddings <= kOneHotMaxEmbeddings) {
    const Tensor vocabulary =
        arange(int64_t{0}, num_embeddings, TensorOptions(DType::kInt64).with_device(g.device()));
    const Tensor one_hot = eq(index.unsqueeze(1), vocabulary.unsqueeze(0)).to(g.dtype());
    return matmul(one_hot.t(), g);
  }
  const DType accumulate = accumulation_dtype(g.dtype());
  Tensor grad = zeros({num_embeddings, dim}, TensorOptions(accumulate).with_device(g.device()));
  const Tensor rows = g.to(accumulate);
  if (rows.numel() > 0) {
    backend_for(g.device())
        .index_add(kernel_view(grad, "embedding"), 0, kernel_view(index, "embedding"),
                   kernel_view(rows, "embedding"));
  }
  return grad.to(g.dtype());
}

}  // namespace

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
  const Tensor flat_index = index.reshape({index.numel()});
  Tensor out = index_select(weight.detach(), 0, flat_index).view(out_shape);
  if (autograd::needs_grad({&weight})) {
    autograd::record(out, kOp, {weight},
                     [flat_index, num_embeddings = weight.size(0)](const Tensor& g) {
                       return std::vector<Tensor>{
                           embedding_backward(g.reshape({flat_index.numel(), g.size(-1)}),
                                              flat_index, num_embeddings)};
                     });
  }
  return out;
}

Tensor swiglu(const Tensor& gate_up) {
  constexpr const char* kOp = "swiglu";
  check_defined_floating(gate_up, kOp, "gate_up");
  RD_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, kShapeMismatch, kOp,
           ": argument 'gate_up' must be [..., 2H] (gate, then up), got shape ",
           shape_str(gate_up.shape()));
  const Tensor in = gate_up.detach().contiguous();
  const int64_t hidden = in.size(-1) / 2;
  const int64_t rows = hidden == 0 ? 0 : in.numel() / (2 * hidden);
  Shape out_shape = in.shape();
  out_shape.back() = hidden;
  Tensor out = empty(out_shape, options_like(in));
  if (out.numel() > 0) {
    backend_for(in.device()).swiglu({out.raw_data(), in.raw_data(), in.dtype(), rows, hidden});
  }
  if (autograd::needs_grad({&gate_up})) {
    autograd::record(out, kOp, {gate_up}, [in, rows, hidden](const Tensor& g) {
      const Tensor grad_out = g.contiguous();
      Tensor grad = empty(in.shape(), options_like(in));
      if (grad.numel() > 0) {
        backend_for(in.device())
            .swiglu_backward(
                {grad.raw_data(), grad_out.raw_data(), in.raw_data(), in.dtype(), rows, hidden});
      }
      return std::vector<Tensor>{grad};
    });
  }
  return out;
}

void attention_merge_(const Tensor& acc_out, const Tensor& acc_lse, const Tensor& part_out,
                      const Tensor& part_lse) {
  constexpr const char* kOp = "attention_merge_";
  for (const auto& [t, name] : {std::pair{&acc_out, "acc_out"}, std::pair{&part_out, "part_out"}}) {
    RD_CHECK(t->defined() && t->dim() == 4, kShapeMismatch, kOp, ": argument '", name,
             "' must be [B, N, H, D], got ", t->defined() ? shape_str(t->shape()) : "undefined");
  }
  for (const auto& [t, name] : {std::pair{&acc_lse, "acc_lse"}, std::pair{&part_lse, "part_lse"}}) {
    RD_CHECK(t->defined() && t->dim() == 3, kShapeMismatch, kOp, ": argument '", name,
             "' must be [B, H, N], got ", t->defined() ? shape_str(t->shape()) : "undefined");
  }
  check_same_device({&acc_out, &acc_lse, &part_out, &part_lse}, kOp);
  // The kernel checks the rest (dtypes, matching shapes) against [B, N, H] row views.
  backend_for(acc_out.device())
      .attention_merge(kernel_view(acc_out, kOp), kernel_view(acc_lse.permute({0, 2, 1}), kOp),
                       kernel_view(part_out, kOp), kernel_view(part_lse.permute({0, 2, 1}), kOp));
}

namespace {

// Rotates x by the rotary embedding (or its inverse) into out; no autograd.
void rotary_into(const Tensor& out, const Tensor& x, int64_t position_offset, double base,
                 bool inverse) {
  constexpr const char* kOp = "rotary_embedding";
  // The kernel checks the rest (4 dims, even D, base, positions) even when x is empty.
  backend_for(x.device())
      .rotary_embedding(kernel_view(out, kOp), kernel_view(x, kOp), position_offset, base,
                        inverse);
}

// x rotated by the rotary embedding (or its inverse) into a new tensor; no autograd.
Tensor rotary_raw(const Tensor& x, int64_t position_offset, double base, bool inverse) {
  Tensor out = empty(x.shape(), options_like(x));
  rotary_into(out, x, position_offset, base, inverse);
  return out;
}

// q and k of a packed [B, T, 3, H, D] tensor as 2H heads [B, T, 2H, D]: they are adjacent
// in every row, so one rotary call covers both.
Tensor query_key_heads(const Tensor& qkv) {
  return qkv.narrow(2, 0, 2).view({qkv.size(0), qkv.size(1), 2 * qkv.size(3), qkv.size(4)});
}

// rotary_into for [B, T, ...] tensors whose rows are runs of consecutive positions.
void rotary_runs_into(const Tensor& out, const Tensor& x, const std::vector<PositionRun>& runs,
                      double base, bool inverse) {
  int64_t at = 0;
  for (const PositionRun& run : runs) {
    rotary_into(out.narrow(1, at, run.rows), x.narrow(1, at, run.rows), run.first_position, base,
                inverse);
    at += run.rows;
  }
}

// A new packed tensor: q and k of `qkv` rotated (or rotated back), v copied.
Tensor rotary_qkv_raw(const Tensor& qkv, const std::vector<PositionRun>& runs, double base,
                      bool inverse) {
  Tensor out = empty(qkv.shape(), options_like(qkv));
  rotary_runs_into(query_key_heads(out), query_key_heads(qkv), runs, base, inverse);
  out.select(2, 2).copy_(qkv.select(2, 2));
  return out;
}

// The runs must cover the rows exactly; positions must not be negative.
void check_position_runs(const Tensor& qkv, const std::vector<PositionRun>& runs, const char* op) {
  int64_t rows = 0;
  for (const PositionRun& run : runs) {
    RD_CHECK(run.rows >= 0 && run.first_position >= 0, kInvalidArgument, op,
             ": position runs need rows >= 0 and first positions >= 0, got (", run.rows, ", ",
             run.first_position, ")");
    rows += run.rows;
  }
  RD_CHECK(rows == qkv.size(1), kShapeMismatch, op, ": the position runs cover ", rows,
           " rows but qkv has ", qkv.size(1), " (shape ", shape_str(qkv.shape()), ")");
}

// Whether q's and k's heads merge into 2H heads of one stride, as in a projection's output.
bool query_key_heads_merge(const Tensor& qkv) {
  return qkv.strides()[2] == qkv.strides()[3] * qkv.size(3);
}

void check_packed_qkv(const Tensor& qkv, const char* op) {
  check_defined_floating(qkv, op, "qkv");
  RD_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, kShapeMismatch, op,
           ": argument 'qkv' must be [B, T, 3, H, D] (q, k, v packed), got shape ",
           shape_str(qkv.shape()));
}

// Records the backward of both packed forms on `out` when qkv needs a gradient: g's q and k
// rotated back, v's passed through. In g's own buffer when the engine alone holds it (then
// v costs nothing), else into a new one.
void record_rotary_qkv(const Tensor& out, const char* op, const Tensor& qkv,
                       const std::vector<PositionRun>& runs, double base) {
  if (!autograd::needs_grad({&qkv})) return;
  autograd::record(out, op, {qkv}, [runs, base](const Tensor& g) {
    if (autograd::is_exclusive_gradient(g)) {
      const Tensor heads = query_key_heads(g);
      rotary_runs_into(heads, heads, runs, base, /*inverse=*/true);
      return std::vector<Tensor>{g};
    }
    return std::vector<Tensor>{rotary_qkv_raw(g.contiguous(), runs, base, /*inverse=*/true)};
  });
}

}  // namespace

Tensor rotary_embedding(const Tensor& x, int64_t position_offset, double base) {
  constexpr const char* kOp = "rotary_embedding";
  check_defined_floating(x, kOp, "x");
  Tensor out = rotary_raw(x.detach(), position_offset, base, /*inverse=*/false);
  if (autograd::needs_grad({&x})) {
    // The rotation is orthogonal: its adjoint is the inverse rotation.
    autograd::record(out, kOp, {x}, [position_offset, base](const Tensor& g) {
      return std::vector<Tensor>{rotary_raw(g, position_offset, base, /*inverse=*/true)};
    });
  }
  return out;
}

Tensor rotary_embedding_qkv(const Tensor& qkv, const std::vector<PositionRun>& runs,
                            double base) {
  constexpr const char* kOp = "rotary_embedding_qkv";
  check_packed_qkv(qkv, kOp);
  check_position_runs(qkv, runs, kOp);
  // Other layouts than a projection's are copied first.
  const Tensor base_qkv = qkv.detach();
  const Tensor in = query_key_heads_merge(base_qkv) ? base_qkv : base_qkv.contiguous();
  Tensor out = rotary_qkv_raw(in, runs, base, /*inverse=*/false);
  record_rotary_qkv(out, kOp, qkv, runs, base);
  return out;
}

Tensor rotary_embedding_qkv(const Tensor& qkv, int64_t position_offset, double base) {
  check_packed_qkv(qkv, "rotary_embedding_qkv");
  return rotary_embedding_qkv(qkv, {{qkv.size(1), position_offset}}, base);
}

Tensor rotary_embedding_qkv_overwrite(const Tensor& qkv, const std::vector<PositionRun>& runs,
                                      double base) {
  constexpr const char* kOp = "rotary_embedding_qkv_overwrite";
  check_packed_qkv(qkv, kOp);
  check_position_runs(qkv, runs, kOp);
  RD_CHECK(!(qkv.is_leaf() && qkv.requires_grad()), kInvalidArgument, kOp,
           ": argument 'qkv' (shape ", shape_str(qkv.shape()),
           ") is a leaf that requires grad; its values may not be overwritten (use "
           "rotary_embedding_qkv)");
  if (!query_key_heads_merge(qkv)) return rotary_embedding_qkv(qkv, runs, base);
  Tensor out = qkv.detach();  // qkv's storage, rotated in place
  const Tensor heads = query_key_heads(out);
  rotary_runs_into(heads, heads, runs, base, /*inverse=*/false);
  record_rotary_qkv(out, kOp, qkv, runs, base);
  return out;
}

Tensor rotary_embedding_qkv_overwrite(const Tensor& qkv, int64_t position_offset, double base) {
  check_packed_qkv(qkv, "rotary_embedding_qkv_overwrite");
  return rotary_embedding_qkv_overwrite(qkv, {{qkv.size(1), position_offset}}, base);
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

namespace {

// The targets shape cross_entropy needs for `logits`: [] for [C], [N] for [N, C] and
// [N, d1, d2, ...] for [N, C, d1, d2, ...] (the class dim, 1, dropped).
Shape cross_entropy_targets_shape(const Shape& logits) {
  if (logits.size() == 1) return {};
  Shape targets = logits;
  targets.erase(targets.begin() + 1);
  return targets;
}

// The per-position losses, reduced in the accumulation dtype; kMean divides by the count of
// targets not ignored (0/0 gives NaN, as PyTorch), which a 16-bit count would round above
// 256. *count is that count (kMean only), which the backward pass divides by too.
Tensor reduce_losses(const Tensor& losses, const Tensor& target, Reduction reduction,
                     int64_t ignore_index, Tensor* count) {
  switch (reduction) {
    case Reduction::kNone:
      return losses;
    case Reduction::kSum:
      return sum(losses);
    case Reduction::kMean:
      *count = sum(ne(target, static_cast<double>(ignore_index)).to(losses.dtype()));
      return div(sum(losses), *count);
  }
  RD_FAIL(kInvalidArgument, "cross_entropy: unknown reduction ", static_cast<int>(reduction));
}

// The gradient of the logits from that of the (reduced) loss, g. `forward` is the forward
// call's arguments: the backward reads the same logits, targets, layout and lse, whose
// tensors the caller keeps alive.
Tensor cross_entropy_grad(const Tensor& g, const kernels::CrossEntropyArgs& forward,
                          const Tensor& logits, const Tensor& count, Reduction reduction) {
  constexpr const char* kOp = "cross_entropy";
  // grad_loss per position: g itself for kNone; for kSum and kMean one value (the mean's
  // 1/count folded in) broadcast to every position through stride 0.
  Tensor grad_loss = g.to(accumulation_dtype(logits.dtype())).contiguous();
  kernels::CrossEntropyBackwardArgs args;
  args.grad_loss_stride = 1;
  if (reduction != Reduction::kNone) {
    if (reduction == Reduction::kMean) grad_loss = div(grad_loss, count).contiguous();
    args.grad_loss_stride = 0;
  }
  Tensor grad = empty(logits.shape(), options_like(logits));
  if (grad.numel() == 0) return grad;
  args.grad_logits = contiguous_data(grad, kOp);
  args.grad_loss = contiguous_data(grad_loss, kOp);
  args.logits = forward.logits;
  args.lse = forward.lse;
  args.targets = forward.targets;
  args.dtype = forward.dtype;
  args.rows = forward.rows;
  args.cols = forward.cols;
  args.inner = forward.inner;
  args.ignore_index = forward.ignore_index;
  backend_for(logits.device()).cross_entropy_backward(args);
  return grad;
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  constexpr const char* kOp = "cross_entropy";
  check_defined_floating(logits, kOp, "logits");
  RD_CHECK(logits.dim() >= 1, kShapeMismatch, kOp,
           ": argument 'logits' must be [C], [N, C] or [N, C, d1, ...], got shape ",
           shape_str(logits.shape()));
  Tensor target = op_util::int64_index(targets, kOp, "targets");
  check_same_device({&logits, &targets}, kOp);
  const Shape expected_targets = cross_entropy_targets_shape(logits.shape());
  RD_CHECK(targets.shape() == expected_targets, kShapeMismatch, kOp,
           ": argument 'targets' has shape ", shape_str(targets.shape()),
           " but logits of shape ", shape_str(logits.shape()), " need targets of shape ",
           shape_str(expected_targets));
  // The fused kernels never read outside a position's classes: host targets are checked
  // here (synchronously); a device kernel records a bad target as an asynchronous error
  // raised at the next synchronization (KernelBackend::cross_entropy, "Bad targets").
  op_util::check_index_bounds(target, logits.dim() == 1 ? logits.size(0) : logits.size(1), kOp,
                              "targets", "num_classes C", ignore_index);

  // One fused kernel per direction. The logits stay in their own layout [N, C, inner] (inner
  // = d1 * d2 * ..., 1 for [N, C]): the kernels take the class stride, so the spatial form
  // costs no permuted copy. The forward pass keeps each position's logsumexp (in the
  // accumulation dtype) for the backward pass, which needs neither the probabilities nor a
  // second softmax. The forward's arguments are built once and reused by the backward.
  const DType dtype = logits.dtype();
  const DType acc = accumulation_dtype(dtype);
  Tensor logits_c = logits.detach().contiguous();
  Tensor target_c = target.contiguous();
  Tensor losses = empty(expected_targets, options_like(logits, acc));
  Tensor lse = empty(expected_targets, options_like(logits, acc));
  kernels::CrossEntropyArgs args;
  args.loss = contiguous_data(losses, kOp);
  args.lse = contiguous_data(lse, kOp);
  args.logits = contiguous_data(logits_c, kOp);
  args.targets = static_cast<const int64_t*>(contiguous_data(target_c, kOp));
  args.dtype = dtype;
  args.rows = target.numel();
  args.cols = logits.dim() == 1 ? logits.size(0) : logits.size(1);
  for (int64_t d = 2; d < logits.dim(); ++d) args.inner *= logits.size(d);
  args.ignore_index = ignore_index;
  if (args.rows > 0) backend_for(logits.device()).cross_entropy(args);

  Tensor count;  // kMean only
  Tensor out = reduce_losses(losses, target_c, reduction, ignore_index, &count).to(dtype);
  if (!autograd::needs_grad({&logits})) return out;
  // The closure keeps logits_c, target_c and lse alive: args points into them.
  autograd::record(out, kOp, {logits},
                   [args, logits_c, target_c, lse, count, reduction](const Tensor& g) {
                     return std::vector<Tensor>{
                         cross_entropy_grad(g, args, logits_c, count, reduction)};
                   });
  return out;
}

}  // namespace rd
