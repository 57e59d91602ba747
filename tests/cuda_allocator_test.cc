// Tests of the CUDA caching allocator: size rules, reuse, splitting and merging, stream
// safety, exact stats, the reserved limit, empty_cache, errors and thread safety. They need a
// CUDA device and skip without one.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/memory_stats_check.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/caching_allocator.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "testing/cuda_test_streams.h"
#endif

namespace rd {
namespace {

#if defined(RD_WITH_CUDA)

using kernels::cuda::CudaCachingAllocator;
using kernels::cuda::StreamGuard;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

char* bytes(void* p) { return static_cast<char*>(p); }

using test::expect_stats;

// Runs `fn`, which must throw rd::Error with `code`; returns the message.
std::string expect_error(const std::function<void()>& fn, ErrorCode code) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected rd::Error " << error_code_name(code);
  return "";
}

using test::StreamGate;
using test::TestStream;

// Writes a distinct byte into each block on the current stream, then reads every block
// back: blocks that overlapped, or memory that is not really there, would show.
void expect_blocks_usable(const std::vector<std::pair<void*, size_t>>& blocks) {
  const cudaStream_t stream = kernels::cuda::current_stream(0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    RD_CUDA_CHECK(cudaMemsetAsync(blocks[i].first, static_cast<int>(i + 1), blocks[i].second,
                                  stream));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<unsigned char> host(blocks[i].second);
    RD_CUDA_CHECK(cudaMemcpyAsync(host.data(), blocks[i].first, host.size(),
                                  cudaMemcpyDeviceToHost, stream));
    RD_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t j = 0; j < host.size(); ++j) {
      ASSERT_EQ(host[j], static_cast<unsigned char>(i + 1)) << "block " << i << " byte " << j;
    }
  }
}

class CudaAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
};

TEST(CudaAllocatorSizesTest, BlockAndSegmentSizesFollowTheDocumentedRules) {
  EXPECT_EQ(CudaCachingAllocator::block_size(1), 512u);
  EXPECT_EQ(CudaCachingAllocator::block_size(512), 512u);
  EXPECT_EQ(CudaCachingAllocator::block_size(513), 1024u);
  EXPECT_EQ(CudaCachingAllocator::block_size(kMiB + 1), kMiB + 512);
  const std::pair<size_t, size_t> segments[] = {
      {512, 2 * kMiB},           {kMiB, 2 * kMiB},         {kMiB + 512, 20 * kMiB},
      {10 * kMiB - 512, 20 * kMiB}, {10 * kMiB, 10 * kMiB}, {10 * kMiB + 512, 12 * kMiB},
      {13 * kMiB, 14 * kMiB},    {256 * kMiB, 256 * kMiB}};
  for (auto [block, segment] : segments) {
    EXPECT_EQ(CudaCachingAllocator::segment_size(block), segment) << "block " << block;
  }
}

TEST_F(CudaAllocatorTest, FreedBlockIsReusedForTheSameSize) {
  CudaCachingAllocator pool(0);
  EXPECT_EQ(pool.device(), Device::cuda(0));
  EXPECT_EQ(pool.allocate(0), nullptr);
  pool.deallocate(nullptr);
  void* a = pool.allocate(1000);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % CudaCachingAllocator::kBlockAlignment, 0u);
  pool.deallocate(a);
  void* b = pool.allocate(1000);
  EXPECT_EQ(b, a);
  expect_stats(pool.stats(), {.allocated_bytes = 1024,
                              .reserved_bytes = 2 * kMiB,
                              .peak_allocated_bytes = 1024,
                              .cache_hits = 1,
                              .cache_misses = 1,
                              .system_allocs = 1,
                              .system_frees = 0});
  pool.deallocate(b);
}

