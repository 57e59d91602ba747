// Tensor: storage, metadata, views (each with its backward), copies and creation.
#include "ringdilated/tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

#if defined(RD_WITH_CUDA)
#include "ringdilated/kernels/cuda/transfer.h"
#endif

namespace rd {

// ---------------------------------------------------------------------------------------
// Storage

Storage::Storage(size_t nbytes, Device device)
    : data_(allocator_for(device).allocate(nbytes)), nbytes_(nbytes), device_(device) {}

Storage::Storage(void* data, size_t nbytes, Device device, Deleter deleter, void* context)
    : data_(data),
      nbytes_(nbytes),
      device_(device),
      owned_(false),
      deleter_(deleter),
      context_(context) {}

Storage::~Storage() {
  // The pool or a user's deleter may throw (a failed CUDA call, a foreign pointer); that must
  // not end the process from a destructor, so it is logged and the block leaked.
  if (owned_) {
    release_in_destructor("Storage: returning its memory to the pool", [&] {
      allocator_for(device_).deallocate(data_);
    });
  } else if (deleter_ != nullptr) {
    release_in_destructor("Storage: the deleter of a from_blob tensor",
                          [&] { deleter_(data_, context_); });
  }
}

// ---------------------------------------------------------------------------------------
// Metadata

namespace {

std::shared_ptr<TensorImpl> new_impl(std::shared_ptr<Storage> storage, Shape shape,
                                     Shape strides, int64_t offset, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return impl;
}

// A tensor sharing `base`'s storage with new geometry. Autograd is the caller's business.
Tensor alias(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  return Tensor(new_impl(base.storage(), std::move(shape), std::move(strides), offset,
                         base.dtype()));
}

// Refuses in-place writes that would silently corrupt autograd's saved values.
void check_inplace_allowed(const Tensor& t, const char* op) {
  RD_CHECK(!(autograd::grad_enabled() && t.requires_grad()), kAutograd, op,
           ": in-place write to a tensor that requires grad; wrap it in rd::autograd::NoGradGuard "
           "or detach() it first");
}

}  // namespace

const TensorImpl& Tensor::checked() const {
  RD_CHECK(impl_ != nullptr, kInvalidArgument, "Tensor: operation on an undefined tensor");
  return *impl_;
}

const Shape& Tensor::shape() const { return checked().shape; }
const Shape& Tensor::strides() const { return checked().strides; }
int64_t Tensor::size(int64_t dim) const {
  return shape()[normalize_dim(dim, this->dim(), "Tensor::size")];
}
int64_t Tensor::stride(int64_t dim) const {
  return strides()[normalize_dim(dim, this->dim(), "Tensor::stride")];
}
int64_t Tensor::offset() const { return checked().offset; }
int64_t Tensor::numel() const { return shape_numel(shape()); }
DType Tensor::dtype() const { return checked().dtype; }
Device Tensor::device() const { return checked().storage->device(); }
const std::shared_ptr<Storage>& Tensor::storage() const { return checked().storage; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element can be out of place
  int64_t expected = 1;
  for (size_t d = shape().size(); d-- > 0;) {
    if (shape()[d] != 1 && strides()[d] != expected) return false;
    expected *= shape()[d];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return str_cat("Tensor(", dtype_name(dtype()), ", ", device().str(), ", ",
                      shape_str(shape()), ")");
}

void* Tensor::raw_data() const {
  const TensorImpl& impl = checked();
  if (impl.storage->data() == nullptr) return nullptr;
  return static_cast<char*>(impl.storage->data()) +
         impl.offset * static_cast<int64_t>(dtype_size(impl.dtype));
}

template <class T>
T* Tensor::data_ptr() const {
  RD_CHECK(dtype() == dtype_of<T>(), kDTypeMismatch, "data_ptr: requested ",
           dtype_name(dtype_of<T>()), " but the tensor is ", dtype_name(dtype()));
  return static_cast<T*>(raw_data());
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = to(Device::cpu()).to(dtype_of<T>()).contiguous();
  const T* p = host.data_ptr<T>();
  return std::vector<T>(p, p + host.numel());
}

template <class T>
T Tensor::item() const {
  RD_CHECK(numel() == 1, kInvalidArgument, "item: the tensor must have exactly one element, got shape ",
           shape_str(shape()));
  return to_vector<T>()[0];
}

#define RD_INSTANTIATE_ACCESSORS(T)                   \
  template T* Tensor::data_ptr<T>() const;            \
  template std::vector<T> Tensor::to_vector<T>() const; \
  template T Tensor::item<T>() const;
RD_INSTANTIATE_ACCESSORS(float)
RD_INSTANTIATE_ACCESSORS(double)
RD_INSTANTIATE_ACCESSORS(BFloat16)
RD_INSTANTIATE_ACCESSORS(Float16)
RD_INSTANTIATE_ACCESSORS(int32_t)
RD_INSTANTIATE_ACCESSORS(int64_t)
RD_INSTANTIATE_ACCESSORS(bool)
#undef RD_INSTANTIATE_ACCESSORS

// ---------------------------------------------------------------------------------------
// Views

namespace {

// Strides that let `new_shape` view memory laid out as (old_shape, old_strides), or
// nullopt. Dims are grouped into runs that are contiguous with each other; each run of the
// old shape must be split or merged exactly by the new one.
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides,
                                  const Shape& new_shape) {
  if (old_shape.empty() || shape_numel(old_shape) == 0) return contiguous_strides(new_shape);
  Shape new_strides(new_shape.size());
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_shape.size()) - 1; tensor_d >= 0;
       --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    bool run_ends = tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                                      old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
    if (!run_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
      new_strides[view_d] = view_numel * chunk_base_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (tensor_d > 0) {
      chunk_base_stride = old_strides[tensor_d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

// Resolves one -1 entry and checks the element count against `numel`.
Shape infer_shape(Shape shape, const Shape& input_shape, const char* op) {
  int64_t numel = shape_numel(input_shape);
  int64_t infer_at = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      RD_CHECK(infer_at < 0, kInvalidArgument, op, ": only one dim may be -1, got ",
               shape_str(shape));
      infer_at = static_cast<int64_t>(i);
    } else {
      RD_CHECK(shape[i] >= 0, kInvalidArgument, op, ": invalid size in ", shape_str(shape));
      RD_CHECK(!__builtin_mul_overflow(known, shape[i], &known), kInvalidArgument, op, ": shape ",
               shape_str(shape), " has more than 2^63 - 1 elements");
    }
  }
  if (infer_at >= 0) {
    RD_CHECK(known != 0 && numel % known == 0, kShapeMismatch, op, ": shape ",
             shape_str(shape), " is invalid for an input of shape ", shape_str(input_shape),
             " (", numel, " elements)");
    shape[infer_at] = numel / known;
  } else {
    RD_CHECK(known == numel, kShapeMismatch, op, ": shape ", shape_str(shape),
             " is invalid for an input of shape ", shape_str(input_shape), " (", numel,
             " elements)");
  }
  return shape;
}

// Records `out` as a view of `base` whose gradient is `grad.reshape(base.shape())`.
void record_reshape_view(const Tensor& out, const Tensor& base, const char* name) {
  if (!autograd::needs_grad({&base})) return;
  Shape base_shape = base.shape();
  autograd::record(out, name, {base}, [base_shape](const Tensor& g) -> std::vector<Tensor> {
    return {g.reshape(base_shape)};
  });
}

// Gradient of a view that picks a sub-block of `base`: zeros of base's shape with `grad`
// written through the same view.
template <class PickFn>
void record_pick_view(const Tensor& out, const Tensor& base, const char* name, PickFn pick) {
  if (!autograd::needs_grad({&base})) return;
  Shape shape = base.shape();
  DType dtype = base.dtype();
  Device device = base.device();
  autograd::record(out, name, {base}, [=](const Tensor& g) -> std::vector<Tensor> {
    Tensor grad_base = zeros(shape, TensorOptions(dtype).with_device(device));
    pick(grad_base).copy_(g);
    return {grad_base};
  });
}

}  // namespace

Tensor Tensor::view(Shape shape) const {
  shape = infer_shape(std::move(shape), this->shape(), "view");
  auto strides_or = view_strides(this->shape(), strides(), shape);
  RD_CHECK(strides_or.has_value(), kShapeMismatch, "view: shape ", shape_str(shape),
           " is not compatible with the input's shape ", shape_str(this->shape()),
           " and strides ", shape_str(strides()), "; use reshape() to copy");
  Tensor out = alias(*this, shape, *strides_or, offset());
  record_reshape_view(out, *this, "view");
  return out;
}

Tensor Tensor::reshape(Shape shape) const {
  shape = infer_shape(std::move(shape), this->shape(), "reshape");
  if (view_strides(this->shape(), strides(), shape).has_value()) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  int64_t start = normalize_dim(start_dim, dim(), "flatten");
  int64_t end = normalize_dim(end_dim, dim(), "flatten");
  RD_CHECK(start <= end, kInvalidArgument, "flatten: start_dim ", start_dim,
           " comes after end_dim ", end_dim);
  Shape shape(this->shape().begin(), this->shape().begin() + start);
  int64_t merged = 1;
  for (int64_t d = start; d <= end; ++d) merged *= this->shape()[d];
  shape.push_back(merged);
  shape.insert(shape.end(), this->shape().begin() + end + 1, this->shape().end());
  return reshape(shape);
}

Tensor Tensor::permute(std::vector<int64_t> dims) const {
  RD_CHECK(static_cast<int64_t>(dims.size()) == dim(), kInvalidArgument, "permute: dims ",
           shape_str(dims), " do not match a tensor of ", dim(), " dims");
  std::vector<bool> seen(dims.size(), false);
  Shape shape(dims.size()), strides(dims.size());
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = normalize_dim(dims[i], dim(), "permute");
    RD_CHECK(!seen[d], kInvalidArgument, "permute: dims ", shape_str(dims),
             " repeat dim ", d);
    seen[d] = true;
    shape[i] = this->shape()[d];
    strides[i] = this->strides()[d];
    inverse[d] = static_cast<int64_t>(i);
  }
  Tensor out = alias(*this, shape, strides, offset());
  if (autograd::needs_grad({this})) {
    autograd::record(out, "permute", {*this}, [inverse](const Tensor& g) -> std::vector<Tensor> {
      return {g.permute(inverse)};
    });
  }
  return out;
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  if (dim() == 0) return *this;
  std::vector<int64_t> dims(dim());
  for (int64_t d = 0; d < dim(); ++d) dims[d] = d;
  std::swap(dims[normalize_dim(dim0, dim(), "transpose")],
            dims[normalize_dim(dim1, dim(), "transpose")]);
  return permute(dims);
}

Tensor Tensor::t() const {
  RD_CHECK(dim() <= 2, kInvalidArgument, "t: expects a tensor of at most 2 dims, got shape ",
           shape_str(shape()));
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::slice(int64_t dim, int64_t start, int64_t end, int64_t step) const {
  int64_t d = normalize_dim(dim, this->dim(), "slice");
  RD_CHECK(this->dim() > 0, kInvalidArgument, "slice: cannot slice a 0-dim tensor");
  RD_CHECK(step > 0, kInvalidArgument, "slice: step must be positive, got ", step);
  int64_t size = shape()[d];
  // Python-style clamping: negative indices count from the end, out-of-range ones clamp.
  auto clamp_index = [size](int64_t i) {
    if (i < 0) i += size;
    return std::clamp<int64_t>(i, 0, size);
  };
  start = clamp_index(start);
  end = std::max(clamp_index(end), start);
  Shape shape = this->shape(), strides = this->strides();
  shape[d] = (end - start + step - 1) / step;
  strides[d] *= step;
  Tensor out = alias(*this, shape, strides, offset() + start * this->strides()[d]);
  record_pick_view(out, *this, "slice", [=](const Tensor& base) {
    return base.slice(d, start, end, step);
  });
  return out;
}

Tensor Tensor::narrow(int64_t dim, int64_t start, int64_t length) const {
  int64_t d = normalize_dim(dim, this->dim(), "narrow");
  RD_CHECK(this->dim() > 0, kInvalidArgument, "narrow: cannot narrow a 0-dim tensor");
  int64_t size = shape()[d];
  if (start < 0) start += size;
  RD_CHECK(start >= 0 && length >= 0 && start + length <= size, kOutOfRange, "narrow: start ",
           start, " and length ", length, " exceed dim ", d, " of size ", size, " (shape ",
           shape_str(shape()), ")");
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t dim, int64_t index) const {
  RD_CHECK(this->dim() > 0, kInvalidArgument, "select: cannot select from a 0-dim tensor");
  int64_t d = normalize_dim(dim, this->dim(), "select");
  int64_t size = shape()[d];
  RD_CHECK(index >= -size && index < size, kOutOfRange, "select: index ", index,
           " is out of range for dim ", d, " of size ", size, " (shape ", shape_str(shape()),
           ")");
  if (index < 0) index += size;
  Shape shape = this->shape(), strides = this->strides();
  int64_t offset = this->offset() + index * strides[d];
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  Tensor out = alias(*this, shape, strides, offset);
  record_pick_view(out, *this, "select", [=](const Tensor& base) {
    return base.select(d, index);
  });
  return out;
}

Tensor Tensor::expand(Shape shape) const {
  RD_CHECK(shape.size() >= this->shape().size(), kShapeMismatch, "expand: target shape ",
           shape_str(shape), " has fewer dims than the input ", shape_str(this->shape()));
  size_t lead = shape.size() - this->shape().size();
  Shape strides(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      RD_CHECK(shape[i] >= 0, kInvalidArgument, "expand: new leading dim ", i,
               " must have a non-negative size, got ", shape_str(shape));
      continue;
    }
    int64_t in_size = this->shape()[i - lead];
    if (shape[i] == -1) shape[i] = in_size;
    if (shape[i] == in_size) {
      strides[i] = this->strides()[i - lead];
    } else {
      RD_CHECK(in_size == 1, kShapeMismatch, "expand: cannot expand shape ",
               shape_str(this->shape()), " to ", shape_str(shape), " (dim ", i, ")");
    }
  }
  shape_numel(shape, "expand");  // the view's element count must fit, as a new tensor's
  Tensor out = alias(*this, shape, strides, offset());
  if (autograd::needs_grad({this})) {
    Shape in_shape = this->shape();
    autograd::record(out, "expand", {*this}, [in_shape](const Tensor& g) -> std::vector<Tensor> {
      // Sum over the broadcast dims: new leading dims and dims expanded from size 1.
      size_t lead_dims = g.shape().size() - in_shape.size();
      std::vector<int64_t> dims;
      for (size_t i = 0; i < g.shape().size(); ++i) {
        if (i < lead_dims || (in_shape[i - lead_dims] == 1 && g.shape()[i] != 1)) {
          dims.push_back(static_cast<int64_t>(i));
        }
      }
      if (dims.empty()) return {g.reshape(in_shape)};
      return {sum(g, dims, /*keepdim=*/true).reshape(in_shape)};
    });
  }
  return out;
}

Tensor Tensor::squeeze() const {
  Shape shape;
  for (int64_t s : this->shape()) {
    if (s != 1) shape.push_back(s);
  }
  return view_as_reshape_of_same_layout(shape);
}

Tensor Tensor::squeeze(int64_t dim) const {
  if (this->dim() == 0) return view({});
  int64_t d = normalize_dim(dim, this->dim(), "squeeze");
  if (shape()[d] != 1) return view(shape());
  Shape shape = this->shape();
  shape.erase(shape.begin() + d);
  return view_as_reshape_of_same_layout(shape);
}

Tensor Tensor::unsqueeze(int64_t dim) const {
  int64_t d = normalize_dim(dim, this->dim() + 1, "unsqueeze");
  Shape shape = this->shape();
  shape.insert(shape.begin() + d, 1);
  return view_as_reshape_of_same_layout(shape);
}

Tensor Tensor::view_as_reshape_of_same_layout(const Shape& shape) const {
  // Adding or dropping size-1 dims never needs a copy: keep every other stride as is.
  Shape strides;
  size_t j = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    while (j < this->shape().size() && this->shape()[j] == 1 && shape[i] != 1) ++j;
    if (j < this->shape().size() && this->shape()[j] == shape[i]) {
      strides.push_back(this->strides()[j]);
      ++j;
    } else {
      strides.push_back(1);  // an inserted size-1 dim; its stride never matters
    }
  }
  Tensor out = alias(*this, shape, strides, offset());
  record_reshape_view(out, *this, "view");
  return out;
}

