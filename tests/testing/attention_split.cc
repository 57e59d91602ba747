// Attention calls split into row and key blocks (see attention_split.h).
#include "testing/attention_split.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "ringdilated/kernels/attention_dropout.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/philox.h"
#include "ringdilated/tensor/dispatch.h"
#include "testing/host_views.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using kernels::AttentionParams;
using kernels::DropoutIndexing;

constexpr const char* kOp = "run_split";

kernels::StridedView view(const Tensor& t) { return kernel_view(t, kOp); }

// [0, cut_1), [cut_1, cut_2), ..., [cut_n, length).
std::vector<std::pair<int64_t, int64_t>> blocks(const std::vector<int64_t>& cuts, int64_t length) {
  std::vector<std::pair<int64_t, int64_t>> result;
  int64_t begin = 0;
  for (int64_t cut : cuts) {
    result.emplace_back(begin, cut);
    begin = cut;
  }
  result.emplace_back(begin, length);
  return result;
}

// The parameters of the block of rows from r0 and keys from c0 of a call with `params`,
// whose resolved dropout numbering is `whole`.
AttentionParams block_params(const AttentionParams& params, const DropoutIndexing& whole,
                             int64_t r0, int64_t c0) {
  AttentionParams p = params;
  p.causal_offset = params.causal_offset + r0 - c0;
  p.dropout_indexing = whole;
  p.dropout_indexing.base = whole.base +
                            static_cast<uint64_t>(r0) * static_cast<uint64_t>(whole.row_stride) +
                            static_cast<uint64_t>(c0) * static_cast<uint64_t>(whole.col_stride);
  return p;
}

}  // namespace

SplitAttention make_split_attention(const SplitShape& shape, DType dtype, Device device,
                                    const AttentionParams& params, std::mt19937_64& rng) {
  const Shape q_shape = concat(shape.batch, {shape.lq, shape.d});
  const Shape k_shape = concat(shape.batch, {shape.lk, shape.d});
  const Shape lse_shape = concat(shape.batch, {shape.lq});
  auto draw = [&](const Shape& s, DType t) {
    return from_ref(random_values(s, Domain::kAny, t, rng), t, device);
  };
  SplitAttention a;
  a.q = draw(q_shape, dtype);
  a.k = draw(k_shape, dtype);
  if (shape.one_hot_v) {
    RefArray v = RefArray::filled(k_shape, 0.0);
    for (int64_t row = 0; row < product(k_shape) / shape.d; ++row) {
      v.data[static_cast<size_t>(row * shape.d + row % shape.lk)] = 1.0;
    }
    a.v = from_ref(v, dtype, device);
  } else {
    a.v = draw(k_shape, dtype);
  }
  a.params = params;
  a.grad_out = draw(q_shape, accumulation_dtype(dtype));
  a.grad_lse = draw(lse_shape, accumulation_dtype(dtype));
  return a;
}

