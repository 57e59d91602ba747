// The attention conformance table: every case of the attention primitive
// (kernels/attention.h) declared once, with one float64 reference written from the contract,
// and one harness that runs a case on a device through one kernel (CPU math; CUDA math,
// flash and cuDNN), forward and backward, in the style of the op suite
// (tests/op_suite_test.cc). tests/attention_kernel_test.cc runs the table on the CPU,
// tests/cuda_attention_conformance_test.cc on every CUDA kernel.
//
// What one run checks (check_attention_case):
// - forward into poisoned outputs (0xff bytes: NaN in every float dtype), so an element a
//   kernel never writes fails; elements of the buffers outside the views stay as they were;
//   rows that see no key are exactly 0 with lse -inf (never NaN); with one-hot values the
//   zeros of out are exactly the documented dropout mask; math kernels give the same bits
//   twice;
// - backward from the reference's out and lse (rounded to their dtypes), accumulated into
//   gradients that start from random values (or from zeros, when the case promises so),
//   run twice: the second run adds again; the scratch a CUDA math or flash backward takes
//   is returned.
// Tolerances come from the dtypes: the reference carries, per element, a bound on the
// error of a float32 (float64 for float64 data) computation ((D + 16) units on each
// score's sum of |terms|, carried through out, lse and the gradients), plus 2 units of the
// stored dtype's rounding; a GPU math kernel adds the spread of another summation order
// (8 (D + 16) units of the compute type on the tensor's largest value); the fused kernels
// (flash, cuDNN) round P and dS to the input dtype: 8 units of it on each element's sum of
// |terms|, plus float32 exp2 error proportional to the score magnitudes.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/strided.h"
#include "ringdilated/tensor/device.h"
#include "testing/host_views.h"