Tensor Tensor::as_strided(Shape shape, Shape strides, std::optional<int64_t> offset) const {
  RD_CHECK(shape.size() == strides.size(), kInvalidArgument, "as_strided: shape ",
           shape_str(shape), " and strides ", shape_str(strides), " differ in length");
  check_new_shape(shape, "as_strided");
  int64_t new_offset = offset.value_or(this->offset());
  int64_t storage_elems =
      static_cast<int64_t>(storage()->nbytes() / dtype_size(dtype()));
  for (int64_t s : strides) {
    RD_CHECK(s >= 0, kInvalidArgument, "as_strided: strides must be non-negative, got ",
             shape_str(strides));
  }
  int64_t last = last_element_offset(shape, strides, "as_strided");
  RD_CHECK(last < 0 || !__builtin_add_overflow(last, new_offset, &last), kInvalidArgument,
           "as_strided: offset ", new_offset, " past the last element of shape ", shape_str(shape),
           " with strides ", shape_str(strides), " passes 2^63 - 1");
  RD_CHECK(new_offset >= 0 && last < storage_elems, kOutOfRange, "as_strided: shape ",
           shape_str(shape), ", strides ", shape_str(strides), " and offset ", new_offset,
           " reach element ", last, " but the storage holds ", storage_elems);
  Tensor out = alias(*this, shape, strides, new_offset);
  if (autograd::needs_grad({this})) {
    Tensor input_geometry = alias(*this, this->shape(), this->strides(), this->offset());
    autograd::record(out, "as_strided", {*this},
                     [=](const Tensor& g) -> std::vector<Tensor> {
      // Scatter-add the gradient into a buffer laid out like the storage, then read it back
      // through the input's geometry. Overlapping output elements add up.
      Tensor buffer = zeros({storage_elems}, TensorOptions(g.dtype()).with_device(g.device()));
      Tensor through_out = buffer.as_strided(shape, strides, new_offset);
      backend_for(g.device()).accumulate(kernel_view(through_out, "as_strided"),
                                         kernel_view(g, "as_strided"));
      return {buffer
                  .as_strided(input_geometry.shape(), input_geometry.strides(),
                              input_geometry.offset())
                  .contiguous()};
    });
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Copies

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), TensorOptions(dtype()).with_device(device()));
  backend_for(device()).copy(kernel_view(out, "clone"), kernel_view(*this, "clone"));
  if (autograd::needs_grad({this})) {
    autograd::record(out, "clone", {*this}, [](const Tensor& g) -> std::vector<Tensor> {
      return {g};
    });
  }
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == this->dtype()) return *this;
  Tensor out = empty(shape(), TensorOptions(dtype).with_device(device()));
  backend_for(device()).copy(kernel_view(out, "to"), kernel_view(*this, "to"));
  if (is_floating(dtype) && autograd::needs_grad({this})) {
    DType source = this->dtype();
    autograd::record(out, "to_dtype", {*this}, [source](const Tensor& g) -> std::vector<Tensor> {
      return {g.to(source)};
    });
  }
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
#if defined(RD_WITH_CUDA)
  Tensor source;
  {
    // The node recorded below covers the whole move; contiguous() must not add its own.
    autograd::NoGradGuard no_grad;
    source = contiguous();
  }
  Tensor out = empty(shape(), TensorOptions(dtype()).with_device(device));
  kernels::cuda::copy_bytes(out.raw_data(), device, source.raw_data(), source.device(),
                            static_cast<size_t>(numel()) * dtype_size(dtype()));
  if (autograd::needs_grad({this})) {
    const Device origin = this->device();
    autograd::record(out, "to_device", {*this}, [origin](const Tensor& g) {
      return std::vector<Tensor>{g.to(origin)};
    });
  }
  return out;
