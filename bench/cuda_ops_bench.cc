// CUDA throughput of the library against ceilings measured in the same process, for issue 3's
// targets: GEMM against a bare cuBLASLt call, memory-bound ops (elementwise, reductions,
// row-wise fused ops, AdamW) against the device-to-device copy bandwidth.
//
// Every row times GPU work with CUDA events on the library's current stream (manual time):
// after a warm-up, calls are queued back to back in batches of about 4 ms of GPU time between
// two events (behind an untimed lead-in call), so launch gaps are hidden as in a training step
// that runs ahead of the GPU, and the tensor API's host overhead shows only where it exceeds
// the GPU time. Inputs are random (never zeros); large operands are 256 MiB, beyond the L2.
// Counters (rates are per second of GPU time):
//   bytes_per_second  minimal bytes each call must move (inputs read once, outputs written
//                     once) over time; memory-bound rows
//   flops             2*m*n*k floating-point operations over time; GEMM rows
//   ceiling           the same run's ceiling in the same unit: the D2D copy bandwidth (bytes
//                     read + written) or the bare cuBLASLt GEMM's FLOP/s for that problem
//   ratio             achieved / ceiling
//   target            issue 3's minimum ratio, on rows the issue sets one for
// Ceilings are measured once per process, on first use (class Ceilings, owned by main()).
//
// Run (one H100, ~4 minutes): build/<dir>/bench/cuda_ops_bench --benchmark_min_time=0.3
//   --benchmark_out=cuda_ops.json --benchmark_out_format=json
// then: python3 bench/report.py cuda_ops.json > tables.md. One repetition: each repetition
// sizes its own batches, and Google Benchmark 1.7 aborts when repetitions of a row end with
// different iteration counts (statistics.cc ComputeStats check).
// Rows are named group/op/dtype/shape; --benchmark_filter=<regex> picks some, e.g. '^rowwise/'.
// Without CUDA in the build no row is registered; without a device each row is skipped.
#include <benchmark/benchmark.h>

#include "cuda_bench_context.h"

#include <exception>
#include <iostream>

#if defined(RD_WITH_CUDA)
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/ringdilated.h"
#include "ringdilated/tensor/dispatch.h"
#include "cuda_bench_util.h"
#endif

namespace {

#if defined(RD_WITH_CUDA)

using rd::DType;
using rd::Tensor;
using rd::bench::DeviceBuffer;

constexpr int kDeviceIndex = 0;
constexpr rd::Device kDevice = rd::Device::cuda(kDeviceIndex);

// --- sizes -------------------------------------------------------------------------------

// Each large operand: 256 MiB, five times the H100's 50 MB L2, so every row streams from HBM.
constexpr int64_t kTensorBytes = int64_t{1} << 28;
// The copy that sets the bandwidth ceiling (1 GiB each way).
constexpr int64_t kCopyCeilingBytes = int64_t{1} << 30;
constexpr int64_t kReduceCols = 4096;
constexpr int64_t kRowCols[] = {1024, 2048, 4096, 8192, 16384};
constexpr int64_t kFusedInfoCols = 4096;  // the informational fused rows use one width
constexpr int64_t kVocab = 50304;         // cross-entropy classes (GPT-2's padded vocabulary)
constexpr int64_t kAdamWLayers = 4;       // AdamW over the parameters of 4 transformer layers
constexpr int64_t kAdamWWidth = 1024;     // of this embedding width (~50M parameters)
constexpr double kNormEps = 1e-5;

// --- issue 3's targets, as ratios of the same run's ceiling --------------------------------
constexpr double kGemmTarget = 0.90;       // bf16 8192^3 through the library vs bare cuBLASLt
constexpr double kBandwidthTarget = 0.80;  // large elementwise ops and reductions
constexpr double kRowwiseTarget = 0.70;    // softmax and layer_norm, forward and backward
constexpr double kNoTarget = 0.0;          // informational rows

// --- timing ------------------------------------------------------------------------------
constexpr int kWarmupCalls = 3;    // first calls pay for heuristics, handles, cache fills
constexpr int kEstimateCalls = 3;  // calls timed to size the batches
constexpr double kBatchSeconds = 4e-3;  // GPU time between two events
constexpr int64_t kMaxCallsPerBatch = 1000;
constexpr double kCeilingSeconds = 0.25;  // GPU time spent measuring one ceiling
constexpr size_t kCeilingMinBatches = 10;
constexpr double kCandidateSeconds = 0.05;  // per heuristic candidate, in the tuned GEMM row
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;  // as the library's
constexpr int kGemmCandidates = 8;                        // heuristic results asked for

// --- small helpers -----------------------------------------------------------------------

rd::TensorOptions on_device(DType dtype) { return rd::TensorOptions(dtype).with_device(kDevice); }

Tensor random_normal(rd::Shape shape, DType dtype, uint64_t seed) {
  rd::Generator gen(seed);
  return rd::randn(std::move(shape), gen, on_device(dtype));
}

Tensor random_uniform(rd::Shape shape, DType dtype, uint64_t seed) {
  rd::Generator gen(seed);
  return rd::rand(std::move(shape), gen, on_device(dtype));
}

double bytes_of(const Tensor& t) {
  return static_cast<double>(t.numel()) * static_cast<double>(rd::dtype_size(t.dtype()));
}

double size_of(DType dtype) { return static_cast<double>(rd::dtype_size(dtype)); }

// Rows of `cols` elements that fill kTensorBytes.
int64_t rows_for(int64_t cols, DType dtype) {
  return std::max<int64_t>(1, kTensorBytes / (cols * static_cast<int64_t>(rd::dtype_size(dtype))));
}

const char* short_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    default: return "other";
  }
}

// "8192x4096": the shape part of a row's name.
std::string dims_str(const rd::Shape& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? "x" : "") + std::to_string(shape[i]);
  }
  return out;
}

// "bfloat16 [8192, 4096]": a row's label.
std::string label_of(DType dtype, const rd::Shape& shape) {
  return rd::str_cat(rd::dtype_name(dtype), " ", rd::shape_str(shape));
}

float* float_ptr(const Tensor& t) { return static_cast<float*>(t.raw_data()); }

rd::kernels::KernelBackend& device_backend() { return rd::backend_for(kDevice); }

cudaStream_t stream() { return rd::kernels::cuda::current_stream(kDeviceIndex); }

// --- CUDA resources ------------------------------------------------------------------------

// Times calls of an op with a pair of events on one stream.
class GpuTimer {
 public:
  explicit GpuTimer(cudaStream_t stream) : stream_(stream) {}

  // GPU seconds per call over `calls` calls queued back to back between the two events. An
  // untimed lead-in call keeps the GPU busy while the host queues the timed ones, so the start
  // event does not count the host's time to issue the first call.
  template <class Op>
  double seconds_per_call(int64_t calls, Op& op) {
    op();
    return rd::bench::gpu_seconds_of_calls(op, calls, stream_) / static_cast<double>(calls);
  }

