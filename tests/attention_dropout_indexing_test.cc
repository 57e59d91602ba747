// Tests of the attention primitive's dropout numbering (kernels::DropoutIndexing in
// kernels/attention.h) on the CPU kernel: a custom numbering with the default's strides is
// the default bit for bit; a custom numbering is the documented formula (read off the output
// with one-hot values, against Philox computed here); and a call split into blocks of rows
// and of keys, each numbered by its place in the whole, gives the whole call's output,
// log-sum-exp and gradients. tests/cuda_attention_dropout_indexing_test.cc runs the same
// splits on the CUDA kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/attention_dropout.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/attention_split.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

using kernels::AttentionKernel;
using kernels::AttentionParams;

AttentionParams dropout_params(double p, uint64_t offset = 77) {
  AttentionParams params;
  params.scale = 0.25;
  params.dropout = p;
  params.seed = 0x9e3779b97f4a7c15ull;
  params.offset = offset;
  return params;
}

::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  return values_close(to_ref(a), to_ref(b), {0.0, 0.0});
}

TEST(AttentionDropoutIndexing, DefaultStridesWrittenOutAreTheDefaultBitForBit) {
  const SplitShape shape{{2, 3}, 37, 45, 16, false};
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(11);
    SplitAttention a = make_split_attention(shape, dtype, Device::cpu(), dropout_params(0.3), rng);
    a.params.causal = true;
    a.params.causal_offset = 4;
    const SplitResult by_default = run_split(a, AttentionKernel::kMath, {}, {}, true);
    a.params.dropout_indexing = default_as_custom(shape.batch, shape.lq, shape.lk);
    const SplitResult custom = run_split(a, AttentionKernel::kMath, {}, {}, true);
    EXPECT_TRUE(bitwise_equal(by_default.out, custom.out));
    EXPECT_TRUE(bitwise_equal(by_default.lse, custom.lse));
    EXPECT_TRUE(bitwise_equal(by_default.grad_q, custom.grad_q));
    EXPECT_TRUE(bitwise_equal(by_default.grad_k, custom.grad_k));
    EXPECT_TRUE(bitwise_equal(by_default.grad_v, custom.grad_v));
    // The base adds to the stream offset: base 1000 at offset 0 is offset 1000.
    a.params.dropout_indexing.base = 1000 - a.params.offset;
    const SplitResult shifted = run_split(a, AttentionKernel::kMath, {}, {}, false);
    a.params.dropout_indexing = {};
    a.params.offset = 1000;
    const SplitResult at_offset = run_split(a, AttentionKernel::kMath, {}, {}, false);
    EXPECT_TRUE(bitwise_equal(shifted.out, at_offset.out));
  }
}

TEST(AttentionDropoutIndexing, DefaultAndCustomNumberingsAreTheDocumentedFormula) {
  const SplitShape shape{{2, 3}, 37, 45, 48, /*one_hot_v=*/true};
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(12);
    SplitAttention a = make_split_attention(shape, dtype, Device::cpu(), dropout_params(0.4), rng);
    a.params.causal = true;
    a.params.causal_offset = 2;
    EXPECT_TRUE(zeros_are_the_mask(run_split(a, AttentionKernel::kMath, {}, {}, false).out, a,
                                   default_as_custom(shape.batch, shape.lq, shape.lk)));
    a.params.dropout_indexing = scattered_numbering();
    EXPECT_TRUE(zeros_are_the_mask(run_split(a, AttentionKernel::kMath, {}, {}, false).out, a,
                                   scattered_numbering()));
    // The test can fail: the default numbering's mask is not the scattered one's.
    EXPECT_FALSE(zeros_are_the_mask(run_split(a, AttentionKernel::kMath, {}, {}, false).out, a,
                                    default_as_custom(shape.batch, shape.lq, shape.lk)));
  }
}

class AttentionDropoutSplit : public ::testing::TestWithParam<SplitCase> {};

// Several CPU query blocks (32 rows) and key tiles (64 keys); blocks cut across them.
TEST_P(AttentionDropoutSplit, BlocksNumberedByTheirPlaceGiveTheWholeCall) {
  const SplitCase& c = GetParam();
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(13);
    const SplitShape shape{{2, 2}, 70, 150, 16, false};  // the cases cut [70, 150]
    const SplitAttention a =
        make_case_attention(c, shape, dtype, Device::cpu(), dropout_params(0.3), rng);
    const SplitResult whole = run_split(a, AttentionKernel::kMath, {}, {}, true);
    const SplitResult split = run_split(a, AttentionKernel::kMath, c.row_cuts, c.col_cuts, true);
    EXPECT_TRUE(split_results_close(whole, split, dtype, shape.d, shape.lk));
  }
}

// With one-hot values each output element is one probability: the split's mask is exactly
// the formula's for the whole call.
TEST_P(AttentionDropoutSplit, BlocksDrawTheWholeCallsMask) {
  const SplitCase& c = GetParam();
  std::mt19937_64 rng(14);
  const SplitShape shape{{2, 2}, 70, 150, 150, /*one_hot_v=*/true};
  const SplitAttention a =
      make_case_attention(c, shape, DType::kFloat32, Device::cpu(), dropout_params(0.3), rng);
  const SplitResult split = run_split(a, AttentionKernel::kMath, c.row_cuts, c.col_cuts, false);
  EXPECT_TRUE(zeros_are_the_mask(split.out, a, case_numbering(c, shape)));
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionDropoutSplit, ::testing::ValuesIn(split_cases()),
                         [](const ::testing::TestParamInfo<SplitCase>& info) {
                           return info.param.name;
                         });

// Offsets far outside [-(lq + 1), lk] are clamped: every key visible, or none, never an
// overflow (what a block of a long split sequence may be given).
TEST(AttentionCausalOffset, HugeOffsetsShowEveryKeyOrNone) {
  std::mt19937_64 rng(15);
  const SplitShape shape{{2, 2}, 40, 45, 48, /*one_hot_v=*/true};
  const SplitAttention plain =
      make_split_attention(shape, DType::kFloat32, Device::cpu(), dropout_params(0.2), rng);
  const SplitResult all = run_split(plain, AttentionKernel::kMath, {}, {}, false);
  for (int64_t offset : {std::numeric_limits<int64_t>::max(), int64_t{45}, int64_t{1} << 62}) {
    SplitAttention a = plain;
    a.params.causal = true;
    a.params.causal_offset = offset;
    EXPECT_TRUE(bitwise_equal(all.out, run_split(a, AttentionKernel::kMath, {}, {}, false).out))
        << "offset " << offset;
  }
  for (int64_t offset : {std::numeric_limits<int64_t>::min(), int64_t{-41}, -(int64_t{1} << 62)}) {
    SplitAttention a = plain;
    a.params.causal = true;
    a.params.causal_offset = offset;
    const SplitResult none = run_split(a, AttentionKernel::kMath, {}, {}, false);
    EXPECT_TRUE(zeros_are_the_mask(none.out, a, default_as_custom(shape.batch, 40, 45)))
        << "offset " << offset;
    EXPECT_TRUE(values_close(to_ref(none.lse), RefArray::filled(none.lse.shape(), -INFINITY),
                             {0.0, 0.0}));
  }
}

}  // namespace
}  // namespace rd::test