#else
  backend_for(device);  // throws a clear error when this build lacks the device
  RD_FAIL(kUnimplemented, "to: copies between ", this->device().str(), " and ", device.str(),
          " are not implemented yet");
#endif
}

// ---------------------------------------------------------------------------------------
// In-place

Tensor& Tensor::fill_(double value) {
  check_inplace_allowed(*this, "fill_");
  backend_for(device()).fill(kernel_view(*this, "fill_"), value);
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace_allowed(*this, "copy_");
  check_same_device({this, &src}, "copy_");
  Tensor expanded = src.shape() == shape() ? src : src.expand(shape());
  backend_for(device()).copy(kernel_view(*this, "copy_"), kernel_view(expanded, "copy_"));
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace_allowed(*this, "add_");
  check_same_device({this, &other}, "add_");
  autograd::NoGradGuard no_grad;
  Tensor addend = alpha == 1.0 ? other.to(dtype()) : mul(other.to(dtype()), alpha);
  if (addend.shape() != shape()) addend = addend.expand(shape());
  backend_for(device()).accumulate(kernel_view(*this, "add_"), kernel_view(addend, "add_"));
  return *this;
}

Tensor& Tensor::mul_(double value) {
  check_inplace_allowed(*this, "mul_");
  Tensor factor = scalar_tensor(value, TensorOptions(dtype()).with_device(device()));
  kernels::StridedView self = kernel_view(*this, "mul_");
  backend_for(device()).binary(kernels::BinaryOp::kMul, self, self,
                               kernel_view(factor.expand(shape()), "mul_"));
  return *this;
}

