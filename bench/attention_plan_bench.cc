// Host cost of planning one dilated-attention call, paid on every call before any kernel
// runs: the rank plan (nn/rank_plan.h) for the multi-GPU bench's configuration (pairs
// (2048,1), (16384,4), (262144,16), (N,64), H = 16, bf16), one device and P ranks, causal
// contiguous or zigzag, and non-causal; head groups, the last rank (the busiest under a
// causal contiguous split). The counter attention_calls is that rank's forward calls (the
// backward reruns each): each pays a kernel launch and its host set-up. Compare both with
// the call's GPU time (docs/benchmarks.md).
//   build/release/bench/attention_plan_bench
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>

#include "ringdilated/nn/rank_plan.h"

namespace {

constexpr int64_t kHeads = 16;
constexpr int64_t kDim = 128;
constexpr int64_t kBf16Bytes = 2;

rd::nn::DilatedAttentionOptions options(int64_t seq_len, bool causal) {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = {std::min<int64_t>(2048, seq_len), std::min<int64_t>(16384, seq_len),
                       std::min<int64_t>(262144, seq_len), seq_len};
  o.dilation_rates = {1, 4, 16, 64};
  o.causal = causal;
  return o;
}

// range(0): log2 N; range(1): P; range(2): 0 non-causal, 1 causal contiguous, 2 causal
// zigzag.
void BM_RankPlan(benchmark::State& state) {
  const int64_t seq_len = int64_t{1} << state.range(0);
  const int ranks = static_cast<int>(state.range(1));
  const bool causal = state.range(2) != 0;
  const rd::nn::RankLayout layout{1,     seq_len / ranks,    kHeads, kDim, ranks - 1,
                                  ranks, state.range(2) == 2};
  const rd::nn::DilatedAttentionOptions o = options(seq_len, causal);
  int64_t calls = 0;
  for (auto _ : state) {
    const rd::nn::RankPlan plan =
        rd::nn::make_rank_plan(o, layout, rd::nn::DistStrategy::kAuto, kBf16Bytes);
    calls = static_cast<int64_t>(plan.local_calls.size());
    for (const auto& per_source : plan.calls) calls += static_cast<int64_t>(per_source.size());
    benchmark::DoNotOptimize(calls);
  }
  state.counters["attention_calls"] = static_cast<double>(calls);
}

BENCHMARK(BM_RankPlan)
    ->ArgNames({"log2N", "P", "mask"})
    ->Args({20, 1, 1})
    ->Args({22, 1, 1})
    ->Args({22, 4, 0})
    ->Args({22, 4, 1})
    ->Args({22, 4, 2})
    ->Args({23, 8, 2})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
