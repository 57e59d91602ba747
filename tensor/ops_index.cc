// Joining, splitting and indexing ops: cat, stack, split, chunk, index_select, gather,
// scatter, scatter_add, masked_fill, tril, triu and cumsum, with their backward passes.
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

using op_util::options_like;

void check_defined(const Tensor& t, const char* op, const char* arg) {
  RD_CHECK(t.defined(), kInvalidArgument, op, ": argument '", arg, "' is undefined");
}

// cat and stack join a list: it must not be empty, and every entry must be defined.
void check_nonempty_defined(const std::vector<Tensor>& tensors, const char* op) {
  RD_CHECK(!tensors.empty(), kInvalidArgument, op, ": argument 'tensors' is empty");
  for (size_t i = 0; i < tensors.size(); ++i) {
    RD_CHECK(tensors[i].defined(), kInvalidArgument, op, ": argument 'tensors[", i,
             "]' is undefined");
  }
}

// Index ops address a dim, so they need at least one.
void check_has_dims(const Tensor& t, const char* op, const char* arg) {
  check_defined(t, op, arg);
  RD_CHECK(t.dim() >= 1, kShapeMismatch, op, ": argument '", arg,
           "' must have at least 1 dim, got a 0-dim tensor");
}

std::string dim_bound_desc(int64_t dim) { return "x.size(" + std::to_string(dim) + ")"; }

// The leading block of t with the given (no larger) shape: t[:shape[0], :shape[1], ...].
Tensor leading_block(const Tensor& t, const Shape& shape) {
  Tensor block = t;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (block.size(d) != shape[d]) block = block.narrow(d, 0, shape[d]);
  }
  return block;
}

// zeros(shape) with `src` added at index along dim: the backward of gather.
Tensor scatter_add_into_zeros(const Shape& shape, int64_t dim, const Tensor& index,
                              const Tensor& src, const char* op) {
  Tensor out = zeros(shape, options_like(src));
  if (index.numel() > 0) {
    backend_for(src.device())
        .scatter(kernel_view(out, op), static_cast<int>(dim), kernel_view(index, op),
                 kernel_view(src, op), /*accumulate=*/true);
  }
  return out;
}

Tensor gather_raw(const Tensor& x, int64_t dim, const Tensor& index, const char* op) {
  Tensor out = empty(index.shape(), options_like(x));
  if (out.numel() > 0) {
    backend_for(x.device())
        .gather(kernel_view(out, op), kernel_view(x, op), static_cast<int>(dim),
                kernel_view(index, op));
  }
  return out;
}

// Inclusive prefix sum along dim (from the end when reverse); a 0-dim tensor is its own sum.
Tensor cumsum_raw(const Tensor& in, int64_t dim, bool reverse, const char* op) {
  Tensor out = empty(in.shape(), options_like(in));
  if (in.numel() == 0) return out;
  const bool scalar = in.dim() == 0;
  backend_for(in.device())
      .cumsum(kernel_view(scalar ? out.view({1}) : out, op),
              kernel_view(scalar ? in.view({1}) : in, op), static_cast<int>(dim), reverse);
  return out;
}

