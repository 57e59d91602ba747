// rotary_embedding beyond the op suite: accuracy at positions around 2^21 against a long
// double reference with a tolerance derived from the dtype and the position (on every
// device this process can run), the sequence-parallel shard property of position_offset,
// the backward pass as the inverse rotation, the packed q/k/v forms (copying and
// overwriting), and argument errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/dtype_precision.h"
#include "testing/raises.h"
#include "testing/reference.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                             DType::kFloat16};

std::vector<Device> devices() {
  std::vector<Device> d{Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

RefArray random_x(const Shape& shape, std::mt19937_64& rng) {
  return random_values(shape, Domain::kAny, DType::kFloat64, rng);
}

// |got - want| allowed for one output element of a pair (x1, x2) at `position`:
//   - rounding cos and sin to the compute type and the two products and the sum in it:
//     a few units of the compute type's roundoff times |x1| + |x2|;
//   - rounding the result to the dtype: one unit of its roundoff times the same;
//   - the float64 angle position * freq (freq <= 1): its rounding is ~2^-53 * position rad,
//     which moves the result by up to that times |x1| + |x2|. This is the term a float32
//     angle would blow up (2^-24 * 2^21 = 0.125 rad), so the test catches one.
double pair_tolerance(DType dtype, int64_t position, double magnitude) {
  const double u_compute = unit_roundoff(dtype == DType::kFloat64 ? dtype : DType::kFloat32);
  const double angle_error = 4.0 * std::ldexp(1.0, -53) * static_cast<double>(position);
  return (8.0 * u_compute + unit_roundoff(dtype) + angle_error) * magnitude;
}

TEST(RotaryEmbedding, MatchesLongDoubleReferenceAroundPosition2M) {
  std::mt19937_64 rng(2024);
  const Shape shape = {2, 5, 3, 16};  // B, T, H, D
  const int64_t half = shape[3] / 2;
  for (int64_t offset : {int64_t{0}, int64_t{2'097'150}, int64_t{1'999'993}}) {
    const RefArray x = random_x(shape, rng);
    for (DType dtype : kFloatTypes) {
      const Tensor x_cpu = from_ref(x, dtype);
      const RefArray x_rounded = to_ref(x_cpu);  // the reference rotates what the op sees
      const RefArray want = ref::rotary_embedding(x_rounded, offset, 10000.0);
      for (Device device : devices()) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + device.str() + " offset " +
                     std::to_string(offset));
        const RefArray got = to_ref(rotary_embedding(x_cpu.to(device), offset));
        int failures = 0;
        for (int64_t e = 0; e < x.numel() && failures < 5; ++e) {
          ref::Index at = ref::unravel(e, shape);
          ref::Index pair = at;
          pair[3] = at[3] < half ? at[3] + half : at[3] - half;
          const double magnitude = std::fabs(x_rounded.at(at)) + std::fabs(x_rounded.at(pair));
          const double tol = pair_tolerance(dtype, offset + at[1], magnitude);
          if (!(std::fabs(got.data[e] - want.data[e]) <= tol)) {
            ++failures;
            ADD_FAILURE() << "element " << e << " (t=" << at[1] << ", d=" << at[3] << "): got "
                          << got.data[e] << ", want " << want.data[e] << " (tol " << tol << ")";
          }
        }
      }
    }
  }
}

// A sequence-parallel shard holding tokens [k, T) with position_offset k computes what the
// whole sequence computes for those tokens, bit for bit.
TEST(RotaryEmbedding, AShardWithItsOffsetMatchesTheWholeSequence) {
  std::mt19937_64 rng(7);
  const Shape shape = {2, 12, 2, 8};
  for (DType dtype : kFloatTypes) {
    for (Device device : devices()) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + device.str());
      const Tensor x = from_ref(random_x(shape, rng), dtype, device);
      const int64_t start = 1'000'000;
      const Tensor whole = rotary_embedding(x, start);
      for (int64_t k : {int64_t{4}, int64_t{9}}) {
        const Tensor shard = rotary_embedding(x.narrow(1, k, shape[1] - k), start + k);
        EXPECT_TRUE(values_close(to_ref(whole.narrow(1, k, shape[1] - k)), to_ref(shard), {}))
            << "shard from token " << k;
      }
    }
  }
}

