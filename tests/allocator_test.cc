// Tests of the CPU caching allocator: size classes, reuse, exact stats, cache limits,
// thread safety, errors, and that tensor storage goes through allocator_for(cpu).
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/kernels/cpu/caching_allocator.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/memory_stats_check.h"

namespace rd {
namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

using test::expect_stats;

TEST(CpuAllocatorTest, BlockSizesFollowTheDocumentedClasses) {
  const std::pair<size_t, size_t> cases[] = {
      {1, 64},         {64, 64},          {65, 128},         {128, 128},
      {129, 192},      {256, 256},        {257, 320},        {1000, 1024},
      {1025, 1280},    {1280, 1280},      {1281, 1536},      {4000, 4096},
      {kMiB, kMiB},    {kMiB + 1, kMiB + kMiB / 4},          {3 * kMiB, 3 * kMiB},
      {64 * kMiB - 1, 64 * kMiB}};
  for (auto [request, block] : cases) {
    EXPECT_EQ(CpuCachingAllocator::block_size(request), block) << "request " << request;
  }
}

TEST(CpuAllocatorTest, BlocksAreAlignedRoundedAndWasteLessThanAQuarter) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<size_t> size_dist(1, 4 * kMiB);
  for (int i = 0; i < 2000; ++i) {
    const size_t request = size_dist(rng);
    const size_t block = CpuCachingAllocator::block_size(request);
    ASSERT_GE(block, request);
    ASSERT_EQ(block % CpuCachingAllocator::kAlignment, 0u) << request;
    if (request > 256) {
      ASSERT_LT(block - request, request / 4) << request;
    }
  }
}

TEST(CpuAllocatorTest, ReturnsAlignedWritableMemory) {
  CpuCachingAllocator pool;
  std::vector<void*> blocks;
  for (size_t nbytes : {size_t{1}, size_t{3}, size_t{64}, size_t{100}, size_t{4097}, kMiB + 7}) {
    void* ptr = pool.allocate(nbytes);
    ASSERT_NE(ptr, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % 64, 0u) << nbytes;
    std::memset(ptr, 0xab, nbytes);  // ASan flags a block smaller than asked for
    blocks.push_back(ptr);
  }
  for (void* ptr : blocks) pool.deallocate(ptr);
}

TEST(CpuAllocatorTest, ZeroBytesAndNullptrAreNoOps) {
  CpuCachingAllocator pool;
  EXPECT_EQ(pool.allocate(0), nullptr);
  pool.deallocate(nullptr);
  expect_stats(pool.stats(), MemoryStats{});
}

TEST(CpuAllocatorTest, ReusesAFreedBlockOfTheSameClass) {
  CpuCachingAllocator pool;
  void* first = pool.allocate(1000);
  pool.deallocate(first);
  void* second = pool.allocate(1020);  // another request of the 1024-byte class
  EXPECT_EQ(second, first);
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.cache_hits, 1);
  EXPECT_EQ(stats.cache_misses, 1);
  EXPECT_EQ(stats.system_allocs, 1);
  // A different class does not take it.
  pool.deallocate(second);
  void* other = pool.allocate(2000);
  EXPECT_NE(other, first);
  EXPECT_EQ(pool.stats().cache_hits, 1);
  EXPECT_EQ(pool.stats().cache_misses, 2);
  pool.deallocate(other);
}

TEST(CpuAllocatorTest, FillOnAllocateCoversFreshAndReusedBlocksUntilTurnedOff) {
  CpuCachingAllocator pool;
  auto bytes_of = [](void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    return std::vector<unsigned char>(b, b + n);
  };
  pool.set_fill_on_allocate(0xA5);
  void* fresh = pool.allocate(1000);
  EXPECT_EQ(bytes_of(fresh, 1000), std::vector<unsigned char>(1000, 0xA5));
  std::memset(fresh, 0x11, 1000);  // a stale result left in the block
  pool.deallocate(fresh);
  void* reused = pool.allocate(1000);
  ASSERT_EQ(reused, fresh);
  EXPECT_EQ(bytes_of(reused, 1000), std::vector<unsigned char>(1000, 0xA5));
  std::memset(reused, 0x11, 1000);
  pool.deallocate(reused);
  pool.set_fill_on_allocate(std::nullopt);
  void* plain = pool.allocate(1000);
  ASSERT_EQ(plain, fresh);
  EXPECT_EQ(bytes_of(plain, 1000), std::vector<unsigned char>(1000, 0x11));
  pool.deallocate(plain);
}

