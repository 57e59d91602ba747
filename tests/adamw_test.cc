// AdamW on the CPU: the multi-tensor kernel against a float64 reference written out below
// (one step at a time, from the kernel's own stored state, with tolerances derived from the
// dtypes), its argument checks, and the nn::AdamW optimizer (grouping, skipped parameters,
// per-parameter bias corrections, the state dict through safetensors, errors).
// The CUDA kernel is checked against this CPU kernel in cuda_adamw_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/optimizer.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/safetensors.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/random_tensors.h"

namespace rd {
namespace {

using kernels::AdamWStep;
using kernels::AdamWTensor;

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                             DType::kFloat16};

using test::random_nonzero_tensor;
using test::unit_roundoff;

std::vector<double> values_of(const Tensor& t) { return t.to_vector<double>(); }

// True when a and b hold the same dtype, shape and bytes.
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << a.str() << " vs " << b.str();
  }
  const Tensor x = a.to(Device::cpu()).contiguous();
  const Tensor y = b.to(Device::cpu()).contiguous();
  const size_t bytes = static_cast<size_t>(x.numel()) * dtype_size(x.dtype());
  if (bytes != 0 && std::memcmp(x.raw_data(), y.raw_data(), bytes) != 0) {
    const std::vector<double> u = values_of(x), v = values_of(y);
    for (size_t i = 0; i < u.size(); ++i) {
      if (std::memcmp(&u[i], &v[i], sizeof(double)) != 0) {
        return ::testing::AssertionFailure() << "element " << i << ": " << u[i] << " vs " << v[i];
      }
    }
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// The kernel against the float64 reference.

// One AdamW step of one element in float64, straight from the definition (bias-corrected
// moments m_hat and v_hat).
struct RefElement {
  double param, exp_avg, exp_avg_sq;
};
RefElement reference_step(double p, double g, double m, double v, const AdamWStep& s) {
  const double t = static_cast<double>(s.step);
  p *= 1.0 - s.lr * s.weight_decay;
  m = s.beta1 * m + (1.0 - s.beta1) * g;
  v = s.beta2 * v + (1.0 - s.beta2) * g * g;
  const double m_hat = m / (1.0 - std::pow(s.beta1, t));
  const double v_hat = v / (1.0 - std::pow(s.beta2, t));
  p -= s.lr * m_hat / (std::sqrt(v_hat) + s.eps);
  return {p, m, v};
}

// One tensor's buffers for a kernel call: param and grad of the dtype, the moments of its
// accumulation dtype.
struct TensorState {
  Tensor param, grad, exp_avg, exp_avg_sq;

  TensorState(int64_t numel, DType dtype, std::mt19937_64& rng)
      : param(random_nonzero_tensor({numel}, dtype, rng)),
        grad(random_nonzero_tensor({numel}, dtype, rng)),
        exp_avg(zeros({numel}, accumulation_dtype(dtype))),
        exp_avg_sq(zeros({numel}, accumulation_dtype(dtype))) {}
  TensorState clone() const {
    TensorState copy = *this;
    for (Tensor* t : {&copy.param, &copy.grad, &copy.exp_avg, &copy.exp_avg_sq}) *t = t->clone();
    return copy;
  }
  AdamWTensor kernel_args() const {
    return {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(),
            param.numel()};
  }
};

// The values of a tensor's buffers before a step.
struct Before {
  std::vector<double> param, grad, exp_avg, exp_avg_sq;
  explicit Before(const TensorState& s)
      : param(values_of(s.param)),
        grad(values_of(s.grad)),
        exp_avg(values_of(s.exp_avg)),
        exp_avg_sq(values_of(s.exp_avg_sq)) {}
};

// Checks every element of one tensor after a kernel step against the reference applied to
// `before`. Tolerances: the computation runs in the accumulation type (roundoff u_a) with a
// handful of roundings per quantity, bounded relative to the sizes of the terms involved
// (4 u_a for the first moment's two terms, 6 u_a for the second's, 16 u_a for the parameter
// on |decayed param| + |update| with the update's first-moment terms taken as absolute
// values), plus the final rounding of the parameter to its dtype (u_t) and, for float16,
// half its subnormal step.
void expect_matches_reference(const Before& before, const TensorState& after, DType dtype,
                              const AdamWStep& s, bool expect_every_param_changed,
                              const std::string& what) {
  const double u_t = unit_roundoff(dtype);
  const double u_a = unit_roundoff(accumulation_dtype(dtype));
  const double tiny = dtype == DType::kFloat16 ? std::ldexp(1.0, -25) : 0.0;
  const double t = static_cast<double>(s.step);
  const double bias_correction1 = 1.0 - std::pow(s.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(s.beta2, t);
  const std::vector<double> p = values_of(after.param), m = values_of(after.exp_avg),
                            v = values_of(after.exp_avg_sq);
  int failures = 0;
  for (size_t i = 0; i < p.size() && failures < 5; ++i) {
    const double g = before.grad[i];
    const RefElement r = reference_step(before.param[i], g, before.exp_avg[i],
                                        before.exp_avg_sq[i], s);
    const double m_scale = std::fabs(s.beta1 * before.exp_avg[i]) + std::fabs((1 - s.beta1) * g);
    const double v_scale = s.beta2 * before.exp_avg_sq[i] + (1 - s.beta2) * g * g;
    const double denom = std::sqrt(r.exp_avg_sq / bias_correction2) + s.eps;
    const double update_scale = s.lr / bias_correction1 * m_scale / denom;
    const double tol_p = u_t * std::fabs(r.param) +
                         16 * u_a * (std::fabs(before.param[i]) + update_scale) + tiny;
    const bool ok = std::fabs(m[i] - r.exp_avg) <= 4 * u_a * m_scale &&
                    std::fabs(v[i] - r.exp_avg_sq) <= 6 * u_a * v_scale &&
                    std::fabs(p[i] - r.param) <= tol_p &&
                    (!expect_every_param_changed || p[i] != before.param[i]);
    if (!ok) {
      ++failures;
      ADD_FAILURE() << what << " element " << i << ": param " << p[i] << " want " << r.param
                    << " (tol " << tol_p << ", was " << before.param[i] << "), exp_avg " << m[i]
                    << " want " << r.exp_avg << ", exp_avg_sq " << v[i] << " want "
                    << r.exp_avg_sq;
    }
  }
}

// Steps with new gradients each time; the last jumps to a late step, where the first bias
// correction is ~1 and the second is not.
const int64_t kSteps[] = {1, 2, 3, 5000};

TEST(AdamWKernelTest, MatchesFloat64ReferenceForEveryDTypeAndSize) {
  // Sizes: empty, single, odd, more than one 64K chunk (and not a multiple of any vector
  // width or of the CPU's parallel grain).
  const std::vector<int64_t> sizes = {0, 1, 7, 33, 65536 * 2 + 3};
  for (DType dtype : kFloatTypes) {
    for (double weight_decay : {0.0, 0.1}) {
      std::mt19937_64 rng(17);
      std::vector<TensorState> states;
      for (int64_t n : sizes) states.emplace_back(n, dtype, rng);
      for (int64_t step : kSteps) {
        // lr 0.05: at step 1 every update is ~lr, visible even in bfloat16.
        const AdamWStep s{0.05, 0.9, 0.999, 1e-8, weight_decay, step};
        std::vector<Before> before;
        std::vector<AdamWTensor> args;
        for (TensorState& state : states) {
          if (step != 1) state.grad = random_nonzero_tensor({state.param.numel()}, dtype, rng);
          before.emplace_back(state);
          args.push_back(state.kernel_args());
        }
        kernels::cpu_backend().adamw(args, dtype, s);
        for (size_t k = 0; k < states.size(); ++k) {
          expect_matches_reference(before[k], states[k], dtype, s, step == 1,
                                   str_cat(dtype_name(dtype), " wd=", weight_decay, " step ",
                                           step, " numel ", sizes[k]));
        }
      }
    }
  }
}

// Packing many tensors into one call changes nothing: each ends as if updated alone.
TEST(AdamWKernelTest, ManyTensorsInOneCallMatchOneCallEach) {
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int64_t> size(0, 300);
  std::vector<TensorState> together, alone;
  for (int i = 0; i < 1000; ++i) {
    together.emplace_back(size(rng), DType::kBFloat16, rng);
    alone.push_back(together.back().clone());
  }
  const AdamWStep s{0.01, 0.9, 0.99, 1e-6, 0.05, 1};
  std::vector<AdamWTensor> args;
  for (const TensorState& state : together) args.push_back(state.kernel_args());
  kernels::cpu_backend().adamw(args, DType::kBFloat16, s);
  for (size_t i = 0; i < alone.size(); ++i) {
    const AdamWTensor one = alone[i].kernel_args();
    kernels::cpu_backend().adamw({&one, 1}, DType::kBFloat16, s);
    ASSERT_TRUE(same_bits(together[i].param, alone[i].param)) << "tensor " << i;
    ASSERT_TRUE(same_bits(together[i].exp_avg, alone[i].exp_avg)) << "tensor " << i;
    ASSERT_TRUE(same_bits(together[i].exp_avg_sq, alone[i].exp_avg_sq)) << "tensor " << i;
  }
}

TEST(AdamWKernelTest, RejectsBadArguments) {
  float param[4] = {1, 2, 3, 4}, grad[4] = {1, 1, 1, 1}, m[4] = {}, v[4] = {};
  const AdamWTensor good{param, grad, m, v, 4};
  const AdamWStep ok;
  struct Case {
    std::vector<AdamWTensor> tensors;
    DType dtype;
    AdamWStep step;
    ErrorCode code;
    std::string message;
  };
  auto with = [&](const std::function<void(AdamWStep&)>& change) {
    AdamWStep s = ok;
    change(s);
    return s;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Case> cases = {
      {{good}, DType::kInt32, ok, ErrorCode::kDTypeMismatch, "argument 'dtype'"},
      {{good}, DType::kFloat32, with([](AdamWStep& s) { s.step = 0; }),
       ErrorCode::kInvalidArgument, "argument 'step'"},
      {{good}, DType::kFloat32, with([&](AdamWStep& s) { s.lr = nan; }),
       ErrorCode::kInvalidArgument, "argument 'lr'"},
      {{good}, DType::kFloat32, with([](AdamWStep& s) { s.eps = -1; }),
       ErrorCode::kInvalidArgument, "argument 'eps'"},
      {{good}, DType::kFloat32, with([](AdamWStep& s) { s.weight_decay = INFINITY; }),
       ErrorCode::kInvalidArgument, "argument 'weight_decay'"},
      {{good}, DType::kFloat32, with([](AdamWStep& s) { s.beta1 = 1.0; }),
       ErrorCode::kInvalidArgument, "argument 'beta1'"},
      {{good}, DType::kFloat32, with([&](AdamWStep& s) { s.beta2 = nan; }),
       ErrorCode::kInvalidArgument, "argument 'beta2'"},
      {{good, {param, nullptr, m, v, 4}}, DType::kFloat32, ok, ErrorCode::kInvalidArgument,
       "argument 'tensors[1].grad' is null"},
      {{good, good, {param, grad, m, nullptr, 1}}, DType::kFloat32, ok,
       ErrorCode::kInvalidArgument, "argument 'tensors[2].exp_avg_sq' is null"},
      {{{param, grad, m, v, -1}}, DType::kFloat32, ok, ErrorCode::kInvalidArgument,
       "argument 'tensors[0].numel'"},
  };
  for (const Case& c : cases) {
    try {
      kernels::cpu_backend().adamw(c.tensors, c.dtype, c.step);
      ADD_FAILURE() << "no error; expected " << c.message;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), c.code) << e.what();
      EXPECT_NE(std::string(e.what()).find("adamw: " + c.message), std::string::npos)
          << e.what();
    }
  }
  // Null pointers are fine where there is nothing to update.
  const AdamWTensor empty{nullptr, nullptr, nullptr, nullptr, 0};
  EXPECT_NO_THROW(kernels::cpu_backend().adamw({&empty, 1}, DType::kFloat32, ok));
  EXPECT_EQ(param[0], 1.0f) << "a rejected call must not have written anything";
}

// ---------------------------------------------------------------------------------------
// nn::AdamW

using nn::AdamW;
using nn::AdamWOptions;

const AdamWOptions kOptions{0.02, 0.9, 0.99, 1e-6, 0.1};

// The parameter after `steps.size()` kernel steps with the given gradients, from scratch.
Tensor updated_by_kernel(const Tensor& param, const std::vector<Tensor>& grads,
                         const AdamWOptions& o) {
  Tensor p = param.clone();
  Tensor m = zeros(param.shape(), accumulation_dtype(param.dtype()));
  Tensor v = zeros(param.shape(), accumulation_dtype(param.dtype()));
  for (size_t k = 0; k < grads.size(); ++k) {
    const AdamWTensor t{p.raw_data(), grads[k].contiguous().raw_data(), m.raw_data(),
                        v.raw_data(), p.numel()};
    kernels::cpu_backend().adamw({&t, 1}, p.dtype(),
                                 {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay,
                                  static_cast<int64_t>(k) + 1});
  }
  return p;
}

template <class Fn>
void expect_error(ErrorCode code, const std::string& message, Fn&& fn) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

// Parameters of three dtypes (three kernel calls per step) move exactly as the kernel
// moves each alone.
TEST(AdamWOptimizerTest, StepsEachDTypeGroupLikeTheKernel) {
  std::mt19937_64 rng(1);
  const Tensor a = random_nonzero_tensor({3, 5}, DType::kFloat32, rng);
  const Tensor b = random_nonzero_tensor({7}, DType::kBFloat16, rng);
  const Tensor c = random_nonzero_tensor({2, 2}, DType::kFloat64, rng);
  const Tensor d = random_nonzero_tensor({4}, DType::kFloat32, rng);
  std::map<std::string, std::vector<Tensor>> grads;
  // The optimizer shares these handles' tensors, so their gradients reach it.
  std::vector<std::pair<std::string, Tensor>> handles = {
      {"a", a.clone()}, {"b", b.clone()}, {"c", c.clone()}, {"d", d.clone()}};
  AdamW opt(handles, kOptions);
  for (int k = 0; k < 3; ++k) {
    for (auto& [name, p] : handles) {
      grads[name].push_back(random_nonzero_tensor(p.shape(), p.dtype(), rng));
      p.set_grad(grads[name].back());
    }
    opt.step();
  }
  EXPECT_EQ(opt.step_count(), 3);
  const std::map<std::string, Tensor> originals = {{"a", a}, {"b", b}, {"c", c}, {"d", d}};
  for (const auto& [name, p] : handles) {
    EXPECT_TRUE(same_bits(p, updated_by_kernel(originals.at(name), grads[name], kOptions)))
        << name;
    EXPECT_EQ(opt.state_dict().at("step." + name).item<int64_t>(), 3);
  }
}

TEST(AdamWOptimizerTest, SkipsParametersWithoutGradientAndBiasCorrectsPerParameter) {
  std::mt19937_64 rng(2);
  const Tensor a0 = random_nonzero_tensor({6}, DType::kFloat32, rng);
  const Tensor b0 = random_nonzero_tensor({5}, DType::kFloat32, rng);
  Tensor a = a0.clone(), b = b0.clone();
  AdamW opt({{"a", a}, {"b", b}}, kOptions);
  const Tensor ga1 = random_nonzero_tensor({6}, DType::kFloat32, rng);
  const Tensor ga2 = random_nonzero_tensor({6}, DType::kFloat32, rng);
  const Tensor gb = random_nonzero_tensor({5}, DType::kFloat32, rng);

  a.set_grad(ga1);
  opt.step();
  EXPECT_TRUE(same_bits(b, b0)) << "b has no gradient and must not move";
  EXPECT_EQ(opt.state_dict().count("exp_avg.b"), 0u);
  EXPECT_EQ(opt.state_dict().count("step.b"), 0u);

  // b's first update, at the optimizer's second step, is an update with t = 1.
  a.set_grad(ga2);
  b.set_grad(gb);
  opt.step();
  EXPECT_TRUE(same_bits(a, updated_by_kernel(a0, {ga1, ga2}, kOptions)));
  EXPECT_TRUE(same_bits(b, updated_by_kernel(b0, {gb}, kOptions)));
  const std::map<std::string, Tensor> state = opt.state_dict();
  EXPECT_EQ(state.at("step").item<int64_t>(), 2);
  EXPECT_EQ(state.at("step.a").item<int64_t>(), 2);
  EXPECT_EQ(state.at("step.b").item<int64_t>(), 1);
  EXPECT_EQ(state.at("exp_avg.b").dtype(), DType::kFloat32);
  EXPECT_EQ(state.at("exp_avg.b").shape(), Shape({5}));

  // zero_grad drops the gradients: the next step moves nothing but still counts.
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  const Tensor a_before = a.clone();
  opt.step();
  EXPECT_TRUE(same_bits(a, a_before));
  EXPECT_EQ(opt.step_count(), 3);
  EXPECT_EQ(opt.state_dict().at("step.a").item<int64_t>(), 2);
}

// Gradients from autograd, and non-contiguous ones, are used like their contiguous values.
TEST(AdamWOptimizerTest, UsesAutogradAndNonContiguousGradients) {
  std::mt19937_64 rng(3);
  const Tensor w0 = random_nonzero_tensor({4, 3}, DType::kFloat32, rng);
  const Tensor x = random_nonzero_tensor({4, 3}, DType::kFloat32, rng);
  Tensor w = w0.clone();
  w.set_requires_grad(true);
  Tensor u = w0.clone();  // gets a transposed gradient
  AdamW opt({{"w", w}, {"u", u}}, kOptions);
  sum(mul(w, x)).backward();  // d/dw = x
  const Tensor gu = random_nonzero_tensor({3, 4}, DType::kFloat32, rng).t();
  ASSERT_FALSE(gu.is_contiguous());
  u.set_grad(gu);
  opt.step();
  EXPECT_TRUE(same_bits(w.detach(), updated_by_kernel(w0, {x}, kOptions)));
  EXPECT_TRUE(same_bits(u, updated_by_kernel(w0, {gu.contiguous()}, kOptions)));
  EXPECT_TRUE(w.requires_grad());
}

// A run interrupted by a checkpoint (parameters and optimizer state through safetensors)
// continues bit for bit like the uninterrupted run.
TEST(AdamWOptimizerTest, StateDictRoundTripThroughSafetensorsContinuesBitIdentically) {
  for (DType dtype : kFloatTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(4);
    const std::vector<std::pair<std::string, Shape>> shapes = {
        {"layer.0.weight", {8, 5}}, {"layer.0.bias", {8}}, {"frozen", {3}}};
    std::vector<std::pair<std::string, Tensor>> run;
    for (const auto& [name, shape] : shapes) {
      run.emplace_back(name, random_nonzero_tensor(shape, dtype, rng));
    }
    AdamW uninterrupted(run, kOptions);
    std::vector<std::vector<Tensor>> grads(5);
    for (auto& step_grads : grads) {
      for (size_t i = 0; i + 1 < shapes.size(); ++i) {  // "frozen" never gets a gradient
        step_grads.push_back(random_nonzero_tensor(shapes[i].second, dtype, rng));
      }
    }
    auto step_with = [&](AdamW& opt, std::vector<std::pair<std::string, Tensor>>& params,
                         const std::vector<Tensor>& g) {
      for (size_t i = 0; i < g.size(); ++i) params[i].second.set_grad(g[i]);
      opt.step();
    };
    for (int k = 0; k < 3; ++k) step_with(uninterrupted, run, grads[k]);

    // Checkpoint: parameters and optimizer state in one safetensors file (in memory).
    std::map<std::string, Tensor> checkpoint = uninterrupted.state_dict();
    for (const auto& [name, p] : run) checkpoint.emplace("param." + name, p);
    const std::vector<uint8_t> bytes = serialize_safetensors(checkpoint);
    const SafetensorsFile file = parse_safetensors(bytes);

    std::vector<std::pair<std::string, Tensor>> resumed_params;
    std::map<std::string, Tensor> optimizer_state;
    for (const auto& [key, t] : file.tensors) {
      if (key.starts_with("param.")) {
        resumed_params.emplace_back(key.substr(6), t.clone());
      } else {
        optimizer_state.emplace(key, t);
      }
    }
    // The file orders names; put the parameters back in the original order.
    std::vector<std::pair<std::string, Tensor>> resumed_run;
    for (const auto& [name, shape] : shapes) {
      for (auto& [n, t] : resumed_params) {
        if (n == name) resumed_run.emplace_back(n, t);
      }
    }
    ASSERT_EQ(resumed_run.size(), shapes.size());
    EXPECT_EQ(optimizer_state.count("exp_avg.frozen"), 0u);
    AdamW resumed(resumed_run, kOptions);
    resumed.load_state_dict(optimizer_state);
    EXPECT_EQ(resumed.step_count(), 3);

    for (int k = 3; k < 5; ++k) {
      step_with(uninterrupted, run, grads[k]);
      step_with(resumed, resumed_run, grads[k]);
    }
    for (size_t i = 0; i < run.size(); ++i) {
      EXPECT_TRUE(same_bits(run[i].second, resumed_run[i].second)) << run[i].first;
    }
    const auto want = uninterrupted.state_dict(), got = resumed.state_dict();
    ASSERT_EQ(want.size(), got.size());
    for (const auto& [key, t] : want) EXPECT_TRUE(same_bits(t, got.at(key))) << key;
    // The loaded moments are the optimizer's own copies, not the file's tensors.
    EXPECT_FALSE(same_bits(optimizer_state.at("exp_avg.layer.0.bias"),
                           got.at("exp_avg.layer.0.bias")));
  }
}

TEST(AdamWOptimizerTest, RejectsBadParametersAndOptions) {
  std::mt19937_64 rng(6);
  const Tensor p = random_nonzero_tensor({2, 3}, DType::kFloat32, rng);
  expect_error(ErrorCode::kInvalidArgument, "AdamW: parameter name 'w' is used twice",
               [&] { AdamW({{"w", p}, {"w", p.clone()}}); });
  expect_error(ErrorCode::kInvalidArgument, "non-empty name", [&] { AdamW({{"", p}}); });
  expect_error(ErrorCode::kInvalidArgument, "parameter 'w' is undefined",
               [&] { AdamW({{"w", Tensor()}}); });
  expect_error(ErrorCode::kDTypeMismatch, "parameter 'i' must be floating",
               [&] { AdamW({{"i", zeros({2}, DType::kInt64)}}); });
  expect_error(ErrorCode::kInvalidArgument, "parameter 't' must be contiguous",
               [&] { AdamW({{"t", p.t()}}); });
  expect_error(ErrorCode::kInvalidArgument, "'v' is the same memory",
               [&] { AdamW({{"w", p}, {"v", p.view({6})}}); });
  expect_error(ErrorCode::kInvalidArgument, "option 'lr'",
               [&] { AdamW({{"w", p}}, {-1.0, 0.9, 0.999, 1e-8, 0.0}); });
  expect_error(ErrorCode::kInvalidArgument, "option 'beta2'",
               [&] { AdamW({{"w", p}}, {1e-3, 0.9, 1.0, 1e-8, 0.0}); });
  expect_error(ErrorCode::kInvalidArgument, "option 'eps'", [&] {
    AdamW({{"w", p}}, {1e-3, 0.9, 0.999, std::numeric_limits<double>::quiet_NaN(), 0.0});
  });
  AdamW opt({{"w", p}});
  opt.set_lr(0.5);
  EXPECT_EQ(opt.lr(), 0.5);
  expect_error(ErrorCode::kInvalidArgument, "AdamW.set_lr: option 'lr'", [&] { opt.set_lr(-2); });
  EXPECT_EQ(opt.lr(), 0.5);
}

TEST(AdamWOptimizerTest, RejectsMismatchedGradientsBeforeUpdatingAnything) {
  std::mt19937_64 rng(7);
  Tensor a = random_nonzero_tensor({4}, DType::kFloat32, rng);
  Tensor b = random_nonzero_tensor({2, 2}, DType::kFloat32, rng);
  const Tensor a0 = a.clone();
  AdamW opt({{"a", a}, {"b", b}});
  a.set_grad(random_nonzero_tensor({4}, DType::kFloat32, rng));

  b.set_grad(random_nonzero_tensor({2, 2}, DType::kFloat64, rng));
  expect_error(ErrorCode::kDTypeMismatch, "gradient of 'b' is float64", [&] { opt.step(); });
  // set_grad refuses a wrong shape, but the gradient slot can still be filled directly.
  b.impl()->grad = random_nonzero_tensor({3}, DType::kFloat32, rng).impl_ptr();
  expect_error(ErrorCode::kShapeMismatch, "gradient of 'b' has shape [3]", [&] { opt.step(); });

  EXPECT_TRUE(same_bits(a, a0)) << "a failed step must not update any parameter";
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_EQ(opt.state_dict().size(), 1u) << "only 'step'";
}

TEST(AdamWOptimizerTest, RejectsBadStateDictsAndKeepsItsState) {
  std::mt19937_64 rng(8);
  Tensor w = random_nonzero_tensor({3, 2}, DType::kBFloat16, rng);
  Tensor b = random_nonzero_tensor({2}, DType::kBFloat16, rng);
  AdamW opt({{"w", w}, {"b", b}}, kOptions);
  w.set_grad(random_nonzero_tensor({3, 2}, DType::kBFloat16, rng));
  b.set_grad(random_nonzero_tensor({2}, DType::kBFloat16, rng));
  opt.step();
  opt.step();
  std::map<std::string, Tensor> good;
  for (const auto& [key, t] : opt.state_dict()) good.emplace(key, t.clone());

  auto changed = [&](const std::function<void(std::map<std::string, Tensor>&)>& change) {
    std::map<std::string, Tensor> s = good;
    change(s);
    return s;
  };
  struct Case {
    std::map<std::string, Tensor> state;
    ErrorCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {changed([](auto& s) { s.erase("step"); }), ErrorCode::kInvalidArgument,
       "no 'step' entry"},
      {changed([](auto& s) { s["step"] = scalar_tensor(2.0); }), ErrorCode::kInvalidArgument,
       "'step' must be an int64 tensor of one element"},
      {changed([](auto& s) { s["momentum.w"] = zeros({3, 2}); }), ErrorCode::kInvalidArgument,
       "unknown key 'momentum.w'"},
      {changed([](auto& s) { s["exp_avg.nope"] = zeros({3, 2}); }),
       ErrorCode::kInvalidArgument, "key 'exp_avg.nope' names no parameter"},
      {changed([](auto& s) { s.erase("exp_avg_sq.b"); }), ErrorCode::kInvalidArgument,
       "parameter 'b' has some state entries but not 'exp_avg_sq.b'"},
      {changed([](auto& s) { s.erase("step.w"); }), ErrorCode::kInvalidArgument,
       "but not 'step.w'"},
      {changed([](auto& s) { s["exp_avg.w"] = zeros({2, 3}); }), ErrorCode::kShapeMismatch,
       "'exp_avg.w' has shape [2, 3] but the parameter has [3, 2]"},
      {changed([](auto& s) { s["exp_avg_sq.b"] = zeros({2}, DType::kBFloat16); }),
       ErrorCode::kDTypeMismatch, "keeps its moments in float32"},
      {changed([](auto& s) { s["step.b"] = scalar_tensor(3.0, DType::kInt64); }),
       ErrorCode::kInvalidArgument, "'step.b' must be in [1, step = 2], got 3"},
      {changed([](auto& s) { s["step.b"] = scalar_tensor(0.0, DType::kInt64); }),
       ErrorCode::kInvalidArgument, "'step.b' must be in [1, step = 2], got 0"},
  };
  for (const Case& c : cases) {
    expect_error(c.code, c.message, [&] { opt.load_state_dict(c.state); });
    const auto now = opt.state_dict();
    ASSERT_EQ(now.size(), good.size());
    for (const auto& [key, t] : good) ASSERT_TRUE(same_bits(now.at(key), t)) << key;
  }
  // A state dict for fewer parameters is fine: the rest start fresh.
  opt.load_state_dict(changed([](auto& s) {
    s.erase("exp_avg.b");
    s.erase("exp_avg_sq.b");
    s.erase("step.b");
  }));
  EXPECT_EQ(opt.state_dict().count("exp_avg.b"), 0u);
  EXPECT_EQ(opt.step_count(), 2);
}

// ---------------------------------------------------------------------------------------
// Parameter groups

using nn::default_param_groups;
using nn::ParamGroup;

// A float64 reference of AdamW over `steps` gradients, with this lr and weight decay.
std::vector<double> reference_run(const std::vector<double>& param,
                                  const std::vector<std::vector<double>>& grads,
                                  const AdamWOptions& o, double lr, double weight_decay) {
  std::vector<double> p = param, m(p.size(), 0.0), v(p.size(), 0.0);
  for (size_t t = 0; t < grads.size(); ++t) {
    const AdamWStep s{lr, o.beta1, o.beta2, o.eps, weight_decay, static_cast<int64_t>(t) + 1};
    for (size_t i = 0; i < p.size(); ++i) {
      const RefElement r = reference_step(p[i], grads[t][i], m[i], v[i], s);
      p[i] = r.param;
      m[i] = r.exp_avg;
      v[i] = r.exp_avg_sq;
    }
  }
  return p;
}

// Three groups (decay, no decay, a half learning rate with its own decay), float32 and
// bfloat16 parameters in each, against the float64 reference run per group. The tolerance
// covers a few float32 roundings per step (the kernel's bound, expect_matches_reference)
// over the steps, plus one rounding to the parameter's dtype per step; the weight decay
// moves a parameter by lr * wd * |p| per step, well beyond it, so a group updated with
// another group's decay (or learning rate) fails.
TEST(AdamWGroupsTest, EachGroupMatchesAFloat64ReferenceWithItsHyperparameters) {
  std::mt19937_64 rng(21);
  const AdamWOptions o{0.02, 0.9, 0.99, 1e-6, /*unused with groups=*/0.5};
  const std::vector<ParamGroup> spec = {{{}, 0.1, 1.0}, {{}, 0.0, 1.0}, {{}, 0.3, 0.5}};
  std::vector<ParamGroup> groups = spec;
  struct Tracked {
    std::string name;
    Tensor param;
    std::vector<double> initial;
    std::vector<std::vector<double>> grads;
    size_t group;
  };
  std::vector<Tracked> tracked;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor p = random_nonzero_tensor({3, 4}, dtype, rng);
      const std::string name = str_cat("g", g, ".", dtype_name(dtype));
      groups[g].params.emplace_back(name, p);
      tracked.push_back({name, p, values_of(p), {}, g});
    }
  }
  AdamW opt(groups, o);
  EXPECT_EQ(opt.num_groups(), 3u);
  const int kStepCount = 3;
  for (int k = 0; k < kStepCount; ++k) {
    for (Tracked& t : tracked) {
      const Tensor grad = random_nonzero_tensor(t.param.shape(), t.param.dtype(), rng);
      t.grads.push_back(values_of(grad));
      t.param.set_grad(grad);
    }
    opt.step();
  }
  for (const Tracked& t : tracked) {
    SCOPED_TRACE(t.name);
    const ParamGroup& g = spec[t.group];
    const std::vector<double> want =
        reference_run(t.initial, t.grads, o, o.lr * g.lr_scale, g.weight_decay);
    const std::vector<double> got = values_of(t.param);
    const double u_t = unit_roundoff(t.param.dtype()), u_a = unit_roundoff(DType::kFloat32);
    for (size_t i = 0; i < got.size(); ++i) {
      const double tol = kStepCount * (u_t * std::fabs(want[i]) + 16 * u_a * (std::fabs(want[i]) + 2 * o.lr));
      ASSERT_NEAR(got[i], want[i], tol) << "element " << i;
    }
    // The check can tell the groups apart: float32 parameters land far from the reference run
    // with any other group's hyperparameters.
    if (t.param.dtype() != DType::kFloat32) continue;
    for (size_t other = 0; other < spec.size(); ++other) {
      if (spec[other].weight_decay == g.weight_decay && spec[other].lr_scale == g.lr_scale) continue;
      const std::vector<double> wrong = reference_run(t.initial, t.grads, o,
                                                      o.lr * spec[other].lr_scale,
                                                      spec[other].weight_decay);
      double max_diff = 0;
      for (size_t i = 0; i < got.size(); ++i) max_diff = std::max(max_diff, std::fabs(wrong[i] - want[i]));
      EXPECT_GT(max_diff, 1e-4) << "groups " << t.group << " and " << other;
    }
  }
}

