// clip_grad_norm_ against a float64 reference: the returned norm (2, 1, 3 and inf norms) and
// the scaled gradients for float32, float64, bfloat16 and float16 parameters together, with
// undefined gradients skipped; no change below max_norm; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/nn/grad_clip.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"
#include "testing/random_tensors.h"

namespace rd {
namespace {

using nn::clip_grad_norm_;
using test::random_nonzero_tensor;

// Parameters of several dtypes with random gradients, one without a gradient.
struct Params {
  std::vector<Tensor> params;
  std::vector<std::vector<double>> grads_before;  // empty for the one without a gradient
  static constexpr size_t kWithoutGradient = 3;

  explicit Params(uint64_t seed, bool with_float64 = true) {
    std::mt19937_64 rng(seed);
    std::vector<std::pair<Shape, DType>> specs = {{{4, 5}, DType::kFloat32},
                                                  {{7}, DType::kBFloat16},
                                                  {{3, 2}, DType::kFloat16},
                                                  {{6}, DType::kFloat32},  // no gradient
                                                  {{0}, DType::kFloat32}};
    if (with_float64) specs.push_back({{2, 3}, DType::kFloat64});
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [shape, dtype] = specs[i];
      Tensor p = random_nonzero_tensor(shape, dtype, rng);
      if (i != kWithoutGradient) {
        const Tensor g = random_nonzero_tensor(shape, dtype, rng);
        p.set_grad(g);
        grads_before.push_back(g.to_vector<double>());
      } else {
        grads_before.emplace_back();
      }
      params.push_back(p);
    }
  }

