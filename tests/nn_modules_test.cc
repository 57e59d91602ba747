// nn/ building blocks: the pattern cache (hits, eviction, bounds), the Module base (names,
// order, modes, buffers, module traversal, state dicts), Linear against a float64
// reference, and MultiheadDilatedAttention against its own composition from the functional
// pieces, with gradients reaching every parameter, and its seeding from a Generator.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/nn/linear.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/nn/optimizer.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "testing/random_tensors.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

Tensor arange_tensor(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return from_vector<int64_t>(v, {n});
}

TEST(PatternCacheTest, ComputesOnceThenHits) {
  nn::PatternCache cache(4, 1 << 20);
  int computed = 0;
  auto compute = [&] {
    ++computed;
    return arange_tensor(10);
  };
  Tensor first = cache.get("a", compute);
  Tensor second = cache.get("a", compute);
  EXPECT_EQ(computed, 1);
  EXPECT_EQ(first.raw_data(), second.raw_data()) << "a hit returns the cached tensor";
  const nn::PatternCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.entries, 1);
  EXPECT_EQ(s.bytes, 10 * 8);
}

TEST(PatternCacheTest, EvictsTheLeastRecentlyUsedBeyondTheEntryBound) {
  nn::PatternCache cache(2, 1 << 20);
  int computed = 0;
  auto make = [&] {
    ++computed;
    return arange_tensor(4);
  };
  cache.get("a", make);
  cache.get("b", make);
  cache.get("a", make);  // a is now the most recent
  cache.get("c", make);  // evicts b
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_EQ(cache.stats().entries, 2);
  computed = 0;
  cache.get("a", make);
  EXPECT_EQ(computed, 0) << "a must have survived";
  cache.get("b", make);
  EXPECT_EQ(computed, 1) << "b must have been evicted";
}

TEST(PatternCacheTest, KeepsWithinTheByteBoundAndSkipsOversizedPatterns) {
  nn::PatternCache cache(100, 100);  // 100 bytes: 12 int64 values
  cache.get("small", [] { return arange_tensor(8); });    // 64 bytes
  cache.get("second", [] { return arange_tensor(8); });   // 128 > 100: evicts "small"
  EXPECT_LE(cache.stats().bytes, 100);
  EXPECT_EQ(cache.stats().entries, 1);
  Tensor big = cache.get("big", [] { return arange_tensor(20); });  // 160 bytes: not kept
  EXPECT_EQ(big.numel(), 20);
  EXPECT_LE(cache.stats().bytes, 100);
  cache.clear();
  EXPECT_EQ(cache.stats().entries, 0);
  EXPECT_EQ(cache.stats().bytes, 0);
  EXPECT_THROW(nn::PatternCache(0, 10), Error);
}

// Many threads over overlapping keys and a bound that forces evictions: every get returns
// the right pattern, each call counts once as a hit or a miss, and the bounds hold.
TEST(PatternCacheTest, ConcurrentGetsStayCorrectAndCounted) {
  constexpr int kThreads = 8, kCallsPerThread = 2000, kKeys = 32, kMaxEntries = 12;
  nn::PatternCache cache(kMaxEntries, 1 << 20);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int call = 0; call < kCallsPerThread; ++call) {
        const int key = static_cast<int>(rng() % kKeys);
        Tensor p = cache.get("k" + std::to_string(key), [key] { return arange_tensor(key + 1); });
        if (p.numel() != key + 1 || p.to_vector<int64_t>().back() != key) ++wrong;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  const nn::PatternCacheStats s = cache.stats();
  EXPECT_EQ(s.hits + s.misses, kThreads * kCallsPerThread);
  EXPECT_LE(s.entries, kMaxEntries);
  EXPECT_GT(s.evictions, 0);
  int64_t held_bytes = 0;  // recount what is held: every key still cached hits without compute
  for (int key = 0; key < kKeys; ++key) {
    bool computed = false;
    Tensor p = cache.get("k" + std::to_string(key), [&] {
      computed = true;
      return arange_tensor(key + 1);
    });
    (void)p;
    if (!computed) held_bytes += (key + 1) * 8;
  }
  EXPECT_LE(held_bytes, int64_t{kMaxEntries} * kKeys * 8);
}

