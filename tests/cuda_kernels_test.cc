// The CUDA elementwise, random and indexing kernels (kernels/cuda/kernels.h) against the CPU
// backend: random non-zero inputs, every dtype, contiguous, misaligned, strided, transposed
// and broadcast layouts. Every output buffer starts out poisoned (0x7f bytes) on both sides,
// including the gaps a strided view skips, and is compared whole, so elements the GPU fails
// to write or writes by mistake both fail. Exact ops must match bit for bit; ops built on
// device transcendental functions within a few ulps of the dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "testing/dtype_precision.h"
#include "testing/host_views.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/kernels.h"
#endif

namespace rd::kernels {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudaKernelsTest, NotBuilt) { GTEST_SKIP() << "this build has no CUDA backend"; }

#else

// --- host and device buffers ---

using test::HostBuffer;
using test::unit_roundoff;

// Every output buffer starts out filled with this byte, on the host and on the device.
constexpr unsigned char kPoisonByte = 0x7f;

// What random values an array gets.
enum class Values {
  kSigned,     // floats in [-3, 3] (never 0), ints in [-9, 9], bools 0/1
  kPositive,   // floats in [0.1, 3], ints in [1, 9]
  kSmallInts,  // integers in [-4, 4] in any dtype (sums of a few stay exact in every dtype)
  kBits,       // 0 or 1
};

HostBuffer random_array(DType dtype, int64_t count, std::mt19937& rng,
                       Values values = Values::kSigned) {
  HostBuffer a(dtype, count);
  std::uniform_real_distribution<double> signed_real(-3.0, 3.0), positive_real(0.1, 3.0);
  std::uniform_int_distribution<int> signed_int(-9, 9), positive_int(1, 9), small(-4, 4),
      bit(0, 1);
  const bool floating = is_floating(dtype);
  for (int64_t i = 0; i < count; ++i) {
    double v = 0;
    if (dtype == DType::kBool || values == Values::kBits) {
      v = bit(rng);
    } else if (values == Values::kSmallInts) {
      v = small(rng);
    } else if (values == Values::kPositive) {
      v = floating ? positive_real(rng) : positive_int(rng);
    } else {
      v = floating ? signed_real(rng) : signed_int(rng);
      if (v == 0) v = 0.5;
    }
    a.set(i, v);
  }
  return a;
}

HostBuffer poisoned_array(DType dtype, int64_t count) {
  HostBuffer a(dtype, count);
  a.fill_bytes(kPoisonByte);
  return a;
}