  // Runs the warm-up calls, then returns how many calls make a batch of about kBatchSeconds.
  template <class Op>
  int64_t warm_up_and_size_batch(Op& op) {
    for (int i = 0; i < kWarmupCalls; ++i) op();
    RD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const double estimate = seconds_per_call(kEstimateCalls, op);
    const double calls = estimate > 0.0 ? kBatchSeconds / estimate : 1.0;
    return std::clamp<int64_t>(static_cast<int64_t>(calls) + 1, 1, kMaxCallsPerBatch);
  }

 private:
  cudaStream_t stream_;
};

// Median GPU seconds per call of `op`, over batches of about kBatchSeconds, for at least
// `min_seconds` of GPU time and kCeilingMinBatches batches. The median resists a stray slow
// batch; a long run lets the clocks settle where a sustained workload would hold them.
template <class Op>
double median_seconds_per_call(Op& op, double min_seconds) {
  GpuTimer timer(stream());
  const int64_t calls = timer.warm_up_and_size_batch(op);
  std::vector<double> samples;
  double total = 0.0;
  while (samples.size() < kCeilingMinBatches || total < min_seconds) {
    samples.push_back(timer.seconds_per_call(calls, op));
    total += samples.back() * static_cast<double>(calls);
  }
  auto middle = samples.begin() + static_cast<std::ptrdiff_t>(samples.size() / 2);
  std::nth_element(samples.begin(), middle, samples.end());
  return *middle;
}

// --- the bare cuBLASLt GEMM ------------------------------------------------------------------

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expression,
                                     const char* file, int line) {
  throw rd::Error(rd::ErrorCode::kInternal,
                  rd::str_cat("cuBLASLt error ", cublasLtGetStatusName(status), " in ", expression,
                              " at ", file, ":", line));
}

#define BENCH_CUBLAS_CHECK(expr)                                    \
  do {                                                              \
    const cublasStatus_t bench_status_ = (expr);                    \
    if (bench_status_ != CUBLAS_STATUS_SUCCESS) {                   \
      throw_cublas_error(bench_status_, #expr, __FILE__, __LINE__); \
    }                                                               \
  } while (false)

// Owning pointers for cuBLASLt's opaque handles.
template <class Handle, cublasStatus_t (*kDestroy)(Handle)>
struct LtDestroyer {
  void operator()(Handle handle) const { kDestroy(handle); }
};
template <class Handle, cublasStatus_t (*kDestroy)(Handle)>
using LtOwner = std::unique_ptr<std::remove_pointer_t<Handle>, LtDestroyer<Handle, kDestroy>>;
using LtHandle = LtOwner<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = LtOwner<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = LtOwner<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = LtOwner<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

// A row-major product C[m, n] = A[m, k] @ B[k, n].
struct GemmCase {
  DType dtype = DType::kBFloat16;
  bool tf32 = false;  // float32 only: TF32 tensor cores
  int64_t m = 0, n = 0, k = 0;

  double flops() const {
    return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  }
  // "bf16/8192x8192x8192", "f32_tf32/8192x8192x8192": names rows and keys the ceilings.
  std::string key() const {
    return rd::str_cat(short_name(dtype), tf32 ? "_tf32" : "", "/", dims_str({m, n, k}));
  }
  std::string label() const {
    return rd::str_cat(rd::dtype_name(dtype), tf32 ? " (tf32)" : "", " [", m, ", ", k, "] @ [", k,
                       ", ", n, "]");
  }
};

// The inputs of one GEMM case: random A and B, and C, all on the device.
struct GemmOperands {
  Tensor a, b, c;
  explicit GemmOperands(const GemmCase& g)
      : a(random_normal({g.m, g.k}, g.dtype, 11)),
        b(random_normal({g.k, g.n}, g.dtype, 12)),
        c(rd::empty({g.m, g.n}, on_device(g.dtype))) {}
};

// A direct cublasLtMatmul call as a user would write it, with its own handle and 32 MiB
// workspace: the row-major product computed as the column-major C^T = B^T A^T (no data
// moves; the same layouts the library uses), float32 compute (TF32 when asked), and up to
// kGemmCandidates algorithms from the heuristic, best ranked first. The ceiling uses the
// first, as the library does; the tuned row tries them all.
class BareGemm {
 public:
  BareGemm(const GemmCase& g, const void* a, const void* b, void* c) : a_(a), b_(b), c_(c) {
    cublasLtHandle_t handle = nullptr;
    BENCH_CUBLAS_CHECK(cublasLtCreate(&handle));
    handle_.reset(handle);
    const cudaDataType_t type = g.dtype == DType::kBFloat16  ? CUDA_R_16BF
                                : g.dtype == DType::kFloat16 ? CUDA_R_16F
                                                             : CUDA_R_32F;
    const cublasComputeType_t compute = g.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasLtMatmulDesc_t desc = nullptr;
    BENCH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
    desc_.reset(desc);
    const cublasOperation_t no_transpose = CUBLAS_OP_N;
    BENCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                      &no_transpose, sizeof(no_transpose)));
    BENCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                      &no_transpose, sizeof(no_transpose)));
    // Column-major views: B is n x k (ld n), A is k x m (ld k), C is n x m (ld n).
    first_ = make_layout(type, g.n, g.k, g.n);
    second_ = make_layout(type, g.k, g.m, g.k);
    out_ = make_layout(type, g.n, g.m, g.n);
    workspace_ = std::make_unique<DeviceBuffer>(kGemmWorkspaceBytes);
    find_algorithms();
  }

  int algorithm_count() const { return static_cast<int>(algorithms_.size()); }

  // Queues one product with the heuristic's `rank`-th algorithm on the current stream.
  void run(int rank) const {
    const float alpha = 1.0f, beta = 0.0f;
    BENCH_CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), &alpha, b_, first_.get(), a_,
                                      second_.get(), &beta, c_, out_.get(), c_, out_.get(),
                                      &algorithms_[static_cast<size_t>(rank)].algo,
                                      workspace_->get(), kGemmWorkspaceBytes, stream()));
  }

 private:
  static LtLayout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
    cublasLtMatrixLayout_t layout = nullptr;
    BENCH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows),
                                                  static_cast<uint64_t>(cols), ld));
    return LtLayout(layout);
  }

  void find_algorithms() {
    cublasLtMatmulPreference_t raw = nullptr;
    BENCH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
    const LtPreference preference(raw);
    const uint64_t workspace = kGemmWorkspaceBytes;
    BENCH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
    std::vector<cublasLtMatmulHeuristicResult_t> results(kGemmCandidates);
    int returned = 0;
    BENCH_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_.get(), desc_.get(), first_.get(),
                                                      second_.get(), out_.get(), out_.get(), raw,
                                                      kGemmCandidates, results.data(), &returned));
    for (int i = 0; i < returned; ++i) {
      if (results[static_cast<size_t>(i)].state == CUBLAS_STATUS_SUCCESS) {
        algorithms_.push_back(results[static_cast<size_t>(i)]);
      }
    }
    if (algorithms_.empty()) {
      throw rd::Error(rd::ErrorCode::kUnimplemented, "cuBLASLt's heuristic found no algorithm");
    }
  }

  const void* a_;
  const void* b_;
  void* c_;
  LtHandle handle_;
  LtMatmulDesc desc_;
  LtLayout first_, second_, out_;
  std::unique_ptr<DeviceBuffer> workspace_;
  std::vector<cublasLtMatmulHeuristicResult_t> algorithms_;
};

