// Error-model tests: bad inputs raise rd::Error with the right ErrorCode and a message that
// names the op and the offending shapes or values.
#include <initializer_list>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/raises.h"

namespace rd {
namespace {

using test::raises;

Tensor floats(Shape shape) { return ones(std::move(shape), DType::kFloat32); }
Tensor indices(std::vector<int64_t> values) {
  int64_t n = static_cast<int64_t>(values.size());
  return from_vector<int64_t>(std::move(values), {n});
}

TEST(Errors, BroadcastMismatchNamesOpAndShapes) {
  EXPECT_TRUE(raises(
      [] {
        add(floats({2, 3}), floats({4}));
      },
      {ErrorCode::kShapeMismatch}, {"add", "[2, 3]", "[4]"}));
  EXPECT_TRUE(raises(
      [] {
        mul(floats({2, 3}), floats({3, 2}));
      },
      {ErrorCode::kShapeMismatch}, {"mul", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(raises([] { where(ones({2}, DType::kBool), floats({3}), floats({2})); },
                     {ErrorCode::kShapeMismatch}, {"where", "[3]"}));
}

TEST(Errors, MatmulInnerSizes) {
  EXPECT_TRUE(raises(
      [] {
        matmul(floats({2, 3}), floats({4, 5}));
      },
      {ErrorCode::kShapeMismatch}, {"matmul", "[2, 3]", "[4, 5]"}));
  EXPECT_TRUE(raises(
      [] {
        matmul(floats({2, 2, 3}), floats({3, 3, 2}));
      },
      {ErrorCode::kShapeMismatch}, {"matmul", "[2, 2, 3]", "[3, 3, 2]"}));
  EXPECT_TRUE(raises([] { matmul(floats({}), floats({3})); },
                     {ErrorCode::kShapeMismatch, ErrorCode::kInvalidArgument}, {"matmul", "[]"}));
  EXPECT_TRUE(raises(
      [] {
        bmm(floats({2, 3}), floats({3, 2}));
      },
      {ErrorCode::kShapeMismatch}, {"bmm", "[2, 3]"}));
  EXPECT_TRUE(raises(
      [] {
        bmm(floats({2, 3, 4}), floats({3, 4, 5}));
      },
      {ErrorCode::kShapeMismatch}, {"bmm", "[2, 3, 4]", "[3, 4, 5]"}));
}

TEST(Errors, LinearShapesAndDTypes) {
  EXPECT_TRUE(raises([] { linear(floats({2, 3}), floats({5, 4})); },
                     {ErrorCode::kShapeMismatch}, {"linear", "'x'", "[2, 3]", "[5, 4]"}));
  EXPECT_TRUE(raises([] { linear(floats({2, 4}), floats({5, 4, 1})); },
                     {ErrorCode::kShapeMismatch}, {"linear", "'weight'", "[5, 4, 1]"}));
  EXPECT_TRUE(raises([] { linear(floats({2, 4}), floats({5, 4}), floats({4})); },
                     {ErrorCode::kShapeMismatch}, {"linear", "'bias'", "[4]", "[5, 4]"}));
  EXPECT_TRUE(raises([] { linear(floats({2, 4}), ones({5, 4}, DType::kFloat64)); },
                     {ErrorCode::kDTypeMismatch}, {"linear", "float32", "float64"}));
  EXPECT_TRUE(raises(
      [] { linear(floats({2, 4}), floats({5, 4}), ones({5}, DType::kBFloat16)); },
      {ErrorCode::kDTypeMismatch}, {"linear", "bias", "bfloat16"}));
}

TEST(Errors, JoiningMismatchedShapes) {
  EXPECT_TRUE(raises(
      [] {
        cat({floats({2, 3}), floats({2, 4})}, 0);
      },
      {ErrorCode::kShapeMismatch}, {"cat", "[2, 3]", "[2, 4]"}));
  EXPECT_TRUE(raises(
      [] {
        cat({floats({2, 3}), floats({3})}, 0);
      },
      {ErrorCode::kShapeMismatch}, {"cat", "[2, 3]", "[3]"}));
  EXPECT_TRUE(raises([] { cat({}, 0); }, {ErrorCode::kInvalidArgument}, {"cat"}));
  EXPECT_TRUE(raises(
      [] {
        stack({floats({2, 3}), floats({3, 2})}, 0);
      },
      {ErrorCode::kShapeMismatch}, {"stack", "[2, 3]", "[3, 2]"}));
}

TEST(Errors, IndicesOutOfRange) {
  EXPECT_TRUE(raises(
      [] {
        index_select(floats({4, 3}), 0, indices({0, 5}));
      },
      {ErrorCode::kOutOfRange}, {"index_select", "5", "4"}));
  EXPECT_TRUE(raises(
      [] {
        index_select(floats({4, 3}), 0, indices({-1}));
      },
      {ErrorCode::kOutOfRange}, {"index_select", "-1"}));
  EXPECT_TRUE(raises(
      [] {
        gather(floats({3, 4}), 1, from_vector<int64_t>({0, 1, 2, 3, 4, 0}, {3, 2}));
      },
      {ErrorCode::kOutOfRange}, {"gather", "4"}));
  EXPECT_TRUE(raises(
      [] {
        floats({3, 4}).select(0, 3);
      },
      {ErrorCode::kOutOfRange}, {"select", "3"}));
  EXPECT_TRUE(raises(
      [] {
        floats({3, 4}).select(1, -5);
      },
      {ErrorCode::kOutOfRange}, {"select", "-5"}));
  EXPECT_TRUE(raises(
      [] {
        embedding(floats({5, 2}), indices({1, 5}));
      },
      {ErrorCode::kOutOfRange}, {"embedding", "5"}));
  EXPECT_TRUE(raises(
      [] {
        scatter_add(floats({2, 3}), 1, from_vector<int64_t>({0, 3}, {1, 2}), floats({1, 2}));
      },
      {ErrorCode::kOutOfRange}, {"scatter_add", "3"}));
  EXPECT_TRUE(raises(
      [] {
        scatter(floats({2, 3}), 0, from_vector<int64_t>({2}, {1, 1}), floats({1, 1}));
      },
      {ErrorCode::kOutOfRange}, {"scatter", "2"}));
}

TEST(Errors, IndexTensorsMustBeIntegers) {
  EXPECT_TRUE(raises(
      [] {
        index_select(floats({4, 3}), 0, floats({2}));
      },
      {ErrorCode::kDTypeMismatch}, {"index_select", "float32"}));
  EXPECT_TRUE(raises([] { masked_fill(floats({2}), floats({2}), 1.0); },
                     {ErrorCode::kDTypeMismatch}, {"masked_fill", "float32"}));
  EXPECT_TRUE(raises([] { where(floats({2}), floats({2}), floats({2})); },
                     {ErrorCode::kDTypeMismatch}, {"where", "float32"}));
}

// Sizes whose products pass int64 (or whose bytes pass the address space) are refused with
// the op and the shape named, never wrapped around into a small allocation.
TEST(Errors, HugeShapesAreRefusedNotWrappedAround) {
  const int64_t big = int64_t{1} << 32;  // big * big = 2^64 wraps to 0 in int64
  EXPECT_TRUE(raises([&] { empty({big, big}); }, {ErrorCode::kInvalidArgument},
                     {"empty", "[4294967296, 4294967296]", "2^63 - 1"}));
  EXPECT_TRUE(raises([&] { zeros({3, big, big / 2}, DType::kBFloat16); },
                     {ErrorCode::kInvalidArgument}, {"zeros", "[3, 4294967296, 2147483648]"}));
  // No elements, but the contiguous strides would multiply the other sizes.
  EXPECT_TRUE(raises([&] { empty({0, big, big}); }, {ErrorCode::kInvalidArgument},
                     {"empty", "[0, 4294967296, 4294967296]"}));
  EXPECT_EQ(empty({0, big}).numel(), 0);
  // 2^62 float64 elements fit in int64, their 2^65 bytes in no address space.
  const int64_t half = int64_t{1} << 31;
  EXPECT_TRUE(raises([&] { empty({half, half}, DType::kFloat64); }, {ErrorCode::kOutOfMemory},
                     {"empty", "[2147483648, 2147483648]", "float64"}));
  // 2^63 bytes: past the largest request the pool takes (it never asks the system).
  EXPECT_TRUE(raises([&] { empty({half, half / 2}, DType::kFloat32); }, {ErrorCode::kOutOfMemory},
                     {"empty", "[2147483648, 1073741824]", "float32"}));
  // Views: the new shape's element count must fit too.
  EXPECT_TRUE(raises([&] { floats({1, 2}).expand({big, big, 2}); },
                     {ErrorCode::kInvalidArgument}, {"expand", "[4294967296, 4294967296, 2]"}));
  EXPECT_TRUE(raises([&] { floats({0}).reshape({big, big, 0, -1}); },
                     {ErrorCode::kInvalidArgument, ErrorCode::kShapeMismatch},
                     {"reshape", "[4294967296, 4294967296, 0, -1]"}));
  EXPECT_TRUE(raises([&] { floats({4}).as_strided({2, big}, {big, big}, 0); },
                     {ErrorCode::kInvalidArgument}, {"as_strided", "[2, 4294967296]"}));
  EXPECT_TRUE(raises([&] { from_vector<float>({}, {big, big, 0}); },
                     {ErrorCode::kInvalidArgument}, {"from_vector", "[4294967296, 4294967296, 0]"}));
}

TEST(Errors, ViewsAndReshapes) {
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).view({4});
      },
      {ErrorCode::kShapeMismatch}, {"view", "[2, 3]", "[4]"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).t().view({6});
      },
      {ErrorCode::kShapeMismatch, ErrorCode::kInvalidArgument}, {"view", "[3, 2]", "[6]"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).reshape({4, 2});
      },
      {ErrorCode::kShapeMismatch}, {"reshape", "[2, 3]", "[4, 2]"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).reshape({-1, -1});
      },
      {ErrorCode::kInvalidArgument, ErrorCode::kShapeMismatch}, {"reshape"}));
  EXPECT_TRUE(raises(
      [] {
        floats({3}).expand({2, 4});
      },
      {ErrorCode::kShapeMismatch}, {"expand", "[3]", "[2, 4]"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).permute({0, 0});
      },
      {ErrorCode::kInvalidArgument, ErrorCode::kOutOfRange}, {"permute"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).slice(1, 0, 3, 0);
      },
      {ErrorCode::kInvalidArgument}, {"slice", "0"}));
  EXPECT_TRUE(raises([] { floats({2, 3}).narrow(1, 2, 2); }, {ErrorCode::kOutOfRange}, {"narrow"}));
}

