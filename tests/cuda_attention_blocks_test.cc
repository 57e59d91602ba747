// GPU tests of attention calls that are blocks of a larger one (kernels/attention.h): the
// CUDA math and flash kernels number dropout elements by a custom DropoutIndexing exactly as
// the CPU does, so a call split into row and key blocks draws the whole call's mask and gives
// the CPU's whole result; and the flash kernels treat causal offsets far outside the block
// (negative, past the keys, near the int64 limits) as the math kernels do.
//
// The CPU kernel is the reference here; tests/attention_dropout_indexing_test.cc checks it
// against the numbering's formula and its own splits. Masks are compared exactly: with
// one-hot values every output element is one probability, zero exactly where dropped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/attention_split.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

using kernels::AttentionKernel;
using kernels::AttentionParams;
using kernels::kernel_name;

class CudaAttentionBlocksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

struct KernelDType {
  AttentionKernel kernel;
  DType dtype;
};

// What each CUDA kernel serves: math every float dtype, flash float32 and the 16-bit types.
constexpr KernelDType kKernelDTypes[] = {
    {AttentionKernel::kMath, DType::kFloat32},  {AttentionKernel::kMath, DType::kFloat64},
    {AttentionKernel::kMath, DType::kBFloat16}, {AttentionKernel::kFlash, DType::kFloat32},
    {AttentionKernel::kFlash, DType::kBFloat16}, {AttentionKernel::kFlash, DType::kFloat16}};

AttentionParams dropout_params(double p) {
  AttentionParams params;
  params.scale = 0.25;
  params.dropout = p;
  params.seed = 0x243f6a8885a308d3ull;
  params.offset = 991;
  return params;
}

// The same call with its tensors on `device`.
SplitAttention on(const SplitAttention& a, Device device) {
  SplitAttention b = a;
  for (Tensor* t : {&b.q, &b.k, &b.v, &b.grad_out, &b.grad_lse}) *t = t->to(device);
  return b;
}

// Calls f(split case, kernel and dtype) for every case of the split table on every kernel and
// dtype, traced by name.
template <class F>
void for_each_split(const F& f) {
  for (const SplitCase& c : split_cases()) {
    for (const KernelDType& kd : kKernelDTypes) {
      SCOPED_TRACE(str_cat(kernel_name(kd.kernel), " ", dtype_name(kd.dtype), " ", c.name));
      f(c, kd);
    }
  }
}

// Every split of the table, on each kernel and dtype, whole and split, forward and backward,
// against the CPU's whole call.
TEST_F(CudaAttentionBlocksTest, SplitsMatchTheCpuWholeCall) {
  for_each_split([](const SplitCase& c, const KernelDType& kd) {
    std::mt19937_64 rng(21);
    const SplitShape shape{{2, 2}, 70, 150, 64, false};
    const SplitAttention cpu =
        make_case_attention(c, shape, kd.dtype, Device::cpu(), dropout_params(0.3), rng);
    const SplitResult want = run_split(cpu, AttentionKernel::kMath, {}, {}, true);
    const SplitAttention cuda = on(cpu, Device::cuda(0));
    EXPECT_TRUE(split_results_close(want, run_split(cuda, kd.kernel, {}, {}, true), kd.dtype,
                                    shape.d, shape.lk))
        << "whole";
    EXPECT_TRUE(split_results_close(want, run_split(cuda, kd.kernel, c.row_cuts, c.col_cuts, true),
                                    kd.dtype, shape.d, shape.lk))
        << "split";
  });
}

// The mask itself, bit for bit: one-hot values (D = Lk = 150, a padded flash bucket). The
// scores are kept small (scale 0.05: a spread of a few units per row) so that every kept
// probability is representable: flash rounds probabilities to the input dtype before the PV
// product, and float16 flushes those below 2^-24 of the row's largest to 0, which would read
// as dropped (with scale 0.25, about 5% of them).
TEST_F(CudaAttentionBlocksTest, SplitsDrawTheWholeCallsMask) {
  for_each_split([](const SplitCase& c, const KernelDType& kd) {
    std::mt19937_64 rng(22);
    const SplitShape shape{{2, 2}, 70, 150, 150, /*one_hot_v=*/true};
    AttentionParams params = dropout_params(0.3);
    params.scale = 0.05;
    const SplitAttention a = make_case_attention(c, shape, kd.dtype, Device::cuda(0), params, rng);
    const kernels::DropoutIndexing ix = case_numbering(c, shape);
    EXPECT_TRUE(zeros_are_the_mask(run_split(a, kd.kernel, {}, {}, false).out, a, ix)) << "whole";
    EXPECT_TRUE(zeros_are_the_mask(run_split(a, kd.kernel, c.row_cuts, c.col_cuts, false).out, a,
                                   ix))
        << "split";
  });
}

// Offsets far outside [-(lq + 1), lk]: the flash kernels clamp them as the math kernels do
// (every key visible, or none), forward and backward, with and without dropout.
TEST_F(CudaAttentionBlocksTest, FlashClampsCausalOffsetsLikeTheMathKernel) {
  const Device gpu = Device::cuda(0);
  const int64_t lq = 70, lk = 150;
  const int64_t offsets[] = {std::numeric_limits<int64_t>::min(),
                             -(int64_t{1} << 62),
                             -(lq + 1) - 1000,
                             -(lq + 1),
                             -lq,
                             -5,
                             lk - 1,
                             lk,
                             lk + 7,
                             int64_t{1} << 62,
                             std::numeric_limits<int64_t>::max()};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (double p : {0.0, 0.2}) {
      for (int64_t offset : offsets) {
        SCOPED_TRACE(str_cat(dtype_name(dtype), " dropout ", p, " offset ", offset));
        std::mt19937_64 rng(23);
        const SplitShape shape{{2, 2}, lq, lk, 64, false};
        SplitAttention cpu =
            make_split_attention(shape, dtype, Device::cpu(), dropout_params(p), rng);
        cpu.params.causal = true;
        cpu.params.causal_offset = offset;
        const SplitResult want = run_split(cpu, AttentionKernel::kMath, {}, {}, true);
        const SplitAttention cuda = on(cpu, gpu);
        for (AttentionKernel kernel : {AttentionKernel::kMath, AttentionKernel::kFlash}) {
          EXPECT_TRUE(split_results_close(want, run_split(cuda, kernel, {}, {}, true), dtype,
                                          shape.d, shape.lk))
              << kernel_name(kernel);
        }
      }
    }
  }
}

}  // namespace
}  // namespace rd::test
