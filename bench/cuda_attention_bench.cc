// Throughput of the flash-attention kernels (kernels/cuda/flash_attention.h) on the shapes of
// dilated attention: bf16 q/k/v of [B * segments, H, n, D] (n = 512, 1024, 2048; D = 64, 128;
// causal and not), forward alone and forward + backward, plus issue 4's target shape read in
// place as a dilated view: segments of 2048 / 4096 / 8192 tokens with rates 1 / 2 / 4 (2048
// rows each, sequence stride r * H * D) over a contiguous [1, N, H, 128] tensor.
//
// Every row times GPU work with CUDA events on the library's current stream (manual time):
// after warm-up calls, batches of calls (about kBatchSeconds of GPU time) are queued back to
// back between two events; the reported time is per call. Inputs are random normal (never
// zeros). Counters:
//   tflops  attention FLOPs over GPU time, in TFLOP/s: forward 4 * n^2 * D per (segment,
//           head) (two matrix products), forward + backward 3.5 times that (five products
//           in the backward); causal rows count the visible half, n (n + 1) / 2.
//   tokens  query rows per call.
// Run (one H100, < 1 minute): build/<dir>/bench/cuda_attention_bench --benchmark_repetitions=3
//   --benchmark_display_aggregates_only=true
// Rows are named flash_<fwd|fwdbwd>/bf16/D<d>/n<n>/<dense|causal|dilated_r<r>>. Without CUDA in
// the build no row is registered; without a device each row is skipped.
#include <benchmark/benchmark.h>

#include <iostream>

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/flash_attention.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "cuda_bench_util.h"
#endif