// ---------------------------------------------------------------------------------------
// Autograd accessors

bool Tensor::requires_grad() const { return checked().requires_grad; }

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  RD_CHECK(is_leaf(), kAutograd,
           "set_requires_grad: only leaf tensors can change requires_grad; use detach() on ",
           str());
  RD_CHECK(!requires_grad || is_floating(dtype()), kDTypeMismatch,
           "set_requires_grad: only floating tensors can require grad, got ",
           dtype_name(dtype()));
  impl_->requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const { return checked().grad_fn == nullptr; }

Tensor Tensor::grad() const { return Tensor(checked().grad); }

void Tensor::set_grad(const Tensor& grad) {
  RD_CHECK(!grad.defined() || grad.shape() == shape(), kShapeMismatch, "set_grad: gradient shape ",
           shape_str(grad.shape()), " differs from the tensor's ", shape_str(shape()));
  impl_->grad = grad.impl_ptr();
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const { return checked().grad_fn; }

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph);
}

void Tensor::zero_grad() { checked(); impl_->grad.reset(); }

Tensor Tensor::detach() const {
  return alias(*this, shape(), strides(), offset());
}

// ---------------------------------------------------------------------------------------
// Creation

namespace {

// A new contiguous tensor of `shape`, uninitialized; errors name `op` (the creation function
// the caller called) and the shape.
Tensor new_tensor(const Shape& shape, TensorOptions options, const char* op) {
  check_new_shape(shape, op);
  const auto numel = static_cast<uint64_t>(shape_numel(shape, op));
  const size_t item = dtype_size(options.dtype);
  RD_CHECK(numel <= std::numeric_limits<size_t>::max() / item, kOutOfMemory, op, ": shape ",
           shape_str(shape), " of ", dtype_name(options.dtype), " needs ", numel, " x ", item,
           " bytes, more than the address space holds");
  std::shared_ptr<Storage> storage;
  try {
    storage = std::make_shared<Storage>(static_cast<size_t>(numel) * item, options.device);
  } catch (const Error& e) {
    // The allocator names bytes and its statistics; say which tensor asked for them.
    if (e.code() != ErrorCode::kOutOfMemory) throw;
    RD_FAIL(kOutOfMemory, op, ": shape ", shape_str(shape), " of ", dtype_name(options.dtype),
            ": ", e.what());
  }
  Tensor out(new_impl(std::move(storage), shape, contiguous_strides(shape), 0, options.dtype));
  if (options.requires_grad) out.set_requires_grad(true);
  return out;
}

Tensor filled(const Shape& shape, double value, TensorOptions options, const char* op) {
  bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor out = new_tensor(shape, options, op);
  out.fill_(value);
  if (requires_grad) out.set_requires_grad(true);
  return out;
}

}  // namespace

