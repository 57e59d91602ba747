// Tensor: shared storage plus shape, strides and offset, with reverse-mode autograd state.
// Views share storage; ops live in ops.h, creation functions at the end of this file.
#pragma once

#include <concepts>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"

namespace rd {

using Shape = std::vector<int64_t>;

namespace autograd {
class Node;
struct LeafHooks;
}

// A block of memory on one device. Owning storage returns its bytes to the device's
// allocator; from_blob storage wraps user memory and calls the optional deleter.
class Storage {
 public:
  using Deleter = void (*)(void* ptr, void* context);
  Storage(size_t nbytes, Device device);  // allocates from allocator_for(device)
  Storage(void* data, size_t nbytes, Device device, Deleter deleter, void* context);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  // True when the device's memory pool owns the bytes (not from_blob user memory).
  bool pool_owned() const { return owned_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  bool owned_ = true;
  Deleter deleter_ = nullptr;
  void* context_ = nullptr;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::kFloat32;

  // Autograd state. A leaf has no grad_fn; gradients accumulate into `grad` of leaves that
  // require grad. `grad_accumulator` is shared by every use of the leaf in a graph.
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<autograd::Node> grad_fn;
  int output_nr = 0;  // which output of grad_fn this tensor is
  std::weak_ptr<autograd::Node> grad_accumulator;
  // What backward calls after accumulating into `grad` (autograd.h's
  // register_post_accumulate_grad_hook); null while there are none.
  std::shared_ptr<autograd::LeafHooks> post_accumulate_hooks;
};

struct TensorOptions {
  DType dtype = DType::kFloat32;
  Device device = Device::cpu();
  bool requires_grad = false;

  TensorOptions() = default;
  TensorOptions(DType d) : dtype(d) {}  // NOLINT: rd::zeros({2}, DType::kInt64) reads well
  TensorOptions with_dtype(DType d) const { auto o = *this; o.dtype = d; return o; }
  TensorOptions with_device(Device d) const { auto o = *this; o.device = d; return o; }
  TensorOptions with_requires_grad(bool r) const { auto o = *this; o.requires_grad = r; return o; }
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  // True when both handles refer to the same tensor object (not just equal values).
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  // --- metadata ---
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t dim) const;    // negative dims count from the end
  int64_t stride(int64_t dim) const;
  int64_t offset() const;
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const;
  std::string str() const;  // e.g. "Tensor(float32, cpu, [2, 3])"

  // --- data access (CPU tensors) ---
  void* raw_data() const;  // pointer to element [0, ..., 0]
  template <class T>
  T* data_ptr() const;  // checks that T matches dtype()
  template <class T>
  std::vector<T> to_vector() const;  // copies to the host in logical (row-major) order
  template <class T>
  T item() const;  // the single element of a 1-element tensor, converted to T