TEST_F(CudaAllocatorTest, FillOnAllocateCoversFreshAndReusedBlocks) {
  CudaCachingAllocator pool(0);
  pool.set_fill_on_allocate(0xA5);
  constexpr size_t kBytes = 3000;
  std::vector<unsigned char> host(kBytes);
  for (int round = 0; round < 2; ++round) {  // a fresh block, then the same block reused
    void* block = pool.allocate(kBytes);
    ASSERT_EQ(cudaMemcpy(host.data(), block, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host, std::vector<unsigned char>(kBytes, 0xA5)) << "round " << round;
    ASSERT_EQ(cudaMemset(block, 0x11, kBytes), cudaSuccess);  // a stale result
    pool.deallocate(block);
  }
  pool.set_fill_on_allocate(std::nullopt);
  void* plain = pool.allocate(kBytes);
  ASSERT_EQ(cudaMemcpy(host.data(), plain, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host, std::vector<unsigned char>(kBytes, 0x11));
  pool.deallocate(plain);
}

TEST_F(CudaAllocatorTest, SmallBlocksAreCarvedFromOneSegment) {
  CudaCachingAllocator pool(0);
  void* a = pool.allocate(1000);     // 1024 B at the start of a 2 MiB segment
  void* b = pool.allocate(3000);     // 3072 B right after it
  void* c = pool.allocate(kMiB);     // then 1 MiB
  EXPECT_EQ(bytes(b), bytes(a) + 1024);
  EXPECT_EQ(bytes(c), bytes(a) + 4096);
  expect_stats(pool.stats(), {.allocated_bytes = 4096 + kMiB,
                              .reserved_bytes = 2 * kMiB,
                              .peak_allocated_bytes = 4096 + kMiB,
                              .cache_hits = 2,
                              .cache_misses = 1,
                              .system_allocs = 1,
                              .system_frees = 0});
  // 1 MiB - 4 KiB is left in the segment: another 1 MiB needs a second one.
  void* d = pool.allocate(kMiB);
  EXPECT_EQ(pool.stats().system_allocs, 2);
  EXPECT_EQ(pool.stats().reserved_bytes, 4 * static_cast<int64_t>(kMiB));
  expect_blocks_usable({{a, 1000}, {b, 3000}, {c, kMiB}, {d, kMiB}});
  // The hole left by b is reused by a request that fits it, at the same address.
  pool.deallocate(b);
  void* e = pool.allocate(2048);
  EXPECT_EQ(e, b);
  for (void* p : {a, c, d, e}) pool.deallocate(p);
  EXPECT_EQ(pool.stats().allocated_bytes, 0);
}

TEST_F(CudaAllocatorTest, LargeBlocksSplitAndFreeNeighboursMerge) {
  CudaCachingAllocator pool(0);
  void* a = pool.allocate(4 * kMiB);   // a 20 MiB segment, split: 16 MiB stay free
  void* b = pool.allocate(6 * kMiB);   // from the remainder, right after a
  void* c = pool.allocate(10 * kMiB);  // exactly the rest of the segment
  EXPECT_EQ(bytes(b), bytes(a) + 4 * kMiB);
  EXPECT_EQ(bytes(c), bytes(a) + 10 * kMiB);
  EXPECT_EQ(pool.stats().system_allocs, 1);
  EXPECT_EQ(pool.stats().reserved_bytes, 20 * static_cast<int64_t>(kMiB));
  expect_blocks_usable({{a, 4 * kMiB}, {b, 6 * kMiB}, {c, 10 * kMiB}});
  pool.deallocate(a);
  pool.deallocate(b);
  // Only the merged a + b can serve 10 MiB without a new segment.
  void* d = pool.allocate(10 * kMiB);
  EXPECT_EQ(d, a);
  expect_stats(pool.stats(), {.allocated_bytes = 20 * kMiB,
                              .reserved_bytes = 20 * kMiB,
                              .peak_allocated_bytes = 20 * kMiB,
                              .cache_hits = 3,
                              .cache_misses = 1,
                              .system_allocs = 1,
                              .system_frees = 0});
  pool.deallocate(c);
  pool.deallocate(d);
  pool.empty_cache();  // one block again: the whole segment goes back
  EXPECT_EQ(pool.stats().system_frees, 1);
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
}

TEST_F(CudaAllocatorTest, LargeRemaindersOfAtMostOneMiBStayInTheBlock) {
  CudaCachingAllocator pool(0);
  // 19.5 MiB gets a 20 MiB segment; the 512 KiB left is not worth a block of its own.
  void* a = pool.allocate(19 * kMiB + 512 * kKiB);
  EXPECT_EQ(pool.stats().allocated_bytes, 20 * static_cast<int64_t>(kMiB));
  // 2 MiB from a 20 MiB segment leaves 18 MiB: split off and reusable.
  void* b = pool.allocate(2 * kMiB);
  EXPECT_EQ(pool.stats().allocated_bytes, 22 * static_cast<int64_t>(kMiB));
  void* c = pool.allocate(18 * kMiB);
  EXPECT_EQ(bytes(c), bytes(b) + 2 * kMiB);
  EXPECT_EQ(pool.stats().system_allocs, 2);
  for (void* p : {a, b, c}) pool.deallocate(p);
}

TEST_F(CudaAllocatorTest, BlocksAreNotSharedBetweenPools) {
  CudaCachingAllocator pool(0);
  void* small = pool.allocate(kMiB);  // small pool: 2 MiB segment
  pool.deallocate(small);
  // 1 MiB + 512 B is a large request: it must not take the free 2 MiB small segment.
  void* large = pool.allocate(kMiB + 1);
  EXPECT_EQ(pool.stats().system_allocs, 2);
  EXPECT_EQ(pool.stats().reserved_bytes, 22 * static_cast<int64_t>(kMiB));
  pool.deallocate(large);
}

TEST_F(CudaAllocatorTest, BlockFreedOnOneStreamIsNotHandedToAnother) {
  TestStream s1;
  TestStream s2;
  CudaCachingAllocator pool(0);
  void* p = nullptr;
  {
    StreamGuard on_s1(0, s1.get());
    p = pool.allocate(4096);
    pool.deallocate(p);
  }
  {
    StreamGuard on_s2(0, s2.get());
    void* q = pool.allocate(4096);
    EXPECT_NE(q, p);
    EXPECT_EQ(pool.stats().system_allocs, 2);  // s1's free segment was not an option
    pool.deallocate(q);
  }
  {
    StreamGuard on_s1(0, s1.get());
    void* again = pool.allocate(4096);
    EXPECT_EQ(again, p);
    pool.deallocate(again);
  }
  EXPECT_EQ(pool.stats().system_allocs, 2);
}

TEST_F(CudaAllocatorTest, RecordingTheOwnStreamChangesNothing) {
  TestStream s1;
  CudaCachingAllocator pool(0);
  StreamGuard on_s1(0, s1.get());
  void* p = pool.allocate(4096);
  pool.record_stream(p, s1.get());
  pool.record_stream(nullptr, s1.get());
  pool.deallocate(p);
  EXPECT_EQ(pool.allocate(4096), p);  // no event to wait for
  pool.deallocate(p);
}

TEST_F(CudaAllocatorTest, BlockUsedOnAnotherStreamWaitsForThatStream) {
  TestStream s1;
  TestStream s2;
  CudaCachingAllocator pool(0);
  StreamGuard on_s1(0, s1.get());
  void* p = pool.allocate(kMiB);  // the first half of a 2 MiB segment
  pool.record_stream(p, s2.get());
  pool.record_stream(p, s2.get());  // recording twice is harmless
  void* q = nullptr;
  {
    StreamGate gate(s2.get());  // s2's work (and so the event after it) cannot finish yet
    pool.deallocate(p);
    EXPECT_EQ(pool.stats().allocated_bytes, 0);
    EXPECT_EQ(pool.stats().reserved_bytes, 2 * static_cast<int64_t>(kMiB));
    q = pool.allocate(kMiB);  // must not be p: s2 may still be using it
    EXPECT_NE(q, p);
    EXPECT_EQ(bytes(q), bytes(p) + kMiB);  // the other half of the segment
    EXPECT_EQ(pool.stats().system_allocs, 1);
  }  // opens the gate and waits for s2
  void* again = pool.allocate(kMiB);  // the event has completed: p is free again
  EXPECT_EQ(again, p);
  EXPECT_EQ(pool.stats().system_allocs, 1);
  pool.deallocate(q);
  pool.deallocate(again);
}

TEST_F(CudaAllocatorTest, EmptyCacheWaitsForPendingBlocks) {
  TestStream s1;
  TestStream s2;
  CudaCachingAllocator pool(0);
  StreamGuard on_s1(0, s1.get());
  void* p = pool.allocate(5 * kMiB);
  RD_CUDA_CHECK(cudaMemsetAsync(p, 7, 5 * kMiB, s2.get()));  // s2 uses the block
  pool.record_stream(p, s2.get());
  pool.deallocate(p);
  pool.empty_cache();  // waits for s2's event, merges the block back, frees the segment
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_frees, 1);
}

TEST_F(CudaAllocatorTest, StatsCountBlocksSegmentsAndPeak) {
  CudaCachingAllocator pool(0);
  void* a = pool.allocate(1000);  // 1024
  void* b = pool.allocate(3000);  // 3072
  void* c = pool.allocate(3 * kMiB);  // 3 MiB from a 20 MiB segment
  expect_stats(pool.stats(), {.allocated_bytes = 4096 + 3 * kMiB,
                              .reserved_bytes = 22 * kMiB,
                              .peak_allocated_bytes = 4096 + 3 * kMiB,
                              .cache_hits = 1,
                              .cache_misses = 2,
                              .system_allocs = 2,
                              .system_frees = 0});
  pool.deallocate(c);
  pool.deallocate(a);
  expect_stats(pool.stats(), {.allocated_bytes = 3072,
                              .reserved_bytes = 22 * kMiB,
                              .peak_allocated_bytes = 4096 + 3 * kMiB,
                              .cache_hits = 1,
                              .cache_misses = 2,
                              .system_allocs = 2,
                              .system_frees = 0});
  pool.reset_peak_stats();
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 3072);
  pool.empty_cache();  // the large segment is free; the small one still holds b
  expect_stats(pool.stats(), {.allocated_bytes = 3072,
                              .reserved_bytes = 2 * kMiB,
                              .peak_allocated_bytes = 3072,
                              .cache_hits = 1,
                              .cache_misses = 2,
                              .system_allocs = 2,
                              .system_frees = 1});
  pool.deallocate(b);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_frees, 2);
}

