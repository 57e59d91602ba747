// GPU tests of the CUDA reductions, row-wise fused ops and cuBLASLt GEMM: reductions and
// row-wise ops against the CPU backend on the same inputs, GEMM against a float64 reference.
// Outputs are poisoned (NaN bytes) before every GPU run, so an unwritten element fails.
// Tolerances: 2 units of the output dtype's rounding on the value, plus 64 units of the
// compute type's rounding on the error scale of the computation (the sum of |terms|).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "testing/dtype_precision.h"
#include "testing/host_views.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/allocator.h"
#include "ringdilated/kernels/cuda/kernels.h"
#include "testing/cuda_scratch_allocator.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd::kernels {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudaRowwiseGemmTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

namespace gpu = ::rd::kernels::cuda;

using test::compute_roundoff;
using test::contiguous_strides;
using test::cuda_check;
using test::CudaTestAllocator;
using test::HostBuffer;
using test::make_view;
using test::product;
using test::tiny_step;
using test::unit_roundoff;

// ---------------------------------------------------------------------------------------
// Test plumbing: device buffers, the scratch allocators, the fixture.

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};

// The elements of a host buffer as T, for the kernels' typed pointers (T matches its dtype).
template <class T>
T* elements(HostBuffer& h) {
  return reinterpret_cast<T*>(h.data());
}
template <class T>
const T* elements(const HostBuffer& h) {
  return reinterpret_cast<const T*>(h.data());
}

// Device memory with a 256-byte aligned base; element `offset` is where the data starts
// (offsets misalign the data on purpose).
class DeviceBuffer {
 public:
  DeviceBuffer(DType dtype, int64_t count, int64_t offset = 0)
      : dtype_(dtype), offset_(offset), count_(count) {
    cuda_check(cudaMalloc(&base_, std::max<size_t>(1, (count + offset) * dtype_size(dtype))),
               "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return static_cast<char*>(base_) + offset_ * dtype_size(dtype_); }
  void upload(const HostBuffer& h) {
    cuda_check(cudaMemcpy(get(), h.data(), h.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  HostBuffer download() const {
    HostBuffer h(dtype_, count_);
    cuda_check(cudaMemcpy(h.data(), get(), h.size_bytes(), cudaMemcpyDeviceToHost), "download");
    return h;
  }
  // NaN bytes for floats (0xff), a large sentinel for integers.
  void poison() {
    const int byte = (dtype_ == DType::kInt32 || dtype_ == DType::kInt64) ? 0x5a : 0xff;
    cuda_check(cudaMemset(get(), byte, count_ * dtype_size(dtype_)), "poison");
  }

 private:
  DType dtype_;
  int64_t offset_;
  int64_t count_;
  void* base_ = nullptr;
};

// The scratch allocators the kernels get: plain cudaMalloc/cudaFree (the caching allocator
// is tested on its own), counting live bytes so tests can check scratch is returned.
// Process-lifetime: the GEMM keeps its workspace for the whole process.
CudaTestAllocator& scratch_allocator() {
  static CudaTestAllocator* const allocator = new CudaTestAllocator();
  return *allocator;
}
CudaTestAllocator& gemm_allocator() {
  static CudaTestAllocator* const allocator = new CudaTestAllocator();
  return *allocator;
}

void expect_scratch_returned() {
  EXPECT_EQ(scratch_allocator().stats().allocated_bytes, 0) << "scratch not returned";
}

// Skips without a device; launches on its own stream (stream()).
class CudaRowwiseGemmTest : public test::CudaStreamTest {
 protected:
  // Where the cross-entropy kernels record out-of-range targets: device 0's record.
  static gpu::AsyncErrors& errors() { return gpu::async_errors(0); }
  void cross_entropy_bad_targets(int64_t inner);
};

bool same_or_within(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;
}

// ---------------------------------------------------------------------------------------
// Reductions.

enum class Data {
  kSpread,     // uniform [-1, 2): positive mean, so lost or doubled terms show in sums
  kFewValues,  // integers 0..4: many ties (first-occurrence rules of argmax/argmin)
  kWithNaN,    // kSpread with a few NaN and +-inf
};

struct ReduceCase {
  std::string name;
  int64_t storage;               // elements of the storage the view reads
  std::vector<int64_t> shape;    // of the view
  std::vector<int64_t> strides;  // of the view (elements)
  int64_t offset = 0;            // element [0, ...] of the view
  // Output strides (elements); empty = contiguous.
  std::vector<int64_t> out_strides = {};
};

HostBuffer make_storage(DType dtype, int64_t count, Data data, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> spread(-1.0, 2.0);
  std::uniform_int_distribution<int> few(0, 4);
  std::uniform_int_distribution<int> ints(-50, 50);
  std::uniform_int_distribution<int> pick(0, 997);
  HostBuffer h(dtype, count);
  const bool integral = dtype == DType::kInt32 || dtype == DType::kInt64;
  for (int64_t i = 0; i < count; ++i) {
    double v = integral ? ints(rng) : spread(rng);
    if (dtype == DType::kBool) v = few(rng) > 2;
    if (data == Data::kFewValues) v = few(rng);
    if (data == Data::kWithNaN) {
      const int p = pick(rng);
      if (p == 0) v = std::numeric_limits<double>::quiet_NaN();
      if (p == 1) v = std::numeric_limits<double>::infinity();
      if (p == 2) v = -std::numeric_limits<double>::infinity();
    }
    h.set(i, v);
  }
  return h;
}

class CudaReduceTest : public CudaRowwiseGemmTest {
 protected:
  // Runs `op` over `mask` of the case's view on the CPU backend and on CUDA and compares.
  // Returns the GPU output (for determinism checks).
  HostBuffer check(const ReduceCase& c, ReduceOp op, uint32_t mask, DType dtype, Data data,
                   DType out_dtype) {
    SCOPED_TRACE(c.name + " op=" + std::string(op_name(op)) + " mask=" + std::to_string(mask) +
                 " dtype=" + std::string(dtype_name(dtype)));
    const HostBuffer storage = make_storage(dtype, c.storage, data, 1234 + mask);
    std::vector<int64_t> out_shape = c.shape;
    for (size_t d = 0; d < out_shape.size(); ++d) {
      if ((mask >> d) & 1u) out_shape[d] = 1;
    }
    const std::vector<int64_t> out_strides =
        c.out_strides.empty() ? contiguous_strides(out_shape) : c.out_strides;
    const int64_t outputs = product(out_shape);

    // CPU result, plus the per-output error scales sum|x| and max|x|.
    HostBuffer host_in = storage;
    const StridedView cpu_in = make_view(host_in.data(), dtype, c.shape, c.strides, c.offset);
    HostBuffer want(out_dtype, outputs);
    cpu_backend().reduce(op, make_view(want.data(), out_dtype, out_shape, out_strides), cpu_in,
                         mask);
    HostBuffer abs_storage(DType::kFloat64, c.storage);
    for (int64_t i = 0; i < c.storage; ++i) abs_storage.set(i, std::fabs(storage.get(i)));
    const StridedView abs_in =
        make_view(abs_storage.data(), DType::kFloat64, c.shape, c.strides, c.offset);
    HostBuffer abs_sum(DType::kFloat64, outputs), abs_max(DType::kFloat64, outputs);
    const bool empty = product(c.shape) == 0;
    if (!empty) {
      cpu_backend().reduce(ReduceOp::kSum,
                           make_view(abs_sum.data(), DType::kFloat64, out_shape, out_strides),
                           abs_in, mask);
      cpu_backend().reduce(ReduceOp::kMax,
                           make_view(abs_max.data(), DType::kFloat64, out_shape, out_strides),
                           abs_in, mask);
    }

    DeviceBuffer dev_in(dtype, c.storage);
    dev_in.upload(storage);
    DeviceBuffer dev_out(out_dtype, outputs);
    dev_out.poison();
    const StridedView gpu_in = make_view(dev_in.get(), dtype, c.shape, c.strides, c.offset);
    gpu::reduce(op, make_view(dev_out.get(), out_dtype, out_shape, out_strides), gpu_in, mask,
                scratch_allocator(), stream());
    sync();
    expect_scratch_returned();
    const HostBuffer got = dev_out.download();

    int64_t reduced = 1;
    for (size_t d = 0; d < c.shape.size(); ++d) {
      if ((mask >> d) & 1u) reduced *= c.shape[d];
    }
    const bool exact = op == ReduceOp::kMax || op == ReduceOp::kMin || op == ReduceOp::kArgMax ||
                       op == ReduceOp::kArgMin || !is_floating(dtype);
    int failures = 0;
    for (int64_t i = 0; i < outputs && failures < 10; ++i) {
      const double g = got.get(i), w = want.get(i);
      double tol = 0;
      if (!exact) {
        const double scale_out = 2 * unit_roundoff(out_dtype) * std::fabs(w);
        const double acc = 64 * compute_roundoff(dtype);
        if (op == ReduceOp::kSum) tol = scale_out + acc * abs_sum.get(i);
        if (op == ReduceOp::kMean) {
          tol = scale_out + acc * abs_sum.get(i) / std::max<int64_t>(reduced, 1);
        }
        if (op == ReduceOp::kLogSumExp) {
          tol = scale_out + acc * (abs_max.get(i) + std::log(static_cast<double>(reduced)) + 1);
        }
      }
      const bool ok =
          exact ? (g == w || (std::isnan(g) && std::isnan(w))) : same_or_within(g, w, tol);
      if (!ok) {
        ++failures;
        ADD_FAILURE() << "output " << i << ": got " << g << ", want " << w << " (tol " << tol
                      << ")";
      }
    }
    return got;
  }
};

const ReduceOp kFloatOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin,
                              ReduceOp::kLogSumExp};

// Every dim mask of 3-D inputs: contiguous, permuted and sliced views (row and column
// kernels, several reduced dims, collapsible and not).
TEST_F(CudaReduceTest, EveryMaskOfContiguousPermutedAndSlicedViewsMatchesCpu) {
  const std::vector<ReduceCase> cases = {
      {"contiguous", 37 * 53 * 7, {37, 53, 7}, {53 * 7, 7, 1}},
      // Memory order [7, 37, 53] viewed as [37, 53, 7].
      {"permuted", 37 * 53 * 7, {37, 53, 7}, {53, 1, 37 * 53}},
      // Every other column of a [40, 70] matrix, from element 3, as [5, 8, 33].
      {"sliced", 40 * 70, {5, 8, 33}, {8 * 70, 70, 2}, 3},
      {"long rows", 3 * 4099 * 2, {3, 4099, 2}, {4099 * 2, 2, 1}},
  };
  for (const ReduceCase& c : cases) {
    for (uint32_t mask = 1; mask < 8; ++mask) {
      for (DType t : kFloatTypes) {
        for (ReduceOp op : kFloatOps) check(c, op, mask, t, Data::kSpread, t);
      }
      for (DType t : {DType::kInt32, DType::kInt64}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
          check(c, op, mask, t, Data::kSpread, t);
        }
      }
    }
  }
}

// argmax/argmin (one reduced dim) on data full of ties, across warp/block/split boundaries.
TEST_F(CudaReduceTest, ArgMaxArgMinPickTheFirstOccurrenceLikeTheCpu) {
  const std::vector<ReduceCase> cases = {
      {"rows", 13 * 1000, {13, 1000}, {1000, 1}},
      {"block rows", 3 * 5000, {3, 5000}, {5000, 1}},
      {"split rows", 2 * 300001, {2, 300001}, {300001, 1}},
      {"columns", 1000 * 13, {1000, 13}, {13, 1}},
      {"split columns", 100000 * 3, {100000, 3}, {3, 1}},
      {"transposed", 64 * 70, {64, 70}, {1, 64}},
  };
  for (const ReduceCase& c : cases) {
    for (uint32_t mask : {1u, 2u}) {
      for (DType t : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16,
                      DType::kInt32, DType::kInt64}) {
        for (ReduceOp op : {ReduceOp::kArgMax, ReduceOp::kArgMin}) {
          check(c, op, mask, t, Data::kFewValues, DType::kInt64);
        }
      }
    }
  }
}

TEST_F(CudaReduceTest, NaNAndInfinitiesPropagateLikeTheCpu) {
  const std::vector<ReduceCase> cases = {
      {"rows", 50 * 2000, {50, 2000}, {2000, 1}},
      {"columns", 2000 * 50, {2000, 50}, {50, 1}},
  };
  for (const ReduceCase& c : cases) {
    for (uint32_t mask : {1u, 2u}) {
      for (DType t : kFloatTypes) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kArgMax,
                            ReduceOp::kArgMin, ReduceOp::kLogSumExp}) {
          const bool arg = op == ReduceOp::kArgMax || op == ReduceOp::kArgMin;
          check(c, op, mask, t, Data::kWithNaN, arg ? DType::kInt64 : t);
        }
      }
    }
  }
}