// The single-list constructor is one group with options.weight_decay: bit-identical to it.
TEST(AdamWGroupsTest, SingleListConstructorEqualsOneGroup) {
  std::mt19937_64 rng(22);
  const Tensor p0 = random_nonzero_tensor({5, 2}, DType::kFloat32, rng);
  Tensor a = p0.clone(), b = p0.clone();
  AdamW list({{"w", a}}, kOptions);
  AdamW grouped(std::vector<ParamGroup>{{{{"w", b}}, kOptions.weight_decay, 1.0}}, kOptions);
  for (int k = 0; k < 2; ++k) {
    const Tensor g = random_nonzero_tensor({5, 2}, DType::kFloat32, rng);
    a.set_grad(g);
    b.set_grad(g);
    list.step();
    grouped.step();
  }
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_EQ(list.num_groups(), 1u);
}

// set_lr moves every group's rate, each keeping its scale.
TEST(AdamWGroupsTest, SetLrScalesEveryGroup) {
  std::mt19937_64 rng(23);
  const Tensor p0 = random_nonzero_tensor({6}, DType::kFloat32, rng);
  const Tensor g = random_nonzero_tensor({6}, DType::kFloat32, rng);
  Tensor half = p0.clone();
  AdamW opt(std::vector<ParamGroup>{{{{"half", half}}, 0.1, 0.5}}, kOptions);
  opt.set_lr(0.04);
  half.set_grad(g);
  opt.step();
  AdamWOptions direct = kOptions;
  direct.lr = 0.02;  // 0.04 * 0.5
  direct.weight_decay = 0.1;
  EXPECT_TRUE(same_bits(half, updated_by_kernel(p0, {g}, direct)));
}

