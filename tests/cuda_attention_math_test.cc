// GPU tests of the CUDA math attention (kernels/cuda/attention.h) against the CPU kernel
// (kernels/cpu/attention.h, itself checked against a float64 reference in
// attention_kernel_test.cc) on the same inputs and memory layouts. GPU outputs are poisoned
// (NaN bytes) before every run so that an unwritten element fails; gradients start from
// random values (the kernels accumulate); memory outside the views must stay as it was.
//
// Tolerance: 4 units of the stored dtype's rounding on |value| (and on the value an
// accumulated gradient started from), plus 8 (D + 16) units of the compute type's rounding
// on the largest |result| of the tensor: the CPU and the GPU sum in different orders.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/cpu/attention.h"
#include "testing/attention_operands.h"
#include "testing/dtype_precision.h"
#include "testing/elementwise_close.h"
#include "testing/host_views.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/cuda/attention.h"
#include "ringdilated/tensor/device.h"
#include "testing/cuda_scratch_allocator.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd::kernels {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudaAttentionMathTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

using Shape = std::vector<int64_t>;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                 DType::kFloat16};

using test::AttentionLayout;
using test::AttentionValues;
using test::compute_roundoff;
using test::concat;
using test::cuda_check;
using test::CudaTestAllocator;
using test::dtype_tag;
using test::expect_untouched_outside;
using test::fill_extreme;
using test::make_operand;
using test::Operand;
using test::read_view;
using test::Role;
using test::signed_tag;
using test::Style;
using test::style_for;
using test::tiny_step;
using test::unit_roundoff;
using test::write_view;

// ---------------------------------------------------------------------------------------
// Device copies of host operands.

// A device copy of an operand's whole buffer, and the view rebased onto it.
class DeviceOperand {
 public:
  explicit DeviceOperand(const Operand& host) : size_(host.buffer.size_bytes()), view_(host.view) {
    cuda_check(cudaMalloc(&base_, std::max<size_t>(size_, 1)), "cudaMalloc");
    cuda_check(cudaMemcpy(base_, host.buffer.data(), size_, cudaMemcpyHostToDevice), "upload");
    if (host.view.data != nullptr) {
      view_.data = static_cast<unsigned char*>(base_) +
                   (static_cast<const unsigned char*>(host.view.data) - host.buffer.data());
    }
  }
  ~DeviceOperand() { cudaFree(base_); }
  DeviceOperand(const DeviceOperand&) = delete;
  DeviceOperand& operator=(const DeviceOperand&) = delete;

  const StridedView& view() const { return view_; }
  // Copies the device buffer into `host` (same layout).
  void download(Operand& host) const {
    cuda_check(cudaMemcpy(host.buffer.data(), base_, size_, cudaMemcpyDeviceToHost), "download");
  }

 private:
  void* base_ = nullptr;
  size_t size_;
  StridedView view_;
};

