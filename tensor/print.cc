// Printing tensors (to_string and operator<< of tensor/tensor.h): a header line, then the
// values in nested brackets, summarized with "..." beyond a threshold, as PyTorch's repr.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {
namespace {

constexpr const char* kGap = "...";

void check_options(const PrintOptions& o) {
  RD_CHECK(o.precision >= 0 && o.precision <= 17, kInvalidArgument,
           "to_string: option 'precision' must be in [0, 17], got ", o.precision);
  RD_CHECK(o.threshold >= 0, kInvalidArgument, "to_string: option 'threshold' must be >= 0, got ",
           o.threshold);
  RD_CHECK(o.edge_items >= 1, kInvalidArgument,
           "to_string: option 'edge_items' must be >= 1, got ", o.edge_items);
  RD_CHECK(o.line_width >= 1, kInvalidArgument,
           "to_string: option 'line_width' must be >= 1, got ", o.line_width);
}

// The elements that will be shown, on the host and contiguous. In a summarized tensor each
// dim longer than 2 * edge_items keeps only its first and last edge_items (cut[d] is then
// true and a gap is drawn between the two halves); only those elements leave the device.
struct ShownValues {
  Tensor values;
  std::vector<bool> cut;
};

ShownValues shown_values(const Tensor& t, const PrintOptions& o) {
  autograd::NoGradGuard no_grad;
  Tensor kept = t.detach();
  std::vector<bool> cut(t.dim(), false);
  if (t.numel() > o.threshold) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t size = kept.size(d);
      if (size <= 2 * o.edge_items) continue;
      kept = cat({kept.narrow(d, 0, o.edge_items), kept.narrow(d, size - o.edge_items, o.edge_items)},
                 d);
      cut[d] = true;
    }
  }
  return {kept.to(Device::cpu()).contiguous(), std::move(cut)};
}

std::string printf_string(const char* format, int precision, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, precision, value);
  return buffer;
}

// Floating values in one notation for the whole tensor, chosen as PyTorch does: integral
// values as "3.", otherwise fixed point unless the magnitudes span more than three decades
// or leave [1e-4, 1e8), which switches to scientific.
std::vector<std::string> format_floating(const std::vector<double>& values, int precision) {
  double max_abs = 0;
  double min_abs = INFINITY;
  bool integral = true;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    integral = integral && v == std::nearbyint(v);
    if (v == 0) continue;
    max_abs = std::max(max_abs, std::fabs(v));
    min_abs = std::min(min_abs, std::fabs(v));
  }
  const bool any_non_zero = max_abs > 0;
  const bool scientific =
      any_non_zero && (max_abs >= 1e8 || (!integral && (min_abs < 1e-4 || max_abs / min_abs > 1e3)));
  std::vector<std::string> out;
  out.reserve(values.size());
  for (double v : values) {
    if (std::isnan(v)) {
      out.push_back("nan");
    } else if (std::isinf(v)) {
      out.push_back(v > 0 ? "inf" : "-inf");
    } else if (scientific) {
      out.push_back(printf_string("%.*e", precision, v));
    } else if (integral) {
      out.push_back(printf_string("%.*f", 0, v) + ".");
    } else {
      out.push_back(printf_string("%.*f", precision, v));
    }
  }
  return out;
}

// Every shown element as text, in row-major order of `values`.
std::vector<std::string> format_values(const Tensor& values, int precision) {
  if (is_floating(values.dtype())) {
    return format_floating(values.to(DType::kFloat64).to_vector<double>(), precision);
  }
  const std::vector<int64_t> integers = values.to(DType::kInt64).to_vector<int64_t>();
  std::vector<std::string> out;
  out.reserve(integers.size());
  for (int64_t v : integers) {
    out.push_back(values.dtype() == DType::kBool ? (v != 0 ? "true" : "false") : std::to_string(v));
  }
  return out;
}

// Writes nested brackets over the shown elements, one dim per recursion level.
class BracketWriter {
 public:
  BracketWriter(const std::vector<std::string>& items, const ShownValues& shown,
                const PrintOptions& options)
      : items_(items), shown_(shown), options_(options) {
    for (const std::string& item : items) width_ = std::max(width_, item.size());
  }

  void write(std::string& out) const { write_dim(out, 0, 0); }

 private:
  int64_t ndim() const { return shown_.values.dim(); }

  // The slice starting at element `first` of dim `d`; its "[" sits at column d.
  void write_dim(std::string& out, int64_t d, int64_t first) const {
    out += '[';
    if (d == ndim() - 1) {
      write_row(out, d, first);
    } else {
      // Rows of a matrix are separated by one newline, matrices by two, and so on.
      const std::string separator = "," + std::string(ndim() - d - 1, '\n') + std::string(d + 1, ' ');
      const int64_t count = shown_.values.size(d);
      for (int64_t i = 0; i < count; ++i) {
        if (i > 0) out += separator;
        if (is_gap_before(d, i)) out += std::string(kGap) + separator;
        write_dim(out, d + 1, first + i * shown_.values.stride(d));
      }
    }
    out += ']';
  }

  // The last dim: right-aligned items, wrapped at line_width under the opening bracket.
  void write_row(std::string& out, int64_t d, int64_t first) const {
    const int64_t count = shown_.values.size(d);
    int64_t column = d + 1;
    auto put = [&](const std::string& text, bool last) {
      std::string cell = std::string(width_ - std::min(width_, text.size()), ' ') + text;
      if (!last) cell += ',';
      if (column > d + 1 && column + 1 + static_cast<int64_t>(cell.size()) > options_.line_width) {
        out += '\n' + std::string(d + 1, ' ');
        column = d + 1;
      } else if (column > d + 1) {
        out += ' ';
        ++column;
      }
      out += cell;
      column += static_cast<int64_t>(cell.size());
    };
    for (int64_t i = 0; i < count; ++i) {
      if (is_gap_before(d, i)) put(kGap, false);
      put(items_[first + i], i + 1 == count);
    }
  }

  bool is_gap_before(int64_t d, int64_t i) const {
    return shown_.cut[d] && i == options_.edge_items;
  }

  const std::vector<std::string>& items_;
  const ShownValues& shown_;
  const PrintOptions& options_;
  size_t width_ = 0;
};

std::string header(const Tensor& t) {
  std::string text = t.str();
  if (t.defined() && t.requires_grad()) text.insert(text.size() - 1, ", requires_grad");
  return text;
}

}  // namespace

std::string to_string(const Tensor& t, const PrintOptions& options) {
  check_options(options);
  std::string out = header(t);
  if (!t.defined()) return out;
  out += '\n';
  if (t.numel() == 0) return out + "[]";
  const ShownValues shown = shown_values(t, options);
  const std::vector<std::string> items = format_values(shown.values, options.precision);
  if (t.dim() == 0) return out + items[0];
  BracketWriter(items, shown, options).write(out);
  return out;
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << to_string(t); }

}  // namespace rd
