// Sequence-parallel dilated attention with P ranks sharing one GPU (in-process ranks):
// ring vs all-gather vs auto against the single-device call on the same inputs, forward and
// forward+backward, bf16, H = 16, D = 128, pairs (2048, 1), (16384, 4), (262144, 16),
// (1048576, 64); plus the bytes each rank sends against the minimum the pattern requires
// (docs/distributed.md) and the two targets of issue 10.
//
// Also: the longest N one RingMultiheadDilatedAttention(768, 12) layer runs forward and
// backward at P = 1 (rows ring_mhda/..., bf16, pairs (2048, 1), (4096, 2), (8192, 4), as the
// single-device MHA rows of cuda_dilated_attention_bench); a row that runs out of memory says so.
//
//   cuda_ring_attention_bench --benchmark_filter=target   # the targets only
//   cuda_ring_attention_bench --benchmark_filter=ring_mhda  # the longest-N rows
#include <benchmark/benchmark.h>

#include <iostream>
#include <string>

#if defined(RD_WITH_CUDA)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/nn/ring_dilated_attention_modules.h"
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

constexpr int kDevice = 0;
constexpr int kRanks = 4;
constexpr int64_t kHeads = 16, kDim = 128;
constexpr int64_t kTargetSeqLen = 1048576;
constexpr int kTimedCalls = 3;
constexpr double kOverheadTarget = 1.10, kTrafficTarget = 1.10;

rd::Device gpu() { return rd::Device::cuda(kDevice); }

rd::nn::DilatedAttentionOptions bench_options() {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = {2048, 16384, 262144, 1048576};
  o.dilation_rates = {1, 4, 16, 64};
  return o;
}

enum class Direction { kForward, kForwardBackward };

const char* direction_name(Direction d) { return d == Direction::kForward ? "fwd" : "fwdbwd"; }

// The whole sequence's inputs and the gradient arriving at the output, bf16 on the GPU.
struct Inputs {
  Tensor q, k, v, grad_out;
};

Inputs make_inputs(int64_t seq_len) {
  rd::Generator gen(42);
  const rd::TensorOptions opts = rd::TensorOptions(rd::DType::kBFloat16).with_device(gpu());
  const rd::Shape shape{1, seq_len, kHeads, kDim};
  return {rd::randn(shape, gen, opts), rd::randn(shape, gen, opts), rd::randn(shape, gen, opts),
          rd::randn(shape, gen, opts)};
}

// One call (and its backward) on q, k, v: leaves sharing the inputs' storage.
using Call = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v)>;

// Seconds per call on this thread: one warm-up, then kTimedCalls, host clock around
// synchronized work (ranks share the GPU, so their calls run on one device either way).
double time_calls(const Call& call, const Inputs& in, Direction direction,
                  const std::function<void()>& sync_ranks) {
  Tensor q = in.q.detach(), k = in.k.detach(), v = in.v.detach();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(direction == Direction::kForwardBackward);
  auto once = [&] {
    const Tensor out = call(q, k, v);
    if (direction == Direction::kForwardBackward) {
      rd::autograd::backward({out}, {in.grad_out});
      for (Tensor* t : {&q, &k, &v}) t->zero_grad();
    }
  };
  once();
  rd::synchronize(gpu());
  sync_ranks();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kTimedCalls; ++i) once();
  rd::synchronize(gpu());
  sync_ranks();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
         kTimedCalls;
}

// The single-device call on the whole sequence, measured once per (N, direction) and reused
// by every row of the run.
double single_seconds(int64_t seq_len, Direction direction) {
  static std::map<std::pair<int64_t, Direction>, double>* const cache =
      new std::map<std::pair<int64_t, Direction>, double>();
  auto it = cache->find({seq_len, direction});
  if (it != cache->end()) return it->second;
  const Inputs in = make_inputs(seq_len);
  const rd::nn::DilatedAttentionOptions o = bench_options();
  const double seconds = time_calls(
      [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        return rd::nn::dilated_attention(q, k, v, o);
      },
      in, direction, [] {});
  (*cache)[{seq_len, direction}] = seconds;
  return seconds;
}

