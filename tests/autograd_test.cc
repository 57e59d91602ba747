// Autograd engine tests: accumulation, deep graphs, graph lifetime and release, grad modes,
// detach, diamonds, views of leaves, misuse errors, and activation recomputation.
#include "ringdilated/tensor/autograd.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/recompute.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

namespace rd {
namespace {

Tensor leaf(std::vector<double> values, Shape shape) {
  Tensor t = from_vector<double>(std::move(values), std::move(shape));
  t.set_requires_grad(true);
  return t;
}

std::vector<double> grad_of(const Tensor& t) {
  EXPECT_TRUE(t.grad().defined()) << "no gradient reached " << t.str();
  return t.grad().defined() ? t.grad().to_vector<double>() : std::vector<double>{};
}

// Runs f, which must throw rd::Error with one of `codes`.
template <class F>
void expect_error(F&& f, std::initializer_list<ErrorCode> codes, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": expected rd::Error";
  } catch (const Error& e) {
    bool ok = false;
    for (ErrorCode c : codes) ok |= e.code() == c;
    EXPECT_TRUE(ok) << what << ": unexpected code " << error_code_name(e.code()) << ": "
                    << e.what();
  }
}

TEST(Autograd, GradientsAccumulateIntoLeavesAcrossBackwardCalls) {
  Tensor x = leaf({0.5, -1.5, 2.0}, {3});
  sum(x * x).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{1.0, -3.0, 4.0}));
  sum(mul(x, 3.0)).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{4.0, 0.0, 7.0}));
}

// A leaf's .grad is its own: the engine adopts a gradient only when nothing else holds it.
// Here the add's backward hands the user's seed to both leaves: each must get a copy, so
// in-place edits of one .grad reach neither the other nor the seed.
TEST(Autograd, LeafGradientsNeverAliasEachOtherOrTheSeed) {
  Tensor a = leaf({1.0, 2.0}, {2}), b = leaf({3.0, 4.0}, {2});
  Tensor seed = from_vector<double>({0.5, -1.0}, {2});
  add(a, b).backward(seed);
  a.grad().mul_(10.0);
  EXPECT_EQ(grad_of(a), (std::vector<double>{5.0, -10.0}));
  EXPECT_EQ(grad_of(b), (std::vector<double>{0.5, -1.0}));
  EXPECT_EQ(seed.to_vector<double>(), (std::vector<double>{0.5, -1.0}));
  // A gradient made inside the backward (mul's) is adopted; accumulation still adds.
  Tensor x = leaf({1.0, -2.0}, {2});
  sum(mul(x, 3.0)).backward();
  x.grad().mul_(2.0);
  EXPECT_EQ(grad_of(x), (std::vector<double>{6.0, 6.0}));
  sum(mul(x, 3.0)).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{9.0, 9.0}));
}

TEST(Autograd, LongChainRunsIterativelyAndTearsDownWithoutRecursion) {
  constexpr int kSteps = 30000;
  const double c = 1.00002;
  Tensor x = leaf({1.0, -2.0}, {2});
  Tensor y = x;
  for (int i = 0; i < kSteps; ++i) y = (i % 2 == 0) ? mul(y, c) : add(y, 0.5);
  sum(y).backward();
  double expected = std::pow(c, kSteps / 2);
  for (double g : grad_of(x)) EXPECT_NEAR(g, expected, 1e-9 * expected);

  // A deep graph that never runs backward must also be destroyed without recursing.
  Tensor z = x;
  for (int i = 0; i < kSteps; ++i) z = mul(z, c);
  std::weak_ptr<autograd::Node> tail = z.grad_fn();
  z = Tensor();
  y = Tensor();
  EXPECT_TRUE(tail.expired());
}

TEST(Autograd, RetainGraphAllowsASecondBackward) {
  Tensor x = leaf({0.1, 0.2}, {2});
  Tensor y = sum(exp(x));
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  std::vector<double> g = grad_of(x);
  EXPECT_DOUBLE_EQ(g[0], 2.0 * std::exp(0.1));
  EXPECT_DOUBLE_EQ(g[1], 2.0 * std::exp(0.2));
  try {
    y.backward();
    ADD_FAILURE() << "a third backward through a released graph must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kAutograd) << e.what();
  }
}

