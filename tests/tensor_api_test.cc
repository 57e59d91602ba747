// Small public-API conveniences of tensor/: arange's integer overloads (dtype, counts, and
// overload resolution for mixed integer types) and rd::set_num_threads, which must move
// OpenMP's and OpenBLAS's thread counts together.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ringdilated/kernels/cpu/parallel.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/raises.h"

namespace rd {
namespace {

std::vector<int64_t> ints(const Tensor& t) {
  EXPECT_EQ(t.dtype(), DType::kInt64) << t.str();
  return t.to_vector<int64_t>();
}

TEST(Arange, IntegerBoundsGiveInt64LikeTorch) {
  EXPECT_EQ(ints(arange(0, 5)), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(ints(arange(5)), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(ints(arange(-2, 2)), (std::vector<int64_t>{-2, -1, 0, 1}));
  EXPECT_EQ(ints(arange(2, 11, 3)), (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(ints(arange(2, 12, 3)), (std::vector<int64_t>{2, 5, 8, 11}));
  EXPECT_EQ(ints(arange(10, 0, -3)), (std::vector<int64_t>{10, 7, 4, 1}));
  EXPECT_EQ(ints(arange(5, 2)).size(), 0u);
  EXPECT_EQ(ints(arange(2, 5, -1)).size(), 0u);
  EXPECT_EQ(ints(arange(3, 3)).size(), 0u);
  // Mixed integer types resolve to the integer overload too.
  const int64_t n = 4;
  const size_t m = 3;
  const int32_t start = 1;
  EXPECT_EQ(ints(arange(0, n)), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(ints(arange(start, m)), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ints(arange(start, n, int16_t{2})), (std::vector<int64_t>{1, 3}));
  // The count never overflows, even across the whole int64 range.
  EXPECT_EQ(arange(INT64_MAX - 2, INT64_MAX).numel(), 2);
  EXPECT_EQ(arange(INT64_MIN, INT64_MAX, INT64_MAX).numel(), 3);
}

TEST(Arange, FloatingArgumentsOrOptionsGiveFloating) {
  const Tensor by_options = arange(0, 3, DType::kFloat32);
  EXPECT_EQ(by_options.dtype(), DType::kFloat32);
  EXPECT_EQ(by_options.to_vector<float>(), (std::vector<float>{0, 1, 2}));
  EXPECT_EQ(arange(0, 3, 1, DType::kFloat64).to_vector<double>(), (std::vector<double>{0, 1, 2}));
  EXPECT_EQ(arange(0.0, 3).dtype(), DType::kFloat32);
  const Tensor halves = arange(0, 2, 0.5);
  EXPECT_EQ(halves.dtype(), DType::kFloat32);
  EXPECT_EQ(halves.to_vector<float>(), (std::vector<float>{0, 0.5f, 1, 1.5f}));
  EXPECT_EQ(arange(5, DType::kFloat32).dtype(), DType::kFloat32);
}

TEST(Arange, ZeroStepIsAnError) {
  EXPECT_TRUE(test::raises([] { arange(0, 5, 0); }, {ErrorCode::kInvalidArgument},
                           {"arange", "step 0"}));
}

// Restores the thread count a test changed.
class ThreadCountTest : public ::testing::Test {
 protected:
  void TearDown() override { set_num_threads(saved_); }
  const int saved_ = num_threads();
};

TEST_F(ThreadCountTest, SetsOpenMPAndOpenBLASTogether) {
  for (int threads : {1, 2, 1}) {
    set_num_threads(threads);
    EXPECT_EQ(num_threads(), threads);
    EXPECT_EQ(kernels::cpu::blas_num_threads(), threads);
  }
}

TEST_F(ThreadCountTest, OpenBLASStartsAlignedWithOpenMP) {
  if (std::getenv("OPENBLAS_NUM_THREADS") != nullptr) {
    GTEST_SKIP() << "OPENBLAS_NUM_THREADS is set, which keeps OpenBLAS's own count";
  }
  // ctest runs this with OMP_NUM_THREADS=1 (tests/CMakeLists.txt), below OpenBLAS's default.
  (void)matmul(ones({2, 2}), ones({2, 2}));  // the CPU backend is in use
  EXPECT_EQ(kernels::cpu::blas_num_threads(), num_threads());
}

// device.h promises that our own kernels give the same result for every thread count (each
// splits its work the same way whatever the count), unlike OpenBLAS's GEMMs, whose rounding
// can change with it. A softmax and reductions large enough to run in parallel, bit for bit
// at 1, 2 and 3 threads.
TEST_F(ThreadCountTest, OwnKernelsGiveTheSameResultForEveryThreadCount) {
  Generator gen(7);
  const Tensor a = randn({256, 1031}, gen);
  const auto compute = [&] {
    return std::vector<std::vector<float>>{
        softmax(a, 1).to_vector<float>(), sum(a, {0}).to_vector<float>(),
        sum(a, {1}).to_vector<float>(), sum(a).to_vector<float>()};
  };
  set_num_threads(1);
  const auto one_thread = compute();
  for (int threads : {2, 3}) {
    set_num_threads(threads);
    EXPECT_EQ(compute(), one_thread) << threads << " threads";
  }
}

TEST(CpuGemmKernels, NamesOpenBLASAndItsKernelSet) {
  const std::string name = cpu_gemm_kernels();
  EXPECT_EQ(name.rfind("OpenBLAS ", 0), 0u) << name;
  EXPECT_GT(name.size(), std::string("OpenBLAS ").size()) << name;
}

TEST_F(ThreadCountTest, RejectsLessThanOne) {
  EXPECT_TRUE(test::raises([] { set_num_threads(0); }, {ErrorCode::kInvalidArgument},
                           {"set_num_threads", "'threads'", "0"}));
  EXPECT_EQ(num_threads(), saved_);
}

}  // namespace
}  // namespace rd