// A device copy of an int64 list (a key visiting order).
class DeviceIndices {
 public:
  explicit DeviceIndices(const std::vector<int64_t>& host) {
    const size_t bytes = host.size() * sizeof(int64_t);
    cuda_check(cudaMalloc(&data_, std::max<size_t>(bytes, 1)), "cudaMalloc");
    cuda_check(cudaMemcpy(data_, host.data(), bytes, cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceIndices() { cudaFree(data_); }
  DeviceIndices(const DeviceIndices&) = delete;
  DeviceIndices& operator=(const DeviceIndices&) = delete;
  const int64_t* data() const { return static_cast<const int64_t*>(data_); }

 private:
  void* data_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// Comparison.

// Expects the GPU's values inside the view close to the CPU's (see the file comment) and the
// GPU buffer unchanged outside the view (`before`: its bytes before the run).
void expect_matches_cpu(const std::string& what, const Operand& gpu, const Operand& cpu,
                        const std::vector<unsigned char>& before, DType compute_dtype,
                        int64_t d, const std::vector<double>* start = nullptr) {
  const std::vector<double> got = read_view(gpu.view), want = read_view(cpu.view);
  const DType stored = gpu.view.dtype;
  double scale = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    if (!std::isinf(want[e])) scale = std::max(scale, std::fabs(want[e] - (start ? (*start)[e] : 0)));
  }
  const double u = unit_roundoff(stored), spread = 8.0 * (d + 16) * compute_roundoff(compute_dtype) * scale;
  test::expect_elementwise_close(
      what, got, want,
      [&](size_t e) {
        return 4 * u * (std::fabs(want[e]) + (start ? std::fabs((*start)[e]) : 0)) + spread +
               tiny_step(stored);
      },
      "gpu", "cpu");
  expect_untouched_outside(what, gpu, before);
}

// ---------------------------------------------------------------------------------------
// Cases.

// Larger sizes by default than the CPU test: several tiles of the GPU kernel.
using Case = test::AttentionCase</*kDefaultLq=*/37, /*kDefaultLk=*/45>;

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType t : kFloatTypes) {
    for (int64_t d : {16, 64, 128, 256, 300}) {  // 300: two passes over the keys
      cases.push_back({.name = dtype_tag(t) + "_d" + std::to_string(d), .dtype = t, .d = d});
    }
  }
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t offset : {0, 5, -7}) {
      cases.push_back({.name = dtype_tag(t) + "_causal_offset" + signed_tag(offset),
                       .dtype = t, .lq = 40, .lk = 70, .causal = true, .causal_offset = offset});
    }
  }
  cases.push_back({.name = "causal_every_row_masked", .causal = true, .causal_offset = -100});
  cases.push_back({.name = "no_keys", .lk = 0});
  cases.push_back({.name = "no_queries", .lq = 0});
  cases.push_back({.name = "no_batch", .batch = {}});
  cases.push_back({.name = "batch2x1x3", .batch = {2, 1, 3}});
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16}) {
    cases.push_back({.name = dtype_tag(t) + "_dropout", .dtype = t, .dropout = 0.3});
  }
  cases.push_back({.name = "bf16_causal_dropout", .dtype = DType::kBFloat16, .lq = 50, .lk = 40,
                   .causal = true, .causal_offset = 3, .dropout = 0.5});
  cases.push_back({.name = "bf16_float32_out_and_grads", .dtype = DType::kBFloat16,
                   .out_dtype = DType::kFloat32, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "f64_float32_grads", .dtype = DType::kFloat64, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "no_lse", .lse = false});
  cases.push_back({.name = "no_grad_lse", .dtype = DType::kFloat16, .grad_lse = false});
  cases.push_back({.name = "strided_f32", .batch = {2, 3}, .layout = AttentionLayout::kStrided});
  cases.push_back({.name = "strided_bf16_causal_dropout", .dtype = DType::kBFloat16, .d = 64,
                   .causal = true, .causal_offset = 2, .dropout = 0.2,
                   .layout = AttentionLayout::kStrided});
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16}) {
    cases.push_back({.name = "dilated_" + dtype_tag(t), .dtype = t, .batch = {2, 3, 2}, .lq = 40,
                     .lk = 40, .d = 32, .causal = t == DType::kFloat16,
                     .layout = AttentionLayout::kDilated});
  }
  cases.push_back({.name = "larger_bf16", .dtype = DType::kBFloat16, .batch = {2, 3}, .lq = 200,
                   .lk = 300, .d = 64, .causal = true, .causal_offset = 100, .dropout = 0.1});
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    cases.push_back({.name = "extreme_" + dtype_tag(t), .dtype = t, .scale = 1.0,
                     .values = AttentionValues::kExtreme});
  }
  for (DType t : kFloatTypes) {
    cases.push_back({.name = "key_order_" + dtype_tag(t), .dtype = t, .key_order = true});
  }
  cases.push_back({.name = "key_order_bf16_causal_dropout_d300", .dtype = DType::kBFloat16,
                   .lq = 60, .lk = 90, .d = 300, .causal = true, .causal_offset = -4,
                   .dropout = 0.2, .key_order = true});
  return cases;
}

class CudaAttentionMathTest : public test::CudaStreamTest,
                              public ::testing::WithParamInterface<Case> {};