struct RingTiming {
  double seconds = 0;
  int64_t forward_bytes_sent = 0;  // by rank 0, per call
  int ring_steps = 0, ring_pairs = 0, gathered_pairs = 0;
};

RingTiming ring_seconds(int64_t seq_len, Direction direction, DistStrategy strategy) {
  const Inputs full = make_inputs(seq_len);
  const rd::nn::DilatedAttentionOptions o = bench_options();
  const int64_t chunk = seq_len / kRanks;
  RingTiming timing;
  rd::dist::run_in_process(kRanks, [&](rd::dist::Communicator& comm) {
    const int r = comm.rank();
    auto block = [&](const Tensor& t) { return t.narrow(1, r * chunk, chunk); };
    const Inputs mine{block(full.q), block(full.k), block(full.v), block(full.grad_out)};
    rd::nn::RingAttentionResult last;
    const double seconds = time_calls(
        [&](const Tensor& q, const Tensor& k, const Tensor& v) {
          last = rd::nn::ring_dilated_attention_with_lse(q, k, v, o, comm, strategy);
          return last.attention.out;
        },
        mine, direction, [&] { comm.barrier(); });
    if (r == 0) {
      timing = {seconds, last.forward_bytes_sent, last.ring_steps, last.ring_pairs,
                last.gathered_pairs};
    }
  }, gpu());
  return timing;
}

int64_t minimum_bytes_per_rank(int64_t seq_len) {
  return rd::bench::minimum_bytes_per_rank(bench_options(), seq_len, kRanks, kHeads, kDim,
                                           /*bf16*/ 2);
}

void set_ring_counters(benchmark::State& state, const RingTiming& t, double single,
                       int64_t seq_len) {
  state.counters["seconds"] = t.seconds;
  state.counters["single_s"] = single;
  state.counters["overhead"] = t.seconds / single;
  state.counters["tokens_per_s"] = static_cast<double>(seq_len) / t.seconds;
  state.counters["bytes_sent"] = static_cast<double>(t.forward_bytes_sent);
  state.counters["min_bytes"] = static_cast<double>(minimum_bytes_per_rank(seq_len));
  state.counters["ring_steps"] = t.ring_steps;
  state.counters["ring_pairs"] = t.ring_pairs;
  state.counters["gathered_pairs"] = t.gathered_pairs;
}

void ring_row(benchmark::State& state, int64_t seq_len, Direction direction,
              DistStrategy strategy) {
  if (!rd::bench::have_cuda_device()) return state.SkipWithError("no CUDA device");
  RingTiming t;
  double single = 0;
  for (auto _ : state) {
    single = single_seconds(seq_len, direction);
    t = ring_seconds(seq_len, direction, strategy);
    state.SetIterationTime(t.seconds);
  }
  set_ring_counters(state, t, single, seq_len);
}

// A target row: ratio, target and whether it holds (report.py reads these counters).
void set_target(benchmark::State& state, double ratio, double target) {
  state.counters["ratio"] = ratio;
  state.counters["target"] = target;
  state.counters["target_max"] = 1.0;
  state.counters["met"] = ratio <= target ? 1.0 : 0.0;
}

void target_overhead(benchmark::State& state) {
  if (!rd::bench::have_cuda_device()) return state.SkipWithError("no CUDA device");
  for (auto _ : state) {
    const double single = single_seconds(kTargetSeqLen, Direction::kForwardBackward);
    const RingTiming t = ring_seconds(kTargetSeqLen, Direction::kForwardBackward,
                                      DistStrategy::kAuto);
    state.SetIterationTime(t.seconds);
    set_ring_counters(state, t, single, kTargetSeqLen);
    set_target(state, t.seconds / single, kOverheadTarget);
  }
}