TEST(Autograd, SecondBackwardWithoutRetainGraphThrows) {
  Tensor x = leaf({1.0, 2.0}, {2});
  Tensor y = sum(x * x);
  y.backward();
  try {
    y.backward();
    ADD_FAILURE() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kAutograd) << e.what();
  }
}

TEST(Autograd, BackwardReleasesSavedTensorsAndNodes) {
  Tensor x = leaf({0.3, -0.7, 1.1}, {3});
  Tensor y;
  // Saved tensors may be fresh handles, but they keep the intermediate's storage alive.
  std::weak_ptr<Storage> hidden;
  std::weak_ptr<autograd::Node> node;
  {
    Tensor h = exp(x);
    hidden = h.storage();
    node = h.grad_fn();
    y = sum(h * h);
  }
  ASSERT_FALSE(hidden.expired()) << "mul must save its inputs for the backward pass";
  y.backward();
  EXPECT_TRUE(hidden.expired()) << "saved tensors must be released after backward";
  ASSERT_FALSE(node.expired());
  EXPECT_TRUE(node.lock()->released());
  y = Tensor();
  EXPECT_TRUE(node.expired()) << "the graph must be freed with its last output";
}

TEST(Autograd, GraphWithoutBackwardIsFreedWithItsOutput) {
  Tensor x = leaf({0.3, -0.7}, {2});
  std::weak_ptr<autograd::Node> node;
  std::weak_ptr<Storage> out;
  {
    Tensor h = exp(x);  // exp saves its own output: must not form a reference cycle
    node = h.grad_fn();
    out = h.storage();
    Tensor y = sum(tanh(h) * h);
  }
  EXPECT_TRUE(node.expired()) << "graph leaked (reference cycle through a saved output?)";
  EXPECT_TRUE(out.expired());
}

TEST(Autograd, NoGradGuardRecordsNothing) {
  Tensor x = leaf({1.0, 2.0}, {2});
  EXPECT_TRUE(autograd::grad_enabled());
  {
    autograd::NoGradGuard guard;
    EXPECT_FALSE(autograd::grad_enabled());
    Tensor y = exp(x * 2.0);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    EXPECT_TRUE(y.is_leaf());
    {
      autograd::GradModeGuard enable(true);
      EXPECT_TRUE(exp(x).requires_grad());
    }
    EXPECT_FALSE(autograd::grad_enabled());
  }
  EXPECT_TRUE(autograd::grad_enabled());
  EXPECT_TRUE((x * 2.0).requires_grad());
}

TEST(Autograd, DetachSharesStorageAndCutsTheGraph) {
  Tensor x = leaf({1.0, 2.0, 3.0}, {3});
  Tensor y = x * 2.0;
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.grad_fn(), nullptr);
  EXPECT_TRUE(d.is_leaf());
  EXPECT_EQ(d.raw_data(), y.raw_data());
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{2.0, 4.0, 6.0}));
  Tensor z = sum(y * d);  // d is a constant: dz/dx = 2 * d
  z.backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{4.0, 8.0, 12.0}));
}

TEST(Autograd, ZeroGradDropsTheAccumulatedGradient) {
  Tensor x = leaf({1.0, -1.0}, {2});
  sum(x * 3.0).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{3.0, 3.0}));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  sum(x * x).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{2.0, -2.0}));
}

TEST(Autograd, DiamondGraphsSumBothPaths) {
  Tensor x = leaf({0.5, -0.25, 1.5}, {3});
  Tensor h = x * 2.0;
  Tensor z = sum(h * h + h + exp(x));  // h used three times, x twice
  z.backward();
  std::vector<double> xs = {0.5, -0.25, 1.5};
  std::vector<double> g = grad_of(x);
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_NEAR(g[i], 8.0 * xs[i] + 2.0 + std::exp(xs[i]), 1e-14) << i;
  }
}

TEST(Autograd, SameLeafAsBothOperands) {
  Tensor x = leaf({3.0, -2.0}, {2});
  sum(mul(x, x)).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{6.0, -4.0}));
}

TEST(Autograd, NonScalarBackwardNeedsAGradient) {
  Tensor x = leaf({1.0, 2.0, 3.0}, {3});
  Tensor y = x * x;
  expect_error([&] { y.backward(); }, {ErrorCode::kAutograd, ErrorCode::kInvalidArgument},
               "non-scalar backward without gradient");
  Tensor y2 = x * x;
  expect_error(
      [&] {
        y2.backward(from_vector<double>({1.0, 2.0}, {2}));
      },
      {ErrorCode::kShapeMismatch}, "backward with a gradient of the wrong shape");
  Tensor y3 = x * x;
  y3.backward(from_vector<double>({1.0, -1.0, 0.5}, {3}));
  EXPECT_EQ(grad_of(x), (std::vector<double>{2.0, -4.0, 3.0}));
}

