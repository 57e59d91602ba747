// RowCover: the rows each head's calls overwrite, and zeroing the rest in
// strided fills.
#include "ringdilated/nn/row_cover.h"

#include <algorithm>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

// Runs followed per head (calls whose segments do not tile add one run per
// segment).
constexpr size_t kMaxRuns = 64;
// A head's rest in more strided fills than this is zeroed whole: each fill is a
// launch, and at strides past 8 the rows saved are under an eighth of the head.
constexpr size_t kMaxRestRuns = 8;

// How many of first, first + stride, ... lie below `rows`.
int64_t count_below(int64_t first, int64_t stride, int64_t rows) {
  return first < rows ? (rows - first + stride - 1) / stride : 0;
}

// The rows of a selection: one run where its segments tile (each segment's
// selected rows continue the previous one's), else one run per segment.
std::vector<RowRun> runs_of(const Selection& s) {
  if (s.segments == 1 || s.count * s.rate == s.segment_stride) {
    return {RowRun{s.first_position, s.rate, s.count * s.segments}};
  }
  std::vector<RowRun> runs;
  for (int64_t segment = 0; segment < s.segments; ++segment) {
    runs.push_back(RowRun{s.first_position + segment * s.segment_stride, s.rate, s.count});
  }
  return runs;
}

// Whether `next` starts where `run` (of the same stride) ends.
bool continues(const RowRun& run, const RowRun& next) {
  return run.stride == next.stride && run.first + run.stride * run.count == next.first;
}

// Sorts runs of one stride and residue and joins those that continue each other.
void join_runs(std::vector<RowRun>& runs) {
  std::sort(runs.begin(), runs.end(),
            [](const RowRun& a, const RowRun& b) { return a.first < b.first; });
  std::vector<RowRun> joined;
  for (const RowRun& run : runs) {
    if (!joined.empty() && continues(joined.back(), run)) {
      joined.back().count += run.count;
    } else {
      joined.push_back(run);
    }
  }
  runs = std::move(joined);
}

bool same_runs(const std::vector<RowRun>& x, const std::vector<RowRun>& y) {
  return std::equal(x.begin(), x.end(), y.begin(), y.end(), [](const RowRun& a, const RowRun& b) {
    return a.first == b.first && a.stride == b.stride && a.count == b.count;
  });
}

}  // namespace

RowCover::RowCover(int64_t batch, int64_t heads, int64_t rows)
    : heads_(static_cast<size_t>(batch), std::vector<HeadRows>(static_cast<size_t>(heads))),
      head_count_(heads),
      rows_(rows) {
  RD_CHECK(batch >= 0 && heads >= 0, kInternal, "RowCover: a buffer of ", batch, " batch rows and ",
           heads, " heads");
}

void RowCover::add_runs(HeadRows& head, const std::vector<RowRun>& runs) {
  if (head.irregular) return;
  const int64_t stride = head.runs.empty() ? runs.front().stride : head.runs.front().stride;
  const int64_t residue = (head.runs.empty() ? runs.front() : head.runs.front()).first % stride;
  for (const RowRun& run : runs) {
    if (run.stride != stride || run.first % stride != residue) {
      head.irregular = true;
      head.runs.clear();
      return;
    }
    head.runs.push_back(run);
  }
  // A segment's document pieces add a run each: joined once there are many, they are
  // the pair's one run per segment (or fewer) again.
  if (head.runs.size() > kMaxRuns) join_runs(head.runs);
  if (head.runs.size() > kMaxRuns) {
    head.irregular = true;
    head.runs.clear();
  }
}

void RowCover::add(const Selection& s, int64_t batch_row) {
  if (s.empty()) return;
  const auto batch = static_cast<int64_t>(heads_.size());
  RD_CHECK(batch_row < batch, kInternal, "RowCover: batch row ", batch_row, " of a buffer of ",
           batch);
  const std::vector<RowRun> runs = runs_of(s);
  const int64_t first_row = batch_row < 0 ? 0 : batch_row;
  const int64_t end_row = batch_row < 0 ? batch : batch_row + 1;
  for (int64_t a = 0; a < s.head_count; ++a) {
    for (int64_t b = 0; b < s.head_repeat; ++b) {
      const int64_t h = s.first_head + s.head_stride * a + s.repeat_stride * b;
      RD_CHECK(h >= 0 && h < head_count_, kInternal, "RowCover: head ", h,
               " of a selection outside the buffer's ", head_count_);
      for (int64_t row = first_row; row < end_row; ++row) {
        add_runs(heads_[static_cast<size_t>(row)][static_cast<size_t>(h)], runs);
      }
    }
  }
}