TEST(AdamWGroupsTest, DefaultGroupsExemptVectorsAndEmbeddingsFromWeightDecay) {
  const std::vector<std::pair<std::string, Tensor>> named = {
      {"layers.0.weight", zeros({4, 3})},      {"layers.0.bias", zeros({4})},
      {"norm.weight", zeros({4})},             {"tok_embeddings.weight", zeros({10, 4})},
      {"encoder.Embed.table", zeros({3, 3})},  {"head.weight", zeros({2, 4})},
      {"scale", scalar_tensor(1.0)},           {"embedded_proj.weight", zeros({4, 4})},
  };
  auto names = [](const ParamGroup& g) {
    std::vector<std::string> out;
    for (const auto& [name, p] : g.params) out.push_back(name);
    return out;
  };
  const std::vector<ParamGroup> groups = default_param_groups(named, 0.05);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weight_decay, 0.05);
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  EXPECT_EQ(groups[0].lr_scale, 1.0);
  EXPECT_EQ(groups[1].lr_scale, 1.0);
  EXPECT_EQ(names(groups[0]), (std::vector<std::string>{"layers.0.weight", "head.weight"}));
  EXPECT_EQ(names(groups[1]),
            (std::vector<std::string>{"layers.0.bias", "norm.weight", "tok_embeddings.weight",
                                      "encoder.Embed.table", "scale", "embedded_proj.weight"}));
  // A caller's rule replaces the default one.
  const std::vector<ParamGroup> custom = default_param_groups(
      named, 0.05, [](const std::string& name, const Tensor&) { return name == "head.weight"; });
  EXPECT_EQ(names(custom[1]), (std::vector<std::string>{"head.weight"}));
  EXPECT_EQ(custom[0].params.size(), named.size() - 1);
  EXPECT_TRUE(nn::is_no_weight_decay_parameter("wte.weight", zeros({2})));
  EXPECT_FALSE(nn::is_no_weight_decay_parameter("wte.weight", zeros({2, 2})));
  expect_error(ErrorCode::kInvalidArgument, "default_param_groups: argument 'no_decay'",
               [&] { default_param_groups(named, 0.1, nullptr); });
}

