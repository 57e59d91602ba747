// GPU tests of AdamW: the multi-tensor CUDA kernel against the CPU kernel on the same inputs,
// bit for bit (both do the same operations in the same order, without FMA contraction,
// with IEEE division and square root), over every float dtype, odd sizes, multi-chunk
// tensors, misaligned buffers (the scalar path) and more tensors than one launch holds.
// Parameters are updated in place, so instead of poisoned outputs: at the first step every
// parameter element must change (the CPU side checks it, the GPU must then match), and guard
// bytes around every device buffer must survive (out-of-bounds writes show). Also
// nn::AdamW on CUDA against nn::AdamW on the CPU, and a CPU checkpoint resumed on the GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/optimizer.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/random_tensors.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/kernels.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd {
namespace {

#if !defined(RD_WITH_CUDA)

TEST(CudaAdamWTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

using kernels::AdamWStep;
using kernels::AdamWTensor;

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                             DType::kFloat16};

using test::cuda_check;
using test::random_nonzero_tensor;

size_t nbytes(const Tensor& t) { return static_cast<size_t>(t.numel()) * dtype_size(t.dtype()); }

// Device memory for the values of a host tensor, starting `offset` bytes past a 256-byte
// aligned address (an offset that is not a multiple of 16 forces the kernel's scalar path),
// between guard zones filled with a known byte.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr int kGuardByte = 0xa5;

