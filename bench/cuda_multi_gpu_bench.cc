// Sequence-parallel dilated attention on P real GPUs (NCCL; one process driving every GPU
// from threads, rank r on GPU r), bf16, H = 16, D = 128, pairs (2048, 1), (16384, 4),
// (262144, 16), (N, 64) (segments capped at N). Against P = 1 (the single-device call):
//   mgpu/<dir>/<strategy>/P<p>/N<n>  ring vs all-gather vs auto, forward and forward+backward
//   strong/P<p>/N<n>                 auto fwd+bwd; efficiency = T(P0) * P0 / (T(P) * P), P0
//                                    the fewest GPUs that hold N (1 unless it runs out of
//                                    memory); per-rank peak memory against P0's
//   strong_causal/<layout>/P<p>/N<n> the same, causal, each sequence layout (contiguous,
//                                    zigzag); work_imbalance: the plan's largest over mean
//                                    attended pairs per rank
//   weak/P<p>                        auto fwd+bwd at N = P x 1M; efficiency = T(1, 1M) / T(P);
//                                    work_efficiency the same per attended pair (a pair over
//                                    the whole sequence makes a rank's work grow with N)
//   dense/P<p>/N<n>                  one dense pair (N, 1), ring: the workload PyTorch's
//                                    context parallelism runs (tools/torch_cp_bench.py)
// Counters: seconds per call (the slowest rank), tokens/s, peak_bytes (the largest rank's
// allocator peak), bytes_sent by rank 0 per forward and min_bytes, the fewest any schedule
// must send (docs/distributed.md). Rows that need more GPUs than are visible are skipped.
//
//   cuda_multi_gpu_bench --benchmark_filter=strong
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <iostream>
#include <string>

#if defined(RD_WITH_CUDA)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "ringdilated/dist/nccl.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "cuda_bench_util.h"
#include "ring_traffic.h"
#endif
#include "cuda_bench_context.h"

namespace {

#if defined(RD_WITH_CUDA)

using rd::Tensor;
using rd::nn::DistStrategy;
using rd::nn::SequenceLayout;

constexpr int64_t kHeads = 16, kDim = 128;
constexpr int64_t kMillion = 1048576;
constexpr int kTimedCalls = 3;

enum class Direction { kForward, kForwardBackward };
const char* direction_name(Direction d) { return d == Direction::kForward ? "fwd" : "fwdbwd"; }

// The pairs, the last one over the whole sequence; or one dense pair.
rd::nn::DilatedAttentionOptions dilated_options(int64_t seq_len, bool causal = false) {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = {2048, 16384, std::min<int64_t>(262144, seq_len), seq_len};
  o.dilation_rates = {1, 4, 16, 64};
  o.causal = causal;
  return o;
}

rd::nn::DilatedAttentionOptions dense_options(int64_t seq_len) {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = {seq_len};
  o.dilation_rates = {1};
  return o;
}

// One rank's measurement.
struct RankTiming {
  double seconds = 0;
  int64_t peak_bytes = 0, bytes_sent = 0;
};

// The whole job's: the slowest rank's time, the largest peak, rank 0's traffic.
struct Timing {
  double seconds = 0;
  int64_t peak_bytes = 0, bytes_sent = 0;
  bool out_of_memory = false;
};

// The NCCL group of the first P GPUs, made once per P (init costs about a second).
std::vector<std::shared_ptr<rd::dist::Communicator>>& nccl_group(int P) {
  static auto* groups = new std::map<int, std::vector<std::shared_ptr<rd::dist::Communicator>>>();
  auto& comms = (*groups)[P];
  if (comms.empty()) {
    std::vector<rd::Device> devices;
    for (int r = 0; r < P; ++r) devices.push_back(rd::Device::cuda(r));
    rd::dist::NcclOptions options;
    options.timeout = std::chrono::seconds(60);
    // The transfers overlap compute as in a job of one process per GPU; main() loads every
    // kernel at start, which that needs (NcclOptions::thread_ranks_overlap).
    options.thread_ranks_overlap = std::getenv("RD_NCCL_THREAD_SYNC") == nullptr;
    comms = rd::dist::make_nccl_group(devices, options);
  }
  return comms;
}

// A rank that failed (out of memory) leaves its peers waiting for it on their GPUs: abort
// the whole group (its NCCL work ends, their waits return) and forget it.
void abort_group(int P, const std::string& why) {
  for (const auto& comm : nccl_group(P)) comm->abort(why);
  nccl_group(P).clear();
}

// Rank r's block of the sequence (N / P tokens), drawn on its GPU; then one warm-up and
// kTimedCalls timed calls (and backward), ranks lined up by barriers around the timed region.
RankTiming time_rank(int64_t seq_len, int P, int r, rd::dist::Communicator* comm,
                     const rd::nn::DilatedAttentionOptions& o, Direction direction,
                     DistStrategy strategy, SequenceLayout layout) {
  const rd::Device gpu = rd::Device::cuda(r);
  const int64_t chunk = seq_len / P;
  rd::Generator gen(100 + static_cast<uint64_t>(r));
  const rd::TensorOptions opts = rd::TensorOptions(rd::DType::kBFloat16).with_device(gpu);
  const rd::Shape shape{1, chunk, kHeads, kDim};
  Tensor q = rd::randn(shape, gen, opts), k = rd::randn(shape, gen, opts),
         v = rd::randn(shape, gen, opts);
  const Tensor grad_out = rd::randn(shape, gen, opts);
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(direction == Direction::kForwardBackward);
  RankTiming timing;
  auto once = [&] {
    Tensor out;
    if (comm == nullptr) {
      out = rd::nn::dilated_attention(q, k, v, o);
    } else {
      const rd::nn::RingAttentionResult result =
          rd::nn::ring_dilated_attention_with_lse(q, k, v, o, *comm, strategy, {}, layout);
      out = result.attention.out;
      timing.bytes_sent = result.forward_bytes_sent;
    }
    if (direction == Direction::kForwardBackward) {
      rd::autograd::backward({out}, {grad_out});
      for (Tensor* t : {&q, &k, &v}) t->zero_grad();
    }
  };
  auto line_up = [&] {
    rd::synchronize(gpu);
    if (comm != nullptr) comm->barrier();
  };
  rd::Allocator& pool = rd::allocator_for(gpu);
  once();
  line_up();
  pool.reset_peak_stats();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kTimedCalls; ++i) once();
  line_up();
  timing.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kTimedCalls;
  timing.peak_bytes = static_cast<int64_t>(pool.stats().peak_allocated_bytes);
  return timing;
}

