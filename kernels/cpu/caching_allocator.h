// CpuCachingAllocator: the CPU memory pool behind allocator_for(Device::cpu()). Exposed so
// tests (and tools) can build private pools with their own limits and system hooks.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "ringdilated/kernels/allocator.h"

namespace rd {

// Where the pool gets its memory. Both hooks default to posix_memalign / free; tests inject
// failing or counting hooks. `allocate` returns nullptr on failure and never throws.
struct SystemMemory {
  void* (*allocate)(size_t nbytes, size_t alignment) = nullptr;
  void (*free)(void* ptr) = nullptr;
};

struct CpuAllocatorOptions {
  // Freed blocks beyond this many cached bytes go back to the system, oldest first, so a
  // burst of temporaries cannot pin memory for the rest of the process.
  size_t max_cached_bytes = size_t{1} << 30;  // 1 GiB
  // Requests above this size bypass the cache both ways. A cached block only serves its own
  // size class, so hoarding huge blocks would pin a lot of memory for rare reuse, while the
  // system call costs little next to the work of filling such a block (glibc serves them
  // with mmap and hands them straight back to the OS on free).
  size_t large_block_bytes = size_t{64} << 20;  // 64 MiB
  SystemMemory system;
};

// A thread-safe pool of 64-byte aligned blocks.
//
// Size classes (block_size): requests up to 64 bytes get 64 bytes; above that, each power of
// two (2^k, 2^(k+1)] is split into four classes of step max(64, 2^(k-2)), e.g.
// 1024 -> 1280 -> 1536 -> 1792 -> 2048. A block wastes less than 25% of its request (about
// 12% on average) while the number of classes stays small (4 per octave), so freed blocks
// are likely to fit later requests. Requests above large_block_bytes are rounded only to the
// 64-byte alignment and never cached.
//
// Freed blocks are cached per class and reused newest first (warm in cache); when the cache
// exceeds max_cached_bytes the oldest cached blocks are returned to the system.
// Stats follow MemoryStats: allocated counts block bytes handed out (after rounding),
// reserved = allocated + cached. Blocks still handed out when the pool is destroyed are
// leaked, not freed, since their owners may still use them.
class CpuCachingAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  // Larger requests are refused outright (kOutOfMemory): rounding them would overflow.
  static constexpr size_t kMaxRequestBytes = size_t{1} << 62;

  CpuCachingAllocator() : CpuCachingAllocator(CpuAllocatorOptions{}) {}
  explicit CpuCachingAllocator(CpuAllocatorOptions options);
  ~CpuCachingAllocator() override;
  CpuCachingAllocator(const CpuCachingAllocator&) = delete;
  CpuCachingAllocator& operator=(const CpuCachingAllocator&) = delete;

  // The size class of a cacheable request of `nbytes` (1 <= nbytes <= kMaxRequestBytes).
  static size_t block_size(size_t nbytes);

  Device device() const override { return Device::cpu(); }
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr) override;
  MemoryStats stats() const override;
  void reset_peak_stats() override;
  void empty_cache() override;
  void set_fill_on_allocate(std::optional<uint8_t> byte) override;

  size_t cached_bytes() const;

 private:
  void* allocate_block(size_t nbytes);
  struct LiveBlock {
    size_t size = 0;
    bool cacheable = false;
  };
  struct CachedBlock {
    void* ptr = nullptr;
    uint64_t freed_seq = 0;  // order of deallocation: the smallest is the oldest
  };
  using FreeLists = absl::flat_hash_map<size_t, std::deque<CachedBlock>>;

  void* take_cached(size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void record_allocation(void* ptr, LiveBlock block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the oldest cached blocks into *to_free until the cache fits max_cached_bytes.
  void evict_over_limit(std::deque<void*>* to_free) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void* system_allocate(size_t size) const;
  void system_free(void* ptr) const;
  [[noreturn]] void throw_out_of_memory(size_t nbytes, size_t block) const;

  const CpuAllocatorOptions options_;
  mutable absl::Mutex mu_;
  MemoryStats stats_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, LiveBlock> live_ ABSL_GUARDED_BY(mu_);
  FreeLists free_lists_ ABSL_GUARDED_BY(mu_);  // block size -> cached blocks, oldest first
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_freed_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> fill_byte_{-1};  // -1: off
};

}  // namespace rd