  // The global norm of the gradients, in float64.
  double reference_norm(double p) const {
    double acc = 0;
    for (const auto& g : grads_before) {
      for (double v : g) acc = std::isinf(p) ? std::max(acc, std::fabs(v)) : acc + std::pow(std::fabs(v), p);
    }
    return std::isinf(p) ? acc : std::pow(acc, 1 / p);
  }
};

// Clips with max_norm and checks the norm and every scaled gradient against float64.
void check_clip(double norm_type, double max_norm_fraction, bool with_float64) {
  SCOPED_TRACE(testing::Message() << "norm_type " << norm_type << ", max_norm = "
                                  << max_norm_fraction << " x norm");
  Params ps(11, with_float64);
  const double want_norm = ps.reference_norm(norm_type);
  const double max_norm = max_norm_fraction * want_norm;
  const Tensor norm = clip_grad_norm_(ps.params, max_norm, norm_type);
  const DType norm_dtype = with_float64 ? DType::kFloat64 : DType::kFloat32;
  ASSERT_EQ(norm.dim(), 0);
  ASSERT_EQ(norm.dtype(), norm_dtype);
  ASSERT_EQ(norm.device(), Device::cpu());
  // A sum of under 100 terms in the norm's type, then a root: a few hundred roundoffs.
  const double u_norm = test::unit_roundoff(norm_dtype);
  EXPECT_NEAR(norm.item<double>(), want_norm, 256 * u_norm * want_norm);

  const double factor = std::min(1.0, max_norm / (want_norm + 1e-6));
  for (size_t i = 0; i < ps.params.size(); ++i) {
    const Tensor grad = ps.params[i].grad();
    if (i == Params::kWithoutGradient) {
      EXPECT_FALSE(grad.defined()) << "an undefined gradient must stay undefined";
      continue;
    }
    const DType dtype = grad.dtype();
    ASSERT_EQ(dtype, ps.params[i].dtype());
    const std::vector<double> got = grad.to_vector<double>();
    for (size_t k = 0; k < got.size(); ++k) {
      const double want = ps.grads_before[i][k] * factor;
      // Rounded once to the gradient's dtype, from a factor good to the norm's precision.
      const double tol = (test::unit_roundoff(dtype) + 512 * u_norm) * std::fabs(want);
      ASSERT_NEAR(got[k], want, tol) << "parameter " << i << " element " << k;
    }
  }
}

TEST(ClipGradNorm, ScalesEveryGradientToMaxNormForEachNormType) {
  for (double norm_type : {2.0, 1.0, 3.0, nn::kInfNorm}) {
    check_clip(norm_type, 0.25, /*with_float64=*/false);
    check_clip(norm_type, 0.25, /*with_float64=*/true);
  }
}

// grad_norm measures what clip_grad_norm_ measures (float64 reference, every norm type, with
// and without float64 gradients) and leaves every gradient as it was.
TEST(GradNorm, MeasuresTheGlobalNormWithoutClipping) {
  for (double norm_type : {2.0, 1.0, 3.0, nn::kInfNorm}) {
    for (bool with_float64 : {false, true}) {
      SCOPED_TRACE(testing::Message() << "norm_type " << norm_type << ", float64 " << with_float64);
      Params ps(13, with_float64);
      const Tensor norm = nn::grad_norm(ps.params, norm_type);
      const DType norm_dtype = with_float64 ? DType::kFloat64 : DType::kFloat32;
      ASSERT_EQ(norm.dtype(), norm_dtype);
      const double want = ps.reference_norm(norm_type);
      EXPECT_NEAR(norm.item<double>(), want, 256 * test::unit_roundoff(norm_dtype) * want);
      for (size_t i = 0; i < ps.params.size(); ++i) {
        if (i == Params::kWithoutGradient) continue;
        EXPECT_EQ(ps.params[i].grad().to_vector<double>(), ps.grads_before[i]) << "parameter " << i;
      }
    }
  }
  EXPECT_TRUE(test::raises([] { nn::grad_norm({}, -1.0); }, {ErrorCode::kInvalidArgument},
                           {"grad_norm", "norm_type", "-1"}));
  EXPECT_EQ(nn::grad_norm({}).item<double>(), 0.0);
}

// A strided gradient (a transposed view) is measured and scaled like a packed one.
TEST(ClipGradNorm, ScalesStridedGradients) {
  std::mt19937_64 rng(21);
  Tensor packed = random_nonzero_tensor({4, 5}, DType::kFloat32, rng);
  Tensor strided = random_nonzero_tensor({4, 5}, DType::kBFloat16, rng);
  packed.set_grad(random_nonzero_tensor({4, 5}, DType::kFloat32, rng));
  strided.set_grad(random_nonzero_tensor({5, 4}, DType::kBFloat16, rng).t());
  ASSERT_FALSE(strided.grad().is_contiguous());
  double want_norm = 0;
  std::vector<std::vector<double>> before;
  for (const Tensor& p : {packed, strided}) {
    before.push_back(p.grad().to_vector<double>());
    for (double v : before.back()) want_norm += v * v;
  }
  want_norm = std::sqrt(want_norm);
  const Tensor norm = clip_grad_norm_(std::vector<Tensor>{packed, strided}, 0.5 * want_norm);
  EXPECT_NEAR(norm.item<double>(), want_norm, 64 * test::unit_roundoff(DType::kFloat32) * want_norm);
  const double factor = 0.5 * want_norm / (want_norm + 1e-6);
  for (size_t i = 0; i < 2; ++i) {
    const Tensor p = i == 0 ? packed : strided;
    const std::vector<double> got = p.grad().to_vector<double>();
    for (size_t k = 0; k < got.size(); ++k) {
      const double want = before[i][k] * factor;
      ASSERT_NEAR(got[k], want, 2 * test::unit_roundoff(p.dtype()) * std::fabs(want) + 1e-6 * std::fabs(want))
          << "parameter " << i << " element " << k;
    }
  }
}

TEST(ClipGradNorm, LeavesGradientsBelowMaxNormUnchanged) {
  Params ps(12);
  const Tensor norm = clip_grad_norm_(ps.params, 2 * ps.reference_norm(2.0));
  for (size_t i = 0; i < ps.params.size(); ++i) {
    if (i == Params::kWithoutGradient) continue;
    EXPECT_EQ(ps.params[i].grad().to_vector<double>(), ps.grads_before[i]) << "parameter " << i;
  }
  EXPECT_GT(norm.item<double>(), 0);
}

TEST(ClipGradNorm, AfterClippingTheNormIsMaxNorm) {
  Params ps(13, /*with_float64=*/false);
  const double max_norm = 0.5;
  std::vector<std::pair<std::string, Tensor>> named;
  for (size_t i = 0; i < ps.params.size(); ++i) named.emplace_back(str_cat("p", i), ps.params[i]);
  const double before = clip_grad_norm_(named, max_norm).item<double>();
  ASSERT_GT(before, 4 * max_norm);
  // Measured again in float64 from the clipped (and rounded) gradients.
  double sum_sq = 0;
  for (const Tensor& p : ps.params) {
    if (!p.grad().defined()) continue;
    for (double v : p.grad().to_vector<double>()) sum_sq += v * v;
  }
  EXPECT_NEAR(std::sqrt(sum_sq), max_norm, 1e-2 * max_norm);  // bfloat16 gradients in the mix
}

TEST(ClipGradNorm, NoGradientsGiveZero) {
  Tensor p = zeros({3});
  EXPECT_EQ(clip_grad_norm_(std::vector<Tensor>{p}, 1.0).item<double>(), 0.0);
  const Tensor none = clip_grad_norm_(std::vector<Tensor>{}, 1.0);
  EXPECT_EQ(none.dim(), 0);
  EXPECT_EQ(none.dtype(), DType::kFloat32);
}

TEST(ClipGradNorm, RejectsBadArguments) {
  Params ps(14);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double max_norm : {0.0, -1.0, nan, inf}) {
    EXPECT_TRUE(test::raises([&] { clip_grad_norm_(ps.params, max_norm); },
                             {ErrorCode::kInvalidArgument}, {"clip_grad_norm_", "'max_norm'"}))
        << max_norm;
  }
  for (double norm_type : {0.0, -2.0, nan}) {
    EXPECT_TRUE(test::raises([&] { clip_grad_norm_(ps.params, 1.0, norm_type); },
                             {ErrorCode::kInvalidArgument}, {"clip_grad_norm_", "'norm_type'"}))
        << norm_type;
  }
  EXPECT_TRUE(test::raises([&] { clip_grad_norm_(std::vector<Tensor>{zeros({2}), Tensor()}, 1.0); },
                           {ErrorCode::kInvalidArgument}, {"clip_grad_norm_", "parameters[1]"}));
  const std::vector<std::pair<std::string, Tensor>> named = {{"w", Tensor()}};
  EXPECT_TRUE(test::raises([&] { clip_grad_norm_(named, 1.0); }, {ErrorCode::kInvalidArgument},
                           {"clip_grad_norm_", "'w'"}));
  // Nothing was scaled by the rejected calls.
  EXPECT_EQ(ps.params[0].grad().to_vector<double>(), ps.grads_before[0]);
}

}  // namespace
}  // namespace rd
