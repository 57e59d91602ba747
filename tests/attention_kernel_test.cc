// Tests of the CPU reference attention (kernels/cpu/attention.h) and of the shared argument
// checks (kernels/attention.cc), against a naive float64 reference written here from
// kernels/attention.h: scores materialized, causal mask and the documented Philox dropout
// mask applied, gradients through the explicit softmax Jacobian; and against float64 finite
// differences of a scalar loss.
//
// Tolerances come from the dtypes: 2 units of the stored dtype's rounding on the value (and
// on the value an accumulated gradient started from), plus an error bound of the float32
// (float64 for float64 data) computation: (D + 16) units on each score's sum of |terms|,
// which bounds the relative error of every probability, carried through the sums of |terms|
// of out, lse and the gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/cpu/attention.h"
#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/philox.h"
#include "testing/attention_operands.h"
#include "testing/dtype_precision.h"
#include "testing/elementwise_close.h"
#include "testing/host_views.h"

namespace rd::kernels {
namespace {

using Shape = std::vector<int64_t>;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                 DType::kFloat16};

using test::AttentionLayout;
using test::AttentionValues;
using test::compute_roundoff;
using test::concat;
using test::contiguous_strides;
using test::dtype_tag;
using test::expect_untouched_outside;
using test::fill_extreme;
using test::make_operand;
using test::make_view;
using test::Operand;
using test::product;
using test::read_view;
using test::Role;
using test::signed_tag;
using test::Style;
using test::style_for;
using test::tiny_step;
using test::unit_roundoff;
using test::write_view;

// ---------------------------------------------------------------------------------------
// The float64 reference, written from kernels/attention.h.

struct Problem {
  DType dtype = DType::kFloat32;  // of q, k, v: sets the compute precision
  int64_t batch = 1, lq = 0, lk = 0, d = 0;
  AttentionParams params;
  std::vector<double> q, k, v;  // [batch, lq or lk, d], as stored
  bool exact_scores = false;    // the scores are exact in the compute type (no dot error)
};

bool visible(const AttentionParams& p, int64_t i, int64_t j) {
  return !p.causal || j <= i + p.causal_offset;
}

// The documented mask: the Philox4x32-10 block of counter n = offset + (b * Lq + i) * Lk + j
// (words lo32(n), hi32(n), 0, 0) under key (lo32(seed), hi32(seed)); the element is kept
// when the top 24 bits of word 0, as a fraction of 2^24, are below 1 - dropout.
bool keep_element(const AttentionParams& p, int64_t lq, int64_t lk, int64_t b, int64_t i,
                  int64_t j) {
  const uint64_t n = p.offset + (static_cast<uint64_t>(b) * lq + i) * lk + j;
  const Philox4x32 counter = {{static_cast<uint32_t>(n), static_cast<uint32_t>(n >> 32), 0u, 0u}};
  const Philox4x32 r = philox4x32_10(counter, static_cast<uint32_t>(p.seed),
                                     static_cast<uint32_t>(p.seed >> 32));
  return static_cast<double>(r.w[0] >> 8) / 16777216.0 < 1 - p.dropout;
}

double dropout_factor(const Problem& pr, int64_t b, int64_t i, int64_t j) {
  if (pr.params.dropout == 0) return 1;
  return keep_element(pr.params, pr.lq, pr.lk, b, i, j) ? 1 / (1 - pr.params.dropout) : 0;
}

struct ForwardRef {
  std::vector<double> out, out_err;  // [batch, lq, d]
  std::vector<double> lse, lse_err;  // [batch, lq]
  std::vector<double> prob, factor;  // [batch, lq, lk]: softmax (0 where masked), dropout factor
  std::vector<double> prob_err;      // [batch, lq]: bound on the relative error of the kernel's p
};

ForwardRef reference_forward(const Problem& pr) {
  const int64_t lq = pr.lq, lk = pr.lk, d = pr.d;
  const double eps = compute_roundoff(pr.dtype), scale = pr.params.scale;
  ForwardRef f;
  f.out.assign(pr.batch * lq * d, 0);
  f.out_err.assign(pr.batch * lq * d, 0);
  f.lse.assign(pr.batch * lq, -kInf);
  f.lse_err.assign(pr.batch * lq, 0);
  f.prob.assign(pr.batch * lq * lk, 0);
  f.factor.assign(pr.batch * lq * lk, 0);
  f.prob_err.assign(pr.batch * lq, 0);
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = b * lq + i;
      const double* qi = &pr.q[row * d];
      std::vector<double> s(lk, -kInf);
      double max_score = -kInf, max_abs_terms = 0;
      for (int64_t j = 0; j < lk; ++j) {
        if (!visible(pr.params, i, j)) continue;
        const double* kj = &pr.k[(b * lk + j) * d];
        double dot = 0, abs_terms = 0;
        for (int64_t c = 0; c < d; ++c) {
          dot += qi[c] * kj[c];
          abs_terms += std::fabs(qi[c] * kj[c]);
        }
        s[j] = scale * dot;
        max_score = std::max(max_score, s[j]);
        max_abs_terms = std::max(max_abs_terms, std::fabs(scale) * abs_terms);
      }
      if (max_score == -kInf) continue;  // no visible key: out 0, lse -inf
      double sum = 0;
      for (int64_t j = 0; j < lk; ++j) sum += std::exp(s[j] - max_score);
      const double lse = max_score + std::log(sum);
      const double rel = eps * (d + 16) * (2 + (pr.exact_scores ? 0 : max_abs_terms)) +
                         eps * (lk + 16);
      f.lse[row] = lse;
      f.lse_err[row] = rel;
      f.prob_err[row] = rel;
      for (int64_t j = 0; j < lk; ++j) {
        if (s[j] == -kInf) continue;
        const double p = std::exp(s[j] - lse), factor = dropout_factor(pr, b, i, j);
        f.prob[row * lk + j] = p;
        f.factor[row * lk + j] = factor;
        for (int64_t c = 0; c < d; ++c) {
          const double term = p * factor * pr.v[(b * lk + j) * d + c];
          f.out[row * d + c] += term;
          f.out_err[row * d + c] += rel * std::fabs(term);
        }
      }
    }
  }
  return f;
}