// P = 1: the single-device call, no communicator; else every rank on its own thread.
// Out of memory on any rank marks the measurement (an NCCL group whose rank failed is not
// reused: the failing rank's peers would wait for it, so P > 1 rows are sized to fit).
Timing measure(int64_t seq_len, int P, const rd::nn::DilatedAttentionOptions& o,
               Direction direction, DistStrategy strategy, SequenceLayout layout) {
  std::vector<RankTiming> ranks(static_cast<size_t>(P));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(P));
  auto run = [&](int r) {
    try {
      rd::dist::Communicator* comm = P == 1 ? nullptr : nccl_group(P)[static_cast<size_t>(r)].get();
      ranks[static_cast<size_t>(r)] =
          time_rank(seq_len, P, r, comm, o, direction, strategy, layout);
    } catch (...) {
      errors[static_cast<size_t>(r)] = std::current_exception();
      if (P > 1) abort_group(P, rd::str_cat("rank ", r, " failed"));
    }
    rd::allocator_for(rd::Device::cuda(r)).empty_cache();
  };
  if (P == 1) {
    run(0);
  } else {
    nccl_group(P);  // made on this thread: ncclCommInitAll drives every GPU at once
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) threads.emplace_back(run, r);
    for (std::thread& t : threads) t.join();
  }
  Timing timing;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const rd::Error& error) {
      if (error.code() != rd::ErrorCode::kOutOfMemory) throw;
      timing.out_of_memory = true;
    }
  }
  if (timing.out_of_memory) return timing;
  for (const RankTiming& r : ranks) {
    timing.seconds = std::max(timing.seconds, r.seconds);
    timing.peak_bytes = std::max(timing.peak_bytes, r.peak_bytes);
  }
  timing.bytes_sent = ranks.front().bytes_sent;
  return timing;
}

// Largest over mean of the plan's attended pairs per rank (nn::attended_pairs_per_rank).
double work_imbalance(const rd::nn::DilatedAttentionOptions& o, int64_t seq_len, int P,
                      SequenceLayout layout) {
  double total = 0, largest = 0;
  for (int64_t w : rd::nn::attended_pairs_per_rank(o, seq_len, kHeads, P, layout)) {
    total += static_cast<double>(w);
    largest = std::max(largest, static_cast<double>(w));
  }
  return largest / (total / P);
}