// Device memory, freed with the object.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) {
    if (cudaMalloc(&data_, bytes == 0 ? 1 : bytes) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes failed";
      data_ = nullptr;
    }
  }
  ~DeviceMemory() { cudaFree(data_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

// A view's shape, element strides and element offset into its buffer.
struct Layout {
  const char* name;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int64_t offset = 0;

  // Elements the buffer needs (strides are non-negative).
  int64_t extent() const {
    int64_t last = offset;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 0) return offset;
      last += (shape[d] - 1) * strides[d];
    }
    return last + 1;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

Layout contiguous(std::vector<int64_t> shape, const char* name = "contiguous") {
  std::vector<int64_t> strides(shape.size());
  int64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = expected;
    expected *= shape[d];
  }
  return {name, shape, strides, 0};
}

StridedView make_view(void* base, DType dtype, const Layout& layout) {
  return test::make_view(base, dtype, layout.shape, layout.strides, layout.offset);
}

// One buffer twice: the CPU backend's copy in host memory and the CUDA kernels' copy on the
// device, starting from the same bytes.
class Mirror {
 public:
  explicit Mirror(const HostBuffer& init) : host_(init), device_(init.size_bytes()) {
    EXPECT_EQ(cudaMemcpy(device_.data(), host_.data(), host_.size_bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  StridedView cpu(const Layout& layout) { return make_view(host_.data(), host_.dtype(), layout); }
  StridedView gpu(const Layout& layout) {
    return make_view(device_.data(), host_.dtype(), layout);
  }
  const HostBuffer& host() const { return host_; }
  HostBuffer download() const {
    HostBuffer out(host_.dtype(), host_.count());
    EXPECT_EQ(cudaMemcpy(out.data(), device_.data(), out.size_bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  HostBuffer host_;
  DeviceMemory device_;
};

enum class Match { kExact, kApprox };

// Tolerance of ops built on transcendental functions: one ulp of the storage (device and
// host may round to neighbouring values) plus a few dozen ulps of the compute type.
double approx_tolerance(DType dtype, double expected) {
  const double compute_u = dtype == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  return 2 * unit_roundoff(dtype) * std::fabs(expected) +
         64 * compute_u * (1 + std::fabs(expected));
}

// Compares the whole buffers (view gaps included), reporting the first few mismatches.
void expect_same(const HostBuffer& cpu, const HostBuffer& gpu, Match match,
                 const std::string& what) {
  ASSERT_EQ(cpu.count(), gpu.count());
  const size_t size = dtype_size(cpu.dtype());
  int failures = 0;
  for (int64_t i = 0; i < cpu.count() && failures < 5; ++i) {
    bool same = std::memcmp(cpu.element(i), gpu.element(i), size) == 0;
    if (!same && match == Match::kApprox && is_floating(cpu.dtype())) {
      const double c = cpu.get(i), g = gpu.get(i);
      same = (std::isnan(c) && std::isnan(g)) ||
             std::fabs(g - c) <= approx_tolerance(cpu.dtype(), c);
    }
    if (!same) {
      ++failures;
      ADD_FAILURE() << what << ": element " << i << " of " << cpu.count() << " is " << gpu.get(i)
                    << " on CUDA but " << cpu.get(i) << " on the CPU ("
                    << dtype_name(cpu.dtype()) << ")";
    }
  }
}

void expect_same(const Mirror& m, Match match, const std::string& what) {
  expect_same(m.host(), m.download(), match, what);
}

std::string describe(const char* op, DType dtype, std::initializer_list<const Layout*> layouts) {
  std::string s = std::string(op) + " " + std::string(dtype_name(dtype)) + " [";
  for (const Layout* l : layouts) s += std::string(l->name) + " ";
  s.back() = ']';
  return s;
}

// Runs the CUDA side and waits for it, failing the test on a CUDA error.
void run_gpu(const std::function<void()>& launch) {
  launch();
  const cudaError_t status = cudaDeviceSynchronize();
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
}

KernelBackend& cpu() { return cpu_backend(); }

// --- layouts shared by the elementwise tests: 315 elements, so vector loops have tails ---

const Layout kContig = contiguous({7, 45});
const Layout kMisaligned{"misaligned", {7, 45}, {45, 1}, 1};  // defeats the 16-byte vectors
const Layout kTransposed{"transposed", {7, 45}, {1, 7}, 0};
const Layout kGaps{"gaps", {7, 45}, {90, 2}, 0};
const Layout kRowBroadcast{"row_broadcast", {7, 45}, {0, 1}, 0};
const Layout kScalar{"scalar", {7, 45}, {0, 0}, 0};
const Layout k3d = contiguous({3, 5, 21}, "3d");
const Layout k3dPermuted{"3d_permuted", {3, 5, 21}, {1, 63, 3}, 0};
// Big enough for many blocks and the vector loops' steady state.
const Layout kLarge = contiguous({(1 << 20) + 7}, "large");
// Rows of whole aligned vectors in strided outer dims (a dilated selection's rows of D
// contiguous elements) take the vectorized row loop (RowVectorBody) in fills, copies and
// accumulations; the other layouts the per-element one.
const Layout kRowGaps{"row_gaps", {3, 4, 32}, {512, 64, 1}, 8};
const Layout kRowOverlapping{"row_overlapping", {3, 4, 32}, {0, 32, 1}, 0};

struct UnaryLayouts {
  const Layout* out;
  const Layout* in;
};
const UnaryLayouts kUnaryLayouts[] = {
    {&kContig, &kContig},     {&kContig, &kMisaligned},    {&kMisaligned, &kMisaligned},
    {&kTransposed, &kContig}, {&kContig, &kTransposed},    {&kGaps, &kGaps},
    {&kContig, &kRowBroadcast}, {&kContig, &kScalar},      {&k3d, &k3dPermuted},
    {&kLarge, &kLarge},
};

struct BinaryLayouts {
  const Layout* out;
  const Layout* a;
  const Layout* b;
};
const BinaryLayouts kBinaryLayouts[] = {
    {&kContig, &kContig, &kContig},         {&kContig, &kContig, &kScalar},
    {&kContig, &kScalar, &kContig},         {&kContig, &kContig, &kRowBroadcast},
    {&kContig, &kTransposed, &kContig},     {&kGaps, &kContig, &kTransposed},
    {&kMisaligned, &kMisaligned, &kMisaligned}, {&kContig, &kMisaligned, &kContig},
    {&k3dPermuted, &k3d, &k3dPermuted},     {&kLarge, &kLarge, &kLarge},
};

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                             DType::kFloat16};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!rd::cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
  // Where the index kernels record out-of-range indices: device 0's record.
  static cuda::AsyncErrors& errors() { return cuda::async_errors(0); }
  // out += in on both backends from the same random small integers (every sum exact).
  void expect_accumulate_matches(DType dtype, const Layout& out_layout, const Layout& in_layout) {
    Mirror out(random_array(dtype, out_layout.extent(), rng_, Values::kSmallInts));
    Mirror in(random_array(dtype, in_layout.extent(), rng_, Values::kSmallInts));
    cpu().accumulate(out.cpu(out_layout), in.cpu(in_layout));
    run_gpu([&] { cuda::accumulate(out.gpu(out_layout), in.gpu(in_layout), nullptr); });
    expect_same(out, Match::kExact, describe("accumulate", dtype, {&out_layout, &in_layout}));
  }
  std::mt19937 rng_{20240611};
};

// --- data movement ---

TEST_F(CudaKernelsTest, FillWritesEveryViewElementAndNothingElse) {
  const Layout kOverlapping{"overlapping", {7, 45}, {0, 1}, 0};  // many elements, one address
  for (DType dtype : kAllDTypes) {
    for (const Layout* out_layout : {&kContig, &kMisaligned, &kGaps, &kTransposed, &kOverlapping,
                                     &k3dPermuted, &kLarge, &kRowGaps, &kRowOverlapping}) {
      for (double value : {2.75, -3.5, 0.0, 1e5}) {
        Mirror out(poisoned_array(dtype, out_layout->extent()));
        cpu().fill(out.cpu(*out_layout), value);
        run_gpu([&] { cuda::fill(out.gpu(*out_layout), value, nullptr); });
        expect_same(out, Match::kExact,
                    describe("fill", dtype, {out_layout}) + " value " + std::to_string(value));
      }
    }
  }
}

TEST_F(CudaKernelsTest, ArangeFollowsLogicalOrder) {
  for (DType dtype : kAllDTypes) {
    for (const Layout* out_layout : {&kContig, &kMisaligned, &kTransposed, &kGaps, &k3dPermuted,
                                     &kLarge}) {
      Mirror out(poisoned_array(dtype, out_layout->extent()));
      cpu().arange(out.cpu(*out_layout), -3.25, 0.5);
      run_gpu([&] { cuda::arange(out.gpu(*out_layout), -3.25, 0.5, nullptr); });
      expect_same(out, Match::kExact, describe("arange", dtype, {out_layout}));
    }
  }
}

TEST_F(CudaKernelsTest, CopyConvertsEveryDtypePairWithAnyStrides) {
  const Layout kRowDense = contiguous({3, 4, 32}, "row_dense");
  const UnaryLayouts layouts[] = {
      {&kContig, &kContig},    {&kContig, &kTransposed}, {&kContig, &kRowBroadcast},
      {&kContig, &kScalar},    {&kGaps, &kMisaligned},   {&kMisaligned, &kContig},
      {&k3dPermuted, &k3d},    {&kLarge, &kLarge},       {&kRowGaps, &kRowDense},
      {&kRowDense, &kRowGaps}, {&kRowGaps, &kRowGaps},
  };
  for (DType to : kAllDTypes) {
    for (DType from : kAllDTypes) {
      for (const UnaryLayouts& l : layouts) {
        // Values in [-9, 9] with zeros: every conversion, bool included, is well defined.
        HostBuffer init = random_array(from, l.in->extent(), rng_, Values::kSmallInts);
        Mirror in(init);
        Mirror out(poisoned_array(to, l.out->extent()));
        cpu().copy(out.cpu(*l.out), in.cpu(*l.in));
        run_gpu([&] { cuda::copy(out.gpu(*l.out), in.gpu(*l.in), nullptr); });
        expect_same(out, Match::kExact,
                    describe("copy", to, {l.out, l.in}) + " from " +
                        std::string(dtype_name(from)));
      }
    }
  }
}

// Same-dtype copies of rows of contiguous runs: rows of whole 16-byte vectors on both sides
// (v of a packed [B, N, 3, H, D] buffer into a dense tensor and back) take the row loop;
// other runs of at least 256 bytes (a narrowed last dim whose rows start off the vectors)
// cudaMemcpy2DAsync; shorter ones the strided kernel.
TEST_F(CudaKernelsTest, CopiesRowsOfContiguousRunsAsTwoDimensionalCopies) {
  const Layout kPacked{"packed_v", {2, 5, 4, 32}, {5 * 384, 384, 32, 1}, 256};
  const Layout kDense = contiguous({2, 5, 4, 32}, "dense");
  const Layout kNarrowed{"narrowed", {9, 100}, {130, 1}, 3};
  const Layout kNarrowedDense = contiguous({9, 100}, "narrowed_dense");
  const Layout kShortRuns{"short_runs", {9, 15}, {40, 1}, 0};  // 60 bytes of float32
  const Layout kShortDense = contiguous({9, 15}, "short_dense");
  const UnaryLayouts layouts[] = {{&kDense, &kPacked},         {&kPacked, &kDense},
                                  {&kNarrowedDense, &kNarrowed}, {&kNarrowed, &kNarrowedDense},
                                  {&kShortDense, &kShortRuns}};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    for (const UnaryLayouts& l : layouts) {
      Mirror in(random_array(dtype, l.in->extent(), rng_, Values::kSmallInts));
      Mirror out(poisoned_array(dtype, l.out->extent()));
      cpu().copy(out.cpu(*l.out), in.cpu(*l.in));
      run_gpu([&] { cuda::copy(out.gpu(*l.out), in.gpu(*l.in), nullptr); });
      expect_same(out, Match::kExact, describe("copy", dtype, {l.out, l.in}));
    }
  }
}

TEST_F(CudaKernelsTest, AccumulateAddsIntoDistinctAndOverlappingOutputs) {
  // Overlapping: every out element is hit 7 times. Small integer values keep every partial sum
  // exact, so the atomic adds' free order cannot change the result.
  const Layout kOverlapping{"overlapping", {7, 45}, {0, 1}, 0};
  const UnaryLayouts layouts[] = {
      {&kContig, &kContig},      {&kContig, &kTransposed}, {&kGaps, &kRowBroadcast},
      {&kContig, &kScalar},      {&kMisaligned, &kContig}, {&kOverlapping, &kContig},
      {&kOverlapping, &kTransposed}, {&kLarge, &kLarge},
  };
  for (DType dtype : kAllDTypes) {
    for (const UnaryLayouts& l : layouts) expect_accumulate_matches(dtype, *l.out, *l.in);
  }
}

// Rows of whole aligned vectors in strided outer dims (a dilated selection's rows of D
// contiguous elements) take the vectorized row loop (RowVectorBody); a misaligned start
// falls back to the per-element loop. Widening: float32 out += a bf16/f16 in, equal to the
// CPU's float32 accumulate of the input converted to float32, into distinct and overlapping
// (atomic) outputs.
TEST_F(CudaKernelsTest, AccumulatesRowsOfVectorsAndWidensNarrowFloats) {
  const Layout kRowDense = contiguous({3, 4, 32}, "row_dense");
  const Layout kRowMisaligned{"row_misaligned", {3, 4, 32}, {512, 64, 1}, 3};
  const UnaryLayouts layouts[] = {{&kRowGaps, &kRowDense},
                                  {&kRowDense, &kRowGaps},
                                  {&kRowGaps, &kRowGaps},
                                  {&kRowMisaligned, &kRowDense},
                                  {&kRowGaps, &kRowMisaligned}};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    for (const UnaryLayouts& l : layouts) expect_accumulate_matches(dtype, *l.out, *l.in);
  }
  std::vector<UnaryLayouts> widening(std::begin(layouts), std::end(layouts));
  widening.push_back({&kRowOverlapping, &kRowGaps});
  for (DType narrow : {DType::kBFloat16, DType::kFloat16}) {
    for (const UnaryLayouts& l : widening) {
      Mirror in(random_array(narrow, l.in->extent(), rng_, Values::kSmallInts));
      Mirror widened(poisoned_array(DType::kFloat32, l.in->extent()));
      cpu().copy(widened.cpu(*l.in), in.cpu(*l.in));
      Mirror out(random_array(DType::kFloat32, l.out->extent(), rng_, Values::kSmallInts));
      cpu().accumulate(out.cpu(*l.out), widened.cpu(*l.in));
      run_gpu([&] { cuda::accumulate(out.gpu(*l.out), in.gpu(*l.in), nullptr); });
      expect_same(out, Match::kExact, describe("accumulate widening", narrow, {l.out, l.in}));
    }
  }
}

// --- elementwise math ---

struct UnaryCase {
  UnaryOp op;
  const char* name;
  Match match;
  Values values;
  UnaryParams params;
};

UnaryParams clamp_params(std::optional<double> lo, std::optional<double> hi) {
  UnaryParams p;
  p.lo = lo;
  p.hi = hi;
  return p;
}
UnaryParams pow_params(double exponent) {
  UnaryParams p;
  p.scalar = exponent;
  return p;
}

TEST_F(CudaKernelsTest, UnaryFloatOpsMatchCpu) {
  const UnaryCase cases[] = {
      {UnaryOp::kNeg, "neg", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kAbs, "abs", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kRelu, "relu", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kSqrt, "sqrt", Match::kExact, Values::kPositive, {}},
      {UnaryOp::kRsqrt, "rsqrt", Match::kExact, Values::kPositive, {}},
      {UnaryOp::kClamp, "clamp", Match::kExact, Values::kSigned, clamp_params(-0.5, 0.75)},
      {UnaryOp::kClamp, "clamp_lo", Match::kExact, Values::kSigned, clamp_params(0.25, {})},
      {UnaryOp::kClamp, "clamp_inverted", Match::kExact, Values::kSigned, clamp_params(1, -1)},
      {UnaryOp::kExp, "exp", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kLog, "log", Match::kApprox, Values::kPositive, {}},
      {UnaryOp::kTanh, "tanh", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kSigmoid, "sigmoid", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kSilu, "silu", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kGeluTanh, "gelu_tanh", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kGeluErf, "gelu_erf", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kGeluTanhGrad, "gelu_tanh_grad", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kGeluErfGrad, "gelu_erf_grad", Match::kApprox, Values::kSigned, {}},
      {UnaryOp::kPowScalar, "pow_scalar", Match::kApprox, Values::kPositive, pow_params(2.5)},
      {UnaryOp::kPowScalar, "pow_scalar_int", Match::kApprox, Values::kSigned, pow_params(3)},
  };
  for (DType dtype : kFloatTypes) {
    for (const UnaryCase& c : cases) {
      for (const UnaryLayouts& l : kUnaryLayouts) {
        Mirror in(random_array(dtype, l.in->extent(), rng_, c.values));
        Mirror out(poisoned_array(dtype, l.out->extent()));
        cpu().unary(c.op, out.cpu(*l.out), in.cpu(*l.in), c.params);
        run_gpu([&] { cuda::unary(c.op, out.gpu(*l.out), in.gpu(*l.in), c.params, nullptr); });
        expect_same(out, c.match, describe(c.name, dtype, {l.out, l.in}));
      }
    }
  }
}

// The 16-bit GELUs take their own cheaper forms on the GPU (polynomial erf, sigmoid tanh with
// the hardware's 2^t and reciprocal): check them on every 16-bit value, so tails, overflow of
// the exponential, subnormals, infinities and NaNs are all covered, not just [-3, 3].
TEST_F(CudaKernelsTest, GelusOfEvery16BitValueMatchCpu) {
  constexpr int64_t kPatterns = int64_t{1} << 16;
  const Layout all = contiguous({kPatterns}, "every bit pattern");
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    HostBuffer patterns(dtype, kPatterns);
    for (int64_t i = 0; i < kPatterns; ++i) {
      const auto bits = static_cast<uint16_t>(i);
      std::memcpy(patterns.element(i), &bits, sizeof(bits));
    }
    for (UnaryOp op : {UnaryOp::kGeluTanh, UnaryOp::kGeluErf}) {
      Mirror in(patterns);
      Mirror out(poisoned_array(dtype, kPatterns));
      cpu().unary(op, out.cpu(all), in.cpu(all), {});
      run_gpu([&] { cuda::unary(op, out.gpu(all), in.gpu(all), {}, nullptr); });
      expect_same(out, Match::kApprox,
                  describe(op == UnaryOp::kGeluTanh ? "gelu_tanh" : "gelu_erf", dtype, {&all}));
    }
  }
}

TEST_F(CudaKernelsTest, UnaryIntegerOpsMatchCpu) {
  const UnaryCase cases[] = {
      {UnaryOp::kNeg, "neg", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kAbs, "abs", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kRelu, "relu", Match::kExact, Values::kSigned, {}},
      {UnaryOp::kClamp, "clamp", Match::kExact, Values::kSigned, clamp_params(-2.5, 4.2)},
      {UnaryOp::kClamp, "clamp_hi_nan_lo", Match::kExact, Values::kSigned,
       clamp_params(std::nan(""), 3)},
      {UnaryOp::kClamp, "clamp_huge", Match::kExact, Values::kSigned, clamp_params(-1e30, 1e30)},
  };
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    for (const UnaryCase& c : cases) {
      for (const UnaryLayouts& l : kUnaryLayouts) {
        Mirror in(random_array(dtype, l.in->extent(), rng_, c.values));
        Mirror out(poisoned_array(dtype, l.out->extent()));
        cpu().unary(c.op, out.cpu(*l.out), in.cpu(*l.in), c.params);
        run_gpu([&] { cuda::unary(c.op, out.gpu(*l.out), in.gpu(*l.in), c.params, nullptr); });
        expect_same(out, c.match, describe(c.name, dtype, {l.out, l.in}));
      }
    }
  }
}

TEST_F(CudaKernelsTest, RejectsOpsADtypeDoesNotSupport) {
  Mirror i32(random_array(DType::kInt32, 315, rng_));
  Mirror b(random_array(DType::kBool, 315, rng_));
  Mirror out(poisoned_array(DType::kInt32, 315));
  auto expect_dtype_error = [](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kDTypeMismatch) << what << ": " << e.what();
    }
  };
  expect_dtype_error(
      [&] { cuda::unary(UnaryOp::kExp, out.gpu(kContig), i32.gpu(kContig), {}, nullptr); },
      "exp on int32");
  expect_dtype_error([&] {
    cuda::binary(BinaryOp::kDiv, out.gpu(kContig), i32.gpu(kContig), i32.gpu(kContig), nullptr);
  }, "div on int32");
  expect_dtype_error([&] {
    cuda::binary(BinaryOp::kAdd, b.gpu(kContig), b.gpu(kContig), b.gpu(kContig), nullptr);
  }, "add on bool");
  expect_dtype_error([&] {
    cuda::random(out.gpu(kContig), Distribution::kNormal, 0, 1, 1, 0, nullptr);
  }, "normal into int32");
  expect_dtype_error([&] { cuda::cumsum(b.gpu(kContig), b.gpu(kContig), 0, false, nullptr); },
                     "cumsum on bool");
  // Nothing was launched: the output is still all poison.
  expect_same(poisoned_array(DType::kInt32, 315), out.download(), Match::kExact,
              "untouched output");
}