TEST(Errors, DimOutOfRange) {
  EXPECT_TRUE(raises([] { sum(floats({2, 3}), {2}); }, {ErrorCode::kOutOfRange}, {"sum", "2"}));
  EXPECT_TRUE(raises(
      [] {
        softmax(floats({2, 3}), -3);
      },
      {ErrorCode::kOutOfRange}, {"softmax", "-3"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).transpose(0, 5);
      },
      {ErrorCode::kOutOfRange}, {"transpose", "5"}));
  EXPECT_TRUE(raises([] { argmax(floats({2, 3}), 2); }, {ErrorCode::kOutOfRange}, {"argmax", "2"}));
  EXPECT_TRUE(raises(
      [] {
        cumsum(floats({2, 3}), -3);
      },
      {ErrorCode::kOutOfRange}, {"cumsum", "-3"}));
  EXPECT_TRUE(raises(
      [] {
        cat({floats({2, 3}), floats({2, 3})}, 2);
      },
      {ErrorCode::kOutOfRange}, {"cat", "2"}));
  EXPECT_TRUE(raises(
      [] {
        floats({2, 3}).unsqueeze(4);
      },
      {ErrorCode::kOutOfRange}, {"unsqueeze", "4"}));
}

TEST(Errors, UnsupportedDTypes) {
  EXPECT_TRUE(raises(
      [] {
        softmax(ones({2, 3}, DType::kInt64), 1);
      },
      {ErrorCode::kDTypeMismatch}, {"softmax", "int64"}));
  EXPECT_TRUE(
      raises([] { exp(ones({2}, DType::kInt32)); }, {ErrorCode::kDTypeMismatch}, {"exp", "int32"}));
  EXPECT_TRUE(raises(
      [] {
        matmul(ones({2, 2}, DType::kBool), ones({2, 2}, DType::kBool));
      },
      {ErrorCode::kDTypeMismatch}, {"matmul", "bool"}));
  EXPECT_TRUE(raises([] { ones({2}, DType::kInt64).set_requires_grad(true); },
                     {ErrorCode::kDTypeMismatch, ErrorCode::kAutograd}, {"int64"}));
  EXPECT_TRUE(raises([] { floats({2}).data_ptr<double>(); }, {ErrorCode::kDTypeMismatch},
                     {"float32", "float64"}));
}