struct GradRef {
  std::vector<double> dq, dk, dv;              // like q, k, v
  std::vector<double> dq_err, dk_err, dv_err;  // compute-error bounds
};

// Gradients of L with dL/dout = g and dL/dlse = gl (empty: none), through the softmax
// Jacobian dp_j / ds_k = p_j (delta_jk - p_k) and dlse / ds_k = p_k. The kernel is given
// out rounded to `out_dtype` and lse rounded to float32; the error bounds include both.
GradRef reference_backward(const Problem& pr, const ForwardRef& f, const std::vector<double>& g,
                           const std::vector<double>& gl, DType out_dtype) {
  const int64_t lq = pr.lq, lk = pr.lk, d = pr.d;
  const double eps = compute_roundoff(pr.dtype), eps_out = unit_roundoff(out_dtype);
  const double eps_lse = unit_roundoff(DType::kFloat32), scale = pr.params.scale;
  GradRef r;
  r.dq.assign(pr.q.size(), 0);
  r.dq_err.assign(pr.q.size(), 0);
  r.dk.assign(pr.k.size(), 0);
  r.dk_err.assign(pr.k.size(), 0);
  r.dv.assign(pr.v.size(), 0);
  r.dv_err.assign(pr.v.size(), 0);
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = b * lq + i;
      if (f.lse[row] == -kInf) continue;
      const double* gi = &g[row * d];
      const double* qi = &pr.q[row * d];
      const double* p = &f.prob[row * lk];
      const double* factor = &f.factor[row * lk];
      const double grad_lse = gl.empty() ? 0 : gl[row];
      const double rel = f.prob_err[row] + 2 * eps_lse * std::fabs(f.lse[row]);
      std::vector<double> dp(lk, 0), dp_abs(lk, 0);
      double delta_abs = std::fabs(grad_lse), go_abs = 0;
      for (int64_t c = 0; c < d; ++c) go_abs += std::fabs(gi[c] * f.out[row * d + c]);
      for (int64_t j = 0; j < lk; ++j) {
        if (p[j] == 0) continue;
        for (int64_t c = 0; c < d; ++c) {
          dp[j] += gi[c] * pr.v[(b * lk + j) * d + c];
          dp_abs[j] += std::fabs(gi[c] * pr.v[(b * lk + j) * d + c]);
        }
        dp[j] *= factor[j];
        dp_abs[j] *= factor[j];
        delta_abs += std::fabs(dp[j]) * p[j];
      }
      const double delta_err = 2 * eps_out * go_abs + eps * (d + 16) * (go_abs + std::fabs(grad_lse));
      for (int64_t k = 0; k < lk; ++k) {
        if (p[k] == 0) continue;
        double ds = grad_lse * p[k];
        for (int64_t j = 0; j < lk; ++j) ds += dp[j] * p[j] * ((j == k ? 1.0 : 0.0) - p[k]);
        const double ds_err =
            p[k] * (rel * (std::fabs(dp[k]) + delta_abs) + eps * (d + 16) * dp_abs[k] + delta_err);
        const double* kk = &pr.k[(b * lk + k) * d];
        for (int64_t c = 0; c < d; ++c) {
          const int64_t qc = row * d + c, kc = (b * lk + k) * d + c;
          r.dq[qc] += scale * ds * kk[c];
          r.dq_err[qc] += std::fabs(scale) * (ds_err * std::fabs(kk[c]) +
                                              eps * (lk + 16) * std::fabs(ds * kk[c]));
          r.dk[kc] += scale * ds * qi[c];
          r.dk_err[kc] += std::fabs(scale) * (ds_err * std::fabs(qi[c]) +
                                              eps * (lq + 16) * std::fabs(ds * qi[c]));
          const double dv = p[k] * factor[k] * gi[c];
          r.dv[kc] += dv;
          r.dv_err[kc] += (rel + eps * (lq + 16)) * std::fabs(dv);
        }
      }
    }
  }
  return r;
}

// Expects |got - want| <= err + 2 u (|want| + |base|) + tiny elementwise, u the unit
// roundoff of the stored dtype and base the value an accumulated output started from.
// Infinite wants must match exactly; NaN always fails.
void expect_close(const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want, const std::vector<double>& err, DType stored,
                  const std::vector<double>* base = nullptr) {
  const double u = unit_roundoff(stored), tiny = tiny_step(stored);
  test::expect_elementwise_close(what, got, want, [&](size_t e) {
    return err[e] + 2 * u * (std::fabs(want[e]) + (base ? std::fabs((*base)[e]) : 0)) + tiny;
  });
}

std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r(a.size());
  for (size_t e = 0; e < a.size(); ++e) r[e] = a[e] + b[e];
  return r;
}

// ---------------------------------------------------------------------------------------
// Case-driven tests: forward and backward of the CPU kernel against the reference.

