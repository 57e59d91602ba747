// Device-independent helpers of the allocator interface.
#include "ringdilated/kernels/allocator.h"

#include "ringdilated/kernels/error.h"

namespace rd {

std::string memory_stats_str(const MemoryStats& s) {
  return str_cat("allocated=", s.allocated_bytes, " reserved=", s.reserved_bytes,
                 " peak=", s.peak_allocated_bytes, " hits=", s.cache_hits,
                 " misses=", s.cache_misses, " system_allocs=", s.system_allocs,
                 " system_frees=", s.system_frees);
}

void Allocator::set_fill_on_allocate(std::optional<uint8_t> /*byte*/) {
  RD_FAIL(kUnimplemented, "set_fill_on_allocate: the ", device().str(),
          " allocator cannot fill blocks on allocation");
}

}  // namespace rd
