// Allocator: the one memory-pool interface behind every tensor's storage and every kernel's
// scratch memory. The CPU pool and the CUDA caching allocator both implement it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "ringdilated/kernels/device.h"
#include "ringdilated/kernels/error.h"

namespace rd {

struct MemoryStats {
  int64_t allocated_bytes = 0;       // bytes handed out and not yet returned
  int64_t reserved_bytes = 0;        // bytes held from the system (allocated + cached)
  int64_t peak_allocated_bytes = 0;  // high-water mark of allocated_bytes
  int64_t cache_hits = 0;            // requests served from the cache
  int64_t cache_misses = 0;          // requests that went to the system
  int64_t system_allocs = 0;         // calls to the system allocator (malloc / cudaMalloc)
  int64_t system_frees = 0;          // calls to the system free (free / cudaFree)
};

// "allocated=4096 reserved=8192 peak=4096 hits=1 misses=2 system_allocs=2 system_frees=0":
// how allocator stats print in messages (out-of-memory errors of every device name them).
std::string memory_stats_str(const MemoryStats& stats);

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // Returns memory for `nbytes` (64-byte aligned on the CPU), or throws rd::Error with
  // kOutOfMemory, naming the size and the current stats. nbytes == 0 returns nullptr.
  virtual void* allocate(size_t nbytes) = 0;
  // Returns memory from allocate() to the pool. nullptr is ignored.
  virtual void deallocate(void* ptr) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  // Returns cached, unused blocks to the system.
  virtual void empty_cache() = 0;

  // Debugging aid for tests: while set, every block is filled with `byte` before it is
  // handed out, so a kernel that leaves part of its output unwritten shows garbage instead
  // of plausible stale values. Off by default. Pools that cannot fill throw kUnimplemented.
  virtual void set_fill_on_allocate(std::optional<uint8_t> byte);
};

// Scratch memory for the duration of a host scope, returned to its pool on every exit path.
// With the CUDA pool this is stream-ordered: memory returned here is handed out again only to
// work queued later on the same stream, which runs after the kernels that used it.
class ScratchBuffer {
 public:
  ScratchBuffer(Allocator& allocator, size_t bytes)
      : allocator_(allocator), ptr_(allocator.allocate(bytes)) {}
  ~ScratchBuffer() {
    release_in_destructor("ScratchBuffer: returning kernel scratch memory",
                          [&] { allocator_.deallocate(ptr_); });
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  Allocator& allocator_;
  void* ptr_;
};

}  // namespace rd