TEST_F(CudaReduceTest, LogSumExpOfAllMinusInfinityRowsIsMinusInfinity) {
  for (DType t : kFloatTypes) {
    HostBuffer h(t, 4 * 100);
    for (int64_t i = 0; i < h.count(); ++i) {
      h.set(i, i < 200 ? -std::numeric_limits<double>::infinity() : 0.5);
    }
    DeviceBuffer in(t, h.count()), out(t, 4);
    in.upload(h);
    out.poison();
    gpu::reduce(ReduceOp::kLogSumExp, make_view(out.get(), t, {4, 1}, {1, 1}),
                make_view(in.get(), t, {4, 100}, {100, 1}), 2u, scratch_allocator(), stream());
    sync();
    const HostBuffer got = out.download();
    EXPECT_EQ(got.get(0), -std::numeric_limits<double>::infinity());
    EXPECT_EQ(got.get(1), -std::numeric_limits<double>::infinity());
    EXPECT_NEAR(got.get(2), 0.5 + std::log(100.0), 4 * unit_roundoff(t) * 5);
  }
}

// Tiny and degenerate shapes: 1-element rows, a broadcast (stride 0) input, empty
// reductions, bool input, a transposed output.
TEST_F(CudaReduceTest, EdgeShapesMatchCpu) {
  const ReduceCase one_element_rows{"1-element rows", 1000, {1000, 1}, {1, 1}};
  const ReduceCase broadcast{"broadcast rows", 100, {64, 100}, {0, 1}};
  const ReduceCase empty{"empty", 0, {4, 0}, {0, 1}};
  const ReduceCase transposed_out{"transposed out", 6 * 5 * 40, {6, 5, 40},
                                  {200, 40, 1},     0,          {1, 6, 30}};
  for (DType t : kFloatTypes) {
    for (ReduceOp op : kFloatOps) {
      check(one_element_rows, op, 2u, t, Data::kSpread, t);
      check(one_element_rows, op, 1u, t, Data::kSpread, t);
      check(broadcast, op, 1u, t, Data::kSpread, t);
      check(broadcast, op, 3u, t, Data::kSpread, t);
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kLogSumExp}) {
      check(empty, op, 2u, t, Data::kSpread, t);  // 0, NaN and -inf per row
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      check(transposed_out, op, 4u, t, Data::kSpread, t);
    }
  }
  const ReduceCase bools{"bool", 300 * 77, {300, 77}, {77, 1}};
  for (uint32_t mask : {1u, 2u, 3u}) {
    check(bools, ReduceOp::kSum, mask, DType::kBool, Data::kSpread, DType::kInt64);
    check(bools, ReduceOp::kMax, mask, DType::kBool, Data::kSpread, DType::kBool);
  }
}

// Full reductions of 1e7 elements (split rows, split columns of a non-collapsible view), and
// bitwise reproducibility of a second run.
TEST_F(CudaReduceTest, FullReductionsOfTenMillionElementsAreAccurateAndDeterministic) {
  const ReduceCase flat{"flat", 10000000, {10000000}, {1}};
  const ReduceCase padded{"padded rows", 2500 * 4001, {2500, 4000}, {4001, 1}};
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kLogSumExp}) {
      const HostBuffer a = check(flat, op, 1u, t, Data::kSpread, t);
      const HostBuffer b = check(flat, op, 1u, t, Data::kSpread, t);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size_bytes()), 0) << "not deterministic";
      check(padded, op, 3u, t, Data::kSpread, t);
    }
  }
  check(flat, ReduceOp::kArgMax, 1u, DType::kFloat32, Data::kFewValues, DType::kInt64);
  check(flat, ReduceOp::kSum, 1u, DType::kInt32, Data::kSpread, DType::kInt32);
}