SplitResult run_split(const SplitAttention& a, kernels::AttentionKernel kernel,
                      const std::vector<int64_t>& row_cuts, const std::vector<int64_t>& col_cuts,
                      bool backward) {
  const int nb = static_cast<int>(a.q.dim()) - 2;
  const int64_t lq = a.q.size(nb), lk = a.k.size(nb);
  const TensorOptions acc = TensorOptions(accumulation_dtype(a.q.dtype())).with_device(a.q.device());
  const DropoutIndexing whole =
      kernels::resolve_dropout_indexing(a.params.dropout_indexing, a.q.shape().data(), nb, lq, lk);
  Shape lse_shape = a.q.shape();
  lse_shape.pop_back();
  SplitResult r;
  r.out = zeros(a.q.shape(), acc);
  r.lse = full(lse_shape, -std::numeric_limits<double>::infinity(), acc);
  kernels::KernelBackend& backend = backend_for(a.q.device());
  const auto row_blocks = blocks(row_cuts, lq), col_blocks = blocks(col_cuts, lk);
  for (const auto& [r0, r1] : row_blocks) {
    const Tensor out_rows = r.out.narrow(nb, r0, r1 - r0), lse_rows = r.lse.narrow(nb, r0, r1 - r0);
    for (const auto& [c0, c1] : col_blocks) {
      const Tensor part_out = zeros(out_rows.shape(), acc);
      const Tensor part_lse = full(lse_rows.shape(), -std::numeric_limits<double>::infinity(), acc);
      AttentionForwardArgs f;
      f.q = view(a.q.narrow(nb, r0, r1 - r0));
      f.k = view(a.k.narrow(nb, c0, c1 - c0));
      f.v = view(a.v.narrow(nb, c0, c1 - c0));
      f.out = view(part_out);
      f.lse = view(part_lse);
      f.params = block_params(a.params, whole, r0, c0);
      backend.attention_forward(kernel, f);
      backend.attention_merge(view(out_rows), view(lse_rows), view(part_out), view(part_lse));
    }
  }
  if (!backward) return r;
  r.grad_q = zeros(a.q.shape(), acc);
  r.grad_k = zeros(a.k.shape(), acc);
  r.grad_v = zeros(a.v.shape(), acc);
  for (const auto& [r0, r1] : row_blocks) {
    for (const auto& [c0, c1] : col_blocks) {
      AttentionBackwardArgs b;
      b.q = view(a.q.narrow(nb, r0, r1 - r0));
      b.k = view(a.k.narrow(nb, c0, c1 - c0));
      b.v = view(a.v.narrow(nb, c0, c1 - c0));
      b.out = view(r.out.narrow(nb, r0, r1 - r0));
      b.lse = view(r.lse.narrow(nb, r0, r1 - r0));
      b.grad_out = view(a.grad_out.narrow(nb, r0, r1 - r0));
      b.grad_lse = view(a.grad_lse.narrow(nb, r0, r1 - r0));
      b.grad_q = view(r.grad_q.narrow(nb, r0, r1 - r0));
      b.grad_k = view(r.grad_k.narrow(nb, c0, c1 - c0));
      b.grad_v = view(r.grad_v.narrow(nb, c0, c1 - c0));
      b.params = block_params(a.params, whole, r0, c0);
      backend.attention_backward(kernel, b);
    }
  }
  return r;
}