// --- ceilings --------------------------------------------------------------------------------

// The ceilings every ratio is taken against, each measured once per process on first use,
// so that a ratio always compares numbers from the same run (and a filtered run measures
// only the ceilings it needs). Owned by main() and passed to every row by reference;
// benchmarks run one at a time on one thread, so it needs no lock.
class Ceilings {
 public:
  // Device-to-device cudaMemcpyAsync of kCopyCeilingBytes: bytes read + written per second.
  double copy_bytes_per_second() {
    if (!copy_) {
      DeviceBuffer source(kCopyCeilingBytes), destination(kCopyCeilingBytes);
      RD_CUDA_CHECK(cudaMemsetAsync(source.get(), 0x3C, kCopyCeilingBytes, stream()));
      auto copy = [&] {
        RD_CUDA_CHECK(cudaMemcpyAsync(destination.get(), source.get(), kCopyCeilingBytes,
                                      cudaMemcpyDeviceToDevice, stream()));
      };
      copy_ = 2.0 * static_cast<double>(kCopyCeilingBytes) /
              median_seconds_per_call(copy, kCeilingSeconds);
    }
    return *copy_;
  }

  // FLOP/s of the bare cuBLASLt call for `g` with the heuristic's first algorithm.
  double gemm_flops_per_second(const GemmCase& g) {
    const std::string key = g.key();
    auto found = gemm_.find(key);
    if (found != gemm_.end()) return found->second;
    const GemmOperands operands(g);
    const BareGemm bare(g, operands.a.raw_data(), operands.b.raw_data(), operands.c.raw_data());
    auto product = [&] { bare.run(0); };
    const double rate = g.flops() / median_seconds_per_call(product, kCeilingSeconds);
    gemm_.emplace(key, rate);
    return rate;
  }

 private:
  std::optional<double> copy_;
  std::map<std::string, double> gemm_;
};

// --- measuring one row -------------------------------------------------------------------

// What one call must do at least, and what it is compared with.
struct Work {
  double bytes = 0.0;    // minimal bytes read + written (memory-bound rows)
  double flops = 0.0;    // floating-point operations (GEMM rows); when set, the rate is FLOP/s
  double ceiling = 0.0;  // in the rate's unit
  double target = kNoTarget;
};

// Times `op` in batches under Google Benchmark's loop and sets the row's counters.
template <class Op>
void measure(benchmark::State& state, const Work& work, Op op) {
  GpuTimer timer(stream());
  const int64_t calls = timer.warm_up_and_size_batch(op);
  double seconds = 0.0;
  int64_t done = 0;
  while (state.KeepRunningBatch(calls)) {
    const double batch_seconds = timer.seconds_per_call(calls, op) * static_cast<double>(calls);
    state.SetIterationTime(batch_seconds);
    seconds += batch_seconds;
    done += calls;
  }
  if (done == 0 || seconds <= 0.0) return;
  if (work.bytes > 0.0) {
    state.SetBytesProcessed(static_cast<int64_t>(work.bytes * static_cast<double>(done)));
  }
  if (work.flops > 0.0) {
    state.counters["flops"] =
        benchmark::Counter(work.flops, benchmark::Counter::kIsIterationInvariantRate);
  }
  const double per_call = work.flops > 0.0 ? work.flops : work.bytes;
  const double achieved = per_call * static_cast<double>(done) / seconds;
  state.counters["ceiling"] = work.ceiling;
  state.counters["ratio"] = work.ceiling > 0.0 ? achieved / work.ceiling : 0.0;
  if (work.target > 0.0) state.counters["target"] = work.target;
}

// A memory-bound row's Work: `bytes` against the copy bandwidth.
Work bandwidth_work(Ceilings& ceilings, double bytes, double target) {
  Work work;
  work.bytes = bytes;
  work.ceiling = ceilings.copy_bytes_per_second();
  work.target = target;
  return work;
}

using RowBody = std::function<void(benchmark::State&, Ceilings&)>;

// Registers one row: skipped without a device; an rd::Error or CUDA failure skips the row
// with its message instead of ending the process.
void add_row(const std::string& name, Ceilings& ceilings, RowBody body) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [&ceilings, body = std::move(body)](benchmark::State& state) {
                                 if (!rd::cuda_available()) {
                                   state.SkipWithError("no CUDA device visible");
                                   return;
                                 }
                                 try {
                                   rd::kernels::cuda::DeviceGuard device(kDeviceIndex);
                                   body(state, ceilings);
                                 } catch (const std::exception& error) {
                                   state.SkipWithError(error.what());
                                 }
                               })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

// --- ceilings as rows of their own ----------------------------------------------------------

void copy_ceiling_row(benchmark::State& state, Ceilings& ceilings) {
  const Work work = bandwidth_work(ceilings, 2.0 * kCopyCeilingBytes, kNoTarget);
  DeviceBuffer source(kCopyCeilingBytes), destination(kCopyCeilingBytes);
  RD_CUDA_CHECK(cudaMemsetAsync(source.get(), 0x3C, kCopyCeilingBytes, stream()));
  state.SetLabel("cudaMemcpyAsync D2D, 1 GiB, bytes read + written");
  measure(state, work, [&] {
    RD_CUDA_CHECK(cudaMemcpyAsync(destination.get(), source.get(), kCopyCeilingBytes,
                                  cudaMemcpyDeviceToDevice, stream()));
  });
}

// --- GEMM ----------------------------------------------------------------------------------

enum class GemmPath {
  kBare,     // direct cublasLtMatmul, heuristic's first algorithm (the ceiling itself)
  kTuned,    // direct cublasLtMatmul, fastest of the heuristic's candidates (informational)
  kMatmul,   // rd::matmul on tensors
  kBackend,  // backend_for(cuda).gemm (the tensor API has no TF32 switch)
};

