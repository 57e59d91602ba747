// The layers a model is built from: Embedding, LayerNorm, RMSNorm, MLP, Dropout, Sequential
// and ModuleList. Forwards against float64 loops, gradients (input and every parameter)
// against central differences of the module itself, and a whole model's state dict through
// a safetensors file into a model built from another seed.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/containers.h"
#include "ringdilated/nn/dropout.h"
#include "ringdilated/nn/embedding.h"
#include "ringdilated/nn/linear.h"
#include "ringdilated/nn/mlp.h"
#include "ringdilated/nn/module.h"
#include "ringdilated/nn/norm.h"
#include "ringdilated/nn/random_state.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/safetensors.h"
#include "testing/gradcheck.h"
#include "testing/random_tensors.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

const TensorOptions kF64(DType::kFloat64);

// The values of a float64 tensor (any layout) as doubles.
std::vector<double> values_of(const Tensor& t) { return to_ref(t).data; }

// Applies fn to every row of the last dim of x: out row = fn(in row).
RefArray rowwise(const RefArray& x,
                 const std::function<void(const double* in, double* out, int64_t n)>& fn) {
  RefArray out = RefArray::filled(x.shape, 0.0);
  const int64_t n = x.shape.back();
  for (int64_t row = 0; row < x.numel() / n; ++row) {
    fn(x.data.data() + row * n, out.data.data() + row * n, n);
  }
  return out;
}

// x [..., in] @ W[out, in]^T + b (b may be empty), in float64 loops.
RefArray ref_linear(const RefArray& x, const std::vector<double>& w, const std::vector<double>& b,
                    int64_t out_features) {
  const int64_t in = x.shape.back();
  const int64_t rows = x.numel() / in;
  Shape shape = x.shape;
  shape.back() = out_features;
  RefArray y = RefArray::filled(shape, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out_features; ++o) {
      double acc = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i) {
        acc += x.data[static_cast<size_t>(r * in + i)] * w[static_cast<size_t>(o * in + i)];
      }
      y.data[static_cast<size_t>(r * out_features + o)] = acc;
    }
  }
  return y;
}

RefArray ref_map(RefArray x, double (*fn)(double)) {
  for (double& v : x.data) v = fn(v);
  return x;
}

double ref_gelu(double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }
double ref_silu(double v) { return v / (1.0 + std::exp(-v)); }

// A module's parameter by qualified name (fails the test when absent).
Tensor parameter(const nn::Module& m, const std::string& name) {
  for (const auto& [key, t] : m.named_parameters()) {
    if (key == name) return t;
  }
  ADD_FAILURE() << "no parameter " << name;
  return {};
}

std::vector<std::string> keys_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> keys;
  for (const auto& [key, t] : named) keys.push_back(key);
  return keys;
}

// Random non-zero values for every parameter (norms start at ones and zeros, which would
// hide a swapped weight and bias), loaded through load_state_dict.
void randomize_parameters(nn::Module& m, std::mt19937_64& rng) {
  std::map<std::string, Tensor> state;
  for (const auto& [key, t] : m.named_parameters()) {
    state[key] = random_nonzero_tensor(t.shape(), t.dtype(), rng);
  }
  for (const auto& [key, t] : m.named_buffers()) state[key] = t.clone();
  m.load_state_dict(state);
}

