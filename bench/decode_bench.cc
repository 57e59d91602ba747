// Decoding with a KV cache against recomputing the prefix (issue 21): the time of one
// decoding step of dilated attention (nn::dilated_attention_decode_step) as the prefix grows,
// and, as the baseline measured in the same run, the causal forward over the whole prefix
// that a decoder without a cache runs for every new token. Pattern (2048,1), (16384,4),
// (262144,16), head groups, H = 12, D = 64, B = 1, float32 on the CPU (bf16 on a GPU).
//   step/<device>/L<prefix>       one step, averaged over the 256 positions after `prefix`
//                                 (where the pattern selects a position varies: a position
//                                 some pair skips costs less)
//   recompute/<device>/L<prefix>  the forward over prefix + 1 positions (up to 16K on the CPU)
//   model/<device>/L<prefix>      the reference model (12 x 768) generating after a prompt of
//                                 `prefix` tokens: time per 32 new tokens, tokens_per_s
//   build/release/bench/decode_bench
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_decode.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/train/model.h"

namespace {

constexpr int64_t kHeads = 12, kDim = 64;

rd::nn::DilatedAttentionOptions pattern() {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = {2048, 16384, 262144};
  o.dilation_rates = {1, 4, 16};
  o.causal = true;
  return o;
}

rd::Device bench_device() {
  return rd::cuda_device_count() > 0 ? rd::Device::cuda(0) : rd::Device::cpu();
}

rd::TensorOptions bench_options(rd::Device device) {
  return rd::TensorOptions(device.is_cpu() ? rd::DType::kFloat32 : rd::DType::kBFloat16)
      .with_device(device);
}

constexpr int64_t kStepsPerIteration = 256;

void BM_Step(benchmark::State& state) {
  const int64_t prefix = state.range(0);
  const rd::Device device = bench_device();
  const rd::TensorOptions options = bench_options(device);
  rd::Generator gen(1);
  const int64_t rows = prefix + kStepsPerIteration;
  rd::nn::DilatedKVCache cache(1, rows, kHeads, kDim, options);
  const rd::Tensor kv = rd::randn({1, rows, kHeads, kDim}, gen).to(options.dtype).to(device);
  const rd::Tensor q = rd::randn({1, 1, kHeads, kDim}, gen).to(options.dtype).to(device);
  cache.append(kv.narrow(1, 0, prefix), kv.narrow(1, 0, prefix));
  auto steps = [&] {
    for (int64_t t = 0; t < kStepsPerIteration; ++t) {
      const rd::Tensor row = kv.narrow(1, prefix + t, 1);
      cache.append(row, row);
      const rd::Tensor out = rd::nn::dilated_attention_decode_step(q, cache, pattern()).out;
      benchmark::DoNotOptimize(out.raw_data());
    }
    rd::synchronize(device);
    cache.truncate(prefix);
  };
  steps();  // warm-up, not timed
  for (auto _ : state) steps();
  // Per step (the benchmark's time is per 256 steps).
  state.counters["seconds_per_step"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kStepsPerIteration),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_Recompute(benchmark::State& state) {
  const int64_t prefix = state.range(0);
  const rd::Device device = bench_device();
  const rd::TensorOptions options = bench_options(device);
  rd::Generator gen(2);
  const rd::Tensor qkv = rd::randn({1, prefix + 1, kHeads, kDim}, gen).to(options.dtype).to(device);
  auto recompute = [&] {
    const rd::Tensor out = rd::nn::dilated_attention(qkv, qkv, qkv, pattern());
    rd::synchronize(device);
    benchmark::DoNotOptimize(out.raw_data());
  };
  recompute();  // warm-up, not timed (the first call of a shape builds its cuDNN graphs)
  for (auto _ : state) recompute();
}

std::string device_name() { return bench_device().is_cpu() ? "cpu" : "cuda"; }

// The reference model of issue 21's decoding targets: 12 blocks of width 768, 12 heads, the
// pairs (2048,1), (4096,2), (8192,4), (16384,8); bf16 on a GPU, float32 on the CPU.
std::unique_ptr<rd::train::LanguageModel> reference_model(rd::Device device) {
  rd::train::ModelConfig c;
  c.vocab_size = 256;
  c.dim = 768;
  c.depth = 12;
  c.heads = 12;
  c.attention.segment_lengths = {2048, 4096, 8192, 16384};
  c.attention.dilation_rates = {1, 2, 4, 8};
  rd::Generator gen(3);
  auto model = std::make_unique<rd::train::LanguageModel>(
      c, gen, rd::TensorOptions(rd::DType::kFloat32).with_device(device));
  model->to(bench_options(device).dtype);
  model->eval();
  return model;
}

constexpr int64_t kModelTokensPerIteration = 32;

// The reference model generating greedily after a prompt of `prefix` tokens (the prefill,
// one forward that fills the caches, is not timed): time per new token. Targets (issue 21,
// one H100): L1048576 within 1.25x of L4096, and at least 200 tokens/s.
void BM_Model(benchmark::State& state) {
  const int64_t prefix = state.range(0);
  const rd::Device device = bench_device();
  rd::autograd::NoGradGuard no_grad;
  const std::unique_ptr<rd::train::LanguageModel> model = reference_model(device);
  std::mt19937_64 rng(4);
  std::vector<int64_t> tokens(static_cast<size_t>(prefix));
  for (int64_t& token : tokens) token = static_cast<int64_t>(rng() % 256);
  const rd::Tensor prompt = rd::from_vector<int64_t>(tokens, {1, prefix}).to(device);
  rd::train::LanguageModel::DecodeState decoding =
      model->start_decoding(1, prefix + kModelTokensPerIteration);
  const rd::Tensor first =
      rd::argmax(model->forward_cached(prompt, decoding).narrow(1, prefix - 1, 1), 2);
  auto generate = [&] {
    rd::Tensor next = first;
    for (int64_t t = 0; t < kModelTokensPerIteration; ++t) {
      next = rd::argmax(model->forward_cached(next, decoding), 2);
    }
    rd::synchronize(device);
    for (rd::nn::DilatedKVCache& cache : decoding.caches) cache.truncate(prefix);
  };
  generate();  // warm-up: the first steps load kernels and GEMM plans for their shapes
  for (auto _ : state) generate();
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kModelTokensPerIteration),
                         benchmark::Counter::kIsRate);
}

const bool kRegistered = [] {
  for (int64_t prefix : {1024, 4096, 16384, 65536, 262144}) {
    benchmark::RegisterBenchmark(("step/" + device_name() + "/L" + std::to_string(prefix)).c_str(),
                                 BM_Step)
        ->Arg(prefix)
        ->Unit(benchmark::kMicrosecond);
    if (prefix <= 16384 || !bench_device().is_cpu()) {
      benchmark::RegisterBenchmark(
          ("recompute/" + device_name() + "/L" + std::to_string(prefix)).c_str(), BM_Recompute)
          ->Arg(prefix)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  const std::vector<int64_t> model_prefixes =
      bench_device().is_cpu() ? std::vector<int64_t>{1024}
                              : std::vector<int64_t>{4096, 65536, 262144, 1048576};
  for (int64_t prefix : model_prefixes) {
    benchmark::RegisterBenchmark(("model/" + device_name() + "/L" + std::to_string(prefix)).c_str(),
                                 BM_Model)
        ->Arg(prefix)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
