// The CUDA caching allocator: stream-owned blocks carved from cudaMalloc'd segments, split,
// merged and reused by best fit, with event-guarded reuse across streams.
#include "ringdilated/kernels/cuda/caching_allocator.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>

#include "ringdilated/kernels/cuda/device_info.h"
#include "ringdilated/kernels/cuda/event_queue.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"

namespace rd::kernels::cuda {
namespace {

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// "; cuda:0 has 1024 of 81559 MiB free", or "" when the device cannot say (the message it
// decorates is already an error; it must not turn into a different one).
std::string device_memory_str(int device) {
  try {
    DeviceGuard guard(device);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      return str_cat("; cuda:", device, " has ", free_bytes >> 20, " of ", total_bytes >> 20,
                     " MiB free");
    }
    static_cast<void>(cudaGetLastError());
  } catch (const Error&) {
  }
  return "";
}

}  // namespace

bool CudaCachingAllocator::BlockOrder::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return std::less<cudaStream_t>()(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return std::less<char*>()(a->ptr, b->ptr);
}

CudaCachingAllocator::CudaCachingAllocator(int device) : device_(device) {}

CudaCachingAllocator::~CudaCachingAllocator() {
  absl::MutexLock lock(&mu_);
  // At worst the cached segments stay reserved.
  release_in_destructor("CudaCachingAllocator: releasing cached segments",
                        [&] { release_cached_segments(); });
  for (cudaEvent_t event : spare_events_) static_cast<void>(cudaEventDestroy(event));
  // What is left: handed-out blocks (leaked with their segments, see the class comment),
  // the free remainders of those segments, and blocks whose events could not be waited on.
  std::vector<Block*> records;
  for (const auto& [ptr, block] : live_) records.push_back(block);
  records.insert(records.end(), small_free_.begin(), small_free_.end());
  records.insert(records.end(), large_free_.begin(), large_free_.end());
  for (const PendingEvent& pending : pending_events_) {
    static_cast<void>(cudaEventDestroy(pending.event));
    records.push_back(pending.block);
  }
  std::sort(records.begin(), records.end());
  records.erase(std::unique(records.begin(), records.end()), records.end());
  for (Block* block : records) delete block;
}

size_t CudaCachingAllocator::block_size(size_t nbytes) { return round_up(nbytes, kBlockAlignment); }

size_t CudaCachingAllocator::segment_size(size_t block) {
  if (block <= kSmallBlockBytes) return kSmallSegmentBytes;
  if (block < kLargeSegmentThreshold) return kMidSegmentBytes;
  return round_up(block, kSegmentGranularity);
}

void* CudaCachingAllocator::allocate(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  const cudaStream_t stream = current_stream(device_);
  void* ptr = allocate_block(nbytes, stream);
  const int fill = fill_byte_.load(std::memory_order_relaxed);
  if (fill >= 0) {
    DeviceGuard guard(device_);
    RD_CUDA_CHECK(cudaMemsetAsync(ptr, fill, nbytes, stream));
  }
  return ptr;
}

void CudaCachingAllocator::set_fill_on_allocate(std::optional<uint8_t> byte) {
  fill_byte_.store(byte ? static_cast<int>(*byte) : -1, std::memory_order_relaxed);
}

void* CudaCachingAllocator::allocate_block(size_t nbytes, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  if (nbytes > kMaxRequestBytes) {
    throw_out_of_memory(nbytes, nbytes, "the request exceeds the largest supported size");
  }
  const size_t size = block_size(nbytes);
  const bool small = size <= kSmallBlockBytes;
  process_events(/*wait=*/false);
  Block* block = take_free_block(size, stream, small);
  if (block != nullptr) {
    ++stats_.cache_hits;
  } else {
    ++stats_.cache_misses;
    block = allocate_segment(nbytes, segment_size(size), stream, small);
  }
  maybe_split(block, size);
  block->state = BlockState::kAllocated;
  live_.emplace(block->ptr, block);
  stats_.allocated_bytes += static_cast<int64_t>(block->size);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return block->ptr;
}

void CudaCachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  auto it = live_.find(ptr);
  RD_CHECK(it != live_.end(), kInternal, "CudaCachingAllocator::deallocate: pointer ", ptr,
           " was not handed out by the pool of cuda:", device_, " or was already freed");
  Block* block = it->second;
  live_.erase(it);
  stats_.allocated_bytes -= static_cast<int64_t>(block->size);
  if (block->stream_uses.empty()) {
    free_block(block);
    return;
  }
  block->state = BlockState::kPending;
  // One extra count while the events are recorded: if recording fails part-way, the block
  // is leaked rather than freed under work on the streams not yet covered.
  ++block->pending_events;
  DeviceGuard guard(device_);
  for (cudaStream_t use : block->stream_uses) {
    cudaEvent_t event = acquire_event();
    const cudaError_t status = cudaEventRecord(event, use);
    if (status != cudaSuccess) {
      spare_events_.push_back(event);
      throw_cuda_error(status, "cudaEventRecord(event, use)", __FILE__, __LINE__);
    }
    pending_events_.push_back({event, block});
    ++block->pending_events;
  }
  --block->pending_events;
  block->stream_uses.clear();
}

MemoryStats CudaCachingAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void CudaCachingAllocator::reset_peak_stats() {
  absl::MutexLock lock(&mu_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

void CudaCachingAllocator::empty_cache() {
  absl::MutexLock lock(&mu_);
  release_cached_segments();
}

void CudaCachingAllocator::record_stream(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  auto it = live_.find(ptr);
  RD_CHECK(it != live_.end(), kInternal, "CudaCachingAllocator::record_stream: pointer ", ptr,
           " is not a block handed out by the pool of cuda:", device_);
  Block* block = it->second;
  if (stream == block->stream) return;
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
}

void CudaCachingAllocator::set_reserved_limit(std::optional<size_t> limit_bytes) {
  absl::MutexLock lock(&mu_);
  reserved_limit_ = limit_bytes;
}

std::optional<size_t> CudaCachingAllocator::reserved_limit() const {
  absl::MutexLock lock(&mu_);
  return reserved_limit_;
}

CudaCachingAllocator::FreeSet& CudaCachingAllocator::free_set(bool small) {
  return small ? small_free_ : large_free_;
}

CudaCachingAllocator::Block* CudaCachingAllocator::take_free_block(size_t size, cudaStream_t stream,
                                                                   bool small) {
  Block key;
  key.stream = stream;
  key.size = size;
  FreeSet& set = free_set(small);
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  set.erase(it);
  return block;
}

CudaCachingAllocator::Block* CudaCachingAllocator::allocate_segment(size_t nbytes,
                                                                    size_t segment_bytes,
                                                                    cudaStream_t stream,
                                                                    bool small) {
  if (exceeds_reserved_limit(segment_bytes)) {
    release_cached_segments();
    if (exceeds_reserved_limit(segment_bytes)) {
      throw_out_of_memory(nbytes, segment_bytes, "the reserved limit would be exceeded");
    }
  }
  auto block = std::make_unique<Block>();  // before cudaMalloc: nothing to undo if it throws
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, segment_bytes);
  if (status == cudaErrorMemoryAllocation) {
    // Cached segments may be what the device is missing: return them and try once more.
    static_cast<void>(cudaGetLastError());
    release_cached_segments();
    status = cudaMalloc(&ptr, segment_bytes);
  }
  if (status == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());
    throw_out_of_memory(nbytes, segment_bytes, "cudaMalloc failed even after emptying the cache");
  }
  if (status != cudaSuccess) {
    throw_cuda_error(status, "cudaMalloc(&ptr, segment_bytes)", __FILE__, __LINE__);
  }
  ++stats_.system_allocs;
  stats_.reserved_bytes += static_cast<int64_t>(segment_bytes);
  block->ptr = static_cast<char*>(ptr);
  block->size = segment_bytes;
  block->stream = stream;
  block->small = small;
  return block.release();
}

bool CudaCachingAllocator::exceeds_reserved_limit(size_t more_bytes) const {
  return reserved_limit_.has_value() &&
         static_cast<size_t>(stats_.reserved_bytes) + more_bytes > *reserved_limit_;
}