TEST(CpuAllocatorTest, StatsArithmeticIsExact) {
  CpuCachingAllocator pool;
  void* a = pool.allocate(100);   // block 128
  void* b = pool.allocate(1000);  // block 1024
  void* c = pool.allocate(1500);  // block 1536
  expect_stats(pool.stats(), {.allocated_bytes = 128 + 1024 + 1536,
                              .reserved_bytes = 128 + 1024 + 1536,
                              .peak_allocated_bytes = 128 + 1024 + 1536,
                              .cache_hits = 0,
                              .cache_misses = 3,
                              .system_allocs = 3,
                              .system_frees = 0});
  pool.deallocate(b);
  expect_stats(pool.stats(), {.allocated_bytes = 128 + 1536,
                              .reserved_bytes = 128 + 1024 + 1536,
                              .peak_allocated_bytes = 128 + 1024 + 1536,
                              .cache_hits = 0,
                              .cache_misses = 3,
                              .system_allocs = 3,
                              .system_frees = 0});
  EXPECT_EQ(pool.cached_bytes(), 1024u);
  void* d = pool.allocate(900);  // block 1024, from the cache
  EXPECT_EQ(d, b);
  expect_stats(pool.stats(), {.allocated_bytes = 128 + 1024 + 1536,
                              .reserved_bytes = 128 + 1024 + 1536,
                              .peak_allocated_bytes = 128 + 1024 + 1536,
                              .cache_hits = 1,
                              .cache_misses = 3,
                              .system_allocs = 3,
                              .system_frees = 0});
  pool.deallocate(a);
  pool.deallocate(c);
  pool.deallocate(d);
  expect_stats(pool.stats(), {.allocated_bytes = 0,
                              .reserved_bytes = 128 + 1024 + 1536,
                              .peak_allocated_bytes = 128 + 1024 + 1536,
                              .cache_hits = 1,
                              .cache_misses = 3,
                              .system_allocs = 3,
                              .system_frees = 0});
}

TEST(CpuAllocatorTest, PeakTracksTheHighWaterMarkAndResets) {
  CpuCachingAllocator pool;
  void* a = pool.allocate(4096);
  void* b = pool.allocate(8192);
  pool.deallocate(b);
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 4096 + 8192);
  pool.reset_peak_stats();
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 4096);
  void* c = pool.allocate(64);
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 4096 + 64);
  pool.deallocate(c);
  pool.deallocate(a);
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 4096 + 64);
  pool.reset_peak_stats();
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 0);
}

TEST(CpuAllocatorTest, EmptyCacheReleasesCachedBlocksOnly) {
  CpuCachingAllocator pool;
  void* kept = pool.allocate(3000);  // block 3072
  void* freed1 = pool.allocate(5000);  // block 5120
  void* freed2 = pool.allocate(5000);
  pool.deallocate(freed1);
  pool.deallocate(freed2);
  EXPECT_EQ(pool.stats().reserved_bytes, 3072 + 2 * 5120);
  pool.empty_cache();
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.allocated_bytes, 3072);
  EXPECT_EQ(stats.reserved_bytes, 3072);
  EXPECT_EQ(stats.system_frees, 2);
  EXPECT_EQ(pool.cached_bytes(), 0u);
  // The next request of that class goes to the system again.
  void* again = pool.allocate(5000);
  EXPECT_EQ(pool.stats().cache_hits, 0);
  EXPECT_EQ(pool.stats().system_allocs, 4);
  pool.deallocate(again);
  pool.deallocate(kept);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_allocs, pool.stats().system_frees);
}