TEST_F(CudaReduceTest, RejectsBadArgumentsLikeTheCpu) {
  DeviceBuffer in(DType::kInt32, 12), out(DType::kInt32, 3);
  const StridedView v = make_view(in.get(), DType::kInt32, {3, 4}, {4, 1});
  const StridedView o = make_view(out.get(), DType::kInt32, {3, 1}, {1, 1});
  EXPECT_THROW(gpu::reduce(ReduceOp::kMean, o, v, 2u, scratch_allocator(), stream()), Error);
  EXPECT_THROW(gpu::reduce(ReduceOp::kArgMax, o, v, 2u, scratch_allocator(), stream()), Error);
  EXPECT_THROW(gpu::reduce(ReduceOp::kSum, o, v, 1u, scratch_allocator(), stream()), Error);
}

// ---------------------------------------------------------------------------------------
// Row-wise ops.

struct RowCase {
  int64_t rows, cols;
  int64_t offset = 0;  // elements past an aligned base: misaligns every row
};

// Widths around every kernel boundary: sub-warp groups, a warp, a block (64..512 threads),
// 16K (the register capacity for 4-byte compute, 8K for float64), tiled rows beyond; odd
// widths and offset bases take the scalar (unvectorized) path.
const RowCase kRowCases[] = {
    {1, 1},     {7, 1},     {5, 3},       {33, 31},   {64, 32},   {17, 100}, {9, 255},
    {8, 1000},  {4, 1024},  {4, 1024, 1}, {3, 1025},  {2, 2051},  {3, 4096}, {2, 8192},
    {2, 16384}, {2, 16385}, {2, 20000},   {1, 65544}, {1, 70001}, {300, 64}, {1, 16384, 3},
};

std::string row_case_str(const RowCase& c, DType t) {
  return "rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) +
         " offset=" + std::to_string(c.offset) + " dtype=" + std::string(dtype_name(t));
}

HostBuffer random_buffer(DType t, int64_t count, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostBuffer h(t, count);
  h.fill_uniform(rng, lo, hi);
  return h;
}

// Compares element-wise with per-element tolerances; reports the first few mismatches.
void expect_close(const HostBuffer& got, const HostBuffer& want,
                  const std::function<double(int64_t)>& tol, const std::string& what) {
  ASSERT_EQ(got.count(), want.count());
  int failures = 0;
  for (int64_t i = 0; i < got.count() && failures < 10; ++i) {
    if (!same_or_within(got.get(i), want.get(i), tol(i))) {
      ++failures;
      ADD_FAILURE() << what << " element " << i << ": got " << got.get(i) << ", want "
                    << want.get(i) << " (tol " << tol(i) << ")";
    }
  }
}

TEST_F(CudaRowwiseGemmTest, SoftmaxAndLogSoftmaxWithBackwardMatchCpu) {
  for (DType t : kFloatTypes) {
    for (const RowCase& c : kRowCases) {
      for (bool log : {false, true}) {
        SCOPED_TRACE(row_case_str(c, t) + (log ? " log_softmax" : " softmax"));
        const int64_t n = c.rows * c.cols;
        const HostBuffer x = random_buffer(t, n, -3, 3, 11 + n);
        const HostBuffer g = random_buffer(t, n, -1, 1, 12 + n);
        HostBuffer y(t, n), gi(t, n);
        cpu_backend().softmax({.out = y.data(),
                               .in = x.data(),
                               .dtype = t,
                               .rows = c.rows,
                               .cols = c.cols,
                               .log = log});
        cpu_backend().softmax_backward({.grad_in = gi.data(),
                                        .grad_out = g.data(),
                                        .out = y.data(),
                                        .dtype = t,
                                        .rows = c.rows,
                                        .cols = c.cols,
                                        .log = log});

        DeviceBuffer dx(t, n, c.offset), dy(t, n, c.offset), dg(t, n, c.offset),
            dgi(t, n, c.offset);
        dx.upload(x);
        dy.poison();
        gpu::softmax({.out = dy.get(),
                      .in = dx.get(),
                      .dtype = t,
                      .rows = c.rows,
                      .cols = c.cols,
                      .log = log},
                     stream());
        sync();
        const double out_eps = 2 * unit_roundoff(t), acc = 64 * compute_roundoff(t);
        std::vector<double> row_max_abs(c.rows, 0);
        for (int64_t i = 0; i < n; ++i) {
          row_max_abs[i / c.cols] = std::max(row_max_abs[i / c.cols], std::fabs(x.get(i)));
        }
        expect_close(
            dy.download(), y,
            [&](int64_t i) {
              const double w = std::fabs(y.get(i));
              return log ? out_eps * w + acc * (w + row_max_abs[i / c.cols] + 1)
                         : (out_eps + acc) * w + tiny_step(t);
            },
            "forward");

        // Backward from the CPU's forward output, so both sides see the same y.
        dy.upload(y);
        dg.upload(g);
        dgi.poison();
        gpu::softmax_backward({.grad_in = dgi.get(),
                               .grad_out = dg.get(),
                               .out = dy.get(),
                               .dtype = t,
                               .rows = c.rows,
                               .cols = c.cols,
                               .log = log},
                              stream());
        sync();
        // Error scale: sum|g * y| (softmax) or sum|g| (log-softmax) per row.
        std::vector<double> row_scale(c.rows, 0);
        for (int64_t i = 0; i < n; ++i) {
          row_scale[i / c.cols] += log ? std::fabs(g.get(i)) : std::fabs(g.get(i) * y.get(i));
        }
        expect_close(
            dgi.download(), gi,
            [&](int64_t i) {
              const double s = row_scale[i / c.cols];
              const double gv = std::fabs(g.get(i)), yv = y.get(i);
              const double scale = log ? gv + std::exp(yv) * s : std::fabs(yv) * (gv + s);
              return out_eps * std::fabs(gi.get(i)) + acc * scale + tiny_step(t);
            },
            "backward");
      }
    }
  }
}

TEST_F(CudaRowwiseGemmTest, SoftmaxIsBitwiseReproducible) {
  const DType t = DType::kFloat32;
  const int64_t rows = 64, cols = 20000;
  const HostBuffer x = random_buffer(t, rows * cols, -3, 3, 5);
  DeviceBuffer dx(t, rows * cols), dy(t, rows * cols);
  dx.upload(x);
  gpu::softmax(
      {.out = dy.get(), .in = dx.get(), .dtype = t, .rows = rows, .cols = cols, .log = false},
      stream());
  sync();
  const HostBuffer a = dy.download();
  dy.poison();
  gpu::softmax(
      {.out = dy.get(), .in = dx.get(), .dtype = t, .rows = rows, .cols = cols, .log = false},
      stream());
  sync();
  const HostBuffer b = dy.download();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size_bytes()), 0);
}

// The host inputs of one norm case. Without a residual the norm normalizes x; with one,
// x + residual, and the backward also gets grad_sum (the gradient reaching that sum).
struct NormInputs {
  const HostBuffer& x;
  const HostBuffer* residual;
  const HostBuffer& grad_out;
  const HostBuffer* grad_sum;
  const HostBuffer& weight;  // read when affine
  const HostBuffer& bias;    // read when affine and not rms
};

// The CPU backend's norm forward and backward of one case (layer or RMS norm, with or
// without the affine parameters), and the checks of the GPU's results against them, with
// tolerances from the normalized values and the CPU's statistics.
class NormReference {
 public:
  NormReference(const RowCase& c, DType t, bool rms, bool affine, double eps, const NormInputs& in)
      : sum(t, in.residual != nullptr ? c.rows * c.cols : 0),
        y(t, c.rows * c.cols),
        mean(DType::kFloat32, c.rows),
        rstd(DType::kFloat32, c.rows),
        grad_in(t, c.rows * c.cols),
        grad_weight(DType::kFloat32, c.cols),
        grad_bias(DType::kFloat32, c.cols),
        c_(c),
        t_(t),
        rms_(rms),
        affine_(affine),
        in_(in),
        out_eps_(2 * unit_roundoff(t)),
        acc_(64 * compute_roundoff(t)),
        mean_abs_(c.rows, 0) {
    const bool residual = in.residual != nullptr;
    const void* const wp = affine ? in.weight.data() : nullptr;
    const void* const bp = affine && !rms ? in.bias.data() : nullptr;
    cpu_backend().norm({.out = y.data(),
                        .in = in.x.data(),
                        .residual = residual ? in.residual->data() : nullptr,
                        .sum = residual ? sum.data() : nullptr,
                        .weight = wp,
                        .bias = bp,
                        .mean = elements<float>(mean),
                        .rstd = elements<float>(rstd),
                        .dtype = t,
                        .rows = c.rows,
                        .cols = c.cols,
                        .eps = eps,
                        .rms = rms});
    cpu_backend().norm_backward({.grad_in = grad_in.data(),
                                 .grad_weight = elements<float>(grad_weight),
                                 .grad_bias = elements<float>(grad_bias),
                                 .grad_out = in.grad_out.data(),
                                 .grad_sum = in.grad_sum != nullptr ? in.grad_sum->data() : nullptr,
                                 .in = normalized().data(),
                                 .mean = elements<float>(mean),
                                 .rstd = elements<float>(rstd),
                                 .weight = wp,
                                 .dtype = t,
                                 .rows = c.rows,
                                 .cols = c.cols,
                                 .rms = rms});
    for (int64_t i = 0; i < c.rows * c.cols; ++i) {
      mean_abs_[i / c.cols] += std::fabs(normalized().get(i)) / c.cols;
    }
  }