// Shared by scatter and scatter_add; PyTorch's rules: same rank for all three,
// index.size(d) <= src.size(d) for every d and <= x.size(d) for d != dim.
Tensor scatter_impl(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                    bool accumulate) {
  const char* op = accumulate ? "scatter_add" : "scatter";
  check_has_dims(x, op, "x");
  check_defined(index, op, "index");
  check_defined(src, op, "src");
  RD_CHECK(index.dim() == x.dim() && src.dim() == x.dim(), kShapeMismatch, op, ": arguments 'x' ",
           shape_str(x.shape()), ", 'index' ", shape_str(index.shape()), " and 'src' ",
           shape_str(src.shape()), " must have the same number of dims");
  dim = normalize_dim(dim, x.dim(), op);
  for (int64_t d = 0; d < x.dim(); ++d) {
    RD_CHECK(index.size(d) <= src.size(d), kShapeMismatch, op, ": argument 'index' of shape ",
             shape_str(index.shape()), " is larger than 'src' of shape ", shape_str(src.shape()),
             " in dim ", d);
    RD_CHECK(d == dim || index.size(d) <= x.size(d), kShapeMismatch, op,
             ": argument 'index' of shape ", shape_str(index.shape()),
             " is larger than 'x' of shape ", shape_str(x.shape()), " in dim ", d, " (only dim ",
             dim, " may exceed x)");
  }
  check_same_device({&x, &index}, op);
  check_same_device({&x, &src}, op);
  Tensor idx = op_util::int64_index(index, op, "index");
  op_util::check_index_bounds(idx, x.size(dim), op, "index", dim_bound_desc(dim));

  Tensor out = x.detach().clone();
  Tensor src_part = leading_block(src.detach(), index.shape()).to(x.dtype());
  auto& backend = backend_for(x.device());
  if (idx.numel() > 0) {
    backend.scatter(kernel_view(out, op), static_cast<int>(dim), kernel_view(idx, op),
                    kernel_view(src_part, op), accumulate);
  }
  if (!autograd::needs_grad({&x, &src})) return out;

  autograd::record(
      out, op, {x, src},
      [idx, dim, accumulate, op, want_x = x.requires_grad(), want_src = src.requires_grad(),
       src_shape = src.shape(), src_dtype = src.dtype()](const Tensor& g) {
        Tensor grad_x;
        if (want_x) {
          if (accumulate) {
            grad_x = g;
          } else {
            // Scattered positions were overwritten, so no gradient reaches x there.
            grad_x = g.clone();
            if (idx.numel() > 0) {
              Tensor no_grad = zeros(idx.shape(), options_like(g));
              backend_for(g.device())
                  .scatter(kernel_view(grad_x, op), static_cast<int>(dim), kernel_view(idx, op),
                           kernel_view(no_grad, op),
                           /*accumulate=*/false);
            }
          }
        }
        Tensor grad_src;
        if (want_src) {
          Tensor picked = gather_raw(g, dim, idx, op).to(src_dtype);
          if (picked.shape() == src_shape) {
            grad_src = picked;
          } else {  // src was larger than index: its other elements were unused
            grad_src = zeros(src_shape, options_like(picked));
            leading_block(grad_src, idx.shape()).copy_(picked);
          }
        }
        return std::vector<Tensor>{grad_x, grad_src};
      });
  return out;
}

