// GradientBuckets: bucket layout, the per-parameter hooks that post full buckets during
// backward, and finish().
#include "ringdilated/nn/gradient_buckets.h"

#include <exception>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

constexpr const char* kOp = "GradientBuckets";

int64_t nbytes(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }

}  // namespace

GradientBuckets::GradientBuckets(std::vector<Tensor> params,
                                 std::shared_ptr<dist::Communicator> comm, int64_t bucket_bytes)
    : params_(std::move(params)), comm_(std::move(comm)) {
  RD_CHECK(comm_ != nullptr, kInvalidArgument, kOp, ": no communicator");
  RD_CHECK(bucket_bytes > 0, kInvalidArgument, kOp, ": bucket_bytes must be > 0, got ",
           bucket_bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    RD_CHECK(p.defined() && p.requires_grad() && p.grad_fn() == nullptr, kInvalidArgument, kOp,
             ": parameter ", i, " must be a leaf that requires grad, got ",
             p.defined() ? p.str() : std::string("an undefined tensor"));
    RD_CHECK(p.device() == comm_->device(), kDeviceMismatch, kOp, ": parameter ", i, " is on ",
             p.device().str(), " but the communicator on ", comm_->device().str());
    for (size_t j = 0; j < i; ++j) {
      RD_CHECK(!params_[j].is_same(p), kInvalidArgument, kOp, ": parameters ", j, " and ", i,
               " are the same tensor");
    }
  }
  // Reverse registration order: the order backward produces the gradients.
  bucket_of_.resize(params_.size());
  int64_t bucket_bytes_used = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k];
    const bool fits = !buckets_.empty() && bucket_bytes_used + nbytes(p) <= bucket_bytes &&
                      params_[buckets_.back().slots.front().param].dtype() == p.dtype();
    if (!fits) {
      buckets_.emplace_back();
      bucket_bytes_used = 0;
    }
    Bucket& b = buckets_.back();
    b.slots.push_back(Slot{k, b.numel});
    b.numel += p.numel();
    bucket_bytes_used += nbytes(p);
    bucket_of_[k] = buckets_.size() - 1;
  }
  produced_.assign(params_.size(), false);
  for (Bucket& b : buckets_) b.waiting = b.slots.size();
  hooks_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.push_back(autograd::register_post_accumulate_grad_hook(
        params_[i], [this, i](const Tensor&) { on_gradient(i); }));
  }
}

GradientBuckets::~GradientBuckets() = default;

void GradientBuckets::set_sync(bool sync) {
  RD_CHECK(next_to_post_ == 0, kInvalidArgument, kOp, ": set_sync(", sync ? "true" : "false",
           ") while ", next_to_post_, " bucket(s) of a synchronized backward are in flight; call "
           "finish() first");
  sync_ = sync;
}

std::vector<std::vector<size_t>> GradientBuckets::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const Bucket& b : buckets_) {
    std::vector<size_t>& indices = out.emplace_back();
    for (const Slot& s : b.slots) indices.push_back(s.param);
  }
  return out;
}

void GradientBuckets::on_gradient(size_t param) {
  if (!sync_) return;
  const size_t b = bucket_of_[param];
  // A second gradient after the bucket was posted would be missing from the sum, and one
  // before would count twice when the passes already sum locally: both are misuse.
  RD_CHECK(!produced_[param], kInvalidArgument, kOp, ": parameter ", param, " (",
           params_[param].str(), ") got a second gradient in one synchronized step; run one "
           "backward per step with sync on (set_sync(false) for the micro-batches before the "
           "last), then finish()");
  produced_[param] = true;
  if (--buckets_[b].waiting == 0) post_ready_buckets();
}

// Posts, in bucket order, every bucket from the next one on whose gradients are all in.
void GradientBuckets::post_ready_buckets() {
  while (next_to_post_ < buckets_.size() && buckets_[next_to_post_].waiting == 0) {
    post(buckets_[next_to_post_++]);
  }
}

void GradientBuckets::post(Bucket& bucket) {
  const Tensor& first = params_[bucket.slots.front().param];
  const Tensor flat = empty({bucket.numel}, TensorOptions(first.dtype()).with_device(first.device()));
  autograd::NoGradGuard no_grad;
  for (const Slot& s : bucket.slots) {
    Tensor p = params_[s.param];
    Tensor view = flat.narrow(0, s.offset, p.numel()).view(p.shape());
    const Tensor grad = p.grad();
    if (grad.defined()) {
      view.copy_(grad);
    } else {
      view.zero_();
    }
    // The old gradient goes now, not after the reduction: no second copy of the bucket stays.
    p.set_grad(view);
  }
  bucket.request = comm_->iall_reduce(flat);
}

void GradientBuckets::finish() {
  for (Bucket& b : buckets_) b.waiting = 0;  // whatever did not arrive counts as it is
  post_ready_buckets();
  // Every bucket is waited for, even after one failed, so that none is left in flight.
  std::exception_ptr error;
  for (Bucket& b : buckets_) {
    try {
      if (b.request != nullptr) b.request->wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    b.request.reset();
    b.waiting = b.slots.size();
  }
  produced_.assign(params_.size(), false);
  next_to_post_ = 0;
  if (error) std::rethrow_exception(error);
}

}  // namespace rd::nn