struct BinaryCase {
  BinaryOp op;
  const char* name;
};

TEST_F(CudaKernelsTest, BinaryArithmeticMatchesCpu) {
  const BinaryCase cases[] = {
      {BinaryOp::kAdd, "add"},         {BinaryOp::kSub, "sub"},
      {BinaryOp::kMul, "mul"},         {BinaryOp::kDiv, "div"},
      {BinaryOp::kPow, "pow"},         {BinaryOp::kMaximum, "maximum"},
      {BinaryOp::kMinimum, "minimum"}, {BinaryOp::kLogicalAnd, "logical_and"},
  };
  for (DType dtype : kAllDTypes) {
    for (const BinaryCase& c : cases) {
      const bool supported =
          c.op == BinaryOp::kMaximum || c.op == BinaryOp::kMinimum ||
          (c.op == BinaryOp::kLogicalAnd ? dtype == DType::kBool
           : (c.op == BinaryOp::kDiv || c.op == BinaryOp::kPow) ? is_floating(dtype)
                                                                 : dtype != DType::kBool);
      if (!supported) continue;
      const Values a_values = c.op == BinaryOp::kPow ? Values::kPositive : Values::kSigned;
      for (const BinaryLayouts& l : kBinaryLayouts) {
        Mirror a(random_array(dtype, l.a->extent(), rng_, a_values));
        Mirror b(random_array(dtype, l.b->extent(), rng_));
        Mirror out(poisoned_array(dtype, l.out->extent()));
        cpu().binary(c.op, out.cpu(*l.out), a.cpu(*l.a), b.cpu(*l.b));
        run_gpu([&] { cuda::binary(c.op, out.gpu(*l.out), a.gpu(*l.a), b.gpu(*l.b), nullptr); });
        expect_same(out, c.op == BinaryOp::kPow ? Match::kApprox : Match::kExact,
                    describe(c.name, dtype, {l.out, l.a, l.b}));
      }
    }
  }
}

