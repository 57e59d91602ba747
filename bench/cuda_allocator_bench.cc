// Cost of one allocate + deallocate pair on a CUDA device, 4 KiB to 256 MiB: the caching
// allocator in steady state (after a warm-up pair has filled its cache) against raw
// cudaMalloc/cudaFree. Without CUDA in the build no benchmark is registered; without a
// device at run time each one reports an error and is skipped.
// Run: build/<dir>/bench/cuda_allocator_bench --benchmark_filter=<regex>.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/runtime.h"
#endif

namespace {

#if defined(RD_WITH_CUDA)

using rd::kernels::cuda::CudaCachingAllocator;

constexpr int64_t kMinBytes = int64_t{4} << 10;    // 4 KiB
constexpr int64_t kMaxBytes = int64_t{256} << 20;  // 256 MiB

bool skip_without_device(benchmark::State& state) {
  if (rd::kernels::cuda::device_count() > 0) return false;
  state.SkipWithError("no CUDA device visible");
  return true;
}

// A private pool, so that the numbers do not depend on what else the process allocated.
void BM_CachingAllocator(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const auto nbytes = static_cast<size_t>(state.range(0));
  CudaCachingAllocator pool(0);
  pool.deallocate(pool.allocate(nbytes));  // warm-up: the segment is cached from now on
  for (auto _ : state) {
    void* ptr = pool.allocate(nbytes);
    benchmark::DoNotOptimize(ptr);
    pool.deallocate(ptr);
  }
  const rd::MemoryStats stats = pool.stats();
  state.counters["system_allocs"] = static_cast<double>(stats.system_allocs);  // stays 1
}

void BM_CudaMallocFree(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const auto nbytes = static_cast<size_t>(state.range(0));
  rd::kernels::cuda::DeviceGuard guard(0);
  for (auto _ : state) {
    void* ptr = nullptr;
    RD_CUDA_CHECK(cudaMalloc(&ptr, nbytes));
    benchmark::DoNotOptimize(ptr);
    RD_CUDA_CHECK(cudaFree(ptr));
  }
}

BENCHMARK(BM_CachingAllocator)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaMallocFree)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes)
    ->Unit(benchmark::kMicrosecond);

#endif  // RD_WITH_CUDA

}  // namespace

BENCHMARK_MAIN();