  // The GPU's forward output, mean (layer norm only) and rstd against the CPU's.
  void expect_forward(const HostBuffer& got_y, const DeviceBuffer& got_mean,
                      const DeviceBuffer& got_rstd) const {
    expect_close(
        got_y, y,
        [&](int64_t i) {
          const int64_t r = i / c_.cols;
          const double bias = affine_ && !rms_ ? std::fabs(in_.bias.get(i % c_.cols)) : 0.0;
          return out_eps_ * std::fabs(y.get(i)) + tiny_step(t_) +
                 acc_ *
                     ((std::fabs(xhat(i)) + rstd.get(r) * mean_abs_[r] + 1) * std::fabs(weight(i)) +
                      bias);
        },
        "forward");
    if (!rms_) {
      expect_close(
          got_mean.download(), mean, [&](int64_t r) { return acc_ * mean_abs_[r]; }, "mean");
    }
    expect_close(
        got_rstd.download(), rstd, [&](int64_t r) { return acc_ * (rstd.get(r) + 1e-30); }, "rstd");
  }

  // The GPU's grad_in, grad_weight and grad_bias against the CPU's.
  void expect_backward(const DeviceBuffer& got_grad_in, const DeviceBuffer& got_grad_weight,
                       const DeviceBuffer& got_grad_bias) const {
    const HostBuffer& go = in_.grad_out;
    const int64_t n = c_.rows * c_.cols;
    std::vector<double> mean_g(c_.rows, 0), mean_gx(c_.rows, 0);
    for (int64_t i = 0; i < n; ++i) {
      const double gv = go.get(i) * weight(i);
      mean_g[i / c_.cols] += std::fabs(gv) / c_.cols;
      mean_gx[i / c_.cols] += std::fabs(gv * xhat(i)) / c_.cols;
    }
    expect_close(
        got_grad_in.download(), grad_in,
        [&](int64_t i) {
          const int64_t r = i / c_.cols;
          const double gv = std::fabs(go.get(i) * weight(i));
          const double xh = std::fabs(xhat(i)) + rstd.get(r) * mean_abs_[r] + 1;
          double tol = out_eps_ * std::fabs(grad_in.get(i)) + tiny_step(t_);
          // grad_sum is added into grad_in: one more rounding on its scale.
          if (in_.grad_sum != nullptr) tol += acc_ * std::fabs(in_.grad_sum->get(i));
          return tol + acc_ * rstd.get(r) * (gv + mean_g[r] + xh * (mean_gx[r] + gv));
        },
        "grad_in");
    std::vector<double> col_gx(c_.cols, 0), col_g(c_.cols, 0);
    for (int64_t i = 0; i < n; ++i) {
      col_gx[i % c_.cols] += std::fabs(go.get(i) * xhat(i));
      col_g[i % c_.cols] += std::fabs(go.get(i));
    }
    expect_close(
        got_grad_weight.download(), grad_weight, [&](int64_t j) { return acc_ * col_gx[j]; },
        "grad_weight");
    expect_close(
        got_grad_bias.download(), grad_bias, [&](int64_t j) { return acc_ * col_g[j]; },
        "grad_bias");
  }

  HostBuffer sum;  // x + residual (with a residual only)
  HostBuffer y, mean, rstd;
  HostBuffer grad_in, grad_weight, grad_bias;

 private:
  // What the norm normalizes: x, or the residual sum.
  const HostBuffer& normalized() const { return in_.residual != nullptr ? sum : in_.x; }
  double xhat(int64_t i) const {
    const int64_t r = i / c_.cols;
    return (normalized().get(i) - (rms_ ? 0.0 : mean.get(r))) * rstd.get(r);
  }
  double weight(int64_t i) const { return affine_ ? in_.weight.get(i % c_.cols) : 1.0; }

  RowCase c_;
  DType t_;
  bool rms_, affine_;
  NormInputs in_;
  double out_eps_, acc_;          // tolerance units: output rounding, compute rounding
  std::vector<double> mean_abs_;  // per row: mean |normalized value|
};

// Calls run(c, t, rms, affine) for every float dtype, case and norm variant (layer or RMS
// norm, with or without the affine parameters), under a trace that names them.
template <class Run>
void for_each_norm_variant(std::span<const RowCase> cases, const Run& run) {
  for (DType t : kFloatTypes) {
    for (const RowCase& c : cases) {
      for (int variant = 0; variant < 4; ++variant) {
        const bool rms = variant & 1, affine = variant & 2;
        SCOPED_TRACE(row_case_str(c, t) + (rms ? " rms" : " layer") + (affine ? " affine" : ""));
        run(c, t, rms, affine);
      }
    }
  }
}

TEST_F(CudaRowwiseGemmTest, LayerAndRmsNormWithBackwardMatchCpu) {
  // {2700, 1024} .. {150, 20000} give the fused backward's blocks several rows each (its grid
  // is what the device holds at once): every chunks-a-thread variant, double-buffered and
  // reloaded in place, and the column sums over many block partials. {3, 30000} and
  // {2, 32768}: 16-bit rows whose partials exceed a block's shared memory, which must fall
  // back to the unfused path instead of failing to launch.
  const RowCase extra[] = {{3000, 40},   {5, 1000},   {2048, 3},    {2700, 1024}, {600, 8192},
                           {300, 16384}, {150, 20000}, {3, 30000}, {2, 32768}};
  std::vector<RowCase> cases(std::begin(kRowCases), std::end(kRowCases));
  cases.insert(cases.end(), std::begin(extra), std::end(extra));
  for_each_norm_variant(cases, [&](const RowCase& c, DType t, bool rms, bool affine) {
    const int64_t n = c.rows * c.cols;
    const double eps = 1e-5;
    const HostBuffer x = random_buffer(t, n, -2, 3, 21 + n);
    const HostBuffer go = random_buffer(t, n, -1, 1, 22 + n);
    const HostBuffer w = random_buffer(t, c.cols, 0.5, 1.5, 23);
    const HostBuffer b = random_buffer(t, c.cols, -0.5, 0.5, 24);
    const NormReference ref(c, t, rms, affine, eps, {x, nullptr, go, nullptr, w, b});

    DeviceBuffer dx(t, n, c.offset), dy(t, n, c.offset), dw(t, c.cols, c.offset),
        db(t, c.cols, c.offset), dmean(DType::kFloat32, c.rows), drstd(DType::kFloat32, c.rows);
    dx.upload(x);
    dw.upload(w);
    db.upload(b);
    dy.poison();
    dmean.poison();
    drstd.poison();
    gpu::norm({.out = dy.get(),
               .in = dx.get(),
               .weight = affine ? dw.get() : nullptr,
               .bias = affine && !rms ? db.get() : nullptr,
               .mean = static_cast<float*>(dmean.get()),
               .rstd = static_cast<float*>(drstd.get()),
               .dtype = t,
               .rows = c.rows,
               .cols = c.cols,
               .eps = eps,
               .rms = rms},
              stream());
    sync();
    ref.expect_forward(dy.download(), dmean, drstd);

    // Backward with the CPU's statistics, so both sides see the same mean and rstd.
    DeviceBuffer dgo(t, n, c.offset), dgi(t, n, c.offset), dgw(DType::kFloat32, c.cols),
        dgb(DType::kFloat32, c.cols);
    dmean.upload(ref.mean);
    drstd.upload(ref.rstd);
    dgo.upload(go);
    dgi.poison();
    dgw.poison();
    dgb.poison();
    gpu::norm_backward({.grad_in = dgi.get(),
                        .grad_weight = static_cast<float*>(dgw.get()),
                        .grad_bias = static_cast<float*>(dgb.get()),
                        .grad_out = dgo.get(),
                        .in = dx.get(),
                        .mean = static_cast<const float*>(dmean.get()),
                        .rstd = static_cast<const float*>(drstd.get()),
                        .weight = affine ? dw.get() : nullptr,
                        .dtype = t,
                        .rows = c.rows,
                        .cols = c.cols,
                        .rms = rms},
                       scratch_allocator(), stream());
    sync();
    expect_scratch_returned();
    ref.expect_backward(dgi, dgw, dgb);
  });
}