Tensor empty(Shape shape, TensorOptions options) { return new_tensor(shape, options, "empty"); }

Tensor full(Shape shape, double value, TensorOptions options) {
  return filled(shape, value, options, "full");
}

Tensor zeros(Shape shape, TensorOptions options) { return filled(shape, 0.0, options, "zeros"); }
Tensor ones(Shape shape, TensorOptions options) { return filled(shape, 1.0, options, "ones"); }

Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), TensorOptions(t.dtype()).with_device(t.device()));
}
Tensor zeros_like(const Tensor& t) { return full_like(t, 0.0); }
Tensor ones_like(const Tensor& t) { return full_like(t, 1.0); }
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, TensorOptions(t.dtype()).with_device(t.device()));
}

Tensor scalar_tensor(double value, TensorOptions options) { return full({}, value, options); }

Tensor arange(double start, double end, double step, TensorOptions options) {
  RD_CHECK(step != 0.0 && std::isfinite(step) && std::isfinite(start) && std::isfinite(end),
           kInvalidArgument, "arange: start ", start, ", end ", end, " and step ", step,
           " must be finite with a non-zero step");
  double count = std::ceil((end - start) / step);
  int64_t n = count > 0 ? static_cast<int64_t>(count) : 0;
  bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor out = empty({n}, options);
  backend_for(options.device).arange(kernel_view(out, "arange"), start, step);
  if (requires_grad) out.set_requires_grad(true);
  return out;
}