TEST(CpuAllocatorTest, LargeBlocksBypassTheCache) {
  CpuAllocatorOptions options;
  options.large_block_bytes = 256 * kKiB;
  CpuCachingAllocator pool(options);
  const size_t large = 300 * kKiB + 5;
  void* ptr = pool.allocate(large);
  std::memset(ptr, 1, large);
  const int64_t rounded = static_cast<int64_t>((large + 63) / 64 * 64);  // no class rounding
  EXPECT_EQ(pool.stats().allocated_bytes, rounded);
  EXPECT_EQ(pool.stats().reserved_bytes, rounded);
  pool.deallocate(ptr);
  expect_stats(pool.stats(), {.allocated_bytes = 0,
                              .reserved_bytes = 0,
                              .peak_allocated_bytes = rounded,
                              .cache_hits = 0,
                              .cache_misses = 1,
                              .system_allocs = 1,
                              .system_frees = 1});
  void* again = pool.allocate(large);
  EXPECT_EQ(pool.stats().cache_hits, 0);
  EXPECT_EQ(pool.stats().system_allocs, 2);
  pool.deallocate(again);
  // A request just at the threshold is still cached.
  void* at_limit = pool.allocate(256 * kKiB);
  pool.deallocate(at_limit);
  EXPECT_EQ(pool.cached_bytes(), 256 * kKiB);
}

TEST(CpuAllocatorTest, DefaultLargeThresholdIs64MiB) {
  CpuCachingAllocator pool;
  void* ptr = pool.allocate(64 * kMiB + 1);
  pool.deallocate(ptr);
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_frees, 1);
}

TEST(CpuAllocatorTest, CacheLimitEvictsOldestBlocksFirst) {
  CpuAllocatorOptions options;
  options.max_cached_bytes = 2 * kKiB;
  CpuCachingAllocator pool(options);
  void* a = pool.allocate(kKiB);
  void* b = pool.allocate(kKiB);
  void* c = pool.allocate(kKiB);
  pool.deallocate(a);  // oldest
  pool.deallocate(b);
  EXPECT_EQ(pool.stats().system_frees, 0);
  pool.deallocate(c);  // 3 KiB cached > 2 KiB: `a` goes back to the system
  EXPECT_EQ(pool.stats().system_frees, 1);
  EXPECT_EQ(pool.cached_bytes(), 2 * kKiB);
  EXPECT_EQ(pool.stats().reserved_bytes, static_cast<int64_t>(2 * kKiB));
  // The survivors come back newest first.
  void* first = pool.allocate(kKiB);
  void* second = pool.allocate(kKiB);
  EXPECT_EQ(first, c);
  EXPECT_EQ(second, b);
  EXPECT_EQ(pool.stats().cache_hits, 2);
  pool.deallocate(first);
  pool.deallocate(second);
}

TEST(CpuAllocatorTest, CacheLimitEvictsAcrossClassesByAge) {
  CpuAllocatorOptions options;
  options.max_cached_bytes = 5 * kKiB;
  CpuCachingAllocator pool(options);
  void* small_old = pool.allocate(kKiB);
  void* big = pool.allocate(4 * kKiB);
  void* small_new = pool.allocate(kKiB);
  pool.deallocate(small_old);
  pool.deallocate(big);
  pool.deallocate(small_new);  // 6 KiB > 5 KiB: the oldest, small_old, goes
  EXPECT_EQ(pool.cached_bytes(), 5 * kKiB);
  EXPECT_EQ(pool.allocate(4 * kKiB), big);
  EXPECT_EQ(pool.allocate(kKiB), small_new);
  EXPECT_EQ(pool.stats().cache_hits, 2);
  pool.deallocate(big);
  pool.deallocate(small_new);
}

TEST(CpuAllocatorTest, UnknownPointerIsAnInternalError) {
  CpuCachingAllocator pool;
  alignas(64) static char not_ours[64];
  try {
    pool.deallocate(not_ours);
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_NE(std::string(e.what()).find("not handed out"), std::string::npos) << e.what();
  }
  void* ptr = pool.allocate(10);
  pool.deallocate(ptr);
  try {
    pool.deallocate(ptr);  // double free
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
  }
  EXPECT_EQ(pool.stats().allocated_bytes, 0);
}

void* always_fail(size_t, size_t) { return nullptr; }
void never_called_free(void*) { ADD_FAILURE() << "free called without an allocation"; }

TEST(CpuAllocatorTest, SystemFailureIsOutOfMemoryNamingSizeAndStats) {
  CpuAllocatorOptions options;
  options.system = {&always_fail, &never_called_free};
  CpuCachingAllocator pool(options);
  try {
    pool.allocate(12345);
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
    const std::string message = e.what();
    EXPECT_NE(message.find("12345"), std::string::npos) << message;
    EXPECT_NE(message.find("allocated=0"), std::string::npos) << message;
    EXPECT_NE(message.find("reserved=0"), std::string::npos) << message;
  }
  EXPECT_EQ(pool.stats().allocated_bytes, 0);
  EXPECT_EQ(pool.stats().system_allocs, 0);
}

