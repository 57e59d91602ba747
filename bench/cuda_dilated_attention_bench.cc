// Dilated attention on one CUDA device (issue 4's "Benchmarks"), through the public API
// rd::nn::dilated_attention_with_lse and MultiheadDilatedAttention, bf16, B = 1, pairs
// (w, r) = (2048, 1), (4096, 2), (8192, 4), head groups:
//   dilated/<fixed|original>/<fwd|fwdbwd>/H<h>D<d>/N<n>/<dense|causal>/<auto|cudnn|flash|math>
//       the fixed (kSegmentLocal) and original (kGlobal) variants, H=12 D=64 and H=16 D=128,
//       N = 8K, 32K, 128K, 256K, 1M, causal and not, on every path. Math is a slow reference
//       (one warp per query row, no tensor cores): it runs up to N = 32K only. The original
//       variant costs O(N^2) (every group attends over N cycled keys): its kAuto rows run
//       until a call would exceed kTimeCapSeconds, its forced-path rows up to N = 32K. The
//       cap holds for every dilated row; a call's time is predicted from the previous N of
//       the same row family (scaled by the FLOPs). A row that stops says why in its error:
//       "time cap: ..." or "out of memory: ...".
//   dense_ceiling/<fwd|fwdbwd>/H<h>D<d>/N<n>/<dense|causal>/cudnn
//       the same work as dense SDPA on the packed batch: per pair i, contiguous bf16
//       [N / w_i, H_i, w_i / r_i, D] (H_i the heads of group i) through the cuDNN kernel
//       directly (KernelBackend::attention_forward/backward, kCudnn); the pairs' calls are
//       timed back to back, so the time is their sum.
//   hilbert/<on|off>/<fwd|fwdbwd>/H16D128/N16384/dense/<path>  use_hilbert's effect (a row
//       whose option is not implemented yet reports the library's error). N is modest because
//       the option may fall back to the math path.
//   mhda/fwdbwd/E768H12/N<n>/<dx|no_dx>  MultiheadDilatedAttention in bf16 (with or without
//       the input's gradient).
//   target/gqa_fwdbwd_over_mha.../KV<4|1>  issue 21: grouped-query attention (H_kv of 16) against
//       the same call with 16 key/value heads, measured in the same row (ratio <= 1).
//   gqa/fwd_over_mha.../KV<4|1>  the same, forward only (no target; where a gap lies).
//   gqa/fwdbwd_over_mha.../causal/KV<4|1>  the same call causal, fwd+bwd (no target).
//   gqa/fwdbwd_alone.../KV<16|4|1>  one side of the target row alone (for kernel traces:
//       tools/gpu_gqa_trace.sh).
//   target/documents_fwdbwd_over_unmasked/H16D128/N262144/<dense|causal>  issue 21:
//       documents averaging a quarter of the longest segment against the same call without
//       them (ratio <= 1.15).
//   documents/gqa_fwdbwd_over_unmasked/H16D128/N262144/<dense|causal>/KV4  the same with
//       grouped queries (H_kv = 4) on both sides (no target).
//   documents/allheads_fwdbwd_over_unmasked/H16D128/N262144/<dense|causal>  the same with
//       every head on every pair (HeadMixing::kAllHeads, rd_train's default; no target).
//   allheads/<fwd|fwdbwd>/H16D128/N262144/<dense|causal>/auto  every head on every pair
//       (HeadMixing::kAllHeads): each pair's partial merged into the others' through the LSE.
//   target/...  issue 4's four targets at N = 262144, H = 16, D = 128, fixed, non-causal,
//       each with its ratio, target and direction (counter target_max = 1: ratio <= target).
//
// Timing: CUDA events on the library's current stream, manual time. Each row first makes one
// warm-up call (cuDNN graphs are built and cached there; its host wall time is the counter
// warmup_s), then one call measured alone for memory: the caching allocator's peak is reset
// right before it (gradients of the previous call dropped first). A call under
// kLongCallSeconds is then timed kReps times in batches of about kBatchSeconds of GPU work,
// and the reported time per call is the median; a longer one is reported from that single
// call. Every row runs one benchmark iteration (its own repetitions are inside). Inputs and
// output gradients are random normal; forward + backward runs Tensor::backward with the
// random output gradient, through autograd into q, k and v. Memory is returned to the device
// (empty_cache) after every row, so rows do not affect each other's peak.
// Counters:
//   tokens_per_s     B * N over the time per call.
//   tflops           attention FLOPs of the selected work over the time (4 n^2 D per
//                    (segment, head) forward, 3.5x that forward + backward; causal counts
//                    n (n + 1) / 2 pairs).
//   held_bytes       allocator bytes in use before the measured call (the inputs, gradient).
//   peak_bytes       allocator peak during the measured call (held bytes included).
//   peak_delta_bytes peak_bytes - held_bytes.
//   bound_bytes      the bound: inputs + outputs + (for fwdbwd) their gradients + LSE,
//                    i.e. (4 or 8) * N * H * D * 2 + H * N * 4 bytes.
//   mem_ratio        peak_bytes / bound_bytes.
//   ratio, target, target_max  on target rows (bench/report.py prints PASS / FAIL).
// The label gives the path the call took (DilatedAttentionResult::path_used, after any
// fallback) and notes. For forward + backward it is the forward's path ("(fwd)"): the public
// API does not report the backward's; a backward fallback is logged once on stderr
// ("[ringdilated] ... falling back"), which the console log keeps.
//
// Run (one H100: about 2 minutes, 103 s on 2026-11-22), then make the markdown tables:
//   build/<dir>/bench/cuda_dilated_attention_bench --benchmark_out=dilated.json
//       --benchmark_out_format=json  (one command line)
//   python3 bench/report.py dilated.json
// or as part of `./rd gpu-run bench` (every bench/cuda_*_bench is packed and run).
// Without CUDA in the build no row is registered; without a device each row is skipped.
#include <benchmark/benchmark.h>