namespace rd::test {

// How the views of one case sit in memory.
enum class AttentionLayout {
  kContiguous,
  kStrided,      // per role: transposed, reversed (negative stride), broadcast (stride 0),
                 // every other element
  kDilated,      // [B, S, Hg, n, D] selections of [B, N, H, D] buffers (see Dilation)
  kHeadsInside,  // q, out, grad_out, grad_q as [B, H, L, D] of [B, L, H, D] storage
  kUnaligned,    // q one element past an aligned start, k stored in reverse
  kGroupedHeads, // k and v read the last batch dim through stride 0: query heads sharing a
                 // key/value head (grouped-query attention); their gradients per query head
  kGroupedHeadsSharedGrads,  // the same with grad_k and grad_v shared like k and v (each
                             // key/value head's gradient summed over its query heads)
};

// The dilated selection of docs/dilated-attention.md: segments of w = n * rate positions,
// every rate-th from `offset`, heads first_head .. first_head + Hg - 1 of `heads` (0: Hg).
// Row statistics (lse, grad_lse) select from a [B, H, N] buffer, or [B, N, H] with
// lse_heads_last, or are packed [B, S, Hg, n] with packed_lse.
// With spare_segments > 0 the buffers hold that many more segments per batch row than the
// selection reads (a rank's block of two zigzag pieces): the batch dim then folds with no
// other, and cuDNN runs one graph per batch entry.
struct Dilation {
  int64_t rate = 2, offset = 1, heads = 0, first_head = 0;
  bool lse_heads_last = false, packed_lse = false;
  int64_t spare_segments = 0;
};

enum class AttentionValues {
  kRandom,   // uniform in [-range, range]
  kExtreme,  // scores +-1e4 + small integers, exact in every compute type (fill_extreme)
  kOneHotV,  // v[b, j] = e_j (d >= lk): out[b, i, j] is p[i, j] times the dropout factor
};

// The fused kernels that must accept a case (a refusal then fails the run); any kernel
// runs every case it accepts, and a refused forward skips the run.
enum MustRun : unsigned {
  kFlashForward = 1,
  kFlashBackward = 2,
  kCudnnForward = 4,
  kCudnnBackward = 8,
  kFlash = kFlashForward | kFlashBackward,
  kCudnn = kCudnnForward | kCudnnBackward,
};

struct AttentionCase {
  std::string name;  // the test's name: letters, digits and _
  DType dtype = DType::kFloat32;
  std::optional<DType> out_dtype = std::nullopt;           // default: dtype (out and grad_out)
  std::optional<DType> grad_dtype = std::nullopt;          // default: dtype
  std::optional<DType> backward_out_dtype = std::nullopt;  // the backward's copy of out; default out_dtype
  std::vector<int64_t> batch = {2};
  int64_t lq = 9, lk = 13, d = 16;
  std::optional<double> scale = std::nullopt;  // default: 1 / sqrt(d)
  bool causal = false;
  int64_t causal_offset = 0;
  double dropout = 0;
  uint64_t seed = 0x9e3779b97f4a7c15ull, offset = 12345;
  bool scattered_numbering = false;  // dropout numbered by scattered_numbering() (2 batch dims)
  bool lse = true;       // the forward writes lse
  bool grad_lse = true;  // the backward gets a grad_lse
  bool overwrite_grads = false;  // the backward overwrites its gradients (poisoned before)
  AttentionLayout layout = AttentionLayout::kContiguous;
  Dilation dilation = Dilation();  // kDilated
  AttentionValues values = AttentionValues::kRandom;
  double q_range = 1, k_range = 1;  // q and k uniform in [-range, range]
  bool key_order = false;  // keys visited in a random order: the same result
  int64_t key_split = 0;   // > 0: keys [0, split) and [split, lk) as two calls merged
                           // through the lse; each backward gets the merged out and lse
  unsigned must = 0;       // MustRun bits
};

inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

// The table (tests/testing/attention_conformance.cc).
const std::vector<AttentionCase>& attention_cases();

// Runs case `c` on `device` through `kernel` and checks it (see the file comment). Skips
// (GTEST_SKIP) without the device, or when the kernel refuses a forward the case does not
// require of it; a refused backward it does not require is left out.
void check_attention_case(const AttentionCase& c, Device device, kernels::AttentionKernel kernel);

// One registered test of the table: a kernel and a case.
struct AttentionRun {
  kernels::AttentionKernel kernel;
  const AttentionCase* c;
};
inline void PrintTo(const AttentionRun& r, std::ostream* os) {
  *os << kernels::kernel_name(r.kernel) << "_" << r.c->name;
}
// Every case of the table for each kernel, and the test name "<kernel>_<case>".
std::vector<AttentionRun> attention_runs(const std::vector<kernels::AttentionKernel>& kernels);
std::string attention_run_name(const ::testing::TestParamInfo<AttentionRun>& info);

// ---------------------------------------------------------------------------------------
// Pieces the path-specific tests share.

// Roles of the operands, and a new zero-filled operand of `shape` for a role under the
// case's layout.
enum class Role { kQ, kK, kV, kOut, kLse, kGradOut, kGradLse, kGradQ, kGradK, kGradV };
Operand make_attention_operand(const AttentionCase& c, Role role, DType dtype,
                               const std::vector<int64_t>& shape);

// Writes q[b, i] = (+-100, c_i, 0, ...) (the sign alternating by row when alternate_sign)
// or k[b, j] = (100, c_j, 0, ...) through `view`, with small integers c: the scores are
// +-1e4 + c_i c_j, exact in every compute type.
void fill_extreme(const kernels::StridedView& view, bool alternate_sign);

// The float64 reference of a forward call: q, k, v in logical row-major order, [batch, lq or
// lk, d] with the batch dims flattened into `batch`.
struct AttentionProblem {
  DType dtype = DType::kFloat32;  // of q, k, v: sets the compute precision
  std::vector<int64_t> batch_shape;
  int64_t lq = 0, lk = 0, d = 0;
  kernels::AttentionParams params;  // key_order ignored: it changes no result
  std::vector<double> q, k, v;
  bool exact_scores = false;  // the scores are exact in the compute type (no dot error)
  int64_t batch() const { return product(batch_shape); }
};

struct ForwardReference {
  std::vector<double> out, out_err, out_abs;  // [batch, lq, d]: value, error bound, sum |terms|
  std::vector<double> lse, lse_err;           // [batch, lq]
  std::vector<double> prob, factor;  // [batch, lq, lk]: softmax (0 where masked), dropout factor
  std::vector<double> prob_err;      // [batch, lq]: bound on the relative error of p
  double score_abs = 0;              // the largest |scale| sum |q k| of a visible pair, and |lse|
};
ForwardReference reference_forward(const AttentionProblem& pr);

struct GradReference {
  std::vector<double> dq, dk, dv;              // like q, k, v
  std::vector<double> dq_err, dk_err, dv_err;  // compute-error bounds
  std::vector<double> dq_abs, dk_abs, dv_abs;  // sums of |terms|
};
// Gradients for dL/dout = g and dL/dlse = gl (empty: none), through the explicit softmax
// Jacobian. The kernel is given out rounded to `out_dtype` and lse rounded to float32; the
// error bounds include both.
GradReference reference_backward(const AttentionProblem& pr, const ForwardReference& f,
                                 const std::vector<double>& g, const std::vector<double>& gl,
                                 DType out_dtype);

}  // namespace rd::test