// A module keeps its patterns in its own cache and leaves the global one alone.
TEST(PatternCacheTest, ModulesUseTheirOwnCache) {
  nn::DilatedAttentionOptions o;
  o.segment_lengths = {4, 8};
  o.dilation_rates = {1, 2};
  o.variant = nn::DilationVariant::kGlobal;  // gathers cycled index lists from the cache
  o.use_hilbert = true;
  nn::DilatedAttention attention(o);
  Generator gen(5);
  Tensor q = randn({1, 12, 2, 8}, gen), k = randn({1, 12, 2, 8}, gen), v = randn({1, 12, 2, 8}, gen);
  const nn::PatternCacheStats global_before = nn::global_pattern_cache().stats();
  attention.forward(q, k, v);
  attention.forward(q, k, v);
  const nn::PatternCacheStats global_after = nn::global_pattern_cache().stats();
  EXPECT_EQ(global_after.hits, global_before.hits);
  EXPECT_EQ(global_after.misses, global_before.misses);
  const nn::PatternCacheStats own = attention.pattern_cache().stats();
  // Per call, each of the two head groups asks for its cycled list and the Hilbert order of
  // 12 keys: the first call computes the two lists and the order once (3 misses, the second
  // group's order hits), the second call hits all four.
  EXPECT_EQ(own.misses, 3);
  EXPECT_EQ(own.hits, 1 + 4);
}

// Several threads running one module's attention at once get the serial result.
TEST(PatternCacheTest, ConcurrentAttentionCallsMatchTheSerialResult) {
  nn::DilatedAttentionOptions o;
  o.segment_lengths = {4, 8, 16};
  o.dilation_rates = {1, 2, 4};
  o.use_hilbert = true;
  nn::DilatedAttention attention(o);
  Generator gen(6);
  Tensor q = randn({2, 20, 3, 8}, gen), k = randn({2, 20, 3, 8}, gen), v = randn({2, 20, 3, 8}, gen);
  const std::vector<float> serial = attention.forward(q, k, v).to_vector<float>();
  attention.pattern_cache().clear();
  std::vector<std::vector<float>> results(6);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] { results[t] = attention.forward(q, k, v).to_vector<float>(); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::vector<float>& r : results) EXPECT_EQ(r, serial);
}

class TwoLayers : public nn::Module {
 public:
  explicit TwoLayers(Generator& gen) {
    first = register_module("first", std::make_shared<nn::Linear>(3, 4, true, gen));
    second = register_module("second", std::make_shared<nn::Linear>(4, 2, false, gen));
    scale = &register_parameter("scale", full({1}, 2.0));
  }
  std::shared_ptr<nn::Linear> first, second;
  Tensor* scale;
};

TEST(ModuleTest, NamesParametersDepthFirstInRegistrationOrderAndPropagatesModes) {
  Generator gen(1);
  TwoLayers m(gen);
  std::vector<std::string> names;
  for (const auto& [name, param] : m.named_parameters()) {
    names.push_back(name);
    EXPECT_TRUE(param.requires_grad()) << name;
    EXPECT_TRUE(param.is_leaf()) << name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"scale", "first.weight", "first.bias",
                                             "second.weight"}));
  EXPECT_TRUE(m.first->is_training());
  m.eval();
  EXPECT_FALSE(m.is_training());
  EXPECT_FALSE(m.first->is_training());
  EXPECT_FALSE(m.second->is_training());
  m.train();
  EXPECT_TRUE(m.second->is_training());
}

class BadNames : public nn::Module {
 public:
  void add(const std::string& name) { register_parameter(name, zeros({1})); }
};

TEST(ModuleTest, RejectsEmptyDottedAndDuplicateNames) {
  BadNames m;
  m.add("w");
  EXPECT_THROW(m.add("w"), Error);
  EXPECT_THROW(m.add(""), Error);
  EXPECT_THROW(m.add("a.b"), Error);
}

std::vector<std::string> keys_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> keys;
  for (const auto& [key, t] : named) keys.push_back(key);
  return keys;
}

