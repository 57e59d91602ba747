// Tests of the CPU reference attention (kernels/cpu/attention.h) and of the shared argument
// checks (kernels/attention.cc): the attention conformance table
// (tests/testing/attention_conformance.h: every case against the float64 reference, forward
// and backward) on the CPU's math kernel, and what is the CPU's own: gradients against
// float64 finite differences of a scalar loss, results independent of the thread count, and
// the argument checks' errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cpu/attention.h"
#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/kernels/error.h"
#include "testing/attention_conformance.h"
#include "testing/host_views.h"

namespace rd::kernels {
namespace {

using Shape = std::vector<int64_t>;
constexpr double kInf = std::numeric_limits<double>::infinity();

using test::concat;
using test::make_strided_operand;
using test::make_view;
using test::Operand;

// ---------------------------------------------------------------------------------------
// The conformance table on the CPU.

class AttentionConformance : public ::testing::TestWithParam<test::AttentionRun> {};

TEST_P(AttentionConformance, MatchesTheFloat64Reference) {
  test::check_attention_case(*GetParam().c, Device::cpu(), GetParam().kernel);
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionConformance,
                         ::testing::ValuesIn(test::attention_runs({AttentionKernel::kMath})),
                         test::attention_run_name);

Operand plain(DType dtype, const Shape& shape) {
  return make_strided_operand(dtype, shape, test::contiguous_strides(shape), 0, test::product(shape));
}

// ---------------------------------------------------------------------------------------
// Small contiguous problems for the tests below.

struct Contiguous {
  Operand q, k, v, out, lse;
  AttentionParams params;
  Shape q_shape, k_shape, lse_shape;

  Contiguous(DType dtype, const Shape& batch, int64_t lq, int64_t lk, int64_t d,
             std::mt19937_64& rng)
      : q_shape(concat(batch, {lq, d})), k_shape(concat(batch, {lk, d})), lse_shape(concat(batch, {lq})) {
    q = plain(dtype, q_shape);
    k = plain(dtype, k_shape);
    v = plain(dtype, k_shape);
    out = plain(dtype, q_shape);
    lse = plain(DType::kFloat32, lse_shape);
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
      Operand w = plain(DType::kFloat64, p.q_shape);
      Operand u = plain(DType::kFloat32, p.lse_shape);
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
      Operand grad_q = plain(DType::kFloat64, p.q_shape);
      Operand grad_k = plain(DType::kFloat64, p.k_shape);
      Operand grad_v = plain(DType::kFloat64, p.k_shape);
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

TEST(AttentionKernelTest, ResultsDoNotDependOnTheThreadCount) {
  std::mt19937_64 rng(3);
  Contiguous p(DType::kFloat32, {4}, 70, 130, 64, rng);
  p.params.causal = true;
  p.params.causal_offset = 3;
  p.params.dropout = 0.1;
  Operand grad_out = plain(DType::kFloat32, p.q_shape);
  Operand grad_lse = plain(DType::kFloat32, p.lse_shape);
  grad_out.buffer.fill_uniform(rng);
  grad_lse.buffer.fill_uniform(rng);
  auto run = [&](int threads) {
    cpu::set_num_threads(threads);
    p.forward();
    Operand gq = plain(DType::kFloat32, p.q_shape);
    Operand gk = plain(DType::kFloat32, p.k_shape);
    Operand gv = plain(DType::kFloat32, p.k_shape);
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

// Gradients shared like k and v (grouped-query attention: stride 0 over the query heads of a
// key/value head) pass the argument checks; the CPU's math kernel, whose threads would race
// on them, reports them unsupported with the reason, so callers go another way. Gradients
// that repeat elements in any other way are still refused.
TEST(AttentionKernelTest, SharedKeyValueGradientsAreAcceptedOnlyLikeTheirInputs) {
  std::vector<double> memory(4096, 0.0);
  void* m = memory.data();
  const DType f32 = DType::kFloat32;
  // [B = 2, H_kv = 3, G = 2, L, D]: k, v and their gradients read dim 2 through stride 0.
  const std::vector<int64_t> q_shape = {2, 3, 2, 5, 8}, kv_shape = {2, 3, 2, 6, 8};
  const std::vector<int64_t> shared = {3 * 6 * 8, 6 * 8, 0, 8, 1};
  AttentionBackwardArgs args;
  args.q = args.out = args.grad_out = args.grad_q = make_view(m, f32, q_shape);
  args.lse = make_view(m, f32, {2, 3, 2, 5});
  args.k = args.v = args.grad_k = args.grad_v = make_view(m, f32, kv_shape, shared);
  args.params.scale = 0.5;
  EXPECT_TRUE(attention_grads_shared(args));
  EXPECT_NO_THROW(check_attention_backward_args(args));
  std::string why;
  EXPECT_FALSE(cpu_backend().attention_supports(AttentionKernel::kMath, {}, &args, &why));
  EXPECT_NE(why.find("only cuDNN"), std::string::npos) << why;
  // Per query head gradients (the scratch path): ordinary, supported.
  AttentionBackwardArgs scratch = args;
  scratch.grad_k = scratch.grad_v = make_view(m, f32, kv_shape);
  EXPECT_FALSE(attention_grads_shared(scratch));
  EXPECT_NO_THROW(check_attention_backward_args(scratch));
  EXPECT_TRUE(cpu_backend().attention_supports(AttentionKernel::kMath, {}, &scratch, &why));
  // A gradient repeating elements along a dim k reads in full: an overlapping output.
  AttentionBackwardArgs wrong = scratch;
  wrong.grad_k = make_view(m, f32, kv_shape, {3 * 6 * 8, 0, 6 * 8, 8, 1});
  EXPECT_FALSE(attention_grads_shared(wrong));
  expect_error([&] { check_attention_backward_args(wrong); }, ErrorCode::kInvalidArgument,
               {"output 'grad_k' overlaps itself"});
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
