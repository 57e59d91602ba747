// Hilbert-curve orders (see hilbert.h).
#include "ringdilated/nn/hilbert.h"

#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

struct Cell {
  int64_t x = 0, y = 0;
};

// The cell at distance d along the Hilbert curve over a side x side grid (side a power of
// two): peel two bits of d per level, from the finest quadrant up, rotating or reflecting
// the partial position so each quadrant's sub-curve joins its neighbours.
Cell cell_at(int64_t side, int64_t d) {
  Cell c;
  for (int64_t s = 1; s < side; s *= 2) {
    const int64_t rx = 1 & (d / 2);
    const int64_t ry = 1 & (d ^ rx);
    if (ry == 0) {
      if (rx == 1) {
        c.x = s - 1 - c.x;
        c.y = s - 1 - c.y;
      }
      std::swap(c.x, c.y);
    }
    c.x += s * rx;
    c.y += s * ry;
    d /= 4;
  }
  return c;
}

}  // namespace

std::vector<int64_t> hilbert_order(int64_t n) {
  RD_CHECK(n >= 0, kInvalidArgument, "hilbert_order: argument 'n' must be >= 0, got ", n);
  int64_t side = 1;
  while (side * side < n) side *= 2;
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(n));
  for (int64_t d = 0; d < side * side; ++d) {
    const Cell c = cell_at(side, d);
    const int64_t position = c.y * side + c.x;
    if (position < n) order.push_back(position);
  }
  return order;
}

}  // namespace rd::nn