TEST_F(CudaKernelsTest, BinaryMaxMinPropagateNan) {
  for (DType dtype : kFloatTypes) {
    HostBuffer a = random_array(dtype, 315, rng_), b = random_array(dtype, 315, rng_);
    for (int64_t i = 0; i < 315; i += 3) (i % 2 ? a : b).set(i, std::nan(""));
    Mirror ma(a), mb(b);
    for (BinaryOp op : {BinaryOp::kMaximum, BinaryOp::kMinimum}) {
      Mirror out(poisoned_array(dtype, 315));
      cpu().binary(op, out.cpu(kContig), ma.cpu(kContig), mb.cpu(kContig));
      run_gpu([&] {
        cuda::binary(op, out.gpu(kContig), ma.gpu(kContig), mb.gpu(kContig), nullptr);
      });
      expect_same(out, Match::kExact, describe("max/min with NaN", dtype, {&kContig}));
    }
  }
}

TEST_F(CudaKernelsTest, ComparisonsWriteBool) {
  const BinaryCase cases[] = {{BinaryOp::kEq, "eq"}, {BinaryOp::kNe, "ne"},
                              {BinaryOp::kLt, "lt"}, {BinaryOp::kLe, "le"},
                              {BinaryOp::kGt, "gt"}, {BinaryOp::kGe, "ge"}};
  for (DType dtype : kAllDTypes) {
    for (const BinaryCase& c : cases) {
      for (const BinaryLayouts& l : kBinaryLayouts) {
        // Small integers, so that ties (where eq/le/ge differ from lt/gt) are common.
        Mirror a(random_array(dtype, l.a->extent(), rng_, Values::kSmallInts));
        Mirror b(random_array(dtype, l.b->extent(), rng_, Values::kSmallInts));
        Mirror out(poisoned_array(DType::kBool, l.out->extent()));
        cpu().binary(c.op, out.cpu(*l.out), a.cpu(*l.a), b.cpu(*l.b));
        run_gpu([&] { cuda::binary(c.op, out.gpu(*l.out), a.gpu(*l.a), b.gpu(*l.b), nullptr); });
        expect_same(out, Match::kExact, describe(c.name, dtype, {l.out, l.a, l.b}));
      }
    }
  }
}