  // --- views: never copy ---
  Tensor view(Shape shape) const;  // needs compatible strides; one dim may be -1
  Tensor reshape(Shape shape) const;  // a view when possible, else a contiguous copy
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(std::vector<int64_t> dims) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor t() const;  // transpose of a 2-D tensor
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(Shape shape) const;  // -1 keeps a dim; new leading dims allowed
  Tensor expand_as(const Tensor& other) const { return expand(other.shape()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor as_strided(Shape shape, Shape strides, std::optional<int64_t> offset = {}) const;

  // --- copies ---
  Tensor contiguous() const;  // self if already contiguous
  Tensor clone() const;
  Tensor to(DType dtype) const;  // self if already that dtype
  Tensor to(Device device) const;  // self if already there

  // --- in-place (not recorded by autograd; refused on tensors that need grad tracking) ---
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }
  Tensor& copy_(const Tensor& src);  // src broadcasts to self; dtype converts
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(double value);

  // --- autograd ---
  bool requires_grad() const;
  Tensor& set_requires_grad(bool requires_grad);  // only on leaves
  bool is_leaf() const;
  Tensor grad() const;  // undefined until a backward pass reaches this leaf
  void set_grad(const Tensor& grad);
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  // Backpropagates from this tensor. A non-scalar needs `gradient` of the same shape.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  void zero_grad();  // drops the accumulated gradient
  Tensor detach() const;  // shares storage, no grad_fn, requires_grad false

 private:
  const TensorImpl& checked() const;
  Tensor view_as_reshape_of_same_layout(const Shape& shape) const;
  std::shared_ptr<TensorImpl> impl_;
};

// --- creation ---
Tensor empty(Shape shape, TensorOptions options = {});
Tensor zeros(Shape shape, TensorOptions options = {});
Tensor ones(Shape shape, TensorOptions options = {});
Tensor full(Shape shape, double value, TensorOptions options = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// [start, end) with step; the count is ceil((end - start) / step). As in torch.arange, the
// dtype defaults to float32 when a bound or the step is floating, and to int64 when all are
// integers: arange(5) and arange(0, n) (any integer types) are int64, arange(0.0, n) is
// float32. Options may name any dtype.
Tensor arange(double start, double end, double step = 1.0, TensorOptions options = {});
Tensor arange(int64_t end, TensorOptions options = DType::kInt64);
template <class T>
concept ArangeInteger = std::integral<T> && !std::same_as<T, bool>;
// arange with integer bounds (the templates below forward here): the count is exact; the
// values are exact while they stay within +-2^53 (they are generated in float64).
Tensor integer_arange(int64_t start, int64_t end, int64_t step, TensorOptions options);
template <ArangeInteger S, ArangeInteger E>
Tensor arange(S start, E end, TensorOptions options = DType::kInt64) {
  return integer_arange(static_cast<int64_t>(start), static_cast<int64_t>(end), 1, options);
}
template <ArangeInteger S, ArangeInteger E, ArangeInteger P>
Tensor arange(S start, E end, P step, TensorOptions options = DType::kInt64) {
  return integer_arange(static_cast<int64_t>(start), static_cast<int64_t>(end),
                        static_cast<int64_t>(step), options);
}
// Uniform in [0, 1) and standard normal, from `gen`, which advances by numel().
Tensor rand(Shape shape, Generator& gen, TensorOptions options = {});
Tensor randn(Shape shape, Generator& gen, TensorOptions options = {});
// Wraps user memory without copying; the memory must outlive the tensor. Strides default
// to contiguous. The optional deleter runs when the last view is gone.
Tensor from_blob(void* data, Shape shape, DType dtype, Shape strides = {},
                 Device device = Device::cpu(), Storage::Deleter deleter = nullptr,
                 void* deleter_context = nullptr);
// Copies `values` into a new contiguous CPU tensor. Defined for float, double and int64_t
// (plus int32_t, bool-as-uint8_t is not offered: use a comparison).
template <class T>
Tensor from_vector(std::vector<T> values, std::vector<int64_t> shape);
// A 0-dim tensor holding `value`.
Tensor scalar_tensor(double value, TensorOptions options = {});

// --- printing (tensor/print.cc) ---
// How to_string() shows values, as torch.set_printoptions.
struct PrintOptions {
  int precision = 4;          // digits after the point of floating values
  int64_t threshold = 1000;   // more elements than this are summarized with "..."
  int64_t edge_items = 3;     // elements kept at each end of a summarized dim
  int64_t line_width = 80;    // a row of values wraps beyond this many characters
};
// A header line (str(), plus requires_grad when set) and the values in nested brackets,
// like PyTorch's repr, for every dtype; CUDA tensors are copied to the host (only the
// elements shown, when summarized), which waits for the device's queued work.
std::string to_string(const Tensor& t, const PrintOptions& options = {});
std::ostream& operator<<(std::ostream& os, const Tensor& t);

// The DType of a C++ element type; a compile error for unsupported types.
template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <> constexpr DType dtype_of<double>() { return DType::kFloat64; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::kBFloat16; }
template <> constexpr DType dtype_of<Float16>() { return DType::kFloat16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kInt32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kInt64; }
template <> constexpr DType dtype_of<bool>() { return DType::kBool; }

}  // namespace rd
