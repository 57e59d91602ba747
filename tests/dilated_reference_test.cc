// Checks of the float64 dilated-attention reference itself: the worked examples of
// docs/dilated-attention.md asserted exactly (one-hot values identify which keys contribute to
// each output row), and agreement with plain dense attention written separately here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "testing/dilated_reference.h"

namespace rd::test {
namespace {

using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::HeadMixing;
using nn::OffsetRule;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Tolerance between the reference and the independent formulas below: both are float64 over
// a few dozen terms, so they agree to a few units of 2^-53 on values of order one.
constexpr double kTight = 1e-13;

HeadsArray random_heads(int64_t batch, int64_t seq, int64_t heads, int64_t dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> magnitude(0.1, 1.0);
  std::bernoulli_distribution sign(0.5);
  HeadsArray a = HeadsArray::zeros(batch, seq, heads, dim);
  for (double& x : a.values) x = (sign(rng) ? 1.0 : -1.0) * magnitude(rng);
  return a;
}

// v[b, n, h, :] = e_n (so D = N): output row d is the total weight the row gave to key d, and
// the set of non-zero entries of an output row is exactly the set of keys it attended.
HeadsArray one_hot_values(int64_t batch, int64_t seq, int64_t heads) {
  HeadsArray v = HeadsArray::zeros(batch, seq, heads, seq);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < seq; ++n) {
      for (int64_t h = 0; h < heads; ++h) v.at(b, n, h, n) = 1.0;
    }
  }
  return v;
}

bool is_one_hot(const HeadsArray& v) {
  if (v.dim != v.seq) return false;
  for (int64_t b = 0; b < v.batch; ++b) {
    for (int64_t n = 0; n < v.seq; ++n) {
      for (int64_t h = 0; h < v.heads; ++h) {
        for (int64_t d = 0; d < v.dim; ++d) {
          if (v.at(b, n, h, d) != (d == n ? 1.0 : 0.0)) return false;
        }
      }
    }
  }
  return true;
}

double dot(const HeadsArray& q, const HeadsArray& k, int64_t b, int64_t i, int64_t j, int64_t h) {
  double s = 0.0;
  for (int64_t d = 0; d < q.dim; ++d) s += q.at(b, i, h, d) * k.at(b, j, h, d);
  return s;
}

struct ExpectedRow {
  std::vector<double> out;
  double lse = kNegInf;
};

// The textbook formula, without the max shift the reference uses (inputs here are small):
// weights exp(s_m) / sum exp(s), over a multiset of keys.
ExpectedRow attention_over(const HeadsArray& q, const HeadsArray& k, const HeadsArray& v,
                           int64_t b, int64_t h, int64_t query, const std::vector<int64_t>& keys,
                           double scale) {
  ExpectedRow row;
  row.out.assign(v.dim, 0.0);
  double z = 0.0;
  for (int64_t key : keys) z += std::exp(scale * dot(q, k, b, query, key, h));
  for (int64_t key : keys) {
    double p = std::exp(scale * dot(q, k, b, query, key, h)) / z;
    for (int64_t d = 0; d < v.dim; ++d) row.out[d] += p * v.at(b, key, h, d);
  }
  row.lse = std::log(z);
  return row;
}

std::vector<double> out_row(const DilatedReferenceResult& r, int64_t b, int64_t n, int64_t h) {
  std::vector<double> row;
  for (int64_t d = 0; d < r.out.dim; ++d) row.push_back(r.out.at(b, n, h, d));
  return row;
}

std::set<int64_t> nonzero_entries(const std::vector<double>& row) {
  std::set<int64_t> support;
  for (size_t d = 0; d < row.size(); ++d) {
    if (row[d] != 0.0) support.insert(static_cast<int64_t>(d));
  }
  return support;
}

