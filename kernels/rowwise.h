// The argument structs of KernelBackend's row-wise fused ops (softmax, layer/RMS norm,
// cross-entropy, SwiGLU) and their argument checks, shared by every backend and the tensor layer.
#pragma once

#include <cstdint>
#include <string>

#include "ringdilated/kernels/dtype.h"

namespace rd::kernels {

// Every struct here describes contiguous row-major data of one dtype: `rows` rows of `cols`
// (or 2 * hidden, ...) elements, each tensor given by its data pointer. They carry pointers
// rather than StridedViews because the kernels accept only contiguous rows (the tensor layer
// makes them so) and because a struct is what a CUDA launch takes by value: eight views of a
// norm would be over a kilobyte of kernel parameters, these structs are under a hundred
// bytes. Optional tensors are null pointers. All are plain data, usable in device code.

// Softmax (or log-softmax when `log`) of each row: out = softmax(in).
struct SoftmaxArgs {
  void* out = nullptr;
  const void* in = nullptr;
  DType dtype = DType::kFloat32;  // of out and in
  int64_t rows = 0, cols = 0;
  bool log = false;
};

// grad_in = y * (g - sum(g*y)) for softmax; g - exp(y) * sum(g) for log-softmax, where g is
// grad_out and y the forward output `out`.
struct SoftmaxBackwardArgs {
  void* grad_in = nullptr;
  const void* grad_out = nullptr;
  const void* out = nullptr;
  DType dtype = DType::kFloat32;  // of all three
  int64_t rows = 0, cols = 0;
  bool log = false;
};

// Layer norm (rms=false) or RMS norm (rms=true) over each row. weight/bias ([cols], dtype)
// may be null. mean (unused for rms) and rstd are float32 [rows] outputs kept for the
// backward pass; either may be null when not wanted.
// Residual fusion: when `residual` is not null the normalized row is in + residual, and that
// sum (rounded to dtype) is also written to `sum` (the transformer's new residual stream), so
// the add costs no extra pass over memory. `sum` must be non-null exactly when `residual` is;
// it may alias `in` or `residual`.
struct NormArgs {
  void* out = nullptr;
  const void* in = nullptr;
  const void* residual = nullptr;  // null: the row normalized is `in` itself
  void* sum = nullptr;             // in + residual, written when residual is set
  const void* weight = nullptr;
  const void* bias = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  DType dtype = DType::kFloat32;  // of out, in, residual, sum, weight and bias
  int64_t rows = 0, cols = 0;
  double eps = 1e-5;
  bool rms = false;
};

// Backward of a norm: `in` is what was normalized (the sum when a residual was fused), mean
// and rstd the forward's statistics (mean may be null for rms). grad_weight/grad_bias are
// float32 [cols] and may be null; they are overwritten, not accumulated. grad_in may be null
// when only the parameter gradients are wanted. grad_sum (may be null) is the gradient
// reaching the fused `sum` output from elsewhere; it is added into grad_in, which is then the
// gradient of both the input and the residual.
struct NormBackwardArgs {
  void* grad_in = nullptr;
  float* grad_weight = nullptr;
  float* grad_bias = nullptr;
  const void* grad_out = nullptr;
  const void* grad_sum = nullptr;
  const void* in = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* weight = nullptr;
  DType dtype = DType::kFloat32;  // of grad_in, grad_out, grad_sum, in and weight
  int64_t rows = 0, cols = 0;
  bool rms = false;
};

// Cross-entropy over `rows` positions of `cols` classes, never materializing the
// probabilities. Logits are contiguous [rows / inner, cols, inner] (PyTorch's [N, C, d...]
// with inner = d1 * d2 * ...; inner == 1 is row-major [rows, cols]): class c of position
// r = o * inner + i is logits[(o * cols + c) * inner + i]. Targets are int64 [rows], in
// position order. lse[r] = logsumexp over the classes of r and
// loss[r] = lse[r] - logit(r, targets[r]), or 0 when targets[r] == ignore_index.
// loss and lse are of accumulation_dtype(dtype). For a target outside [0, cols) (other than
// ignore_index) see "Bad targets" on KernelBackend::cross_entropy.
struct CrossEntropyArgs {
  void* loss = nullptr;
  void* lse = nullptr;
  const void* logits = nullptr;
  const int64_t* targets = nullptr;
  DType dtype = DType::kFloat32;  // of the logits
  int64_t rows = 0, cols = 0, inner = 1;
  int64_t ignore_index = -100;
};

// grad_logits(r, c) = grad_loss[r * grad_loss_stride] * (exp(logit(r, c) - lse[r]) -
// (c == targets[r])), and 0 at ignored positions; same layout as the logits. grad_loss
// (accumulation_dtype(dtype)) may broadcast one value with stride 0, which is how a mean or
// sum reduction arrives.
struct CrossEntropyBackwardArgs {
  void* grad_logits = nullptr;
  const void* grad_loss = nullptr;
  int64_t grad_loss_stride = 1;
  const void* logits = nullptr;
  const void* lse = nullptr;
  const int64_t* targets = nullptr;
  DType dtype = DType::kFloat32;  // of the logits and grad_logits
  int64_t rows = 0, cols = 0, inner = 1;
  int64_t ignore_index = -100;
};

// SwiGLU (kernels/swiglu.h): out [rows, hidden] = silu(gate) * up for contiguous gate_up rows
// [rows, 2 * hidden] (gate first, then up), computed in accumulation_dtype(dtype).
struct SwigluArgs {
  void* out = nullptr;
  const void* gate_up = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0, hidden = 0;
};

// The backward pass: grad_gate_up [rows, 2 * hidden] from grad_out [rows, hidden] and
// gate_up, reading each once.
struct SwigluBackwardArgs {
  void* grad_gate_up = nullptr;
  const void* grad_out = nullptr;
  const void* gate_up = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0, hidden = 0;
};

// The checks every backend runs first (kernels/rowwise.cc), so that a bad call fails with
// the same rd::Error, naming the op and the argument, on every device: non-negative sizes,
// and the pointers the op must have (norm: residual and sum together, rstd and, for layer
// norm, mean in the backward; cross-entropy: targets, loss/lse or grad_loss/lse per row and
// the logits per element when there are any, inner > 0 dividing rows, grad_loss_stride >= 0).
// Dtypes are checked where the backend dispatches on them (kDTypeMismatch naming the op).
// Cross-entropy target values are not checked here: see KernelBackend::cross_entropy.
void check_softmax_args(const SoftmaxArgs& args);
void check_softmax_backward_args(const SoftmaxBackwardArgs& args);
void check_norm_args(const NormArgs& args);
void check_norm_backward_args(const NormBackwardArgs& args);
void check_cross_entropy_args(const CrossEntropyArgs& args);
void check_cross_entropy_backward_args(const CrossEntropyBackwardArgs& args);
void check_swiglu_args(const SwigluArgs& args);
void check_swiglu_backward_args(const SwigluBackwardArgs& args);

// The message of a cross-entropy target outside [0, cols) (not ignore_index), e.g.
// "cross_entropy: target 40 of row 1 is out of range for 40 classes": what every backend
// reports, as rd::Error kOutOfRange, whenever it reports it.
std::string cross_entropy_target_message(const char* op, int64_t target, int64_t row,
                                         int64_t cols);

}  // namespace rd::kernels