#include <iostream>
#include <random>
#include <string>

#include "cuda_bench_context.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cuda_bench_util.h"
#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/cuda/cudnn_attention.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_attention_modules.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"
#endif

namespace {

#if defined(RD_WITH_CUDA)

using rd::DType;
using rd::Tensor;
using rd::bench::have_cuda_device;
using rd::nn::AttentionPath;
using rd::nn::DilationVariant;

constexpr int kDevice = 0;
constexpr double kTimeCapSeconds = 2.0;   // a row whose call would take longer is not run
constexpr double kLongCallSeconds = 0.1;  // longer calls are timed once
constexpr double kBatchSeconds = 20e-3;   // GPU time of one timed batch of short calls
constexpr int kReps = 3;                  // timed batches of short calls
constexpr int64_t kMaxCallsPerBatch = 100;
constexpr int64_t kMathMaxSeqLen = 32768;            // the math path is a slow reference
constexpr int64_t kOriginalForcedMaxSeqLen = 32768;  // original variant on forced paths
constexpr int64_t kTargetSeqLen = 262144;
constexpr int64_t kHilbertSeqLen = 16384;  // use_hilbert may run on the slow math path
constexpr int64_t kMhdaTargetSeqLen = 4194304;

const std::vector<int64_t> kSegmentLengths{2048, 4096, 8192};
const std::vector<int64_t> kDilationRates{1, 2, 4};
const std::vector<int64_t> kSeqLens{8192, 32768, 131072, 262144, 1048576};

struct HeadConfig {
  int64_t heads, head_dim;
};
constexpr HeadConfig kConfigs[] = {{12, 64}, {16, 128}};
constexpr HeadConfig kTargetConfig{16, 128};

enum class Direction { kForward, kForwardBackward };

struct RowSpec {
  DilationVariant variant = DilationVariant::kSegmentLocal;
  Direction direction = Direction::kForward;
  HeadConfig config{16, 128};
  int64_t seq_len = 0;
  bool causal = false;
  AttentionPath path = AttentionPath::kAuto;
  bool hilbert = false;
  rd::nn::HeadMixing mixing = rd::nn::HeadMixing::kHeadGroups;
};

bool backward_of(const RowSpec& s) { return s.direction == Direction::kForwardBackward; }

rd::Device device() { return rd::Device::cuda(kDevice); }

cudaStream_t stream() { return rd::kernels::cuda::current_stream(kDevice); }

rd::Allocator& pool() { return rd::allocator_for(device()); }

void synchronize() { RD_CUDA_CHECK(cudaStreamSynchronize(stream())); }

// Waits for the device and returns every cached block, so the next row starts clean.
void release_memory() {
  cudaDeviceSynchronize();
  pool().empty_cache();
}

// GPU seconds of `calls` back-to-back calls of `op` on the current stream.
double time_calls(const std::function<void()>& op, int64_t calls) {
  return rd::bench::gpu_seconds_of_calls(op, calls, stream());
}

struct Timing {
  double seconds = 0.0;         // per call
  double warmup_seconds = 0.0;  // host wall time of the warm-up call, synchronized
  int64_t held_bytes = 0;       // allocated before the measured call
  int64_t peak_bytes = 0;       // allocator peak during the measured call
  int64_t timed_calls = 0;
};

// Warm-up, one call measured for memory (after `prepare`, which drops what the previous call
// left), then the timed batches (see the top of the file).
Timing measure(const std::function<void()>& op, const std::function<void()>& prepare) {
  Timing t;
  synchronize();
  const auto wall = std::chrono::steady_clock::now();
  op();
  synchronize();
  t.warmup_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count();

  prepare();
  synchronize();
  t.held_bytes = pool().stats().allocated_bytes;
  pool().reset_peak_stats();
  const double first = time_calls(op, 1);
  t.peak_bytes = pool().stats().peak_allocated_bytes;
  if (first >= kLongCallSeconds) {
    t.seconds = first;
    t.timed_calls = 1;
    return t;
  }
  const int64_t calls = std::clamp<int64_t>(
      static_cast<int64_t>(kBatchSeconds / std::max(first, 1e-6)) + 1, 1, kMaxCallsPerBatch);
  std::vector<double> per_call;
  for (int rep = 0; rep < kReps; ++rep) {
    per_call.push_back(time_calls(op, calls) / static_cast<double>(calls));
  }
  std::sort(per_call.begin(), per_call.end());
  t.seconds = per_call[per_call.size() / 2];
  t.timed_calls = 1 + kReps * calls;
  return t;
}

// ---------------------------------------------------------------------------------------
// Shapes, work and bounds.

// Heads of each group: H / G, the extra H % G going to the first groups (fixed variant) or
// the last ones (original variant), as in docs/dilated-attention.md.
std::vector<int64_t> group_heads(int64_t heads, DilationVariant variant) {
  const int64_t groups = static_cast<int64_t>(kSegmentLengths.size());
  std::vector<int64_t> result;
  for (int64_t g = 0; g < groups; ++g) {
    const bool extra = variant == DilationVariant::kSegmentLocal ? g < heads % groups
                                                                 : g >= groups - heads % groups;
    result.push_back(heads / groups + (extra ? 1 : 0));
  }
  return result;
}

double attended_pairs(int64_t n, bool causal) {
  const double rows = static_cast<double>(n);
  return causal ? rows * (rows + 1.0) / 2.0 : rows * rows;
}

// Attention FLOPs of one call (see the counters above). N is a multiple of every w_i here.
double attention_flops(const RowSpec& s) {
  const std::vector<int64_t> heads = group_heads(s.config.heads, s.variant);
  double flops = 0.0;
  for (size_t i = 0; i < heads.size(); ++i) {
    if (s.variant == DilationVariant::kGlobal) {
      flops += static_cast<double>(heads[i]) * attended_pairs(s.seq_len, s.causal);
    } else {
      const int64_t segments = s.seq_len / kSegmentLengths[i];
      const int64_t n = kSegmentLengths[i] / kDilationRates[i];
      flops += static_cast<double>(heads[i] * segments) * attended_pairs(n, s.causal);
    }
  }
  flops *= 4.0 * static_cast<double>(s.config.head_dim);
  return backward_of(s) ? 3.5 * flops : flops;
}

int64_t bound_bytes(const RowSpec& s) {
  const int64_t elements = s.seq_len * s.config.heads * s.config.head_dim;
  const int64_t tensors = backward_of(s) ? 8 : 4;  // q, k, v, out (and their gradients)
  return tensors * elements * 2 + s.config.heads * s.seq_len * 4;
}

const char* variant_name(DilationVariant v) {
  return v == DilationVariant::kSegmentLocal ? "fixed" : "original";
}
const char* direction_name(Direction d) { return d == Direction::kForward ? "fwd" : "fwdbwd"; }
std::string config_name(const HeadConfig& c) { return rd::str_cat("H", c.heads, "D", c.head_dim); }
const char* mask_name(bool causal) { return causal ? "causal" : "dense"; }

// The row's name without N: the family whose earlier N predicts the cost of the next.
std::string family_of(const RowSpec& s) {
  return rd::str_cat(variant_name(s.variant), "/", direction_name(s.direction), "/",
                     config_name(s.config), "/", mask_name(s.causal), "/",
                     rd::nn::path_name(s.path), s.hilbert ? "/hilbert" : "");
}

// Seconds per call measured for the largest N so far, per family.
std::map<std::string, std::pair<int64_t, double>>& measured_history() {
  static auto* const history = new std::map<std::string, std::pair<int64_t, double>>();
  return *history;
}

// The expected seconds per call: the last measurement of the family scaled by its work,
// else the work at a rate that is optimistic for the path (the math path, and use_hilbert,
// which may fall back to it, run at well under 1 TFLOP/s).
double predicted_seconds(const RowSpec& s, std::string* basis) {
  const auto& history = measured_history();
  const auto it = history.find(family_of(s));
  if (it != history.end()) {
    RowSpec previous = s;
    previous.seq_len = it->second.first;
    *basis = rd::str_cat("measured ", it->second.second, " s at N=", it->second.first);
    return it->second.second * attention_flops(s) / attention_flops(previous);
  }
  const double rate = s.path == AttentionPath::kMath || s.hilbert ? 5e11 : 4e14;
  *basis = rd::str_cat("no earlier N measured; FLOPs at ", rate * 1e-12, " TFLOP/s");
  return attention_flops(s) / rate;
}

rd::TensorOptions bf16(bool requires_grad = false) {
  return rd::TensorOptions(DType::kBFloat16)
      .with_device(device())
      .with_requires_grad(requires_grad);
}

rd::nn::DilatedAttentionOptions options_of(const RowSpec& s) {
  rd::nn::DilatedAttentionOptions o;
  o.segment_lengths = kSegmentLengths;
  o.dilation_rates = kDilationRates;
  o.variant = s.variant;
  o.causal = s.causal;
  o.use_hilbert = s.hilbert;
  o.path = s.path;
  o.mixing = s.mixing;
  return o;
}

std::string error_text(const std::exception& error) {
  const auto* rd_error = dynamic_cast<const rd::Error*>(&error);
  if (rd_error != nullptr && rd_error->code() == rd::ErrorCode::kOutOfMemory) {
    return rd::str_cat("out of memory: ", error.what());
  }
  return error.what();
}

// Runs `body` (which fills `state`'s counters and returns the time per call), then the one
// benchmark iteration; any error skips the row with its message. Memory is released either
// way.
void run_guarded(benchmark::State& state, const std::function<double()>& body) {
  if (!have_cuda_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  double seconds = 0.0;
  try {
    RD_CUDA_CHECK(cudaSetDevice(kDevice));
    seconds = body();
  } catch (const std::exception& error) {
    release_memory();
    state.SkipWithError(error_text(error).c_str());
    return;
  }
  release_memory();
  for (auto _ : state) state.SetIterationTime(seconds);
}

// ---------------------------------------------------------------------------------------
// Dilated attention rows.

struct DilatedResult {
  Timing timing;
  AttentionPath path_used = AttentionPath::kAuto;
};

// One row's call on fresh random inputs: forward alone (no graph), or forward + backward
// into q, k and v through autograd.
// kv_heads: key/value heads (grouped-query attention); 0: as many as the query heads.
DilatedResult measure_dilated(const RowSpec& s, uint64_t seed = 1, int64_t kv_heads = 0,
                              const rd::nn::DocumentStarts* documents = nullptr) {
  rd::Generator generator(seed);
  const bool backward = backward_of(s);
  const rd::Shape shape{1, s.seq_len, s.config.heads, s.config.head_dim};
  const rd::Shape kv_shape{1, s.seq_len, kv_heads > 0 ? kv_heads : s.config.heads,
                           s.config.head_dim};
  const Tensor q = rd::randn(shape, generator, bf16(backward));
  const Tensor k = rd::randn(kv_shape, generator, bf16(backward));
  const Tensor v = rd::randn(kv_shape, generator, bf16(backward));
  const Tensor grad_out = backward ? rd::randn(shape, generator, bf16()) : Tensor();
  const rd::nn::DilatedAttentionOptions options = options_of(s);
  rd::nn::AttentionCallContext context;
  context.document_starts = documents;
  DilatedResult result;
  auto drop_grads = [&] {
    for (Tensor t : {q, k, v}) t.zero_grad();
  };
  auto op = [&] {
    if (!backward) {
      rd::autograd::NoGradGuard no_grad;
      result.path_used = rd::nn::dilated_attention_with_lse(q, k, v, options, context).path_used;
      return;
    }
    drop_grads();
    const rd::nn::DilatedAttentionResult r =
        rd::nn::dilated_attention_with_lse(q, k, v, options, context);
    result.path_used = r.path_used;
    r.out.backward(grad_out);
  };
  result.timing = measure(op, drop_grads);
  return result;
}

void set_throughput_counters(benchmark::State& state, const RowSpec& s, double seconds) {
  state.counters["tokens_per_s"] = static_cast<double>(s.seq_len) / seconds;
  state.counters["tflops"] = attention_flops(s) / seconds * 1e-12;
}

void set_memory_counters(benchmark::State& state, const RowSpec& s, const Timing& t) {
  const int64_t bound = bound_bytes(s);
  state.counters["held_bytes"] = static_cast<double>(t.held_bytes);
  state.counters["peak_bytes"] = static_cast<double>(t.peak_bytes);
  state.counters["peak_delta_bytes"] = static_cast<double>(t.peak_bytes - t.held_bytes);
  state.counters["bound_bytes"] = static_cast<double>(bound);
  state.counters["mem_ratio"] = static_cast<double>(t.peak_bytes) / static_cast<double>(bound);
}

void set_timing_counters(benchmark::State& state, const Timing& t) {
  state.counters["warmup_s"] = t.warmup_seconds;
  state.counters["calls"] = static_cast<double>(t.timed_calls);
}

void dilated_row(benchmark::State& state, const RowSpec& s) {
  std::string basis;
  const double predicted = predicted_seconds(s, &basis);
  if (predicted > kTimeCapSeconds) {
    const std::string why = rd::str_cat(
        "time cap: a call would take about ", predicted, " s (", basis, ") > ", kTimeCapSeconds,
        " s; not run",
        s.variant == DilationVariant::kGlobal ? " (the original variant is O(N^2))" : "");
    state.SkipWithError(why.c_str());
    return;
  }
  run_guarded(state, [&] {
    const DilatedResult r = measure_dilated(s);
    measured_history()[family_of(s)] = {s.seq_len, r.timing.seconds};
    set_throughput_counters(state, s, r.timing.seconds);
    set_memory_counters(state, s, r.timing);
    set_timing_counters(state, r.timing);
    state.SetLabel(
        rd::str_cat("path=", rd::nn::path_name(r.path_used), backward_of(s) ? " (fwd)" : "")
            .c_str());
    return r.timing.seconds;
  });
}

// ---------------------------------------------------------------------------------------
// The dense-SDPA ceiling: per pair, the packed contiguous batch through cuDNN directly.

rd::kernels::StridedView view_of(const Tensor& t) { return rd::kernel_view(t, "ceiling"); }

struct PackedPair {
  Tensor q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v;
  rd::kernels::AttentionForwardArgs forward;
  rd::kernels::AttentionBackwardArgs backward;
};

// Pair i's packed batch [N / w_i, H_i, w_i / r_i, D] for the fixed variant's head groups.
std::vector<PackedPair> packed_pairs(const RowSpec& s, rd::Generator& generator) {
  const std::vector<int64_t> heads = group_heads(s.config.heads, DilationVariant::kSegmentLocal);
  std::vector<PackedPair> pairs(heads.size());
  for (size_t i = 0; i < heads.size(); ++i) {
    PackedPair& p = pairs[i];
    const int64_t n = kSegmentLengths[i] / kDilationRates[i];
    const rd::Shape shape{s.seq_len / kSegmentLengths[i], heads[i], n, s.config.head_dim};
    p.q = rd::randn(shape, generator, bf16());
    p.k = rd::randn(shape, generator, bf16());
    p.v = rd::randn(shape, generator, bf16());
    p.out = rd::empty(shape, bf16());
    p.lse = rd::empty({shape[0], shape[1], shape[2]},
                      rd::TensorOptions(DType::kFloat32).with_device(device()));
    p.forward.q = view_of(p.q);
    p.forward.k = view_of(p.k);
    p.forward.v = view_of(p.v);
    p.forward.out = view_of(p.out);
    p.forward.lse = view_of(p.lse);
    p.forward.params.scale = 1.0 / std::sqrt(static_cast<double>(s.config.head_dim));
    p.forward.params.causal = s.causal;
    if (!backward_of(s)) continue;
    p.grad_out = rd::randn(shape, generator, bf16());
    p.grad_q = rd::zeros(shape, bf16());
    p.grad_k = rd::zeros(shape, bf16());
    p.grad_v = rd::zeros(shape, bf16());
    rd::kernels::AttentionBackwardArgs& b = p.backward;
    b.q = p.forward.q;
    b.k = p.forward.k;
    b.v = p.forward.v;
    b.out = p.forward.out;
    b.lse = p.forward.lse;
    b.grad_out = view_of(p.grad_out);
    b.grad_q = view_of(p.grad_q);
    b.grad_k = view_of(p.grad_k);
    b.grad_v = view_of(p.grad_v);
    b.params = p.forward.params;
  }
  return pairs;
}

// The ceiling's time per call (all pairs), refusing to stand in with another kernel.
Timing measure_ceiling(const RowSpec& s) {
  rd::Generator generator(7);
  const std::vector<PackedPair> pairs = packed_pairs(s, generator);
  rd::kernels::KernelBackend& backend = rd::backend_for(device());
  const bool backward = backward_of(s);
  for (const PackedPair& p : pairs) {
    std::string why_not;
    RD_CHECK(backend.attention_supports(rd::kernels::AttentionKernel::kCudnn, p.forward,
                                        backward ? &p.backward : nullptr, &why_not),
             kUnimplemented, "dense ceiling: cuDNN cannot run it: ", why_not);
  }
  auto op = [&] {
    for (const PackedPair& p : pairs) {
      backend.attention_forward(rd::kernels::AttentionKernel::kCudnn, p.forward);
      if (backward) backend.attention_backward(rd::kernels::AttentionKernel::kCudnn, p.backward);
    }
  };
  return measure(op, [] {});
}

void ceiling_row(benchmark::State& state, const RowSpec& s) {
  run_guarded(state, [&] {
    const Timing t = measure_ceiling(s);
    set_throughput_counters(state, s, t.seconds);
    set_timing_counters(state, t);
    state.SetLabel("path=cudnn (direct, packed contiguous batch)");
    return t.seconds;
  });
}

// ---------------------------------------------------------------------------------------
// MultiheadDilatedAttention in bf16 (default pairs, fixed variant, kAuto, non-causal).

struct MhdaResult {
  Timing timing;
  AttentionPath path_used = AttentionPath::kAuto;
};

MhdaResult measure_mhda(int64_t seq_len, bool input_grad) {
  constexpr int64_t kEmbed = 768, kHeads = 12;
  rd::nn::MultiheadOptions module_options;
  module_options.bias = true;
  module_options.tensor_options = bf16();
  rd::nn::DilatedAttentionOptions options;
  options.segment_lengths = kSegmentLengths;
  options.dilation_rates = kDilationRates;
  rd::Generator init(3);
  rd::nn::MultiheadDilatedAttention module(kEmbed, kHeads, options, init, module_options);
  rd::Generator generator(11);
  const Tensor x = rd::randn({1, seq_len, kEmbed}, generator, bf16(input_grad));
  const Tensor grad_y = rd::randn({1, seq_len, kEmbed}, generator, bf16());
  const std::vector<Tensor> parameters = module.parameters();
  auto drop_grads = [&] {
    for (Tensor p : parameters) p.zero_grad();
    if (input_grad) Tensor(x).zero_grad();
  };
  auto op = [&] {
    drop_grads();
    module.forward(x).backward(grad_y);
  };
  MhdaResult result;
  result.timing = measure(op, drop_grads);
  result.path_used = module.last_path();
  return result;
}

void set_mhda_counters(benchmark::State& state, int64_t seq_len, const Timing& t) {
  state.counters["tokens_per_s"] = static_cast<double>(seq_len) / t.seconds;
  state.counters["held_bytes"] = static_cast<double>(t.held_bytes);
  state.counters["peak_bytes"] = static_cast<double>(t.peak_bytes);
  state.counters["peak_delta_bytes"] = static_cast<double>(t.peak_bytes - t.held_bytes);
  set_timing_counters(state, t);
}

void mhda_row(benchmark::State& state, int64_t seq_len, bool input_grad) {
  run_guarded(state, [&] {
    const MhdaResult r = measure_mhda(seq_len, input_grad);
    set_mhda_counters(state, seq_len, r.timing);
    state.SetLabel(rd::str_cat("path=", rd::nn::path_name(r.path_used),
                               input_grad ? ", input gradient too" : ", parameter gradients only")
                       .c_str());
    return r.timing.seconds;
  });
}

// ---------------------------------------------------------------------------------------
// Issue 4's targets (H100, bf16, D=128, N=256K, fixed, head groups, non-causal).

RowSpec target_spec(Direction direction, AttentionPath path) {
  RowSpec s;
  s.variant = DilationVariant::kSegmentLocal;
  s.direction = direction;
  s.config = kTargetConfig;
  s.seq_len = kTargetSeqLen;
  s.causal = false;
  s.path = path;
  return s;
}

void set_target(benchmark::State& state, double ratio, double target, bool at_most) {
  state.counters["ratio"] = ratio;
  state.counters["target"] = target;
  state.counters["target_max"] = at_most ? 1.0 : 0.0;
}

// (a) kAuto forward + backward within 1.2x of the dense-SDPA ceiling.
void target_auto_vs_ceiling(benchmark::State& state) {
  run_guarded(state, [&] {
    const RowSpec s = target_spec(Direction::kForwardBackward, AttentionPath::kAuto);
    const DilatedResult r = measure_dilated(s);
    release_memory();
    const Timing ceiling = measure_ceiling(s);
    set_throughput_counters(state, s, r.timing.seconds);
    state.counters["ceiling_s"] = ceiling.seconds;
    set_target(state, r.timing.seconds / ceiling.seconds, 1.2, /*at_most=*/true);
    state.SetLabel(rd::str_cat("path=", rd::nn::path_name(r.path_used),
                               " (fwd); ratio = auto fwd+bwd time / dense-SDPA ceiling time")
                       .c_str());
    return r.timing.seconds;
  });
}

// (b) kFlash forward at >= 50% of cuDNN's forward rate.
void target_flash_vs_cudnn(benchmark::State& state) {
  run_guarded(state, [&] {
    const DilatedResult flash =
        measure_dilated(target_spec(Direction::kForward, AttentionPath::kFlash));
    release_memory();
    const RowSpec cudnn_spec = target_spec(Direction::kForward, AttentionPath::kCudnn);
    const DilatedResult cudnn = measure_dilated(cudnn_spec);
    set_throughput_counters(state, cudnn_spec, flash.timing.seconds);
    state.counters["cudnn_s"] = cudnn.timing.seconds;
    set_target(state, cudnn.timing.seconds / flash.timing.seconds, 0.5, /*at_most=*/false);
    state.SetLabel(rd::str_cat("paths used: flash row ", rd::nn::path_name(flash.path_used),
                               ", cudnn row ", rd::nn::path_name(cudnn.path_used),
                               "; ratio = flash rate / cudnn rate")
                       .c_str());
    return flash.timing.seconds;
  });
}

// (c) Fixed-variant forward + backward peak memory within 1.1x of the bound.
void target_peak_memory(benchmark::State& state) {
  run_guarded(state, [&] {
    const RowSpec s = target_spec(Direction::kForwardBackward, AttentionPath::kAuto);
    const DilatedResult r = measure_dilated(s);
    set_throughput_counters(state, s, r.timing.seconds);
    set_memory_counters(state, s, r.timing);
    set_target(state,
               static_cast<double>(r.timing.peak_bytes) / static_cast<double>(bound_bytes(s)), 1.1,
               /*at_most=*/true);
    state.SetLabel(rd::str_cat("path=", rd::nn::path_name(r.path_used),
                               " (fwd); ratio = allocator peak / (q,k,v,out + grads + lse)")
                       .c_str());
    return r.timing.seconds;
  });
}

// Issue 21: a grouped-query call (H = 16, H_kv = 4 or 1) no slower than the same call with
// H_kv = 16, forward + backward, kAuto; both measured in this row, in the order full, grouped,
// grouped, full (each side's time the mean of its two), so that a drift of the GPU's clock
// over the row weighs on both sides alike (measured full then grouped, the ratio spread
// 0.97-1.03 over five runs).
// The forward alone (gqa/fwd rows) has no target: it tells whether a gap lies in the forward or
// in the backward's shared dK/dV.
void target_gqa(benchmark::State& state, int64_t kv_heads, Direction direction, bool causal) {
  run_guarded(state, [&] {
    RowSpec s = target_spec(direction, AttentionPath::kAuto);
    s.causal = causal;
    double full_s = 0, grouped_s = 0;
    DilatedResult grouped;
    for (const bool grouped_call : {false, true, true, false}) {
      const DilatedResult r = measure_dilated(s, 1, grouped_call ? kv_heads : 0);
      release_memory();
      (grouped_call ? grouped_s : full_s) += r.timing.seconds / 2;
      if (grouped_call) grouped = r;
    }
    set_throughput_counters(state, s, grouped_s);
    state.counters["full_heads_s"] = full_s;
    const double ratio = grouped_s / full_s;
    if (direction == Direction::kForwardBackward && !causal) {
      set_target(state, ratio, 1.0, /*at_most=*/true);
    } else {
      state.counters["ratio"] = ratio;
    }
    state.SetLabel(rd::str_cat("path: grouped ", rd::nn::path_name(grouped.path_used),
                               "; ratio = grouped time / H_kv = 16 time (ABBA means)")
                       .c_str());
    return grouped_s;
  });
}

// One side of target_gqa alone (kv_heads 16: the full-heads side), for a kernel trace of
// either (tools/cupti_trace.cc); the ratio comes from the target row, not from these.
void gqa_alone(benchmark::State& state, int64_t kv_heads) {
  run_guarded(state, [&] {
    const RowSpec s = target_spec(Direction::kForwardBackward, AttentionPath::kAuto);
    const DilatedResult r = measure_dilated(s, 1, kv_heads == s.config.heads ? 0 : kv_heads);
    set_throughput_counters(state, s, r.timing.seconds);
    // Every call of the row, the warm-up's included: what a trace of it divides by.
    state.counters["calls_run"] = static_cast<double>(r.timing.timed_calls + 1);
    state.counters["held_bytes"] = static_cast<double>(r.timing.held_bytes);
    state.counters["peak_bytes"] = static_cast<double>(r.timing.peak_bytes);
    state.SetLabel(rd::str_cat("path=", rd::nn::path_name(r.path_used)).c_str());
    return r.timing.seconds;
  });
}

// Issue 21's document-mask target: documents of random lengths, uniform in [1, w / 2 - 1]
// for the longest segment w (a mean of a quarter of it), packed over the sequence; the
// masked call against the same call without documents, measured in the same row. With
// kv_heads > 0 both calls are grouped-query ones, and `mixing` all heads mixes every head
// on every pair (rd_train's default), on both sides (no target: the rows tell whether those
// keep the documents' cost).
void target_documents(benchmark::State& state, bool causal, int64_t kv_heads = 0,
                      rd::nn::HeadMixing mixing = rd::nn::HeadMixing::kHeadGroups) {
  run_guarded(state, [&] {
    RowSpec s = target_spec(Direction::kForwardBackward, AttentionPath::kAuto);
    s.causal = causal;
    s.mixing = mixing;
    const int64_t longest = kSegmentLengths.back();
    std::mt19937_64 rng(7);
    std::vector<int64_t> starts;
    for (int64_t at = 0; at < s.seq_len;
         at += 1 + static_cast<int64_t>(rng() % (longest / 2 - 1))) {
      starts.push_back(at);
    }
    const rd::nn::DocumentStarts documents = {starts};
    const DilatedResult unmasked = measure_dilated(s, 1, kv_heads);
    release_memory();
    const DilatedResult masked = measure_dilated(s, 1, kv_heads, &documents);
    set_throughput_counters(state, s, masked.timing.seconds);
    state.counters["unmasked_s"] = unmasked.timing.seconds;
    state.counters["documents"] = static_cast<double>(starts.size());
    const double ratio = masked.timing.seconds / unmasked.timing.seconds;
    if (kv_heads == 0 && mixing == rd::nn::HeadMixing::kHeadGroups) {
      set_target(state, ratio, 1.15, /*at_most=*/true);
    } else {
      state.counters["ratio"] = ratio;
    }
    state.SetLabel(rd::str_cat(starts.size(), " documents; paths: masked ",
                               rd::nn::path_name(masked.path_used), ", unmasked ",
                               rd::nn::path_name(unmasked.path_used),
                               "; ratio = masked time / unmasked time")
                       .c_str());
    return masked.timing.seconds;
  });
}

// (d) MultiheadDilatedAttention(E=768, H=12) forward + backward in bf16 at N = 4,194,304.
void target_mhda(benchmark::State& state) {
  run_guarded(state, [&] {
    const MhdaResult r = measure_mhda(kMhdaTargetSeqLen, /*input_grad=*/true);
    set_mhda_counters(state, kMhdaTargetSeqLen, r.timing);
    set_target(state, 1.0, 1.0, /*at_most=*/false);  // ratio 1: it ran (else: skipped)
    state.SetLabel(rd::str_cat("path=", rd::nn::path_name(r.path_used),
                               "; ran with parameter and input gradients")
                       .c_str());
    return r.timing.seconds;
  });
}

// ---------------------------------------------------------------------------------------
// Registration.

void add(const std::string& name, std::function<void(benchmark::State&)> fn) {
  benchmark::RegisterBenchmark(name.c_str(), [fn](benchmark::State& state) { fn(state); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(1);
}

std::string dilated_name(const RowSpec& s) {
  return rd::str_cat("dilated/", variant_name(s.variant), "/", direction_name(s.direction), "/",
                     config_name(s.config), "/N", s.seq_len, "/", mask_name(s.causal), "/",
                     rd::nn::path_name(s.path));
}

bool runs_on_path(const RowSpec& s) {
  if (s.path == AttentionPath::kMath && s.seq_len > kMathMaxSeqLen) return false;
  return s.variant == DilationVariant::kSegmentLocal || s.path == AttentionPath::kAuto ||
         s.seq_len <= kOriginalForcedMaxSeqLen;
}

void add_rows() {
  const AttentionPath paths[] = {AttentionPath::kAuto, AttentionPath::kCudnn, AttentionPath::kFlash,
                                 AttentionPath::kMath};
  const Direction directions[] = {Direction::kForward, Direction::kForwardBackward};
  // Original vs fixed, every path; N increases within a family (the time cap predicts from
  // the previous N).
  for (DilationVariant variant : {DilationVariant::kSegmentLocal, DilationVariant::kGlobal}) {
    for (Direction direction : directions) {
      for (const HeadConfig& config : kConfigs) {
        for (bool causal : {false, true}) {
          for (AttentionPath path : paths) {
            for (int64_t seq_len : kSeqLens) {
              const RowSpec s{variant, direction, config, seq_len, causal, path, false};
              if (!runs_on_path(s)) continue;
              add(dilated_name(s), [s](benchmark::State& state) { dilated_row(state, s); });
            }
          }
        }
      }
    }
  }
  // The ceiling on the same shapes.
  for (Direction direction : directions) {
    for (const HeadConfig& config : kConfigs) {
      for (bool causal : {false, true}) {
        for (int64_t seq_len : kSeqLens) {
          const RowSpec s{DilationVariant::kSegmentLocal, direction, config, seq_len, causal,
                          AttentionPath::kCudnn,          false};
          add(rd::str_cat("dense_ceiling/", direction_name(direction), "/", config_name(config),
                          "/N", seq_len, "/", mask_name(causal), "/cudnn"),
              [s](benchmark::State& state) { ceiling_row(state, s); });
        }
      }
    }
  }
  // Every head on every pair (rd_train's default mixing): the pairs' partials merged through
  // the LSE, at the target shape.
  for (Direction direction : directions) {
    for (bool causal : {false, true}) {
      RowSpec s{DilationVariant::kSegmentLocal, direction, kTargetConfig, kTargetSeqLen, causal,
                AttentionPath::kAuto,           false};
      s.mixing = rd::nn::HeadMixing::kAllHeads;
      add(rd::str_cat("allheads/", direction_name(direction), "/", config_name(kTargetConfig), "/N",
                      kTargetSeqLen, "/", mask_name(causal), "/auto"),
          [s](benchmark::State& state) { dilated_row(state, s); });
    }
  }
  // use_hilbert against the same rows without it.
  for (bool hilbert : {false, true}) {
    for (Direction direction : directions) {
      for (AttentionPath path : paths) {
        const RowSpec s{DilationVariant::kSegmentLocal,
                        direction,
                        kTargetConfig,
                        kHilbertSeqLen,
                        false,
                        path,
                        hilbert};
        add(rd::str_cat("hilbert/", hilbert ? "on" : "off", "/", direction_name(direction), "/",
                        config_name(kTargetConfig), "/N", kHilbertSeqLen, "/dense/",
                        rd::nn::path_name(path)),
            [s](benchmark::State& state) { dilated_row(state, s); });
      }
    }
  }
  // The multihead module below the target length (the target row runs N = 4,194,304).
  for (int64_t seq_len : {int64_t{1048576}, int64_t{2097152}}) {
    add(rd::str_cat("mhda/fwdbwd/E768H12/N", seq_len, "/dx"),
        [seq_len](benchmark::State& state) { mhda_row(state, seq_len, true); });
  }
  add(rd::str_cat("mhda/fwdbwd/E768H12/N", kMhdaTargetSeqLen, "/no_dx"),
      [](benchmark::State& state) { mhda_row(state, kMhdaTargetSeqLen, false); });
  const std::string shape =
      rd::str_cat("/", config_name(kTargetConfig), "/N", kTargetSeqLen, "/dense");
  add("target/auto_fwdbwd_over_ceiling" + shape, target_auto_vs_ceiling);
  add("target/flash_over_cudnn_fwd_rate" + shape, target_flash_vs_cudnn);
  add("target/fixed_fwdbwd_peak_over_bound" + shape, target_peak_memory);
  add(rd::str_cat("target/mhda_fwdbwd_runs/E768H12/N", kMhdaTargetSeqLen), target_mhda);
  const std::string causal_shape =
      rd::str_cat("/", config_name(kTargetConfig), "/N", kTargetSeqLen, "/causal");
  for (int64_t kv_heads : {4, 1}) {
    add(rd::str_cat("target/gqa_fwdbwd_over_mha" + shape, "/KV", kv_heads),
        [kv_heads](benchmark::State& state) {
          target_gqa(state, kv_heads, Direction::kForwardBackward, false);
        });
    add(rd::str_cat("gqa/fwd_over_mha" + shape, "/KV", kv_heads),
        [kv_heads](benchmark::State& state) {
          target_gqa(state, kv_heads, Direction::kForward, false);
        });
    add(rd::str_cat("gqa/fwdbwd_over_mha" + causal_shape, "/KV", kv_heads),
        [kv_heads](benchmark::State& state) {
          target_gqa(state, kv_heads, Direction::kForwardBackward, true);
        });
  }
  for (int64_t kv_heads : {16, 4, 1}) {
    add(rd::str_cat("gqa/fwdbwd_alone" + shape, "/KV", kv_heads),
        [kv_heads](benchmark::State& state) { gqa_alone(state, kv_heads); });
  }
  for (bool causal : {false, true}) {
    add(rd::str_cat("target/documents_fwdbwd_over_unmasked/", config_name(kTargetConfig), "/N",
                    kTargetSeqLen, "/", mask_name(causal)),
        [causal](benchmark::State& state) { target_documents(state, causal); });
    add(rd::str_cat("documents/gqa_fwdbwd_over_unmasked/", config_name(kTargetConfig), "/N",
                    kTargetSeqLen, "/", mask_name(causal), "/KV4"),
        [causal](benchmark::State& state) { target_documents(state, causal, 4); });
    add(rd::str_cat("documents/allheads_fwdbwd_over_unmasked/", config_name(kTargetConfig), "/N",
                    kTargetSeqLen, "/", mask_name(causal)),
        [causal](benchmark::State& state) {
          target_documents(state, causal, 0, rd::nn::HeadMixing::kAllHeads);
        });
  }
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
  std::cerr << "cuda_dilated_attention_bench: this build has no CUDA backend; no benchmark is "
               "registered\n";
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