// Keeps the elements of the last two dims with col - row <= k (lower) or >= k (upper).
Tensor triangle(const Tensor& x, int64_t k, bool lower) {
  const char* op = lower ? "tril" : "triu";
  check_defined(x, op, "x");
  RD_CHECK(x.dim() >= 2, kShapeMismatch, op, ": argument 'x' must have at least 2 dims, got shape ",
           shape_str(x.shape()));
  const TensorOptions int_options = options_like(x, DType::kInt64);
  Tensor rows = arange(0.0, static_cast<double>(x.size(-2)), 1.0, int_options).unsqueeze(1);
  Tensor cols = arange(0.0, static_cast<double>(x.size(-1)), 1.0, int_options);
  Tensor diagonal = add(rows, static_cast<double>(k));  // the kept boundary per row
  Tensor keep = lower ? le(cols, diagonal) : ge(cols, diagonal);
  return where(keep, x, 0.0);  // where() supplies the masked gradient
}

}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  constexpr const char* kOp = "cat";
  check_nonempty_defined(tensors, kOp);
  const Tensor& first = tensors[0];
  RD_CHECK(first.dim() >= 1, kShapeMismatch, kOp,
           ": 0-dim tensors cannot be concatenated (tensors[0] is 0-dim)");
  dim = normalize_dim(dim, first.dim(), kOp);

  Shape out_shape = first.shape();
  out_shape[dim] = 0;
  DType dtype = first.dtype();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    RD_CHECK(t.device() == first.device(), kDeviceMismatch, kOp, ": tensors[", i, "] is on ",
             t.device().str(), " but tensors[0] is on ", first.device().str());
    bool match = t.dim() == first.dim();
    for (int64_t d = 0; match && d < first.dim(); ++d) {
      match = d == dim || t.size(d) == first.size(d);
    }
    RD_CHECK(match, kShapeMismatch, kOp, ": tensors[", i, "] has shape ", shape_str(t.shape()),
             " but tensors[0] has shape ", shape_str(first.shape()),
             "; shapes must match except in dim ", dim);
    out_shape[dim] += t.size(dim);
    dtype = promote_types(dtype, t.dtype());
  }

  Tensor out = empty(out_shape, TensorOptions(dtype).with_device(first.device()));
  auto& backend = backend_for(first.device());
  std::vector<int64_t> starts;
  int64_t start = 0;
  for (const Tensor& t : tensors) {
    starts.push_back(start);
    if (t.numel() > 0) {
      backend.copy(kernel_view(out.narrow(dim, start, t.size(dim)), kOp), kernel_view(t, kOp));
    }
    start += t.size(dim);
  }
  if (!autograd::needs_grad(tensors)) return out;

  std::vector<bool> wants;
  std::vector<DType> dtypes;
  std::vector<int64_t> lengths;
  for (const Tensor& t : tensors) {
    wants.push_back(t.requires_grad());
    dtypes.push_back(t.dtype());
    lengths.push_back(t.size(dim));
  }
  autograd::record(out, kOp, tensors, [dim, starts, lengths, wants, dtypes](const Tensor& g) {
    std::vector<Tensor> grads(starts.size());
    for (size_t i = 0; i < starts.size(); ++i) {
      if (wants[i]) grads[i] = g.narrow(dim, starts[i], lengths[i]).to(dtypes[i]);
    }
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  constexpr const char* kOp = "stack";
  check_nonempty_defined(tensors, kOp);
  for (size_t i = 0; i < tensors.size(); ++i) {
    RD_CHECK(tensors[i].shape() == tensors[0].shape(), kShapeMismatch, kOp, ": tensors[", i,
             "] has shape ", shape_str(tensors[i].shape()), " but tensors[0] has shape ",
             shape_str(tensors[0].shape()), "; stack needs equal shapes");
  }
  dim = normalize_dim(dim, tensors[0].dim() + 1, kOp);
  std::vector<Tensor> expanded;
  expanded.reserve(tensors.size());
  for (const Tensor& t : tensors) expanded.push_back(t.unsqueeze(dim));
  return cat(expanded, dim);
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  constexpr const char* kOp = "split";
  check_has_dims(x, kOp, "x");
  dim = normalize_dim(dim, x.dim(), kOp);
  const int64_t n = x.size(dim);
  RD_CHECK(split_size > 0 || (split_size == 0 && n == 0), kInvalidArgument, kOp,
           ": argument 'split_size' must be positive, got ", split_size, " for dim ", dim,
           " of size ", n);
  if (n == 0) return {x.narrow(dim, 0, 0)};  // PyTorch: one empty piece
  std::vector<Tensor> pieces;
  for (int64_t start = 0; start < n; start += split_size) {
    pieces.push_back(x.narrow(dim, start, std::min(split_size, n - start)));
  }
  return pieces;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  constexpr const char* kOp = "split";
  check_has_dims(x, kOp, "x");
  dim = normalize_dim(dim, x.dim(), kOp);
  int64_t total = 0;
  for (int64_t s : sizes) {
    RD_CHECK(s >= 0, kInvalidArgument, kOp, ": argument 'sizes' ", shape_str(sizes),
             " holds a negative size");
    total += s;
  }
  RD_CHECK(total == x.size(dim), kShapeMismatch, kOp, ": argument 'sizes' ", shape_str(sizes),
           " sums to ", total, " but dim ", dim, " of 'x' ", shape_str(x.shape()), " has size ",
           x.size(dim));
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t s : sizes) {
    pieces.push_back(x.narrow(dim, start, s));
    start += s;
  }
  return pieces;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  constexpr const char* kOp = "chunk";
  check_has_dims(x, kOp, "x");
  RD_CHECK(chunks > 0, kInvalidArgument, kOp, ": argument 'chunks' must be positive, got ", chunks);
  dim = normalize_dim(dim, x.dim(), kOp);
  const int64_t n = x.size(dim);
  // As PyTorch: pieces of ceil(n / chunks), so fewer than `chunks` pieces may come back;
  // an empty dim gives `chunks` empty pieces.
  if (n == 0) return split(x, std::vector<int64_t>(chunks, 0), dim);
  return split(x, (n + chunks - 1) / chunks, dim);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  constexpr const char* kOp = "index_select";
  check_has_dims(x, kOp, "x");
  check_defined(index, kOp, "index");
  dim = normalize_dim(dim, x.dim(), kOp);
  RD_CHECK(index.dim() <= 1, kShapeMismatch, kOp,
           ": argument 'index' must be 1-D (or 0-dim), got shape ", shape_str(index.shape()));
  check_same_device({&x, &index}, kOp);
  Tensor idx = op_util::int64_index(index, kOp, "index").reshape({index.numel()});
  op_util::check_index_bounds(idx, x.size(dim), kOp, "index", dim_bound_desc(dim));

  Shape out_shape = x.shape();
  out_shape[dim] = idx.numel();
  Tensor out = empty(out_shape, options_like(x));
  if (out.numel() > 0) {
    backend_for(x.device())
        .index_select(kernel_view(out, kOp), kernel_view(x, kOp), static_cast<int>(dim),
                      kernel_view(idx, kOp));
  }
  if (autograd::needs_grad({&x})) {
    autograd::record(out, kOp, {x}, [idx, dim, shape = x.shape()](const Tensor& g) {
      Tensor grad_x = zeros(shape, options_like(g));
      if (g.numel() > 0) {
        backend_for(g.device())
            .index_add(kernel_view(grad_x, kOp), static_cast<int>(dim), kernel_view(idx, kOp),
                       kernel_view(g, kOp));
      }
      return std::vector<Tensor>{grad_x};
    });
  }
  return out;
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  constexpr const char* kOp = "gather";
  check_has_dims(x, kOp, "x");
  check_defined(index, kOp, "index");
  RD_CHECK(index.dim() == x.dim(), kShapeMismatch, kOp, ": argument 'index' of shape ",
           shape_str(index.shape()), " must have as many dims as 'x' ", shape_str(x.shape()));
  dim = normalize_dim(dim, x.dim(), kOp);
  for (int64_t d = 0; d < x.dim(); ++d) {
    RD_CHECK(d == dim || index.size(d) <= x.size(d), kShapeMismatch, kOp,
             ": argument 'index' of shape ", shape_str(index.shape()), " is larger than 'x' ",
             shape_str(x.shape()), " in dim ", d);
  }
  check_same_device({&x, &index}, kOp);
  Tensor idx = op_util::int64_index(index, kOp, "index");
  op_util::check_index_bounds(idx, x.size(dim), kOp, "index", dim_bound_desc(dim));

  Tensor out = gather_raw(x.detach(), dim, idx, kOp);
  if (autograd::needs_grad({&x})) {
    autograd::record(out, kOp, {x}, [idx, dim, shape = x.shape()](const Tensor& g) {
      return std::vector<Tensor>{scatter_add_into_zeros(shape, dim, idx, g, kOp)};
    });
  }
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl(x, dim, index, src, /*accumulate=*/false);
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl(x, dim, index, src, /*accumulate=*/true);
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  constexpr const char* kOp = "masked_fill";
  check_defined(x, kOp, "x");
  check_defined(mask, kOp, "mask");
  RD_CHECK(mask.dtype() == DType::kBool, kDTypeMismatch, kOp,
           ": argument 'mask' must be bool, got ", dtype_name(mask.dtype()));
  // The mask broadcasts to x, never the other way: the result keeps x's shape.
  bool broadcastable = mask.dim() <= x.dim();
  for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
    broadcastable = mask.size(-i) == 1 || mask.size(-i) == x.size(-i);
  }
  RD_CHECK(broadcastable, kShapeMismatch, kOp, ": argument 'mask' of shape ",
           shape_str(mask.shape()), " does not broadcast to 'x' of shape ", shape_str(x.shape()));
  check_same_device({&x, &mask}, kOp);
  return where(mask, scalar_tensor(value, options_like(x)), x);  // where() gives the gradient
}

Tensor tril(const Tensor& x, int64_t k) { return triangle(x, k, /*lower=*/true); }

Tensor triu(const Tensor& x, int64_t k) { return triangle(x, k, /*lower=*/false); }

Tensor cumsum(const Tensor& x, int64_t dim) {
  constexpr const char* kOp = "cumsum";
  check_defined(x, kOp, "x");
  dim = normalize_dim(dim, x.dim(), kOp);  // a 0-dim x takes dim 0 or -1
  // Integer and bool sums widen to int64, as in PyTorch.
  const DType dtype = is_floating(x.dtype()) ? x.dtype() : DType::kInt64;
  Tensor out = cumsum_raw(x.detach().to(dtype), dim, /*reverse=*/false, kOp);
  if (autograd::needs_grad({&x})) {
    // d out[j] / d x[i] = 1 for j >= i, so grad_x is the reverse cumsum of grad.
    autograd::record(out, kOp, {x}, [dim](const Tensor& g) {
      return std::vector<Tensor>{cumsum_raw(g, dim, /*reverse=*/true, kOp)};
    });
  }
  return out;
}

}  // namespace rd
