// nn::RowCover (which rows of each head calls overwrite; zeroing the rest)
// against a naive per-row reference on random selections: every row no call
// covers is zeroed, and where a head's rows are one stride and residue (a
// pair's selected positions) only those rows.
#include "ringdilated/nn/row_cover.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {
namespace {

// The rows of `s`, listed one by one.
std::set<int64_t> rows_of(const Selection& s) {
  std::set<int64_t> rows;
  for (int64_t segment = 0; segment < s.segments; ++segment) {
    for (int64_t u = 0; u < s.count; ++u) {
      rows.insert(s.first_position + segment * s.segment_stride + s.rate * u);
    }
  }
  return rows;
}

std::set<int64_t> rows_of(const std::vector<RowRun>& runs) {
  std::set<int64_t> rows;
  for (const RowRun& run : runs) {
    for (int64_t i = 0; i < run.count; ++i) rows.insert(run.first + run.stride * i);
  }
  return rows;
}

// One segment's selection: `count` rows every `rate` from `first` in heads [first_head,
// first_head + head_count).
Selection one_segment(int64_t first_head, int64_t head_count, int64_t first, int64_t rate,
                      int64_t count) {
  Selection s;
  s.first_head = first_head;
  s.head_count = head_count;
  s.first_position = first;
  s.rate = rate;
  s.segment_stride = rate * std::max<int64_t>(count, 1);
  s.segments = 1;
  s.count = count;
  return s;
}

// A pair's selection of `rows` rows: segments of `length`, every `rate`-th row from
// `offset` (offset < rate and length), in heads [first_head, first_head + heads); the last
// segment may be cut short (then it is a call of its own, as the planner makes it). Where
// `rate` does not divide `length` the segments do not tile (one run per segment).
std::vector<Selection> pair_calls(int64_t rows, int64_t length, int64_t rate, int64_t offset,
                                  int64_t first_head, int64_t heads) {
  std::vector<Selection> calls;
  Selection s;
  s.first_head = first_head;
  s.head_count = heads;
  s.rate = rate;
  s.first_position = offset;
  s.segment_stride = length;
  s.segments = rows / length;
  s.count = (length - offset + rate - 1) / rate;
  if (s.segments > 0 && s.count > 0) calls.push_back(s);
  const int64_t tail = rows - s.segments * length;
  if (tail > offset) {
    Selection last = s;
    last.first_position = s.segments * length + offset;
    last.segments = 1;
    last.count = (tail - offset + rate - 1) / rate;
    calls.push_back(last);
  }
  return calls;
}

TEST(RowCover, ZeroesEveryRowNoCallCoversAndOnlyThoseOfOnePair) {
  std::mt19937_64 rng(5);
  auto draw = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t rows = draw(1, 70), heads = draw(1, 5);
    RowCover cover(1, heads, rows);
    std::vector<std::set<int64_t>> covered(static_cast<size_t>(heads));
    std::vector<int> pairs_of_head(static_cast<size_t>(heads), 0);
    std::vector<bool> unusual_head(static_cast<size_t>(heads), false);
    for (int pair = 0, pairs = static_cast<int>(draw(0, 3)); pair < pairs; ++pair) {
      // Mostly a pair as the planner makes it (rate <= 4 dividing the length); sometimes
      // rates past the rest's fill limit, segments that do not tile, single-row segments.
      const bool usual = draw(0, 3) > 0;
      const int64_t rate = usual ? draw(1, 4) : draw(1, 12);
      const int64_t length = usual ? rate * draw(1, 6) : draw(1, 20);
      const int64_t offset = draw(0, std::min(rate, length) - 1);
      const int64_t first_head = draw(0, heads - 1), count = draw(1, heads - first_head);
      std::vector<Selection> calls = pair_calls(rows, length, rate, offset, first_head, count);
      if (!calls.empty() && calls.front().segments > 1 && draw(0, 1) == 1) {
        // Rows the pair leaves to another piece: its first segment dropped (a gap).
        calls.front().first_position += length;
        calls.front().segments -= 1;
      }
      for (const Selection& s : calls) {
        cover.add(s);
        for (int64_t h = first_head; h < first_head + count; ++h) {
          for (int64_t row : rows_of(s)) covered[static_cast<size_t>(h)].insert(row);
        }
      }
      for (int64_t h = first_head; h < first_head + count; ++h) {
        ++pairs_of_head[static_cast<size_t>(h)];
        if (!usual) unusual_head[static_cast<size_t>(h)] = true;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      SCOPED_TRACE("trial " + std::to_string(trial) + ", head " + std::to_string(h));
      const std::set<int64_t> rest = rows_of(cover.rest(h));
      const std::set<int64_t>& mine = covered[static_cast<size_t>(h)];
      for (int64_t row = 0; row < rows; ++row) {
        if (!mine.count(row)) {
          EXPECT_TRUE(rest.count(row)) << "row " << row << " not zeroed";
        }
      }
      for (int64_t row : rest) EXPECT_TRUE(row >= 0 && row < rows) << row;
      // One usual pair (rows of one residue, rate <= 4: at most 5 fills): its rows exactly.
      if (pairs_of_head[static_cast<size_t>(h)] == 1 && !unusual_head[static_cast<size_t>(h)] &&
          !mine.empty()) {
        for (int64_t row : mine) EXPECT_FALSE(rest.count(row)) << "covered row " << row;
      }
    }
  }
}

// zero_rest on a [B, rows, H, D] tensor of ones: zeros exactly in each head's rest.
TEST(RowCover, ZeroRestWritesZerosExactlyInTheRest) {
  const int64_t rows = 24, heads = 4;
  RowCover cover(2, heads, rows);
  for (const Selection& s : pair_calls(rows, 8, 1, 0, 0, 1)) cover.add(s);
  for (const Selection& s : pair_calls(rows, 8, 2, 1, 1, 2)) cover.add(s);
  for (const Selection& s : pair_calls(rows, 16, 4, 3, 3, 1)) cover.add(s);
  const Tensor t = ones({2, rows, heads, 3}, TensorOptions(DType::kFloat32));
  cover.zero_rest(t);
  const std::vector<float> values = t.to_vector<float>();
  for (int64_t h = 0; h < heads; ++h) {
    const std::set<int64_t> rest = rows_of(cover.rest(h));
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t d = 0; d < 3; ++d) {
          const float want = rest.count(row) ? 0.0f : 1.0f;
          EXPECT_EQ(values[static_cast<size_t>(((b * rows + row) * heads + h) * 3 + d)], want)
              << "b " << b << " row " << row << " head " << h;
        }
      }
    }
  }
  EXPECT_TRUE(cover.rest(0).empty());  // rate 1 over every row: nothing to zero
  EXPECT_FALSE(cover.covers_everything());
  EXPECT_EQ(rows_of(cover.rest(1)).size(), rows / 2);
  // Rows 3, 7, 11 and 19, 23 (the short last segment of 8 from 16): rate 4
  // from 3.
  EXPECT_EQ(rows_of(cover.rest(3)).size(), rows - 6);
}

