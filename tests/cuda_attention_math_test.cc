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
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/cpu/attention.h"
#include "ringdilated/kernels/half.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/cuda/attention.h"
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

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

double unit_roundoff(DType t) {
  switch (t) {
    case DType::kFloat64: return std::ldexp(1.0, -53);
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}
double compute_roundoff(DType t) {
  return t == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}
double tiny_step(DType t) { return t == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0; }

int64_t product(const Shape& s) {
  int64_t n = 1;
  for (int64_t x : s) n *= x;
  return n;
}
Shape concat(Shape a, const Shape& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
Shape contiguous_strides(const Shape& shape) {
  Shape s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

// ---------------------------------------------------------------------------------------
// Host memory with views into it, and device copies of it.

double load_element(const unsigned char* p, DType t) {
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  switch (t) {
    case DType::kFloat32: return load(float{});
    case DType::kFloat64: return load(double{});
    case DType::kBFloat16: return static_cast<float>(load(BFloat16{}));
    case DType::kFloat16: return static_cast<float>(load(Float16{}));
    default: ADD_FAILURE() << "unexpected dtype"; return 0;
  }
}
void store_element(unsigned char* p, DType t, double v) {
  auto store = [p](auto x) { std::memcpy(p, &x, sizeof(x)); };
  switch (t) {
    case DType::kFloat32: return store(static_cast<float>(v));
    case DType::kFloat64: return store(v);
    case DType::kBFloat16: return store(BFloat16(static_cast<float>(v)));
    case DType::kFloat16: return store(Float16(static_cast<float>(v)));
    default: ADD_FAILURE() << "unexpected dtype";
  }
}

// A view and the host memory behind it (movable only: the view points into the buffer).
struct Operand {
  std::vector<unsigned char> bytes;
  StridedView view;
  Operand() = default;
  Operand(Operand&&) = default;
  Operand& operator=(Operand&&) = default;
  Operand(const Operand&) = delete;

  int64_t count() const { return static_cast<int64_t>(bytes.size() / dtype_size(view.dtype)); }
  void fill_uniform(std::mt19937_64& rng) {
    std::uniform_real_distribution<double> dist(-1, 1);
    for (int64_t e = 0; e < count(); ++e) store_element(&bytes[e * dtype_size(view.dtype)], view.dtype, dist(rng));
  }
  void poison() { std::fill(bytes.begin(), bytes.end(), 0xff); }
  // The same memory, a new buffer (same offsets and strides).
  Operand clone() const {
    Operand o;
    o.bytes = bytes;
    o.view = view;
    if (view.data != nullptr) {
      o.view.data = o.bytes.data() + (static_cast<const unsigned char*>(view.data) - bytes.data());
    }
    return o;
  }
};

enum class Style { kPlain, kTransposed, kReversedRows, kBroadcastFirst, kEveryOther, kDilated };
constexpr int64_t kDilation = 2, kDilationOffset = 1;

Operand make_operand(DType dtype, const Shape& shape, Style style) {
  const int n = static_cast<int>(shape.size());
  Shape strides = contiguous_strides(shape);
  int64_t offset = 0, count = product(shape);
  switch (style) {
    case Style::kPlain: break;
    case Style::kTransposed:
      if (n >= 2) {
        Shape stored = shape;
        std::swap(stored[n - 1], stored[n - 2]);
        strides = contiguous_strides(stored);
        std::swap(strides[n - 1], strides[n - 2]);
      }
      break;
    case Style::kReversedRows:
      if (shape[n - 2] > 0) {
        offset = (shape[n - 2] - 1) * strides[n - 2];
        strides[n - 2] = -strides[n - 2];
      }
      break;
    case Style::kBroadcastFirst:
      if (n > 2 && shape[0] > 1) {
        const Shape rest(shape.begin() + 1, shape.end());
        strides = concat({0}, contiguous_strides(rest));
        count = product(rest);
      }
      break;
    case Style::kEveryOther:
      for (int64_t& s : strides) s *= 2;
      offset = 1;
      count = 2 * count + 1;
      break;
    case Style::kDilated: {
      // [B, S, H, n, D] in a [B, N, H, D] buffer; [B, S, H, n] in a [B, H, N] buffer.
      const int64_t b = shape[0], segments = shape[1], heads = shape[2], rows = shape[3];
      const int64_t w = rows * kDilation, seq = segments * w;
      if (n == 5) {
        const int64_t d = shape[4];
        strides = {seq * heads * d, w * heads * d, d, kDilation * heads * d, 1};
        offset = kDilationOffset * heads * d;
        count = b * seq * heads * d;
      } else {
        strides = {heads * seq, w, seq, kDilation};
        offset = kDilationOffset;
        count = b * heads * seq;
      }
      break;
    }
  }
  Operand o;
  o.bytes.assign(static_cast<size_t>(count) * dtype_size(dtype), 0);
  o.view.data = count > 0 ? o.bytes.data() + offset * dtype_size(dtype) : nullptr;
  o.view.dtype = dtype;
  o.view.ndim = n;
  for (int d = 0; d < n; ++d) {
    o.view.shape[d] = shape[d];
    o.view.strides[d] = strides[d];
  }
  return o;
}

template <class F>
void for_each_element(const StridedView& v, const F& f) {
  const int64_t n = v.numel();
  std::vector<int64_t> index(v.ndim, 0);
  int64_t offset = 0;
  for (int64_t linear = 0; linear < n; ++linear) {
    f(linear, offset);
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++index[d] < v.shape[d]) {
        offset += v.strides[d];
        break;
      }
      offset -= (v.shape[d] - 1) * v.strides[d];
      index[d] = 0;
    }
  }
}

std::vector<double> read_view(const StridedView& v) {
  std::vector<double> values(v.numel());
  const auto size = static_cast<int64_t>(dtype_size(v.dtype));
  for_each_element(v, [&](int64_t i, int64_t off) {
    values[i] = load_element(static_cast<const unsigned char*>(v.data) + off * size, v.dtype);
  });
  return values;
}

void write_view(const StridedView& v, const std::vector<double>& values) {
  const auto size = static_cast<int64_t>(dtype_size(v.dtype));
  for_each_element(v, [&](int64_t i, int64_t off) {
    store_element(static_cast<unsigned char*>(v.data) + off * size, v.dtype, values[i]);
  });
}

// A device copy of an operand's whole buffer, and the view rebased onto it.
class DeviceOperand {
 public:
  explicit DeviceOperand(const Operand& host) : size_(host.bytes.size()), view_(host.view) {
    cuda_check(cudaMalloc(&base_, std::max<size_t>(size_, 1)), "cudaMalloc");
    cuda_check(cudaMemcpy(base_, host.bytes.data(), size_, cudaMemcpyHostToDevice), "upload");
    if (host.view.data != nullptr) {
      view_.data = static_cast<unsigned char*>(base_) +
                   (static_cast<const unsigned char*>(host.view.data) - host.bytes.data());
    }
  }
  ~DeviceOperand() { cudaFree(base_); }
  DeviceOperand(const DeviceOperand&) = delete;
  DeviceOperand& operator=(const DeviceOperand&) = delete;

  const StridedView& view() const { return view_; }
  // Copies the device buffer into `host` (same layout).
  void download(Operand& host) const {
    cuda_check(cudaMemcpy(host.bytes.data(), base_, size_, cudaMemcpyDeviceToHost), "download");
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

// Scratch memory for the backward: plain cudaMalloc/cudaFree, counting live bytes.
class CudaTestAllocator : public Allocator {
 public:
  Device device() const override { return Device::cuda(0); }
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, nbytes), "CudaTestAllocator::allocate");
    sizes_.emplace_back(p, nbytes);
    stats_.allocated_bytes += static_cast<int64_t>(nbytes);
    return p;
  }
  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    cuda_check(cudaFree(ptr), "CudaTestAllocator::deallocate");  // waits for the kernels
    auto it = std::find_if(sizes_.begin(), sizes_.end(), [&](auto& e) { return e.first == ptr; });
    if (it == sizes_.end()) throw std::runtime_error("deallocate of an unknown pointer");
    stats_.allocated_bytes -= static_cast<int64_t>(it->second);
    sizes_.erase(it);
  }
  MemoryStats stats() const override { return stats_; }
  void reset_peak_stats() override {}
  void empty_cache() override {}

 private:
  std::vector<std::pair<void*, size_t>> sizes_;
  MemoryStats stats_;
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
  int64_t failures = 0, first = -1;
  double first_tol = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    bool ok;
    double tol = 0;
    if (std::isinf(want[e])) {
      ok = got[e] == want[e];
    } else {
      tol = 4 * u * (std::fabs(want[e]) + (start ? std::fabs((*start)[e]) : 0)) + spread + tiny_step(stored);
      ok = std::fabs(got[e] - want[e]) <= tol;  // false for NaN (an unwritten element)
    }
    if (!ok && failures++ == 0) {
      first = static_cast<int64_t>(e);
      first_tol = tol;
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << got.size()
                         << " elements off; first at " << first << ": gpu "
                         << (first >= 0 ? got[first] : 0) << ", cpu "
                         << (first >= 0 ? want[first] : 0) << ", tolerance " << first_tol;
  // Outside the view: the bytes the buffer had before.
  const auto size = static_cast<int64_t>(dtype_size(stored));
  std::vector<bool> inside(gpu.count(), false);
  if (gpu.view.data != nullptr) {
    const int64_t origin = (static_cast<const unsigned char*>(gpu.view.data) - gpu.bytes.data()) / size;
    for_each_element(gpu.view, [&](int64_t, int64_t off) { inside[origin + off] = true; });
  }
  int64_t changed = 0;
  for (int64_t e = 0; e < gpu.count(); ++e) {
    if (!inside[e] && std::memcmp(&gpu.bytes[e * size], &before[e * size], size) != 0) ++changed;
  }
  EXPECT_EQ(changed, 0) << what << ": elements outside the view were written";
}

