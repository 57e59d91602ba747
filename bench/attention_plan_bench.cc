// Host cost of planning one dilated-attention call, paid on every call before any kernel
// runs: the rank plan (nn/rank_plan.h) for the multi-GPU bench's configuration (pairs
// (2048,1), (16384,4), (262144,16), (N,64), H = 16, bf16), one device and P ranks, causal
// contiguous or zigzag, and non-causal; head groups, the last rank (the busiest under a
// causal contiguous split). The counter attention_calls is that rank's forward calls (the
// backward reruns each): each pays a kernel launch and its host set-up. Compare both with
// the call's GPU time (docs/benchmarks.md). With packed documents (BM_RankPlanDocuments) a
// plan has a call per piece and costs milliseconds; BM_RankPlanCacheHit is what a model's
// other blocks pay for the same plan (nn/rank_plan_cache.h).
//   build/release/bench/attention_plan_bench
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/nn/piece_calls.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/nn/rank_plan_cache.h"

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

// The call rd_train plans in its context-parallel run on text with a document per paragraph
// (tools/gpu_issue19.sh docs): B = 2, all heads, causal zigzag, the second of P ranks,
// documents of random lengths (uniform, mean `mean` tokens).
struct DocumentsCall {
  static constexpr int64_t kBatch = 2;
  rd::nn::DilatedAttentionOptions options;
  rd::nn::RankLayout layout;
  std::vector<std::vector<int64_t>> documents;

  // range(0): log2 N; range(1): P; range(2): mean document length.
  explicit DocumentsCall(const benchmark::State& state)
      : options(::options(int64_t{1} << state.range(0), true)),
        layout{kBatch,
               (int64_t{1} << state.range(0)) / state.range(1),
               kHeads,
               kDim,
               static_cast<int>(state.range(1)) - 1,
               static_cast<int>(state.range(1)),
               true},
        documents(kBatch) {
    options.mixing = rd::nn::HeadMixing::kAllHeads;
    const int64_t seq_len = layout.seq_len(), mean = state.range(2);
    std::mt19937_64 lengths(7);
    for (std::vector<int64_t>& starts : documents) {
      for (int64_t at = 0; at < seq_len; at += 1 + static_cast<int64_t>(lengths() % (2 * mean))) {
        starts.push_back(at);
      }
    }
  }
  rd::nn::RankPlan plan() const {
    return rd::nn::make_rank_plan(options, layout, rd::nn::DistStrategy::kAuto, kBf16Bytes,
                                  &documents);
  }
  std::string key() const {
    return rd::nn::rank_plan_key(options, layout, rd::nn::DistStrategy::kAuto, kBf16Bytes,
                                 &documents);
  }
};

// The plan of a DocumentsCall: a call per document piece.
void BM_RankPlanDocuments(benchmark::State& state) {
  const DocumentsCall call(state);
  int64_t calls = 0;
  for (auto _ : state) {
    const rd::nn::RankPlan plan = call.plan();
    calls = static_cast<int64_t>(plan.local_calls.size());
    for (const auto& per_source : plan.calls) calls += static_cast<int64_t>(per_source.size());
    benchmark::DoNotOptimize(calls);
  }
  state.counters["attention_calls"] = static_cast<double>(calls);
  state.counters["documents"] = static_cast<double>(call.documents[0].size());
}

// The same call found in a RankPlanCache (what every block after the first, and every
// recomputed forward, pays instead): building its key and the lookup.
void BM_RankPlanCacheHit(benchmark::State& state) {
  const DocumentsCall call(state);
  rd::nn::RankPlanCache cache;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cache.get(call.key(), [&] { return call.plan(); }));
  }
}

// Grouping the plan's local calls into calls over pieces (nn/piece_calls.h), which the fixed
// variant's forward and backward each do on every call.
void BM_GroupPieceCalls(benchmark::State& state) {
  const rd::nn::RankPlan plan = DocumentsCall(state).plan();
  int64_t groups = 0;
  for (auto _ : state) {
    const rd::nn::PieceGroups g =
        rd::nn::group_piece_calls(plan.local_calls, [](const rd::nn::LocalCall&) { return true; });
    groups = static_cast<int64_t>(g.groups.size());
    benchmark::DoNotOptimize(groups);
  }
  state.counters["local_calls"] = static_cast<double>(plan.local_calls.size());
  state.counters["groups"] = static_cast<double>(groups);
}

BENCHMARK(BM_GroupPieceCalls)
    ->ArgNames({"log2N", "P", "mean_len"})
    ->Args({18, 2, 400})
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_RankPlanCacheHit)
    ->ArgNames({"log2N", "P", "mean_len"})
    ->Args({18, 2, 400})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_RankPlanDocuments)
    ->ArgNames({"log2N", "P", "mean_len"})
    ->Args({16, 2, 400})
    ->Args({18, 2, 400})
    ->Args({18, 2, 4096})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
