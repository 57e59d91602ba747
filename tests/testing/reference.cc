// Plain-loop float64 reference ops: slow and obvious on purpose, so that a test failure
// points at the library, not at the reference.
#include "testing/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>

namespace rd::ref {
namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::logic_error(std::string("reference: ") + what);
}

// The dims of `dims` wrapped into [0, ndim) as a membership mask; empty means all.
std::vector<bool> dim_mask(const std::vector<int64_t>& dims, int64_t ndim) {
  std::vector<bool> mask(ndim, dims.empty());
  for (int64_t d : wrap_dims(dims, ndim)) mask[d] = true;
  return mask;
}

double sum_of(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return s;
}

double mean_of(const std::vector<double>& v) { return sum_of(v) / static_cast<double>(v.size()); }

// The index of the first element that `better` prefers over every earlier one.
int64_t first_best(const std::vector<double>& v, bool want_max) {
  int64_t best = 0;
  for (int64_t i = 1; i < static_cast<int64_t>(v.size()); ++i) {
    if (want_max ? v[i] > v[best] : v[i] < v[best]) best = i;
  }
  return best;
}

Shape drop_dim(const Shape& shape, int64_t dim) {
  Shape out = shape;
  out.erase(out.begin() + dim);
  return out;
}

}  // namespace

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Index unravel(int64_t flat, const Shape& shape) {
  Index index(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

int64_t ravel(const Index& index, const Shape& shape) {
  require(index.size() == shape.size(), "index rank differs from shape rank");
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    require(index[d] >= 0 && index[d] < shape[d], "index out of bounds");
    flat = flat * shape[d] + index[d];
  }
  return flat;
}

int64_t wrap_dim(int64_t dim, int64_t ndim) {
  int64_t d = dim < 0 ? dim + ndim : dim;
  require(d >= 0 && d < ndim, "dim out of range");
  return d;
}

std::vector<int64_t> wrap_dims(const std::vector<int64_t>& dims, int64_t ndim) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(wrap_dim(d, ndim));
  return out;
}

RefArray::RefArray(Shape s, std::vector<double> values)
    : shape(std::move(s)), data(std::move(values)) {
  require(static_cast<int64_t>(data.size()) == numel_of(shape), "value count != numel");
}

RefArray RefArray::filled(Shape s, double value) {
  int64_t n = numel_of(s);
  return RefArray(std::move(s), std::vector<double>(n, value));
}

// --- elementwise ---

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    require(da == db || da == 1 || db == 1, "shapes do not broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

RefArray broadcast_to(const RefArray& x, const Shape& shape) {
  require(broadcast_shapes(x.shape, shape) == shape, "cannot broadcast to shape");
  RefArray out = RefArray::filled(shape, 0.0);
  size_t lead = shape.size() - x.shape.size();
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index oi = unravel(i, shape);
    Index xi(x.shape.size());
    for (size_t d = 0; d < xi.size(); ++d) xi[d] = x.shape[d] == 1 ? 0 : oi[d + lead];
    out.data[i] = x.at(xi);
  }
  return out;
}

RefArray map(const RefArray& x, const std::function<double(double)>& f) {
  RefArray out = x;
  for (double& v : out.data) v = f(v);
  return out;
}

RefArray zip(const RefArray& a, const RefArray& b, const std::function<double(double, double)>& f) {
  Shape shape = broadcast_shapes(a.shape, b.shape);
  RefArray ab = broadcast_to(a, shape);
  RefArray bb = broadcast_to(b, shape);
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) out.data[i] = f(ab.data[i], bb.data[i]);
  return out;
}

