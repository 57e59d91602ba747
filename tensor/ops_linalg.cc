// Matrix products: matmul (NumPy semantics, batch broadcasting) built on bmm, which maps
// strided operands onto one batched GEMM without copies where the layout allows, and linear
// (a GEMM with a fused bias).
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd {

namespace {

// How one [batch, rows, cols] operand is handed to GEMM: its storage as a row-major
// matrix with unit column stride, transposed or not.
struct GemmOperand {
  Tensor tensor;  // possibly a contiguous copy of the input
  bool transposed = false;
  int64_t ld = 0;
  int64_t batch_stride = 0;
};

GemmOperand gemm_operand(const Tensor& x) {
  int64_t rows = x.size(1), cols = x.size(2);
  // BLAS needs the leading dim to be at least the stored row length.
  if (x.stride(2) == 1 && x.stride(1) >= std::max<int64_t>(cols, 1)) {
    return {x, false, x.stride(1), x.stride(0)};
  }
  if (x.stride(1) == 1 && x.stride(2) >= std::max<int64_t>(rows, 1)) {
    return {x, true, x.stride(2), x.stride(0)};
  }
  Tensor c = x.contiguous();
  return {c, false, std::max<int64_t>(cols, 1), rows * cols};
}

// a @ b, plus `bias` (undefined, or b.size(2) elements of a's dtype, contiguous) added to
// every row by the GEMM epilogue.
Tensor bmm_forward(const Tensor& a, const Tensor& b, const Tensor& bias = {}) {
  int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  Tensor out = empty({batch, m, n}, TensorOptions(a.dtype()).with_device(a.device()));
  if (out.numel() == 0) return out;
  GemmOperand ga = gemm_operand(a), gb = gemm_operand(b);
  kernels::GemmArgs args;
  args.dtype = a.dtype();
  args.trans_a = ga.transposed;
  args.trans_b = gb.transposed;
  args.m = m;
  args.n = n;
  args.k = k;
  args.a = ga.tensor.raw_data();
  args.b = gb.tensor.raw_data();
  args.c = out.raw_data();
  args.lda = ga.ld;
  args.ldb = gb.ld;
  args.ldc = n;
  args.batch = batch;
  args.stride_a = ga.batch_stride;
  args.stride_b = gb.batch_stride;
  args.stride_c = m * n;
  if (bias.defined()) args.bias = bias.raw_data();
  if (k == 0) {
    RD_CHECK(!bias.defined(), kInternal, "bmm_forward: a bias with an empty inner dim");
    out.zero_();
    return out;
  }
  backend_for(a.device()).gemm(args);
  return out;
}

}  // namespace

Tensor bmm(const Tensor& a, const Tensor& b) {
  check_same_device({&a, &b}, "bmm");
  RD_CHECK(a.dim() == 3 && b.dim() == 3, kShapeMismatch, "bmm: expects 3-D operands, got ",
           shape_str(a.shape()), " and ", shape_str(b.shape()));
  RD_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), kShapeMismatch,
           "bmm: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()),
           " do not multiply (batch and inner sizes must match)");
  RD_CHECK(a.dtype() == b.dtype(), kDTypeMismatch, "bmm: dtypes differ (",
           dtype_name(a.dtype()), " and ", dtype_name(b.dtype()), ")");
  check_floating(a, "bmm", "a");
  Tensor out = bmm_forward(a, b);
  if (autograd::needs_grad({&a, &b})) {
    bool need_a = a.requires_grad(), need_b = b.requires_grad();
    // Each operand's gradient reads only the other operand.
    Tensor sa = need_b ? a.detach() : Tensor(), sb = need_a ? b.detach() : Tensor();
    autograd::record(out, "bmm", {a, b}, [=](const Tensor& g) -> std::vector<Tensor> {
      return {need_a ? bmm(g, sb.transpose(1, 2)) : Tensor(),
              need_b ? bmm(sa.transpose(1, 2), g) : Tensor()};
    });
  }
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  RD_CHECK(a.dim() >= 1 && b.dim() >= 1, kShapeMismatch,
           "matmul: operands must have at least 1 dim, got ", shape_str(a.shape()), " and ",
           shape_str(b.shape()));
  check_same_device({&a, &b}, "matmul");
  check_floating(a, "matmul", "a");
  RD_CHECK(a.dtype() == b.dtype(), kDTypeMismatch, "matmul: dtypes differ (",
           dtype_name(a.dtype()), " and ", dtype_name(b.dtype()), ")");
  // 1-D operands gain a dim for the product and lose it afterwards.
  if (a.dim() == 1 && b.dim() == 1) {
    RD_CHECK(a.size(0) == b.size(0), kShapeMismatch, "matmul: vectors of sizes ", a.size(0),
             " and ", b.size(0), " differ");
    return matmul(a.unsqueeze(0), b.unsqueeze(1)).reshape({});
  }
  if (a.dim() == 1) return matmul(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return matmul(a, b.unsqueeze(1)).squeeze(-1);

  int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  RD_CHECK(b.size(-2) == k, kShapeMismatch, "matmul: shapes ", shape_str(a.shape()), " and ",
           shape_str(b.shape()), " do not multiply (", k, " vs ", b.size(-2), ")");
  Shape batch_a(a.shape().begin(), a.shape().end() - 2);
  Shape batch_b(b.shape().begin(), b.shape().end() - 2);
  RD_CHECK(broadcast_compatible(batch_a, batch_b), kShapeMismatch, "matmul: batch dims of ", shape_str(a.shape()), " and ",
           shape_str(b.shape()), " cannot be broadcast together");
  Shape batch = broadcast_shapes(batch_a, batch_b, "matmul");
  int64_t batch_count = shape_numel(batch);

  auto as_3d = [&](const Tensor& x, int64_t rows, int64_t cols) {
    Shape full = batch;
    full.push_back(rows);
    full.push_back(cols);
    return x.expand(full).reshape({batch_count, rows, cols});
  };
  Tensor product = bmm(as_3d(a, m, k), as_3d(b, k, n));
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  return product.view(out_shape);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_same_device({&x, &weight}, "linear");
  RD_CHECK(weight.dim() == 2, kShapeMismatch, "linear: argument 'weight' must be [out, in], got ",
           shape_str(weight.shape()));
  const int64_t in = weight.size(1), out = weight.size(0);
  RD_CHECK(x.dim() >= 1 && x.size(-1) == in, kShapeMismatch, "linear: argument 'x' must be [..., ",
           in, "] for weight ", shape_str(weight.shape()), ", got ", shape_str(x.shape()));
  RD_CHECK(x.dtype() == weight.dtype(), kDTypeMismatch, "linear: dtypes of x and weight differ (",
           dtype_name(x.dtype()), " and ", dtype_name(weight.dtype()), ")");
  check_floating(x, "linear", "x");
  if (bias.defined()) {
    check_same_device({&x, &bias}, "linear");
    RD_CHECK(bias.dim() == 1 && bias.size(0) == out, kShapeMismatch,
             "linear: argument 'bias' must be [", out, "] for weight ", shape_str(weight.shape()),
             ", got ", shape_str(bias.shape()));
    RD_CHECK(bias.dtype() == x.dtype(), kDTypeMismatch, "linear: dtypes of x and bias differ (",
             dtype_name(x.dtype()), " and ", dtype_name(bias.dtype()), ")");
  }
  // An empty inner dim leaves nothing to multiply: the composition handles it.
  if (in == 0) return bias.defined() ? add(matmul(x, weight.t()), bias) : matmul(x, weight.t());

  Shape out_shape = x.shape();
  out_shape.back() = out;
  const int64_t rows = x.numel() / in;
  // Detached: the reshapes feed the kernel only, so they record no throwaway nodes.
  const Tensor x_rows = x.detach().reshape({1, rows, in});
  const Tensor result = bmm_forward(x_rows, weight.detach().t().unsqueeze(0),
                                    bias.defined() ? bias.detach().contiguous() : Tensor())
                            .view(out_shape);
  if (autograd::needs_grad({&x, &weight, &bias})) {
    const bool need_x = x.requires_grad(), need_weight = weight.requires_grad();
    const bool need_bias = bias.defined() && bias.requires_grad();
    // The input gradient reads the weight, the weight gradient the input: save only those.
    Tensor saved_x = need_weight ? x_rows.squeeze(0) : Tensor();
    Tensor saved_weight = need_x ? weight.detach() : Tensor();
    Shape x_shape = x.shape();
    autograd::record(
        result, "linear", {x, weight, bias},
        [=](const Tensor& g) -> std::vector<Tensor> {
          const Tensor g_rows = g.reshape({rows, out});
          return {need_x ? matmul(g_rows, saved_weight).view(x_shape) : Tensor(),
                  need_weight ? matmul(g_rows.t(), saved_x) : Tensor(),
                  need_bias ? sum(g_rows, {0}) : Tensor()};
        });
  }
  return result;
}

}  // namespace rd
