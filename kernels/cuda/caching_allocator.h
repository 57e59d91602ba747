// CudaCachingAllocator: the per-device CUDA memory pool behind allocator_for(Device::cuda(i)).
// Segments come from cudaMalloc and are split into stream-owned blocks that are reused.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "ringdilated/kernels/allocator.h"

namespace rd::kernels::cuda {

// A thread-safe caching pool for one CUDA device.
//
// Sizes. Every request is rounded up to a multiple of kBlockAlignment (512 B), so all blocks
// are 512-byte aligned. Blocks of at most kSmallBlockBytes (1 MiB) form the small pool and are
// carved out of kSmallSegmentBytes (2 MiB) segments; larger blocks form the large pool. A
// large request below kLargeSegmentThreshold (10 MiB) gets a kMidSegmentBytes (20 MiB)
// segment, so that several mid-size blocks share one cudaMalloc; from 10 MiB on, the segment
// is the request rounded up to kSegmentGranularity (2 MiB). See segment_size().
//
// Reuse. Free blocks sit in one ordered set per pool, keyed by (stream, size, address); a
// request takes the smallest free block of its own stream that fits (best fit, lowest
// address on ties). The block is split when the remainder is worth keeping: in the small
// pool any remainder (it is at least 512 B), in the large pool a remainder above 1 MiB (a
// large-pool block of 1 MiB or less could never serve a large request on its own; keeping it
// inside the allocated block costs nothing, as it merges back on free). A freed block merges
// with the free neighbours of its segment, and a segment that is entirely free is one block,
// which empty_cache() returns with cudaFree.
//
// Streams. A block belongs to the stream that was current on the device when it was
// allocated (current_stream(device)), and is only reused by allocations on that stream: work
// queued on one stream runs in order, so a block freed there is safe to hand out again at
// once. Users of a block on other streams must be declared with record_stream(); freeing
// such a block records an event on each of those streams, and the block stays out of the
// free sets until all of them have completed (events are polled at the start of every
// allocate and waited for in empty_cache). Every block of a segment shares the segment's
// stream, so merging never mixes streams.
//
// Limits and failures. An optional limit caps reserved (cudaMalloc'd) bytes; a request that
// would exceed it, or a cudaMalloc that runs out of memory, first returns the cached
// segments and retries once, then throws rd::Error(kOutOfMemory) naming the request, the
// device and the stats.
//
// Stats follow MemoryStats: allocated counts the sizes of blocks handed out (after rounding
// and including any unsplit remainder), reserved the cudaMalloc'd segment bytes, a hit is a
// request served without cudaMalloc. A block freed with pending events stops counting as
// allocated at once but stays reserved.
//
// The pool holds its mutex across cudaMalloc/cudaFree: a CUDA allocation is slow anyway, and
// it keeps the limit and the stats exact. Blocks still handed out when a pool is destroyed
// are leaked, since their owners may still use them.
class CudaCachingAllocator final : public Allocator {
 public:
  static constexpr size_t kBlockAlignment = 512;
  static constexpr size_t kSmallBlockBytes = size_t{1} << 20;      // 1 MiB
  static constexpr size_t kSmallSegmentBytes = size_t{2} << 20;    // 2 MiB
  static constexpr size_t kMidSegmentBytes = size_t{20} << 20;     // 20 MiB
  static constexpr size_t kLargeSegmentThreshold = size_t{10} << 20;  // 10 MiB
  static constexpr size_t kSegmentGranularity = size_t{2} << 20;   // 2 MiB
  // Larger requests are refused outright (kOutOfMemory): rounding them could overflow.
  static constexpr size_t kMaxRequestBytes = size_t{1} << 62;

  // A pool for CUDA device `device`. No CUDA call happens before the first allocation.
  explicit CudaCachingAllocator(int device);
  ~CudaCachingAllocator() override;
  CudaCachingAllocator(const CudaCachingAllocator&) = delete;
  CudaCachingAllocator& operator=(const CudaCachingAllocator&) = delete;