TEST(Autograd, LeafThroughAViewChain) {
  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor v = x.transpose(0, 1).slice(0, 0, 3, 2).unsqueeze(0);  // [1, 2, 2]: rows 0 and 2 of x^T
  EXPECT_TRUE(x.is_leaf());
  EXPECT_FALSE(v.is_leaf());
  EXPECT_TRUE(v.requires_grad());
  ASSERT_EQ(v.shape(), (Shape{1, 2, 2}));
  EXPECT_EQ(v.to_vector<double>(), (std::vector<double>{1, 4, 3, 6}));
  Tensor w = from_vector<double>({10, 20, 30, 40}, {1, 2, 2});
  sum(v * w).backward();
  // v[0][i][j] = x[j][2 i]
  EXPECT_EQ(grad_of(x), (std::vector<double>{10, 0, 30, 20, 0, 40}));
}

TEST(Autograd, SetRequiresGradOnlyOnLeaves) {
  Tensor x = leaf({1.0}, {1});
  Tensor y = x * 2.0;
  expect_error([&] { y.set_requires_grad(false); }, {ErrorCode::kAutograd},
               "set_requires_grad on a non-leaf");
  Tensor c = from_vector<double>({1.0}, {1});
  c.set_requires_grad(true);
  EXPECT_TRUE(c.requires_grad());
  c.set_requires_grad(false);
  EXPECT_FALSE(c.requires_grad());
}

TEST(Autograd, InPlaceOnATrackedTensorIsRefused) {
  Tensor x = leaf({1.0, 2.0}, {2});
  expect_error([&] { x.fill_(0.0); }, {ErrorCode::kAutograd, ErrorCode::kInvalidArgument},
               "fill_ on a leaf requiring grad");
  Tensor y = x * 2.0;
  expect_error([&] { y.mul_(2.0); }, {ErrorCode::kAutograd, ErrorCode::kInvalidArgument},
               "mul_ on a graph tensor");
}

// --- post-accumulate-grad hooks ---

// In a chain a -> b -> c (c used last in forward), backward finishes c's gradient first;
// each hook sees its leaf's final gradient for the pass, and runs once per pass even when
// the leaf is used on several paths.
TEST(AutogradHooks, RunOncePerPassWithTheFinalGradientInBackwardOrder) {
  Tensor a = leaf({0.5, -1.0}, {2}), b = leaf({2.0, 3.0}, {2}), c = leaf({-0.5, 1.5}, {2});
  std::vector<std::pair<char, std::vector<double>>> seen;
  std::vector<autograd::HookHandle> handles;
  for (auto [name, t] : {std::pair{'a', a}, std::pair{'b', b}, std::pair{'c', c}}) {
    handles.push_back(autograd::register_post_accumulate_grad_hook(
        t, [&seen, name = name](const Tensor& l) {
          EXPECT_FALSE(autograd::grad_enabled());
          seen.emplace_back(name, l.grad().to_vector<double>());
        }));
  }
  const Tensor x = from_vector<double>({1.0, -2.0}, {2});
  const Tensor h1 = x * a * a;         // a on two paths
  const Tensor h2 = exp(h1) * b;
  const Tensor out = sum(h2 * c);
  out.backward();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].first, 'c');
  EXPECT_EQ(seen[1].first, 'b');
  EXPECT_EQ(seen[2].first, 'a');
  // Independent reference: d/da sum(c * b * exp(x a^2)) = c b exp(x a^2) 2 x a, and so on.
  const std::vector<double> av = {0.5, -1.0}, bv = {2.0, 3.0}, cv = {-0.5, 1.5}, xv = {1.0, -2.0};
  for (size_t i = 0; i < 2; ++i) {
    const double e = std::exp(xv[i] * av[i] * av[i]);
    EXPECT_NEAR(seen[0].second[i], e * bv[i], 1e-14);
    EXPECT_NEAR(seen[1].second[i], e * cv[i], 1e-14);
    EXPECT_NEAR(seen[2].second[i], cv[i] * bv[i] * e * 2.0 * xv[i] * av[i], 1e-13);
  }
  // A second, identical pass: the hook sees the accumulated sum, exactly twice the first.
  const std::vector<double> first_a = seen[2].second;
  seen.clear();
  sum(exp(x * a * a) * b * c).backward();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[2].first, 'a');
  EXPECT_EQ(seen[2].second, (std::vector<double>{2.0 * first_a[0], 2.0 * first_a[1]}));
}

