// A field-by-field check of allocator MemoryStats, for the CPU and CUDA allocator tests.
#pragma once

#include "gtest/gtest.h"
#include "ringdilated/kernels/allocator.h"

namespace rd::test {

// Expects every field of a MemoryStats equal, naming the ones that differ.
inline void expect_stats(const MemoryStats& got, const MemoryStats& want) {
  EXPECT_EQ(got.allocated_bytes, want.allocated_bytes);
  EXPECT_EQ(got.reserved_bytes, want.reserved_bytes);
  EXPECT_EQ(got.peak_allocated_bytes, want.peak_allocated_bytes);
  EXPECT_EQ(got.cache_hits, want.cache_hits);
  EXPECT_EQ(got.cache_misses, want.cache_misses);
  EXPECT_EQ(got.system_allocs, want.system_allocs);
  EXPECT_EQ(got.system_frees, want.system_frees);
}

}  // namespace rd::test