TEST_F(CudaAllocatorTest, ReservedLimitFirstReleasesTheCacheThenFails) {
  CudaCachingAllocator pool(0);
  pool.set_reserved_limit(20 * kMiB);
  EXPECT_EQ(pool.reserved_limit(), 20 * kMiB);
  void* s = pool.allocate(512 * kKiB);  // 2 MiB segment
  pool.deallocate(s);                   // cached
  // 19 MiB needs a 20 MiB segment: only fits once the cached 2 MiB are returned.
  void* big = pool.allocate(19 * kMiB);
  EXPECT_EQ(pool.stats().system_frees, 1);
  EXPECT_EQ(pool.stats().reserved_bytes, 20 * static_cast<int64_t>(kMiB));
  // Nothing is cached now, and any new segment would exceed the limit.
  const std::string message = expect_error([&] { pool.allocate(1000); }, ErrorCode::kOutOfMemory);
  EXPECT_NE(message.find("reserved limit"), std::string::npos) << message;
  EXPECT_NE(message.find("20971520"), std::string::npos) << message;  // the limit
  EXPECT_EQ(pool.stats().reserved_bytes, 20 * static_cast<int64_t>(kMiB));
  pool.set_reserved_limit(std::nullopt);
  void* now_fits = pool.allocate(1000);
  EXPECT_NE(now_fits, nullptr);
  pool.deallocate(now_fits);
  pool.deallocate(big);
}