TEST(AutogradHooks, SeveralHooksRunInOrderAndHandlesRemoveThem) {
  Tensor w = leaf({1.0, 2.0}, {2});
  std::vector<int> calls;
  autograd::HookHandle first =
      autograd::register_post_accumulate_grad_hook(w, [&](const Tensor&) { calls.push_back(1); });
  {
    autograd::HookHandle second = autograd::register_post_accumulate_grad_hook(
        w, [&](const Tensor&) { calls.push_back(2); });
    sum(w * w).backward();
    EXPECT_EQ(calls, (std::vector<int>{1, 2}));
  }  // `second` is removed here
  sum(w * w).backward();
  EXPECT_EQ(calls, (std::vector<int>{1, 2, 1}));
  autograd::HookHandle moved = std::move(first);
  sum(w * w).backward();
  EXPECT_EQ(calls, (std::vector<int>{1, 2, 1, 1}));
  moved.remove();
  sum(w * w).backward();
  EXPECT_EQ(calls.size(), 4u);
}

TEST(AutogradHooks, NotRunForLeavesNoGradientReached) {
  Tensor used = leaf({1.0}, {1}), unused = leaf({2.0}, {1});
  int used_calls = 0, unused_calls = 0;
  autograd::HookHandle h1 =
      autograd::register_post_accumulate_grad_hook(used, [&](const Tensor&) { ++used_calls; });
  autograd::HookHandle h2 =
      autograd::register_post_accumulate_grad_hook(unused, [&](const Tensor&) { ++unused_calls; });
  sum(used * 3.0).backward();
  EXPECT_EQ(used_calls, 1);
  EXPECT_EQ(unused_calls, 0);
}

TEST(AutogradHooks, AHookThatThrowsEndsBackward) {
  Tensor w = leaf({1.0}, {1});
  autograd::HookHandle h = autograd::register_post_accumulate_grad_hook(
      w, [](const Tensor&) { RD_FAIL(kInvalidArgument, "hook failed on purpose"); });
  expect_error([&] { sum(w * 2.0).backward(); }, {ErrorCode::kInvalidArgument}, "throwing hook");
}

TEST(AutogradHooks, OnlyOnLeavesThatRequireGrad) {
  Tensor w = leaf({1.0}, {1});
  const Tensor y = w * 2.0;
  const Tensor constant = from_vector<double>({1.0}, {1});
  auto noop = [](const Tensor&) {};
  expect_error([&] { (void)autograd::register_post_accumulate_grad_hook(y, noop); },
               {ErrorCode::kAutograd}, "hook on a non-leaf");
  expect_error([&] { (void)autograd::register_post_accumulate_grad_hook(constant, noop); },
               {ErrorCode::kAutograd}, "hook on a tensor that needs no grad");
}

// A handle may outlive its leaf: removing then is a no-op.
TEST(AutogradHooks, HandleOutlivingItsLeaf) {
  autograd::HookHandle h;
  {
    Tensor w = leaf({1.0}, {1});
    h = autograd::register_post_accumulate_grad_hook(w, [](const Tensor&) {});
  }
  h.remove();
}

// --- activation recomputation ---

// Gradients of sum(out_j * w_j) over fn's outputs, run directly or through recompute().
struct RecomputeRun {
  std::vector<std::vector<double>> outputs;
  std::vector<std::vector<double>> grads;
};

