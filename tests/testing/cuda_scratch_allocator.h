// A plain cudaMalloc/cudaFree Allocator for the scratch memory of kernels under test, with
// exact stats (live and peak bytes, calls) so that a test can check what a kernel used.
// CUDA builds only: it includes the CUDA runtime, which CPU-only builds lack.
#pragma once

#if defined(RD_WITH_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "ringdilated/kernels/allocator.h"
#include "testing/cuda_test_streams.h"

namespace rd::test {

class CudaTestAllocator : public Allocator {
 public:
  Device device() const override { return Device::cuda(0); }
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, nbytes), "CudaTestAllocator::allocate");
    sizes_.emplace_back(p, nbytes);
    stats_.allocated_bytes += static_cast<int64_t>(nbytes);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    ++stats_.system_allocs;
    return p;
  }
  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    // cudaFree waits for the device, so kernels still using the memory finish first.
    cuda_check(cudaFree(ptr), "CudaTestAllocator::deallocate");
    auto it = std::find_if(sizes_.begin(), sizes_.end(), [&](auto& e) { return e.first == ptr; });
    if (it == sizes_.end()) throw std::runtime_error("deallocate of an unknown pointer");
    stats_.allocated_bytes -= static_cast<int64_t>(it->second);
    sizes_.erase(it);
    ++stats_.system_frees;
  }
  MemoryStats stats() const override { return stats_; }
  void reset_peak_stats() override { stats_.peak_allocated_bytes = stats_.allocated_bytes; }
  void empty_cache() override {}

 private:
  std::vector<std::pair<void*, size_t>> sizes_;
  MemoryStats stats_;
};

}  // namespace rd::test

#endif  // RD_WITH_CUDA
