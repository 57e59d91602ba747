// The CPU caching allocator: size-classed blocks cached for reuse, with exact statistics.
#include "ringdilated/kernels/cpu/caching_allocator.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd {
namespace {

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

void* posix_aligned_allocate(size_t nbytes, size_t alignment) {
  void* ptr = nullptr;
  return posix_memalign(&ptr, alignment, nbytes) == 0 ? ptr : nullptr;
}

void posix_free(void* ptr) { std::free(ptr); }

CpuAllocatorOptions with_default_hooks(CpuAllocatorOptions options) {
  if (options.system.allocate == nullptr) options.system.allocate = &posix_aligned_allocate;
  if (options.system.free == nullptr) options.system.free = &posix_free;
  return options;
}

}  // namespace

CpuCachingAllocator::CpuCachingAllocator(CpuAllocatorOptions options)
    : options_(with_default_hooks(options)) {}

CpuCachingAllocator::~CpuCachingAllocator() {
  release_in_destructor("CpuCachingAllocator: freeing cached blocks", [&] { empty_cache(); });
}

size_t CpuCachingAllocator::block_size(size_t nbytes) {
  if (nbytes <= kAlignment) return kAlignment;
  // nbytes lies in (2^octave, 2^(octave + 1)]; octave >= 6 since nbytes > 64.
  const int octave = std::bit_width(nbytes - 1) - 1;
  const size_t step = std::max(kAlignment, size_t{1} << (octave - 2));
  return round_up(nbytes, step);
}

void* CpuCachingAllocator::allocate(size_t nbytes) {
  void* ptr = allocate_block(nbytes);
  const int fill = fill_byte_.load(std::memory_order_relaxed);
  if (ptr != nullptr && fill >= 0) std::memset(ptr, fill, nbytes);
  return ptr;
}

void CpuCachingAllocator::set_fill_on_allocate(std::optional<uint8_t> byte) {
  fill_byte_.store(byte ? static_cast<int>(*byte) : -1, std::memory_order_relaxed);
}

void* CpuCachingAllocator::allocate_block(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  if (nbytes > kMaxRequestBytes) throw_out_of_memory(nbytes, nbytes);
  const bool cacheable = nbytes <= options_.large_block_bytes;
  const size_t size = cacheable ? block_size(nbytes) : round_up(nbytes, kAlignment);
  {
    absl::MutexLock lock(&mu_);
    if (cacheable) {
      if (void* ptr = take_cached(size)) {
        ++stats_.cache_hits;
        record_allocation(ptr, {size, cacheable});
        return ptr;
      }
    }
    ++stats_.cache_misses;
  }
  // The system call runs unlocked so that other threads keep using the cache meanwhile.
  void* ptr = system_allocate(size);
  if (ptr == nullptr) {
    // Cached blocks of other classes may be what the system is missing: give them back
    // and try once more before failing.
    empty_cache();
    ptr = system_allocate(size);
  }
  if (ptr == nullptr) throw_out_of_memory(nbytes, size);
  absl::MutexLock lock(&mu_);
  ++stats_.system_allocs;
  stats_.reserved_bytes += static_cast<int64_t>(size);
  try {
    record_allocation(ptr, {size, cacheable});
  } catch (...) {  // the bookkeeping itself could not allocate: do not leak the block
    --stats_.system_allocs;
    stats_.reserved_bytes -= static_cast<int64_t>(size);
    system_free(ptr);
    throw;
  }
  return ptr;
}

void CpuCachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::deque<void*> to_free;
  {
    absl::MutexLock lock(&mu_);
    auto it = live_.find(ptr);
    RD_CHECK(it != live_.end(), kInternal, "CpuCachingAllocator::deallocate: pointer ",
             ptr,
             " was not handed out by this allocator or was already freed");
    const LiveBlock block = it->second;
    live_.erase(it);
    stats_.allocated_bytes -= static_cast<int64_t>(block.size);
    if (block.cacheable) {
      free_lists_[block.size].push_back({ptr, next_freed_seq_++});
      cached_bytes_ += block.size;
      evict_over_limit(&to_free);
    } else {
      stats_.reserved_bytes -= static_cast<int64_t>(block.size);
      ++stats_.system_frees;
      to_free.push_back(ptr);
    }
  }
  for (void* block : to_free) system_free(block);
}

MemoryStats CpuCachingAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void CpuCachingAllocator::reset_peak_stats() {
  absl::MutexLock lock(&mu_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

void CpuCachingAllocator::empty_cache() {
  std::deque<void*> to_free;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [size, blocks] : free_lists_) {
      for (const CachedBlock& block : blocks) to_free.push_back(block.ptr);
    }
    free_lists_.clear();
    stats_.reserved_bytes -= static_cast<int64_t>(cached_bytes_);
    stats_.system_frees += static_cast<int64_t>(to_free.size());
    cached_bytes_ = 0;
  }
  for (void* block : to_free) system_free(block);
}

size_t CpuCachingAllocator::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void* CpuCachingAllocator::take_cached(size_t size) {
  auto it = free_lists_.find(size);
  if (it == free_lists_.end() || it->second.empty()) return nullptr;
  void* ptr = it->second.back().ptr;  // newest first: most likely still in the CPU cache
  it->second.pop_back();
  cached_bytes_ -= size;
  return ptr;
}

void CpuCachingAllocator::record_allocation(void* ptr, LiveBlock block) {
  live_.emplace(ptr, block);
  stats_.allocated_bytes += static_cast<int64_t>(block.size);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
}

void CpuCachingAllocator::evict_over_limit(std::deque<void*>* to_free) {
  while (cached_bytes_ > options_.max_cached_bytes) {
    // Each class's list is in free order, so the oldest block overall heads one of them.
    // Eviction is rare and classes are few, so a scan is cheaper than a global list.
    FreeLists::iterator oldest = free_lists_.end();
    for (auto it = free_lists_.begin(); it != free_lists_.end(); ++it) {
      if (it->second.empty()) continue;
      if (oldest == free_lists_.end() ||
          it->second.front().freed_seq < oldest->second.front().freed_seq) {
        oldest = it;
      }
    }
    const size_t size = oldest->first;
    to_free->push_back(oldest->second.front().ptr);
    oldest->second.pop_front();
    cached_bytes_ -= size;
    stats_.reserved_bytes -= static_cast<int64_t>(size);
    ++stats_.system_frees;
  }
}

void* CpuCachingAllocator::system_allocate(size_t size) const {
  return options_.system.allocate(size, kAlignment);
}

void CpuCachingAllocator::system_free(void* ptr) const { options_.system.free(ptr); }

void CpuCachingAllocator::throw_out_of_memory(size_t nbytes, size_t block) const {
  RD_FAIL(kOutOfMemory, "CpuCachingAllocator::allocate: out of memory: requested ", nbytes,
          " bytes (block of ", block, " bytes); stats: ", memory_stats_str(stats()));
}

}  // namespace rd