Tensor arange(int64_t end, TensorOptions options) { return integer_arange(0, end, 1, options); }

Tensor integer_arange(int64_t start, int64_t end, int64_t step, TensorOptions options) {
  RD_CHECK(step != 0, kInvalidArgument, "arange: start ", start, ", end ", end, " and step ",
           step, " need a non-zero step");
  // ceil((end - start) / step) without overflow or rounding: the distance in the step's
  // direction, then a ceiling division.
  const bool forward = step > 0;
  const uint64_t distance = forward ? static_cast<uint64_t>(end) - static_cast<uint64_t>(start)
                                    : static_cast<uint64_t>(start) - static_cast<uint64_t>(end);
  const uint64_t stride = forward ? static_cast<uint64_t>(step) : -static_cast<uint64_t>(step);
  const bool empty_range = forward ? end <= start : end >= start;
  const int64_t n = empty_range ? 0 : static_cast<int64_t>((distance - 1) / stride + 1);
  bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor out = empty({n}, options);
  backend_for(options.device)
      .arange(kernel_view(out, "arange"), static_cast<double>(start), static_cast<double>(step));
  if (requires_grad) out.set_requires_grad(true);
  return out;
}

namespace {
Tensor random_tensor(Shape shape, Generator& gen, TensorOptions options,
                     kernels::Distribution dist, const char* op) {
  RD_CHECK(is_floating(options.dtype), kDTypeMismatch, op, ": dtype must be floating, got ",
           dtype_name(options.dtype));
  bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor out = empty(std::move(shape), options);
  uint64_t offset = gen.advance(static_cast<uint64_t>(out.numel()));
  backend_for(options.device).random(kernel_view(out, op), dist, 0.0, 1.0, gen.seed(), offset);
  if (requires_grad) out.set_requires_grad(true);
  return out;
}
}  // namespace