TEST_F(CudaRowwiseGemmTest, NormBackwardOverNoRowsZeroesTheParameterGradients) {
  DeviceBuffer dgw(DType::kFloat32, 10), dgb(DType::kFloat32, 10), dummy(DType::kFloat32, 1);
  dgw.poison();
  dgb.poison();
  gpu::norm_backward({.grad_weight = static_cast<float*>(dgw.get()),
                      .grad_bias = static_cast<float*>(dgb.get()),
                      .grad_out = dummy.get(),
                      .in = dummy.get(),
                      .mean = static_cast<const float*>(dummy.get()),
                      .rstd = static_cast<const float*>(dummy.get()),
                      .dtype = DType::kFloat32,
                      .rows = 0,
                      .cols = 10,
                      .rms = false},
                     scratch_allocator(), stream());
  sync();
  for (const DeviceBuffer* b : {&dgw, &dgb}) {
    const HostBuffer h = b->download();
    for (int64_t j = 0; j < 10; ++j) EXPECT_EQ(h.get(j), 0.0);
  }
}

// ---------------------------------------------------------------------------------------
// GEMM.

double gelu_tanh_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

struct GemmCase {
  int64_t m, n, k;
  int64_t batch = 1;
  bool broadcast_b = false;  // stride_b = 0
  int64_t pad = 0;           // extra elements per row of every stored matrix (lda > cols)
  double alpha = 1, beta = 0;
  bool bias = false, gelu = false;
  bool nan_in_a = false;  // with alpha == 0 or k == 0: A must not be read
};

std::string gemm_case_str(const GemmCase& c, DType t, bool ta, bool tb, bool tf32) {
  return "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
         " batch=" + std::to_string(c.batch) + (c.broadcast_b ? " stride_b=0" : "") +
         " pad=" + std::to_string(c.pad) + " alpha=" + std::to_string(c.alpha) +
         " beta=" + std::to_string(c.beta) + (c.bias ? " bias" : "") + (c.gelu ? " gelu" : "") +
         " trans_a=" + std::to_string(ta) + " trans_b=" + std::to_string(tb) +
         " dtype=" + std::string(dtype_name(t)) + (tf32 ? " tf32" : "");
}

class CudaGemmTest : public CudaRowwiseGemmTest {
 protected:
  void check(const GemmCase& c, DType t, bool ta, bool tb, bool tf32 = false) {
    SCOPED_TRACE(gemm_case_str(c, t, ta, tb, tf32));
    // Stored shapes (row-major): A is m x k (k x m transposed), B is k x n (n x k).
    const int64_t a_rows = ta ? c.k : c.m, a_cols = ta ? c.m : c.k;
    const int64_t b_rows = tb ? c.n : c.k, b_cols = tb ? c.k : c.n;
    const int64_t lda = std::max<int64_t>(a_cols, 1) + c.pad;
    const int64_t ldb = std::max<int64_t>(b_cols, 1) + c.pad;
    const int64_t ldc = c.n + c.pad;
    const int64_t stride_a = a_rows * lda + 7;  // gaps between batch entries
    const int64_t stride_b = c.broadcast_b ? 0 : b_rows * ldb + 5;
    const int64_t stride_c = c.m * ldc + 3;
    const int64_t a_count = stride_a * c.batch, b_count = stride_b * (c.batch - 1) + b_rows * ldb;
    const int64_t c_count = stride_c * c.batch;
    HostBuffer a = random_buffer(t, a_count, -1, 1, 31 + c.m);
    const HostBuffer b = random_buffer(t, b_count, -1, 1, 32 + c.n);
    const HostBuffer c0 = random_buffer(t, c_count, -1, 1, 33 + c.k);
    const HostBuffer bias = random_buffer(t, c.n, -0.5, 0.5, 34);
    if (c.nan_in_a) {
      for (int64_t i = 0; i < a_count; ++i) a.set(i, std::numeric_limits<double>::quiet_NaN());
    }

    DeviceBuffer da(t, a_count), db(t, b_count), dc(t, c_count), dbias(t, c.n);
    da.upload(a);
    db.upload(b);
    dbias.upload(bias);
    if (c.beta == 0) {
      dc.poison();  // beta == 0: C is not read, NaN must not survive
    } else {
      dc.upload(c0);
    }
    const HostBuffer before = dc.download();
    GemmArgs g;
    g.dtype = t;
    g.trans_a = ta;
    g.trans_b = tb;
    g.m = c.m;
    g.n = c.n;
    g.k = c.k;
    g.a = da.get();
    g.b = db.get();
    g.c = dc.get();
    g.lda = lda;
    g.ldb = ldb;
    g.ldc = ldc;
    g.batch = c.batch;
    g.stride_a = stride_a;
    g.stride_b = stride_b;
    g.stride_c = stride_c;
    g.alpha = c.alpha;
    g.beta = c.beta;
    g.bias = c.bias ? dbias.get() : nullptr;
    g.gelu = c.gelu;
    g.allow_tf32 = tf32;
    gpu::gemm(g, gemm_allocator(), stream());
    sync();
    const HostBuffer got = dc.download();

    // float64 reference from the stored (rounded) inputs.
    // TF32 rounds each input to 11 significant bits (relative error <= 2^-11 per input);
    // the accumulation itself is float32 (float64 for float64).
    const double input_eps = tf32 ? std::ldexp(1.0, -11) : 0.0;
    int failures = 0;
    std::vector<bool> written(c_count, false);
    for (int64_t e = 0; e < c.batch; ++e) {
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          double s = 0, magnitude = 0;
          if (c.alpha != 0) {
            for (int64_t p = 0; p < c.k; ++p) {
              const double av = a.get(e * stride_a + (ta ? p * lda + i : i * lda + p));
              const double bv = b.get(e * stride_b + (tb ? j * ldb + p : p * ldb + j));
              s += av * bv;
              magnitude += std::fabs(av * bv);
            }
          }
          const int64_t at = e * stride_c + i * ldc + j;
          written[at] = true;
          double want = c.alpha * s;
          magnitude = std::fabs(c.alpha) * magnitude;
          if (c.beta != 0) {
            want += c.beta * c0.get(at);
            magnitude += std::fabs(c.beta * c0.get(at));
          }
          // cuBLASLt may round alpha*AB + beta*C to the storage type before an epilogue
          // adds the bias (seen for bf16 on an H100), as our unfused epilogue does too:
          // one more rounding, of the pre-epilogue value, which can exceed |want| when the
          // bias cancels it.
          const double pre_epilogue = want;
          if (c.bias) {
            want += bias.get(j);
            magnitude += std::fabs(bias.get(j));
          }
          if (c.gelu) want = gelu_tanh_ref(want);  // |gelu'| <= 1.13: same error scale
          const double epilogue_rounding =
              c.bias || c.gelu ? 2 * unit_roundoff(t) * std::fabs(pre_epilogue) : 0.0;
          const double tol = 2 * unit_roundoff(t) * std::fabs(want) + epilogue_rounding +
                             (4 * input_eps + 2 * (c.k + 16) * compute_roundoff(t)) * magnitude +
                             tiny_step(t);
          if (!same_or_within(got.get(at), want, tol) && failures++ < 10) {
            ADD_FAILURE() << "C[" << e << "][" << i << "][" << j << "]: got " << got.get(at)
                          << ", want " << want << " (tol " << tol << ")";
          }
        }
      }
    }
    // Padding and gaps between batch entries are untouched.
    for (int64_t i = 0; i < c_count && failures < 10; ++i) {
      if (written[i]) continue;
      const double g0 = got.get(i), b0 = before.get(i);
      if (!(g0 == b0 || (std::isnan(g0) && std::isnan(b0)))) {
        ++failures;
        ADD_FAILURE() << "C element " << i << " outside the matrices changed";
      }
    }
  }
};