// The state dict has the same keys however the parameters are grouped, and moves between
// groupings.
TEST(AdamWGroupsTest, StateDictKeysDoNotDependOnGroups) {
  std::mt19937_64 rng(24);
  const std::vector<std::pair<std::string, Tensor>> named = {
      {"w", random_nonzero_tensor({3, 3}, DType::kFloat32, rng)},
      {"b", random_nonzero_tensor({3}, DType::kFloat32, rng)}};
  AdamW grouped(default_param_groups(named, 0.1), kOptions);
  for (const auto& [name, p] : named) {
    Tensor handle = p;
    handle.set_grad(random_nonzero_tensor(p.shape(), p.dtype(), rng));
  }
  grouped.step();
  const std::map<std::string, Tensor> state = grouped.state_dict();
  std::vector<std::string> keys;
  for (const auto& [key, value] : state) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"exp_avg.b", "exp_avg.w", "exp_avg_sq.b",
                                            "exp_avg_sq.w", "step", "step.b", "step.w"}));
  std::vector<std::pair<std::string, Tensor>> copies;
  for (const auto& [name, p] : named) copies.emplace_back(name, p.clone());
  AdamW single(copies, kOptions);
  single.load_state_dict(state);
  EXPECT_EQ(single.step_count(), 1);
  EXPECT_TRUE(same_bits(single.state_dict().at("exp_avg.w"), state.at("exp_avg.w")));
}

TEST(AdamWGroupsTest, RejectsBadGroups) {
  const Tensor w = zeros({2});
  expect_error(ErrorCode::kInvalidArgument, "AdamW: groups[1].weight_decay", [&] {
    AdamW(std::vector<ParamGroup>{{{{"a", w}}, 0.1, 1.0}, {{}, -0.1, 1.0}}, kOptions);
  });
  expect_error(ErrorCode::kInvalidArgument, "AdamW: groups[0].lr_scale", [&] {
    AdamW(std::vector<ParamGroup>{{{}, 0.0, std::nan("")}}, kOptions);
  });
  expect_error(ErrorCode::kInvalidArgument, "parameter name 'a' is used twice", [&] {
    AdamW(std::vector<ParamGroup>{{{{"a", zeros({2})}}, 0.1, 1.0}, {{{"a", zeros({2})}}, 0.0, 1.0}},
          kOptions);
  });
  expect_error(ErrorCode::kInvalidArgument, "same memory", [&] {
    AdamW(std::vector<ParamGroup>{{{{"a", w}}, 0.1, 1.0}, {{{"b", w}}, 0.0, 1.0}}, kOptions);
  });
}

}  // namespace
}  // namespace rd
