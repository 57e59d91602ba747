// Tensor printing (to_string, operator<<): exact text for every dtype, the notations of
// floating values, summarization with "...", line wrapping, options, and that printing a
// summarized tensor shows its true edge elements.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/raises.h"

namespace rd {
namespace {

TEST(TensorPrint, Float32MatrixInFixedPointUnderItsHeader) {
  const Tensor t = from_vector<float>({1.5f, -2.25f, 0.125f, 3.0f, 10.0f, -0.5f}, {2, 3});
  EXPECT_EQ(to_string(t),
            "Tensor(float32, cpu, [2, 3])\n"
            "[[ 1.5000, -2.2500,  0.1250],\n"
            " [ 3.0000, 10.0000, -0.5000]]");
}

TEST(TensorPrint, EveryDType) {
  EXPECT_EQ(to_string(arange(4)), "Tensor(int64, cpu, [4])\n[0, 1, 2, 3]");
  EXPECT_EQ(to_string(from_vector<int32_t>({-7, 12}, {2})), "Tensor(int32, cpu, [2])\n[-7, 12]");
  EXPECT_EQ(to_string(lt(arange(3), scalar_tensor(1.0, DType::kInt64))),
            "Tensor(bool, cpu, [3])\n[ true, false, false]");
  EXPECT_EQ(to_string(from_vector<double>({0.5, 0.25}, {2})),
            "Tensor(float64, cpu, [2])\n[0.5000, 0.2500]");
  // bfloat16 and float16 print the value they store.
  const Tensor third = full({2}, 1.0 / 3.0, DType::kBFloat16);
  EXPECT_EQ(to_string(third), "Tensor(bfloat16, cpu, [2])\n[0.3340, 0.3340]");
  EXPECT_EQ(to_string(full({1}, 1.0 / 3.0, DType::kFloat16)),
            "Tensor(float16, cpu, [1])\n[0.3333]");
}

TEST(TensorPrint, ScalarsEmptyAndUndefined) {
  EXPECT_EQ(to_string(scalar_tensor(2.5)), "Tensor(float32, cpu, [])\n2.5000");
  EXPECT_EQ(to_string(zeros({0, 3})), "Tensor(float32, cpu, [0, 3])\n[]");
  EXPECT_EQ(to_string(Tensor()), "Tensor(undefined)");
}

TEST(TensorPrint, NotationFollowsTheValues) {
  // Integral values print as "3."; a wide range or tiny values switch to scientific.
  EXPECT_EQ(to_string(from_vector<float>({3, -1, 0}, {3})), "Tensor(float32, cpu, [3])\n[ 3., -1.,  0.]");
  EXPECT_EQ(to_string(from_vector<double>({1e-5, 1.0}, {2})),
            "Tensor(float64, cpu, [2])\n[1.0000e-05, 1.0000e+00]");
  EXPECT_EQ(to_string(from_vector<double>({2e9, 1.0}, {2})),
            "Tensor(float64, cpu, [2])\n[2.0000e+09, 1.0000e+00]");
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(to_string(from_vector<double>({std::nan(""), inf, -inf, 0.5}, {4})),
            "Tensor(float64, cpu, [4])\n[   nan,    inf,   -inf, 0.5000]");
  EXPECT_EQ(to_string(from_vector<double>({0.123456, 2}, {2}), PrintOptions{.precision = 2}),
            "Tensor(float64, cpu, [2])\n[0.12, 2.00]");
}

TEST(TensorPrint, ThreeDimsSeparateMatricesByABlankLine) {
  EXPECT_EQ(to_string(arange(8).reshape({2, 2, 2})),
            "Tensor(int64, cpu, [2, 2, 2])\n"
            "[[[0, 1],\n"
            "  [2, 3]],\n"
            "\n"
            " [[4, 5],\n"
            "  [6, 7]]]");
}

TEST(TensorPrint, LargeTensorsAreSummarizedWithTheirEdgeElements) {
  // 40 x 50 = 2000 elements > the threshold 1000: three rows and columns at each end.
  const Tensor t = arange(2000).reshape({40, 50});
  EXPECT_EQ(to_string(t),
            "Tensor(int64, cpu, [40, 50])\n"
            "[[   0,    1,    2,  ...,   47,   48,   49],\n"
            " [  50,   51,   52,  ...,   97,   98,   99],\n"
            " [ 100,  101,  102,  ...,  147,  148,  149],\n"
            " ...,\n"
            " [1850, 1851, 1852,  ..., 1897, 1898, 1899],\n"
            " [1900, 1901, 1902,  ..., 1947, 1948, 1949],\n"
            " [1950, 1951, 1952,  ..., 1997, 1998, 1999]]");
  // Under the threshold nothing is cut; dims shorter than 2 * edge_items never are.
  const PrintOptions few{.threshold = 5, .edge_items = 1};
  EXPECT_EQ(to_string(arange(6).reshape({2, 3}), few),
            "Tensor(int64, cpu, [2, 3])\n[[0, ..., 2],\n [3, ..., 5]]");
  EXPECT_EQ(to_string(arange(6).reshape({2, 3}), PrintOptions{.threshold = 6}),
            "Tensor(int64, cpu, [2, 3])\n[[0, 1, 2],\n [3, 4, 5]]");
}

TEST(TensorPrint, LongRowsWrapUnderTheirBracket) {
  EXPECT_EQ(to_string(arange(10, 22).reshape({1, 12}), PrintOptions{.line_width = 20}),
            "Tensor(int64, cpu, [1, 12])\n"
            "[[10, 11, 12, 13,\n"
            "  14, 15, 16, 17,\n"
            "  18, 19, 20, 21]]");
}

TEST(TensorPrint, HeaderShowsRequiresGradAndStreamMatchesToString) {
  Tensor w = from_vector<float>({0.5f}, {1});
  w.set_requires_grad(true);
  std::ostringstream os;
  os << w;
  EXPECT_EQ(os.str(), "Tensor(float32, cpu, [1], requires_grad)\n[0.5000]");
  EXPECT_EQ(os.str(), to_string(w));
}

TEST(TensorPrint, NonContiguousViewsPrintInLogicalOrder) {
  EXPECT_EQ(to_string(arange(6).reshape({2, 3}).t()),
            "Tensor(int64, cpu, [3, 2])\n[[0, 3],\n [1, 4],\n [2, 5]]");
}

TEST(TensorPrint, RejectsBadOptions) {
  const Tensor t = arange(3);
  EXPECT_TRUE(test::raises([&] { to_string(t, PrintOptions{.precision = -1}); },
                           {ErrorCode::kInvalidArgument}, {"to_string", "'precision'", "-1"}));
  EXPECT_TRUE(test::raises([&] { to_string(t, PrintOptions{.edge_items = 0}); },
                           {ErrorCode::kInvalidArgument}, {"to_string", "'edge_items'"}));
  EXPECT_TRUE(test::raises([&] { to_string(t, PrintOptions{.line_width = 0}); },
                           {ErrorCode::kInvalidArgument}, {"to_string", "'line_width'"}));
  EXPECT_TRUE(test::raises([&] { to_string(t, PrintOptions{.threshold = -2}); },
                           {ErrorCode::kInvalidArgument}, {"to_string", "'threshold'"}));
}

}  // namespace
}  // namespace rd