// Measurements are made once per configuration and shared by the rows that compare them.
struct Key {
  int64_t seq_len;
  int P;
  bool dense;
  Direction direction;
  DistStrategy strategy;
  bool causal = false;
  SequenceLayout layout = SequenceLayout::kAuto;
  auto operator<=>(const Key&) const = default;
};

const Timing& measured(const Key& key) {
  static auto* cache = new std::map<Key, Timing>();
  auto it = cache->find(key);
  if (it == cache->end()) {
    const rd::nn::DilatedAttentionOptions o =
        key.dense ? dense_options(key.seq_len) : dilated_options(key.seq_len, key.causal);
    it = cache->emplace(key, measure(key.seq_len, key.P, o, key.direction, key.strategy, key.layout))
             .first;
  }
  return it->second;
}

bool enough_gpus(benchmark::State& state, int P) {
  const int visible = rd::cuda_device_count();
  if (visible >= P) return true;
  state.SkipWithError(rd::str_cat("needs ", P, " GPUs, ", visible, " visible").c_str());
  return false;
}

// Reports `t` on the row; false (row skipped) when it ran out of memory.
bool report(benchmark::State& state, const Timing& t, int64_t seq_len) {
  if (t.out_of_memory) {
    state.SkipWithError("out of memory");
    return false;
  }
  for (auto _ : state) state.SetIterationTime(t.seconds);
  state.counters["seconds"] = t.seconds;
  state.counters["tokens_per_s"] = static_cast<double>(seq_len) / t.seconds;
  state.counters["peak_bytes"] = static_cast<double>(t.peak_bytes);
  state.counters["bytes_sent"] = static_cast<double>(t.bytes_sent);
  return true;
}

void strategy_row(benchmark::State& state, int64_t seq_len, int P, Direction d, DistStrategy s) {
  if (!enough_gpus(state, P)) return;
  const Timing& t = measured({seq_len, P, false, d, s});
  if (!report(state, t, seq_len)) return;
  const Timing& single = measured({seq_len, 1, false, d, DistStrategy::kAuto});
  if (!single.out_of_memory) state.counters["speedup_vs_1gpu"] = single.seconds / t.seconds;
  state.counters["min_bytes"] =
      static_cast<double>(rd::bench::minimum_bytes_per_rank(dilated_options(seq_len), seq_len, P,
                                                            kHeads, kDim, /*bf16*/ 2));
}

// Forward+backward of the dilated pairs, auto strategy.
Key fwdbwd_key(int64_t seq_len, int P, bool causal, SequenceLayout layout) {
  return {seq_len, P, false, Direction::kForwardBackward, DistStrategy::kAuto, causal, layout};
}

// The fewest GPUs (1, 2, 4) on which N runs forward+backward: the strong-scaling baseline
// (one GPU: no layout).
std::optional<int> baseline_gpus(int64_t seq_len, bool causal, SequenceLayout layout) {
  for (int P : {1, 2, 4}) {
    if (P > rd::cuda_device_count()) break;
    const SequenceLayout l = P == 1 ? SequenceLayout::kAuto : layout;
    if (!measured(fwdbwd_key(seq_len, P, causal, l)).out_of_memory) return P;
  }
  return std::nullopt;
}

// Strong scaling of one call at N: time on P GPUs against the baseline's, per GPU. Causal
// rows run each layout (kAuto: zigzag), so the balance shows against the same-run contiguous.
void strong_row(benchmark::State& state, int64_t seq_len, int P, bool causal = false,
                SequenceLayout layout = SequenceLayout::kAuto) {
  if (!enough_gpus(state, P)) return;
  const Timing& t = measured(fwdbwd_key(seq_len, P, causal, P == 1 ? SequenceLayout::kAuto : layout));
  if (!report(state, t, seq_len)) return;
  const std::optional<int> P0 = baseline_gpus(seq_len, causal, layout);
  if (!P0) return;
  const Timing& base =
      measured(fwdbwd_key(seq_len, *P0, causal, *P0 == 1 ? SequenceLayout::kAuto : layout));
  if (causal && P > 1) {
    state.counters["work_imbalance"] = work_imbalance(dilated_options(seq_len, true), seq_len, P,
                                                      layout);
  }
  state.counters["baseline_gpus"] = *P0;
  state.counters["efficiency"] = base.seconds * *P0 / (t.seconds * P);
  state.counters["peak_over_baseline"] =
      static_cast<double>(t.peak_bytes) / static_cast<double>(base.peak_bytes);
}