std::vector<RowRun> RowCover::rest(int64_t head, int64_t batch_row) const {
  const HeadRows& rows = heads_.at(static_cast<size_t>(batch_row)).at(static_cast<size_t>(head));
  const std::vector<RowRun> whole{RowRun{0, 1, rows_}};
  if (rows.irregular || rows.runs.empty()) return whole;
  const int64_t stride = rows.runs.front().stride;
  const int64_t residue = rows.runs.front().first % stride;
  std::vector<RowRun> rest;
  // The other residues whole.
  for (int64_t r = 0; r < std::min(stride, rows_); ++r) {
    if (r != residue) rest.push_back(RowRun{r, stride, count_below(r, stride, rows_)});
  }
  // The residue's rows between the runs.
  std::vector<RowRun> runs = rows.runs;
  std::sort(runs.begin(), runs.end(),
            [](const RowRun& a, const RowRun& b) { return a.first < b.first; });
  int64_t next = residue;  // the residue's first row not yet covered
  for (const RowRun& run : runs) {
    if (run.first > next) rest.push_back(RowRun{next, stride, (run.first - next) / stride});
    next = std::max(next, run.first + stride * run.count);
  }
  if (next < rows_) rest.push_back(RowRun{next, stride, count_below(next, stride, rows_)});
  if (rest.size() > kMaxRestRuns) return whole;
  std::sort(rest.begin(), rest.end(),
            [](const RowRun& a, const RowRun& b) { return a.first < b.first; });
  return rest;
}

bool RowCover::covers_everything() const {
  for (size_t row = 0; row < heads_.size(); ++row) {
    for (int64_t h = 0; h < head_count_; ++h) {
      if (!rest(h, static_cast<int64_t>(row)).empty()) return false;
    }
  }
  return true;
}

void RowCover::zero_heads(const Tensor& t, const std::vector<std::vector<RowRun>>& rests) {
  const auto heads = static_cast<int64_t>(rests.size());
  for (int64_t first = 0; first < heads;) {
    int64_t end = first + 1;
    while (end < heads &&
           same_runs(rests[static_cast<size_t>(end)], rests[static_cast<size_t>(first)]))
      ++end;
    for (const RowRun& run : rests[static_cast<size_t>(first)]) {
      unit_rows(t, Heads{first, 1, end - first}, run).zero_();
    }
    first = end;
  }
}

void RowCover::zero_rest(const Tensor& t) const {
  const auto batch = static_cast<int64_t>(heads_.size());
  const int64_t heads = head_count_;
  RD_CHECK(t.dim() == 4 && t.size(0) == batch && t.size(1) == rows_ && t.size(2) == heads,
           kInternal, "RowCover: a buffer of ", batch, " batch rows, ", rows_, " rows and ", heads,
           " heads, got shape ", shape_str(t.shape()));
  if (batch == 0 || heads == 0) return;
  std::vector<std::vector<std::vector<RowRun>>> rests(static_cast<size_t>(batch));
  bool rows_alike = true;  // every batch row's rests those of the first
  for (int64_t row = 0; row < batch; ++row) {
    for (int64_t h = 0; h < heads; ++h) rests[static_cast<size_t>(row)].push_back(rest(h, row));
    const auto& mine = rests[static_cast<size_t>(row)];
    for (int64_t h = 0; h < heads && rows_alike; ++h) {
      rows_alike = same_runs(mine[static_cast<size_t>(h)], rests.front()[static_cast<size_t>(h)]);
    }
  }
  if (rows_alike) {
    zero_heads(t, rests.front());  // one fill per run over every batch row
    return;
  }
  for (int64_t row = 0; row < batch; ++row) {
    zero_heads(t.narrow(0, row, 1), rests[static_cast<size_t>(row)]);
  }
}

}  // namespace rd::nn