TEST(Errors, CreationArguments) {
  EXPECT_TRUE(raises(
      [] {
        from_vector<float>({1, 2, 3}, {2, 2});
      },
      {ErrorCode::kShapeMismatch, ErrorCode::kInvalidArgument}, {"from_vector", "[2, 2]", "3"}));
  EXPECT_TRUE(raises([] { zeros({2, -1}); }, {ErrorCode::kInvalidArgument}, {"-1"}));
  EXPECT_TRUE(raises([] { arange(0.0, 1.0, 0.0); }, {ErrorCode::kInvalidArgument}, {"arange"}));
}

TEST(Errors, NnOpArguments) {
  EXPECT_TRUE(raises(
      [] {
        cross_entropy(floats({2, 3}), indices({0, 3}));
      },
      {ErrorCode::kOutOfRange}, {"cross_entropy", "3"}));
  EXPECT_TRUE(raises(
      [] {
        cross_entropy(floats({2, 3}), indices({0, 1, 2}));
      },
      {ErrorCode::kShapeMismatch}, {"cross_entropy", "[2, 3]", "[3]"}));
  EXPECT_TRUE(raises(
      [] {
        layer_norm(floats({2, 3}), {4});
      },
      {ErrorCode::kShapeMismatch}, {"layer_norm", "[2, 3]", "[4]"}));
  EXPECT_TRUE(raises(
      [] {
        layer_norm(floats({2, 3}), {3}, floats({2}));
      },
      {ErrorCode::kShapeMismatch}, {"layer_norm", "[2]"}));
  EXPECT_TRUE(raises(
      [] {
        rms_norm(floats({2, 3}), {2});
      },
      {ErrorCode::kShapeMismatch}, {"rms_norm", "[2, 3]", "[2]"}));
  EXPECT_TRUE(raises(
      [] {
        Generator gen(0);
        dropout(floats({2}), 1.5, true, gen);
      },
      {ErrorCode::kInvalidArgument}, {"dropout", "1.5"}));
  EXPECT_TRUE(raises([] { split(floats({4}), int64_t{0}); }, {ErrorCode::kInvalidArgument},
                     {"split", "0"}));
  EXPECT_TRUE(raises(
      [] {
        split(floats({4}), std::vector<int64_t>{1, 2});
      },
      {ErrorCode::kShapeMismatch, ErrorCode::kInvalidArgument}, {"split", "4"}));
  EXPECT_TRUE(raises([] { chunk(floats({4}), 0); }, {ErrorCode::kInvalidArgument}, {"chunk", "0"}));
  EXPECT_TRUE(raises([] { tril(floats({3})); },
                     {ErrorCode::kShapeMismatch, ErrorCode::kInvalidArgument}, {"tril", "[3]"}));
}

TEST(Errors, ItemNeedsOneElement) {
  EXPECT_TRUE(raises([] { floats({2}).item<float>(); },
                     {ErrorCode::kInvalidArgument, ErrorCode::kShapeMismatch}, {"item", "[2]"}));
  EXPECT_EQ(floats({1, 1}).item<float>(), 1.0f);
}

TEST(Errors, BackwardWithoutGraph) {
  EXPECT_TRUE(raises([] { scalar_tensor(2.0, DType::kFloat64).backward(); }, {ErrorCode::kAutograd},
                     {"backward"}));
  EXPECT_TRUE(
      raises([] { (scalar_tensor(2.0) * 3.0).backward(); }, {ErrorCode::kAutograd}, {"backward"}));
}

TEST(Errors, MessagesUseTheDocumentedShapeFormat) {
  try {
    add(floats({2, 3, 4}), floats({5}));
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
    EXPECT_EQ(std::string(e.what()).rfind("add", 0), 0u)
        << "messages start with the op name: " << e.what();
  }
}

}  // namespace
}  // namespace rd