TEST_P(CudaAttentionMathTest, MatchesTheCpuKernel) {
  const Case& c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(c.name));
  const DType out_dtype = c.out_dtype.value_or(c.dtype), grad_dtype = c.grad_dtype.value_or(c.dtype);
  const Shape q_shape = concat(c.batch, {c.lq, c.d}), k_shape = concat(c.batch, {c.lk, c.d});
  const Shape lse_shape = concat(c.batch, {c.lq});
  auto operand = [&](Role role, DType dtype, const Shape& shape) {
    return make_operand(dtype, shape, style_for(c.layout, role));
  };
  AttentionParams params;
  params.scale = c.scale.value_or(1 / std::sqrt(static_cast<double>(c.d)));
  params.causal = c.causal;
  params.causal_offset = c.causal_offset;
  params.dropout = c.dropout;
  params.seed = 0xfeedfacecafebeefull;
  params.offset = 1ull << 40;
  std::vector<int64_t> key_order(static_cast<size_t>(c.lk));
  std::iota(key_order.begin(), key_order.end(), int64_t{0});
  if (c.key_order) {
    std::shuffle(key_order.begin(), key_order.end(), rng);
    params.key_order = key_order.data();  // host memory for the CPU kernel
  }
  const DeviceIndices device_key_order(key_order);
  AttentionParams device_params = params;
  if (c.key_order) device_params.key_order = device_key_order.data();

  Operand q = operand(Role::kQ, c.dtype, q_shape), k = operand(Role::kK, c.dtype, k_shape);
  Operand v = operand(Role::kV, c.dtype, k_shape);
  q.buffer.fill_uniform(rng);
  k.buffer.fill_uniform(rng);
  v.buffer.fill_uniform(rng);
  if (c.values == AttentionValues::kExtreme) {
    fill_extreme(q.view, true);
    fill_extreme(k.view, false);
  }
  const DeviceOperand dq(q), dk(k), dv(v);

  // Forward: the CPU, then the GPU into poisoned memory.
  Operand cpu_out = operand(Role::kOut, out_dtype, q_shape);
  Operand cpu_lse = operand(Role::kLse, DType::kFloat32, lse_shape);
  AttentionForwardArgs args;
  args.q = q.view;
  args.k = k.view;
  args.v = v.view;
  args.out = cpu_out.view;
  if (c.lse) args.lse = cpu_lse.view;
  args.params = params;
  cpu::attention_forward(args);

  Operand gpu_out = cpu_out.clone(), gpu_lse = cpu_lse.clone();
  gpu_out.buffer.poison();
  gpu_lse.buffer.poison();
  const auto out_before = gpu_out.buffer.bytes(), lse_before = gpu_lse.buffer.bytes();
  {
    const DeviceOperand d_out(gpu_out), d_lse(gpu_lse);
    AttentionForwardArgs dargs = args;
    dargs.q = dq.view();
    dargs.k = dk.view();
    dargs.v = dv.view();
    dargs.out = d_out.view();
    dargs.lse = c.lse ? d_lse.view() : StridedView{};
    dargs.params = device_params;
    cuda::attention_math_forward(dargs, stream());
    sync();
    d_out.download(gpu_out);
    d_lse.download(gpu_lse);
  }
  expect_matches_cpu("out", gpu_out, cpu_out, out_before, c.dtype, c.d);
  if (c.lse) {
    expect_matches_cpu("lse", gpu_lse, cpu_lse, lse_before, c.dtype, c.d);
  } else {
    EXPECT_EQ(gpu_lse.buffer.bytes(), lse_before) << "lse was written though its data is null";
  }
  if (!c.lse) {  // the backward needs the lse
    args.lse = cpu_lse.view;
    cpu::attention_forward(args);
  }

  // Backward from the CPU's out and lse, into gradients that start from random values.
  Operand grad_out = operand(Role::kGradOut, out_dtype, q_shape);
  Operand grad_lse = operand(Role::kGradLse, DType::kFloat32, lse_shape);
  Operand cpu_gq = operand(Role::kGradQ, grad_dtype, q_shape);
  Operand cpu_gk = operand(Role::kGradK, grad_dtype, k_shape);
  Operand cpu_gv = operand(Role::kGradV, grad_dtype, k_shape);
  for (Operand* o : {&grad_out, &grad_lse, &cpu_gq, &cpu_gk, &cpu_gv}) o->buffer.fill_uniform(rng);
  Operand gpu_gq = cpu_gq.clone(), gpu_gk = cpu_gk.clone(), gpu_gv = cpu_gv.clone();
  const std::vector<double> start_q = read_view(cpu_gq.view), start_k = read_view(cpu_gk.view),
                            start_v = read_view(cpu_gv.view);
  const auto gq_before = gpu_gq.buffer.bytes(), gk_before = gpu_gk.buffer.bytes(),
             gv_before = gpu_gv.buffer.bytes();
  AttentionBackwardArgs bargs;
  bargs.q = q.view;
  bargs.k = k.view;
  bargs.v = v.view;
  bargs.out = cpu_out.view;
  bargs.lse = cpu_lse.view;
  bargs.grad_out = grad_out.view;
  if (c.grad_lse) bargs.grad_lse = grad_lse.view;
  bargs.grad_q = cpu_gq.view;
  bargs.grad_k = cpu_gk.view;
  bargs.grad_v = cpu_gv.view;
  bargs.params = params;
  cpu::attention_backward(bargs);
  {
    const DeviceOperand d_out(cpu_out), d_lse(cpu_lse), d_go(grad_out), d_gl(grad_lse);
    const DeviceOperand d_gq(gpu_gq), d_gk(gpu_gk), d_gv(gpu_gv);
    AttentionBackwardArgs dargs = bargs;
    dargs.q = dq.view();
    dargs.k = dk.view();
    dargs.v = dv.view();
    dargs.out = d_out.view();
    dargs.lse = d_lse.view();
    dargs.grad_out = d_go.view();
    dargs.grad_lse = c.grad_lse ? d_gl.view() : StridedView{};
    dargs.grad_q = d_gq.view();
    dargs.grad_k = d_gk.view();
    dargs.grad_v = d_gv.view();
    dargs.params = device_params;
    CudaTestAllocator scratch;
    cuda::attention_math_backward(dargs, scratch, stream());
    sync();
    EXPECT_EQ(scratch.stats().allocated_bytes, 0) << "scratch not returned";
    d_gq.download(gpu_gq);
    d_gk.download(gpu_gk);
    d_gv.download(gpu_gv);
  }
  expect_matches_cpu("grad_q", gpu_gq, cpu_gq, gq_before, c.dtype, c.d, &start_q);
  expect_matches_cpu("grad_k", gpu_gk, cpu_gk, gk_before, c.dtype, c.d, &start_k);
  expect_matches_cpu("grad_v", gpu_gv, cpu_gv, gv_before, c.dtype, c.d, &start_v);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaAttentionMathTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// With v the identity (Lk <= D), out[b, i, j] = p[i, j] * keep / (1 - dropout): the GPU