TEST_F(CudaGemmTest, TransposesLeadingDimsBatchStridesBetaAndEpiloguesMatchFloat64) {
  const std::vector<GemmCase> cases = {
      {37, 53, 29},
      {1, 17, 64},
      {64, 1, 33},
      {128, 96, 300, 1, false, 0, 1.0, 0.0},
      {37, 53, 29, 3, false, 3, -1.5, 0.5},
      {37, 53, 29, 3, true, 2, 1.0, 0.0},
      {40, 24, 16, 2, true, 0, 0.75, 1.0, true, false},
      {33, 65, 47, 1, false, 1, 1.0, 0.5, true, true},
      {32, 64, 64, 2, false, 0, 1.0, 0.0, false, true},
      {32, 64, 64, 1, false, 0, 1.0, 0.0, true, true},
  };
  for (DType t : kFloatTypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (const GemmCase& c : cases) check(c, t, ta, tb);
      }
    }
  }
  for (const GemmCase& c : cases) check(c, DType::kFloat32, false, true, /*tf32=*/true);
}

TEST_F(CudaGemmTest, NoProductTermScalesCWithoutReadingAOrB) {
  for (DType t : kFloatTypes) {
    GemmCase alpha_zero{20, 30, 10, 2, false, 1, 0.0, 0.5};
    alpha_zero.nan_in_a = true;
    check(alpha_zero, t, false, false);
    GemmCase k_zero{20, 30, 0, 2, false, 1, 1.0, 0.0, true, true};
    check(k_zero, t, false, false);
    GemmCase k_zero_beta{20, 30, 0, 1, false, 0, 1.0, 2.0};
    check(k_zero_beta, t, true, true);
  }
}

TEST_F(CudaGemmTest, RejectsBadLeadingDimsAndOverlappingBatchOutputs) {
  DeviceBuffer a(DType::kFloat32, 64), b(DType::kFloat32, 64), c(DType::kFloat32, 64);
  GemmArgs g;
  g.m = g.n = g.k = 4;
  g.a = a.get();
  g.b = b.get();
  g.c = c.get();
  g.lda = 3;  // < k
  g.ldb = g.ldc = 4;
  EXPECT_THROW(gpu::gemm(g, gemm_allocator(), stream()), Error);
  g.lda = 4;
  g.batch = 2;
  g.stride_a = g.stride_b = 16;
  g.stride_c = 0;
  EXPECT_THROW(gpu::gemm(g, gemm_allocator(), stream()), Error);
  g.dtype = DType::kInt32;
  g.batch = 1;
  EXPECT_THROW(gpu::gemm(g, gemm_allocator(), stream()), Error);
}

// ---------------------------------------------------------------------------------------
// Residual-fused norm and cross-entropy.

// Norm widths around the register capacity (16K, 8K for float64) and far beyond it, where
// the residual sum is written in a pre-pass and read back; offsets take the scalar path.
const RowCase kResidualNormCases[] = {{7, 1},     {5, 3},      {33, 31},     {300, 64},
                                      {8, 1000},  {4, 1024, 1}, {2, 8192},   {2, 16384},
                                      {2, 16385}, {1, 50000},  {1, 200000}, {1, 50000, 3}};

TEST_F(CudaRowwiseGemmTest, NormWithResidualAndGradSumMatchCpu) {
  for_each_norm_variant(kResidualNormCases, [&](const RowCase& c, DType t, bool rms, bool affine) {
    const int64_t n = c.rows * c.cols;
    const double eps = 1e-5;
    const HostBuffer x = random_buffer(t, n, -2, 3, 31 + n);
    const HostBuffer res = random_buffer(t, n, -1.5, 1, 32 + n);
    const HostBuffer go = random_buffer(t, n, -1, 1, 33 + n);
    const HostBuffer gs = random_buffer(t, n, -1, 1, 34 + n);
    const HostBuffer w = random_buffer(t, c.cols, 0.5, 1.5, 35);
    const HostBuffer b = random_buffer(t, c.cols, -0.5, 0.5, 36);
    const NormReference ref(c, t, rms, affine, eps, {x, &res, go, &gs, w, b});

    DeviceBuffer dx(t, n, c.offset), dres(t, n, c.offset), dsum(t, n, c.offset), dy(t, n, c.offset),
        dw(t, c.cols, c.offset), db(t, c.cols, c.offset), dmean(DType::kFloat32, c.rows),
        drstd(DType::kFloat32, c.rows);
    dx.upload(x);
    dres.upload(res);
    dw.upload(w);
    db.upload(b);
    for (DeviceBuffer* p : {&dsum, &dy, &dmean, &drstd}) p->poison();
    void* const dwp = affine ? dw.get() : nullptr;
    void* const dbp = affine && !rms ? db.get() : nullptr;
    gpu::norm({.out = dy.get(),
               .in = dx.get(),
               .residual = dres.get(),
               .sum = dsum.get(),
               .weight = dwp,
               .bias = dbp,
               .mean = static_cast<float*>(dmean.get()),
               .rstd = static_cast<float*>(drstd.get()),
               .dtype = t,
               .rows = c.rows,
               .cols = c.cols,
               .eps = eps,
               .rms = rms},
              stream());
    sync();
    // Both sides add in the compute type and round once to t: the sums are identical.
    expect_close(
        dsum.download(), ref.sum, [](int64_t) { return 0.0; }, "sum");
    const HostBuffer got_y = dy.download();
    ref.expect_forward(got_y, dmean, drstd);

    // The sum written over the residual (an in-place residual stream): same results.
    DeviceBuffer dstream(t, n, c.offset), dy2(t, n, c.offset);
    dstream.upload(res);
    dy2.poison();
    gpu::norm({.out = dy2.get(),
               .in = dx.get(),
               .residual = dstream.get(),
               .sum = dstream.get(),
               .weight = dwp,
               .bias = dbp,
               .dtype = t,
               .rows = c.rows,
               .cols = c.cols,
               .eps = eps,
               .rms = rms},
              stream());
    sync();
    expect_close(
        dstream.download(), ref.sum, [](int64_t) { return 0.0; }, "in-place sum");
    expect_close(
        dy2.download(), got_y, [](int64_t) { return 0.0; }, "in-place forward");

    // Backward from the CPU's sum and statistics, so both sides see the same inputs.
    DeviceBuffer dgo(t, n, c.offset), dgs(t, n, c.offset), dgi(t, n, c.offset),
        dgw(DType::kFloat32, c.cols), dgb(DType::kFloat32, c.cols);
    dsum.upload(ref.sum);
    dmean.upload(ref.mean);
    drstd.upload(ref.rstd);
    dgo.upload(go);
    dgs.upload(gs);
    for (DeviceBuffer* p : {&dgi, &dgw, &dgb}) p->poison();
    gpu::norm_backward({.grad_in = dgi.get(),
                        .grad_weight = static_cast<float*>(dgw.get()),
                        .grad_bias = static_cast<float*>(dgb.get()),
                        .grad_out = dgo.get(),
                        .grad_sum = dgs.get(),
                        .in = dsum.get(),
                        .mean = static_cast<const float*>(dmean.get()),
                        .rstd = static_cast<const float*>(drstd.get()),
                        .weight = dwp,
                        .dtype = t,
                        .rows = c.rows,
                        .cols = c.cols,
                        .rms = rms},
                       scratch_allocator(), stream());
    sync();
    expect_scratch_returned();
    ref.expect_backward(dgi, dgw, dgb);
  });
}

TEST_F(CudaRowwiseGemmTest, NormNeedsResidualAndSumTogether) {
  DeviceBuffer x(DType::kFloat32, 8), y(DType::kFloat32, 8), stats(DType::kFloat32, 2);
  float* const s = static_cast<float*>(stats.get());
  EXPECT_THROW(gpu::norm({.out = y.get(),
                          .in = x.get(),
                          .residual = x.get(),
                          .mean = s,
                          .rstd = s,
                          .dtype = DType::kFloat32,
                          .rows = 2,
                          .cols = 4,
                          .eps = 1e-5,
                          .rms = false},
                         stream()),
               Error);
  EXPECT_THROW(gpu::norm({.out = y.get(),
                          .in = x.get(),
                          .sum = y.get(),
                          .mean = s,
                          .rstd = s,
                          .dtype = DType::kFloat32,
                          .rows = 2,
                          .cols = 4,
                          .eps = 1e-5,
                          .rms = false},
                         stream()),
               Error);
}