RecomputeRun run_with(const RecomputeFn& fn, bool use_recompute, Generator* gen, uint64_t seed) {
  Tensor a = leaf({0.3, -1.2, 0.8, 1.5, -0.4, 0.9}, {2, 3});
  Tensor b = leaf({0.7, -0.1, 0.2, -1.1, 0.6, 0.05}, {3, 2});
  Tensor constant = from_vector<double>({0.5, -2.0}, {2});
  if (gen) gen->manual_seed(seed);
  std::vector<Tensor> inputs = {a, b, constant};
  std::vector<Tensor> outs;
  if (use_recompute) {
    std::vector<Generator*> gens;
    if (gen) gens.push_back(gen);
    outs = recompute(fn, inputs, gens);
  } else {
    outs = fn(inputs);
  }
  RecomputeRun run;
  Tensor loss = scalar_tensor(0.0, DType::kFloat64);
  double k = 1.0;
  for (const Tensor& o : outs) {
    EXPECT_TRUE(o.requires_grad());
    run.outputs.push_back(o.to_vector<double>());
    loss = loss + sum(o * k);
    k += 0.75;
  }
  // Advance the generator between forward and backward, as other work would.
  if (gen) {
    Tensor noise = rand({5}, *gen, DType::kFloat64);
    (void)noise;
  }
  loss.backward();
  run.grads = {grad_of(a), grad_of(b)};
  return run;
}

TEST(Recompute, SameGradientsAsWithoutIt) {
  int calls = 0;
  RecomputeFn fn = [&calls](const std::vector<Tensor>& in) {
    ++calls;
    Tensor h = tanh(matmul(in[0], in[1]));  // [2, 2]
    return std::vector<Tensor>{sigmoid(h) * in[2] + square(h)};
  };
  RecomputeRun plain = run_with(fn, false, nullptr, 0);
  calls = 0;
  RecomputeRun recomputed = run_with(fn, true, nullptr, 0);
  EXPECT_EQ(calls, 2) << "recompute must run fn once forward and once in backward";
  EXPECT_EQ(plain.outputs, recomputed.outputs);
  EXPECT_EQ(plain.grads, recomputed.grads);
}

TEST(Recompute, DropoutMasksMatchThroughTheGenerator) {
  Generator gen(0);
  RecomputeFn fn = [&gen](const std::vector<Tensor>& in) {
    Tensor h = dropout(matmul(in[0], in[1]), 0.5, /*training=*/true, gen);
    return std::vector<Tensor>{exp(h) + in[2]};
  };
  RecomputeRun plain = run_with(fn, false, &gen, 99);
  RecomputeRun recomputed = run_with(fn, true, &gen, 99);
  EXPECT_EQ(plain.outputs, recomputed.outputs);
  EXPECT_EQ(plain.grads, recomputed.grads);
  // The mask must actually matter: another seed gives other gradients.
  RecomputeRun other = run_with(fn, true, &gen, 100);
  EXPECT_NE(plain.grads, other.grads);
}

TEST(Recompute, MultipleOutputs) {
  RecomputeFn fn = [](const std::vector<Tensor>& in) {
    Tensor p = matmul(in[0], in[1]);  // [2, 2]
    return std::vector<Tensor>{softmax(p, 1), sum(p * p, {0}) + in[2], p.t()};
  };
  RecomputeRun plain = run_with(fn, false, nullptr, 0);
  RecomputeRun recomputed = run_with(fn, true, nullptr, 0);
  EXPECT_EQ(plain.outputs, recomputed.outputs);
  EXPECT_EQ(plain.grads, recomputed.grads);
}