// drops exactly the elements the CPU drops. Two GPU runs give the same bits.
TEST(CudaAttentionMathDropoutTest, SameMaskAsTheCpuAndReproducible) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kLq = 50, kLk = 40, kD = 48;
  std::mt19937_64 rng(17);
  const Shape q_shape = {3, kLq, kD}, k_shape = {3, kLk, kD};
  Operand q = make_operand(DType::kFloat32, q_shape, Style::kPlain);
  Operand k = make_operand(DType::kFloat32, k_shape, Style::kPlain);
  Operand v = make_operand(DType::kFloat32, k_shape, Style::kPlain);
  q.buffer.fill_uniform(rng);
  k.buffer.fill_uniform(rng);
  std::vector<double> identity(v.buffer.count());
  for (int64_t e = 0; e < v.buffer.count(); ++e) identity[e] = (e / kD) % kLk == e % kD ? 1.0 : 0.0;
  write_view(v.view, identity);
  Operand cpu_out = make_operand(DType::kFloat32, q_shape, Style::kPlain);
  AttentionForwardArgs args;
  args.q = q.view;
  args.k = k.view;
  args.v = v.view;
  args.out = cpu_out.view;
  args.params.scale = 0.2;
  args.params.dropout = 0.4;
  args.params.seed = 1234567;
  args.params.offset = 0xffffffffull - 100;  // the counter crosses into its high word
  cpu::attention_forward(args);

  const DeviceOperand dq(q), dk(k), dv(v);
  std::vector<std::vector<unsigned char>> runs;
  for (int run = 0; run < 2; ++run) {
    Operand gpu_out = cpu_out.clone();
    gpu_out.buffer.poison();
    const DeviceOperand d_out(gpu_out);
    AttentionForwardArgs dargs = args;
    dargs.q = dq.view();
    dargs.k = dk.view();
    dargs.v = dv.view();
    dargs.out = d_out.view();
    cuda::attention_math_forward(dargs, nullptr);
    cuda_check(cudaDeviceSynchronize(), "sync");
    d_out.download(gpu_out);
    runs.push_back(gpu_out.buffer.bytes());
    const std::vector<double> got = read_view(gpu_out.view), want = read_view(cpu_out.view);
    int64_t mismatches = 0, dropped = 0;
    for (size_t e = 0; e < want.size(); ++e) {
      if (static_cast<int64_t>(e % kD) >= kLk) continue;  // columns past Lk are 0 anyway
      mismatches += (got[e] == 0) != (want[e] == 0);
      dropped += want[e] == 0;
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_GT(dropped, 0);
  }
  EXPECT_EQ(runs[0], runs[1]);
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::kernels