RefArray where(const RefArray& cond, const RefArray& a, const RefArray& b) {
  Shape shape = broadcast_shapes(broadcast_shapes(cond.shape, a.shape), b.shape);
  RefArray c = broadcast_to(cond, shape);
  RefArray ab = broadcast_to(a, shape);
  RefArray bb = broadcast_to(b, shape);
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) out.data[i] = c.data[i] != 0 ? ab.data[i] : bb.data[i];
  return out;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh(double x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
double silu(double x) { return x * sigmoid(x); }

// --- reductions ---

RefArray reduce(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim,
                const ReduceFn& f) {
  std::vector<bool> reduced = dim_mask(dims, x.dim());
  Shape kept_shape = x.shape;  // keepdim layout: reduced dims become 1
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (reduced[d]) kept_shape[d] = 1;
  }
  std::vector<std::vector<double>> groups(numel_of(kept_shape));
  for (int64_t i = 0; i < x.numel(); ++i) {
    Index xi = unravel(i, x.shape);
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (reduced[d]) xi[d] = 0;
    }
    groups[ravel(xi, kept_shape)].push_back(x.data[i]);
  }
  Shape out_shape;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced[d]) {
      out_shape.push_back(x.shape[d]);
    } else if (keepdim) {
      out_shape.push_back(1);
    }
  }
  RefArray out = RefArray::filled(out_shape, 0.0);
  for (size_t g = 0; g < groups.size(); ++g) out.data[g] = f(groups[g]);
  return out;
}

RefArray sum(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, sum_of);
}

RefArray mean(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, mean_of);
}

RefArray max(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim,
                [](const std::vector<double>& v) { return v[first_best(v, true)]; });
}

RefArray min(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim,
                [](const std::vector<double>& v) { return v[first_best(v, false)]; });
}

RefArray logsumexp(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, [](const std::vector<double>& v) {
    double m = v[first_best(v, true)];
    double s = 0.0;
    for (double e : v) s += std::exp(e - m);
    return m + std::log(s);
  });
}

RefArray var(const RefArray& x, const std::vector<int64_t>& dims, int64_t correction,
             bool keepdim) {
  return reduce(x, dims, keepdim, [correction](const std::vector<double>& v) {
    double m = mean_of(v);
    double ss = 0.0;
    for (double e : v) ss += (e - m) * (e - m);
    return ss / static_cast<double>(static_cast<int64_t>(v.size()) - correction);
  });
}

RefArray argmax(const RefArray& x, int64_t dim, bool keepdim) {
  return reduce(x, {dim}, keepdim, [](const std::vector<double>& v) {
    return static_cast<double>(first_best(v, true));
  });
}

RefArray argmin(const RefArray& x, int64_t dim, bool keepdim) {
  return reduce(x, {dim}, keepdim, [](const std::vector<double>& v) {
    return static_cast<double>(first_best(v, false));
  });
}

// --- lines along a dim ---

RefArray along_dim(const RefArray& x, int64_t dim, const LineFn& f) {
  if (x.dim() == 0) {
    wrap_dim(dim, 1);
    std::vector<double> line = f({x.data[0]});
    return RefArray({}, line);
  }
  int64_t d = wrap_dim(dim, x.dim());
  int64_t n = x.shape[d];
  RefArray out = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    Index start = unravel(i, x.shape);
    if (start[d] != 0) continue;  // visit each line once, from its first element
    std::vector<double> line(n);
    Index at = start;
    for (int64_t j = 0; j < n; ++j) {
      at[d] = j;
      line[j] = x.at(at);
    }
    std::vector<double> result = f(line);
    for (int64_t j = 0; j < n; ++j) {
      at[d] = j;
      out.at(at) = result[j];
    }
  }
  return out;
}

RefArray softmax(const RefArray& x, int64_t dim) {
  return along_dim(x, dim, [](const std::vector<double>& v) {
    double m = v[first_best(v, true)];
    std::vector<double> e(v.size());
    double s = 0.0;
    for (size_t i = 0; i < v.size(); ++i) s += (e[i] = std::exp(v[i] - m));
    for (double& ei : e) ei /= s;
    return e;
  });
}

RefArray log_softmax(const RefArray& x, int64_t dim) {
  return along_dim(x, dim, [](const std::vector<double>& v) {
    double m = v[first_best(v, true)];
    double s = 0.0;
    for (double e : v) s += std::exp(e - m);
    double lse = m + std::log(s);
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] - lse;
    return out;
  });
}