// Checks the gradients backward gives the input (when floating) and every parameter of `m`
// against float64 central differences of L = sum(m.forward(x) * w), w fixed, random and
// non-zero. Buffers are restored before every forward, so a layer that advances random
// state (Dropout) draws one mask throughout. Parameters must be contiguous float64.
::testing::AssertionResult module_gradcheck(nn::UnaryModule& m, const Tensor& x_value,
                                            std::mt19937_64& rng) {
  const GradcheckOptions tol;
  std::map<std::string, Tensor> saved_buffers;
  for (const auto& [key, b] : m.named_buffers()) saved_buffers[key] = b.clone();
  // Through load_state_dict, so that layers also reload what they keep of a buffer.
  auto restore_buffers = [&] { m.load_state_dict(saved_buffers, /*strict=*/false); };
  Tensor x = x_value.detach().clone();
  std::vector<std::pair<std::string, Tensor>> targets = m.named_parameters();
  if (is_floating(x.dtype())) {
    x.set_requires_grad(true);
    targets.insert(targets.begin(), {"input", x});
  }
  for (Tensor p : m.parameters()) p.zero_grad();
  restore_buffers();
  const Tensor y = m.forward(x);
  const Tensor w = random_nonzero_tensor(y.shape(), DType::kFloat64, rng);
  sum(y * w).backward();
  auto loss = [&] {
    restore_buffers();
    autograd::NoGradGuard no_grad;
    return sum(m.forward(x) * w).item<double>();
  };
  for (const auto& [name, t] : targets) {
    if (!t.grad().defined()) return ::testing::AssertionFailure() << name << " got no gradient";
    const std::vector<double> analytic = values_of(t.grad());
    double* data = t.data_ptr<double>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double original = data[i];
      data[i] = original + tol.eps;
      const double plus = loss();
      data[i] = original - tol.eps;
      const double minus = loss();
      data[i] = original;
      const double numeric = (plus - minus) / (2 * tol.eps);
      const double got = analytic[static_cast<size_t>(i)];
      if (std::abs(got - numeric) > tol.atol + tol.rtol * std::abs(numeric)) {
        return ::testing::AssertionFailure() << name << "[" << i << "]: analytic " << got
                                             << ", numeric " << numeric;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// --- Embedding ---

TEST(EmbeddingTest, PicksRowsOfANormalWeightAndSumsGradientsOfRepeatedIndices) {
  constexpr int64_t kRows = 7, kDim = 5;
  Generator gen(3);
  nn::Embedding table(kRows, kDim, gen, kF64);
  EXPECT_EQ(keys_of(table.named_parameters()), std::vector<std::string>{"weight"});
  const std::vector<double> weight = values_of(table.weight());
  const std::vector<int64_t> ids = {4, 0, 6, 4, 4, 2};  // 4 repeats: its gradient sums
  for (DType index_dtype : {DType::kInt64, DType::kInt32}) {
    Tensor(table.weight()).zero_grad();
    const Tensor indices = from_vector<int64_t>(ids, {2, 3}).to(index_dtype);
    const Tensor y = table.forward(indices);
    ASSERT_EQ(y.shape(), (Shape{2, 3, kDim}));
    std::vector<double> want;
    for (int64_t id : ids) {
      want.insert(want.end(), weight.begin() + id * kDim, weight.begin() + (id + 1) * kDim);
    }
    EXPECT_EQ(values_of(y), want) << dtype_short_name(index_dtype);

    std::mt19937_64 rng(5);
    const Tensor upstream = random_nonzero_tensor(y.shape(), DType::kFloat64, rng);
    sum(y * upstream).backward();
    std::vector<double> want_grad(static_cast<size_t>(kRows * kDim), 0.0);
    const std::vector<double> u = values_of(upstream);
    for (size_t pos = 0; pos < ids.size(); ++pos) {
      for (int64_t d = 0; d < kDim; ++d) {
        const auto d_at = static_cast<size_t>(d);
        want_grad[static_cast<size_t>(ids[pos] * kDim) + d_at] += u[pos * kDim + d_at];
      }
    }
    EXPECT_TRUE(values_close(RefArray({kRows, kDim}, want_grad), to_ref(table.weight().grad()),
                             tolerance_for(DType::kFloat64, 3)));
  }
  EXPECT_TRUE(raises([&] { table.forward(from_vector<int64_t>({7}, {1})); },
                     {ErrorCode::kOutOfRange}, {"embedding", "index 7"}));
  EXPECT_TRUE(raises([&] { table.forward(zeros({2})); }, {ErrorCode::kDTypeMismatch},
                     {"Embedding", "indices"}));
}

TEST(EmbeddingTest, InitialisesFromTheStandardNormal) {
  Generator gen(11);
  nn::Embedding table(1000, 16, gen);  // 16,000 draws: mean and std within 5 sigma
  const std::vector<float> w = table.weight().to_vector<float>();
  double mean = 0, square = 0;
  for (float v : w) mean += v / static_cast<double>(w.size());
  for (float v : w) square += (v - mean) * (v - mean) / static_cast<double>(w.size());
  EXPECT_NEAR(mean, 0.0, 5.0 / std::sqrt(16000.0));
  EXPECT_NEAR(std::sqrt(square), 1.0, 0.03);
}

// --- norms ---

TEST(LayerNormTest, MatchesAFloat64ReferenceAndItsGradients) {
  constexpr int64_t kDim = 6;
  constexpr double kEps = 1e-3;  // large enough to matter in the reference
  std::mt19937_64 rng(21);
  const RefArray x = random_values({3, 2, kDim}, Domain::kAny, DType::kFloat64, rng);
  for (bool affine : {false, true}) {
    for (bool bias : {false, true}) {
      nn::LayerNorm norm(kDim, kEps, affine, bias, kF64);
      EXPECT_EQ(norm.parameters().size(), affine ? (bias ? 2u : 1u) : 0u);
      randomize_parameters(norm, rng);
      const std::vector<double> w = affine ? values_of(*norm.weight()) : std::vector<double>();
      const std::vector<double> b =
          norm.bias() != nullptr ? values_of(*norm.bias()) : std::vector<double>();
      const RefArray want = rowwise(x, [&](const double* in, double* out, int64_t n) {
        double mean = 0, var = 0;
        for (int64_t i = 0; i < n; ++i) mean += in[i] / n;
        for (int64_t i = 0; i < n; ++i) var += (in[i] - mean) * (in[i] - mean) / n;
        for (int64_t i = 0; i < n; ++i) {
          const auto at = static_cast<size_t>(i);
          out[i] = (in[i] - mean) / std::sqrt(var + kEps) * (w.empty() ? 1.0 : w[at]) +
                   (b.empty() ? 0.0 : b[at]);
        }
      });
      const Tensor input = from_ref(x, DType::kFloat64);
      EXPECT_TRUE(values_close(want, to_ref(norm.forward(input)),
                               tolerance_for(DType::kFloat64, kDim)))
          << "affine " << affine << " bias " << bias;
      EXPECT_TRUE(module_gradcheck(norm, input, rng)) << "affine " << affine << " bias " << bias;
    }
  }
  nn::LayerNorm norm(kDim);
  EXPECT_TRUE(raises([&] { norm.forward(zeros({2, 5})); }, {ErrorCode::kShapeMismatch},
                     {"LayerNorm", "[2, 5]"}));
  EXPECT_THROW(nn::LayerNorm(0), Error);
  EXPECT_THROW(nn::LayerNorm(4, -1.0), Error);
}

TEST(RMSNormTest, MatchesAFloat64ReferenceAndItsGradients) {
  constexpr int64_t kDim = 5;
  constexpr double kEps = 1e-2;
  std::mt19937_64 rng(22);
  const RefArray x = random_values({4, kDim}, Domain::kAny, DType::kFloat64, rng);
  for (bool affine : {false, true}) {
    nn::RMSNorm norm(kDim, kEps, affine, kF64);
    randomize_parameters(norm, rng);
    const std::vector<double> w = affine ? values_of(*norm.weight()) : std::vector<double>();
    const RefArray want = rowwise(x, [&](const double* in, double* out, int64_t n) {
      double square = 0;
      for (int64_t i = 0; i < n; ++i) square += in[i] * in[i] / n;
      for (int64_t i = 0; i < n; ++i) {
        out[i] = in[i] / std::sqrt(square + kEps) * (w.empty() ? 1.0 : w[static_cast<size_t>(i)]);
      }
    });
    const Tensor input = from_ref(x, DType::kFloat64);
    EXPECT_TRUE(
        values_close(want, to_ref(norm.forward(input)), tolerance_for(DType::kFloat64, kDim)));
    EXPECT_TRUE(module_gradcheck(norm, input, rng)) << "affine " << affine;
  }
  nn::RMSNorm norm(kDim);
  EXPECT_TRUE(raises([&] { norm.forward(zeros({3})); }, {ErrorCode::kShapeMismatch},
                     {"RMSNorm", "[3]"}));
}

// --- MLP ---

TEST(MLPTest, GeluAndSwiGLUMatchFloat64ReferencesAndTheirGradients) {
  constexpr int64_t kDim = 4, kHidden = 6;
  std::mt19937_64 rng(31);
  const RefArray x = random_values({2, 3, kDim}, Domain::kAny, DType::kFloat64, rng);
  const Tensor input = from_ref(x, DType::kFloat64);
  for (bool bias : {true, false}) {
    Generator gen(8);
    nn::MLP gelu_mlp(kDim, kHidden, nn::MLPActivation::kGelu, bias, gen, kF64);
    std::vector<std::string> want_keys = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    if (!bias) want_keys = {"fc1.weight", "fc2.weight"};
    EXPECT_EQ(keys_of(gelu_mlp.named_parameters()), want_keys);
    auto weight = [](const nn::Module& m, const std::string& layer) {
      return values_of(parameter(m, layer + ".weight"));
    };
    auto bias_of = [&](const nn::Module& m, const std::string& layer) {
      return bias ? values_of(parameter(m, layer + ".bias")) : std::vector<double>();
    };
    const RefArray hidden =
        ref_map(ref_linear(x, weight(gelu_mlp, "fc1"), bias_of(gelu_mlp, "fc1"), kHidden),
                ref_gelu);
    const RefArray want_gelu =
        ref_linear(hidden, weight(gelu_mlp, "fc2"), bias_of(gelu_mlp, "fc2"), kDim);
    EXPECT_TRUE(values_close(want_gelu, to_ref(gelu_mlp.forward(input)),
                             tolerance_for(DType::kFloat64, kDim + kHidden)));
    EXPECT_TRUE(module_gradcheck(gelu_mlp, input, rng)) << "gelu, bias " << bias;

    nn::MLP swiglu(kDim, kHidden, nn::MLPActivation::kSwiGLU, bias, gen, kF64);
    std::vector<std::string> swiglu_keys;
    for (const char* layer : {"gate", "up", "down"}) {
      swiglu_keys.push_back(std::string(layer) + ".weight");
      if (bias) swiglu_keys.push_back(std::string(layer) + ".bias");
    }
    EXPECT_EQ(keys_of(swiglu.named_parameters()), swiglu_keys);
    RefArray gated =
        ref_map(ref_linear(x, weight(swiglu, "gate"), bias_of(swiglu, "gate"), kHidden), ref_silu);
    const RefArray up = ref_linear(x, weight(swiglu, "up"), bias_of(swiglu, "up"), kHidden);
    for (size_t i = 0; i < gated.data.size(); ++i) gated.data[i] *= up.data[i];
    const RefArray want_swiglu =
        ref_linear(gated, weight(swiglu, "down"), bias_of(swiglu, "down"), kDim);
    EXPECT_TRUE(values_close(want_swiglu, to_ref(swiglu.forward(input)),
                             tolerance_for(DType::kFloat64, kDim + kHidden)));
    EXPECT_TRUE(module_gradcheck(swiglu, input, rng)) << "swiglu, bias " << bias;
  }
}

// --- Dropout ---

TEST(DropoutTest, ZeroesOrScalesInTrainingAndIsTheIdentityInEvalOrAtPZero) {
  constexpr double kP = 0.3;
  constexpr int64_t kCount = 10000;
  nn::Dropout drop(kP, 77);
  std::mt19937_64 rng(41);
  const Tensor x = random_nonzero_tensor({kCount}, DType::kFloat64, rng);
  const std::vector<double> xs = values_of(x);
  const std::vector<double> first = values_of(drop.forward(x));
  int64_t dropped = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (first[i] == 0.0) {
      ++dropped;
    } else {
      EXPECT_NEAR(first[i], xs[i] / (1.0 - kP), 1e-15 * std::abs(xs[i]) * 4) << i;
    }
  }
  // Binomial(10000, 0.3): standard deviation about 46; allow 6.
  EXPECT_NEAR(static_cast<double>(dropped), kP * kCount, 6 * std::sqrt(kCount * kP * (1 - kP)));
  EXPECT_EQ(drop.generator_state().offset, static_cast<uint64_t>(kCount));
  EXPECT_NE(values_of(drop.forward(x)), first) << "the stream advances between calls";

  drop.eval();
  EXPECT_TRUE(drop.forward(x).is_same(x));
  nn::Dropout off(0.0, 77);
  EXPECT_TRUE(off.forward(x).is_same(x));
  EXPECT_EQ(off.generator_state().offset, 0u);
  EXPECT_THROW(nn::Dropout(1.5, 1), Error);
  EXPECT_THROW(nn::Dropout(-0.1, 1), Error);
}

TEST(DropoutTest, GradientIsTheMaskAndLayersFromOneGeneratorDiffer) {
  std::mt19937_64 rng(42);
  nn::Dropout drop(0.5, 9);
  EXPECT_TRUE(module_gradcheck(drop, random_nonzero_tensor({3, 7}, DType::kFloat64, rng), rng));

  Generator gen(5);
  nn::Dropout a(0.5, gen), b(0.5, gen);
  EXPECT_NE(a.generator_state().seed, b.generator_state().seed);
  const Tensor x = ones({256}, kF64);
  EXPECT_NE(values_of(a.forward(x)), values_of(b.forward(x)));
}

// A resumed run draws the masks the uninterrupted one would: the generator state travels
// in the state dict (through safetensors bytes) into a layer built with another seed.
TEST(DropoutTest, RestoredGeneratorStateRepeatsTheMasks) {
  const Tensor x = ones({64}, kF64);
  nn::Dropout original(0.4, 1234);
  original.forward(x);  // advance past the start
  const std::vector<uint8_t> bytes = serialize_safetensors(original.state_dict());
  const std::vector<double> next = values_of(original.forward(x));
  const std::vector<double> after = values_of(original.forward(x));

  nn::Dropout resumed(0.4, 999);
  EXPECT_EQ(keys_of(resumed.named_buffers()), std::vector<std::string>{"generator_state"});
  EXPECT_TRUE(resumed.load_state_dict(parse_safetensors(bytes).tensors).ok());
  EXPECT_EQ(values_of(resumed.forward(x)), next);
  EXPECT_EQ(values_of(resumed.forward(x)), after);
  EXPECT_EQ(resumed.generator_state(), original.generator_state());
}

// Rewinding the live generator (what rd::checkpoint does before its replay) repeats the
// mask, and the buffer then holds the state after the repeat.
TEST(DropoutTest, RewindingTheLiveGeneratorRepeatsTheMask) {
  const Tensor x = ones({128}, kF64);
  nn::Dropout drop(0.5, 31);
  const Generator::State before = drop.generator().state();
  const std::vector<double> mask = values_of(drop.forward(x));
  const Generator::State after = drop.generator_state();
  drop.generator().set_state(before);
  EXPECT_EQ(values_of(drop.forward(x)), mask);
  EXPECT_EQ(nn::read_generator_state(drop.state_dict().at("generator_state")), after);
}

// --- containers ---

TEST(SequentialTest, ComposesInOrderNamesChildrenByIndexAndChecksTypes) {
  Generator gen(12);
  nn::Sequential seq;
  auto first = seq.push_back(std::make_shared<nn::Linear>(3, 5, true, gen, kF64));
  seq.push_back(std::make_shared<nn::RMSNorm>(5, 1e-6, true, kF64));
  auto last = seq.push_back(std::make_shared<nn::Linear>(5, 2, false, gen, kF64));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(keys_of(seq.named_parameters()),
            (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "2.weight"}));
  std::mt19937_64 rng(13);
  randomize_parameters(seq, rng);
  const Tensor x = random_nonzero_tensor({4, 3}, DType::kFloat64, rng);
  const Tensor want = last->forward(seq.at<nn::RMSNorm>(1).forward(first->forward(x)));
  EXPECT_TRUE(allclose(seq.forward(x), want, 0.0, 0.0));
  EXPECT_TRUE(module_gradcheck(seq, x, rng));
  EXPECT_EQ(&seq.at<nn::Linear>(2), last.get());
  EXPECT_EQ(&seq[0], first.get());
  EXPECT_TRUE(raises([&] { seq.at<nn::LayerNorm>(1); }, {ErrorCode::kInvalidArgument},
                     {"Sequential", "module 1"}));
  EXPECT_TRUE(raises([&] { seq[3]; }, {ErrorCode::kOutOfRange}, {"Sequential", "index 3"}));
  EXPECT_TRUE(nn::Sequential().forward(x).is_same(x));
  EXPECT_THROW(seq.push_back(std::shared_ptr<nn::Linear>()), Error);
}

TEST(ModuleListTest, IndexesIteratesAndNamesByPosition) {
  Generator gen(14);
  nn::ModuleList list;
  list.push_back(std::make_shared<nn::Linear>(2, 2, false, gen));
  list.push_back(std::make_shared<nn::LayerNorm>(2));
  EXPECT_EQ(list.size(), 2u);
  EXPECT_EQ(keys_of(list.named_parameters()),
            (std::vector<std::string>{"0.weight", "1.weight", "1.bias"}));
  EXPECT_EQ(list.at<nn::LayerNorm>(1).dim(), 2);
  size_t visited = 0;
  for (const std::shared_ptr<nn::Module>& m : list) visited += m->parameters().size();
  EXPECT_EQ(visited, 3u);
  EXPECT_TRUE(raises([&] { list.at<nn::Linear>(1); }, {ErrorCode::kInvalidArgument},
                     {"ModuleList", "module 1"}));
  EXPECT_TRUE(raises([&] { list[2]; }, {ErrorCode::kOutOfRange}, {"ModuleList", "index 2"}));
}

// --- a whole model's state dict ---

// A small language-model-like stack built from every layer kind.
class TinyModel : public nn::Module {
 public:
  TinyModel(uint64_t seed, TensorOptions options) {
    Generator gen(seed);
    embed = register_module("embed", std::make_shared<nn::Embedding>(11, 8, gen, options));
    blocks = register_module("blocks", std::make_shared<nn::Sequential>());
    blocks->push_back(std::make_shared<nn::LayerNorm>(8, 1e-5, true, true, options));
    blocks->push_back(
        std::make_shared<nn::MLP>(8, 16, nn::MLPActivation::kSwiGLU, true, gen, options));
    blocks->push_back(std::make_shared<nn::Dropout>(0.25, gen));
    blocks->push_back(std::make_shared<nn::RMSNorm>(8, 1e-6, true, options));
    head = register_module("head", std::make_shared<nn::Linear>(8, 11, false, gen, options));
  }
  Tensor forward(const Tensor& tokens) {
    return head->forward(blocks->forward(embed->forward(tokens)));
  }
  std::shared_ptr<nn::Embedding> embed;
  std::shared_ptr<nn::Sequential> blocks;
  std::shared_ptr<nn::Linear> head;
};

TEST(StateDictTest, AModelSavedToSafetensorsReloadsIntoAnotherSeedAndComputesTheSame) {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() /
                        ("rd_nn_layers_" + std::to_string(::getpid()) + ".safetensors");
  const Tensor tokens = from_vector<int64_t>({1, 5, 10, 0, 3, 3}, {2, 3});
  TinyModel original(1, kF64);
  std::mt19937_64 rng(51);
  randomize_parameters(original, rng);  // norms away from their ones/zeros start
  original.forward(tokens);             // dropout's stream moves on from its seed
  save_safetensors(path.string(), original.state_dict());

  TinyModel restored(2, kF64);
  EXPECT_FALSE(allclose(restored.forward(tokens), original.forward(tokens)))
      << "another seed must give another model";
  // The forward above advanced `original`'s dropout past the save; reload it too.
  const SafetensorsFile file = load_safetensors(path.string());
  fs::remove(path);
  EXPECT_TRUE(original.load_state_dict(file.tensors).ok());
  const nn::LoadStateDictResult report = restored.load_state_dict(file.tensors);
  EXPECT_TRUE(report.ok());
  EXPECT_EQ(file.tensors.size(), original.named_parameters().size() + 1u);  // + dropout state
  EXPECT_TRUE(allclose(restored.forward(tokens), original.forward(tokens), 0.0, 0.0))
      << "training mode: the same dropout masks";
  original.eval();
  restored.eval();
  EXPECT_TRUE(allclose(restored.forward(tokens), original.forward(tokens), 0.0, 0.0));
}

}  // namespace
}  // namespace rd::test