void target_traffic(benchmark::State& state) {
  if (!rd::bench::have_cuda_device()) return state.SkipWithError("no CUDA device");
  for (auto _ : state) {
    const RingTiming t = ring_seconds(kTargetSeqLen, Direction::kForward, DistStrategy::kAuto);
    state.SetIterationTime(t.seconds);
    const double minimum = static_cast<double>(minimum_bytes_per_rank(kTargetSeqLen));
    state.counters["bytes_sent"] = static_cast<double>(t.forward_bytes_sent);
    state.counters["min_bytes"] = minimum;
    set_target(state, static_cast<double>(t.forward_bytes_sent) / minimum, kTrafficTarget);
  }
}

template <class F>
void add(const std::string& name, F fn) {
  benchmark::RegisterBenchmark(name.c_str(), fn)->UseManualTime()->Iterations(1)->Unit(
      benchmark::kMillisecond);
}

// One forward + backward of RingMultiheadDilatedAttention(768, 12) on a one-rank group over
// the whole sequence: seconds, and the allocator's peak.
void ring_mhda_row(benchmark::State& state, int64_t seq_len) {
  if (!rd::bench::have_cuda_device()) return state.SkipWithError("no CUDA device");
  rd::Allocator& pool = rd::allocator_for(gpu());
  double seconds = 0;
  int64_t peak = 0;
  try {
    auto comm = rd::dist::make_in_process_group(1, gpu())[0];
    rd::nn::DilatedAttentionOptions o;
    o.segment_lengths = {2048, 4096, 8192};
    o.dilation_rates = {1, 2, 4};
    rd::nn::MultiheadOptions mo;
    mo.tensor_options = rd::TensorOptions(rd::DType::kBFloat16).with_device(gpu());
    rd::Generator init(3);
    rd::nn::RingMultiheadDilatedAttention layer(768, 12, o, comm, init, DistStrategy::kAuto, mo);
    rd::Generator gen(11);
    const Tensor x = rd::randn({1, seq_len, 768}, gen, mo.tensor_options);
    const Tensor grad_y = rd::randn({1, seq_len, 768}, gen, mo.tensor_options);
    rd::synchronize(gpu());
    pool.reset_peak_stats();
    const auto start = std::chrono::steady_clock::now();
    layer.forward(x).backward(grad_y);
    rd::synchronize(gpu());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    peak = static_cast<int64_t>(pool.stats().peak_allocated_bytes);
  } catch (const rd::Error& e) {
    pool.empty_cache();
    return state.SkipWithError(e.code() == rd::ErrorCode::kOutOfMemory ? "out of memory" : e.what());
  }
  pool.empty_cache();
  for (auto _ : state) state.SetIterationTime(seconds);
  state.counters["seconds"] = seconds;
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.counters["tokens_per_s"] = static_cast<double>(seq_len) / seconds;
}

void add_rows() {
  for (int64_t millions : {4, 6, 8, 10, 12}) {
    const int64_t seq_len = millions * 1048576;
    add(rd::str_cat("ring_mhda/fwdbwd/E768H12/P1/N", seq_len),
        [=](benchmark::State& state) { ring_mhda_row(state, seq_len); });
  }
  for (int64_t seq_len : {int64_t{262144}, kTargetSeqLen}) {
    for (Direction d : {Direction::kForward, Direction::kForwardBackward}) {
      for (DistStrategy s : {DistStrategy::kRing, DistStrategy::kAllGather, DistStrategy::kAuto}) {
        add(rd::str_cat("ring/", direction_name(d), "/", rd::nn::strategy_name(s), "/P", kRanks,
                        "/H16D128/N", seq_len),
            [=](benchmark::State& state) { ring_row(state, seq_len, d, s); });
      }
    }
  }
  const std::string shape = rd::str_cat("/P", kRanks, "/H16D128/N", kTargetSeqLen);
  add("target/auto_fwdbwd_over_single" + shape, target_overhead);
  add("target/auto_bytes_sent_over_minimum" + shape, target_traffic);
}

#endif  // RD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  const std::string command = rd::bench::command_line(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
#if defined(RD_WITH_CUDA)
  rd::bench::add_cuda_context(command, kDevice);
  add_rows();
#else
  std::cerr << "cuda_ring_attention_bench: this build has no CUDA backend; no benchmark is "
               "registered\n";
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
