// CUDA runtime scaffolding for GPU tests: checked runtime calls, a fixture that skips
// without a device and runs on its own stream, and a stream a test can hold at a gate.
// CUDA builds only: it includes the CUDA runtime, which CPU-only builds lack.
#pragma once

#if defined(RD_WITH_CUDA)

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/tensor/device.h"

namespace rd::test {

// Throws std::runtime_error naming `what` when a CUDA runtime call failed.
inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// A fixture for tests that launch on one stream of device 0; they skip without a device.
// Parameterized tests add ::testing::WithParamInterface<T>.
class CudaStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    cuda_check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream() const { return stream_; }
  // Waits for the stream; throws on an error of anything it ran.
  void sync() {
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cuda_check(cudaGetLastError(), "cudaGetLastError");
  }

 private:
  cudaStream_t stream_ = nullptr;
};

// A non-blocking stream (no implicit sync with the legacy default stream), destroyed with
// the test.
class TestStream {
 public:
  TestStream() { RD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~TestStream() { static_cast<void>(cudaStreamDestroy(stream_)); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Holds `stream` at a host callback until open() (at the latest when the gate is
// destroyed), so that everything queued behind it stays pending meanwhile. While a gate is
// closed the test must not synchronize the device (cudaFree, cudaDeviceSynchronize).
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : stream_(stream) {
    RD_CUDA_CHECK(cudaLaunchHostFunc(stream_, &StreamGate::hold, this));
  }
  ~StreamGate() {
    open();
    static_cast<void>(cudaStreamSynchronize(stream_));
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void open() { open_.store(true); }

 private:
  static void CUDART_CB hold(void* self) {
    while (!static_cast<StreamGate*>(self)->open_.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};

}  // namespace rd::test

#endif  // RD_WITH_CUDA