Tensor rand(Shape shape, Generator& gen, TensorOptions options) {
  return random_tensor(std::move(shape), gen, options, kernels::Distribution::kUniform, "rand");
}

Tensor randn(Shape shape, Generator& gen, TensorOptions options) {
  return random_tensor(std::move(shape), gen, options, kernels::Distribution::kNormal, "randn");
}

Tensor from_blob(void* data, Shape shape, DType dtype, Shape strides, Device device,
                 Storage::Deleter deleter, void* deleter_context) {
  check_new_shape(shape, "from_blob");
  if (strides.empty()) strides = contiguous_strides(shape);
  RD_CHECK(strides.size() == shape.size(), kInvalidArgument, "from_blob: shape ",
           shape_str(shape), " and strides ", shape_str(strides), " differ in length");
  for (int64_t s : strides) {
    RD_CHECK(s >= 0, kInvalidArgument, "from_blob: strides must be non-negative, got ",
             shape_str(strides));
  }
  const int64_t extent = last_element_offset(shape, strides, "from_blob") + 1;
  RD_CHECK(static_cast<uint64_t>(extent) <= std::numeric_limits<size_t>::max() / dtype_size(dtype),
           kInvalidArgument, "from_blob: shape ", shape_str(shape), " with strides ",
           shape_str(strides), " of ", dtype_name(dtype), " spans more bytes than memory holds");
  RD_CHECK(data != nullptr || extent == 0, kInvalidArgument,
           "from_blob: null data for a non-empty shape ", shape_str(shape));
  auto storage = std::make_shared<Storage>(data, static_cast<size_t>(extent) * dtype_size(dtype),
                                           device, deleter, deleter_context);
  return Tensor(new_impl(std::move(storage), std::move(shape), std::move(strides), 0, dtype));
}

template <class T>
Tensor from_vector(std::vector<T> values, std::vector<int64_t> shape) {
  check_new_shape(shape, "from_vector");
  RD_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), kShapeMismatch,
           "from_vector: ", values.size(), " values do not fill shape ", shape_str(shape), " (",
           shape_numel(shape), " elements)");
  Tensor out = empty(shape, dtype_of<T>());
  if (!values.empty()) std::memcpy(out.raw_data(), values.data(), values.size() * sizeof(T));
  return out;
}

template Tensor from_vector<float>(std::vector<float>, std::vector<int64_t>);
template Tensor from_vector<double>(std::vector<double>, std::vector<int64_t>);
template Tensor from_vector<int64_t>(std::vector<int64_t>, std::vector<int64_t>);
template Tensor from_vector<int32_t>(std::vector<int32_t>, std::vector<int64_t>);

}  // namespace rd