TEST_F(CudaAllocatorTest, EmptyCacheReleasesOnlyEntirelyFreeSegments) {
  CudaCachingAllocator pool(0);
  void* a = pool.allocate(1000);
  void* b = pool.allocate(4 * kMiB);
  void* c = pool.allocate(1000);  // shares a's segment
  pool.deallocate(a);
  pool.deallocate(b);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().system_frees, 1);
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * static_cast<int64_t>(kMiB));
  // c is untouched and still usable; a's place in the segment is still there to reuse.
  expect_blocks_usable({{c, 1000}});
  EXPECT_EQ(pool.allocate(1000), a);
  pool.deallocate(a);
  pool.deallocate(c);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().system_frees, 2);
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
  EXPECT_EQ(pool.stats().system_allocs, 2);
}

TEST_F(CudaAllocatorTest, OutOfMemoryNamesSizeDeviceAndStats) {
  CudaCachingAllocator pool(0);
  void* keep = pool.allocate(1000);
  void* cached = pool.allocate(4 * kMiB);
  pool.deallocate(cached);
  const size_t absurd = size_t{1} << 50;  // 1 PiB
  const std::string message = expect_error([&] { pool.allocate(absurd); },
                                           ErrorCode::kOutOfMemory);
  EXPECT_NE(message.find("1125899906842624"), std::string::npos) << message;
  EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
  EXPECT_NE(message.find(memory_stats_str(pool.stats())), std::string::npos) << message;
  // Before failing, the pool returned its cache (the free 20 MiB segment) and retried.
  EXPECT_EQ(pool.stats().system_frees, 1);
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * static_cast<int64_t>(kMiB));
  expect_error([&] { pool.allocate(CudaCachingAllocator::kMaxRequestBytes + 1); },
               ErrorCode::kOutOfMemory);
  // The pool still works after the failures.
  void* after = pool.allocate(1000);
  EXPECT_NE(after, nullptr);
  pool.deallocate(after);
  pool.deallocate(keep);
}