// A system that fails while more than one block is out, to see the pool give its cache
// back and retry before reporting out of memory.
int g_outstanding = 0;
void* one_block_at_a_time(size_t nbytes, size_t alignment) {
  if (g_outstanding >= 1) return nullptr;
  void* ptr = nullptr;
  if (posix_memalign(&ptr, alignment, nbytes) != 0) return nullptr;
  ++g_outstanding;
  return ptr;
}
void counted_free(void* ptr) {
  --g_outstanding;
  std::free(ptr);
}

TEST(CpuAllocatorTest, FreesTheCacheAndRetriesBeforeFailing) {
  g_outstanding = 0;
  CpuAllocatorOptions options;
  options.system = {&one_block_at_a_time, &counted_free};
  CpuCachingAllocator pool(options);
  void* small = pool.allocate(100);
  pool.deallocate(small);  // cached: the system is now "full"
  void* big = pool.allocate(10000);  // fails once, empties the cache, succeeds
  ASSERT_NE(big, nullptr);
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.system_allocs, 2);
  EXPECT_EQ(stats.system_frees, 1);
  EXPECT_EQ(stats.reserved_bytes, 10240);
  EXPECT_THROW(pool.allocate(100), Error);  // nothing left to give back
  pool.deallocate(big);
  pool.empty_cache();
  EXPECT_EQ(g_outstanding, 0);
}

TEST(CpuAllocatorTest, AbsurdRequestIsOutOfMemory) {
  CpuCachingAllocator pool;
  try {
    pool.allocate(SIZE_MAX);
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find(std::to_string(SIZE_MAX)), std::string::npos)
        << e.what();
  }
}

TEST(CpuAllocatorTest, ConcurrentAllocAndFreeKeepsStatsConsistent) {
  CpuCachingAllocator pool;
  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 10000;
  std::vector<int64_t> allocations(kThreads, 0);
  auto work = [&](int thread) {
    std::mt19937 rng(1234 + thread);
    std::uniform_int_distribution<size_t> size_dist(1, 8192);
    struct Held {
      uint8_t* ptr;
      size_t size;
    };
    std::vector<Held> held;
    for (int op = 0; op < kOpsPerThread; ++op) {
      if (held.empty() || (held.size() < 64 && rng() % 2 == 0)) {
        const size_t size = size_dist(rng);
        auto* ptr = static_cast<uint8_t*>(pool.allocate(size));
        // Mark both ends: another thread holding the same block would overwrite them.
        ptr[0] = static_cast<uint8_t>(thread);
        ptr[size - 1] = static_cast<uint8_t>(thread);
        held.push_back({ptr, size});
        ++allocations[thread];
      } else {
        const size_t index = rng() % held.size();
        Held block = held[index];
        held[index] = held.back();
        held.pop_back();
        ASSERT_EQ(block.ptr[0], thread);
        ASSERT_EQ(block.ptr[block.size - 1], thread);
        pool.deallocate(block.ptr);
      }
    }
    for (const Held& block : held) pool.deallocate(block.ptr);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (std::thread& thread : threads) thread.join();

  int64_t total_allocations = 0;
  for (int64_t n : allocations) total_allocations += n;
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.allocated_bytes, 0);
  EXPECT_EQ(stats.cache_hits + stats.cache_misses, total_allocations);
  EXPECT_EQ(stats.system_allocs, stats.cache_misses);
  EXPECT_EQ(stats.reserved_bytes, static_cast<int64_t>(pool.cached_bytes()));
  EXPECT_GT(stats.cache_hits, 0);
  EXPECT_LE(stats.peak_allocated_bytes, int64_t{kThreads} * 64 * 8192);
  pool.empty_cache();
  stats = pool.stats();
  EXPECT_EQ(stats.reserved_bytes, 0);
  EXPECT_EQ(stats.system_allocs, stats.system_frees);
}