::testing::AssertionResult zeros_are_the_mask(const Tensor& out, const SplitAttention& a,
                                              const kernels::DropoutIndexing& ix) {
  const RefArray values = to_ref(out);
  const Shape& shape = values.shape;
  const int nb = static_cast<int>(shape.size()) - 2;
  const int64_t d = shape[nb + 1], lk = a.k.size(nb);
  const AttentionParams& p = a.params;
  int64_t wrong = 0;
  std::string examples;  // the first few disagreements, enough to see a pattern
  int64_t min_key = lk, max_key = -1;
  for (int64_t row = 0; row < values.numel() / d; ++row) {
    const std::vector<int64_t> index = ref::unravel(row * d, shape);
    const std::vector<int64_t> batch_index(index.begin(), index.begin() + nb);
    const int64_t i = index[nb];
    for (int64_t j = 0; j < lk; ++j) {
      const bool visible = !p.causal || j - i <= p.causal_offset;
      const bool kept = p.dropout == 0 ||
                        dropout_keeps(p.seed, p.offset, p.dropout,
                                      custom_dropout_number(ix, batch_index, i, j));
      const double got = values.data[static_cast<size_t>(row * d + j)];
      if ((got == 0.0) == (visible && kept)) {
        if (wrong++ < 8) {
          examples += "\n  row " + std::to_string(row) + " (query " + std::to_string(i) +
                      "), key " + std::to_string(j) + ": got " + std::to_string(got) +
                      ", visible " + std::to_string(visible) + ", kept " + std::to_string(kept);
        }
        min_key = std::min(min_key, j);
        max_key = std::max(max_key, j);
      }
    }
  }
  if (wrong == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << wrong << " elements disagree with the mask, at keys "
                                       << min_key << ".." << max_key << "; the first:" << examples;
}

std::vector<SplitCase> split_cases() {
  return {
      {"rows_default", false, false, 0, {33}, {}},
      {"keys_default", false, false, 0, {}, {64}},
      {"rows_and_keys_custom", true, false, 0, {20, 45}, {50, 100}},
      {"causal_rows_and_keys", true, true, 5, {33}, {64, 130}},
      {"causal_negative_offset", false, true, -3, {10, 40}, {30}},
      {"causal_offset_past_the_keys", true, true, 200, {32}, {1, 149}},
  };
}

kernels::DropoutIndexing default_as_custom(const std::vector<int64_t>& batch, int64_t lq,
                                           int64_t lk) {
  DropoutIndexing ix;
  ix.custom = true;
  int64_t stride = lq * lk;
  for (size_t d = batch.size(); d-- > 0;) {
    ix.batch_strides[d] = stride;
    stride *= batch[d];
  }
  ix.row_stride = lk;
  ix.col_stride = 1;
  return ix;
}

kernels::DropoutIndexing scattered_numbering() {
  DropoutIndexing ix;
  ix.custom = true;
  ix.base = std::numeric_limits<uint64_t>::max() - 39;
  ix.batch_strides[0] = -1'000'003;
  ix.batch_strides[1] = 40'009;
  ix.row_stride = 613;
  ix.col_stride = 3;
  return ix;
}

SplitAttention make_case_attention(const SplitCase& c, const SplitShape& shape, DType dtype,
                                   Device device, AttentionParams params, std::mt19937_64& rng) {
  params.causal = c.causal;
  params.causal_offset = c.causal_offset;
  if (c.custom) params.dropout_indexing = scattered_numbering();
  return make_split_attention(shape, dtype, device, params, rng);
}

kernels::DropoutIndexing case_numbering(const SplitCase& c, const SplitShape& shape) {
  return c.custom ? scattered_numbering() : default_as_custom(shape.batch, shape.lq, shape.lk);
}

::testing::AssertionResult split_results_close(const SplitResult& expected, const SplitResult& got,
                                               DType dtype, int64_t d, int64_t lk) {
  const Tolerance out_tol = tolerance_for(dtype, d + lk);
  const Tolerance lse_tol = tolerance_for(accumulation_dtype(dtype), d + lk);
  enum class Kind { kOut, kLse, kGrad };
  const struct {
    const char* name;
    Kind kind;
    const Tensor& want;
    const Tensor& got;
  } parts[] = {{"out", Kind::kOut, expected.out, got.out},
               {"lse", Kind::kLse, expected.lse, got.lse},
               {"grad_q", Kind::kGrad, expected.grad_q, got.grad_q},
               {"grad_k", Kind::kGrad, expected.grad_k, got.grad_k},
               {"grad_v", Kind::kGrad, expected.grad_v, got.grad_v}};
  for (const auto& part : parts) {
    if (!part.want.defined() || !part.got.defined()) continue;
    const RefArray want = to_ref(part.want);
    Tolerance tol{2 * out_tol.rtol, 2 * out_tol.atol};
    if (part.kind == Kind::kLse) tol = lse_tol;
    if (part.kind == Kind::kGrad) {
      double largest = 0;
      for (double x : want.data) largest = std::max(largest, std::abs(x));
      tol = {4 * out_tol.rtol, 4 * out_tol.rtol * largest};
    }
    ::testing::AssertionResult ok = values_close(want, to_ref(part.got), tol);
    if (!ok) return ::testing::AssertionFailure() << part.name << ": " << ok.message();
  }
  return ::testing::AssertionSuccess();
}

uint64_t custom_dropout_number(const kernels::DropoutIndexing& ix,
                               const std::vector<int64_t>& batch_index, int64_t i, int64_t j) {
  uint64_t n = ix.base;
  for (size_t d = 0; d < batch_index.size(); ++d) {
    n += static_cast<uint64_t>(batch_index[d]) * static_cast<uint64_t>(ix.batch_strides[d]);
  }
  return n + static_cast<uint64_t>(i) * static_cast<uint64_t>(ix.row_stride) +
         static_cast<uint64_t>(j) * static_cast<uint64_t>(ix.col_stride);
}

bool dropout_keeps(uint64_t seed, uint64_t offset, double p, uint64_t n) {
  const uint64_t counter = offset + n;
  const kernels::Philox4x32 block = kernels::philox4x32_10(
      {{static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<double>(block.w[0] >> 8) / 16777216.0 < 1 - p;
}

}  // namespace rd::test