RefArray cumsum(const RefArray& x, int64_t dim) {
  return along_dim(x, dim, [](const std::vector<double>& v) {
    std::vector<double> out(v.size());
    double s = 0.0;
    for (size_t i = 0; i < v.size(); ++i) out[i] = (s += v[i]);
    return out;
  });
}

// --- linear algebra ---

RefArray matmul(const RefArray& a_in, const RefArray& b_in) {
  require(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul needs at least 1-D operands");
  // Promote 1-D operands: a [k] -> [1, k], b [k] -> [k, 1]; the added dim is dropped later.
  RefArray a = a_in.dim() == 1 ? RefArray({1, a_in.shape[0]}, a_in.data) : a_in;
  RefArray b = b_in.dim() == 1 ? RefArray({b_in.shape[0], 1}, b_in.data) : b_in;
  int64_t n = a.shape[a.dim() - 2], k = a.shape[a.dim() - 1];
  int64_t k2 = b.shape[b.dim() - 2], m = b.shape[b.dim() - 1];
  require(k == k2, "matmul inner sizes differ");
  Shape a_batch(a.shape.begin(), a.shape.end() - 2);
  Shape b_batch(b.shape.begin(), b.shape.end() - 2);
  Shape batch = broadcast_shapes(a_batch, b_batch);
  Shape a_full = batch, b_full = batch;
  a_full.insert(a_full.end(), {n, k});
  b_full.insert(b_full.end(), {k, m});
  RefArray ab = broadcast_to(a, a_full);
  RefArray bb = broadcast_to(b, b_full);
  Shape out_shape = batch;
  out_shape.insert(out_shape.end(), {n, m});
  RefArray out = RefArray::filled(out_shape, 0.0);
  int64_t batches = numel_of(batch);
  for (int64_t p = 0; p < batches; ++p) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double s = 0.0;
        for (int64_t l = 0; l < k; ++l) {
          s += ab.data[(p * n + i) * k + l] * bb.data[(p * k + l) * m + j];
        }
        out.data[(p * n + i) * m + j] = s;
      }
    }
  }
  Shape final_shape = batch;
  if (a_in.dim() != 1) final_shape.push_back(n);
  if (b_in.dim() != 1) final_shape.push_back(m);
  return RefArray(final_shape, out.data);
}

RefArray bmm(const RefArray& a, const RefArray& b) {
  require(a.dim() == 3 && b.dim() == 3 && a.shape[0] == b.shape[0], "bmm needs [B,n,k]@[B,k,m]");
  return matmul(a, b);
}

RefArray linear(const RefArray& x, const RefArray& weight, const std::optional<RefArray>& bias) {
  require(weight.dim() == 2 && x.dim() >= 1 && x.shape.back() == weight.shape[1],
          "linear needs x [..., in] and weight [out, in]");
  const int64_t in = weight.shape[1], out = weight.shape[0];
  require(!bias || (bias->dim() == 1 && bias->shape[0] == out), "linear needs bias [out]");
  Shape shape = x.shape;
  shape.back() = out;
  RefArray y = RefArray::filled(shape, 0.0);
  for (int64_t row = 0; row < x.numel() / in; ++row) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias ? bias->data[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x.data[row * in + i] * weight.data[o * in + i];
      y.data[row * out + o] = acc;
    }
  }
  return y;
}

// --- neural-network ops ---