void gemm_row(benchmark::State& state, Ceilings& ceilings, const GemmCase& g, GemmPath path,
              double target) {
  Work work;
  work.flops = g.flops();
  work.ceiling = ceilings.gemm_flops_per_second(g);
  work.target = target;
  GemmOperands operands(g);
  std::string label = g.label();
  if (path == GemmPath::kMatmul) {
    state.SetLabel(label + ", rd::matmul");
    measure(state, work, [&] { Tensor c = rd::matmul(operands.a, operands.b); });
    return;
  }
  if (path == GemmPath::kBackend) {
    rd::kernels::GemmArgs args;
    args.dtype = g.dtype;
    args.m = g.m;
    args.n = g.n;
    args.k = g.k;
    args.a = operands.a.raw_data();
    args.b = operands.b.raw_data();
    args.c = operands.c.raw_data();
    args.lda = g.k;
    args.ldb = g.n;
    args.ldc = g.n;
    args.allow_tf32 = g.tf32;
    state.SetLabel(label + ", backend gemm");
    measure(state, work, [&] { device_backend().gemm(args); });
    return;
  }
  const BareGemm bare(g, operands.a.raw_data(), operands.b.raw_data(), operands.c.raw_data());
  int rank = 0;
  if (path == GemmPath::kTuned) {
    double best = 0.0;
    for (int candidate = 0; candidate < bare.algorithm_count(); ++candidate) {
      auto product = [&] { bare.run(candidate); };
      const double seconds = median_seconds_per_call(product, kCandidateSeconds);
      if (candidate == 0 || seconds < best) {
        best = seconds;
        rank = candidate;
      }
    }
  }
  state.SetLabel(rd::str_cat(label, ", bare cuBLASLt, heuristic algorithm ", rank + 1, " of ",
                             bare.algorithm_count()));
  measure(state, work, [&] { bare.run(rank); });
}

void add_gemm_rows(Ceilings& ceilings) {
  struct Row {
    GemmCase g;
    GemmPath library;
    double target;
  };
  const Row rows[] = {
      {{DType::kBFloat16, false, 8192, 8192, 8192}, GemmPath::kMatmul, kGemmTarget},
      {{DType::kBFloat16, false, 4096, 4096, 4096}, GemmPath::kMatmul, kNoTarget},
      {{DType::kFloat32, true, 8192, 8192, 8192}, GemmPath::kBackend, kNoTarget},
      {{DType::kFloat32, false, 4096, 4096, 4096}, GemmPath::kMatmul, kNoTarget},
  };
  for (const Row& row : rows) {
    const GemmCase g = row.g;
    // The bare row right before the library row: both run in the same thermal state.
    add_row("gemm/cublaslt_bare/" + g.key(), ceilings, [g](benchmark::State& s, Ceilings& c) {
      gemm_row(s, c, g, GemmPath::kBare, kNoTarget);
    });
    const std::string library = row.library == GemmPath::kMatmul ? "matmul" : "backend_gemm";
    add_row("gemm/" + library + "/" + g.key(), ceilings,
            [g, path = row.library, target = row.target](benchmark::State& s, Ceilings& c) {
              gemm_row(s, c, g, path, target);
            });
  }
  const GemmCase big{DType::kBFloat16, false, 8192, 8192, 8192};
  add_row("gemm/cublaslt_tuned/" + big.key(), ceilings, [big](benchmark::State& s, Ceilings& c) {
    gemm_row(s, c, big, GemmPath::kTuned, kNoTarget);
  });
}

// --- elementwise ---------------------------------------------------------------------------

enum class Elementwise { kCopy, kAdd, kMul, kGeluErf, kGeluTanh };

const char* elementwise_name(Elementwise op) {
  switch (op) {
    case Elementwise::kCopy: return "copy";
    case Elementwise::kAdd: return "add";
    case Elementwise::kMul: return "mul";
    case Elementwise::kGeluErf: return "gelu_erf";
    case Elementwise::kGeluTanh: return "gelu_tanh";
  }
  return "?";
}

void elementwise_row(benchmark::State& state, Ceilings& ceilings, Elementwise op, DType dtype) {
  const int64_t n = kTensorBytes / static_cast<int64_t>(rd::dtype_size(dtype));
  const Tensor x = random_normal({n}, dtype, 1);
  const Tensor y = random_normal({n}, dtype, 2);
  Tensor out = rd::empty({n}, on_device(dtype));
  const bool binary = op == Elementwise::kAdd || op == Elementwise::kMul;
  const Work work = bandwidth_work(ceilings, (binary ? 3.0 : 2.0) * bytes_of(x), kBandwidthTarget);
  state.SetLabel(label_of(dtype, {n}) + (op == Elementwise::kCopy ? ", out.copy_(x)" : ""));
  measure(state, work, [&] {
    switch (op) {
      case Elementwise::kCopy: out.copy_(x); break;
      case Elementwise::kAdd: out = rd::add(x, y); break;
      case Elementwise::kMul: out = rd::mul(x, y); break;
      case Elementwise::kGeluErf: out = rd::gelu(x); break;
      case Elementwise::kGeluTanh: out = rd::gelu(x, rd::GeluApproximation::kTanh); break;
    }
  });
}

// out.copy_(x) across dtypes: reads n elements of `from`, writes n of `to`.
void convert_row(benchmark::State& state, Ceilings& ceilings, DType from, DType to) {
  const int64_t n =
      kTensorBytes / static_cast<int64_t>(std::max(rd::dtype_size(from), rd::dtype_size(to)));
  const Tensor x = random_normal({n}, from, 3);
  Tensor out = rd::empty({n}, on_device(to));
  const Work work = bandwidth_work(ceilings, bytes_of(x) + bytes_of(out), kBandwidthTarget);
  state.SetLabel(rd::str_cat(rd::dtype_name(from), " -> ", rd::dtype_name(to), " ",
                             rd::shape_str(rd::Shape{n})));
  measure(state, work, [&] { out.copy_(x); });
}

// The same conversion between v of a packed [rows, 3, 12, 64] buffer and a dense
// [rows, 12, 64] tensor (rows of whole vectors: the row loop): bf16 -> f32 reads the packed
// side (a scratch gradient laid out like a packed projection stored into float32 gradient
// buffers), f32 -> bf16 writes it. Bytes read + written.
void convert_packed_row(benchmark::State& state, Ceilings& ceilings, DType from, DType to) {
  const int64_t rows = kTensorBytes / (3 * 12 * 64 * 4);
  const bool from_packed = rd::dtype_size(from) < rd::dtype_size(to);
  auto make = [&](DType dtype, bool packed, uint64_t seed) {
    return packed ? random_normal({rows, 3, 12, 64}, dtype, seed).select(1, 2)
                  : random_normal({rows, 12, 64}, dtype, seed);
  };
  const Tensor x = make(from, from_packed, 3);
  Tensor out = make(to, !from_packed, 4);
  const Work work = bandwidth_work(ceilings, bytes_of(x) + bytes_of(out), kBandwidthTarget);
  state.SetLabel(rd::str_cat(rd::dtype_name(from), " -> ", rd::dtype_name(to), ", ",
                             from_packed ? "packed v -> dense" : "dense -> packed v"));
  measure(state, work, [&] { out.copy_(x); });
}