void CudaCachingAllocator::maybe_split(Block* block, size_t size) {
  const size_t remainder = block->size - size;
  const bool keep = block->small ? remainder >= kBlockAlignment : remainder > kSmallBlockBytes;
  if (!keep) return;
  auto* rest = new Block();
  rest->ptr = block->ptr + size;
  rest->size = remainder;
  rest->stream = block->stream;
  rest->small = block->small;
  rest->state = BlockState::kFree;
  rest->prev = block;
  rest->next = block->next;
  if (block->next != nullptr) block->next->prev = rest;
  block->next = rest;
  block->size = size;
  free_set(rest->small).insert(rest);
}

void CudaCachingAllocator::free_block(Block* block) {
  block->state = BlockState::kFree;
  block->stream_uses.clear();
  if (block->prev != nullptr && block->prev->state == BlockState::kFree) {
    merge(block, block->prev);
  }
  if (block->next != nullptr && block->next->state == BlockState::kFree) {
    merge(block, block->next);
  }
  free_set(block->small).insert(block);
}

void CudaCachingAllocator::merge(Block* block, Block* other) {
  free_set(other->small).erase(other);  // by its old key, before anything changes
  if (other == block->prev) {
    block->ptr = other->ptr;
    block->prev = other->prev;
    if (block->prev != nullptr) block->prev->next = block;
  } else {
    block->next = other->next;
    if (block->next != nullptr) block->next->prev = block;
  }
  block->size += other->size;
  delete other;
}

void CudaCachingAllocator::process_events(bool wait) {
  retire_completed_events(pending_events_, wait, [&](const PendingEvent& pending) {
    spare_events_.push_back(pending.event);
    if (--pending.block->pending_events == 0) free_block(pending.block);
  });
}

void CudaCachingAllocator::release_cached_segments() {
  process_events(/*wait=*/true);
  std::optional<DeviceGuard> guard;  // only touch the device when there is work for it
  for (FreeSet* set : {&small_free_, &large_free_}) {
    for (auto it = set->begin(); it != set->end();) {
      Block* block = *it;
      // Merging makes an entirely free segment a single block with no neighbours.
      if (block->prev != nullptr || block->next != nullptr) {
        ++it;
        continue;
      }
      if (!guard.has_value()) guard.emplace(device_);
      RD_CUDA_CHECK(cudaFree(block->ptr));
      ++stats_.system_frees;
      stats_.reserved_bytes -= static_cast<int64_t>(block->size);
      it = set->erase(it);
      delete block;
    }
  }
}

cudaEvent_t CudaCachingAllocator::acquire_event() { return take_spare_event(spare_events_); }

void CudaCachingAllocator::throw_out_of_memory(size_t nbytes, size_t segment_bytes,
                                               const char* reason) const {
  const std::string limit =
      reserved_limit_.has_value() ? str_cat(*reserved_limit_, " bytes") : std::string("none");
  RD_FAIL(kOutOfMemory, "CudaCachingAllocator::allocate: out of memory on cuda:", device_,
          ": requested ", nbytes, " bytes (new segment of ", segment_bytes, " bytes): ", reason,
          "; reserved limit: ", limit, device_memory_str(device_),
          "; stats: ", memory_stats_str(stats_));
}

CudaCachingAllocator& cuda_caching_allocator(int device) {
  // Every visible device's pool, made together on first use: constructing one makes no
  // CUDA call. Never destroyed, like the CPU pool.
  static const std::vector<CudaCachingAllocator*>* const pools = [] {
    auto* list = new std::vector<CudaCachingAllocator*>();
    const int count = device_count();
    for (int d = 0; d < count; ++d) list->push_back(new CudaCachingAllocator(d));
    return list;
  }();
  RD_CHECK(device >= 0 && device < static_cast<int>(pools->size()), kDeviceMismatch,
           "cuda_caching_allocator: there is no CUDA device ", device, " (", pools->size(),
           " visible)");
  return *(*pools)[device];
}

}  // namespace rd::kernels::cuda