  // The block size of a request (1 <= nbytes <= kMaxRequestBytes): a multiple of 512.
  static size_t block_size(size_t nbytes);
  // The cudaMalloc size of a new segment for a block of `block` bytes (from block_size).
  static size_t segment_size(size_t block);

  Device device() const override { return Device::cuda(device_); }
  // Memory for `nbytes` on the device, owned by this thread's current stream of the device.
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr) override;
  MemoryStats stats() const override;
  void reset_peak_stats() override;
  // Waits for the events of freed blocks, then cudaFrees every entirely free segment.
  void empty_cache() override;

  // Declares that work queued on `stream` uses `ptr` (a block handed out by this pool), so
  // that freeing it waits for that work. Recording the block's own stream is a no-op;
  // nullptr is ignored.
  void record_stream(void* ptr, cudaStream_t stream);

  // Caps reserved bytes (nullopt: no cap). Already reserved memory is not released by
  // lowering the cap; the next allocation that needs a new segment is held to it.
  void set_reserved_limit(std::optional<size_t> limit_bytes);
  std::optional<size_t> reserved_limit() const;

  // Fills each block on the allocating stream (cudaMemsetAsync) before handing it out.
  void set_fill_on_allocate(std::optional<uint8_t> byte) override;

 private:
  void* allocate_block(size_t nbytes, cudaStream_t stream);
  enum class BlockState : uint8_t {
    kAllocated,  // handed out
    kPending,    // freed, waiting for events on streams recorded with record_stream
    kFree,       // in a free set
  };

  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    cudaStream_t stream = nullptr;
    bool small = false;  // which pool
    BlockState state = BlockState::kFree;
    int pending_events = 0;
    Block* prev = nullptr;  // address-order neighbours within the segment
    Block* next = nullptr;
    std::vector<cudaStream_t> stream_uses;  // recorded streams other than `stream`
  };

  // Orders by (stream, size, address): the first block not below {stream, size, nullptr}
  // is the best fit for `size` on `stream`, if it is on that stream.
  struct BlockOrder {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BlockOrder>;

  struct PendingEvent {
    cudaEvent_t event = nullptr;
    Block* block = nullptr;
  };

  FreeSet& free_set(bool small) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes and returns the best-fitting free block, or nullptr.
  Block* take_free_block(size_t size, cudaStream_t stream, bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new segment of `segment_bytes` as one block (state kFree, in no set). Enforces the
  // limit, retries cudaMalloc once after releasing the cache, throws kOutOfMemory.
  Block* allocate_segment(size_t nbytes, size_t segment_bytes, cudaStream_t stream, bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool exceeds_reserved_limit(size_t more_bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cuts `block` down to `size` when the remainder is worth keeping; the remainder joins the
  // free set.
  void maybe_split(Block* block, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns a block with no outstanding use to its free set, merging free neighbours.
  void free_block(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Absorbs the free neighbour `other` (prev or next of `block`) into `block`.
  void merge(Block* block, Block* other) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the blocks whose events have all completed; with `wait`, waits for every event.
  void process_events(bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for pending events, then cudaFrees every entirely free segment.
  void release_cached_segments() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  cudaEvent_t acquire_event() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  [[noreturn]] void throw_out_of_memory(size_t nbytes, size_t segment_bytes,
                                        const char* reason) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int device_;
  mutable absl::Mutex mu_;
  MemoryStats stats_ ABSL_GUARDED_BY(mu_);
  std::optional<size_t> reserved_limit_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, Block*> live_ ABSL_GUARDED_BY(mu_);  // handed-out blocks
  FreeSet small_free_ ABSL_GUARDED_BY(mu_);
  FreeSet large_free_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingEvent> pending_events_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> spare_events_ ABSL_GUARDED_BY(mu_);  // reusable, on device_
  std::atomic<int> fill_byte_{-1};  // -1: off
};

// The process-wide pool of CUDA device `device`, created on first use and never destroyed
// (tensors held in statics may free their storage during exit). Throws kDeviceMismatch for
// a device index that is not visible.
CudaCachingAllocator& cuda_caching_allocator(int device);

}  // namespace rd::kernels::cuda