TEST_F(CudaAllocatorTest, UnknownPointersAreInternalErrors) {
  CudaCachingAllocator pool(0);
  int local = 0;
  expect_error([&] { pool.deallocate(&local); }, ErrorCode::kInternal);
  expect_error([&] { pool.record_stream(&local, nullptr); }, ErrorCode::kInternal);
  void* p = pool.allocate(1000);
  pool.deallocate(p);
  expect_error([&] { pool.deallocate(p); }, ErrorCode::kInternal);  // double free
  // An interior pointer of a live block is not a block either.
  void* q = pool.allocate(4096);
  expect_error([&] { pool.deallocate(bytes(q) + 512); }, ErrorCode::kInternal);
  pool.deallocate(q);
}

TEST_F(CudaAllocatorTest, RandomTrafficNeverOverlapsAndBalances) {
  CudaCachingAllocator pool(0);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> log_size(0.0, 25.0);  // 1 B .. 32 MiB
  std::map<char*, size_t> live;  // start -> requested size
  auto check_no_overlap = [&](char* p, size_t n) {
    auto next = live.lower_bound(p);
    if (next != live.end()) {
      ASSERT_LE(p + n, next->first) << "overlaps the next block";
    }
    if (next != live.begin()) {
      auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second, p) << "overlaps the previous block";
    }
  };
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || rng() % 5 < 3) {
      const size_t n = static_cast<size_t>(std::exp2(log_size(rng))) + 1;
      char* p = bytes(pool.allocate(n));
      ASSERT_NE(p, nullptr);
      check_no_overlap(p, n);
      live.emplace(p, n);
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      pool.deallocate(it->first);
      live.erase(it);
    }
  }
  for (const auto& [p, n] : live) pool.deallocate(p);
  MemoryStats stats = pool.stats();
  EXPECT_EQ(stats.allocated_bytes, 0);
  EXPECT_GT(stats.cache_hits, stats.cache_misses);  // the cache did its job
  pool.empty_cache();
  stats = pool.stats();
  EXPECT_EQ(stats.reserved_bytes, 0);  // every segment merged back into one free block
  EXPECT_EQ(stats.system_frees, stats.system_allocs);
}

TEST_F(CudaAllocatorTest, ConcurrentThreadsGetDisjointBlocks) {
  CudaCachingAllocator pool(0);
  std::mutex live_mu;
  std::map<char*, size_t> live;
  std::atomic<int> overlaps{0};
  auto work = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::pair<char*, size_t>> mine;
    for (int step = 0; step < 500; ++step) {
      if (mine.empty() || rng() % 2 == 0) {
        const size_t n = 1 + rng() % (3 * kMiB);
        char* p = bytes(pool.allocate(n));
        std::lock_guard<std::mutex> lock(live_mu);
        auto next = live.lower_bound(p);
        if (next != live.end() && p + n > next->first) ++overlaps;
        if (next != live.begin() && std::prev(next)->first + std::prev(next)->second > p) {
          ++overlaps;
        }
        live.emplace(p, n);
        mine.emplace_back(p, n);
      } else {
        const size_t i = rng() % mine.size();
        {
          std::lock_guard<std::mutex> lock(live_mu);
          live.erase(mine[i].first);
        }
        pool.deallocate(mine[i].first);
        mine.erase(mine.begin() + static_cast<long>(i));
      }
    }
    for (auto& [p, n] : mine) {
      {
        std::lock_guard<std::mutex> lock(live_mu);
        live.erase(p);
      }
      pool.deallocate(p);
    }
  };
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 4; ++t) threads.emplace_back(work, 100 + t);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(pool.stats().allocated_bytes, 0);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
}

TEST_F(CudaAllocatorTest, TensorStorageUsesTheProcessWidePool) {
  Allocator& pool = allocator_for(Device::cuda(0));
  EXPECT_EQ(&pool, &kernels::cuda::cuda_caching_allocator(0));
  EXPECT_EQ(pool.device(), Device::cuda(0));
  const int64_t before = pool.stats().allocated_bytes;
  {
    Tensor t = empty({1000}, TensorOptions(DType::kFloat32).with_device(Device::cuda(0)));
    EXPECT_EQ(t.device(), Device::cuda(0));
    EXPECT_EQ(pool.stats().allocated_bytes - before, 4096);  // 4000 B rounded to 512
  }
  EXPECT_EQ(pool.stats().allocated_bytes, before);
  const std::string message =
      expect_error([] { kernels::cuda::cuda_caching_allocator(1000); }, ErrorCode::kDeviceMismatch);
  EXPECT_NE(message.find("1000"), std::string::npos) << message;
}

#else  // !RD_WITH_CUDA

TEST(CudaAllocatorTest, BuiltWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace rd