// Free code builds a module tree: parameters, buffers and children registered from outside.
TEST(ModuleTest, RegistersFromFreeCodeAndNamesBuffersLikeParameters) {
  auto child = std::make_shared<nn::Module>();
  child->register_buffer("running", full({3}, 0.5));
  child->register_parameter("w", ones({3}));
  nn::Module root;
  root.register_buffer("count", zeros({1}, DType::kInt64));
  root.register_module("child", child);
  root.register_parameter("bias", zeros({2}));
  EXPECT_EQ(keys_of(root.named_buffers()), (std::vector<std::string>{"count", "child.running"}));
  EXPECT_EQ(keys_of(root.named_parameters()), (std::vector<std::string>{"bias", "child.w"}));
  EXPECT_EQ(root.buffers().size(), 2u);
  for (const Tensor& b : root.buffers()) EXPECT_FALSE(b.requires_grad());
  EXPECT_FALSE(child->register_buffer("grad_free", ones({1}, TensorOptions().with_requires_grad(
                                                                 true))).requires_grad());
  EXPECT_THROW(root.register_buffer("bias", zeros({1})), Error) << "names are shared with params";
  EXPECT_THROW(root.register_parameter("child", zeros({1})), Error);
  EXPECT_THROW(root.register_buffer("undefined", Tensor()), Error);

  root.to(DType::kFloat64);  // floating buffers convert, integer ones keep their dtype
  const std::map<std::string, Tensor> state = root.state_dict();
  EXPECT_EQ(state.at("count").dtype(), DType::kInt64);
  EXPECT_EQ(state.at("child.running").dtype(), DType::kFloat64);
  EXPECT_EQ(state.at("child.running").to_vector<double>(), (std::vector<double>{0.5, 0.5, 0.5}));
  for (const Tensor& p : root.parameters()) {
    EXPECT_EQ(p.dtype(), DType::kFloat64);
    EXPECT_TRUE(p.requires_grad() && p.is_leaf());
  }
  EXPECT_EQ(state.size(), 5u);
  for (const auto& [key, t] : state) EXPECT_FALSE(t.requires_grad()) << key << " is detached";
}

class Named : public nn::Module {
 public:
  std::shared_ptr<Named> add(const std::string& name) {
    return register_module(name, std::make_shared<Named>());
  }
};

TEST(ModuleTest, NamedModulesIsDepthFirstAndApplyVisitsChildrenFirst) {
  Named root;
  auto a = root.add("a");
  auto x = a->add("x");
  auto y = a->add("y");
  auto b = root.add("b");
  std::vector<std::string> names;
  std::vector<nn::Module*> modules;
  for (const auto& [name, module] : root.named_modules()) {
    names.push_back(name);
    modules.push_back(module);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"", "a", "a.x", "a.y", "b"}));
  EXPECT_EQ(modules, (std::vector<nn::Module*>{&root, a.get(), x.get(), y.get(), b.get()}));
  std::vector<nn::Module*> applied;
  root.apply([&](nn::Module& m) { applied.push_back(&m); });
  EXPECT_EQ(applied, (std::vector<nn::Module*>{x.get(), y.get(), a.get(), b.get(), &root}));
}

// TwoLayers plus an int64 buffer: the keys first.weight [4, 3], first.bias [4],
// second.weight [2, 4], scale [1], steps [1] (int64).
class TwoLayersWithBuffer : public TwoLayers {
 public:
  explicit TwoLayersWithBuffer(Generator& gen) : TwoLayers(gen) {
    register_buffer("steps", zeros({1}, DType::kInt64));
  }
};

std::map<std::string, std::vector<double>> values_by_key(const nn::Module& m) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [key, t] : m.state_dict()) out[key] = to_ref(t).data;
  return out;
}

TEST(ModuleTest, LoadStateDictReportsEveryProblemAndStrictModeChangesNothing) {
  Generator gen(3), other(4);
  TwoLayersWithBuffer model(gen);
  TwoLayersWithBuffer source(other);
  std::map<std::string, Tensor> state = source.state_dict();
  state.erase("first.bias");                            // missing
  state["extra"] = zeros({1});                          // unexpected
  state["second.weight"] = zeros({4, 2});               // wrong shape
  state["steps"] = full({1}, 7.0);                      // float into an int64 buffer
  const auto before = values_by_key(model);
  EXPECT_TRUE(raises([&] { model.load_state_dict(state); }, {ErrorCode::kInvalidArgument},
                     {"load_state_dict", "missing key 'first.bias'", "unexpected key 'extra'",
                      "'second.weight': expected [2, 4] float32, got [4, 2] float32",
                      "'steps': expected [1] int64, got [1] float32"}));
  EXPECT_EQ(values_by_key(model), before) << "strict mode changes nothing on failure";

  const std::vector<Tensor> handles = model.parameters();
  const nn::LoadStateDictResult report = model.load_state_dict(state, /*strict=*/false);
  EXPECT_EQ(report.missing_keys, std::vector<std::string>{"first.bias"});
  EXPECT_EQ(report.unexpected_keys, std::vector<std::string>{"extra"});
  ASSERT_EQ(report.mismatched.size(), 2u);
  EXPECT_NE(report.mismatched[0].find("second.weight"), std::string::npos);
  EXPECT_NE(report.mismatched[1].find("steps"), std::string::npos);
  const auto after = values_by_key(model);
  const auto wanted = values_by_key(source);
  for (const char* loaded : {"first.weight", "scale"}) {
    EXPECT_EQ(after.at(loaded), wanted.at(loaded)) << loaded;
  }
  for (const char* kept : {"first.bias", "second.weight", "steps"}) {
    EXPECT_EQ(after.at(kept), before.at(kept)) << kept;
  }
  const std::vector<Tensor> handles_after = model.parameters();
  for (size_t i = 0; i < handles.size(); ++i) EXPECT_TRUE(handles[i].is_same(handles_after[i]));
}