// Every other row of 5 of 16 heads of D = 128 in a [1, rows, 16, 128] buffer: the rows a
// dilated attention buffer zeroes where no call of a rate-2 pair writes (nn::RowCover), or a
// dilated selection cuDNN's staging copies.
Tensor every_other_row(const Tensor& buffer) {
  const rd::Shape& st = buffer.strides();
  return buffer.as_strided({1, buffer.size(1) / 2, 5, buffer.size(3)},
                           {st[0], 2 * st[1], st[2], st[3]}, buffer.offset() + 6 * st[2]);
}

Tensor head_buffer(DType dtype, uint64_t seed) {
  const int64_t rows = kTensorBytes / (16 * 128 * static_cast<int64_t>(rd::dtype_size(dtype)));
  return random_normal({1, rows, 16, 128}, dtype, seed);
}

// out.zero_() on a whole tensor or on every_other_row of one. Bytes written.
void zero_row(benchmark::State& state, Ceilings& ceilings, DType dtype, bool strided) {
  const Tensor buffer = head_buffer(dtype, 4);
  Tensor out = strided ? every_other_row(buffer) : buffer;
  const Work work = bandwidth_work(ceilings, bytes_of(out), kBandwidthTarget);
  state.SetLabel(label_of(dtype, out.shape()) +
                 (strided ? ", every other row, 5 of 16 heads" : ""));
  measure(state, work, [&] { out.zero_(); });
}

// Same-dtype copies of rows of contiguous runs: `every_other_row` views of two buffers
// (1280-byte runs, an eighth of each pitch), or v of a packed [N, 3, 12, 64] buffer into a
// dense [N, 12, 64] tensor (1536-byte runs; the trainer's v copies). Through out.copy_(x),
// or straight through the copy engine's 2-D copy (cudaMemcpy2DAsync) on the same views: the
// two ways copy() may take. Bytes read + written.
enum class StridedCopy { kEveryOtherRow, kPackedV };

void strided_copy_row(benchmark::State& state, Ceilings& ceilings, StridedCopy which,
                      bool copy_engine) {
  const DType dtype = DType::kBFloat16;
  Tensor from, out;
  if (which == StridedCopy::kEveryOtherRow) {
    from = every_other_row(head_buffer(dtype, 5));
    out = every_other_row(head_buffer(dtype, 6));
  } else {
    const int64_t rows = kTensorBytes / (3 * 12 * 64 * 2);
    from = random_normal({rows, 3, 12, 64}, dtype, 5).select(1, 2);
    out = rd::empty({rows, 12, 64}, on_device(dtype));
  }
  // Runs of the last two dims, rows along the one before (both views have that form).
  const auto element = static_cast<size_t>(rd::dtype_size(dtype));
  const int64_t ndim = out.dim(), run = out.size(ndim - 1) * out.size(ndim - 2);
  const auto pitch = [&](const Tensor& t) {
    return static_cast<size_t>(t.strides()[ndim - 3]) * element;
  };
  const Work work = bandwidth_work(ceilings, 2.0 * bytes_of(out), kBandwidthTarget);
  state.SetLabel(label_of(dtype, out.shape()) + (copy_engine ? ", cudaMemcpy2DAsync" : ", copy_"));
  measure(state, work, [&] {
    if (copy_engine) {
      RD_CUDA_CHECK(cudaMemcpy2DAsync(out.raw_data(), pitch(out), from.raw_data(), pitch(from),
                                      static_cast<size_t>(run) * element,
                                      static_cast<size_t>(out.numel() / run),
                                      cudaMemcpyDeviceToDevice, stream()));
    } else {
      out.copy_(from);
    }
  });
}

// --- reductions ----------------------------------------------------------------------------

enum class Reduce { kAll, kLastDim, kFirstDim };

const char* reduce_name(Reduce r) {
  switch (r) {
    case Reduce::kAll: return "sum_all";
    case Reduce::kLastDim: return "sum_last_dim";
    case Reduce::kFirstDim: return "sum_first_dim";
  }
  return "?";
}

rd::Shape reduce_shape(DType dtype) { return {rows_for(kReduceCols, dtype), kReduceCols}; }

void reduce_row(benchmark::State& state, Ceilings& ceilings, Reduce r, DType dtype) {
  const rd::Shape shape = reduce_shape(dtype);
  const Tensor x = random_normal(shape, dtype, 4);
  const std::vector<int64_t> dims = r == Reduce::kAll       ? std::vector<int64_t>{}
                                    : r == Reduce::kLastDim ? std::vector<int64_t>{-1}
                                                            : std::vector<int64_t>{0};
  // The output's size counts too (it is not negligible for the last-dim sum).
  const Tensor probe = rd::sum(x, dims);
  const Work work = bandwidth_work(ceilings, bytes_of(x) + bytes_of(probe), kBandwidthTarget);
  state.SetLabel(rd::str_cat(label_of(dtype, shape), " -> ", rd::shape_str(probe.shape())));
  measure(state, work, [&] { Tensor s = rd::sum(x, dims); });
}

// --- softmax and layer_norm ------------------------------------------------------------------

enum class RowOp { kSoftmaxForward, kSoftmaxBackward, kLayerNormForward, kLayerNormBackward };

const char* row_op_name(RowOp op) {
  switch (op) {
    case RowOp::kSoftmaxForward: return "softmax_fwd";
    case RowOp::kSoftmaxBackward: return "softmax_bwd";
    case RowOp::kLayerNormForward: return "layer_norm_fwd";
    case RowOp::kLayerNormBackward: return "layer_norm_bwd";
  }
  return "?";
}

// Forward rows go through the tensor API; backward rows call the backend kernel directly, so
// that only the backward pass is timed (autograd would re-run the forward every call).
void softmax_row(benchmark::State& state, Ceilings& ceilings, bool backward, DType dtype,
                 int64_t cols) {
  const int64_t rows = rows_for(cols, dtype);
  const Tensor x = random_normal({rows, cols}, dtype, 5);
  const double t = bytes_of(x);
  state.SetLabel(label_of(dtype, {rows, cols}) +
                 (backward ? ", backend softmax_backward" : ", rd::softmax"));
  if (!backward) {
    measure(state, bandwidth_work(ceilings, 2.0 * t, kRowwiseTarget),
            [&] { Tensor y = rd::softmax(x, -1); });
    return;
  }
  const Tensor y = rd::softmax(x, -1);  // real probabilities as the saved output
  const Tensor grad_out = random_normal({rows, cols}, dtype, 6);
  const Tensor grad_in = rd::empty({rows, cols}, on_device(dtype));
  measure(state, bandwidth_work(ceilings, 3.0 * t, kRowwiseTarget), [&] {
    device_backend().softmax_backward({.grad_in = grad_in.raw_data(),
                                       .grad_out = grad_out.raw_data(),
                                       .out = y.raw_data(),
                                       .dtype = dtype,
                                       .rows = rows,
                                       .cols = cols,
                                       .log = false});
  });
}