struct CrossEntropyCase {
  int64_t rows, cols;
  int64_t offset = 0;  // misaligns the logits (scalar path)
  int64_t ignore_index = -100;
};

// Group sizes from one lane to a warp, block-per-row rows, and vocabularies of 50K to 256K
// (many register tiles per thread); ignore_index 3 is also a real class.
const CrossEntropyCase kCrossEntropyCases[] = {
    {1, 1},       {7, 5},         {33, 31},     {300, 64},       {9, 255},
    {8, 1000},    {4, 1024, 1},   {3, 1025},    {2, 16384},      {2, 16385},
    {6, 300, 0, 3}, {3, 50000},   {2, 200000},  {2, 200000, 1},  {1, 262144}};

// Logits in [-8, 8) with a few -inf (never a target), targets spread over the classes,
// every third row (from the second) ignored.
struct CrossEntropyInputs {
  HostBuffer logits;
  HostBuffer targets;
};

CrossEntropyInputs cross_entropy_inputs(DType t, const CrossEntropyCase& c, uint64_t seed) {
  CrossEntropyInputs in{random_buffer(t, c.rows * c.cols, -8, 8, seed),
                        HostBuffer(DType::kInt64, c.rows)};
  for (int64_t i = 5; i < c.rows * c.cols; i += 997) in.logits.set(i, -INFINITY);
  for (int64_t r = 0; r < c.rows; ++r) {
    int64_t target = (r * 7919 + 11) % c.cols;
    while (std::isinf(in.logits.get(r * c.cols + target))) target = (target + 1) % c.cols;
    if (r % 3 == 1) target = c.ignore_index;
    in.targets.set(r, static_cast<double>(target));
  }
  if (c.ignore_index >= 0 && c.rows > 2) in.targets.set(2, static_cast<double>(c.ignore_index));
  return in;
}

TEST_F(CudaRowwiseGemmTest, CrossEntropyForwardAndBackwardMatchCpu) {
  for (DType t : kFloatTypes) {
    for (const CrossEntropyCase& c : kCrossEntropyCases) {
      SCOPED_TRACE("rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) +
                   " offset=" + std::to_string(c.offset) +
                   " ignore_index=" + std::to_string(c.ignore_index) +
                   " dtype=" + std::string(dtype_name(t)));
      const int64_t n = c.rows * c.cols;
      const DType acc_t = accumulation_dtype(t);
      const CrossEntropyInputs in = cross_entropy_inputs(t, c, 41 + n);
      const auto* targets = elements<int64_t>(in.targets);
      HostBuffer loss(acc_t, c.rows), lse(acc_t, c.rows);
      cpu_backend().cross_entropy({.loss = loss.data(),
                                   .lse = lse.data(),
                                   .logits = in.logits.data(),
                                   .targets = targets,
                                   .dtype = t,
                                   .rows = c.rows,
                                   .cols = c.cols,
                                   .inner = 1,
                                   .ignore_index = c.ignore_index});

      DeviceBuffer dx(t, n, c.offset), dtargets(DType::kInt64, c.rows), dloss(acc_t, c.rows),
          dlse(acc_t, c.rows);
      dx.upload(in.logits);
      dtargets.upload(in.targets);
      dloss.poison();
      dlse.poison();
      const auto* dtp = static_cast<const int64_t*>(dtargets.get());
      gpu::cross_entropy({.loss = dloss.get(),
                          .lse = dlse.get(),
                          .logits = dx.get(),
                          .targets = dtp,
                          .dtype = t,
                          .rows = c.rows,
                          .cols = c.cols,
                          .inner = 1,
                          .ignore_index = c.ignore_index},
                         errors(), stream());
      sync();
      const double out_eps = 2 * unit_roundoff(t), acc = 64 * compute_roundoff(t);
      // Error scale of a logsumexp: the largest |logit| and the length of the sum.
      std::vector<double> scale(c.rows, 0);
      for (int64_t i = 0; i < n; ++i) {
        const double v = std::fabs(in.logits.get(i));
        if (!std::isinf(v)) scale[i / c.cols] = std::max(scale[i / c.cols], v);
      }
      for (int64_t r = 0; r < c.rows; ++r) scale[r] += std::log(static_cast<double>(c.cols)) + 1;
      expect_close(
          dlse.download(), lse, [&](int64_t r) { return acc * scale[r]; }, "lse");
      // Ignored rows must be exactly 0: the reference there is 0 with no tolerance.
      expect_close(
          dloss.download(), loss, [&](int64_t r) { return acc * scale[r]; }, "loss");

      // Backward from the CPU's lse, with a per-row grad_loss and a broadcast one.
      const HostBuffer grad_loss = random_buffer(acc_t, c.rows, -2, 2, 42 + n);
      DeviceBuffer dgrad_loss(acc_t, c.rows), dgx(t, n, c.offset);
      dgrad_loss.upload(grad_loss);
      dlse.upload(lse);
      for (int64_t stride : {1, 0}) {
        SCOPED_TRACE("grad_loss_stride=" + std::to_string(stride));
        HostBuffer gx(t, n);
        cpu_backend().cross_entropy_backward({.grad_logits = gx.data(),
                                              .grad_loss = grad_loss.data(),
                                              .grad_loss_stride = stride,
                                              .logits = in.logits.data(),
                                              .lse = lse.data(),
                                              .targets = targets,
                                              .dtype = t,
                                              .rows = c.rows,
                                              .cols = c.cols,
                                              .inner = 1,
                                              .ignore_index = c.ignore_index});
        dgx.poison();
        gpu::cross_entropy_backward({.grad_logits = dgx.get(),
                                     .grad_loss = dgrad_loss.get(),
                                     .grad_loss_stride = stride,
                                     .logits = dx.get(),
                                     .lse = dlse.get(),
                                     .targets = dtp,
                                     .dtype = t,
                                     .rows = c.rows,
                                     .cols = c.cols,
                                     .inner = 1,
                                     .ignore_index = c.ignore_index},
                                    errors(), stream());
        sync();
        expect_close(
            dgx.download(), gx,
            [&](int64_t i) {
              const int64_t r = i / c.cols;
              const double x = in.logits.get(i), l = lse.get(r);
              if (std::isinf(x)) return 0.0;  // exp(-inf - lse) is exactly 0
              const double p = std::exp(x - l);
              const double g = std::fabs(grad_loss.get(stride * r));
              // exp(x - lse) rounds the difference (|x| + |lse|) before the exponential.
              return out_eps * std::fabs(gx.get(i)) + tiny_step(t) +
                     acc * g * p * (std::fabs(x) + std::fabs(l) + 1);
            },
            "grad_logits");
      }
    }
  }
}