// ---------------------------------------------------------------------------------------
// Cases.

enum class Layout { kContiguous, kStrided, kDilated };
enum class Role { kQ, kK, kV, kOut, kLse, kGradOut, kGradLse, kGradQ, kGradK, kGradV };

Style style_for(Layout layout, Role role) {
  if (layout == Layout::kContiguous) return Style::kPlain;
  if (layout == Layout::kDilated) return Style::kDilated;
  switch (role) {
    case Role::kQ:
    case Role::kOut:
    case Role::kGradQ: return Style::kTransposed;
    case Role::kK:
    case Role::kGradOut:
    case Role::kGradK: return Style::kReversedRows;
    case Role::kV: return Style::kBroadcastFirst;
    case Role::kLse:
    case Role::kGradLse:
    case Role::kGradV: return Style::kEveryOther;
  }
  return Style::kPlain;
}

struct Case {
  std::string name;
  DType dtype = DType::kFloat32;
  std::optional<DType> out_dtype = std::nullopt;
  std::optional<DType> grad_dtype = std::nullopt;
  Shape batch = {2};
  int64_t lq = 37, lk = 45, d = 16;
  std::optional<double> scale = std::nullopt;
  bool causal = false;
  int64_t causal_offset = 0;
  double dropout = 0;
  bool lse = true;
  bool grad_lse = true;
  Layout layout = Layout::kContiguous;
  bool extreme = false;    // scores +-1e4 + small integers
  bool key_order = false;  // visit the keys in a random order
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string tag(DType t) { return std::string(dtype_name(t)); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType t : kFloatTypes) {
    for (int64_t d : {16, 64, 128, 256, 300}) {  // 300: two passes over the keys
      cases.push_back({.name = tag(t) + "_d" + std::to_string(d), .dtype = t, .d = d});
    }
  }
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t offset : {0, 5, -7}) {
      cases.push_back({.name = tag(t) + "_causal_offset" +
                               (offset < 0 ? "m" + std::to_string(-offset) : std::to_string(offset)),
                       .dtype = t, .lq = 40, .lk = 70, .causal = true, .causal_offset = offset});
    }
  }
  cases.push_back({.name = "causal_every_row_masked", .causal = true, .causal_offset = -100});
  cases.push_back({.name = "no_keys", .lk = 0});
  cases.push_back({.name = "no_queries", .lq = 0});
  cases.push_back({.name = "no_batch", .batch = {}});
  cases.push_back({.name = "batch2x1x3", .batch = {2, 1, 3}});
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16}) {
    cases.push_back({.name = tag(t) + "_dropout", .dtype = t, .dropout = 0.3});
  }
  cases.push_back({.name = "bf16_causal_dropout", .dtype = DType::kBFloat16, .lq = 50, .lk = 40,
                   .causal = true, .causal_offset = 3, .dropout = 0.5});
  cases.push_back({.name = "bf16_float32_out_and_grads", .dtype = DType::kBFloat16,
                   .out_dtype = DType::kFloat32, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "f64_float32_grads", .dtype = DType::kFloat64, .grad_dtype = DType::kFloat32});
  cases.push_back({.name = "no_lse", .lse = false});
  cases.push_back({.name = "no_grad_lse", .dtype = DType::kFloat16, .grad_lse = false});
  cases.push_back({.name = "strided_f32", .batch = {2, 3}, .layout = Layout::kStrided});
  cases.push_back({.name = "strided_bf16_causal_dropout", .dtype = DType::kBFloat16, .d = 64,
                   .causal = true, .causal_offset = 2, .dropout = 0.2, .layout = Layout::kStrided});
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16}) {
    cases.push_back({.name = "dilated_" + tag(t), .dtype = t, .batch = {2, 3, 2}, .lq = 40,
                     .lk = 40, .d = 32, .causal = t == DType::kFloat16, .layout = Layout::kDilated});
  }
  cases.push_back({.name = "larger_bf16", .dtype = DType::kBFloat16, .batch = {2, 3}, .lq = 200,
                   .lk = 300, .d = 64, .causal = true, .causal_offset = 100, .dropout = 0.1});
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    cases.push_back({.name = "extreme_" + tag(t), .dtype = t, .scale = 1.0, .extreme = true});
  }
  for (DType t : kFloatTypes) {
    cases.push_back({.name = "key_order_" + tag(t), .dtype = t, .key_order = true});
  }
  cases.push_back({.name = "key_order_bf16_causal_dropout_d300", .dtype = DType::kBFloat16,
                   .lq = 60, .lk = 90, .d = 300, .causal = true, .causal_offset = -4,
                   .dropout = 0.2, .key_order = true});
  return cases;
}

