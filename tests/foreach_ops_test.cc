// The multi-tensor ops (foreach_sum_squares, foreach_scaled_copy_) on every device this
// process can run, against float64 references: lists mixing tiny, empty and multi-chunk
// tensors (more than 65536 elements), every dtype conversion the trainer uses, in place, with
// a device scale; poisoned outputs show unwritten elements; bad arguments get named errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"
#include "testing/random_tensors.h"

namespace rd::test {
namespace {

std::vector<Device> devices() {
  std::vector<Device> d{Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

// Shapes of one list: small, empty, exactly one chunk, and several chunks with a tail.
const std::vector<Shape> kShapes = {{3, 5}, {0}, {65536}, {2, 70001}, {7}};

std::vector<Tensor> random_list(DType dtype, std::mt19937_64& rng) {
  std::vector<Tensor> list;
  for (const Shape& shape : kShapes) list.push_back(random_nonzero_tensor(shape, dtype, rng));
  return list;
}

std::vector<Tensor> on(const std::vector<Tensor>& list, Device device) {
  std::vector<Tensor> moved;
  for (const Tensor& t : list) moved.push_back(t.to(device));
  return moved;
}

TEST(ForeachOps, SumSquaresMatchesFloat64) {
  std::mt19937_64 rng(3);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    const std::vector<Tensor> list = random_list(dtype, rng);
    double want = 0, count = 0;
    for (const Tensor& t : list) {
      for (double v : t.to_vector<double>()) want += v * v;
      count += static_cast<double>(t.numel());
    }
    for (Device device : devices()) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + device.str());
      const Tensor got = foreach_sum_squares(on(list, device));
      ASSERT_EQ(got.dim(), 0);
      ASSERT_EQ(got.dtype(), DType::kFloat64);
      ASSERT_EQ(got.device(), device);
      // Each chunk of 65536 squares (all positive) summed in float32 (float64 for float64):
      // a relative error of at most 65536 roundoffs, far less in practice for a tree sum.
      const double u = unit_roundoff(dtype == DType::kFloat64 ? dtype : DType::kFloat32);
      EXPECT_NEAR(got.item<double>(), want, 2 * std::sqrt(count) * u * want + 1e-300);
    }
  }
}

TEST(ForeachOps, ScaledCopyConvertsScalesAndWritesEveryElement) {
  struct Case {
    DType src, dst;
  };
  std::mt19937_64 rng(5);
  for (const Case& c : {Case{DType::kBFloat16, DType::kFloat32}, Case{DType::kFloat32, DType::kBFloat16},
                        Case{DType::kFloat16, DType::kFloat32}, Case{DType::kFloat32, DType::kFloat32},
                        Case{DType::kFloat64, DType::kFloat64}}) {
    const std::vector<Tensor> src = random_list(c.src, rng);
    for (Device device : devices()) {
      for (bool with_device_scale : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(c.src)) + " -> " + std::string(dtype_name(c.dst)) + " on " +
                     device.str() + (with_device_scale ? ", device scale" : ""));
        std::vector<Tensor> dst;
        for (const Tensor& t : src) {
          dst.push_back(full(t.shape(), std::nan(""), TensorOptions(c.dst).with_device(device)));
        }
        const double scale = 0.375;
        const Tensor device_scale =
            with_device_scale ? scalar_tensor(-2.5, TensorOptions(DType::kFloat32).with_device(device))
                              : Tensor();
        foreach_scaled_copy_(dst, on(src, device), scale, device_scale);
        const double factor = with_device_scale ? scale * -2.5 : scale;
        for (size_t i = 0; i < src.size(); ++i) {
          const std::vector<double> x = src[i].to_vector<double>();
          const std::vector<double> y = dst[i].to_vector<double>();
          for (size_t k = 0; k < x.size(); ++k) {
            const double want = x[k] * factor;
            // One rounding to dst's dtype after one in the compute type (the factor is exact).
            const double tol = 2 * unit_roundoff(c.dst) * std::fabs(want);
            ASSERT_NEAR(y[k], want, tol) << "tensor " << i << " element " << k;
          }
        }
      }
    }
  }
}

TEST(ForeachOps, ScaledCopyInPlace) {
  std::mt19937_64 rng(7);
  const std::vector<Tensor> values = random_list(DType::kBFloat16, rng);
  for (Device device : devices()) {
    SCOPED_TRACE(device.str());
    std::vector<Tensor> list;
    for (const Tensor& t : values) list.push_back(t.clone().to(device));
    foreach_scaled_copy_(list, list, 4.0);  // a power of two: exact in bfloat16
    for (size_t i = 0; i < list.size(); ++i) {
      const std::vector<double> before = values[i].to_vector<double>();
      const std::vector<double> after = list[i].to_vector<double>();
      for (size_t k = 0; k < before.size(); ++k) ASSERT_EQ(after[k], 4.0 * before[k]);
    }
  }
}

TEST(ForeachOps, RejectsBadArguments) {
  const Tensor a = zeros({2, 3});
  const Tensor b = zeros({3}, TensorOptions(DType::kBFloat16));
  EXPECT_TRUE(raises([&] { foreach_sum_squares({}); }, {ErrorCode::kInvalidArgument},
                     {"foreach_sum_squares", "empty"}));
  EXPECT_TRUE(raises([&] { foreach_sum_squares({a, b}); }, {ErrorCode::kDTypeMismatch},
                     {"foreach_sum_squares", "tensors[1]", "bfloat16"}));
  EXPECT_TRUE(raises([&] { foreach_sum_squares({a.t()}); }, {ErrorCode::kInvalidArgument},
                     {"foreach_sum_squares", "tensors[0]", "contiguous"}));
  EXPECT_TRUE(raises([&] { foreach_sum_squares({zeros({2}, TensorOptions(DType::kInt64))}); },
                     {ErrorCode::kDTypeMismatch}, {"foreach_sum_squares", "floating"}));
  EXPECT_TRUE(raises([&] { foreach_scaled_copy_({a}, {zeros({3, 2})}); }, {ErrorCode::kShapeMismatch},
                     {"foreach_scaled_copy_", "dst[0]", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(raises([&] { foreach_scaled_copy_({a}, {a, a}); }, {ErrorCode::kInvalidArgument},
                     {"foreach_scaled_copy_", "1 dst", "2 src"}));
  EXPECT_TRUE(raises([&] { foreach_scaled_copy_({a}, {a}, 1.0, zeros({2})); },
                     {ErrorCode::kInvalidArgument}, {"foreach_scaled_copy_", "device_scale", "[2]"}));
  EXPECT_TRUE(raises([&] { foreach_scaled_copy_({a}, {a}, std::nan("")); },
                     {ErrorCode::kInvalidArgument}, {"multi_tensor_scale", "scale"}));
}

}  // namespace
}  // namespace rd::test