// Logits [outer, cols, inner] (PyTorch's [N, C, d...]): the class-strided kernels (one
// thread per position) against the CPU's, on many positions with few classes, a vocabulary
// with a few positions, and a partial last block of threads.
TEST_F(CudaRowwiseGemmTest, CrossEntropyWithAClassStrideMatchesCpu) {
  struct Case {
    int64_t outer, cols, inner;
  };
  for (const Case& c : {Case{2, 1000, 37}, Case{1, 50000, 3}, Case{3, 5, 4099}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE("outer=" + std::to_string(c.outer) + " cols=" + std::to_string(c.cols) +
                   " inner=" + std::to_string(c.inner) + " dtype=" + std::string(dtype_name(t)));
      const int64_t rows = c.outer * c.inner, n = rows * c.cols;
      const DType acc_t = accumulation_dtype(t);
      const HostBuffer x = random_buffer(t, n, -8, 8, 61 + n);
      HostBuffer targets(DType::kInt64, rows);
      for (int64_t r = 0; r < rows; ++r) {
        targets.set(r, r % 3 == 1 ? -100.0 : static_cast<double>((r * 7919 + 11) % c.cols));
      }
      const auto* tp = elements<int64_t>(targets);
      HostBuffer loss(acc_t, rows), lse(acc_t, rows), gx(t, n);
      const HostBuffer grad_loss = random_buffer(acc_t, rows, -2, 2, 62 + n);
      cpu_backend().cross_entropy({.loss = loss.data(),
                                   .lse = lse.data(),
                                   .logits = x.data(),
                                   .targets = tp,
                                   .dtype = t,
                                   .rows = rows,
                                   .cols = c.cols,
                                   .inner = c.inner,
                                   .ignore_index = -100});
      cpu_backend().cross_entropy_backward({.grad_logits = gx.data(),
                                            .grad_loss = grad_loss.data(),
                                            .grad_loss_stride = 1,
                                            .logits = x.data(),
                                            .lse = lse.data(),
                                            .targets = tp,
                                            .dtype = t,
                                            .rows = rows,
                                            .cols = c.cols,
                                            .inner = c.inner,
                                            .ignore_index = -100});

      DeviceBuffer dx(t, n), dtargets(DType::kInt64, rows), dloss(acc_t, rows),
          dlse(acc_t, rows), dgrad_loss(acc_t, rows), dgx(t, n);
      dx.upload(x);
      dtargets.upload(targets);
      dgrad_loss.upload(grad_loss);
      dloss.poison();
      dlse.poison();
      dgx.poison();
      const auto* dtp = static_cast<const int64_t*>(dtargets.get());
      gpu::cross_entropy({.loss = dloss.get(),
                          .lse = dlse.get(),
                          .logits = dx.get(),
                          .targets = dtp,
                          .dtype = t,
                          .rows = rows,
                          .cols = c.cols,
                          .inner = c.inner,
                          .ignore_index = -100},
                         errors(), stream());
      sync();
      dlse.upload(lse);  // the backward from the CPU's lse, as in the row-major test
      gpu::cross_entropy_backward({.grad_logits = dgx.get(),
                                   .grad_loss = dgrad_loss.get(),
                                   .grad_loss_stride = 1,
                                   .logits = dx.get(),
                                   .lse = dlse.get(),
                                   .targets = dtp,
                                   .dtype = t,
                                   .rows = rows,
                                   .cols = c.cols,
                                   .inner = c.inner,
                                   .ignore_index = -100},
                                  errors(), stream());
      sync();
      const double out_eps = 2 * unit_roundoff(t), acc = 64 * compute_roundoff(t);
      const double scale = 8 + std::log(static_cast<double>(c.cols)) + 1;
      expect_close(
          dloss.download(), loss, [&](int64_t) { return acc * scale; }, "loss");
      expect_close(
          dgx.download(), gx,
          [&](int64_t e) {
            const int64_t r = e / (c.cols * c.inner) * c.inner + e % c.inner;
            const double p = std::exp(x.get(e) - lse.get(r));
            return out_eps * std::fabs(gx.get(e)) + tiny_step(t) +
                   acc * std::fabs(grad_loss.get(r)) * p * (std::fabs(x.get(e)) + scale + 1);
          },
          "grad_logits");
    }
  }
}

// Device targets are not bounds-checked by the tensor layer, so the kernels must not trust
// them: an out-of-range target gives its row a NaN loss and NaN gradients, reads nothing
// outside the row, and is recorded as an asynchronous error that the next synchronization
// through the library raises. Row-major and class-strided (inner 2: two positions per
// sample, the second sample's first position bad) layouts alike.
TEST_F(CudaRowwiseGemmTest, CrossEntropyOutOfRangeTargetsGiveNaNRows) {
  for (int64_t inner : {1, 2}) {
    SCOPED_TRACE("inner=" + std::to_string(inner));
    cross_entropy_bad_targets(inner);
  }
}

void CudaRowwiseGemmTest::cross_entropy_bad_targets(int64_t inner) {
  const DType t = DType::kFloat32;
  const int64_t rows = 4, cols = 40;
  const HostBuffer x = random_buffer(t, rows * cols, -3, 3, 51);
  HostBuffer targets(DType::kInt64, rows);
  const int64_t values[rows] = {3, cols, -1, -100};
  for (int64_t r = 0; r < rows; ++r) targets.set(r, static_cast<double>(values[r]));
  DeviceBuffer dx(t, rows * cols), dtargets(DType::kInt64, rows), dloss(t, rows), dlse(t, rows),
      dg(t, 1), dgx(t, rows * cols);
  dx.upload(x);
  dtargets.upload(targets);
  HostBuffer one(t, 1);
  one.set(0, 1.0);
  dg.upload(one);
  dloss.poison();
  dlse.poison();
  dgx.poison();
  const auto* dtp = static_cast<const int64_t*>(dtargets.get());
  gpu::cross_entropy({.loss = dloss.get(),
                      .lse = dlse.get(),
                      .logits = dx.get(),
                      .targets = dtp,
                      .dtype = t,
                      .rows = rows,
                      .cols = cols,
                      .inner = inner,
                      .ignore_index = -100},
                     errors(), stream());
  gpu::cross_entropy_backward({.grad_logits = dgx.get(),
                               .grad_loss = dg.get(),
                               .grad_loss_stride = 0,
                               .logits = dx.get(),
                               .lse = dlse.get(),
                               .targets = dtp,
                               .dtype = t,
                               .rows = rows,
                               .cols = cols,
                               .inner = inner,
                               .ignore_index = -100},
                              errors(), stream());
  sync();
  try {
    gpu::synchronize_stream(0, stream());
    ADD_FAILURE() << "out-of-range targets were not raised at the next synchronization";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("cross_entropy"), std::string::npos) << what;
    EXPECT_TRUE(what.find("target 40 ") != std::string::npos ||
                what.find("target -1 ") != std::string::npos)
        << what;
  }
  gpu::synchronize_stream(0, stream());  // raised once, then cleared
  const HostBuffer loss = dloss.download(), lse = dlse.download(), gx = dgx.download();
  // Element (r, j) of the logits, in the layout `inner` gives: [rows / inner, cols, inner].
  auto element = [&](int64_t r, int64_t j) { return (r / inner * cols + j) * inner + r % inner; };
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_FALSE(std::isnan(lse.get(r))) << "row " << r;
    const bool bad = r == 1 || r == 2;
    EXPECT_EQ(std::isnan(loss.get(r)), bad) << "row " << r;
    for (int64_t j = 0; j < cols; ++j) {
      EXPECT_EQ(std::isnan(gx.get(element(r, j))), bad) << "row " << r << " col " << j;
    }
  }
  EXPECT_EQ(loss.get(3), 0.0);
  EXPECT_EQ(gx.get(element(3, 0)), 0.0);
}

TEST_F(CudaRowwiseGemmTest, CrossEntropyRejectsBadArguments) {
  DeviceBuffer x(DType::kFloat32, 6), loss(DType::kFloat32, 2), targets(DType::kInt64, 2);
  const auto* tp = static_cast<const int64_t*>(targets.get());
  EXPECT_THROW(gpu::cross_entropy({.loss = loss.get(),
                                   .lse = loss.get(),
                                   .logits = x.get(),
                                   .targets = tp,
                                   .dtype = DType::kInt32,
                                   .rows = 2,
                                   .cols = 3,
                                   .inner = 1,
                                   .ignore_index = -100},
                                  errors(), stream()),
               Error);
  EXPECT_THROW(gpu::cross_entropy({.loss = loss.get(),
                                   .logits = x.get(),
                                   .targets = tp,
                                   .dtype = DType::kFloat32,
                                   .rows = 2,
                                   .cols = 3,
                                   .inner = 1,
                                   .ignore_index = -100},
                                  errors(), stream()),
               Error);
  EXPECT_THROW(gpu::cross_entropy({.loss = loss.get(),
                                   .lse = loss.get(),
                                   .logits = x.get(),
                                   .targets = tp,
                                   .dtype = DType::kFloat32,
                                   .rows = -1,
                                   .cols = 3,
                                   .inner = 1,
                                   .ignore_index = -100},
                                  errors(), stream()),
               Error);
  EXPECT_THROW(gpu::cross_entropy({.loss = loss.get(),
                                   .lse = loss.get(),
                                   .logits = x.get(),
                                   .targets = tp,
                                   .dtype = DType::kFloat32,
                                   .rows = 2,
                                   .cols = 3,
                                   .inner = 4,
                                   .ignore_index = -100},
                                  errors(), stream()),
               Error);
  EXPECT_THROW(gpu::cross_entropy_backward({.grad_logits = x.get(),
                                            .grad_loss = loss.get(),
                                            .grad_loss_stride = -1,
                                            .logits = x.get(),
                                            .lse = loss.get(),
                                            .targets = tp,
                                            .dtype = DType::kFloat32,
                                            .rows = 2,
                                            .cols = 3,
                                            .inner = 1,
                                            .ignore_index = -100},
                                           errors(), stream()),
               Error);
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd::kernels
