// GradientBuckets: data-parallel gradient summation in buckets, each all-reduced as soon as
// backward has produced its last gradient, so that communication overlaps the rest of
// backward; gradients end as views of the reduced bucket buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Sums the gradients of `params` over the ranks of a communicator during backward.
//
// The parameters are grouped into buckets of at most `bucket_bytes` (one parameter larger
// than that gets a bucket of its own; a bucket holds one dtype and device) in reverse order,
// the order in which backward produces the gradients of parameters registered in forward
// order. A post-accumulate-grad hook on every parameter counts the gradients a bucket still
// waits for; when the last arrives the bucket's gradients are copied into one fresh flat
// buffer, each parameter's .grad becomes its view of that buffer, and the buffer's
// all-reduce is posted (iall_reduce: asynchronous on NCCL, done at once on the CPU
// backends). Buckets are posted in bucket order, which is the same on every rank whatever
// order their gradients arrive in, so the collectives match. finish() posts the buckets
// whose gradients did not all arrive (a parameter without a gradient counts as zeros; one
// that kept a gradient from an earlier pass counts with that one) and waits for them all.
//
// Use: every rank builds it over the same parameters in the same order, then, each step,
// runs backward once with sync on (set_sync(false) for the micro-batches before the last,
// whose gradients then only accumulate locally) and calls finish(). Between a bucket's
// post and finish(), its parameters' .grad is the buffer in flight: leave it alone.
// Every rank's .grad is then the sum of every rank's (ReduceOp::kSum; no averaging).
class GradientBuckets {
 public:
  static constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

  // `params`: leaves that require grad, distinct, in registration order.
  GradientBuckets(std::vector<Tensor> params, std::shared_ptr<dist::Communicator> comm,
                  int64_t bucket_bytes = kDefaultBucketBytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Whether the coming backward passes communicate (on by default). Off: gradients
  // accumulate locally, as gradient accumulation over micro-batches wants for all but the
  // last. Refused while a synchronized step is under way (between a post and finish()).
  void set_sync(bool sync);
  bool sync() const { return sync_; }

  // Posts what backward did not, waits for every bucket, and starts the next step. After it,
  // every parameter's .grad is the sum over the ranks (a view of its bucket's buffer).
  void finish();

  // The buckets, as indices into `params`, in the order they are reduced.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // How many buckets of the current step were posted so far (tests, diagnostics).
  size_t posted() const { return next_to_post_; }

 private:
  struct Slot {
    size_t param;    // index into params_
    int64_t offset;  // in elements, into the bucket's buffer
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t numel = 0;
    size_t waiting = 0;  // gradients not produced yet in this step
    std::unique_ptr<dist::Request> request;
  };

  void on_gradient(size_t param);
  void post_ready_buckets();
  void post(Bucket& bucket);

  std::vector<Tensor> params_;
  std::shared_ptr<dist::Communicator> comm_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;    // per parameter
  std::vector<bool> produced_;       // per parameter: its gradient arrived this step
  size_t next_to_post_ = 0;
  bool sync_ = true;
  std::vector<autograd::HookHandle> hooks_;
};

}  // namespace rd::nn