// The planner's document pieces (dilated_plan.cc): a pair's segments with no document
// start inside are calls over every batch row; a segment that some row's document starts
// inside is, in every row, one call per document piece of that row. The pieces of a
// segment join into the pair's run, so each batch row's rest is the rest without
// documents; a piece left out (a gap) is zeroed in its row alone.
TEST(RowCover, DocumentPiecesCoverTheirBatchRowOnly) {
  std::mt19937_64 rng(11);
  auto draw = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 300; ++trial) {
    // Sometimes more pieces in a head than RowCover keeps runs for (64) unless they join.
    const bool many = draw(0, 3) == 0;
    const int64_t rate = draw(1, 4), length = rate * draw(1, 8), segments = draw(1, many ? 24 : 6);
    const int64_t rows = length * segments, heads = draw(1, 4), batch = draw(1, 3);
    const int64_t offset = draw(0, rate - 1), first_head = draw(0, heads - 1);
    const int64_t head_count = draw(1, heads - first_head);
    // Document starts per batch row (the first at 0), a few of them.
    std::vector<std::set<int64_t>> starts(static_cast<size_t>(batch));
    for (std::set<int64_t>& row_starts : starts) {
      row_starts.insert(0);
      for (int64_t d = draw(0, many ? 120 : 4); d > 0; --d) row_starts.insert(draw(1, rows - 1));
    }
    auto selection = [&](int64_t lo, int64_t hi, int64_t segment) {
      const int64_t begin = segment * length + offset;  // the segment's first selected row
      const int64_t first_u = std::max<int64_t>(0, (lo - begin + rate - 1) / rate);
      const int64_t end_u = std::max<int64_t>(0, (hi - begin + rate - 1) / rate);
      return one_segment(first_head, head_count, begin + rate * first_u, rate,
                         std::max<int64_t>(0, end_u - first_u));
    };
    RowCover cover(batch, heads, rows);
    // covered[b]: the rows of batch row b the calls write (the same in each of their heads).
    std::vector<std::set<int64_t>> covered(static_cast<size_t>(batch));
    const bool leave_a_gap = draw(0, 1) == 0;
    int64_t gap_row = -1;  // the batch row of the piece left out
    for (int64_t segment = 0; segment < segments; ++segment) {
      const int64_t lo = segment * length, hi = lo + length;
      bool split = false;
      for (const std::set<int64_t>& row_starts : starts) {
        const auto it = row_starts.upper_bound(lo);
        split = split || (it != row_starts.end() && *it < hi);
      }
      if (!split) {
        const Selection s = selection(lo, hi, segment);
        cover.add(s, -1);
        for (std::set<int64_t>& rows_of_b : covered) {
          for (int64_t row : rows_of(s)) rows_of_b.insert(row);
        }
        continue;
      }
      for (int64_t b = 0; b < batch; ++b) {
        const std::set<int64_t>& row_starts = starts[static_cast<size_t>(b)];
        std::vector<int64_t> bounds(row_starts.begin(), row_starts.end());
        bounds.push_back(rows);
        for (size_t d = 0; d + 1 < bounds.size(); ++d) {
          const int64_t piece_lo = std::max(bounds[d], lo), piece_hi = std::min(bounds[d + 1], hi);
          const Selection s = selection(piece_lo, piece_hi, segment);
          if (piece_lo >= piece_hi || s.count == 0) continue;
          if (leave_a_gap && gap_row < 0 && draw(0, 1) == 0) {
            gap_row = b;  // this piece's rows stay unwritten
            continue;
          }
          cover.add(s, b);
          for (int64_t row : rows_of(s)) covered[static_cast<size_t>(b)].insert(row);
        }
      }
    }
    const Tensor t = ones({batch, rows, heads, 2}, TensorOptions(DType::kFloat32));
    cover.zero_rest(t);
    const std::vector<float> values = t.to_vector<float>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        SCOPED_TRACE("trial " + std::to_string(trial) + ", batch row " + std::to_string(b) +
                     ", head " + std::to_string(h));
        const bool mine = h >= first_head && h < first_head + head_count;
        const std::set<int64_t>& written = covered[static_cast<size_t>(b)];
        for (int64_t row = 0; row < rows; ++row) {
          const bool is_written = mine && written.count(row) > 0;
          const float value = values[static_cast<size_t>(((b * rows + row) * heads + h) * 2)];
          // Rows no call writes are zeroed; in the batch rows without a gap the written rows
          // are kept (one pair of rate <= 4 in a head: its rest in at most 5 fills).
          if (!is_written) {
            EXPECT_EQ(value, 0.0f) << "row " << row << " not zeroed";
          } else if (b != gap_row) {
            EXPECT_EQ(value, 1.0f) << "written row " << row;
          }
        }
      }
    }
  }
}