// Small sizes by default: the float64 reference backward is quadratic in lk per query row.
using Case = test::AttentionCase</*kDefaultLq=*/9, /*kDefaultLk=*/13>;

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType t : kFloatTypes) {
    for (int64_t d : {16, 64, 128, 256}) {
      cases.push_back({.name = dtype_tag(t) + "_d" + std::to_string(d), .dtype = t, .d = d});
    }
  }
  const std::vector<std::pair<std::string, Shape>> batches = {
      {"no_batch", {}}, {"batch3", {3}}, {"batch2x3", {2, 3}}, {"batch2x1x3", {2, 1, 3}},
      {"batch1x2x1x2", {1, 2, 1, 2}}};
  for (const auto& [name, batch] : batches) cases.push_back({.name = name, .batch = batch});
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    for (auto [lq, lk] : {std::pair{6, 10}, std::pair{10, 6}}) {
      for (int64_t offset : {0, 3, -2}) {
        cases.push_back({.name = dtype_tag(t) + "_causal_q" + std::to_string(lq) + "_k" +
                                 std::to_string(lk) + "_offset" + signed_tag(offset),
                         .dtype = t, .lq = lq, .lk = lk, .causal = true, .causal_offset = offset});
      }
    }
  }
  cases.push_back({.name = "causal_every_row_masked", .causal = true, .causal_offset = -20});
  cases.push_back({.name = "causal_offset_past_the_end", .causal = true, .causal_offset = 100});
  cases.push_back({.name = "no_keys", .lk = 0});
  cases.push_back({.name = "no_queries", .lq = 0});
  // Several query blocks and key tiles (32 queries, 64 keys per tile in the kernel).
  cases.push_back({.name = "tiles_f32_causal", .lq = 70, .lk = 150, .causal = true, .causal_offset = 5});
  cases.push_back({.name = "tiles_f16_causal_dropout", .dtype = DType::kFloat16, .lq = 70,
                   .lk = 150, .causal = true, .causal_offset = 5, .dropout = 0.3});
  cases.push_back({.name = "tiles_f64_negative_offset", .dtype = DType::kFloat64, .lq = 100,
                   .lk = 70, .causal = true, .causal_offset = -40});
  cases.push_back({.name = "bf16_with_float32_out_and_grads", .dtype = DType::kBFloat16,
                   .out_dtype = DType::kFloat32, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "f16_with_float32_out", .dtype = DType::kFloat16, .out_dtype = DType::kFloat32});
  cases.push_back({.name = "f64_with_float32_grads", .dtype = DType::kFloat64, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "f32_no_lse", .lse = false});
  cases.push_back({.name = "bf16_no_lse", .dtype = DType::kBFloat16, .lse = false});
  cases.push_back({.name = "f32_no_grad_lse", .grad_lse = false});
  cases.push_back({.name = "f16_no_grad_lse_causal", .dtype = DType::kFloat16, .causal = true,
                   .grad_lse = false});
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    cases.push_back({.name = dtype_tag(t) + "_dropout", .dtype = t, .dropout = 0.25});
  }
  cases.push_back({.name = "dropout_half_causal", .causal = true, .causal_offset = 2, .dropout = 0.5});
  cases.push_back({.name = "odd_d_custom_scale", .d = 3, .scale = 0.7});
  cases.push_back({.name = "negative_scale", .d = 5, .scale = -0.3});
  cases.push_back({.name = "strided_f32", .batch = {2, 3}, .layout = AttentionLayout::kStrided});
  cases.push_back({.name = "strided_bf16_causal_dropout", .dtype = DType::kBFloat16,
                   .causal = true, .causal_offset = 1, .dropout = 0.2,
                   .layout = AttentionLayout::kStrided});
  cases.push_back({.name = "strided_f64_no_batch", .dtype = DType::kFloat64, .batch = {},
                   .layout = AttentionLayout::kStrided});
  for (DType t : kFloatTypes) {
    cases.push_back({.name = "dilated_" + dtype_tag(t), .dtype = t, .batch = {2, 2, 3}, .lq = 4,
                     .lk = 4, .layout = AttentionLayout::kDilated});
  }
  cases.push_back({.name = "dilated_causal_dropout", .batch = {2, 3, 2}, .lq = 6, .lk = 6,
                   .causal = true, .dropout = 0.3, .layout = AttentionLayout::kDilated});
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    cases.push_back({.name = "extreme_" + dtype_tag(t), .dtype = t, .lq = 8, .lk = 11,
                     .scale = 1.0, .values = AttentionValues::kExtreme});
  }
  cases.push_back({.name = "extreme_causal_f32", .lq = 8, .lk = 11, .scale = 1.0, .causal = true,
                   .causal_offset = 1, .values = AttentionValues::kExtreme});
  // A key visiting order changes only the order of the sums: the reference ignores it.
  for (DType t : kFloatTypes) {
    cases.push_back({.name = "key_order_" + dtype_tag(t), .dtype = t, .key_order = true});
  }
  cases.push_back({.name = "key_order_tiles_causal_dropout", .lq = 70, .lk = 150, .causal = true,
                   .causal_offset = 5, .dropout = 0.3, .key_order = true});
  cases.push_back({.name = "key_order_causal_negative_offset", .dtype = DType::kFloat64, .lq = 100,
                   .lk = 70, .causal = true, .causal_offset = -40, .key_order = true});
  cases.push_back({.name = "key_order_strided_bf16_causal", .dtype = DType::kBFloat16, .causal = true,
                   .causal_offset = 1, .layout = AttentionLayout::kStrided, .key_order = true});
  return cases;
}