namespace {

// Applies f to each row of x viewed as [outer, inner], where inner spans the trailing dims
// named by normalized_shape; f gets the row and writes the normalized row.
RefArray normalize_rows(const RefArray& x, const Shape& normalized_shape,
                        const std::function<void(std::vector<double>&)>& f) {
  require(normalized_shape.size() <= x.shape.size(), "normalized_shape longer than x");
  require(std::equal(normalized_shape.begin(), normalized_shape.end(),
                     x.shape.end() - normalized_shape.size()),
          "normalized_shape is not x's trailing shape");
  int64_t inner = numel_of(normalized_shape);
  RefArray out = x;
  for (int64_t row = 0; row < x.numel() / inner; ++row) {
    std::vector<double> v(x.data.begin() + row * inner, x.data.begin() + (row + 1) * inner);
    f(v);
    std::copy(v.begin(), v.end(), out.data.begin() + row * inner);
  }
  return out;
}

void scale_and_shift(std::vector<double>& v, const std::optional<RefArray>& weight,
                     const std::optional<RefArray>& bias) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (weight) v[i] *= weight->data[i];
    if (bias) v[i] += bias->data[i];
  }
}

}  // namespace

RefArray layer_norm(const RefArray& x, const Shape& normalized_shape,
                    const std::optional<RefArray>& weight, const std::optional<RefArray>& bias,
                    double eps) {
  return normalize_rows(x, normalized_shape, [&](std::vector<double>& v) {
    double m = mean_of(v);
    double ss = 0.0;
    for (double e : v) ss += (e - m) * (e - m);
    double inv = 1.0 / std::sqrt(ss / static_cast<double>(v.size()) + eps);
    for (double& e : v) e = (e - m) * inv;
    scale_and_shift(v, weight, bias);
  });
}

RefArray rms_norm(const RefArray& x, const Shape& normalized_shape,
                  const std::optional<RefArray>& weight, double eps) {
  return normalize_rows(x, normalized_shape, [&](std::vector<double>& v) {
    double ss = 0.0;
    for (double e : v) ss += e * e;
    double inv = 1.0 / std::sqrt(ss / static_cast<double>(v.size()) + eps);
    for (double& e : v) e *= inv;
    scale_and_shift(v, weight, std::nullopt);
  });
}

namespace {

// x + residual, elementwise (same shapes).
RefArray add_same_shape(const RefArray& x, const RefArray& residual) {
  require(x.shape == residual.shape, "add_*_norm: x and residual must have the same shape");
  RefArray sum = x;
  for (int64_t i = 0; i < sum.numel(); ++i) sum.data[i] += residual.data[i];
  return sum;
}

}  // namespace

std::vector<RefArray> add_layer_norm(const RefArray& x, const RefArray& residual,
                                     const Shape& normalized_shape,
                                     const std::optional<RefArray>& weight,
                                     const std::optional<RefArray>& bias, double eps) {
  RefArray sum = add_same_shape(x, residual);
  return {layer_norm(sum, normalized_shape, weight, bias, eps), sum};
}

std::vector<RefArray> add_rms_norm(const RefArray& x, const RefArray& residual,
                                   const Shape& normalized_shape,
                                   const std::optional<RefArray>& weight, double eps) {
  RefArray sum = add_same_shape(x, residual);
  return {rms_norm(sum, normalized_shape, weight, eps), sum};
}

RefArray embedding(const RefArray& weight, const RefArray& indices) {
  require(weight.dim() == 2, "embedding weight must be 2-D");
  int64_t e = weight.shape[1];
  Shape shape = indices.shape;
  shape.push_back(e);
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < indices.numel(); ++i) {
    int64_t row = static_cast<int64_t>(indices.data[i]);
    for (int64_t j = 0; j < e; ++j) out.data[i * e + j] = weight.at({row, j});
  }
  return out;
}

