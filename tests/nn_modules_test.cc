// nn/ building blocks: the pattern cache (hits, eviction, bounds), the Module base (names,
// order, modes), Linear against a float64 reference, and MultiheadDilatedAttention against
// its own composition from the functional pieces, with gradients reaching every parameter.
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
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/ops.h"
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

TEST(MultiheadDilatedAttentionTest, EqualsItsCompositionAndTrainsEveryParameter) {
  nn::DilatedAttentionOptions options;
  options.segment_lengths = {4, 8};
  options.dilation_rates = {1, 2};
  options.causal = true;
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

TEST(RecommendedDTypeTest, IsFloat32OnTheCpu) {
  EXPECT_EQ(nn::recommended_dtype(Device::cpu()), DType::kFloat32);
}

}  // namespace
}  // namespace rd::test
