// What the flash-attention kernels (kernels/cuda/flash_attention.h) refuse, with reasons,
// through the CUDA backend. Their results, forward and backward, are checked by the
// attention conformance table (tests/cuda_attention_conformance_test.cc, the flash_* cases).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/host_views.h"

namespace rd::test {
namespace {

using kernels::AttentionForwardArgs;
using kernels::AttentionKernel;

TEST(CudaFlashAttentionTest, RefusesWithReasons) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const Device gpu = Device::cuda(0);
  kernels::KernelBackend& backend = backend_for(gpu);
  auto device_view = [&](DType dtype, const std::vector<int64_t>& shape,
                         const std::vector<int64_t>& strides = {}) {
    const Tensor t = zeros({product(shape) * 2}, TensorOptions(dtype).with_device(gpu));
    static std::vector<Tensor> keep;  // the memory outlives the views
    keep.push_back(t);
    return make_view(kernel_view(t).data, dtype, shape, strides);
  };
  AttentionForwardArgs args;
  args.q = args.k = args.v = args.out = device_view(DType::kBFloat16, {2, 16, 300});
  args.params.scale = 0.1;
  std::string why_not;
  EXPECT_FALSE(backend.attention_supports(AttentionKernel::kFlash, args, nullptr, &why_not));
  EXPECT_NE(why_not.find("300"), std::string::npos) << why_not;
  try {
    backend.attention_forward(AttentionKernel::kFlash, args);
    ADD_FAILURE() << "D = 300 ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnimplemented);
  }

  // A head dim that is not unit-stride: every other element of a [16, 128] buffer.
  args.q = args.k = args.v = device_view(DType::kFloat16, {16, 64}, {128, 2});
  args.out = device_view(DType::kFloat16, {16, 64});
  EXPECT_FALSE(backend.attention_supports(AttentionKernel::kFlash, args, nullptr, &why_not));
  EXPECT_NE(why_not.find("head-dim stride"), std::string::npos) << why_not;

  // The forward needs a positive scale.
  args.params.scale = 0.0;
  EXPECT_FALSE(backend.attention_supports(AttentionKernel::kFlash, args, nullptr, &why_not));
  EXPECT_NE(why_not.find("positive scale"), std::string::npos) << why_not;
  args.params.scale = 0.1;

  // float64 belongs to the math path.
  args.q = args.k = args.v = args.out = device_view(DType::kFloat64, {8, 32});
  EXPECT_FALSE(backend.attention_supports(AttentionKernel::kFlash, args, nullptr, &why_not));
  EXPECT_NE(why_not.find("float64"), std::string::npos) << why_not;
}

}  // namespace
}  // namespace rd::test
