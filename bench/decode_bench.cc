// Decoding with a KV cache against recomputing the prefix (issue 21): the time of one
// decoding step of dilated attention (nn::dilated_attention_decode_step) as the prefix grows,
// and, as the baseline measured in the same run, the causal forward over the whole prefix
// that a decoder without a cache runs for every new token. Pattern (2048,1), (16384,4),
// (262144,16), head groups, H = 12, D = 64, B = 1, float32 on the CPU (bf16 on a GPU).
//   step/<device>/L<prefix>       one step, averaged over the 256 positions after `prefix`
//                                 (where the pattern selects a position varies: a position
//                                 some pair skips costs less)
//   recompute/<device>/L<prefix>  the forward over prefix + 1 positions (up to 16K on the CPU)
//   build/release/bench/decode_bench
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_decode.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"

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
  for (auto _ : state) {
    for (int64_t t = 0; t < kStepsPerIteration; ++t) {
      const rd::Tensor row = kv.narrow(1, prefix + t, 1);
      cache.append(row, row);
      const rd::Tensor out = rd::nn::dilated_attention_decode_step(q, cache, pattern()).out;
      benchmark::DoNotOptimize(out.raw_data());
    }
    rd::synchronize(device);
    cache.truncate(prefix);
  }
  // Per step (the benchmark's time is per 256).
  state.counters["us_per_step"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kStepsPerIteration),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_Recompute(benchmark::State& state) {
  const int64_t prefix = state.range(0);
  const rd::Device device = bench_device();
  const rd::TensorOptions options = bench_options(device);
  rd::Generator gen(2);
  const rd::Tensor qkv = rd::randn({1, prefix + 1, kHeads, kDim}, gen).to(options.dtype).to(device);
  for (auto _ : state) {
    const rd::Tensor out = rd::nn::dilated_attention(qkv, qkv, qkv, pattern());
    rd::synchronize(device);
    benchmark::DoNotOptimize(out.raw_data());
  }
}

std::string device_name() { return bench_device().is_cpu() ? "cpu" : "cuda"; }

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
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
