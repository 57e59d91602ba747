// Hilbert-curve orders: the key visiting order of dilated attention's use_hilbert option.
#pragma once

#include <cstdint>
#include <vector>

namespace rd::nn {

// A permutation of 0..n-1: lay the n positions row-major on the smallest 2^k x 2^k grid
// that holds them (position p at row p / 2^k, column p % 2^k) and list them in the order a
// Hilbert curve over the grid visits their cells. On a full grid consecutive entries are
// grid neighbours; cells past n are skipped. n must be >= 0.
std::vector<int64_t> hilbert_order(int64_t n);

}  // namespace rd::nn