RefArray rotary_embedding_qkv(const RefArray& qkv, int64_t position_offset, double base) {
  const Shape& s = qkv.shape;  // [B, T, 3, H, D]
  RefArray out = qkv;
  for (int64_t part = 0; part < 2; ++part) {  // q, then k
    RefArray x;
    x.shape = {s[0], s[1], s[3], s[4]};
    x.data.resize(static_cast<size_t>(numel_of(x.shape)));
    for (int64_t b = 0; b < s[0]; ++b)
      for (int64_t t = 0; t < s[1]; ++t)
        for (int64_t h = 0; h < s[3]; ++h)
          for (int64_t d = 0; d < s[4]; ++d) x.at({b, t, h, d}) = qkv.at({b, t, part, h, d});
    const RefArray rotated = rotary_embedding(x, position_offset, base);
    for (int64_t b = 0; b < s[0]; ++b)
      for (int64_t t = 0; t < s[1]; ++t)
        for (int64_t h = 0; h < s[3]; ++h)
          for (int64_t d = 0; d < s[4]; ++d) out.at({b, t, part, h, d}) = rotated.at({b, t, h, d});
  }
  return out;
}

RefArray swiglu(const RefArray& x) {
  const int64_t hidden = x.shape.back() / 2;
  RefArray out;
  out.shape = x.shape;
  out.shape.back() = hidden;
  const int64_t rows = hidden == 0 ? 0 : x.numel() / (2 * hidden);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t j = 0; j < hidden; ++j) {
      const double gate = x.data[row * 2 * hidden + j], up = x.data[row * 2 * hidden + hidden + j];
      out.data.push_back(silu(gate) * up);
    }
  }
  return out;
}

RefArray rotary_embedding(const RefArray& x, int64_t position_offset, double base) {
  RefArray out = x;
  const int64_t dim = x.shape[3], half = dim / 2;
  for (int64_t b = 0; b < x.shape[0]; ++b) {
    for (int64_t t = 0; t < x.shape[1]; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const long double freq = std::pow(static_cast<long double>(base),
                                          -2.0L * static_cast<long double>(i) / dim);
        const long double angle = static_cast<long double>(position_offset + t) * freq;
        const long double c = std::cos(angle), s = std::sin(angle);
        for (int64_t h = 0; h < x.shape[2]; ++h) {
          const long double x1 = x.at({b, t, h, i}), x2 = x.at({b, t, h, i + half});
          out.at({b, t, h, i}) = static_cast<double>(x1 * c - x2 * s);
          out.at({b, t, h, i + half}) = static_cast<double>(x2 * c + x1 * s);
        }
      }
    }
  }
  return out;
}

RefArray cross_entropy(const RefArray& logits, const RefArray& targets, int64_t ignore_index,
                       Reduction reduction) {
  // A single sample [C] with target [] is the batch [1, C] with the batch dim dropped. Each
  // target position p = (n, d1, ...) picks class targets[p] of logits (n, :, d1, ...).
  bool single = logits.dim() == 1;
  RefArray lg = single ? RefArray({1, logits.shape[0]}, logits.data) : logits;
  RefArray lsm = log_softmax(lg, 1);
  Shape target_shape = lg.shape;
  target_shape.erase(target_shape.begin() + 1);
  const int64_t n = numel_of(target_shape);
  std::vector<double> losses(n, 0.0);
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = static_cast<int64_t>(targets.data[i]);
    if (t == ignore_index) continue;
    Index at = unravel(i, target_shape);
    at.insert(at.begin() + 1, t);
    losses[i] = -lsm.at(at);
    total += losses[i];
    ++counted;
  }
  switch (reduction) {
    case Reduction::kNone:
      return RefArray(single ? Shape{} : target_shape, losses);
    case Reduction::kSum:
      return RefArray({}, {total});
    case Reduction::kMean:
      return RefArray({}, {counted == 0 ? std::numeric_limits<double>::quiet_NaN()
                                        : total / static_cast<double>(counted)});
  }
  return {};
}

// --- joining, splitting, indexing ---

RefArray cat(const std::vector<RefArray>& xs, int64_t dim) {
  require(!xs.empty(), "cat of nothing");
  int64_t d = wrap_dim(dim, xs[0].dim());
  Shape shape = xs[0].shape;
  shape[d] = 0;
  for (const RefArray& x : xs) shape[d] += x.shape[d];
  RefArray out = RefArray::filled(shape, 0.0);
  int64_t base = 0;
  for (const RefArray& x : xs) {
    for (int64_t i = 0; i < x.numel(); ++i) {
      Index idx = unravel(i, x.shape);
      idx[d] += base;
      out.at(idx) = x.data[i];
    }
    base += x.shape[d];
  }
  return out;
}