class AttentionCaseTest : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCaseTest, ForwardAndBackwardMatchTheReference) {
  const Case& c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(c.name));
  const DType out_dtype = c.out_dtype.value_or(c.dtype);
  const DType grad_dtype = c.grad_dtype.value_or(c.dtype);
  const Shape q_shape = concat(c.batch, {c.lq, c.d}), k_shape = concat(c.batch, {c.lk, c.d});
  const Shape lse_shape = concat(c.batch, {c.lq});
  auto operand = [&](Role role, DType dtype, const Shape& shape) {
    return make_operand(dtype, shape, style_for(c.layout, role));
  };

  Operand q = operand(Role::kQ, c.dtype, q_shape), k = operand(Role::kK, c.dtype, k_shape);
  Operand v = operand(Role::kV, c.dtype, k_shape);
  q.buffer.fill_uniform(rng);
  k.buffer.fill_uniform(rng);
  v.buffer.fill_uniform(rng);
  if (c.values == AttentionValues::kExtreme) {
    fill_extreme(q.view, /*alternate_sign=*/true);
    fill_extreme(k.view, /*alternate_sign=*/false);
  }
  Problem pr;
  pr.dtype = c.dtype;
  pr.batch = product(c.batch);
  pr.lq = c.lq;
  pr.lk = c.lk;
  pr.d = c.d;
  pr.params.scale = c.scale.value_or(1 / std::sqrt(static_cast<double>(c.d)));
  pr.params.causal = c.causal;
  pr.params.causal_offset = c.causal_offset;
  pr.params.dropout = c.dropout;
  pr.params.seed = 0x9e3779b97f4a7c15ull;
  pr.params.offset = 12345;
  std::vector<int64_t> key_order(static_cast<size_t>(c.lk));
  std::iota(key_order.begin(), key_order.end(), int64_t{0});
  if (c.key_order) {
    std::shuffle(key_order.begin(), key_order.end(), rng);
    pr.params.key_order = key_order.data();
  }
  pr.q = read_view(q.view);
  pr.k = read_view(k.view);
  pr.v = read_view(v.view);
  pr.exact_scores = c.values == AttentionValues::kExtreme;
  const ForwardRef ref = reference_forward(pr);

  // Forward, into poisoned outputs.
  Operand out = operand(Role::kOut, out_dtype, q_shape);
  Operand lse = operand(Role::kLse, DType::kFloat32, lse_shape);
  out.buffer.poison();
  lse.buffer.poison();
  const auto out_before = out.buffer.bytes(), lse_before = lse.buffer.bytes();
  AttentionForwardArgs args;
  args.q = q.view;
  args.k = k.view;
  args.v = v.view;
  args.out = out.view;
  if (c.lse) args.lse = lse.view;
  args.params = pr.params;
  cpu::attention_forward(args);
  expect_close("out", read_view(out.view), ref.out, ref.out_err, out_dtype);
  expect_untouched_outside("out", out, out_before);
  if (c.lse) {
    expect_close("lse", read_view(lse.view), ref.lse, ref.lse_err, DType::kFloat32);
    expect_untouched_outside("lse", lse, lse_before);
  } else {
    EXPECT_EQ(lse.buffer.bytes(), lse_before) << "lse was written though its data is null";
  }
  // Rows that see no key: exactly 0 and -inf.
  const std::vector<double> got_out = read_view(out.view), got_lse = read_view(lse.view);
  for (int64_t row = 0; row < pr.batch * c.lq; ++row) {
    if (ref.lse[row] != -kInf) continue;
    for (int64_t col = 0; col < c.d; ++col) {
      ASSERT_EQ(got_out[row * c.d + col], 0.0) << "row " << row;
    }
    if (c.lse) {
      ASSERT_EQ(got_lse[row], -kInf) << "row " << row;
    }
  }

  // Backward from the reference's out and lse (rounded to their dtypes), accumulating into
  // gradients that start from random values.
  write_view(out.view, ref.out);
  write_view(lse.view, ref.lse);
  Operand grad_out = operand(Role::kGradOut, out_dtype, q_shape);
  Operand grad_lse = operand(Role::kGradLse, DType::kFloat32, lse_shape);
  Operand grad_q = operand(Role::kGradQ, grad_dtype, q_shape);
  Operand grad_k = operand(Role::kGradK, grad_dtype, k_shape);
  Operand grad_v = operand(Role::kGradV, grad_dtype, k_shape);
  for (Operand* o : {&grad_out, &grad_lse, &grad_q, &grad_k, &grad_v}) o->buffer.fill_uniform(rng);
  const std::vector<double> g0_q = read_view(grad_q.view), g0_k = read_view(grad_k.view),
                            g0_v = read_view(grad_v.view);
  const auto q_before = grad_q.buffer.bytes(), k_before = grad_k.buffer.bytes(),
             v_before = grad_v.buffer.bytes();
  AttentionBackwardArgs bargs;
  bargs.q = q.view;
  bargs.k = k.view;
  bargs.v = v.view;
  bargs.out = out.view;
  bargs.lse = lse.view;
  bargs.grad_out = grad_out.view;
  if (c.grad_lse) bargs.grad_lse = grad_lse.view;
  bargs.grad_q = grad_q.view;
  bargs.grad_k = grad_k.view;
  bargs.grad_v = grad_v.view;
  bargs.params = pr.params;
  cpu::attention_backward(bargs);
  const GradRef gr = reference_backward(
      pr, ref, read_view(grad_out.view),
      c.grad_lse ? read_view(grad_lse.view) : std::vector<double>{}, out_dtype);
  expect_close("grad_q", read_view(grad_q.view), plus(g0_q, gr.dq), gr.dq_err, grad_dtype, &g0_q);
  expect_close("grad_k", read_view(grad_k.view), plus(g0_k, gr.dk), gr.dk_err, grad_dtype, &g0_k);
  expect_close("grad_v", read_view(grad_v.view), plus(g0_v, gr.dv), gr.dv_err, grad_dtype, &g0_v);
  expect_untouched_outside("grad_q", grad_q, q_before);
  expect_untouched_outside("grad_k", grad_k, k_before);
  expect_untouched_outside("grad_v", grad_v, v_before);
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionCaseTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------
// Small contiguous problems for the tests below.

struct Contiguous {
  Operand q, k, v, out, lse;
  AttentionParams params;
  Shape q_shape, k_shape, lse_shape;

  Contiguous(DType dtype, const Shape& batch, int64_t lq, int64_t lk, int64_t d,
             std::mt19937_64& rng)
      : q_shape(concat(batch, {lq, d})), k_shape(concat(batch, {lk, d})), lse_shape(concat(batch, {lq})) {
    q = make_operand(dtype, q_shape, Style::kPlain);
    k = make_operand(dtype, k_shape, Style::kPlain);
    v = make_operand(dtype, k_shape, Style::kPlain);
    out = make_operand(dtype, q_shape, Style::kPlain);
    lse = make_operand(DType::kFloat32, lse_shape, Style::kPlain);
    q.buffer.fill_uniform(rng);
    k.buffer.fill_uniform(rng);
    v.buffer.fill_uniform(rng);
    params.scale = 1 / std::sqrt(static_cast<double>(d));
  }
  void forward() {
    AttentionForwardArgs args;
    args.q = q.view;
    args.k = k.view;
    args.v = v.view;
    args.out = out.view;
    args.lse = lse.view;
    args.params = params;
    cpu::attention_forward(args);
  }
  // Adds the gradients for dL/dout = grad_out and dL/dlse = grad_lse into the grads.
  void backward(const Operand& grad_out, const Operand& grad_lse, Operand& grad_q,
                Operand& grad_k, Operand& grad_v) const {
    AttentionBackwardArgs args;
    args.q = q.view;
    args.k = k.view;
    args.v = v.view;
    args.out = out.view;
    args.lse = lse.view;
    args.grad_out = grad_out.view;
    args.grad_lse = grad_lse.view;
    args.grad_q = grad_q.view;
    args.grad_k = grad_k.view;
    args.grad_v = grad_v.view;
    args.params = params;
    cpu::attention_backward(args);
  }
};