// Leaves that recomputed regions read (a weight shared by several regions, nested inside an
// outer recomputed region, as chunked MLPs inside a recomputed block) get the gradient of
// the plain graph, and their post-accumulate hooks run once per pass; leaves not named
// still get their gradient, once per region that reads them.
TEST(Recompute, NamedLeavesGetOneGradientPerPass) {
  Generator gen(21);
  Tensor x = (rand({4, 3}, gen, DType::kFloat64) - 0.5).detach();
  x.set_requires_grad(true);  // as a block input is: recompute records only then
  auto run = [&](bool use_recompute, bool name_leaves, int* hook_calls) {
    Tensor w = (rand({3, 3}, gen, DType::kFloat64) - 0.5).detach();
    Tensor v = (rand({3, 3}, gen, DType::kFloat64) - 0.5).detach();
    w.set_requires_grad(true);
    v.set_requires_grad(true);
    autograd::HookHandle hook = autograd::register_post_accumulate_grad_hook(
        w, [hook_calls](const Tensor&) { ++*hook_calls; });
    const std::vector<Tensor> leaves = name_leaves ? std::vector<Tensor>{w, v} : std::vector<Tensor>{};
    // The inner region: two chunks of rows, each reading w.
    auto chunk = [&w](const std::vector<Tensor>& in) {
      return std::vector<Tensor>{tanh(matmul(in[0], w))};
    };
    auto block = [&](const std::vector<Tensor>& in) {
      const Tensor h = matmul(in[0], v);
      std::vector<Tensor> parts;
      for (int64_t start : {int64_t{0}, int64_t{2}}) {
        const Tensor piece = h.narrow(0, start, 2);
        parts.push_back(use_recompute ? recompute(chunk, {piece}, {}, name_leaves ? std::vector<Tensor>{w}
                                                                                   : std::vector<Tensor>{})[0]
                                      : chunk({piece})[0]);
      }
      return std::vector<Tensor>{cat(parts, 0)};
    };
    const Tensor out = use_recompute ? recompute(block, {x}, {}, leaves)[0] : block({x})[0];
    sum(out * out).backward();
    return std::vector<Tensor>{w.grad(), v.grad()};
  };
  gen.manual_seed(5);
  int plain_calls = 0;
  const std::vector<Tensor> plain = run(false, false, &plain_calls);
  gen.manual_seed(5);
  int named_calls = 0;
  const std::vector<Tensor> named = run(true, true, &named_calls);
  gen.manual_seed(5);
  int unnamed_calls = 0;
  const std::vector<Tensor> unnamed = run(true, false, &unnamed_calls);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(named_calls, 1) << "a named leaf's hooks must run once per pass";
  EXPECT_EQ(unnamed_calls, 2) << "an unnamed leaf accumulates once per region";
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(named[i].defined() && unnamed[i].defined());
    EXPECT_TRUE(allclose(named[i], plain[i], 1e-12, 1e-14)) << i;
    EXPECT_TRUE(allclose(unnamed[i], plain[i], 1e-12, 1e-14)) << i;
  }
}

// Backward formulas save only what they read: an intermediate consumed by add, sub, where,
// or the operand whose values a product's requested gradients do not need is freed once
// the forward is done with it, not held until backward.
TEST(AutogradMemoryTest, IntermediatesNotReadByBackwardAreFreedAfterForward) {
  Allocator& pool = allocator_for(Device::cpu());
  const TensorOptions f32 = TensorOptions(DType::kFloat32).with_requires_grad(true);
  Tensor w = full({256, 256}, 0.5, f32);  // 256 KiB each
  Tensor b = full({256}, 0.25, f32);
  Tensor c = full({256, 256}, 2.0, TensorOptions(DType::kFloat32));
  const int64_t matrix_bytes = 256 * 256 * 4;
  const int64_t held = pool.stats().allocated_bytes;
  {
    // Each line's inner result is dropped right away unless a backward saved it.
    Tensor y = add(matmul(c, w), b);
    EXPECT_EQ(pool.stats().allocated_bytes - held, matrix_bytes);
    y = sub(y, mul(c, 3.0));  // mul saves c (already held), not the product
    EXPECT_EQ(pool.stats().allocated_bytes - held, matrix_bytes);
    y = where(gt(c, 1.0), y, exp(c));  // exp's output is read by its own backward only
    EXPECT_LE(pool.stats().allocated_bytes - held, 3 * matrix_bytes);
    sum(y).backward();
  }
  EXPECT_TRUE(w.grad().defined() && b.grad().defined());
  EXPECT_EQ(pool.stats().allocated_bytes - held, matrix_bytes + 256 * 4);  // the two gradients
}

// Without retain_graph a node's saved tensors are freed as soon as it ran, not at the end of
// the pass: when the upstream probe runs, exp's saved output must be gone already.
TEST(AutogradMemoryTest, SavedTensorsAreFreedAsSoonAsTheirNodeRan) {
  Tensor x = full({64}, 0.5, TensorOptions(DType::kFloat32).with_requires_grad(true));
  std::weak_ptr<Storage> exp_output;
  bool freed_when_probe_ran = false;
  Tensor probed = x.detach().clone();
  autograd::record(probed, "probe", {x}, [&](const Tensor& g) -> std::vector<Tensor> {
    freed_when_probe_ran = exp_output.expired();
    return {g};
  });
  Tensor loss;
  {
    Tensor e = exp(probed);  // saves its output for backward
    exp_output = e.impl()->storage;
    loss = sum(e);
  }
  EXPECT_FALSE(exp_output.expired());  // held by exp's node until it runs
  loss.backward();
  EXPECT_TRUE(freed_when_probe_ran);
  EXPECT_TRUE(x.grad().defined());
}

}  // namespace
}  // namespace rd