// Inputs and saved statistics of a layer norm (or RMS norm) over [rows, cols].
struct NormCase {
  int64_t rows, cols;
  DType dtype;
  Tensor x, weight, bias, out, mean, rstd;
  NormCase(DType d, int64_t c)
      : rows(rows_for(c, d)),
        cols(c),
        dtype(d),
        x(random_normal({rows, cols}, d, 7)),
        weight(random_normal({cols}, d, 8)),
        bias(random_normal({cols}, d, 9)),
        out(rd::empty({rows, cols}, on_device(d))),
        mean(rd::empty({rows}, on_device(DType::kFloat32))),
        rstd(rd::empty({rows}, on_device(DType::kFloat32))) {}
  double tensor_bytes() const { return bytes_of(x); }
  double stats_bytes() const { return 2.0 * 4.0 * static_cast<double>(rows); }  // mean, rstd
  double param_bytes() const { return static_cast<double>(cols) * size_of(dtype); }
};

void layer_norm_row(benchmark::State& state, Ceilings& ceilings, bool backward, DType dtype,
                    int64_t cols) {
  NormCase nc(dtype, cols);
  state.SetLabel(label_of(dtype, {nc.rows, cols}) +
                 (backward ? ", backend norm_backward (+ weight, bias grads)"
                           : ", rd::layer_norm (weight, bias)"));
  if (!backward) {
    // x in, out back, weight and bias in, mean and rstd out.
    const double bytes = 2.0 * nc.tensor_bytes() + 2.0 * nc.param_bytes() + nc.stats_bytes();
    measure(state, bandwidth_work(ceilings, bytes, kRowwiseTarget),
            [&] { Tensor y = rd::layer_norm(nc.x, {cols}, nc.weight, nc.bias, kNormEps); });
    return;
  }
  device_backend().norm({.out = nc.out.raw_data(),
                         .in = nc.x.raw_data(),
                         .weight = nc.weight.raw_data(),
                         .bias = nc.bias.raw_data(),
                         .mean = float_ptr(nc.mean),
                         .rstd = float_ptr(nc.rstd),
                         .dtype = dtype,
                         .rows = nc.rows,
                         .cols = cols,
                         .eps = kNormEps,
                         .rms = false});
  const Tensor grad_out = random_normal({nc.rows, cols}, dtype, 10);
  const Tensor grad_in = rd::empty({nc.rows, cols}, on_device(dtype));
  const Tensor grad_weight = rd::empty({cols}, on_device(DType::kFloat32));
  const Tensor grad_bias = rd::empty({cols}, on_device(DType::kFloat32));
  // grad_out and x in, grad_in out, mean, rstd and weight in, two float32 [cols] grads out.
  const double bytes = 3.0 * nc.tensor_bytes() + nc.stats_bytes() + nc.param_bytes() +
                       2.0 * 4.0 * static_cast<double>(cols);
  measure(state, bandwidth_work(ceilings, bytes, kRowwiseTarget), [&] {
    device_backend().norm_backward({.grad_in = grad_in.raw_data(),
                                    .grad_weight = float_ptr(grad_weight),
                                    .grad_bias = float_ptr(grad_bias),
                                    .grad_out = grad_out.raw_data(),
                                    .in = nc.x.raw_data(),
                                    .mean = float_ptr(nc.mean),
                                    .rstd = float_ptr(nc.rstd),
                                    .weight = nc.weight.raw_data(),
                                    .dtype = dtype,
                                    .rows = nc.rows,
                                    .cols = cols,
                                    .rms = false});
  });
}

void add_rowwise_rows(Ceilings& ceilings) {
  for (RowOp op : {RowOp::kSoftmaxForward, RowOp::kSoftmaxBackward, RowOp::kLayerNormForward,
                   RowOp::kLayerNormBackward}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t cols : kRowCols) {
        const std::string name = rd::str_cat("rowwise/", row_op_name(op), "/", short_name(dtype),
                                             "/", dims_str({rows_for(cols, dtype), cols}));
        add_row(name, ceilings, [op, dtype, cols](benchmark::State& s, Ceilings& c) {
          const bool backward = op == RowOp::kSoftmaxBackward || op == RowOp::kLayerNormBackward;
          if (op == RowOp::kSoftmaxForward || op == RowOp::kSoftmaxBackward) {
            softmax_row(s, c, backward, dtype, cols);
          } else {
            layer_norm_row(s, c, backward, dtype, cols);
          }
        });
      }
    }
  }
}

// --- informational fused rows: autograd round trips, residual + norm, RMS norm, cross-entropy,
// AdamW. No target of their own in the issue; their ratios show how close they come.

// Forward and backward through autograd (softmax, or layer_norm with weight and bias), the
// way a training step runs them: 2 passes forward, 3 backward.
void autograd_row(benchmark::State& state, Ceilings& ceilings, bool layer_norm, DType dtype) {
  const int64_t cols = kFusedInfoCols, rows = rows_for(cols, dtype);
  Tensor x = random_normal({rows, cols}, dtype, 13);
  Tensor weight = random_normal({cols}, dtype, 14);
  Tensor bias = random_normal({cols}, dtype, 15);
  x.set_requires_grad(true);
  weight.set_requires_grad(true);
  bias.set_requires_grad(true);
  const Tensor grad_out = random_normal({rows, cols}, dtype, 16);
  state.SetLabel(label_of(dtype, {rows, cols}) + ", forward + backward through autograd");
  measure(state, bandwidth_work(ceilings, 5.0 * bytes_of(x), kNoTarget), [&] {
    x.zero_grad();
    Tensor y;
    if (layer_norm) {
      weight.zero_grad();
      bias.zero_grad();
      y = rd::layer_norm(x, {cols}, weight, bias, kNormEps);
    } else {
      y = rd::softmax(x, -1);
    }
    y.backward(grad_out);
  });
}

