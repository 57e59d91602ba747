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

// The rows each head's calls overwrite, per batch row. A head's rows are
// followed while they are runs of one stride and residue (one pair's selected
// positions; runs that continue each other, as a segment's document pieces do,
// join into one); a head whose rows are not, or whose rest would take more than
// a few strided fills, is zeroed whole (its calls then overwrite their rows of
// the zeros), which is always correct.
class RowCover {
 public:
  RowCover(int64_t batch, int64_t heads, int64_t rows);

  // Records that a call overwrites the rows of `s` in each of its heads
  // (repeats included), in batch row `batch_row`, or in every batch row where
  // it is negative (LocalCall::batch_row).
  void add(const Selection& s, int64_t batch_row = -1);

  // Zeroes t ([B, rows, heads, D]) everywhere but the recorded rows.
  void zero_rest(const Tensor& t) const;

  // Whether the recorded rows are every row of every head in every batch row.
  bool covers_everything() const;

  // The runs of rows of `head` in batch row `batch_row` that zero_rest zeroes
  // (in order of their first row).
  std::vector<RowRun> rest(int64_t head, int64_t batch_row = 0) const;

 private:
  struct HeadRows {
    std::vector<RowRun> runs;  // joined where one continues another once there are many
    bool irregular = false;    // not runs of one stride and residue: zeroed whole
  };
  static void add_runs(HeadRows& head, const std::vector<RowRun>& runs);
  // Zeroes t's heads by `rests` (one per head), consecutive heads of equal rest
  // in one fill per run.
  static void zero_heads(const Tensor& t, const std::vector<std::vector<RowRun>>& rests);

  std::vector<std::vector<HeadRows>> heads_;  // [batch row][head]
  int64_t head_count_;
  int64_t rows_;
};

}  // namespace rd::nn