// Loading copies into the live parameters (converting the dtype), so an optimizer built
// before the load updates the loaded values.
TEST(ModuleTest, LoadStateDictConvertsDTypesAndKeepsOptimizersWorking) {
  Generator gen(5);
  nn::Linear layer(3, 2, true, gen, TensorOptions(DType::kFloat64));
  nn::AdamW optimizer(layer.named_parameters(), {.lr = 0.1, .weight_decay = 0.0});
  std::mt19937_64 rng(6);
  std::map<std::string, Tensor> state = {
      {"weight", random_nonzero_tensor({2, 3}, DType::kFloat32, rng)},
      {"bias", random_nonzero_tensor({2}, DType::kFloat32, rng)}};
  EXPECT_TRUE(layer.load_state_dict(state).ok());
  const std::vector<double> loaded = to_ref(layer.weight()).data;
  EXPECT_EQ(loaded, to_ref(state["weight"]).data);
  EXPECT_EQ(layer.weight().dtype(), DType::kFloat64);
  sum(layer.forward(ones({1, 3}, TensorOptions(DType::kFloat64)))).backward();
  optimizer.step();
  const std::vector<double> stepped = to_ref(layer.weight()).data;
  for (size_t i = 0; i < loaded.size(); ++i) {
    // Adam's first step moves each weight by lr against the sign of its gradient (+1 here).
    EXPECT_NEAR(stepped[i], loaded[i] - 0.1, 1e-6) << i;
  }
}

TEST(LinearTest, MatchesAFloat64ReferenceAndInitialisesWithinTheBound) {
  Generator gen(7);
  nn::Linear layer(5, 3, true, gen, TensorOptions(DType::kFloat64));
  const double bound = 1.0 / std::sqrt(5.0);
  const std::vector<double> w = layer.weight().to_vector<double>();
  const std::vector<double> b = layer.bias()->to_vector<double>();
  for (double x : w) EXPECT_LE(std::abs(x), bound);
  std::mt19937_64 rng(3);
  RefArray x_values = random_values({2, 4, 5}, Domain::kAny, DType::kFloat64, rng);
  Tensor x = from_ref(x_values, DType::kFloat64);
  const std::vector<double> y = layer.forward(x).to_vector<double>();
  ASSERT_EQ(y.size(), 2u * 4u * 3u);
  for (int64_t row = 0; row < 8; ++row) {
    for (int64_t o = 0; o < 3; ++o) {
      double want = b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < 5; ++i) {
        want += x_values.data[static_cast<size_t>(row * 5 + i)] * w[static_cast<size_t>(o * 5 + i)];
      }
      EXPECT_NEAR(y[static_cast<size_t>(row * 3 + o)], want, 1e-12);
    }
  }
  EXPECT_THROW(layer.forward(zeros({2, 4}, TensorOptions(DType::kFloat64))), Error);
}

// Causal, pairs (4, 1) and (8, 2): small enough for float64 compositions on the CPU.
nn::DilatedAttentionOptions small_causal_options() {
  nn::DilatedAttentionOptions options;
  options.segment_lengths = {4, 8};
  options.dilation_rates = {1, 2};
  options.causal = true;
  return options;
}