// Row (b, n, h) is the attention of `query` over the multiset `keys`: its value and lse match
// the textbook formula, and with one-hot values its non-zero entries are exactly the keys.
void expect_row_attends(const DilatedReferenceResult& r, const HeadsArray& q, const HeadsArray& k,
                        const HeadsArray& v, int64_t b, int64_t n, int64_t h, int64_t query,
                        const std::vector<int64_t>& keys, double scale) {
  SCOPED_TRACE(::testing::Message() << "row n=" << n << " head " << h << " batch " << b);
  ExpectedRow expected = attention_over(q, k, v, b, h, query, keys, scale);
  std::vector<double> got = out_row(r, b, n, h);
  for (int64_t d = 0; d < v.dim; ++d) EXPECT_NEAR(got[d], expected.out[d], kTight) << "d=" << d;
  EXPECT_NEAR(r.lse_at(b, h, n), expected.lse, kTight);
  if (is_one_hot(v)) {
    EXPECT_EQ(nonzero_entries(got), std::set<int64_t>(keys.begin(), keys.end()));
  }
}

void expect_row_empty(const DilatedReferenceResult& r, int64_t b, int64_t n, int64_t h) {
  for (double x : out_row(r, b, n, h)) EXPECT_EQ(x, 0.0) << "row n=" << n << " head " << h;
  EXPECT_EQ(r.lse_at(b, h, n), kNegInf) << "row n=" << n << " head " << h;
}