// The residual-add fused norm (layer norm, or RMS norm without a residual when `rms`):
// forward reads x and residual and writes out and sum; backward reads grad_out, grad_sum and
// the sum and writes grad_in.
void fused_norm_row(benchmark::State& state, Ceilings& ceilings, bool rms, bool backward,
                    DType dtype) {
  NormCase nc(dtype, kFusedInfoCols);
  const int64_t rows = nc.rows, cols = nc.cols;
  const Tensor residual = random_normal({rows, cols}, dtype, 17);
  const Tensor sum = rd::empty({rows, cols}, on_device(dtype));
  const void* residual_ptr = rms ? nullptr : residual.raw_data();
  void* sum_ptr = rms ? nullptr : sum.raw_data();
  const void* bias_ptr = rms ? nullptr : nc.bias.raw_data();
  auto forward = [&] {
    device_backend().norm({.out = nc.out.raw_data(),
                           .in = nc.x.raw_data(),
                           .residual = residual_ptr,
                           .sum = sum_ptr,
                           .weight = nc.weight.raw_data(),
                           .bias = bias_ptr,
                           .mean = float_ptr(nc.mean),
                           .rstd = float_ptr(nc.rstd),
                           .dtype = dtype,
                           .rows = rows,
                           .cols = cols,
                           .eps = kNormEps,
                           .rms = rms});
  };
  const double t = nc.tensor_bytes();
  const double params = (rms ? 1.0 : 2.0) * nc.param_bytes();
  state.SetLabel(
      label_of(dtype, {rows, cols}) +
      (rms ? ", backend norm (rms, weight)" : ", backend norm (residual, weight, bias)") +
      (backward ? " backward" : " forward"));
  if (!backward) {
    const double bytes = (rms ? 2.0 : 4.0) * t + params + nc.stats_bytes();
    measure(state, bandwidth_work(ceilings, bytes, kNoTarget), forward);
    return;
  }
  forward();
  const Tensor grad_out = random_normal({rows, cols}, dtype, 18);
  const Tensor grad_sum = random_normal({rows, cols}, dtype, 19);
  const Tensor grad_in = rd::empty({rows, cols}, on_device(dtype));
  const Tensor grad_weight = rd::empty({cols}, on_device(DType::kFloat32));
  const Tensor grad_bias = rd::empty({cols}, on_device(DType::kFloat32));
  const void* normalized = rms ? nc.x.raw_data() : sum.raw_data();
  const double bytes = (rms ? 3.0 : 4.0) * t + nc.stats_bytes() + nc.param_bytes() +
                       (rms ? 1.0 : 2.0) * 4.0 * static_cast<double>(cols);
  measure(state, bandwidth_work(ceilings, bytes, kNoTarget), [&] {
    device_backend().norm_backward({.grad_in = grad_in.raw_data(),
                                    .grad_weight = float_ptr(grad_weight),
                                    .grad_bias = rms ? nullptr : float_ptr(grad_bias),
                                    .grad_out = grad_out.raw_data(),
                                    .grad_sum = rms ? nullptr : grad_sum.raw_data(),
                                    .in = normalized,
                                    .mean = float_ptr(nc.mean),
                                    .rstd = float_ptr(nc.rstd),
                                    .weight = nc.weight.raw_data(),
                                    .dtype = dtype,
                                    .rows = rows,
                                    .cols = cols,
                                    .rms = rms});
  });
}

// Cross-entropy over [rows, kVocab] logits through the backend, forward (loss and lse) or
// backward (gradient of a mean loss: one broadcast grad_loss value).
void cross_entropy_row(benchmark::State& state, Ceilings& ceilings, bool backward, DType dtype) {
  const int64_t rows = rows_for(kVocab, dtype), cols = kVocab;
  constexpr int64_t kIgnoreIndex = -100;
  const Tensor logits = random_normal({rows, cols}, dtype, 20);
  std::vector<int64_t> classes(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) classes[static_cast<size_t>(r)] = (r * 7919) % cols;
  const Tensor targets = rd::from_vector<int64_t>(classes, {rows}).to(kDevice);
  const DType stats_dtype = rd::accumulation_dtype(dtype);
  const Tensor loss = rd::empty({rows}, on_device(stats_dtype));
  const Tensor lse = rd::empty({rows}, on_device(stats_dtype));
  const auto* target_ptr = static_cast<const int64_t*>(targets.raw_data());
  const double rows_d = static_cast<double>(rows), stat = size_of(stats_dtype);
  // Forward: logits and int64 targets in, loss and lse out. Backward: logits, targets and lse
  // in, grad_logits out (the one broadcast grad_loss value is negligible).
  const double forward_bytes = bytes_of(logits) + rows_d * (8.0 + 2.0 * stat);
  const double backward_bytes = 2.0 * bytes_of(logits) + rows_d * (8.0 + stat);
  state.SetLabel(label_of(dtype, {rows, cols}) + ", backend cross_entropy" +
                 (backward ? "_backward" : ""));
  auto forward = [&] {
    device_backend().cross_entropy({.loss = loss.raw_data(),
                                    .lse = lse.raw_data(),
                                    .logits = logits.raw_data(),
                                    .targets = target_ptr,
                                    .dtype = dtype,
                                    .rows = rows,
                                    .cols = cols,
                                    .inner = 1,
                                    .ignore_index = kIgnoreIndex});
  };
  if (!backward) {
    measure(state, bandwidth_work(ceilings, forward_bytes, kNoTarget), forward);
    return;
  }
  forward();
  const Tensor grad_loss = rd::full({1}, 1.0 / rows_d, on_device(stats_dtype));
  const Tensor grad_logits = rd::empty({rows, cols}, on_device(dtype));
  measure(state, bandwidth_work(ceilings, backward_bytes, kNoTarget), [&] {
    device_backend().cross_entropy_backward({.grad_logits = grad_logits.raw_data(),
                                             .grad_loss = grad_loss.raw_data(),
                                             .grad_loss_stride = 0,
                                             .logits = logits.raw_data(),
                                             .lse = lse.raw_data(),
                                             .targets = target_ptr,
                                             .dtype = dtype,
                                             .rows = rows,
                                             .cols = cols,
                                             .inner = 1,
                                             .ignore_index = kIgnoreIndex});
  });
}

// One AdamW step over the parameters of kAdamWLayers transformer layers of width
// kAdamWWidth (matrices, biases and norm weights: 12 tensors a layer), in one backend call.
void adamw_row(benchmark::State& state, Ceilings& ceilings, DType dtype) {
  const int64_t e = kAdamWWidth;
  const int64_t layer_sizes[] = {3 * e * e, 3 * e, e * e, e, 4 * e * e, 4 * e,
                                 4 * e * e, e,     e,     e, e,         e};
  const DType moment_dtype = rd::accumulation_dtype(dtype);
  std::vector<Tensor> owned;  // keeps every buffer alive while the raw pointers are in use
  std::vector<rd::kernels::AdamWTensor> tensors;
  int64_t params = 0;
  uint64_t seed = 100;
  for (int64_t layer = 0; layer < kAdamWLayers; ++layer) {
    for (int64_t numel : layer_sizes) {
      const Tensor param = random_normal({numel}, dtype, seed++);
      const Tensor grad = random_normal({numel}, dtype, seed++);
      const Tensor exp_avg = random_normal({numel}, moment_dtype, seed++);
      const Tensor exp_avg_sq = random_uniform({numel}, moment_dtype, seed++);  // >= 0
      tensors.push_back(
          {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(), numel});
      owned.insert(owned.end(), {param, grad, exp_avg, exp_avg_sq});
      params += numel;
    }
  }
  rd::kernels::AdamWStep step;
  step.step = 10;
  // param and both moments read and written, grad read.
  const double per_param = 3.0 * size_of(dtype) + 4.0 * size_of(moment_dtype);
  state.SetLabel(rd::str_cat(rd::dtype_name(dtype), ", ", tensors.size(), " tensors, ", params,
                             " parameters, backend adamw"));
  measure(state, bandwidth_work(ceilings, per_param * static_cast<double>(params), kNoTarget), [&] {
    device_backend().adamw(std::span<const rd::kernels::AdamWTensor>(tensors), dtype, step);
  });
}

