// The attention calls of one dilated-attention call: which kernel runs each (cuDNN, flash,
// math; the RD_ATTENTION_PATH override; the fallback to slower kernels), the kernel
// parameters they share, and where the backward adds the q/k/v gradients.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// The log-sum-exp of a row that has seen no key yet: where a merge of partials starts, and
// what a row that sees no key keeps.
inline constexpr double kEmptyLse = -std::numeric_limits<double>::infinity();

// The slower of two kernels (math, then flash, then cuDNN): what a call reports as its path.
kernels::AttentionKernel slower(kernels::AttentionKernel a, kernels::AttentionKernel b);

// The requested path: RD_ATTENTION_PATH (auto|cudnn|flash|math) overrides kAuto. Read per
// call, so there is no hidden state; a bad value is an rd::Error naming `op`.
AttentionPath requested_path(AttentionPath option, const char* op);

// Kernels to try, in order: the requested one, then the slower fallbacks. kAuto starts from
// the fastest the device may have; the CPU has only math.
std::vector<kernels::AttentionKernel> candidate_kernels(AttentionPath requested, Device device);

// Runs the attention calls of one dilated-attention call. Built once from its options and
// context, it holds what every call shares (scale, causal mask, dropout seed and each pair's
// Philox offset, the kernels to try, the pattern cache) and runs each forward or backward
// call with the first kernel that supports it. A kernel that reports it cannot serve a call
// (attention_supports false, or kUnimplemented thrown before it queued any work) falls back
// to the next; a forced path's fallback is logged once per distinct message. Every other
// error (out of memory, a failed launch) propagates: by then a backward kernel may already
// have accumulated into its gradients, and a retry would add them twice. Unless a path is
// forced, a call whose shape follows the data (params.shape_follows_data: document pieces,
// decoding steps) skips the kernels that build state per shape (cuDNN's graphs).
class AttentionRunner {
 public:
  // `seq_len` is N over every rank (the dropout numbering spans the whole sequence).
  // Draws each pair's dropout offset from the context's generator when training with
  // dropout, so every rank holding an identically seeded generator draws the same ones.
  AttentionRunner(const char* op, const DilatedAttentionOptions& options,
                  const AttentionCallContext& context, const Tensor& q, int64_t seq_len);

  const char* op() const { return op_; }
  bool dropout() const { return params_.dropout > 0; }
  bool causal() const { return params_.causal; }
  int64_t backward_piece_elements() const { return backward_piece_elements_; }
  PatternCache& patterns() const { return *patterns_; }
  // The context's rank plan cache, or null (plan every call).
  RankPlanCache* plans() const { return plans_; }

  // The parameters of a call of pair `pair` numbered by `indexing` (read with dropout only).
  kernels::AttentionParams call_params(int pair, bool causal,
                                       const kernels::DropoutIndexing& indexing) const;

  // The Hilbert order of n keys when the options ask for it (cached), else undefined.
  Tensor key_order(int64_t n, Device device) const;

  void forward(const kernels::AttentionForwardArgs& args);
  // forward() where some kernel takes the call; false, with nothing run, where none does (a
  // call over pieces, which only cuDNN takes: the caller then runs each piece).
  bool forward_if_supported(const kernels::AttentionForwardArgs& args);
  void backward(const kernels::AttentionForwardArgs& fwd,
                const kernels::AttentionBackwardArgs& args);
  // backward() where some kernel takes the call; false, with nothing run, where none does (a
  // caller with another way to the same gradients: grouped-query attention's shared dK/dV,
  // which only cuDNN sums natively).
  bool backward_if_supported(const kernels::AttentionForwardArgs& fwd,
                             const kernels::AttentionBackwardArgs& args);
  // Whether backward_if_supported would find a kernel, as far as kernels tell before running
  // (a graph cuDNN then fails to build still makes it return false, with nothing run).
  bool backward_supported(const kernels::AttentionForwardArgs& fwd,
                          const kernels::AttentionBackwardArgs& args) const;

  // The slowest kernel any call ran (cuDNN when none ran).
  AttentionPath path_used() const { return path_of(slowest_); }

 private:
  // The kernel that ran the call; none when no kernel could (then nothing ran), which is an
  // error unless `optional`.
  std::optional<kernels::AttentionKernel> run(const kernels::AttentionForwardArgs& fwd,
                                              const kernels::AttentionBackwardArgs* backward,
                                              bool optional = false);
  void count_call(kernels::AttentionKernel kernel, bool over_pieces, bool backward);
  // Why `kernel` cannot take the call before running it ("" where it can).
  std::string refusal(kernels::AttentionKernel kernel, const kernels::AttentionForwardArgs& fwd,
                      const kernels::AttentionBackwardArgs* backward) const;

  const char* op_;
  Device device_;
  kernels::AttentionParams params_;
  std::vector<kernels::AttentionKernel> kernels_;
  bool forced_ = false;
  bool hilbert_ = false;
  PatternCache* patterns_ = nullptr;
  RankPlanCache* plans_ = nullptr;
  int64_t backward_piece_elements_ = 0;
  std::vector<uint64_t> pair_offsets_;  // with dropout: each pair's first Philox counter
  kernels::AttentionKernel slowest_ = kernels::AttentionKernel::kCudnn;
  AttentionCallCounts* counts_ = nullptr;  // the context's, or null
};

// A backward's inputs from its forward call: q, k, v, out, lse, parameters and pieces (the
// gradients left for the caller).
kernels::AttentionBackwardArgs backward_of(const kernels::AttentionForwardArgs& fwd);

// The backward of a forward call: its inputs and (merged) results, the gradients arriving
// at out and lse (an undefined grad_lse: the lse was not used), and the q/k/v gradient
// tensors (views) it adds into.
kernels::AttentionBackwardArgs backward_args(const char* op,
                                             const kernels::AttentionForwardArgs& fwd,
                                             const Tensor& grad_out, const Tensor& grad_lse,
                                             const Tensor& grad_q, const Tensor& grad_k,
                                             const Tensor& grad_v);

// One rank's rows of an attention's result.
struct RankAttention {
  Tensor out;  // [B, C, H, D], q's dtype
  Tensor lse;  // [B, H, C], the accumulation dtype (float32; float64 for float64 data)
};

// The dtypes the backward builds the gradients of q and of k, v in: the inputs' dtype where
// each element is written by one call (exact), else the accumulation dtype (shares add up).
// They differ under grouped-query attention with head groups: each query head is one pair's,
// while a key/value head may serve the query heads of several pairs.
struct GradDtypes {
  DType q = DType::kFloat32, kv = DType::kFloat32;
};

// Where the backward builds the gradients of q, k and v: buffers of the gradient dtypes,
// either three [B, N, H, D] tensors or the q/k/v selections of one [B, N, 3, H, D] tensor
// when the inputs came packed (then no gradient-sized copy is ever made to pack them). They
// come uninitialized: a variant's backward zeroes what its calls do not store.
struct GradBuffers {
  Tensor packed;            // [B, N, 3, H, D], or undefined
  std::vector<Tensor> qkv;  // q [B, N, H, D], k and v [B, N, H_kv, D]

  // `kv_heads`: H_kv (grouped-query attention; packed inputs have H_kv = H and one dtype).
  static GradBuffers uninitialized(const Shape& bnhd, int64_t kv_heads, GradDtypes dtypes,
                                   Device device, bool packed);
  // Zeroes all three.
  void zero() const;
  // The gradients of the autograd inputs (q, k, v; or the packed qkv) in `dtype`.
  std::vector<Tensor> input_grads(DType dtype) const;
};

}  // namespace rd::nn
