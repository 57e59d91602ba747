// CPU throughput of the core ops through the public API: GEMM (GFLOP/s), elementwise,
// reductions and the fused row ops (bytes/s). Inputs are random normal float32. Rates use
// wall time: the ops run on several threads, and CPU time would count only the caller's.
// Run: ./rd bench, or build/release/bench/cpu_ops_bench --benchmark_filter=<regex>.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "ringdilated/ringdilated.h"

namespace {

constexpr int64_t kFloatBytes = sizeof(float);
constexpr int64_t kRowOpRows = 4096;
constexpr int64_t kRowOpCols = 1024;

rd::Tensor random_tensor(rd::Shape shape, uint64_t seed) {
  rd::Generator gen(seed);
  return rd::randn(std::move(shape), gen);
}

// Reports the bytes each iteration reads and writes, so the output shows bytes/s.
void set_bytes_per_iteration(benchmark::State& state, int64_t bytes_per_iteration) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iteration);
}

// --- GEMM: [n, n] @ [n, n], 2 n^3 floating-point operations --------------------------

void BM_Matmul(benchmark::State& state) {
  const int64_t n = state.range(0);
  rd::Tensor a = random_tensor({n, n}, 1);
  rd::Tensor b = random_tensor({n, n}, 2);
  for (auto _ : state) {
    rd::Tensor c = rd::matmul(a, b);
    benchmark::DoNotOptimize(c.raw_data());
  }
  const double flops = 2.0 * double(n) * double(n) * double(n);
  // Printed as "GFLOP=<n>/s".
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Matmul)
    ->RangeMultiplier(2)
    ->Range(256, 1024)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// --- elementwise: 1M, 4M and 16M elements -------------------------------------------

enum class Elementwise { kAdd, kMul, kGelu };

template <Elementwise kOp>
void BM_Elementwise(benchmark::State& state) {
  const int64_t n = state.range(0);
  rd::Tensor x = random_tensor({n}, 3);
  rd::Tensor y = random_tensor({n}, 4);
  for (auto _ : state) {
    rd::Tensor out;
    if constexpr (kOp == Elementwise::kAdd) out = rd::add(x, y);
    if constexpr (kOp == Elementwise::kMul) out = rd::mul(x, y);
    if constexpr (kOp == Elementwise::kGelu) out = rd::gelu(x);
    benchmark::DoNotOptimize(out.raw_data());
  }
  const int64_t tensors_touched = kOp == Elementwise::kGelu ? 2 : 3;  // inputs + output
  set_bytes_per_iteration(state, tensors_touched * n * kFloatBytes);
}
void ElementwiseSizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(4)->Range(1 << 20, 1 << 24)->Unit(benchmark::kMicrosecond)->UseRealTime();
}
BENCHMARK(BM_Elementwise<Elementwise::kAdd>)->Name("BM_Add")->Apply(ElementwiseSizes);
BENCHMARK(BM_Elementwise<Elementwise::kMul>)->Name("BM_Mul")->Apply(ElementwiseSizes);
BENCHMARK(BM_Elementwise<Elementwise::kGelu>)->Name("BM_Gelu")->Apply(ElementwiseSizes);

// --- reductions of a [4096, 1024] input: per row, per column, and of everything ------

enum class Reduction { kSum, kMax };
enum class Axis : int64_t { kRows = 0, kColumns = 1, kAll = 2 };

template <Reduction kOp>
void BM_Reduce(benchmark::State& state) {
  const auto axis = static_cast<Axis>(state.range(0));
  rd::Tensor x = random_tensor({kRowOpRows, kRowOpCols}, 5);
  std::vector<int64_t> dims;
  if (axis == Axis::kRows) dims = {1};     // one result per row
  if (axis == Axis::kColumns) dims = {0};  // one result per column
  for (auto _ : state) {
    rd::Tensor out = kOp == Reduction::kSum ? rd::sum(x, dims) : rd::max(x, dims);
    benchmark::DoNotOptimize(out.raw_data());
  }
  state.SetLabel(axis == Axis::kRows      ? "each row"
                 : axis == Axis::kColumns ? "each column"
                                          : "all");
  set_bytes_per_iteration(state, x.numel() * kFloatBytes);
}
void ReduceAxes(benchmark::internal::Benchmark* b) {
  b->DenseRange(0, 2)->Unit(benchmark::kMicrosecond)->UseRealTime();
}
BENCHMARK(BM_Reduce<Reduction::kSum>)->Name("BM_Sum")->Apply(ReduceAxes);
BENCHMARK(BM_Reduce<Reduction::kMax>)->Name("BM_Max")->Apply(ReduceAxes);

// --- fused row ops on [4096, 1024] ---------------------------------------------------

void BM_Softmax(benchmark::State& state) {
  rd::Tensor x = random_tensor({kRowOpRows, kRowOpCols}, 6);
  for (auto _ : state) {
    rd::Tensor out = rd::softmax(x, -1);
    benchmark::DoNotOptimize(out.raw_data());
  }
  set_bytes_per_iteration(state, 2 * x.numel() * kFloatBytes);
}
BENCHMARK(BM_Softmax)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_LayerNorm(benchmark::State& state) {
  rd::Tensor x = random_tensor({kRowOpRows, kRowOpCols}, 7);
  rd::Tensor weight = random_tensor({kRowOpCols}, 8);
  rd::Tensor bias = random_tensor({kRowOpCols}, 9);
  for (auto _ : state) {
    rd::Tensor out = rd::layer_norm(x, {kRowOpCols}, weight, bias);
    benchmark::DoNotOptimize(out.raw_data());
  }
  set_bytes_per_iteration(state, 2 * x.numel() * kFloatBytes);
}
BENCHMARK(BM_LayerNorm)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