TEST(MultiheadDilatedAttentionTest, EqualsItsCompositionAndTrainsEveryParameter) {
  const nn::DilatedAttentionOptions options = small_causal_options();
  nn::MultiheadOptions module_options;
  module_options.tensor_options = TensorOptions(DType::kFloat64);
  Generator init(5);
  nn::MultiheadDilatedAttention mha(12, 3, options, init, module_options);
  std::mt19937_64 rng(9);
  Tensor x = from_ref(random_values({2, 11, 12}, Domain::kAny, DType::kFloat64, rng),
                      DType::kFloat64);
  Tensor y = mha.forward(x);
  ASSERT_EQ(y.shape(), (Shape{2, 11, 12}));

  // The same from the pieces: QKV projection, split into heads, attention, out projection.
  std::map<std::string, Tensor> p;
  for (const auto& [name, t] : mha.named_parameters()) p[name] = t.detach();
  Tensor qkv = add(matmul(x, p["qkv.weight"].t()), p["qkv.bias"]).reshape({2, 11, 3, 3, 4});
  Tensor attended = nn::dilated_attention(qkv.select(2, 0), qkv.select(2, 1), qkv.select(2, 2),
                                          options);
  Tensor want = add(matmul(attended.reshape({2, 11, 12}), p["out.weight"].t()), p["out.bias"]);
  EXPECT_TRUE(allclose(y, want, 1e-12, 1e-12));

  sum(mul(y, y)).backward();
  for (const auto& [name, t] : mha.named_parameters()) {
    ASSERT_TRUE(t.grad().defined()) << name;
    const std::vector<double> g = t.grad().to_vector<double>();
    double norm = 0;
    for (double v : g) norm += v * v;
    EXPECT_GT(norm, 0.0) << name << " got no gradient";
  }
  EXPECT_EQ(mha.last_path(), nn::AttentionPath::kMath);
  EXPECT_THROW(nn::MultiheadDilatedAttention(10, 3, options, init), Error);
}

// With rotary positions the module rotates q and k inside its projection's output (and the
// gradient inside the attention's): values and every gradient equal the composition's,
// which rotates separate copies.
TEST(MultiheadDilatedAttentionTest, WithRotaryPositionsEqualsItsComposition) {
  const nn::DilatedAttentionOptions options = small_causal_options();
  nn::MultiheadOptions module_options;
  module_options.tensor_options = TensorOptions(DType::kFloat64);
  module_options.rope_base = 500.0;
  Generator init(7);
  nn::MultiheadDilatedAttention mha(16, 2, options, init, module_options);
  std::mt19937_64 rng(11);
  const Tensor x_values = from_ref(random_values({2, 16, 16}, Domain::kAny, DType::kFloat64, rng),
                                   DType::kFloat64);
  const Tensor w = from_ref(random_values({2, 16, 16}, Domain::kAny, DType::kFloat64, rng),
                            DType::kFloat64);
  Tensor x = x_values.clone();
  x.set_requires_grad(true);
  const Tensor y = mha.forward(x);
  sum(mul(y, w)).backward();

  std::map<std::string, Tensor> p;
  for (const auto& [name, t] : mha.named_parameters()) {
    p[name] = t.detach().clone();
    p[name].set_requires_grad(true);
  }
  Tensor x2 = x_values.clone();
  x2.set_requires_grad(true);
  const Tensor qkv = add(matmul(x2, p["qkv.weight"].t()), p["qkv.bias"]).reshape({2, 16, 3, 2, 8});
  const Tensor attended = nn::dilated_attention(rotary_embedding(qkv.select(2, 0), 0, 500.0),
                                                rotary_embedding(qkv.select(2, 1), 0, 500.0),
                                                qkv.select(2, 2), options);
  const Tensor want = add(matmul(attended.reshape({2, 16, 16}), p["out.weight"].t()), p["out.bias"]);
  sum(mul(want, w)).backward();
  EXPECT_TRUE(allclose(y, want, 1e-12, 1e-12));
  EXPECT_TRUE(allclose(x.grad(), x2.grad(), 1e-12, 1e-12)) << "input gradient";
  for (const auto& [name, t] : mha.named_parameters()) {
    EXPECT_TRUE(allclose(t.grad(), p[name].grad(), 1e-12, 1e-12)) << name;
  }
}