TEST_F(CudaKernelsTest, WhereSelectsPerElement) {
  struct WhereLayouts {
    const Layout* out;
    const Layout* cond;
    const Layout* a;
    const Layout* b;
  };
  const WhereLayouts layouts[] = {
      {&kContig, &kContig, &kContig, &kContig},
      {&kContig, &kRowBroadcast, &kContig, &kScalar},
      {&kContig, &kContig, &kScalar, &kTransposed},
      {&kGaps, &kTransposed, &kMisaligned, &kContig},
      {&kMisaligned, &kMisaligned, &kMisaligned, &kMisaligned},
      {&k3dPermuted, &k3d, &k3dPermuted, &k3d},
      {&kLarge, &kLarge, &kLarge, &kLarge},
  };
  for (DType dtype : kAllDTypes) {
    for (const WhereLayouts& l : layouts) {
      Mirror cond(random_array(DType::kBool, l.cond->extent(), rng_));
      Mirror a(random_array(dtype, l.a->extent(), rng_));
      Mirror b(random_array(dtype, l.b->extent(), rng_));
      Mirror out(poisoned_array(dtype, l.out->extent()));
      cpu().where(out.cpu(*l.out), cond.cpu(*l.cond), a.cpu(*l.a), b.cpu(*l.b));
      run_gpu([&] {
        cuda::where(out.gpu(*l.out), cond.gpu(*l.cond), a.gpu(*l.a), b.gpu(*l.b), nullptr);
      });
      expect_same(out, Match::kExact, describe("where", dtype, {l.out, l.cond, l.a, l.b}));
    }
  }
}