// q[b, i] = (+-100, c_i, 0, ...) (sign alternating by row), k[b, j] = (100, c_j, 0, ...).
void fill_extreme(const StridedView& view, bool alternate_sign) {
  const int64_t d = view.shape[view.ndim - 1], rows = view.shape[view.ndim - 2];
  std::vector<double> values(view.numel(), 0);
  for (int64_t r = 0; r < view.numel() / d; ++r) {
    values[r * d] = alternate_sign && (r % rows) % 2 == 1 ? -100 : 100;
    if (d > 1) values[r * d + 1] = static_cast<double>((r * 7 + 3) % 5) - 2;
  }
  write_view(view, values);
}

class CudaAttentionMathTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    cuda_check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void sync() {
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cuda_check(cudaGetLastError(), "cudaGetLastError");
  }
  cudaStream_t stream_ = nullptr;
};

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
  q.fill_uniform(rng);
  k.fill_uniform(rng);
  v.fill_uniform(rng);
  if (c.extreme) {
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
  gpu_out.poison();
  gpu_lse.poison();
  const auto out_before = gpu_out.bytes, lse_before = gpu_lse.bytes;
  {
    const DeviceOperand d_out(gpu_out), d_lse(gpu_lse);
    AttentionForwardArgs dargs = args;
    dargs.q = dq.view();
    dargs.k = dk.view();
    dargs.v = dv.view();
    dargs.out = d_out.view();
    dargs.lse = c.lse ? d_lse.view() : StridedView{};
    dargs.params = device_params;
    cuda::attention_math_forward(dargs, stream_);
    sync();
    d_out.download(gpu_out);
    d_lse.download(gpu_lse);
  }
  expect_matches_cpu("out", gpu_out, cpu_out, out_before, c.dtype, c.d);
  if (c.lse) {
    expect_matches_cpu("lse", gpu_lse, cpu_lse, lse_before, c.dtype, c.d);
  } else {
    EXPECT_EQ(gpu_lse.bytes, lse_before) << "lse was written though its data is null";
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
  for (Operand* o : {&grad_out, &grad_lse, &cpu_gq, &cpu_gk, &cpu_gv}) o->fill_uniform(rng);
  Operand gpu_gq = cpu_gq.clone(), gpu_gk = cpu_gk.clone(), gpu_gv = cpu_gv.clone();
  const std::vector<double> start_q = read_view(cpu_gq.view), start_k = read_view(cpu_gk.view),
                            start_v = read_view(cpu_gv.view);
  const auto gq_before = gpu_gq.bytes, gk_before = gpu_gk.bytes, gv_before = gpu_gv.bytes;
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
    cuda::attention_math_backward(dargs, scratch, stream_);
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
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kLq = 50, kLk = 40, kD = 48;
  std::mt19937_64 rng(17);
  const Shape q_shape = {3, kLq, kD}, k_shape = {3, kLk, kD};
  Operand q = make_operand(DType::kFloat32, q_shape, Style::kPlain);
  Operand k = make_operand(DType::kFloat32, k_shape, Style::kPlain);
  Operand v = make_operand(DType::kFloat32, k_shape, Style::kPlain);
  q.fill_uniform(rng);
  k.fill_uniform(rng);
  std::vector<double> identity(v.count());
  for (int64_t e = 0; e < v.count(); ++e) identity[e] = (e / kD) % kLk == e % kD ? 1.0 : 0.0;
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
    gpu_out.poison();
    const DeviceOperand d_out(gpu_out);
    AttentionForwardArgs dargs = args;
    dargs.q = dq.view();
    dargs.k = dk.view();
    dargs.v = dv.view();
    dargs.out = d_out.view();
    cuda::attention_math_forward(dargs, nullptr);
    cuda_check(cudaDeviceSynchronize(), "sync");
    d_out.download(gpu_out);
    runs.push_back(gpu_out.bytes);
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