// Forward + backward holds no activation longer than the backward needs it. With B*N*E
// elements as the unit, the peak during backward is: the QKV projection output (3, read by
// the attention backward), the attention output (1, read by the output projection's weight
// gradient), the module output (1, held by the caller), the attention output's gradient (1)
// and the packed QKV gradient (3), plus the parameter gradients and the LSE. Anything more
// is a saved tensor that pins memory (a bias add once kept a whole QKV-sized GEMM output).
TEST(MultiheadDilatedAttentionTest, PeakMemoryOfForwardBackwardIsTheActivationBudget) {
  constexpr int64_t kEmbed = 512, kHeads = 8, kSeqLen = 4096;
  nn::DilatedAttentionOptions options;
  options.segment_lengths = {1024, 2048};
  options.dilation_rates = {1, 2};
  nn::MultiheadOptions module_options;
  module_options.tensor_options = TensorOptions(DType::kFloat32);
  Generator init(2);
  nn::MultiheadDilatedAttention mha(kEmbed, kHeads, options, init, module_options);
  Generator gen(4);
  const TensorOptions f32(DType::kFloat32);
  Tensor x = randn({1, kSeqLen, kEmbed}, gen, f32.with_requires_grad(true));
  const Tensor grad_y = randn({1, kSeqLen, kEmbed}, gen, f32);

  int64_t parameter_bytes = 0;
  for (const Tensor& p : mha.parameters()) parameter_bytes += p.numel() * 4;
  const int64_t unit = kSeqLen * kEmbed * 4;
  const int64_t lse_bytes = kHeads * kSeqLen * 4;
  const int64_t budget = 9 * unit + parameter_bytes + lse_bytes;

  Allocator& pool = allocator_for(Device::cpu());
  const int64_t held = pool.stats().allocated_bytes;
  pool.reset_peak_stats();
  mha.forward(x).backward(grad_y);
  const int64_t peak_delta = pool.stats().peak_allocated_bytes - held;
  // Kernel scratch (the math path's per-thread tiles) gets a quarter unit.
  EXPECT_LE(peak_delta, budget + unit / 4)
      << "peak above the inputs: " << static_cast<double>(peak_delta) / unit
      << " units of B*N*E floats; budget " << static_cast<double>(budget) / unit;
  EXPECT_GE(peak_delta, 9 * unit);  // the budget's tensors do all exist at once
  ASSERT_TRUE(x.grad().defined());
  // After backward only the gradients remain above what was held.
  EXPECT_EQ(pool.stats().allocated_bytes - held, unit + parameter_bytes);
}

// Layers built one after another from one generator differ; the same seed rebuilds the
// same model, parameters and attention dropout state alike.
TEST(MultiheadDilatedAttentionTest, LayersFromOneGeneratorDifferAndOneSeedReproduces) {
  nn::DilatedAttentionOptions options;
  options.segment_lengths = {4};
  options.dilation_rates = {1};
  options.dropout = 0.1;
  auto build_two = [&](uint64_t seed) {
    Generator gen(seed);
    auto first = std::make_shared<nn::MultiheadDilatedAttention>(8, 2, options, gen);
    auto second = std::make_shared<nn::MultiheadDilatedAttention>(8, 2, options, gen);
    return std::pair{first, second};
  };
  auto [a1, a2] = build_two(7);
  auto [b1, b2] = build_two(7);
  auto [c1, c2] = build_two(8);
  const std::map<std::string, Tensor> a1_state = a1->state_dict();
  EXPECT_TRUE(a1_state.contains("attention.dropout_state"));
  EXPECT_EQ(a1_state.size(), 5u);  // qkv and out weight and bias, the dropout state
  auto same = [](const nn::Module& x, const nn::Module& y, const std::string& key) {
    return allclose(x.state_dict().at(key), y.state_dict().at(key), 0.0, 0.0);
  };
  for (const auto& [key, unused] : a1_state) {
    EXPECT_FALSE(same(*a1, *a2, key)) << key << ": two layers from one generator";
    EXPECT_TRUE(same(*a1, *b1, key) && same(*a2, *b2, key)) << key << ": one seed reproduces";
    EXPECT_FALSE(same(*a1, *c1, key)) << key << ": another seed";
  }
  // The dropout state drives the masks: the reproduced layers agree in training mode.
  Generator data(9);
  const Tensor x = randn({1, 8, 8}, data);
  EXPECT_TRUE(allclose(a2->forward(x), b2->forward(x), 0.0, 0.0));
}

TEST(RecommendedDTypeTest, IsFloat32OnTheCpu) {
  EXPECT_EQ(nn::recommended_dtype(Device::cpu()), DType::kFloat32);
}

}  // namespace
}  // namespace rd::test