// The backward pass is the inverse rotation: the gradient of sum(w * rotary(x)) is
// rotary^-1(w), and rotating that forward again gives w back.
TEST(RotaryEmbedding, BackwardIsTheInverseRotation) {
  std::mt19937_64 rng(11);
  const Shape shape = {1, 6, 2, 10};
  for (Device device : devices()) {
    SCOPED_TRACE(device.str());
    const int64_t offset = 2'000'000;
    Tensor x = from_ref(random_x(shape, rng), DType::kFloat64, device);
    x.set_requires_grad(true);
    const Tensor w = from_ref(random_x(shape, rng), DType::kFloat64, device);
    sum(mul(rotary_embedding(x, offset), w)).backward();
    const RefArray back = to_ref(rotary_embedding(x.grad(), offset));
    EXPECT_TRUE(values_close(to_ref(w), back, tolerance_for(DType::kFloat64, 4)));
    // ... and the gradient differs from w (the rotation is not the identity there).
    EXPECT_FALSE(values_close(to_ref(w), to_ref(x.grad()), tolerance_for(DType::kFloat64, 4)));
  }
}

// The packed form at a transformer's shape (head dim 64, where the GPU moves 16-byte groups
// of pairs): q and k equal rotary_embedding of each, v is copied bit for bit, on every
// device; its gradient equals those of the three separate pieces.
TEST(RotaryEmbedding, PackedQkvMatchesSeparateRotations) {
  std::mt19937_64 rng(13);
  const Shape shape = {2, 37, 3, 4, 64};  // B, T, (q, k, v), H, D
  const int64_t offset = 5000;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (Device device : devices()) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + device.str());
      Tensor qkv = from_ref(random_x(shape, rng), dtype, device);
      qkv.set_requires_grad(true);
      const Tensor w = from_ref(random_x(shape, rng), dtype, device);
      const Tensor packed = rotary_embedding_qkv(qkv, offset);
      sum(mul(packed, w)).backward();
      const Tensor packed_grad = qkv.grad();

      Tensor separate = qkv.detach().clone();
      separate.set_requires_grad(true);
      const Tensor q = rotary_embedding(separate.select(2, 0), offset);
      const Tensor k = rotary_embedding(separate.select(2, 1), offset);
      const Tensor v = separate.select(2, 2);
      sum(add(add(mul(q, w.select(2, 0)), mul(k, w.select(2, 1))), mul(v, w.select(2, 2))))
          .backward();
      for (int64_t part : {0, 1}) {
        EXPECT_TRUE(values_close(to_ref(packed.select(2, part)), to_ref(part == 0 ? q : k),
                                 tolerance_for(dtype, 2)))
            << "part " << part;
      }
      EXPECT_TRUE(values_close(to_ref(packed.select(2, 2)), to_ref(v), {})) << "v";
      EXPECT_TRUE(values_close(to_ref(packed_grad), to_ref(separate.grad()), tolerance_for(dtype, 4)));
    }
  }
}

// The overwriting form gives the copying form's values and gradients (which the test above
// checks against separate rotations), rotating inside the projection's buffer (the result
// aliases it: no packed-sized copy, v never moves).
TEST(RotaryEmbedding, OverwritingPackedQkvMatchesCopying) {
  std::mt19937_64 rng(17);
  const Shape shape = {2, 29, 3, 4, 64};
  const int64_t offset = 123;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (Device device : devices()) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + device.str());
      const Tensor x = from_ref(random_x(shape, rng), dtype, device);
      const Tensor w = from_ref(random_x(shape, rng), dtype, device);
      std::vector<Tensor> results, grads;
      for (bool overwrite : {false, true}) {
        Tensor leaf = x.clone();
        leaf.set_requires_grad(true);
        const Tensor projected = mul(leaf, 2.0);  // a fresh non-leaf, like a projection's output
        const void* projected_data = projected.raw_data();
        const Tensor packed = overwrite ? rotary_embedding_qkv_overwrite(projected, offset)
                                        : rotary_embedding_qkv(projected, offset);
        EXPECT_EQ(packed.raw_data() == projected_data, overwrite);
        sum(mul(packed, w)).backward();  // mul's gradient reaches the rotation exclusively
        results.push_back(packed.detach());
        grads.push_back(leaf.grad());
      }
      EXPECT_TRUE(values_close(to_ref(results[1]), to_ref(results[0]), {})) << "values";
      EXPECT_TRUE(values_close(to_ref(grads[1]), to_ref(grads[0]), {})) << "gradients";
      // ... and the values equal the reference's rotation of 2x.
      const RefArray doubled = ref::map(to_ref(x), [](double v) { return 2.0 * v; });
      const RefArray expected = ref::rotary_embedding_qkv(doubled, offset, 10000.0);
      EXPECT_TRUE(values_close(to_ref(results[1]), expected, tolerance_for(dtype, 4)));
    }
  }
}