RefArray stack(const std::vector<RefArray>& xs, int64_t dim) {
  require(!xs.empty(), "stack of nothing");
  int64_t d = wrap_dim(dim, xs[0].dim() + 1);
  std::vector<RefArray> expanded;
  for (const RefArray& x : xs) expanded.push_back(unsqueeze(x, d));
  return cat(expanded, d);
}

std::vector<RefArray> split(const RefArray& x, const std::vector<int64_t>& sizes, int64_t dim) {
  int64_t d = wrap_dim(dim, x.dim());
  std::vector<RefArray> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(slice(x, d, start, start + s, 1));
    start += s;
  }
  require(start == x.shape[d], "split sizes do not cover the dim");
  return out;
}

std::vector<int64_t> split_sizes(int64_t n, int64_t split_size) {
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < n; start += split_size) {
    sizes.push_back(std::min(split_size, n - start));
  }
  return sizes;
}

std::vector<int64_t> chunk_sizes(int64_t n, int64_t chunks) {
  return split_sizes(n, (n + chunks - 1) / chunks);
}

RefArray index_select(const RefArray& x, int64_t dim, const RefArray& index) {
  int64_t d = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  Shape shape = x.shape;
  if (x.dim() > 0) shape[d] = index.numel();
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index oi = unravel(i, shape);
    if (x.dim() > 0) oi[d] = static_cast<int64_t>(index.data[oi[d]]);
    out.data[i] = x.at(oi);
  }
  return out;
}

RefArray gather(const RefArray& x, int64_t dim, const RefArray& index) {
  int64_t d = wrap_dim(dim, x.dim());
  RefArray out = RefArray::filled(index.shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index xi = unravel(i, index.shape);
    xi[d] = static_cast<int64_t>(index.data[i]);
    out.data[i] = x.at(xi);
  }
  return out;
}

namespace {

RefArray scatter_impl(const RefArray& x, int64_t dim, const RefArray& index, const RefArray& src,
                      bool accumulate) {
  int64_t d = wrap_dim(dim, x.dim());
  RefArray out = x;
  for (int64_t i = 0; i < index.numel(); ++i) {
    Index pos = unravel(i, index.shape);
    double v = src.at(pos);
    pos[d] = static_cast<int64_t>(index.data[i]);
    if (accumulate) {
      out.at(pos) += v;
    } else {
      out.at(pos) = v;
    }
  }
  return out;
}

}  // namespace

RefArray scatter(const RefArray& x, int64_t dim, const RefArray& index, const RefArray& src) {
  return scatter_impl(x, dim, index, src, /*accumulate=*/false);
}

RefArray scatter_add(const RefArray& x, int64_t dim, const RefArray& index, const RefArray& src) {
  return scatter_impl(x, dim, index, src, /*accumulate=*/true);
}

RefArray masked_fill(const RefArray& x, const RefArray& mask, double value) {
  return where(mask, RefArray({}, {value}), x);
}

namespace {

RefArray keep_triangle(const RefArray& x, int64_t k, bool lower) {
  require(x.dim() >= 2, "tril/triu need at least 2 dims");
  RefArray out = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    Index idx = unravel(i, x.shape);
    int64_t row = idx[x.dim() - 2], col = idx[x.dim() - 1];
    bool keep = lower ? col - row <= k : col - row >= k;
    if (!keep) out.data[i] = 0.0;
  }
  return out;
}

}  // namespace

RefArray tril(const RefArray& x, int64_t k) { return keep_triangle(x, k, /*lower=*/true); }
RefArray triu(const RefArray& x, int64_t k) { return keep_triangle(x, k, /*lower=*/false); }

// --- shape ops ---