void add_fused_info_rows(Ceilings& ceilings) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const std::string suffix = rd::str_cat(
        "/", short_name(dtype), "/", dims_str({rows_for(kFusedInfoCols, dtype), kFusedInfoCols}));
    add_row("fused/softmax_autograd_fwd_bwd" + suffix, ceilings,
            [dtype](benchmark::State& s, Ceilings& c) { autograd_row(s, c, false, dtype); });
    add_row("fused/layer_norm_autograd_fwd_bwd" + suffix, ceilings,
            [dtype](benchmark::State& s, Ceilings& c) { autograd_row(s, c, true, dtype); });
    for (bool backward : {false, true}) {
      const std::string dir = backward ? "_bwd" : "_fwd";
      add_row("fused/add_layer_norm" + dir + suffix, ceilings,
              [dtype, backward](benchmark::State& s, Ceilings& c) {
                fused_norm_row(s, c, /*rms=*/false, backward, dtype);
              });
      add_row("fused/rms_norm" + dir + suffix, ceilings,
              [dtype, backward](benchmark::State& s, Ceilings& c) {
                fused_norm_row(s, c, /*rms=*/true, backward, dtype);
              });
    }
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const std::string suffix =
        rd::str_cat("/", short_name(dtype), "/", dims_str({rows_for(kVocab, dtype), kVocab}));
    for (bool backward : {false, true}) {
      add_row(std::string("fused/cross_entropy") + (backward ? "_bwd" : "_fwd") + suffix, ceilings,
              [dtype, backward](benchmark::State& s, Ceilings& c) {
                cross_entropy_row(s, c, backward, dtype);
              });
    }
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    add_row(rd::str_cat("optim/adamw/", short_name(dtype), "/", kAdamWLayers, "_layers_width_",
                        kAdamWWidth),
            ceilings, [dtype](benchmark::State& s, Ceilings& c) { adamw_row(s, c, dtype); });
  }
}

// --- registration ----------------------------------------------------------------------------

void add_all_rows(Ceilings& ceilings) {
  add_row("ceiling/copy_d2d/1GiB", ceilings, copy_ceiling_row);
  add_gemm_rows(ceilings);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const int64_t n = kTensorBytes / static_cast<int64_t>(rd::dtype_size(dtype));
    for (Elementwise op : {Elementwise::kCopy, Elementwise::kAdd, Elementwise::kMul,
                           Elementwise::kGeluErf, Elementwise::kGeluTanh}) {
      add_row(rd::str_cat("elementwise/", elementwise_name(op), "/", short_name(dtype), "/", n),
              ceilings,
              [op, dtype](benchmark::State& s, Ceilings& c) { elementwise_row(s, c, op, dtype); });
    }
  }
  const int64_t convert_n = kTensorBytes / 4;
  add_row(rd::str_cat("elementwise/convert/f32_to_bf16/", convert_n), ceilings,
          [](benchmark::State& s, Ceilings& c) {
            convert_row(s, c, DType::kFloat32, DType::kBFloat16);
          });
  add_row(rd::str_cat("elementwise/convert/bf16_to_f32/", convert_n), ceilings,
          [](benchmark::State& s, Ceilings& c) {
            convert_row(s, c, DType::kBFloat16, DType::kFloat32);
          });
  add_row("elementwise/convert/bf16_to_f32/packed_v", ceilings,
          [](benchmark::State& s, Ceilings& c) {
            convert_packed_row(s, c, DType::kBFloat16, DType::kFloat32);
          });
  add_row("elementwise/convert/f32_to_bf16/packed_v", ceilings,
          [](benchmark::State& s, Ceilings& c) {
            convert_packed_row(s, c, DType::kFloat32, DType::kBFloat16);
          });
  for (const bool strided : {false, true}) {
    add_row(
        rd::str_cat("elementwise/zero/bf16/", strided ? "every_other_row" : "contiguous"), ceilings,
        [strided](benchmark::State& s, Ceilings& c) { zero_row(s, c, DType::kBFloat16, strided); });
  }
  for (const StridedCopy which : {StridedCopy::kEveryOtherRow, StridedCopy::kPackedV}) {
    for (const bool copy_engine : {false, true}) {
      add_row(rd::str_cat("elementwise/copy/bf16/",
                          which == StridedCopy::kEveryOtherRow ? "every_other_row" : "packed_v",
                          copy_engine ? "/copy_engine" : "/copy_"),
              ceilings, [which, copy_engine](benchmark::State& s, Ceilings& c) {
                strided_copy_row(s, c, which, copy_engine);
              });
    }
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (Reduce r : {Reduce::kAll, Reduce::kLastDim, Reduce::kFirstDim}) {
      add_row(rd::str_cat("reduce/", reduce_name(r), "/", short_name(dtype), "/",
                          dims_str(reduce_shape(dtype))),
              ceilings,
              [r, dtype](benchmark::State& s, Ceilings& c) { reduce_row(s, c, r, dtype); });
    }
  }
  add_rowwise_rows(ceilings);
  add_fused_info_rows(ceilings);
}

// The shared context (command line, device, cuDNN), plus what this bench's ceilings depend
// on: the L2 size and the cuBLASLt version.
void add_device_context(const std::string& command) {
  rd::bench::add_cuda_context(command, kDeviceIndex);
  if (!rd::cuda_available()) return;
  cudaDeviceProp prop{};
  RD_CUDA_CHECK(cudaGetDeviceProperties(&prop, kDeviceIndex));
  benchmark::AddCustomContext("cuda_l2_mib", rd::str_cat(prop.l2CacheSize / (1 << 20)));
  benchmark::AddCustomContext("cublaslt_version", std::to_string(cublasLtGetVersion()));
}

#endif  // RD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  const std::string command = rd::bench::command_line(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
#if defined(RD_WITH_CUDA)
  Ceilings ceilings;  // outlives every row: RunSpecifiedBenchmarks returns before it dies
  try {
    add_device_context(command);
  } catch (const std::exception& error) {
    std::cerr << "cuda_ops_bench: could not read the device: " << error.what() << "\n";
  }
  add_all_rows(ceilings);
#else
  std::cerr << "cuda_ops_bench: this build has no CUDA backend; no benchmark is registered\n";
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
