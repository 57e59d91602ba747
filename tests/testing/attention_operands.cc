// The operands of the attention kernel tests: layouts, styles, case names, extreme inputs.
#include "testing/attention_operands.h"

#include <utility>

namespace rd::test {

Operand make_operand(DType dtype, const std::vector<int64_t>& shape, Style style) {
  const int n = static_cast<int>(shape.size());
  std::vector<int64_t> strides = contiguous_strides(shape);
  int64_t offset = 0;
  int64_t count = product(shape);
  switch (style) {
    case Style::kPlain:
      break;
    case Style::kTransposed:
      if (n >= 2) {
        std::vector<int64_t> stored = shape;
        std::swap(stored[n - 1], stored[n - 2]);
        strides = contiguous_strides(stored);
        std::swap(strides[n - 1], strides[n - 2]);
      }
      break;
    case Style::kReversedRows: {
      const int rows = n >= 2 ? n - 2 : n - 1;
      if (shape[rows] > 0) {
        offset = (shape[rows] - 1) * strides[rows];
        strides[rows] = -strides[rows];
      }
      break;
    }
    case Style::kBroadcastFirst:
      if (n > 2 && shape[0] > 1) {
        const std::vector<int64_t> rest(shape.begin() + 1, shape.end());
        strides = concat({0}, contiguous_strides(rest));
        count = product(rest);
      }
      break;
    case Style::kEveryOther:
      for (int64_t& s : strides) s *= 2;
      offset = 1;
      count = 2 * count + 1;
      break;
    case Style::kDilated: {
      // Matrices [B, S, H, n, D] in a [B, N, H, D] buffer; row statistics [B, S, H, n] in a
      // [B, H, N] buffer, as the spec lays out out and lse.
      const int64_t b = shape[0], segments = shape[1], heads = shape[2], rows = shape[3];
      const int64_t w = rows * kDilation, seq = segments * w;
      if (n == 5) {
        const int64_t d = shape[4];
        strides = {seq * heads * d, w * heads * d, d, kDilation * heads * d, 1};
        offset = kDilationOffset * heads * d;
        count = b * seq * heads * d;
      } else {
        strides = {heads * seq, w, seq, kDilation};
        offset = kDilationOffset;
        count = b * heads * seq;
      }
      break;
    }
  }
  return make_strided_operand(dtype, shape, strides, offset, count);
}

Style style_for(AttentionLayout layout, Role role) {
  if (layout == AttentionLayout::kContiguous) return Style::kPlain;
  if (layout == AttentionLayout::kDilated) return Style::kDilated;
  switch (role) {
    case Role::kQ:
    case Role::kOut:
    case Role::kGradQ: return Style::kTransposed;
    case Role::kK:
    case Role::kGradOut:
    case Role::kGradK: return Style::kReversedRows;
    case Role::kV: return Style::kBroadcastFirst;
    case Role::kLse:
    case Role::kGradLse:
    case Role::kGradV: return Style::kEveryOther;
  }
  return Style::kPlain;
}

std::string dtype_tag(DType t) { return std::string(dtype_name(t)); }

std::string signed_tag(int64_t value) {
  return value < 0 ? "m" + std::to_string(-value) : std::to_string(value);
}

void fill_extreme(const kernels::StridedView& view, bool alternate_sign) {
  const int64_t d = view.shape[view.ndim - 1], rows = view.shape[view.ndim - 2];
  std::vector<double> values(view.numel(), 0);
  for (int64_t r = 0; r < view.numel() / d; ++r) {
    const int64_t i = r % rows;
    values[r * d] = alternate_sign && i % 2 == 1 ? -100 : 100;
    if (d > 1) values[r * d + 1] = static_cast<double>((r * 7 + 3) % 5) - 2;
  }
  write_view(view, values);
}

}  // namespace rd::test