// covers_everything: true exactly when every row of every head of every batch row is
// recorded (a rate-1 pair over all heads, whole or as document pieces of each batch row).
TEST(RowCover, CoversEverythingOnlyWhenNoRowIsLeft) {
  const int64_t rows = 24, heads = 3;
  RowCover whole(2, heads, rows);
  EXPECT_FALSE(whole.covers_everything());
  for (const Selection& s : pair_calls(rows, 8, 1, 0, 0, heads)) whole.add(s);
  EXPECT_TRUE(whole.covers_everything());
  // Document pieces: batch row 0 in pieces [0, 5) [5, 24), row 1 in [0, 24) but head 2's
  // rows 20-23 left out.
  RowCover pieces(2, heads, rows);
  auto piece = [&](int64_t first, int64_t count, int64_t first_head, int64_t head_count) {
    return one_segment(first_head, head_count, first, 1, count);
  };
  pieces.add(piece(0, 5, 0, heads), 0);
  pieces.add(piece(5, 19, 0, heads), 0);
  pieces.add(piece(0, 24, 0, 2), 1);
  pieces.add(piece(0, 20, 2, 1), 1);
  EXPECT_FALSE(pieces.covers_everything());
  pieces.add(piece(20, 4, 2, 1), 1);
  EXPECT_TRUE(pieces.covers_everything());
  // A rate-2 pair covers half the rows.
  RowCover half(1, 1, rows);
  for (const Selection& s : pair_calls(rows, 8, 2, 0, 0, 1)) half.add(s);
  EXPECT_FALSE(half.covers_everything());
}

}  // namespace
}  // namespace rd::nn