void weak_row(benchmark::State& state, int P) {
  if (!enough_gpus(state, P)) return;
  const int64_t seq_len = P * kMillion;
  const Timing& t = measured({seq_len, P, false, Direction::kForwardBackward, DistStrategy::kAuto});
  if (!report(state, t, seq_len)) return;
  const Timing& one =
      measured({kMillion, 1, false, Direction::kForwardBackward, DistStrategy::kAuto});
  if (one.out_of_memory) return;
  state.counters["efficiency"] = one.seconds / t.seconds;
  // Pairs per second per GPU against one GPU's at 1M.
  auto total_pairs = [](int64_t n, int ranks) {
    double total = 0;
    for (int64_t w : rd::nn::attended_pairs_per_rank(dilated_options(n), n, kHeads, ranks,
                                                     SequenceLayout::kContiguous)) {
      total += static_cast<double>(w);
    }
    return total;
  };
  const double rate_p = total_pairs(seq_len, P) / P / t.seconds;
  const double rate_1 = total_pairs(kMillion, 1) / one.seconds;
  state.counters["work_efficiency"] = rate_p / rate_1;
}

void dense_row(benchmark::State& state, int64_t seq_len, int P, Direction d) {
  if (!enough_gpus(state, P)) return;
  const Timing& t = measured({seq_len, P, true, d, DistStrategy::kRing});
  if (!report(state, t, seq_len)) return;
  // Non-causal attention FLOPs per GPU: 4 N^2 H D forward, 2.5x that backward.
  const double forward = 4.0 * static_cast<double>(seq_len) * static_cast<double>(seq_len) *
                         kHeads * kDim;
  const double flops = d == Direction::kForward ? forward : 3.5 * forward;
  state.counters["tflops_per_gpu"] = flops / P / t.seconds * 1e-12;
}

template <class F>
void add(const std::string& name, F fn) {
  benchmark::RegisterBenchmark(name.c_str(), fn)->UseManualTime()->Iterations(1)->Unit(
      benchmark::kMillisecond);
}

void add_rows() {
  for (Direction d : {Direction::kForward, Direction::kForwardBackward}) {
    for (int P : {1, 2, 4}) {
      const std::vector<DistStrategy> strategies =
          P == 1 ? std::vector<DistStrategy>{DistStrategy::kAuto}
                 : std::vector<DistStrategy>{DistStrategy::kRing, DistStrategy::kAllGather,
                                             DistStrategy::kAuto};
      for (DistStrategy s : strategies) {
        add(rd::str_cat("mgpu/", direction_name(d), "/", P == 1 ? "single" : rd::nn::strategy_name(s),
                        "/P", P, "/N", kMillion),
            [=](benchmark::State& state) { strategy_row(state, kMillion, P, d, s); });
      }
    }
  }
  for (int64_t seq_len : {kMillion, 4 * kMillion}) {
    for (int P : {1, 2, 4}) {
      add(rd::str_cat("strong/P", P, "/N", seq_len),
          [=](benchmark::State& state) { strong_row(state, seq_len, P); });
    }
    for (SequenceLayout layout : {SequenceLayout::kContiguous, SequenceLayout::kZigzag}) {
      for (int P : {1, 2, 4}) {
        add(rd::str_cat("strong_causal/", rd::nn::layout_name(layout), "/P", P, "/N", seq_len),
            [=](benchmark::State& state) { strong_row(state, seq_len, P, true, layout); });
      }
    }
  }
  for (int P : {1, 2, 4}) {
    add(rd::str_cat("weak/P", P, "/N", P * kMillion),
        [=](benchmark::State& state) { weak_row(state, P); });
  }
  for (int64_t seq_len : {int64_t{131072}, int64_t{262144}}) {
    for (Direction d : {Direction::kForward, Direction::kForwardBackward}) {
      for (int P : {1, 2, 4}) {
        add(rd::str_cat("dense/", direction_name(d), "/P", P, "/N", seq_len),
            [=](benchmark::State& state) { dense_row(state, seq_len, P, d); });
      }
    }
  }
}

#endif  // RD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  // Before CUDA starts: every kernel loaded up front, so that no rank's thread loads one
  // (and waits for its GPU) while its NCCL transfer waits for a peer (see above).
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  const std::string command = rd::bench::command_line(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
#if defined(RD_WITH_CUDA)
  rd::bench::add_cuda_context(command, 0);
  add_rows();
#else
  std::cerr << "cuda_multi_gpu_bench: this build has no CUDA backend; no benchmark is "
               "registered\n";
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
