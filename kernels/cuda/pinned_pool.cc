// The pinned host staging pool: size-classed cudaHostAlloc buffers, reused once the copies
// that used them have completed.
#include "ringdilated/kernels/cuda/pinned_pool.h"

#include <algorithm>

#include "ringdilated/kernels/cpu/caching_allocator.h"
#include "ringdilated/kernels/cuda/event_queue.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {

PinnedHostPool::PinnedHostPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}

PinnedHostPool::~PinnedHostPool() {
  // At worst the cached buffers stay pinned.
  release_in_destructor("PinnedHostPool: unpinning cached buffers", [&] { empty_cache(); });
  absl::MutexLock lock(&mu_);
  for (auto& [device, events] : spare_events_) {
    for (cudaEvent_t event : events) static_cast<void>(cudaEventDestroy(event));
  }
}

void* PinnedHostPool::allocate(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  RD_CHECK(nbytes <= kMaxRequestBytes, kOutOfMemory, "PinnedHostPool::allocate: requested ", nbytes,
           " bytes, more than the largest supported size ", kMaxRequestBytes);
  const size_t size = CpuCachingAllocator::block_size(nbytes);
  std::vector<void*> to_free;  // completed buffers that did not fit in the cache
  void* ptr = nullptr;
  {
    absl::MutexLock lock(&mu_);
    process_events(/*wait=*/false, &to_free);
    auto it = cached_.find(size);
    if (it != cached_.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= size;
      ++stats_.cache_hits;
      record_handout(ptr, size);
    } else {
      ++stats_.cache_misses;
    }
  }
  free_buffers(to_free);
  if (ptr != nullptr) return ptr;
  cudaError_t status = cudaHostAlloc(&ptr, size, cudaHostAllocPortable);
  if (status == cudaErrorMemoryAllocation) {
    // Cached buffers of other classes may be what the host is missing.
    static_cast<void>(cudaGetLastError());
    empty_cache();
    status = cudaHostAlloc(&ptr, size, cudaHostAllocPortable);
  }
  if (status == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());
    RD_FAIL(kOutOfMemory, "PinnedHostPool::allocate: out of pinned host memory: requested ", nbytes,
            " bytes (buffer of ", size, " bytes); stats: ", memory_stats_str(stats()));
  }
  if (status != cudaSuccess) {
    throw_cuda_error(status, "cudaHostAlloc(&ptr, size, cudaHostAllocPortable)", __FILE__,
                     __LINE__);
  }
  absl::MutexLock lock(&mu_);
  ++stats_.system_allocs;
  stats_.reserved_bytes += static_cast<int64_t>(size);
  record_handout(ptr, size);
  return ptr;
}

void PinnedHostPool::release(void* ptr) {
  if (ptr == nullptr) return;
  std::vector<void*> to_free;
  {
    absl::MutexLock lock(&mu_);
    const size_t size = take_live(ptr, "release");
    cache_or_free(ptr, size, &to_free);
  }
  free_buffers(to_free);
}

void PinnedHostPool::release_after(void* ptr, int device, cudaStream_t stream) {
  if (ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  const size_t size = take_live(ptr, "release_after");
  DeviceGuard guard(device);
  cudaEvent_t event = acquire_event(device);
  const cudaError_t status = cudaEventRecord(event, stream);
  if (status != cudaSuccess) {
    // The stream may still use the buffer: it is leaked (stays reserved), never reused.
    spare_events_[device].push_back(event);
    throw_cuda_error(status, "cudaEventRecord(event, stream)", __FILE__, __LINE__);
  }
  pending_.push_back({event, device, ptr, size});
}

MemoryStats PinnedHostPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void PinnedHostPool::empty_cache() {
  std::vector<void*> to_free;
  {
    absl::MutexLock lock(&mu_);
    process_events(/*wait=*/true, &to_free);
    for (auto& [size, buffers] : cached_) {
      to_free.insert(to_free.end(), buffers.begin(), buffers.end());
      stats_.reserved_bytes -= static_cast<int64_t>(size * buffers.size());
      stats_.system_frees += static_cast<int64_t>(buffers.size());
    }
    cached_.clear();
    cached_bytes_ = 0;
  }
  free_buffers(to_free);
}

void PinnedHostPool::process_events(bool wait, std::vector<void*>* to_free) {
  retire_completed_events(pending_, wait, [&](const PendingRelease& pending) {
    spare_events_[pending.device].push_back(pending.event);
    cache_or_free(pending.ptr, pending.size, to_free);
  });
}

void PinnedHostPool::cache_or_free(void* ptr, size_t size, std::vector<void*>* to_free) {
  if (cached_bytes_ + size > max_cached_bytes_) {
    to_free->push_back(ptr);
    stats_.reserved_bytes -= static_cast<int64_t>(size);
    ++stats_.system_frees;
    return;
  }
  cached_[size].push_back(ptr);
  cached_bytes_ += size;
}

size_t PinnedHostPool::take_live(void* ptr, const char* op) {
  auto it = live_.find(ptr);
  RD_CHECK(it != live_.end(), kInternal, "PinnedHostPool::", op, ": pointer ", ptr,
           " was not handed out by this pool or was already released");
  const size_t size = it->second;
  live_.erase(it);
  stats_.allocated_bytes -= static_cast<int64_t>(size);
  return size;
}

void PinnedHostPool::record_handout(void* ptr, size_t size) {
  live_.emplace(ptr, size);
  stats_.allocated_bytes += static_cast<int64_t>(size);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
}

// A new event belongs to `device`, current under the caller's guard.
cudaEvent_t PinnedHostPool::acquire_event(int device) {
  return take_spare_event(spare_events_[device]);
}

void PinnedHostPool::free_buffers(const std::vector<void*>& buffers) {
  for (void* ptr : buffers) RD_CUDA_CHECK(cudaFreeHost(ptr));
}

PinnedHostPool& pinned_host_pool() {
  static PinnedHostPool* const pool = new PinnedHostPool();
  return *pool;
}

}  // namespace rd::kernels::cuda