  GuardedBuffer(const Tensor& host, size_t offset)
      : bytes_(nbytes(host)), offset_(offset), total_(kGuard + offset + bytes_ + kGuard) {
    cuda_check(cudaMalloc(&base_, total_), "cudaMalloc");
    cuda_check(cudaMemset(base_, kGuardByte, total_), "cudaMemset");
    upload(host);
  }
  ~GuardedBuffer() { cudaFree(base_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  void* data() const { return static_cast<char*>(base_) + kGuard + offset_; }
  void upload(const Tensor& host) {
    cuda_check(cudaMemcpy(data(), host.raw_data(), bytes_, cudaMemcpyHostToDevice), "upload");
  }
  // The buffer's bytes, as a CPU tensor shaped and typed like `like`.
  Tensor download(const Tensor& like) const {
    Tensor out = empty(like.shape(), like.dtype());
    cuda_check(cudaMemcpy(out.raw_data(), data(), bytes_, cudaMemcpyDeviceToHost), "download");
    return out;
  }
  // True when no byte outside [data(), data() + bytes) was written.
  bool guards_intact() const {
    std::vector<unsigned char> all(total_);
    cuda_check(cudaMemcpy(all.data(), base_, total_, cudaMemcpyDeviceToHost), "guards");
    for (size_t i = 0; i < total_; ++i) {
      const bool inside = i >= kGuard + offset_ && i < kGuard + offset_ + bytes_;
      if (!inside && all[i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  size_t bytes_, offset_, total_;
  void* base_ = nullptr;
};

// Which of a tensor's four buffers start misaligned (one element past an aligned address).
struct Misalignment {
  bool param = false, grad = false, exp_avg = false, exp_avg_sq = false;
};

// One tensor of a kernel call, on both devices: host tensors for the CPU kernel, guarded
// device copies for the CUDA kernel.
struct DualTensor {
  Tensor param, grad, exp_avg, exp_avg_sq;  // CPU
  std::unique_ptr<GuardedBuffer> d_param, d_grad, d_exp_avg, d_exp_avg_sq;

  DualTensor(int64_t numel, DType dtype, Misalignment mis, std::mt19937_64& rng)
      : param(random_nonzero_tensor({numel}, dtype, rng)),
        grad(random_nonzero_tensor({numel}, dtype, rng)),
        exp_avg(zeros({numel}, accumulation_dtype(dtype))),
        exp_avg_sq(zeros({numel}, accumulation_dtype(dtype))) {
    const size_t t = dtype_size(dtype), a = dtype_size(accumulation_dtype(dtype));
    d_param = std::make_unique<GuardedBuffer>(param, mis.param ? t : 0);
    d_grad = std::make_unique<GuardedBuffer>(grad, mis.grad ? t : 0);
    d_exp_avg = std::make_unique<GuardedBuffer>(exp_avg, mis.exp_avg ? a : 0);
    d_exp_avg_sq = std::make_unique<GuardedBuffer>(exp_avg_sq, mis.exp_avg_sq ? a : 0);
  }
  AdamWTensor host_args() const {
    return {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(),
            param.numel()};
  }
  AdamWTensor device_args() const {
    return {d_param->data(), d_grad->data(), d_exp_avg->data(), d_exp_avg_sq->data(),
            param.numel()};
  }
  void new_gradient(std::mt19937_64& rng) {
    grad = random_nonzero_tensor({param.numel()}, param.dtype(), rng);
    d_grad->upload(grad);
  }
};

// Bitwise equality of a device result with the CPU result, naming the first difference.
::testing::AssertionResult same_bits(const Tensor& cpu, const GuardedBuffer& gpu) {
  const Tensor got = gpu.download(cpu);
  if (nbytes(cpu) == 0 || std::memcmp(cpu.raw_data(), got.raw_data(), nbytes(cpu)) == 0) {
    return ::testing::AssertionSuccess();
  }
  const std::vector<double> want = cpu.to_vector<double>(), have = got.to_vector<double>();
  int64_t differing = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &have[i], sizeof(double)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++differing;
    }
  }
  return ::testing::AssertionFailure()
         << differing << " of " << want.size() << " elements differ; first at " << first
         << ": cpu " << want[static_cast<size_t>(first)] << ", gpu "
         << have[static_cast<size_t>(first)];
}

class CudaAdamWTest : public test::CudaStreamTest {
 protected:
  // Runs `steps` AdamW steps on both devices with fresh gradients each time and checks the
  // GPU's parameters and moments against the CPU's after each one.
  void run_and_compare(std::vector<DualTensor>& tensors, DType dtype, double weight_decay,
                       std::mt19937_64& rng, const std::string& what) {
    for (int64_t step : {1, 2, 3}) {
      SCOPED_TRACE(str_cat(what, " step ", step));
      const AdamWStep s{0.05, 0.9, 0.999, 1e-8, weight_decay, step};
      std::vector<AdamWTensor> host, device;
      std::vector<Tensor> before;
      for (DualTensor& t : tensors) {
        if (step > 1) t.new_gradient(rng);
        before.push_back(t.param.clone());
        host.push_back(t.host_args());
        device.push_back(t.device_args());
      }
      kernels::cpu_backend().adamw(host, dtype, s);
      kernels::cuda::adamw(device, dtype, s, stream());
      sync();
      for (size_t k = 0; k < tensors.size(); ++k) {
        const DualTensor& t = tensors[k];
        SCOPED_TRACE(str_cat("tensor ", k, " of ", t.param.numel(), " elements"));
        if (step == 1) {
          // lr 0.05 moves every element at the first step, even in bfloat16, so a GPU that
          // matches the CPU has written every element.
          const std::vector<double> now = t.param.to_vector<double>();
          const std::vector<double> was = before[k].to_vector<double>();
          for (size_t i = 0; i < now.size(); ++i) ASSERT_NE(now[i], was[i]) << "element " << i;
        }
        ASSERT_TRUE(same_bits(t.param, *t.d_param)) << "param";
        ASSERT_TRUE(same_bits(t.exp_avg, *t.d_exp_avg)) << "exp_avg";
        ASSERT_TRUE(same_bits(t.exp_avg_sq, *t.d_exp_avg_sq)) << "exp_avg_sq";
        for (const GuardedBuffer* b : {t.d_param.get(), t.d_grad.get(), t.d_exp_avg.get(),
                                       t.d_exp_avg_sq.get()}) {
          ASSERT_TRUE(b->guards_intact()) << "a write outside a buffer";
        }
      }
    }
  }
};

TEST_F(CudaAdamWTest, MatchesCpuForEveryDTypeSizeAndAlignment) {
  // Sizes: single, odd, not a multiple of any vector width, exactly one 64K chunk, several
  // chunks with a ragged end.
  const std::vector<int64_t> sizes = {1, 7, 9, 4097, 65536, 3 * 65536 + 5};
  const std::vector<std::pair<std::string, Misalignment>> layouts = {
      {"aligned", {}},
      {"param misaligned", {true, false, false, false}},
      {"grad misaligned", {false, true, false, false}},
      {"exp_avg misaligned", {false, false, true, false}},
      {"all misaligned", {true, true, true, true}},
  };
  for (DType dtype : kFloatTypes) {
    for (double weight_decay : {0.0, 0.1}) {
      for (const auto& [layout, mis] : layouts) {
        std::mt19937_64 rng(11);
        std::vector<DualTensor> tensors;
        for (int64_t n : sizes) tensors.emplace_back(n, dtype, mis, rng);
        tensors.emplace_back(0, dtype, mis, rng);  // empty: nothing to do
        run_and_compare(tensors, dtype, weight_decay, rng,
                        str_cat(dtype_name(dtype), " wd=", weight_decay, " ", layout));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// 1500 tensors need three launches (a launch holds up to 720); sizes and alignments vary,
// and large tensors sit around the launch boundaries.
TEST_F(CudaAdamWTest, MoreTensorsThanOneLaunchHolds) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    std::mt19937_64 rng(12);
    std::uniform_int_distribution<int64_t> size(0, 3000);
    std::bernoulli_distribution misaligned(0.25);
    std::vector<DualTensor> tensors;
    tensors.reserve(1500);
    for (int i = 0; i < 1500; ++i) {
      const bool big = i == 0 || i == 719 || i == 720 || i == 1439 || i == 1499;
      const bool shift = misaligned(rng);
      tensors.emplace_back(big ? 70001 : size(rng), dtype, Misalignment{shift, false, shift, shift},
                           rng);
    }
    run_and_compare(tensors, dtype, 0.01, rng, str_cat(dtype_name(dtype), " x1500"));
    if (HasFatalFailure()) return;
  }
}

TEST_F(CudaAdamWTest, RejectsBadArgumentsLikeTheCpu) {
  const AdamWTensor null_grad{reinterpret_cast<void*>(256), nullptr,
                              reinterpret_cast<void*>(256), reinterpret_cast<void*>(256), 3};
  AdamWStep bad_beta;
  bad_beta.beta1 = 1.0;
  struct Case {
    std::vector<AdamWTensor> tensors;
    DType dtype;
    AdamWStep step;
  };
  const std::vector<Case> cases = {
      {{}, DType::kInt64, AdamWStep{}},
      {{null_grad}, DType::kFloat32, AdamWStep{}},
      {{}, DType::kFloat32, bad_beta},
  };
  for (const Case& c : cases) {
    std::string cpu_message, gpu_message;
    try {
      kernels::cpu_backend().adamw(c.tensors, c.dtype, c.step);
    } catch (const Error& e) {
      cpu_message = e.what();
    }
    try {
      kernels::cuda::adamw(c.tensors, c.dtype, c.step, stream());
    } catch (const Error& e) {
      gpu_message = e.what();
    }
    EXPECT_FALSE(cpu_message.empty());
    EXPECT_EQ(gpu_message, cpu_message);
  }
}

// ---------------------------------------------------------------------------------------
// nn::AdamW on the GPU.

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

NamedTensors on_device(const NamedTensors& params, Device device) {
  NamedTensors out;
  for (const auto& [name, p] : params) out.emplace_back(name, p.to(device).clone());
  return out;
}

// The CUDA optimizer (several dtypes, so several kernel calls per step; one parameter
// joining late, so two bias corrections in one step) moves exactly like the CPU one, and a
// checkpoint taken on the CPU resumes on the GPU.
TEST_F(CudaAdamWTest, OptimizerOnCudaMatchesCpuAndResumesCpuState) {
  const Device gpu = Device::cuda(0);
  std::mt19937_64 rng(13);
  const NamedTensors initial = {{"w", random_nonzero_tensor({33, 17}, DType::kFloat32, rng)},
                                {"e", random_nonzero_tensor({1000}, DType::kBFloat16, rng)},
                                {"h", random_nonzero_tensor({5}, DType::kFloat16, rng)},
                                {"d", random_nonzero_tensor({3, 3}, DType::kFloat64, rng)}};
  NamedTensors cpu_params = on_device(initial, Device::cpu());
  NamedTensors gpu_params = on_device(initial, gpu);
  const nn::AdamWOptions options{0.01, 0.9, 0.99, 1e-6, 0.1};
  nn::AdamW cpu_opt(cpu_params, options), gpu_opt(gpu_params, options);
  auto step_both = [&](int step) {
    for (size_t i = 0; i < initial.size(); ++i) {
      if (step == 0 && initial[i].first == "h") continue;  // "h" joins at the second step
      const Tensor g = random_nonzero_tensor(initial[i].second.shape(),
                                           initial[i].second.dtype(), rng);
      cpu_params[i].second.set_grad(g);
      gpu_params[i].second.set_grad(g.to(gpu));
    }
    cpu_opt.step();
    gpu_opt.step();
  };
  auto expect_same = [&](const NamedTensors& a, const NamedTensors& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      const Tensor x = a[i].second.to(Device::cpu()), y = b[i].second.to(Device::cpu());
      ASSERT_EQ(std::memcmp(x.raw_data(), y.raw_data(), nbytes(x)), 0) << a[i].first;
    }
  };
  for (int step = 0; step < 3; ++step) step_both(step);
  expect_same(cpu_params, gpu_params);
  const std::map<std::string, Tensor> cpu_state = cpu_opt.state_dict();
  for (const auto& [key, t] : gpu_opt.state_dict()) {
    EXPECT_EQ(t.device(), key == "step" || key.starts_with("step.") ? Device::cpu() : gpu) << key;
    const Tensor x = cpu_state.at(key), y = t.to(Device::cpu());
    EXPECT_EQ(std::memcmp(x.raw_data(), y.raw_data(), nbytes(x)), 0) << key;
  }

  // Resume the CPU run's checkpoint on the GPU; both continue identically.
  NamedTensors resumed_params = on_device(cpu_params, gpu);
  nn::AdamW resumed(resumed_params, options);
  resumed.load_state_dict(cpu_state);
  for (size_t i = 0; i < initial.size(); ++i) {
    const Tensor g = random_nonzero_tensor(initial[i].second.shape(),
                                           initial[i].second.dtype(), rng);
    cpu_params[i].second.set_grad(g);
    resumed_params[i].second.set_grad(g.to(gpu));
  }
  cpu_opt.step();
  resumed.step();
  expect_same(cpu_params, resumed_params);
}

#endif  // RD_WITH_CUDA

}  // namespace
}  // namespace rd