// --- random ---

TEST_F(CudaKernelsTest, RandomMatchesCpuBitForBit) {
  // An offset just below 2^32 makes the counters carry into their high word mid-tensor.
  const uint64_t kSeed = 0x0123456789abcdefull, kOffset = (uint64_t{1} << 32) - 1000;
  for (DType dtype : kAllDTypes) {
    for (const Layout* layout : {&kContig, &kTransposed, &kGaps, &k3dPermuted, &kLarge}) {
      struct Draw {
        Distribution dist;
        double a, b;
        const char* name;
      };
      const Draw draws[] = {{Distribution::kUniform, -1.5, 2.0, "uniform"},
                            {Distribution::kUniform, 0.0, 0.3, "uniform_narrow"},
                            {Distribution::kBernoulli, 0.3, 0.0, "bernoulli"},
                            {Distribution::kNormal, 0.5, 2.0, "normal"}};
      for (const Draw& d : draws) {
        if (d.dist != Distribution::kBernoulli && !is_floating(dtype)) continue;
        Mirror out(poisoned_array(dtype, layout->extent()));
        cpu().random(out.cpu(*layout), d.dist, d.a, d.b, kSeed, kOffset);
        run_gpu([&] {
          cuda::random(out.gpu(*layout), d.dist, d.a, d.b, kSeed, kOffset, nullptr);
        });
        // Normal samples go through device log/cos, which may differ in the last ulp.
        expect_same(out, d.dist == Distribution::kNormal ? Match::kApprox : Match::kExact,
                    describe(d.name, dtype, {layout}));
      }
    }
  }
}

// --- indexing ---

// An index array of `count` values in [0, limit), with duplicates.
HostBuffer random_index(DType dtype, int64_t count, int64_t limit, std::mt19937& rng) {
  HostBuffer index(dtype, count);
  std::uniform_int_distribution<int64_t> pick(0, limit - 1);
  for (int64_t i = 0; i < count; ++i) index.set(i, static_cast<double>(pick(rng)));
  return index;
}

const Layout kIn3d = contiguous({6, 9, 5}, "in");
const Layout kIn3dTransposed{"in_transposed", {6, 9, 5}, {1, 30, 6}, 0};