// A gradient someone else holds (here the caller's seed) is read, never overwritten.
TEST(RotaryEmbedding, PackedQkvBackwardLeavesSharedGradientsAlone) {
  std::mt19937_64 rng(19);
  const Shape shape = {1, 7, 3, 2, 8};
  for (Device device : devices()) {
    SCOPED_TRACE(device.str());
    Tensor qkv = from_ref(random_x(shape, rng), DType::kFloat32, device);
    qkv.set_requires_grad(true);
    const Tensor seed = from_ref(random_x(shape, rng), DType::kFloat32, device);
    const RefArray seed_values = to_ref(seed);
    rotary_embedding_qkv_overwrite(mul(qkv, 1.0), 9).backward(seed);
    EXPECT_TRUE(values_close(to_ref(seed), seed_values, {})) << "the seed was overwritten";
    const RefArray back = ref::rotary_embedding_qkv(to_ref(qkv.grad()), 9, 10000.0);
    EXPECT_TRUE(values_close(back, seed_values, tolerance_for(DType::kFloat32, 4)));
  }
}

// Position runs (a zigzag rank's two pieces, nn::sequence_pieces): each run of rows is
// rotated from its own first position, in both packed forms, values and gradients, the
// same as rotating each run's rows alone with that offset; runs that do not cover the rows
// exactly are refused, naming the op and the counts.
TEST(RotaryEmbedding, PositionRunsRotateEachRunFromItsOwnPosition) {
  std::mt19937_64 rng(17);
  const Shape shape = {2, 12, 3, 2, 8};
  const std::vector<PositionRun> runs = {{5, 40}, {7, 3000}};
  for (Device device : devices()) {
    SCOPED_TRACE(device.str());
    const Tensor base = from_ref(random_x(shape, rng), DType::kFloat64, device);
    const Tensor w = from_ref(random_x(shape, rng), DType::kFloat64, device);
    Tensor x = base.clone();
    x.set_requires_grad(true);
    const Tensor got = rotary_embedding_qkv(x, runs);
    sum(mul(got, w)).backward();
    Tensor y = base.clone();
    y.set_requires_grad(true);
    const Tensor want = cat({rotary_embedding_qkv(y.narrow(1, 0, 5), 40),
                             rotary_embedding_qkv(y.narrow(1, 5, 7), 3000)}, 1);
    sum(mul(want, w)).backward();
    EXPECT_TRUE(values_close(to_ref(got), to_ref(want), tolerance_for(DType::kFloat64, 2)));
    EXPECT_TRUE(values_close(to_ref(x.grad()), to_ref(y.grad()), tolerance_for(DType::kFloat64, 2)));
    // One run from position 40 would differ after the first run's rows.
    EXPECT_FALSE(values_close(to_ref(got), to_ref(rotary_embedding_qkv(base, 40)),
                              tolerance_for(DType::kFloat64, 2)));
    // The overwriting form, on a fresh non-leaf buffer, gives the same values.
    const Tensor over = rotary_embedding_qkv_overwrite(mul(base, 1.0), runs);
    EXPECT_TRUE(values_close(to_ref(over), to_ref(want), tolerance_for(DType::kFloat64, 2)));
    EXPECT_TRUE(raises([&] { rotary_embedding_qkv(base, {{5, 40}, {6, 3000}}); },
                       {ErrorCode::kShapeMismatch}, {"rotary_embedding_qkv", "11", "12"}));
  }
}

TEST(RotaryEmbedding, RejectsBadArguments) {
  const Tensor x = zeros({1, 2, 2, 4});
  EXPECT_TRUE(raises([&] { rotary_embedding(zeros({1, 2, 2, 3})); }, {ErrorCode::kShapeMismatch},
                     {"rotary_embedding", "even"}));
  EXPECT_TRUE(raises([&] { rotary_embedding(zeros({2, 2, 4})); }, {ErrorCode::kShapeMismatch},
                     {"rotary_embedding", "[B, T, H, D]"}));
  EXPECT_TRUE(raises([&] { rotary_embedding(x, -1); }, {ErrorCode::kInvalidArgument},
                     {"rotary_embedding", "positions"}));
  EXPECT_TRUE(raises([&] { rotary_embedding(x, 0, 0.0); }, {ErrorCode::kInvalidArgument},
                     {"rotary_embedding", "base"}));
  EXPECT_TRUE(raises([&] { rotary_embedding(zeros({1, 2, 2, 4}, DType::kInt64)); },
                     {ErrorCode::kDTypeMismatch}, {"rotary_embedding"}));
  Tensor leaf = zeros({1, 2, 3, 2, 4});
  leaf.set_requires_grad(true);
  EXPECT_TRUE(raises([&] { rotary_embedding_qkv_overwrite(leaf); }, {ErrorCode::kInvalidArgument},
                     {"rotary_embedding_qkv_overwrite", "leaf", "[1, 2, 3, 2, 4]"}));
  EXPECT_TRUE(raises([&] { rotary_embedding_qkv_overwrite(zeros({1, 2, 2, 2, 4})); },
                     {ErrorCode::kShapeMismatch}, {"rotary_embedding_qkv_overwrite", "[B, T, 3, H, D]"}));
}

}  // namespace
}  // namespace rd::test
