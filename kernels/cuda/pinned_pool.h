// PinnedHostPool: cached page-locked host buffers that stage host<->device copies. A buffer
// released while a copy may still read or write it is reused only after that copy completes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "ringdilated/kernels/allocator.h"

namespace rd::kernels::cuda {

// A thread-safe pool of pinned host buffers (cudaHostAlloc, portable to every device).
//
// Requests are rounded to the CPU pool's size classes (CpuCachingAllocator::block_size: four
// per octave, under 25% waste) and a released buffer serves later requests of its class.
// release_after() records an event on the stream that still uses the buffer; the buffer
// joins the cache once that event has completed (polled at every allocate, waited for in
// empty_cache). Buffers that would push the cache above max_cached_bytes are freed instead
// of cached, so one huge transfer cannot pin host memory for the rest of the process.
//
// Stats follow MemoryStats: allocated counts buffers handed out and not yet released,
// reserved every buffer held from cudaHostAlloc (handed out, in flight or cached).
class PinnedHostPool {
 public:
  static constexpr size_t kDefaultMaxCachedBytes = size_t{256} << 20;  // 256 MiB
  // Larger requests are refused outright (kOutOfMemory): rounding them could overflow.
  static constexpr size_t kMaxRequestBytes = size_t{1} << 62;

  explicit PinnedHostPool(size_t max_cached_bytes = kDefaultMaxCachedBytes);
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  // A pinned buffer of at least `nbytes` (nullptr for 0). Throws kOutOfMemory.
  void* allocate(size_t nbytes);
  // Returns a buffer that no queued work uses any more. nullptr is ignored.
  void release(void* ptr);
  // Returns a buffer that work already queued on `stream` (a stream of CUDA device
  // `device`) may still use; it is reused only after that work has completed.
  void release_after(void* ptr, int device, cudaStream_t stream);
  MemoryStats stats() const;
  // Waits for buffers still in use by queued copies, then frees every cached buffer.
  void empty_cache();

 private:
  struct PendingRelease {
    cudaEvent_t event = nullptr;
    int device = 0;
    void* ptr = nullptr;
    size_t size = 0;
  };

  // Moves buffers whose copies have completed (with `wait`: all of them) into the cache.
  void process_events(bool wait, std::vector<void*>* to_free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Caches a buffer no work uses, or queues it in *to_free when the cache is full.
  void cache_or_free(void* ptr, size_t size, std::vector<void*>* to_free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The handed-out size of `ptr`, removed from the live set; kInternal if unknown.
  size_t take_live(void* ptr, const char* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void record_handout(void* ptr, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  cudaEvent_t acquire_event(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // cudaFreeHost on each buffer; runs without the lock (the call may wait for the device).
  static void free_buffers(const std::vector<void*>& buffers);

  const size_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  MemoryStats stats_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, size_t> live_ ABSL_GUARDED_BY(mu_);  // handed out -> size
  absl::flat_hash_map<size_t, std::vector<void*>> cached_ ABSL_GUARDED_BY(mu_);  // by size
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<PendingRelease> pending_ ABSL_GUARDED_BY(mu_);
  // Events are tied to a device; each device keeps its own reusable ones.
  absl::flat_hash_map<int, std::vector<cudaEvent_t>> spare_events_ ABSL_GUARDED_BY(mu_);
};

// The process-wide staging pool, created on first use and never destroyed.
PinnedHostPool& pinned_host_pool();

}  // namespace rd::kernels::cuda