std::vector<int64_t> range_step(int64_t start, int64_t end, int64_t step) {
  std::vector<int64_t> out;
  for (int64_t p = start; p < end; p += step) out.push_back(p);
  return out;
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

DilatedAttentionOptions pairs(std::vector<int64_t> segments, std::vector<int64_t> rates) {
  DilatedAttentionOptions o;
  o.segment_lengths = std::move(segments);
  o.dilation_rates = std::move(rates);
  return o;
}

double default_scale(const HeadsArray& q) { return 1.0 / std::sqrt(static_cast<double>(q.dim)); }

// Plain dense softmax attention, written separately from the reference: scores matrix, row
// softmax, then the weighted sum, with a causal mask j <= i.
DilatedReferenceResult dense_attention(const HeadsArray& q, const HeadsArray& k,
                                       const HeadsArray& v, bool causal, double scale) {
  DilatedReferenceResult r;
  r.out = HeadsArray::zeros(q.batch, q.seq, q.heads, v.dim);
  r.lse.assign(q.batch * q.heads * q.seq, 0.0);
  for (int64_t b = 0; b < q.batch; ++b) {
    for (int64_t h = 0; h < q.heads; ++h) {
      for (int64_t i = 0; i < q.seq; ++i) {
        int64_t visible = causal ? i + 1 : q.seq;
        std::vector<double> e(visible);
        double z = 0.0;
        for (int64_t j = 0; j < visible; ++j) z += e[j] = std::exp(scale * dot(q, k, b, i, j, h));
        for (int64_t j = 0; j < visible; ++j) {
          for (int64_t d = 0; d < v.dim; ++d) r.out.at(b, i, h, d) += e[j] / z * v.at(b, j, h, d);
        }
        r.lse[(b * q.heads + h) * q.seq + i] = std::log(z);
      }
    }
  }
  return r;
}

void expect_results_near(const DilatedReferenceResult& expected, const DilatedReferenceResult& got,
                         double tol) {
  ASSERT_EQ(expected.out.values.size(), got.out.values.size());
  for (size_t i = 0; i < expected.out.values.size(); ++i) {
    ASSERT_NEAR(got.out.values[i], expected.out.values[i], tol) << "out element " << i;
  }
  ASSERT_EQ(expected.lse.size(), got.lse.size());
  for (size_t i = 0; i < expected.lse.size(); ++i) {
    if (std::isinf(expected.lse[i])) {
      ASSERT_EQ(got.lse[i], expected.lse[i]) << "lse element " << i;
    } else {
      ASSERT_NEAR(got.lse[i], expected.lse[i], tol) << "lse element " << i;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Index plans.

TEST(DilatedReferencePlans, SegmentSelectionsShortLastSegmentAndNoWrapAround) {
  using V = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(segment_selections(10, 4, 2, 1, OffsetRule::kConstant), (V{{1, 3}, {5, 7}, {9}}));
  EXPECT_EQ(segment_selections(10, 4, 2, 0, OffsetRule::kConstant), (V{{0, 2}, {4, 6}, {8}}));
  // The last segment [8, 9) is too short for offset 1: it selects nothing (no wrap-around).
  EXPECT_EQ(segment_selections(9, 4, 2, 1, OffsetRule::kConstant), (V{{1, 3}, {5, 7}, {}}));
  EXPECT_EQ(segment_selections(16, 4, 2, 0, OffsetRule::kRotating),
            (V{{0, 2}, {5, 7}, {8, 10}, {13, 15}}));
  EXPECT_EQ(segment_selections(12, 4, 4, 1, OffsetRule::kRotating), (V{{1}, {6}, {11}}));
  // A segment longer than the sequence is one short segment.
  EXPECT_EQ(segment_selections(5, 8, 2, 0, OffsetRule::kConstant), (V{{0, 2, 4}}));
}

TEST(DilatedReferencePlans, CycledIndexList) {
  EXPECT_EQ(cycled_index_list(8, 2, 0), (std::vector<int64_t>{0, 2, 4, 6, 0, 2, 4, 6}));
  EXPECT_EQ(cycled_index_list(7, 3, 1), (std::vector<int64_t>{1, 4, 1, 4, 1, 4, 1}));
  EXPECT_EQ(cycled_index_list(4, 1, 0), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(cycled_index_list(2, 4, 3).empty());
}

TEST(DilatedReferencePlans, HeadGroupSizesGiveExtraHeadsToFirstOrLastGroups) {
  EXPECT_EQ(head_group_sizes(5, 3, true), (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(head_group_sizes(5, 3, false), (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(head_group_sizes(6, 3, true), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(head_group_sizes(7, 2, false), (std::vector<int64_t>{3, 4}));
}

TEST(DilatedReferencePlans, HeadJobsFollowTheMixingAndVariant) {
  DilatedAttentionOptions o = pairs({8, 8, 8}, {1, 2, 4});
  // Fixed, head groups, H = 5: groups {0, 1}, {2, 3}, {4}; group i uses o = i mod r_i.
  std::vector<int64_t> pair_of_head, offset_of_head;
  for (int64_t h = 0; h < 5; ++h) {
    auto jobs = head_jobs(h, 5, o);
    ASSERT_EQ(jobs.size(), 1u);
    pair_of_head.push_back(jobs[0].pair);
    offset_of_head.push_back(jobs[0].offset);
  }
  EXPECT_EQ(pair_of_head, (std::vector<int64_t>{0, 0, 1, 1, 2}));
  EXPECT_EQ(offset_of_head, (std::vector<int64_t>{0, 0, 1, 1, 2}));
  // Global: groups {0}, {1, 2}, {3, 4}.
  o.variant = DilationVariant::kGlobal;
  pair_of_head.clear();
  for (int64_t h = 0; h < 5; ++h) pair_of_head.push_back(head_jobs(h, 5, o)[0].pair);
  EXPECT_EQ(pair_of_head, (std::vector<int64_t>{0, 1, 1, 2, 2}));
  // All heads: head h runs every pair with o = h mod r_i.
  o.variant = DilationVariant::kSegmentLocal;
  o.mixing = HeadMixing::kAllHeads;
  auto jobs = head_jobs(3, 5, o);
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].offset, 0);
  EXPECT_EQ(jobs[1].offset, 1);
  EXPECT_EQ(jobs[2].offset, 3);
}

// ---------------------------------------------------------------------------------------
// Worked examples of docs/dilated-attention.md.

TEST(DilatedReferenceExamples, Example1FixedConstantOffsets) {
  const int64_t n = 16;
  HeadsArray q = random_heads(1, n, 2, n, 1), k = random_heads(1, n, 2, n, 2);
  HeadsArray v = one_hot_values(1, n, 2);
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, pairs({8, 8}, {2, 2}));
  const double scale = default_scale(q);
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<int64_t> first = range_step(h, 8, 2), second = range_step(8 + h, 16, 2);
    for (int64_t p : first) expect_row_attends(r, q, k, v, 0, p, h, p, first, scale);
    for (int64_t p : second) expect_row_attends(r, q, k, v, 0, p, h, p, second, scale);
    for (int64_t p = 1 - h; p < n; p += 2) expect_row_empty(r, 0, p, h);
  }
}

TEST(DilatedReferenceExamples, Example2GlobalVariantKeysRepeatAndRowsAreNotScatteredBack) {
  const int64_t n = 16;
  HeadsArray q = random_heads(1, n, 2, n, 3), k = random_heads(1, n, 2, n, 4);
  HeadsArray v = one_hot_values(1, n, 2);
  DilatedAttentionOptions o = pairs({8, 8}, {2, 2});
  o.variant = DilationVariant::kGlobal;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<int64_t> once = range_step(h, n, 2);
    std::vector<int64_t> twice = concat(once, once);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t query = 2 * (j % 8) + h;
      expect_row_attends(r, q, k, v, 0, j, h, query, twice, scale);
      // Each key counted twice: the same weights as once, and an lse larger by log 2.
      ExpectedRow single = attention_over(q, k, v, 0, h, query, once, scale);
      EXPECT_NEAR(r.lse_at(0, h, j), single.lse + std::log(2.0), kTight);
    }
  }
}

TEST(DilatedReferenceExamples, Example3ShortLastSegment) {
  const int64_t n = 10;
  HeadsArray q = random_heads(1, n, 2, 4, 5), k = random_heads(1, n, 2, 4, 6);
  HeadsArray v = random_heads(1, n, 2, 4, 7);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.mixing = HeadMixing::kAllHeads;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  // Head 1 (o = 1): {1, 3}, {5, 7}, {9}; position 9 attends only to itself: out = v[9].
  for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(r.out.at(0, 9, 1, d), v.at(0, 9, 1, d));
  EXPECT_EQ(r.lse_at(0, 1, 9), scale * dot(q, k, 0, 9, 9, 1));
  expect_row_attends(r, q, k, v, 0, 1, 1, 1, {1, 3}, scale);
  expect_row_attends(r, q, k, v, 0, 7, 1, 7, {5, 7}, scale);
  for (int64_t p : {0, 2, 4, 6, 8}) expect_row_empty(r, 0, p, 1);
  // Head 0 (o = 0): {0, 2}, {4, 6}, {8}.
  for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(r.out.at(0, 8, 0, d), v.at(0, 8, 0, d));
  expect_row_attends(r, q, k, v, 0, 6, 0, 6, {4, 6}, scale);
  for (int64_t p : {1, 3, 5, 7, 9}) expect_row_empty(r, 0, p, 0);
}

TEST(DilatedReferenceExamples, Example4RotatingOffsets) {
  const int64_t n = 16;
  HeadsArray q = random_heads(1, n, 1, n, 8), k = random_heads(1, n, 1, n, 9);
  HeadsArray v = one_hot_values(1, n, 1);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.offset_rule = OffsetRule::kRotating;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const std::vector<std::vector<int64_t>> selected = {{0, 2}, {5, 7}, {8, 10}, {13, 15}};
  std::set<int64_t> all_selected;
  for (const auto& segment : selected) {
    for (int64_t p : segment) {
      expect_row_attends(r, q, k, v, 0, p, 0, p, segment, default_scale(q));
      all_selected.insert(p);
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    if (!all_selected.count(p)) expect_row_empty(r, 0, p, 0);
  }
}

TEST(DilatedReferenceExamples, Example5CausalFixed) {
  const int64_t n = 8;
  HeadsArray q = random_heads(1, n, 1, n, 10), k = random_heads(1, n, 1, n, 11);
  HeadsArray v = one_hot_values(1, n, 1);
  DilatedAttentionOptions o = pairs({4}, {2});
  o.causal = true;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  for (int64_t p : {0, 4}) {
    for (int64_t d = 0; d < n; ++d) EXPECT_EQ(r.out.at(0, p, 0, d), v.at(0, p, 0, d)) << p;
  }
  expect_row_attends(r, q, k, v, 0, 2, 0, 2, {0, 2}, scale);
  expect_row_attends(r, q, k, v, 0, 6, 0, 6, {4, 6}, scale);
  for (int64_t p : {1, 3, 5, 7}) expect_row_empty(r, 0, p, 0);
}

TEST(DilatedReferenceExamples, Example6AllHeadsMergeThroughTheLogSumExp) {
  const int64_t n = 8;
  HeadsArray q = random_heads(1, n, 2, n, 12), k = random_heads(1, n, 2, n, 13);
  HeadsArray v = one_hot_values(1, n, 2);
  DilatedAttentionOptions o = pairs({4, 8}, {1, 2});
  o.mixing = HeadMixing::kAllHeads;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  // Head 0, position 1: pair 1 (o = 0) does not select it, so only pair 0's [0, 4) counts.
  expect_row_attends(r, q, k, v, 0, 1, 0, 1, {0, 1, 2, 3}, scale);
  // Head 0, position 2: the union of {0, 1, 2, 3} and {0, 2, 4, 6}, keys 0 and 2 twice.
  expect_row_attends(r, q, k, v, 0, 2, 0, 2, {0, 1, 2, 3, 0, 2, 4, 6}, scale);
  // ... which is the LSE-weighted merge of the two pairs' separate results.
  ExpectedRow dense_part = attention_over(q, k, v, 0, 0, 2, {0, 1, 2, 3}, scale);
  ExpectedRow dilated_part = attention_over(q, k, v, 0, 0, 2, {0, 2, 4, 6}, scale);
  double lse = std::log(std::exp(dense_part.lse) + std::exp(dilated_part.lse));
  EXPECT_NEAR(r.lse_at(0, 0, 2), lse, kTight);
  for (int64_t d = 0; d < n; ++d) {
    double merged = std::exp(dense_part.lse - lse) * dense_part.out[d] +
                    std::exp(dilated_part.lse - lse) * dilated_part.out[d];
    EXPECT_NEAR(r.out.at(0, 2, 0, d), merged, kTight);
  }
  // Head 1 uses o = 1 for pair 1 ({1, 3, 5, 7}) and o = 0 for pair 0 (r = 1).
  expect_row_attends(r, q, k, v, 0, 1, 1, 1, {0, 1, 2, 3, 1, 3, 5, 7}, scale);
  expect_row_attends(r, q, k, v, 0, 2, 1, 2, {0, 1, 2, 3}, scale);
  expect_row_attends(r, q, k, v, 0, 6, 1, 6, {4, 5, 6, 7}, scale);
  expect_row_attends(r, q, k, v, 0, 7, 1, 7, {4, 5, 6, 7, 1, 3, 5, 7}, scale);
}

// ---------------------------------------------------------------------------------------
// Further semantics.

TEST(DilatedReferenceSemantics, OnePairOfRateOneIsDenseAttention) {
  HeadsArray q = random_heads(2, 7, 3, 5, 20), k = random_heads(2, 7, 3, 5, 21);
  HeadsArray v = random_heads(2, 7, 3, 5, 22);
  for (bool causal : {false, true}) {
    DilatedReferenceResult dense = dense_attention(q, k, v, causal, default_scale(q));
    for (int64_t segment : {7, 16}) {  // w = N, and w > N (one short segment)
      for (HeadMixing mixing : {HeadMixing::kHeadGroups, HeadMixing::kAllHeads}) {
        for (DilationVariant variant : {DilationVariant::kSegmentLocal, DilationVariant::kGlobal}) {
          SCOPED_TRACE(::testing::Message() << "causal " << causal << " w " << segment << " mixing "
                                            << static_cast<int>(mixing) << " variant "
                                            << static_cast<int>(variant));
          DilatedAttentionOptions o = pairs({segment}, {1});
          o.causal = causal;
          o.mixing = mixing;
          o.variant = variant;
          expect_results_near(dense, dilated_attention_reference(q, k, v, o), kTight);
        }
      }
    }
  }
}

TEST(DilatedReferenceSemantics, ScaleDefaultsToInverseSqrtOfHeadDim) {
  HeadsArray q = random_heads(1, 9, 2, 4, 23), k = random_heads(1, 9, 2, 4, 24);
  HeadsArray v = random_heads(1, 9, 2, 4, 25);
  DilatedAttentionOptions o = pairs({9}, {1});
  DilatedReferenceResult implicit = dilated_attention_reference(q, k, v, o);
  expect_results_near(dense_attention(q, k, v, false, 0.5), implicit, kTight);
  o.scale = 1.7;
  expect_results_near(dense_attention(q, k, v, false, 1.7), dilated_attention_reference(q, k, v, o),
                      kTight);
}

TEST(DilatedReferenceSemantics, FixedSegmentsAreIndependentDenseBlocks) {
  // Pair (4, 1) on N = 10 is dense attention inside [0, 4), [4, 8) and the short [8, 10).
  HeadsArray q = random_heads(2, 10, 1, 3, 26), k = random_heads(2, 10, 1, 3, 27);
  HeadsArray v = random_heads(2, 10, 1, 3, 28);
  for (bool causal : {false, true}) {
    DilatedAttentionOptions o = pairs({4}, {1});
    o.causal = causal;
    DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t p = 0; p < 10; ++p) {
        int64_t start = p / 4 * 4, end = std::min<int64_t>(start + 4, 10);
        std::vector<int64_t> keys = range_step(start, causal ? p + 1 : end, 1);
        expect_row_attends(r, q, k, v, b, p, 0, p, keys, 1.0 / std::sqrt(3.0));
      }
    }
  }
}

TEST(DilatedReferenceSemantics, HeadGroupsWithExtraHeadsUseTheirGroupsPair) {
  const int64_t n = 16;
  HeadsArray q = random_heads(1, n, 5, n, 29), k = random_heads(1, n, 5, n, 30);
  HeadsArray v = one_hot_values(1, n, 5);
  DilatedAttentionOptions o = pairs({16, 8, 8}, {1, 2, 4});
  DilatedReferenceResult fixed = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  // Fixed: groups {0, 1} dense, {2, 3} pair (8, 2) with o = 1, {4} pair (8, 4) with o = 2.
  for (int64_t h : {0, 1}) expect_row_attends(fixed, q, k, v, 0, 5, h, 5, range_step(0, n, 1), scale);
  for (int64_t h : {2, 3}) {
    expect_row_attends(fixed, q, k, v, 0, 11, h, 11, {9, 11, 13, 15}, scale);
    expect_row_empty(fixed, 0, 10, h);
  }
  expect_row_attends(fixed, q, k, v, 0, 6, 4, 6, {2, 6}, scale);
  expect_row_attends(fixed, q, k, v, 0, 10, 4, 10, {10, 14}, scale);
  expect_row_empty(fixed, 0, 1, 4);
  // Global: groups {0} dense, {1, 2} rate 2 with o = 1, {3, 4} rate 4 with o = 2.
  o.variant = DilationVariant::kGlobal;
  DilatedReferenceResult global = dilated_attention_reference(q, k, v, o);
  expect_row_attends(global, q, k, v, 0, 5, 0, 5, range_step(0, n, 1), scale);
  std::vector<int64_t> odd = range_step(1, n, 2), every_fourth = range_step(2, n, 4);
  for (int64_t h : {1, 2}) {
    expect_row_attends(global, q, k, v, 0, 10, h, 2 * (10 % 8) + 1, concat(odd, odd), scale);
  }
  std::vector<int64_t> four_times = concat(concat(every_fourth, every_fourth), concat(every_fourth, every_fourth));
  for (int64_t h : {3, 4}) {
    expect_row_attends(global, q, k, v, 0, 7, h, every_fourth[7 % 4], four_times, scale);
  }
}

TEST(DilatedReferenceSemantics, GlobalCausalMasksByListOrder) {
  const int64_t n = 8;
  HeadsArray q = random_heads(1, n, 1, n, 31), k = random_heads(1, n, 1, n, 32);
  HeadsArray v = one_hot_values(1, n, 1);
  DilatedAttentionOptions o = pairs({8}, {2});
  o.variant = DilationVariant::kGlobal;
  o.causal = true;
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
  const double scale = default_scale(q);
  // P = [0, 2, 4, 6, 0, 2, 4, 6]; row j sees P[0..j] whatever the original positions are.
  expect_row_attends(r, q, k, v, 0, 0, 0, 0, {0}, scale);
  expect_row_attends(r, q, k, v, 0, 2, 0, 4, {0, 2, 4}, scale);
  expect_row_attends(r, q, k, v, 0, 5, 0, 2, {0, 2, 4, 6, 0, 2}, scale);
  // Row 5: keys 0 and 2 count twice, 4 and 6 once.
  double e0 = std::exp(scale * dot(q, k, 0, 2, 0, 0)), e6 = std::exp(scale * dot(q, k, 0, 2, 6, 0));
  EXPECT_NEAR(r.out.at(0, 5, 0, 0) / r.out.at(0, 5, 0, 6), 2.0 * e0 / e6, 1e-12);
}

TEST(DilatedReferenceSemantics, AllHeadsRowsThatNoPairSelectsAreZero) {
  const int64_t n = 8;
  HeadsArray q = random_heads(1, n, 1, 3, 33), k = random_heads(1, n, 1, 3, 34);
  HeadsArray v = random_heads(1, n, 1, 3, 35);
  for (bool causal : {false, true}) {
    DilatedAttentionOptions o = pairs({4, 8}, {2, 4});
    o.mixing = HeadMixing::kAllHeads;
    o.causal = causal;
    DilatedReferenceResult r = dilated_attention_reference(q, k, v, o);
    for (int64_t p : {1, 3, 5, 7}) expect_row_empty(r, 0, p, 0);
    // Position 4: pair 0's {4, 6} and pair 1's {0, 4}; causal leaves {4} and {0, 4}.
    std::vector<int64_t> keys =
        causal ? std::vector<int64_t>{4, 0, 4} : std::vector<int64_t>{4, 6, 0, 4};
    expect_row_attends(r, q, k, v, 0, 4, 0, 4, keys, default_scale(q));
  }
}

TEST(DilatedReferenceSemantics, RateEqualToSegmentLengthLetsEachSelectedPositionSeeOnlyItself) {
  HeadsArray q = random_heads(1, 12, 1, 4, 36), k = random_heads(1, 12, 1, 4, 37);
  HeadsArray v = random_heads(1, 12, 1, 4, 38);
  DilatedReferenceResult r = dilated_attention_reference(q, k, v, pairs({3}, {3}));
  for (int64_t p = 0; p < 12; ++p) {
    if (p % 3 != 0) {
      expect_row_empty(r, 0, p, 0);
      continue;
    }
    for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(r.out.at(0, p, 0, d), v.at(0, p, 0, d));
  }
}

TEST(DilatedReferenceSemantics, RejectsWhatTheSpecificationRejects) {
  HeadsArray x = random_heads(1, 8, 2, 4, 39);
  auto run = [&](const DilatedAttentionOptions& o) { dilated_attention_reference(x, x, x, o); };
  EXPECT_THROW(run(pairs({}, {})), std::invalid_argument);
  EXPECT_THROW(run(pairs({8, 4}, {2})), std::invalid_argument);
  EXPECT_THROW(run(pairs({0}, {1})), std::invalid_argument);
  EXPECT_THROW(run(pairs({8}, {0})), std::invalid_argument);
  EXPECT_THROW(run(pairs({6}, {4})), std::invalid_argument);
  EXPECT_THROW(run(pairs({8, 8, 8}, {1, 2, 4})), std::invalid_argument);  // H = 2 < G = 3
  DilatedAttentionOptions all_heads = pairs({8, 8, 8}, {1, 2, 4});
  all_heads.mixing = HeadMixing::kAllHeads;
  EXPECT_NO_THROW(run(all_heads));
}

}  // namespace
}  // namespace rd::test
