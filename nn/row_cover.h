// Which rows of each head of a [B, N, H, D] buffer a pass's calls overwrite, so
// that only the rest is zeroed (forward outputs under head groups, gradients
// the calls store).
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// The rows each head's calls overwrite. A head's rows are followed while they
// are runs of one stride and residue (one pair's selected positions); a head
// whose rows are not, or whose rest would take more than a few strided fills,
// is zeroed whole (its calls then overwrite their rows of the zeros), which is
// always correct.
class RowCover {
 public:
  RowCover(int64_t heads, int64_t rows);

  // Records that a call overwrites the rows of `s` in each of its heads
  // (repeats included).
  void add(const Selection& s);

  // Zeroes t ([B, rows, heads, D]) everywhere but the recorded rows.
  void zero_rest(const Tensor& t) const;

  // The runs of rows of `head` that zero_rest zeroes (in order of their first
  // row).
  std::vector<RowRun> rest(int64_t head) const;

 private:
  struct HeadRows {
    std::vector<RowRun> runs;
    bool irregular = false;  // not runs of one stride and residue: zeroed whole
  };
  std::vector<HeadRows> heads_;
  int64_t rows_;
};

}  // namespace rd::nn