// ---------------------------------------------------------------------------------------
// Gradients against float64 finite differences of L = sum(out * W) + sum(lse * U) (rows
// whose lse is -inf, which no input moves, left out). The two terms are checked apart:
// out is float64, so its term takes a small central step and a tight tolerance; lse is
// float32 by contract, so its term takes a wide five-point stencil (truncation O(h^4))
// whose tolerance covers float32 rounding of lse divided by the step.

struct FdCase {
  const char* name;
  bool causal;
  int64_t causal_offset;
  double dropout;
  double scale;
};

struct FdTerm {
  const char* name;
  bool out_term;   // true: L = sum(out * W); false: L = sum(lse * U)
  double step;
  double tolerance;  // relative to 1 + |numeric gradient|
};

TEST(AttentionKernelTest, GradientsMatchFiniteDifferences) {
  const FdCase cases[] = {
      {"plain", false, 0, 0.0, 0.5},
      {"causal", true, 0, 0.0, 0.5},
      {"causal_masked_rows", true, -2, 0.0, 0.5},
      {"causal_dropout", true, 1, 0.4, 0.5},
      {"dropout", false, 0, 0.5, 0.5},
      {"negative_scale", false, 0, 0.0, -0.8},
  };
  const FdTerm terms[] = {{"out term", true, 1e-5, 1e-7}, {"lse term", false, 0.02, 3e-4}};
  for (const FdCase& fc : cases) {
    for (const FdTerm& term : terms) {
      SCOPED_TRACE(std::string(fc.name) + ", " + term.name);
      std::mt19937_64 rng(7);
      Contiguous p(DType::kFloat64, {2}, 4, 5, 3, rng);
      p.params.causal = fc.causal;
      p.params.causal_offset = fc.causal_offset;
      p.params.dropout = fc.dropout;
      p.params.scale = fc.scale;
      p.params.seed = 99;
      p.params.offset = 5;
      Operand w = make_operand(DType::kFloat64, p.q_shape, Style::kPlain);
      Operand u = make_operand(DType::kFloat32, p.lse_shape, Style::kPlain);
      if (term.out_term) {
        w.buffer.fill_uniform(rng);
      } else {
        u.buffer.fill_uniform(rng);
      }
      auto loss = [&]() {
        p.forward();
        double l = 0;
        for (int64_t e = 0; e < p.out.buffer.count(); ++e) {
          l += p.out.buffer.get(e) * w.buffer.get(e);
        }
        for (int64_t e = 0; e < p.lse.buffer.count(); ++e) {
          if (p.lse.buffer.get(e) != -kInf) l += p.lse.buffer.get(e) * u.buffer.get(e);
        }
        return l;
      };
      loss();  // out and lse of the unperturbed inputs, for the backward
      Operand grad_q = make_operand(DType::kFloat64, p.q_shape, Style::kPlain);
      Operand grad_k = make_operand(DType::kFloat64, p.k_shape, Style::kPlain);
      Operand grad_v = make_operand(DType::kFloat64, p.k_shape, Style::kPlain);
      p.backward(w, u, grad_q, grad_k, grad_v);
      int64_t masked_rows = 0;
      for (int64_t e = 0; e < p.lse.buffer.count(); ++e) masked_rows += p.lse.buffer.get(e) == -kInf;
      EXPECT_EQ(masked_rows, fc.causal_offset < 0 ? -fc.causal_offset * 2 : 0);

      const double h = term.step;
      for (auto [input, grad, name] : {std::tuple{&p.q, &grad_q, "q"},
                                       std::tuple{&p.k, &grad_k, "k"},
                                       std::tuple{&p.v, &grad_v, "v"}}) {
        for (int64_t e = 0; e < input->buffer.count(); ++e) {
          const double x = input->buffer.get(e);
          auto at = [&](double dx) {
            input->buffer.set(e, x + dx);
            const double l = loss();
            input->buffer.set(e, x);
            return l;
          };
          const double numeric =
              term.out_term ? (at(h) - at(-h)) / (2 * h)
                            : (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h);
          EXPECT_NEAR(grad->buffer.get(e), numeric, term.tolerance * (1 + std::fabs(numeric)))
              << "d loss / d " << name << "[" << e << "]";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// A call split over two key ranges, merged through the log-sum-exp: the merged forward is
// the full call's, and the backward of each part, given the merged out and lse, adds up to
// the full call's gradient (the contract of AttentionBackwardArgs).

TEST(AttentionKernelTest, SplitKeysMergeToTheFullCall) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    constexpr int64_t kLq = 7, kLk = 10, kSplit = 4, kD = 8;
    std::mt19937_64 rng(11);
    Contiguous full(DType::kFloat64, {2}, kLq, kLk, kD, rng);
    full.params.causal = causal;
    full.params.causal_offset = 1;
    full.forward();

    // The key ranges [0, kSplit) and [kSplit, kLk) as views of the same k and v.
    auto key_range = [&](const StridedView& whole, int64_t begin, int64_t end) {
      StridedView part = whole;
      part.data = static_cast<double*>(whole.data) + begin * whole.strides[1];
      part.shape[1] = end - begin;
      return part;
    };
    const std::pair<int64_t, int64_t> ranges[] = {{0, kSplit}, {kSplit, kLk}};
    std::vector<Operand> outs, lses;
    for (auto [begin, end] : ranges) {
      outs.push_back(make_operand(DType::kFloat64, full.q_shape, Style::kPlain));
      lses.push_back(make_operand(DType::kFloat32, full.lse_shape, Style::kPlain));
      AttentionForwardArgs args;
      args.q = full.q.view;
      args.k = key_range(full.k.view, begin, end);
      args.v = key_range(full.v.view, begin, end);
      args.out = outs.back().view;
      args.lse = lses.back().view;
      args.params = full.params;
      args.params.causal_offset -= begin;  // key j of the part is key begin + j of the whole
      cpu::attention_forward(args);
    }
    for (int64_t row = 0; row < full.lse.buffer.count(); ++row) {
      const double a = lses[0].buffer.get(row), b = lses[1].buffer.get(row);
      const double merged = std::max(a, b) + std::log(std::exp(a - std::max(a, b)) +
                                                      std::exp(b - std::max(a, b)));
      EXPECT_NEAR(merged, full.lse.buffer.get(row), 1e-6) << "lse row " << row;
      for (int64_t c = 0; c < kD; ++c) {
        const int64_t e = row * kD + c;
        const double o = std::exp(a - merged) * outs[0].buffer.get(e) +
                         std::exp(b - merged) * outs[1].buffer.get(e);
        EXPECT_NEAR(o, full.out.buffer.get(e), 1e-6) << "out element " << e;
      }
    }

    Operand grad_out = make_operand(DType::kFloat64, full.q_shape, Style::kPlain);
    Operand grad_lse = make_operand(DType::kFloat32, full.lse_shape, Style::kPlain);
    grad_out.buffer.fill_uniform(rng);
    grad_lse.buffer.fill_uniform(rng);
    Operand want_q = make_operand(DType::kFloat64, full.q_shape, Style::kPlain);
    Operand want_k = make_operand(DType::kFloat64, full.k_shape, Style::kPlain);
    Operand want_v = make_operand(DType::kFloat64, full.k_shape, Style::kPlain);
    full.backward(grad_out, grad_lse, want_q, want_k, want_v);
    Operand got_q = make_operand(DType::kFloat64, full.q_shape, Style::kPlain);
    Operand got_k = make_operand(DType::kFloat64, full.k_shape, Style::kPlain);
    Operand got_v = make_operand(DType::kFloat64, full.k_shape, Style::kPlain);
    for (auto [begin, end] : ranges) {
      AttentionBackwardArgs args;
      args.q = full.q.view;
      args.k = key_range(full.k.view, begin, end);
      args.v = key_range(full.v.view, begin, end);
      args.out = full.out.view;  // the merged result
      args.lse = full.lse.view;
      args.grad_out = grad_out.view;
      args.grad_lse = grad_lse.view;
      args.grad_q = got_q.view;  // both parts add into it
      args.grad_k = key_range(got_k.view, begin, end);
      args.grad_v = key_range(got_v.view, begin, end);
      args.params = full.params;
      args.params.causal_offset -= begin;
      cpu::attention_backward(args);
    }
    for (auto [got, want, name] : {std::tuple{&got_q, &want_q, "grad_q"},
                                   std::tuple{&got_k, &want_k, "grad_k"},
                                   std::tuple{&got_v, &want_v, "grad_v"}}) {
      for (int64_t e = 0; e < got->buffer.count(); ++e) {
        const double w = want->buffer.get(e);
        EXPECT_NEAR(got->buffer.get(e), w, 1e-12 * (1 + std::fabs(w))) << name << "[" << e << "]";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dropout: with v the identity (Lk <= D), out[b, i, j] = p[i, j] * keep / (1 - dropout), so
// the mask can be read off the output exactly.

struct MaskRun {
  std::vector<bool> dropped;  // [batch, lq, lk]
  std::vector<unsigned char> out_bytes;
};

TEST(AttentionKernelTest, DropoutMaskIsTheDocumentedPhiloxMask) {
  constexpr int64_t kBatch = 3, kLq = 20, kLk = 16, kD = 16;
  constexpr double kDropout = 0.3;
  std::mt19937_64 rng(5);
  Contiguous p(DType::kFloat64, {kBatch}, kLq, kLk, kD, rng);
  for (int64_t e = 0; e < p.v.buffer.count(); ++e) {
    p.v.buffer.set(e, (e / kD) % kLk == e % kD ? 1.0 : 0.0);
  }
  p.params.dropout = kDropout;
  p.params.seed = 0x0123456789abcdefull;
  p.params.offset = 777;
  auto run = [&](uint64_t seed, uint64_t offset) {
    p.params.seed = seed;
    p.params.offset = offset;
    p.forward();
    MaskRun r;
    for (int64_t e = 0; e < p.out.buffer.count(); ++e) r.dropped.push_back(p.out.buffer.get(e) == 0);
    r.out_bytes = p.out.buffer.bytes();
    return r;
  };
  const MaskRun first = run(0x0123456789abcdefull, 777);

  // Equal to the documented mask, with kept elements scaled by 1 / (1 - dropout).
  Problem pr;
  pr.dtype = DType::kFloat64;
  pr.batch = kBatch;
  pr.lq = kLq;
  pr.lk = kLk;
  pr.d = kD;
  pr.params = p.params;
  pr.q = read_view(p.q.view);
  pr.k = read_view(p.k.view);
  pr.v = read_view(p.v.view);
  const ForwardRef ref = reference_forward(pr);
  int64_t dropped = 0, mismatches = 0;
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t i = 0; i < kLq; ++i) {
      for (int64_t j = 0; j < kLk; ++j) {
        const int64_t e = (b * kLq + i) * kD + j;
        const bool keep = keep_element(p.params, kLq, kLk, b, i, j);
        dropped += !keep;
        mismatches += first.dropped[e] == keep;
        if (keep) {
          const double want = ref.prob[(b * kLq + i) * kLk + j] / (1 - kDropout);
          EXPECT_NEAR(p.out.buffer.get(e), want, 1e-14) << "element " << e;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  // The drop rate is the requested one (960 draws: 5 standard deviations is ~71).
  const double expected = kDropout * kBatch * kLq * kLk;
  EXPECT_NEAR(static_cast<double>(dropped), expected, 5 * std::sqrt(expected * (1 - kDropout)));

  // Reproducible, bit for bit.
  EXPECT_EQ(run(0x0123456789abcdefull, 777).out_bytes, first.out_bytes);
  // Another seed draws another mask.
  EXPECT_NE(run(0x0123456789abcdeeull, 777).dropped, first.dropped);
  // The offset moves along the stream: offset + Lk gives row i the mask row i + 1 had.
  const MaskRun shifted = run(0x0123456789abcdefull, 777 + kLk);
  for (int64_t row = 0; row + 1 < kBatch * kLq; ++row) {
    for (int64_t j = 0; j < kLk; ++j) {
      ASSERT_EQ(shifted.dropped[row * kD + j], first.dropped[(row + 1) * kD + j])
          << "row " << row << " key " << j;
    }
  }
}

TEST(AttentionKernelTest, ResultsDoNotDependOnTheThreadCount) {
  std::mt19937_64 rng(3);
  Contiguous p(DType::kFloat32, {4}, 70, 130, 64, rng);
  p.params.causal = true;
  p.params.causal_offset = 3;
  p.params.dropout = 0.1;
  Operand grad_out = make_operand(DType::kFloat32, p.q_shape, Style::kPlain);
  Operand grad_lse = make_operand(DType::kFloat32, p.lse_shape, Style::kPlain);
  grad_out.buffer.fill_uniform(rng);
  grad_lse.buffer.fill_uniform(rng);
  auto run = [&](int threads) {
    cpu::set_num_threads(threads);
    p.forward();
    Operand gq = make_operand(DType::kFloat32, p.q_shape, Style::kPlain);
    Operand gk = make_operand(DType::kFloat32, p.k_shape, Style::kPlain);
    Operand gv = make_operand(DType::kFloat32, p.k_shape, Style::kPlain);
    p.backward(grad_out, grad_lse, gq, gk, gv);
    return std::vector<std::vector<unsigned char>>{p.out.buffer.bytes(), p.lse.buffer.bytes(),
                                                   gq.buffer.bytes(), gk.buffer.bytes(),
                                                   gv.buffer.bytes()};
  };
  const int saved = cpu::num_threads();
  const auto one = run(1);
  const auto three = run(3);
  cpu::set_num_threads(saved);
  EXPECT_TRUE(one == three);
}

// ---------------------------------------------------------------------------------------
// Argument checks: each bad argument is an rd::Error naming the op and the argument.

template <class F>
void expect_error(const F& call, ErrorCode code, const std::vector<std::string>& pieces) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing '" << pieces.front() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& piece : pieces) {
      EXPECT_NE(std::string(e.what()).find(piece), std::string::npos)
          << "message '" << e.what() << "' lacks '" << piece << "'";
    }
  }
}

TEST(AttentionKernelTest, BadArgumentsAreClearErrors) {
  std::vector<double> memory(4096, 0.0);  // room for any of the views below
  void* m = memory.data();
  const DType f32 = DType::kFloat32;
  AttentionForwardArgs good;
  good.q = make_view(m, f32, {2, 5, 8});
  good.k = make_view(m, f32, {2, 6, 8});
  good.v = make_view(m, f32, {2, 6, 8});
  good.out = make_view(m, f32, {2, 5, 8});
  good.lse = make_view(m, f32, {2, 5});
  good.params.scale = 0.5;
  EXPECT_NO_THROW(check_attention_forward_args(good));

  using Edit = std::function<void(AttentionForwardArgs&)>;
  struct ForwardBad {
    Edit edit;
    ErrorCode code;
    std::vector<std::string> pieces;
  };
  const std::vector<ForwardBad> forward_cases = {
      {[&](auto& a) { a.q = make_view(m, f32, {8}); }, ErrorCode::kShapeMismatch,
       {"attention: argument 'q'", "[8]"}},
      {[&](auto& a) { a.q.dtype = a.k.dtype = a.v.dtype = DType::kInt32; },
       ErrorCode::kDTypeMismatch, {"attention: argument 'q'", "floating"}},
      {[&](auto& a) { a.k.dtype = DType::kFloat64; }, ErrorCode::kDTypeMismatch,
       {"attention: argument 'k'", "float64"}},
      {[&](auto& a) { a.k = make_view(m, f32, {3, 6, 8}); }, ErrorCode::kShapeMismatch,
       {"argument 'k' has shape [3, 6, 8]", "[2, 5, 8]"}},
      {[&](auto& a) { a.v = make_view(m, f32, {2, 6, 4}); }, ErrorCode::kShapeMismatch,
       {"argument 'v' has shape [2, 6, 4]"}},
      {[&](auto& a) { a.v = make_view(m, f32, {2, 7, 8}); }, ErrorCode::kShapeMismatch,
       {"argument 'v' has shape [2, 7, 8] but 'k' has shape [2, 6, 8]"}},
      {[&](auto& a) { a.k = make_view(m, f32, {2, 3, 6, 8}); a.v = a.k; }, ErrorCode::kShapeMismatch,
       {"argument 'k' has shape [2, 3, 6, 8]"}},
      {[&](auto& a) { a.out = make_view(m, f32, {2, 5, 4}); }, ErrorCode::kShapeMismatch,
       {"argument 'out' has shape [2, 5, 4]"}},
      {[&](auto& a) { a.out.dtype = DType::kFloat64; }, ErrorCode::kDTypeMismatch,
       {"argument 'out' has dtype float64"}},
      {[&](auto& a) { a.out.dtype = DType::kBFloat16; }, ErrorCode::kDTypeMismatch,
       {"argument 'out' has dtype bfloat16"}},
      {[&](auto& a) { a.lse.dtype = DType::kFloat64; }, ErrorCode::kDTypeMismatch,
       {"argument 'lse' has dtype float64"}},
      {[&](auto& a) { a.lse = make_view(m, f32, {2, 6}); }, ErrorCode::kShapeMismatch,
       {"argument 'lse' has shape [2, 6]"}},
      {[&](auto& a) { a.lse = make_view(m, f32, {2, 5, 1}); }, ErrorCode::kShapeMismatch,
       {"argument 'lse' has shape [2, 5, 1]"}},
      {[&](auto& a) { a.params.dropout = 1.0; }, ErrorCode::kInvalidArgument,
       {"attention: argument 'dropout'", "[0, 1)"}},
      {[&](auto& a) { a.params.dropout = -0.1; }, ErrorCode::kInvalidArgument, {"'dropout'"}},
      {[&](auto& a) { a.params.dropout = std::nan(""); }, ErrorCode::kInvalidArgument, {"'dropout'"}},
      {[&](auto& a) { a.params.scale = kInf; }, ErrorCode::kInvalidArgument, {"argument 'scale'"}},
      {[&](auto& a) { a.params.scale = std::nan(""); }, ErrorCode::kInvalidArgument, {"'scale'"}},
      {[&](auto& a) { a.out = make_view(m, f32, {2, 5, 8}, {40, 0, 1}); },
       ErrorCode::kInvalidArgument, {"attention: output 'out' overlaps itself", "[2, 5, 8]"}},
      {[&](auto& a) { a.lse = make_view(m, f32, {2, 5}, {1, 1}); }, ErrorCode::kInvalidArgument,
       {"output 'lse' overlaps itself"}},
      {[&](auto& a) { a.q.data = nullptr; }, ErrorCode::kInvalidArgument,
       {"argument 'q' has no data"}},
  };
  for (size_t n = 0; n < forward_cases.size(); ++n) {
    SCOPED_TRACE("forward case " + std::to_string(n));
    AttentionForwardArgs args = good;
    forward_cases[n].edit(args);
    expect_error([&] { check_attention_forward_args(args); }, forward_cases[n].code,
                 forward_cases[n].pieces);
  }
  // The kernel checks before it runs.
  AttentionForwardArgs bad_dropout = good;
  bad_dropout.params.dropout = 2;
  expect_error([&] { cpu::attention_forward(bad_dropout); }, ErrorCode::kInvalidArgument,
               {"attention: argument 'dropout'"});

  // Accepted: float32 out for 16-bit inputs, no lse, negative and zero input strides.
  AttentionForwardArgs mixed = good;
  mixed.q.dtype = mixed.k.dtype = mixed.v.dtype = DType::kBFloat16;
  EXPECT_NO_THROW(check_attention_forward_args(mixed));
  mixed.lse = StridedView{};
  EXPECT_NO_THROW(check_attention_forward_args(mixed));
  AttentionForwardArgs strided = good;
  strided.k = make_view(static_cast<float*>(m) + 40, f32, {2, 6, 8}, {0, -8, 1});
  EXPECT_NO_THROW(check_attention_forward_args(strided));

  AttentionBackwardArgs bgood;
  bgood.q = good.q;
  bgood.k = good.k;
  bgood.v = good.v;
  bgood.out = good.out;
  bgood.lse = good.lse;
  bgood.grad_out = good.out;
  bgood.grad_lse = good.lse;
  bgood.grad_q = good.q;
  bgood.grad_k = good.k;
  bgood.grad_v = good.v;
  bgood.params = good.params;
  EXPECT_NO_THROW(check_attention_backward_args(bgood));
  using BackwardEdit = std::function<void(AttentionBackwardArgs&)>;
  struct BackwardBad {
    BackwardEdit edit;
    ErrorCode code;
    std::vector<std::string> pieces;
  };
  const std::vector<BackwardBad> backward_cases = {
      {[&](auto& a) { a.grad_k = make_view(m, f32, {2, 5, 8}); }, ErrorCode::kShapeMismatch,
       {"attention_backward: argument 'grad_k' has shape [2, 5, 8] but 'k' has shape [2, 6, 8]"}},
      {[&](auto& a) { a.grad_q.dtype = DType::kFloat64; }, ErrorCode::kDTypeMismatch,
       {"attention_backward: argument 'grad_q' has dtype float64"}},
      {[&](auto& a) { a.grad_out = make_view(m, f32, {2, 4, 8}); }, ErrorCode::kShapeMismatch,
       {"argument 'grad_out' has shape [2, 4, 8]"}},
      {[&](auto& a) { a.lse = StridedView{}; }, ErrorCode::kShapeMismatch,
       {"attention_backward: argument 'lse' has shape []"}},
      {[&](auto& a) { a.lse.data = nullptr; }, ErrorCode::kInvalidArgument,
       {"attention_backward: argument 'lse' has no data"}},
      {[&](auto& a) { a.grad_lse = make_view(m, f32, {5, 2}); }, ErrorCode::kShapeMismatch,
       {"argument 'grad_lse' has shape [5, 2]"}},
      {[&](auto& a) { a.grad_v = make_view(m, f32, {2, 6, 8}, {0, 8, 1}); },
       ErrorCode::kInvalidArgument, {"attention_backward: output 'grad_v' overlaps itself"}},
      {[&](auto& a) { a.out.dtype = DType::kFloat16; }, ErrorCode::kDTypeMismatch,
       {"argument 'out' has dtype float16"}},
      {[&](auto& a) { a.params.dropout = 1.5; }, ErrorCode::kInvalidArgument,
       {"attention_backward: argument 'dropout'"}},
  };
  for (size_t n = 0; n < backward_cases.size(); ++n) {
    SCOPED_TRACE("backward case " + std::to_string(n));
    AttentionBackwardArgs args = bgood;
    backward_cases[n].edit(args);
    expect_error([&] { check_attention_backward_args(args); }, backward_cases[n].code,
                 backward_cases[n].pieces);
  }
  AttentionBackwardArgs bad_shape = bgood;
  bad_shape.grad_v = make_view(m, f32, {2, 6, 7});
  expect_error([&] { cpu::attention_backward(bad_shape); }, ErrorCode::kShapeMismatch,
               {"attention_backward: argument 'grad_v'"});
}

}  // namespace
}  // namespace rd::kernels