RefArray permute(const RefArray& x, const std::vector<int64_t>& dims) {
  std::vector<int64_t> p = wrap_dims(dims, x.dim());
  require(static_cast<int64_t>(p.size()) == x.dim(), "permute needs every dim");
  Shape shape(p.size());
  for (size_t i = 0; i < p.size(); ++i) shape[i] = x.shape[p[i]];
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index oi = unravel(i, shape);
    Index xi(p.size());
    for (size_t j = 0; j < p.size(); ++j) xi[p[j]] = oi[j];
    out.data[i] = x.at(xi);
  }
  return out;
}

RefArray transpose(const RefArray& x, int64_t dim0, int64_t dim1) {
  std::vector<int64_t> p(x.dim());
  for (int64_t i = 0; i < x.dim(); ++i) p[i] = i;
  std::swap(p[wrap_dim(dim0, x.dim())], p[wrap_dim(dim1, x.dim())]);
  return permute(x, p);
}

RefArray slice(const RefArray& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  int64_t d = wrap_dim(dim, x.dim());
  int64_t n = x.shape[d];
  // PyTorch slicing: negative bounds count from the end, then clamp into [0, n].
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = x.shape;
  shape[d] = (end - start + step - 1) / step;
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index xi = unravel(i, shape);
    xi[d] = start + xi[d] * step;
    out.data[i] = x.at(xi);
  }
  return out;
}

RefArray select(const RefArray& x, int64_t dim, int64_t index) {
  int64_t d = wrap_dim(dim, x.dim());
  if (index < 0) index += x.shape[d];
  RefArray one = slice(x, d, index, index + 1, 1);
  return RefArray(drop_dim(x.shape, d), one.data);
}

RefArray reshape(const RefArray& x, Shape shape) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      infer = static_cast<int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) shape[infer] = x.numel() / known;
  return RefArray(shape, x.data);
}

RefArray expand(const RefArray& x, Shape shape) {
  size_t lead = shape.size() - x.shape.size();
  for (size_t i = 0; i < x.shape.size(); ++i) {
    if (shape[i + lead] == -1) shape[i + lead] = x.shape[i];
  }
  return broadcast_to(x, shape);
}

RefArray squeeze(const RefArray& x) {
  Shape shape;
  for (int64_t s : x.shape) {
    if (s != 1) shape.push_back(s);
  }
  return RefArray(shape, x.data);
}

RefArray squeeze(const RefArray& x, int64_t dim) {
  if (x.dim() == 0) return x;
  int64_t d = wrap_dim(dim, x.dim());
  if (x.shape[d] != 1) return x;
  return RefArray(drop_dim(x.shape, d), x.data);
}

RefArray unsqueeze(const RefArray& x, int64_t dim) {
  int64_t d = wrap_dim(dim, x.dim() + 1);
  Shape shape = x.shape;
  shape.insert(shape.begin() + d, 1);
  return RefArray(shape, x.data);
}

RefArray flatten(const RefArray& x, int64_t start_dim, int64_t end_dim) {
  if (x.dim() == 0) return RefArray({1}, x.data);
  int64_t s = wrap_dim(start_dim, x.dim()), e = wrap_dim(end_dim, x.dim());
  Shape shape(x.shape.begin(), x.shape.begin() + s);
  int64_t merged = 1;
  for (int64_t d = s; d <= e; ++d) merged *= x.shape[d];
  shape.push_back(merged);
  shape.insert(shape.end(), x.shape.begin() + e + 1, x.shape.end());
  return RefArray(shape, x.data);
}

RefArray as_strided(const RefArray& x, const Shape& shape, const Shape& strides, int64_t offset) {
  RefArray out = RefArray::filled(shape, 0.0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Index idx = unravel(i, shape);
    int64_t pos = offset;
    for (size_t d = 0; d < idx.size(); ++d) pos += idx[d] * strides[d];
    require(pos >= 0 && pos < x.numel(), "as_strided reads outside the array");
    out.data[i] = x.data[pos];
  }
  return out;
}

}  // namespace rd::ref
