// The attention conformance table (tests/testing/attention_conformance.h) on the first CUDA
// device, through each kernel: math (every case), flash and cuDNN (the cases each accepts;
// a case that names a kernel in its `must` fails when that kernel refuses it). Every case,
// forward and backward, against the float64 reference, with poisoned outputs and scratch.
// Registered whether or not a GPU is there (stable names); skipped without one.
#include <gtest/gtest.h>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/tensor/device.h"
#include "testing/attention_conformance.h"

namespace rd::test {
namespace {

using kernels::AttentionKernel;

class CudaAttentionConformance : public ::testing::TestWithParam<AttentionRun> {};

TEST_P(CudaAttentionConformance, MatchesTheFloat64Reference) {
  check_attention_case(*GetParam().c, Device::cuda(0), GetParam().kernel);
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaAttentionConformance,
                         ::testing::ValuesIn(attention_runs({AttentionKernel::kMath,
                                                             AttentionKernel::kFlash,
                                                             AttentionKernel::kCudnn})),
                         attention_run_name);

}  // namespace
}  // namespace rd::test