TEST_F(CudaKernelsTest, IndexSelectAndGatherMatchCpu) {
  for (DType dtype : kAllDTypes) {
    for (DType index_dtype : {DType::kInt64, DType::kInt32}) {
      for (int dim = 0; dim < 3; ++dim) {
        for (const Layout* in_layout : {&kIn3d, &kIn3dTransposed}) {
          Mirror in(random_array(dtype, in_layout->extent(), rng_));
          const int64_t limit = in_layout->shape[dim];
          {  // index_select with 11 indices, read with stride 2
            Layout index_layout{"index_stride2", {11}, {2}, 0};
            Mirror index(random_index(index_dtype, index_layout.extent(), limit, rng_));
            std::vector<int64_t> out_shape = in_layout->shape;
            out_shape[dim] = 11;
            const Layout out_layout = contiguous(out_shape, "out");
            Mirror out(poisoned_array(dtype, out_layout.extent()));
            cpu().index_select(out.cpu(out_layout), in.cpu(*in_layout), dim,
                               index.cpu(index_layout));
            run_gpu([&] {
              cuda::index_select(out.gpu(out_layout), in.gpu(*in_layout), dim,
                                 index.gpu(index_layout), errors(), nullptr);
            });
            expect_same(out, Match::kExact,
                        describe("index_select", dtype, {&out_layout, in_layout}) + " dim " +
                            std::to_string(dim));
          }
          {  // gather with an index smaller than in outside dim, 7 long along dim
            std::vector<int64_t> index_shape = {4, 7, 3};
            index_shape[dim] = 7;
            const Layout index_layout = contiguous(index_shape, "index");
            const Layout out_layout{"out_transposed", index_shape,
                                    {1, index_shape[0], index_shape[0] * index_shape[1]}, 0};
            Mirror index(random_index(index_dtype, index_layout.extent(), limit, rng_));
            Mirror out(poisoned_array(dtype, out_layout.extent()));
            cpu().gather(out.cpu(out_layout), in.cpu(*in_layout), dim, index.cpu(index_layout));
            run_gpu([&] {
              cuda::gather(out.gpu(out_layout), in.gpu(*in_layout), dim, index.gpu(index_layout),
                           errors(), nullptr);
            });
            expect_same(out, Match::kExact,
                        describe("gather", dtype, {&out_layout, in_layout}) + " dim " +
                            std::to_string(dim));
          }
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, IndexAddMatchesCpuInLineAndElementModes) {
  // 11 indices: short lines, one thread per line in order (bit-exact for any values). 300
  // indices over 45 lines: element-parallel atomics; 0/1 values keep every sum exact.
  for (DType dtype : kAllDTypes) {
    for (int64_t length : {11, 300}) {
      for (int dim = 0; dim < 3; ++dim) {
        const Values values = length > 256 ? Values::kBits : Values::kSigned;
        Mirror out(random_array(dtype, kIn3d.extent(), rng_, values));
        Mirror index(random_index(DType::kInt64, length, kIn3d.shape[dim], rng_));
        std::vector<int64_t> src_shape = kIn3d.shape;
        src_shape[dim] = length;
        const Layout src_layout = contiguous(src_shape, "src");
        const Layout index_layout = contiguous({length}, "index");
        Mirror src(random_array(dtype, src_layout.extent(), rng_, values));
        cpu().index_add(out.cpu(kIn3d), dim, index.cpu(index_layout), src.cpu(src_layout));
        run_gpu([&] {
          cuda::index_add(out.gpu(kIn3d), dim, index.gpu(index_layout), src.gpu(src_layout),
                          errors(), nullptr);
        });
        expect_same(out, Match::kExact,
                    describe("index_add", dtype, {&kIn3d, &src_layout}) + " dim " +
                        std::to_string(dim) + " length " + std::to_string(length));
      }
    }
  }
}

// A [length, columns] index whose every column holds distinct values in [0, limit).
HostBuffer distinct_columns_index(int64_t length, int64_t columns, int64_t limit,
                                 std::mt19937& rng) {
  HostBuffer index(DType::kInt64, length * columns);
  std::vector<int64_t> perm(limit);
  for (int64_t c = 0; c < columns; ++c) {
    for (int64_t i = 0; i < limit; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t r = 0; r < length; ++r) index.set(r * columns + c, static_cast<double>(perm[r]));
  }
  return index;
}

TEST_F(CudaKernelsTest, ScatterMatchesCpu) {
  for (DType dtype : kAllDTypes) {
    for (bool accumulate : {false, true}) {
      {  // line mode: 7-long lines with duplicate indices, in order on one thread each
        const Layout out_layout = kIn3d;
        const Layout index_layout = contiguous({6, 7, 5}, "index");
        const Layout src_layout{"src_bigger", {6, 8, 5}, {80, 10, 2}, 3};  // src > index
        Mirror out(random_array(dtype, out_layout.extent(), rng_));
        Mirror index(random_index(DType::kInt32, index_layout.extent(), out_layout.shape[1], rng_));
        Mirror src(random_array(dtype, src_layout.extent(), rng_));
        cpu().scatter(out.cpu(out_layout), 1, index.cpu(index_layout), src.cpu(src_layout),
                      accumulate);
        run_gpu([&] {
          cuda::scatter(out.gpu(out_layout), 1, index.gpu(index_layout), src.gpu(src_layout),
                        accumulate, errors(), nullptr);
        });
        expect_same(out, Match::kExact,
                    describe("scatter lines", dtype, {&out_layout, &src_layout}) +
                        (accumulate ? " accumulate" : " assign"));
      }
      {  // element mode: 300-long lines; assignment with distinct indices per line,
         // accumulation with 0/1 values (exact sums)
        const Layout out_layout = contiguous({320, 4}, "out");
        const Layout index_layout = contiguous({300, 4}, "index");
        Mirror out(random_array(dtype, out_layout.extent(), rng_));
        Mirror index(accumulate ? random_index(DType::kInt64, index_layout.extent(), 320, rng_)
                                : distinct_columns_index(300, 4, 320, rng_));
        Mirror src(random_array(dtype, index_layout.extent(), rng_,
                                accumulate ? Values::kBits : Values::kSigned));
        cpu().scatter(out.cpu(out_layout), 0, index.cpu(index_layout), src.cpu(index_layout),
                      accumulate);
        run_gpu([&] {
          cuda::scatter(out.gpu(out_layout), 0, index.gpu(index_layout), src.gpu(index_layout),
                        accumulate, errors(), nullptr);
        });
        expect_same(out, Match::kExact,
                    describe("scatter elements", dtype, {&out_layout, &index_layout}) +
                        (accumulate ? " accumulate" : " assign"));
      }
      {  // overlapping out (stride 0 outside dim): assignment serial in the CPU's order,
         // accumulation atomic with exact small-integer sums
        const Layout out_layout{"out_overlapping", {6, 5}, {1, 0}, 0};
        const Layout index_layout = contiguous({8, 5}, "index");
        Mirror out(random_array(dtype, out_layout.extent(), rng_, Values::kSmallInts));
        Mirror index(random_index(DType::kInt64, index_layout.extent(), 6, rng_));
        Mirror src(random_array(dtype, index_layout.extent(), rng_, Values::kSmallInts));
        cpu().scatter(out.cpu(out_layout), 0, index.cpu(index_layout), src.cpu(index_layout),
                      accumulate);
        run_gpu([&] {
          cuda::scatter(out.gpu(out_layout), 0, index.gpu(index_layout), src.gpu(index_layout),
                        accumulate, errors(), nullptr);
        });
        expect_same(out, Match::kExact,
                    describe("scatter overlapping", dtype, {&out_layout, &index_layout}) +
                        (accumulate ? " accumulate" : " assign"));
      }
    }
  }
}

// An out-of-range index does not stop the launch: the kernel skips it (index_select writes
// 0 there, index_add adds nothing), records it, and the next synchronization through the
// library raises kOutOfRange naming the op and one of the bad values, once.
TEST_F(CudaKernelsTest, OutOfRangeIndicesAreSkippedAndRaisedAtTheNextSynchronization) {
  // The message names one of the bad values; which one wins the record is unspecified.
  auto expect_raised = [](const char* op, int64_t bad) {
    try {
      cuda::synchronize_stream(0, nullptr);
      ADD_FAILURE() << op << " with index " << bad << " was not raised";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfRange) << e.what();
      const std::string what = e.what();
      EXPECT_TRUE(what.find("index " + std::to_string(bad) + " is out of range") !=
                      std::string::npos ||
                  what.find("index 100 is out of range") != std::string::npos)
          << what;
      EXPECT_NE(what.find(op), std::string::npos) << what;
    }
    cuda::synchronize_stream(0, nullptr);  // cleared: nothing more to raise
  };
  for (int64_t bad : {int64_t{6}, int64_t{-1}}) {
    HostBuffer index_values = random_index(DType::kInt64, 11, 6, rng_);
    index_values.set(4, static_cast<double>(bad));
    index_values.set(9, 100.0);
    Mirror index(index_values);
    Mirror in(random_array(DType::kFloat32, kIn3d.extent(), rng_));
    const Layout out_layout = contiguous({11, 9, 5}, "out");
    const Layout index_layout = contiguous({11}, "index");
    Mirror out(poisoned_array(DType::kFloat32, out_layout.extent()));
    // The CPU's result for the good indices, zeros where they are bad.
    HostBuffer good_values = index_values;
    good_values.set(4, 0.0);
    good_values.set(9, 0.0);
    Mirror good_index(good_values);
    cpu().index_select(out.cpu(out_layout), in.cpu(kIn3d), 0, good_index.cpu(index_layout));
    auto* expected = static_cast<float*>(out.cpu(out_layout).data);
    for (int64_t k : {4, 9}) std::fill(expected + k * 45, expected + (k + 1) * 45, 0.0f);
    cuda::index_select(out.gpu(out_layout), in.gpu(kIn3d), 0, index.gpu(index_layout), errors(),
                       nullptr);  // queues the work and returns: no throw here
    expect_raised("index_select", bad);
    expect_same(out, Match::kExact, "index_select output with bad indices");

    const Layout src_layout = contiguous({11, 9, 5}, "src");
    Mirror src(random_array(DType::kFloat32, src_layout.extent(), rng_));
    Mirror target(random_array(DType::kFloat32, kIn3d.extent(), rng_));
    cuda::index_add(target.gpu(kIn3d), 0, index.gpu(index_layout), src.gpu(src_layout), errors(),
                    nullptr);
    expect_raised("index_add", bad);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // nothing out of bounds was touched
  }
}

TEST_F(CudaKernelsTest, CumsumMatchesCpu) {
  // Short lines scan on one thread each in the CPU's order: bit-identical for any values.
  // The 5000-long lines scan with a block per line in another order; small integers keep
  // every partial sum exact in the accumulator, so those must match exactly too.
  const Layout kLong = contiguous({3, 5000}, "long_lines");
  for (DType dtype : kAllDTypes) {
    if (dtype == DType::kBool) continue;
    for (const Layout* in_layout : {&kIn3d, &kIn3dTransposed, &kLong}) {
      const Values values = in_layout == &kLong ? Values::kSmallInts : Values::kSigned;
      for (int dim = 0; dim < static_cast<int>(in_layout->shape.size()); ++dim) {
        for (bool reverse : {false, true}) {
          Mirror in(random_array(dtype, in_layout->extent(), rng_, values));
          const Layout out_layout = contiguous(in_layout->shape, "out");
          Mirror out(poisoned_array(dtype, out_layout.extent()));
          cpu().cumsum(out.cpu(out_layout), in.cpu(*in_layout), dim, reverse);
          run_gpu([&] {
            cuda::cumsum(out.gpu(out_layout), in.gpu(*in_layout), dim, reverse, nullptr);
          });
          expect_same(out, Match::kExact,
                      describe("cumsum", dtype, {&out_layout, in_layout}) + " dim " +
                          std::to_string(dim) + (reverse ? " reverse" : ""));
        }
      }
    }
  }
}

// --- sizes beyond one grid and beyond 32-bit offsets ---

TEST_F(CudaKernelsTest, GridStrideLoopsCoverMoreItemsThanThreads) {
  // 20M strided elements: more than the 2^16 blocks x 256 threads of one grid.
  const int64_t n = 20'000'000;
  const Layout out_layout = contiguous({n}, "out");
  const Layout in_layout{"in_reversed_pairs", {n / 2, 2}, {1, n / 2}, 0};
  const Layout out_2d = contiguous({n / 2, 2}, "out");
  HostBuffer init(DType::kFloat32, n);
  for (int64_t i = 0; i < n; ++i) init.set(i, static_cast<double>(i % 1000003));
  Mirror in(init);
  Mirror out(poisoned_array(DType::kBFloat16, out_layout.extent()));
  cpu().copy(out.cpu(out_2d), in.cpu(in_layout));
  run_gpu([&] { cuda::copy(out.gpu(out_2d), in.gpu(in_layout), nullptr); });
  expect_same(out, Match::kExact, "copy float32 -> bfloat16, 20M strided elements");
}

TEST_F(CudaKernelsTest, TensorsBeyondTwoToThe31ElementsUse64BitOffsets) {
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const int64_t half = (int64_t{1} << 30) + 7;  // [2, half] holds 2^31 + 14 elements
  const int64_t n = 2 * half;
  const size_t need = 2 * static_cast<size_t>(n) * sizeof(float);
  if (free_bytes < need + (size_t{1} << 30)) GTEST_SKIP() << "needs " << need << " bytes free";
  DeviceMemory in(n * sizeof(float)), out(n * sizeof(float));
  const Layout in_layout = contiguous({2, half}, "in");
  const Layout out_layout{"out_interleaved", {2, half}, {1, 2}, 0};
  run_gpu([&] { cuda::arange(make_view(in.data(), DType::kFloat32, in_layout), 0, 1, nullptr); });
  run_gpu([&] {
    cuda::copy(make_view(out.data(), DType::kFloat32, out_layout),
               make_view(in.data(), DType::kFloat32, in_layout), nullptr);
  });
  // out[2 j + r] = in[r * half + j] = float(r * half + j).
  for (int64_t j : {int64_t{0}, int64_t{1}, int64_t{12345}, (int64_t{1} << 30) - 3,
                    (int64_t{1} << 30) + 1, half - 1}) {
    for (int64_t r : {0, 1}) {
      float got = 0, arange_got = 0;
      ASSERT_EQ(cudaMemcpy(&got, static_cast<float*>(out.data()) + 2 * j + r, sizeof(float),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&arange_got, static_cast<float*>(in.data()) + r * half + j,
                           sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
      const float expected = static_cast<float>(static_cast<double>(r * half + j));
      EXPECT_EQ(arange_got, expected) << "arange element " << r * half + j;
      EXPECT_EQ(got, expected) << "copy element (" << r << ", " << j << ")";
    }
  }
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::kernels
