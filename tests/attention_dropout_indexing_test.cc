// Tests of the attention primitive's dropout numbering (kernels::DropoutIndexing in
// kernels/attention.h) on the CPU kernel: a custom numbering with the default's strides is
// the default bit for bit; a custom numbering is the documented formula (read off the output
// with one-hot values, against Philox computed here); and a call split into blocks of rows
// and of keys, each numbered by its place in the whole, gives the whole call's output,
// log-sum-exp and gradients. tests/cuda_attention_dropout_indexing_test.cc runs the same
// splits on the CUDA kernels.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <ostream>
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
using kernels::DropoutIndexing;

AttentionParams dropout_params(double p, uint64_t offset = 77) {
  AttentionParams params;
  params.scale = 0.25;
  params.dropout = p;
  params.seed = 0x9e3779b97f4a7c15ull;
  params.offset = offset;
  return params;
}

// The default numbering (b * lq + i) * lk + j for batch dims [b0, b1], written out as strides.
DropoutIndexing default_as_custom(int64_t b1, int64_t lq, int64_t lk) {
  DropoutIndexing ix;
  ix.custom = true;
  ix.batch_strides[0] = b1 * lq * lk;
  ix.batch_strides[1] = lq * lk;
  ix.row_stride = lk;
  ix.col_stride = 1;
  return ix;
}

// A numbering unlike the default: a base 40 below 2^64 (the numbers wrap around), a negative
// batch stride, rows and columns spread apart (as the rows and keys of a dilated selection).
DropoutIndexing scattered_numbering() {
  DropoutIndexing ix;
  ix.custom = true;
  ix.base = std::numeric_limits<uint64_t>::max() - 39;
  ix.batch_strides[0] = -1'000'003;
  ix.batch_strides[1] = 40'009;
  ix.row_stride = 613;
  ix.col_stride = 3;
  return ix;
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
    a.params.dropout_indexing = default_as_custom(3, shape.lq, shape.lk);
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
                                   default_as_custom(3, shape.lq, shape.lk)));
    a.params.dropout_indexing = scattered_numbering();
    EXPECT_TRUE(zeros_are_the_mask(run_split(a, AttentionKernel::kMath, {}, {}, false).out, a,
                                   scattered_numbering()));
    // The test can fail: the default numbering's mask is not the scattered one's.
    EXPECT_FALSE(zeros_are_the_mask(run_split(a, AttentionKernel::kMath, {}, {}, false).out, a,
                                    default_as_custom(3, shape.lq, shape.lk)));
  }
}

// One case of the split table: a numbering, a causal setting and where to cut.
struct SplitCase {
  std::string name;
  bool custom = false;
  bool causal = false;
  int64_t causal_offset = 0;
  std::vector<int64_t> row_cuts, col_cuts;
};

void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.name; }

std::vector<SplitCase> split_cases() {
  return {
      {"rows_default", false, false, 0, {33}, {}},
      {"keys_default", false, false, 0, {}, {64}},
      {"rows_and_keys_custom", true, false, 0, {20, 45}, {50, 100}},
      {"causal_rows_and_keys", true, true, 5, {33}, {64, 130}},
      {"causal_negative_offset", false, true, -3, {10, 40}, {30}},
      {"causal_offset_past_the_keys", true, true, 200, {32}, {1, 149}},
  };
}

class AttentionDropoutSplit : public ::testing::TestWithParam<SplitCase> {};

// Several CPU query blocks (32 rows) and key tiles (64 keys); blocks cut across them.
TEST_P(AttentionDropoutSplit, BlocksNumberedByTheirPlaceGiveTheWholeCall) {
  const SplitCase& c = GetParam();
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(13);
    const SplitShape shape{{2, 2}, 70, 150, 16, false};
    SplitAttention a = make_split_attention(shape, dtype, Device::cpu(), dropout_params(0.3), rng);
    a.params.causal = c.causal;
    a.params.causal_offset = c.causal_offset;
    if (c.custom) a.params.dropout_indexing = scattered_numbering();
    const SplitResult whole = run_split(a, AttentionKernel::kMath, {}, {}, true);
    const SplitResult split = run_split(a, AttentionKernel::kMath, c.row_cuts, c.col_cuts, true);
    const Tolerance tol = tolerance_for(dtype, shape.lk + shape.d);
    EXPECT_TRUE(values_close(to_ref(whole.out), to_ref(split.out), tol));
    EXPECT_TRUE(values_close(to_ref(whole.lse), to_ref(split.lse), tol));
    EXPECT_TRUE(values_close(to_ref(whole.grad_q), to_ref(split.grad_q), tol));
    EXPECT_TRUE(values_close(to_ref(whole.grad_k), to_ref(split.grad_k), tol));
    EXPECT_TRUE(values_close(to_ref(whole.grad_v), to_ref(split.grad_v), tol));
  }
}

// With one-hot values each output element is one probability: the split's mask is exactly
// the formula's for the whole call.
TEST_P(AttentionDropoutSplit, BlocksDrawTheWholeCallsMask) {
  const SplitCase& c = GetParam();
  std::mt19937_64 rng(14);
  const SplitShape shape{{2, 2}, 70, 150, 150, /*one_hot_v=*/true};
  SplitAttention a =
      make_split_attention(shape, DType::kFloat32, Device::cpu(), dropout_params(0.3), rng);
  a.params.causal = c.causal;
  a.params.causal_offset = c.causal_offset;
  if (c.custom) a.params.dropout_indexing = scattered_numbering();
  const SplitResult split = run_split(a, AttentionKernel::kMath, c.row_cuts, c.col_cuts, false);
  EXPECT_TRUE(zeros_are_the_mask(split.out, a,
                                 c.custom ? scattered_numbering()
                                          : default_as_custom(2, shape.lq, shape.lk)));
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionDropoutSplit, ::testing::ValuesIn(split_cases()),
                         [](const ::testing::TestParamInfo<SplitCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace rd::test