namespace {

#if defined(RD_WITH_CUDA)

using rd::DType;
using rd::kernels::StridedView;
namespace gpu = rd::kernels::cuda;
using rd::bench::DeviceBuffer;
using rd::bench::have_cuda_device;

constexpr int kDevice = 0;
constexpr int64_t kTokens = 16384;  // query rows per head in every dense row
constexpr int64_t kHeads = 16;
constexpr int kWarmupCalls = 2;
constexpr double kBatchSeconds = 20e-3;
constexpr int64_t kMaxCallsPerBatch = 200;

cudaStream_t stream() { return gpu::current_stream(kDevice); }

// One row's problem: the batch of (segment, head) pairs, rows per segment, head dim, and
// how q/k/v sit in memory.
struct Shape {
  int64_t segments;  // B * segments
  int64_t n, d;
  bool causal;
  int64_t rate;  // 0: contiguous [segments, H, n, D]; r >= 1: dilated view of [1, N, H, D]
};

// A view [segments, H, n, D] of `data`: contiguous, or the dilated selection of segments of
// w = n * r tokens (offset 0) of a contiguous [1, segments * w, H, D] tensor.
StridedView view_of(void* data, DType dtype, const Shape& s) {
  StridedView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = 4;
  const int64_t shape[4] = {s.segments, kHeads, s.n, s.d};
  for (int i = 0; i < 4; ++i) v.shape[i] = shape[i];
  if (s.rate == 0) {
    const int64_t strides[4] = {kHeads * s.n * s.d, s.n * s.d, s.d, 1};
    for (int i = 0; i < 4; ++i) v.strides[i] = strides[i];
  } else {
    const int64_t w = s.n * s.rate;
    const int64_t strides[4] = {w * kHeads * s.d, s.d, s.rate * kHeads * s.d, 1};
    for (int i = 0; i < 4; ++i) v.strides[i] = strides[i];
  }
  return v;
}

// Elements of the memory behind a view of `s` (all of the dilated tensor).
int64_t storage_elements(const Shape& s) {
  return s.segments * kHeads * s.n * s.d * std::max<int64_t>(s.rate, 1);
}

StridedView lse_view(void* data, const Shape& s) {
  StridedView v;
  v.data = data;
  v.dtype = DType::kFloat32;
  v.ndim = 3;
  const int64_t shape[3] = {s.segments, kHeads, s.n};
  const int64_t strides[3] = {kHeads * s.n, s.n, 1};
  for (int i = 0; i < 3; ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = strides[i];
  }
  return v;
}

// The buffers of one row, filled once.
struct Problem {
  explicit Problem(const Shape& s)
      : shape(s),
        bytes(static_cast<size_t>(storage_elements(s)) * 2),
        q(bytes),
        k(bytes),
        v(bytes),
        out(bytes),
        grad_out(bytes),
        grad_q(bytes),
        grad_k(bytes),
        grad_v(bytes),
        lse(static_cast<size_t>(s.segments * kHeads * s.n) * sizeof(float)) {
    uint64_t seed = 1;
    for (DeviceBuffer* m : {&q, &k, &v, &grad_out}) {
      gpu::random(flat(m->get()), rd::kernels::Distribution::kNormal, 0.0, 1.0, seed++, 0,
                  stream());
    }
    for (DeviceBuffer* m : {&out, &grad_q, &grad_k, &grad_v}) {
      RD_CUDA_CHECK(cudaMemsetAsync(m->get(), 0, bytes, stream()));
    }
    RD_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  StridedView flat(void* data) const {
    StridedView f;
    f.data = data;
    f.dtype = DType::kBFloat16;
    f.ndim = 1;
    f.shape[0] = static_cast<int64_t>(bytes / 2);
    f.strides[0] = 1;
    return f;
  }
  rd::kernels::AttentionForwardArgs forward_args() const {
    rd::kernels::AttentionForwardArgs a;
    a.q = view_of(q.get(), DType::kBFloat16, shape);
    a.k = view_of(k.get(), DType::kBFloat16, shape);
    a.v = view_of(v.get(), DType::kBFloat16, shape);
    a.out = view_of(out.get(), DType::kBFloat16, shape);
    a.lse = lse_view(lse.get(), shape);
    a.params.scale = 1.0 / std::sqrt(static_cast<double>(shape.d));
    a.params.causal = shape.causal;
    return a;
  }
  rd::kernels::AttentionBackwardArgs backward_args() const {
    const rd::kernels::AttentionForwardArgs f = forward_args();
    rd::kernels::AttentionBackwardArgs a;
    a.q = f.q;
    a.k = f.k;
    a.v = f.v;
    a.out = f.out;
    a.lse = f.lse;
    a.grad_out = view_of(grad_out.get(), DType::kBFloat16, shape);
    a.grad_q = view_of(grad_q.get(), DType::kBFloat16, shape);
    a.grad_k = view_of(grad_k.get(), DType::kBFloat16, shape);
    a.grad_v = view_of(grad_v.get(), DType::kBFloat16, shape);
    a.params = f.params;
    return a;
  }

  Shape shape;
  size_t bytes;
  DeviceBuffer q, k, v, out, grad_out, grad_q, grad_k, grad_v, lse;
};

// The process's scratch pool for the backward (stream-ordered on the current stream).
rd::Allocator& scratch() {
  static gpu::CudaCachingAllocator* const pool = new gpu::CudaCachingAllocator(kDevice);
  return *pool;
}

double forward_flops(const Shape& s) {
  const double pairs = s.causal ? s.n * (s.n + 1) / 2.0 : static_cast<double>(s.n) * s.n;
  return 4.0 * static_cast<double>(s.segments * kHeads) * pairs * static_cast<double>(s.d);
}

void run_row(benchmark::State& state, const Shape& shape, bool backward) {
  if (!have_cuda_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  try {
    RD_CUDA_CHECK(cudaSetDevice(kDevice));
    const Problem problem(shape);
    const rd::kernels::AttentionForwardArgs fwd = problem.forward_args();
    const rd::kernels::AttentionBackwardArgs bwd = problem.backward_args();
    std::string why_not;
    if (!gpu::flash_attention_supports(fwd, &why_not)) {
      state.SkipWithError(why_not.c_str());
      return;
    }
    auto op = [&] {
      gpu::flash_attention_forward(fwd, stream());
      if (backward) gpu::flash_attention_backward(bwd, scratch(), stream());
    };
    for (int i = 0; i < kWarmupCalls; ++i) op();
    auto time_calls = [&](int64_t calls) {
      return rd::bench::gpu_seconds_of_calls(op, calls, stream());
    };
    const double estimate = time_calls(1);
    const int64_t calls = std::clamp<int64_t>(
        static_cast<int64_t>(kBatchSeconds / std::max(estimate, 1e-6)) + 1, 1, kMaxCallsPerBatch);
    double total_seconds = 0.0;
    int64_t total_calls = 0;
    for (auto _ : state) {
      const double seconds = time_calls(calls);
      state.SetIterationTime(seconds / static_cast<double>(calls));
      total_seconds += seconds;
      total_calls += calls;
    }
    const double flops = forward_flops(shape) * (backward ? 3.5 : 1.0);
    state.counters["tflops"] =
        total_seconds > 0 ? flops * static_cast<double>(total_calls) / total_seconds * 1e-12 : 0.0;
    state.counters["tokens"] = static_cast<double>(shape.segments * shape.n);
  } catch (const std::exception& error) {
    state.SkipWithError(error.what());
  }
}

void add_rows() {
  std::vector<std::pair<std::string, Shape>> rows;
  for (int64_t d : {64, 128}) {
    for (int64_t n : {512, 1024, 2048}) {
      for (bool causal : {false, true}) {
        rows.push_back({rd::str_cat("bf16/D", d, "/n", n, causal ? "/causal" : "/dense"),
                        Shape{kTokens / n, n, d, causal, 0}});
      }
    }
  }
  // Issue 4's target: segments 2048 / 4096 / 8192 with rates 1 / 2 / 4, 2048 rows each.
  for (int64_t rate : {1, 2, 4}) {
    rows.push_back(
        {rd::str_cat("bf16/D128/n2048/dilated_r", rate), Shape{8, 2048, 128, false, rate}});
  }
  for (bool backward : {false, true}) {
    for (const auto& [label, shape] : rows) {
      const std::string name = std::string(backward ? "flash_fwdbwd/" : "flash_fwd/") + label;
      benchmark::RegisterBenchmark(
          name.c_str(),
          [shape = shape, backward](benchmark::State& state) { run_row(state, shape, backward); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(5);
    }
  }
}

#endif  // RD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
#if defined(RD_WITH_CUDA)
  add_rows();
#else
  std::cerr << "cuda_attention_bench: this build has no CUDA backend; no benchmark is registered\n";
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
