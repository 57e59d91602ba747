// The argument checks of the row-wise fused ops (kernels/rowwise.h), run by every backend
// before it reads anything, so that a bad call fails alike on every device.
#include "ringdilated/kernels/rowwise.h"

#include <initializer_list>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::kernels {
namespace {

void check_rows(const char* op, int64_t rows, int64_t cols) {
  RD_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, op,
           ": rows and cols must be non-negative, got rows=", rows, " cols=", cols);
}

using NamedPointers = std::initializer_list<std::pair<const char*, const void*>>;

// Cross-entropy reads targets[r] and the per-row pointers for every position and the
// per-element ones for every logit, so each must be set when there is something to read
// (an empty call may pass nulls).
void check_cross_entropy_common(const char* op, int64_t rows, int64_t cols, int64_t inner,
                                const int64_t* targets, NamedPointers per_row,
                                NamedPointers per_element) {
  check_rows(op, rows, cols);
  RD_CHECK(inner >= 1 && rows % inner == 0, kInvalidArgument, op,
           ": argument 'inner' must be positive and divide rows=", rows, ", got ", inner);
  RD_CHECK(rows == 0 || targets != nullptr, kInvalidArgument, op,
           ": argument 'targets' must not be null for ", rows, " rows");
  for (const auto& [name, p] : per_row) {
    RD_CHECK(rows == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " rows");
  }
  for (const auto& [name, p] : per_element) {
    RD_CHECK(rows * cols == 0 || p != nullptr, kInvalidArgument, op, ": argument '", name,
             "' must not be null for ", rows, " x ", cols, " logits");
  }
}

void check_swiglu_shape(const char* op, int64_t rows, int64_t hidden) {
  RD_CHECK(rows >= 0 && hidden >= 0, kInvalidArgument, op,
           ": rows and hidden must be non-negative, got rows=", rows, " hidden=", hidden);
}

}  // namespace

void check_softmax_args(const SoftmaxArgs& args) {
  check_rows("softmax", args.rows, args.cols);
}

void check_softmax_backward_args(const SoftmaxBackwardArgs& args) {
  check_rows("softmax_backward", args.rows, args.cols);
}

void check_norm_args(const NormArgs& a) {
  check_rows("norm", a.rows, a.cols);
  RD_CHECK((a.residual == nullptr) == (a.sum == nullptr), kInvalidArgument,
           "norm: arguments 'residual' and 'sum' must be both null or both set, got residual ",
           a.residual == nullptr ? "null" : "set", " and sum ", a.sum == nullptr ? "null" : "set");
}

void check_norm_backward_args(const NormBackwardArgs& a) {
  check_rows("norm_backward", a.rows, a.cols);
  RD_CHECK(a.rstd && (a.rms || a.mean), kInvalidArgument,
           "norm_backward: arguments 'rstd' (and 'mean' for layer norm) must not be null");
}

void check_cross_entropy_args(const CrossEntropyArgs& a) {
  check_cross_entropy_common("cross_entropy", a.rows, a.cols, a.inner, a.targets,
                             {{"loss", a.loss}, {"lse", a.lse}}, {{"logits", a.logits}});
}

void check_cross_entropy_backward_args(const CrossEntropyBackwardArgs& a) {
  constexpr const char* kOp = "cross_entropy_backward";
  check_cross_entropy_common(kOp, a.rows, a.cols, a.inner, a.targets,
                             {{"grad_loss", a.grad_loss}, {"lse", a.lse}},
                             {{"grad_logits", a.grad_logits}, {"logits", a.logits}});
  RD_CHECK(a.grad_loss_stride >= 0, kInvalidArgument, kOp,
           ": argument 'grad_loss_stride' must be >= 0, got ", a.grad_loss_stride);
}

void check_swiglu_args(const SwigluArgs& a) { check_swiglu_shape("swiglu", a.rows, a.hidden); }

void check_swiglu_backward_args(const SwigluBackwardArgs& a) {
  check_swiglu_shape("swiglu_backward", a.rows, a.hidden);
}

std::string cross_entropy_target_message(const char* op, int64_t target, int64_t row,
                                         int64_t cols) {
  return str_cat(op, ": target ", target, " of row ", row, " is out of range for ", cols,
                 " classes");
}

}  // namespace rd::kernels
