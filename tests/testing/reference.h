// Independent float64 reference implementations of the tensor ops, as plain loops over a
// tiny row-major array. It deliberately shares no code with the library under test.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace rd::ref {

using Shape = std::vector<int64_t>;
using Index = std::vector<int64_t>;

int64_t numel_of(const Shape& shape);
// The multi-index of row-major position `flat`, and back.
Index unravel(int64_t flat, const Shape& shape);
int64_t ravel(const Index& index, const Shape& shape);
// Maps a possibly negative dim into [0, ndim).
int64_t wrap_dim(int64_t dim, int64_t ndim);
std::vector<int64_t> wrap_dims(const std::vector<int64_t>& dims, int64_t ndim);

// A dense row-major array of doubles: the reference's only data type. Integer and bool
// values are stored exactly as doubles.
struct RefArray {
  Shape shape;
  std::vector<double> data;

  RefArray() = default;
  RefArray(Shape s, std::vector<double> values);  // values.size() must equal numel
  static RefArray filled(Shape s, double value);

  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  double at(const Index& index) const { return data[ravel(index, shape)]; }
  double& at(const Index& index) { return data[ravel(index, shape)]; }
};

// --- elementwise ---
Shape broadcast_shapes(const Shape& a, const Shape& b);
RefArray broadcast_to(const RefArray& x, const Shape& shape);
RefArray map(const RefArray& x, const std::function<double(double)>& f);
RefArray zip(const RefArray& a, const RefArray& b, const std::function<double(double, double)>& f);
RefArray where(const RefArray& cond, const RefArray& a, const RefArray& b);

double sigmoid(double x);
double gelu_erf(double x);
double gelu_tanh(double x);
double silu(double x);

// --- reductions: over `dims` (empty means all) ---
using ReduceFn = std::function<double(const std::vector<double>&)>;
// Applies f to the values of each reduced group, visited in row-major order.
RefArray reduce(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim,
                const ReduceFn& f);
RefArray sum(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim);
RefArray mean(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim);
RefArray max(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim);
RefArray min(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim);
RefArray logsumexp(const RefArray& x, const std::vector<int64_t>& dims, bool keepdim);
RefArray var(const RefArray& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim);
// Index of the first maximum / minimum along dim.
RefArray argmax(const RefArray& x, int64_t dim, bool keepdim);
RefArray argmin(const RefArray& x, int64_t dim, bool keepdim);

// --- functions of whole lines along one dim (a 0-dim array is one line of length 1) ---
using LineFn = std::function<std::vector<double>(const std::vector<double>&)>;
RefArray along_dim(const RefArray& x, int64_t dim, const LineFn& f);
RefArray softmax(const RefArray& x, int64_t dim);
RefArray log_softmax(const RefArray& x, int64_t dim);
RefArray cumsum(const RefArray& x, int64_t dim);

// --- linear algebra ---
RefArray matmul(const RefArray& a, const RefArray& b);  // NumPy semantics
RefArray bmm(const RefArray& a, const RefArray& b);
// x [..., in] times weight [out, in] transposed, plus bias [out] when given.
RefArray linear(const RefArray& x, const RefArray& weight, const std::optional<RefArray>& bias);

// --- neural-network ops ---
RefArray layer_norm(const RefArray& x, const Shape& normalized_shape,
                    const std::optional<RefArray>& weight, const std::optional<RefArray>& bias,
                    double eps);
RefArray rms_norm(const RefArray& x, const Shape& normalized_shape,
                  const std::optional<RefArray>& weight, double eps);
// Residual add fused with a norm: returns {norm(x + residual), x + residual}; x and residual
// have the same shape.
std::vector<RefArray> add_layer_norm(const RefArray& x, const RefArray& residual,
                                     const Shape& normalized_shape,
                                     const std::optional<RefArray>& weight,
                                     const std::optional<RefArray>& bias, double eps);
std::vector<RefArray> add_rms_norm(const RefArray& x, const RefArray& residual,
                                   const Shape& normalized_shape,
                                   const std::optional<RefArray>& weight, double eps);
RefArray embedding(const RefArray& weight, const RefArray& indices);
// RoPE of x [B, T, H, D] ("rotate_half" pairs (i, i + D/2)), with the angle
// (position_offset + t) * base^(-2i/D) and its cos/sin in long double.
// q and k of a packed qkv [B, T, 3, H, D] rotated by rotary_embedding, v unchanged.
RefArray rotary_embedding_qkv(const RefArray& qkv, int64_t position_offset, double base);
// silu(gate) * up of the halves of x's last dim [..., 2H] (gate first).
RefArray swiglu(const RefArray& x);
RefArray rotary_embedding(const RefArray& x, int64_t position_offset, double base);
enum class Reduction { kNone, kMean, kSum };
RefArray cross_entropy(const RefArray& logits, const RefArray& targets, int64_t ignore_index,
                       Reduction reduction);

// --- joining, splitting, indexing ---
RefArray cat(const std::vector<RefArray>& xs, int64_t dim);
RefArray stack(const std::vector<RefArray>& xs, int64_t dim);
std::vector<RefArray> split(const RefArray& x, const std::vector<int64_t>& sizes, int64_t dim);
// The piece sizes of split(x, split_size) and chunk(x, chunks) along a dim of length n.
std::vector<int64_t> split_sizes(int64_t n, int64_t split_size);
std::vector<int64_t> chunk_sizes(int64_t n, int64_t chunks);
RefArray index_select(const RefArray& x, int64_t dim, const RefArray& index);
RefArray gather(const RefArray& x, int64_t dim, const RefArray& index);
RefArray scatter(const RefArray& x, int64_t dim, const RefArray& index, const RefArray& src);
RefArray scatter_add(const RefArray& x, int64_t dim, const RefArray& index, const RefArray& src);
RefArray masked_fill(const RefArray& x, const RefArray& mask, double value);
RefArray tril(const RefArray& x, int64_t k);
RefArray triu(const RefArray& x, int64_t k);

// --- shape ops (the values a view shows, as a fresh array) ---
RefArray permute(const RefArray& x, const std::vector<int64_t>& dims);
RefArray transpose(const RefArray& x, int64_t dim0, int64_t dim1);
RefArray slice(const RefArray& x, int64_t dim, int64_t start, int64_t end, int64_t step);
RefArray select(const RefArray& x, int64_t dim, int64_t index);
RefArray reshape(const RefArray& x, Shape shape);  // one dim may be -1
RefArray expand(const RefArray& x, Shape shape);   // -1 keeps a dim
RefArray squeeze(const RefArray& x);
RefArray squeeze(const RefArray& x, int64_t dim);
RefArray unsqueeze(const RefArray& x, int64_t dim);
RefArray flatten(const RefArray& x, int64_t start_dim, int64_t end_dim);
// Reads x's row-major data at offset + sum(index * strides).
RefArray as_strided(const RefArray& x, const Shape& shape, const Shape& strides, int64_t offset);

}  // namespace rd::ref
