// allocator_for(): each device's process-wide memory pool.
#include "ringdilated/tensor/allocator.h"

#include "ringdilated/kernels/cpu/caching_allocator.h"
#include "ringdilated/kernels/error.h"

#if defined(RD_WITH_CUDA)
#include "ringdilated/kernels/cuda/caching_allocator.h"
#endif

namespace rd {

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    // Never destroyed: tensors held in other statics may free their storage during exit,
    // after a destructible pool would be gone.
    static CpuCachingAllocator* const cpu_pool = new CpuCachingAllocator();
    return *cpu_pool;
  }
#if defined(RD_WITH_CUDA)
  return kernels::cuda::cuda_caching_allocator(device.index);
#else
  RD_FAIL(kDeviceMismatch, "allocator_for: no allocator for ", device.str(),
          ": this build has no CUDA allocator (built without CUDA)");
#endif
}

}  // namespace rd
