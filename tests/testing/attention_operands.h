// The operands of the attention kernel tests (CPU against a float64 reference, CUDA against
// the CPU): memory layouts and styles per role, the case description, extreme-score inputs.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/strided.h"
#include "testing/host_views.h"

namespace rd::test {

// How the views of one case sit in memory.
enum class AttentionLayout {
  kContiguous,
  kStrided,  // transposed, reversed (negative stride), broadcast (zero stride), every-other
  kDilated,  // [B, S, H, n, D] views of [B, N, H, D] buffers: the fixed variant's selection
};

// How one operand sits in memory.
enum class Style {
  kPlain,
  kTransposed,      // the last two dims stored swapped
  kReversedRows,    // rows (dim -2, or -1 for [batch..., rows]) in reverse: negative stride
  kBroadcastFirst,  // dim 0 has stride 0 (inputs only)
  kEveryOther,      // every other element of a buffer twice as large, starting at 1
  kDilated,         // see AttentionLayout::kDilated
};

// The dilated selection: dilation rate r and offset o (segments of length w = n * r).
inline constexpr int64_t kDilation = 2;
inline constexpr int64_t kDilationOffset = 1;

// A new operand of `shape` in `style`, zero-filled.
Operand make_operand(DType dtype, const std::vector<int64_t>& shape, Style style);

enum class Role { kQ, kK, kV, kOut, kLse, kGradOut, kGradLse, kGradQ, kGradK, kGradV };

// The style of each role under a layout: kStrided gives the roles different strides.
Style style_for(AttentionLayout layout, Role role);

enum class AttentionValues {
  kRandom,   // uniform in [-1, 1]
  kExtreme,  // scores +-1e4 + small integers, computed exactly (see fill_extreme)
};

// One attention test case. The sizes lq and lk a case leaves out are the table's defaults,
// a parameter: the CPU test's float64 reference wants small problems, the GPU test several
// tiles.
template <int64_t kDefaultLq, int64_t kDefaultLk>
struct AttentionCase {
  std::string name;
  DType dtype = DType::kFloat32;
  std::optional<DType> out_dtype = std::nullopt;   // default: dtype
  std::optional<DType> grad_dtype = std::nullopt;  // default: dtype
  std::vector<int64_t> batch = {2};
  int64_t lq = kDefaultLq, lk = kDefaultLk, d = 16;
  std::optional<double> scale = std::nullopt;  // default: 1 / sqrt(d)
  bool causal = false;
  int64_t causal_offset = 0;
  double dropout = 0;
  bool lse = true;       // the forward writes lse
  bool grad_lse = true;  // the backward gets a grad_lse
  AttentionLayout layout = AttentionLayout::kContiguous;
  AttentionValues values = AttentionValues::kRandom;
  bool key_order = false;  // visit the keys in a random order: the same result
};

// gtest prints a failing case by its name rather than its bytes.
template <int64_t kDefaultLq, int64_t kDefaultLk>
void PrintTo(const AttentionCase<kDefaultLq, kDefaultLk>& c, std::ostream* os) {
  *os << c.name;
}

// Pieces of case names: "float32", and "5" or "m7" for -7.
std::string dtype_tag(DType t);
std::string signed_tag(int64_t value);

// Writes q[b, i] = (+-100, c_i, 0, ...) (the sign alternating by row when alternate_sign)
// or k[b, j] = (100, c_j, 0, ...) through `view`, with small integers c: the scores are
// +-1e4 + c_i c_j, exact in every compute type.
void fill_extreme(const kernels::StridedView& view, bool alternate_sign);

}  // namespace rd::test