TEST(AllocatorForTest, CpuIsOneProcessWidePool) {
  Allocator& a = allocator_for(Device::cpu());
  Allocator& b = allocator_for(Device::cpu());
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(a.device(), Device::cpu());
}

// Without a visible CUDA device (no CUDA in the build, or no GPU) asking for a CUDA pool is
// a clear kDeviceMismatch naming the device; with one, the pool belongs to that device.
TEST(AllocatorForTest, CudaPoolExistsOnlyForVisibleDevices) {
  if (cuda_available()) {
    EXPECT_EQ(allocator_for(Device::cuda(0)).device(), Device::cuda(0));
    return;
  }
  try {
    allocator_for(Device::cuda(0));
    FAIL() << "expected rd::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeviceMismatch);
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
}

TEST(AllocatorForTest, TensorStorageComesFromTheCpuPool) {
  Allocator& pool = allocator_for(Device::cpu());
  const MemoryStats before = pool.stats();
  const int64_t block = static_cast<int64_t>(CpuCachingAllocator::block_size(1000 * 4));
  {
    Tensor t = empty({10, 100}, DType::kFloat32);
    const MemoryStats during = pool.stats();
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, block);
    EXPECT_EQ(during.cache_hits + during.cache_misses,
              before.cache_hits + before.cache_misses + 1);
    Tensor view = t.transpose(0, 1);  // views share the storage: nothing new
    EXPECT_EQ(pool.stats().allocated_bytes, during.allocated_bytes);
  }
  const MemoryStats after = pool.stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  // The freed block is cached, so another tensor of that size class is a cache hit.
  {
    Tensor again = empty({1000}, DType::kInt32);
    EXPECT_EQ(pool.stats().cache_hits, after.cache_hits + 1);
    EXPECT_EQ(pool.stats().allocated_bytes - before.allocated_bytes, block);
  }
  EXPECT_EQ(pool.stats().allocated_bytes, before.allocated_bytes);
}

// ---------------------------------------------------------------------------------------
// Destructors never throw: a release that fails is logged once and leaked, not fatal.

struct DeleterCalls {
  int count = 0;
};

void throwing_deleter(void* /*ptr*/, void* context) {
  ++static_cast<DeleterCalls*>(context)->count;
  throw std::runtime_error("the user's deleter failed");
}

TEST(DestructorTest, AThrowingDeleterIsLoggedNotFatal) {
  alignas(16) float data[4] = {1, 2, 3, 4};
  DeleterCalls calls;
  ::testing::internal::CaptureStderr();
  {
    Tensor t = from_blob(data, {4}, DType::kFloat32, {}, Device::cpu(), &throwing_deleter, &calls);
    Tensor view = t.narrow(0, 1, 2);  // the last owner runs the deleter
  }
  const std::string first = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(calls.count, 1);
  EXPECT_NE(first.find("Storage"), std::string::npos) << first;
  EXPECT_NE(first.find("the user's deleter failed"), std::string::npos) << first;
  // The same failure again: logged once per process, so nothing new.
  ::testing::internal::CaptureStderr();
  {
    Tensor again =
        from_blob(data, {4}, DType::kFloat32, {}, Device::cpu(), &throwing_deleter, &calls);
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(calls.count, 2);
}

// An allocator whose deallocate throws, as a pool that was handed a foreign pointer does.
class ThrowingDeallocator : public Allocator {
 public:
  Device device() const override { return Device::cpu(); }
  void* allocate(size_t nbytes) override { return nbytes == 0 ? nullptr : &block_; }
  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    ++deallocations;
    RD_FAIL(kInternal, "ThrowingDeallocator::deallocate: refused pointer");
  }
  MemoryStats stats() const override { return {}; }
  void reset_peak_stats() override {}
  void empty_cache() override {}
  int deallocations = 0;

 private:
  alignas(64) char block_[64] = {};
};

TEST(DestructorTest, AScratchBufferWhoseReleaseThrowsIsLoggedNotFatal) {
  ThrowingDeallocator allocator;
  ::testing::internal::CaptureStderr();
  { ScratchBuffer scratch(allocator, 64); }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(allocator.deallocations, 1);
  EXPECT_NE(log.find("ScratchBuffer"), std::string::npos) << log;
  EXPECT_NE(log.find("refused pointer"), std::string::npos) << log;
}

}  // namespace
}  // namespace rd
