// The float64 dilated-attention reference: index plans built literally from the specification
// (docs/dilated-attention.md), one max-shifted softmax per row, and a log-sum-exp merge.
#include "testing/dilated_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace rd::test {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct RowResult {
  std::vector<double> out;  // [D]
  double lse = kNegInf;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("dilated_attention_reference: " + what);
}

void validate(const HeadsArray& q, const HeadsArray& k, const HeadsArray& v,
              const nn::DilatedAttentionOptions& options) {
  auto same_shape = [&](const HeadsArray& x) {
    return x.batch == q.batch && x.seq == q.seq && x.heads == q.heads && x.dim == q.dim &&
           static_cast<int64_t>(x.values.size()) == x.batch * x.seq * x.heads * x.dim;
  };
  require(same_shape(q) && same_shape(k) && same_shape(v), "q, k, v must share one shape");
  require(q.dim >= 1, "head dim must be >= 1");
  const auto& w = options.segment_lengths;
  const auto& r = options.dilation_rates;
  require(!w.empty() && w.size() == r.size(), "pair lists must be non-empty and equal");
  for (size_t i = 0; i < w.size(); ++i) {
    require(w[i] >= 1 && r[i] >= 1 && w[i] % r[i] == 0, "bad pair " + std::to_string(i));
  }
  if (options.mixing == nn::HeadMixing::kHeadGroups) {
    require(q.heads >= static_cast<int64_t>(w.size()), "head groups need H >= G");
  }
}

// softmax(scale * q[query] . k[keys]^T) . v[keys] for one (batch, head), with its lse.
RowResult attend(const HeadsArray& q, const HeadsArray& k, const HeadsArray& v, int64_t b,
                 int64_t h, const RowPlan& plan, double scale) {
  RowResult row;
  row.out.assign(q.dim, 0.0);
  if (plan.query < 0 || plan.keys.empty()) return row;
  std::vector<double> scores;
  for (int64_t key : plan.keys) {
    double dot = 0.0;
    for (int64_t d = 0; d < q.dim; ++d) dot += q.at(b, plan.query, h, d) * k.at(b, key, h, d);
    scores.push_back(scale * dot);
  }
  double max_score = *std::max_element(scores.begin(), scores.end());
  double denominator = 0.0;
  for (double s : scores) denominator += std::exp(s - max_score);
  row.lse = max_score + std::log(denominator);
  for (size_t m = 0; m < plan.keys.size(); ++m) {
    double weight = std::exp(scores[m] - row.lse);
    for (int64_t d = 0; d < q.dim; ++d) row.out[d] += weight * v.at(b, plan.keys[m], h, d);
  }
  return row;
}

// LSE = logsumexp_i lse_i, out = sum_i exp(lse_i - LSE) out_i; all -inf gives 0 and -inf.
RowResult merge(const std::vector<RowResult>& parts, int64_t dim) {
  RowResult merged;
  merged.out.assign(dim, 0.0);
  double max_lse = kNegInf;
  for (const RowResult& part : parts) max_lse = std::max(max_lse, part.lse);
  if (max_lse == kNegInf) return merged;
  double total = 0.0;
  for (const RowResult& part : parts) total += std::exp(part.lse - max_lse);
  merged.lse = max_lse + std::log(total);
  for (const RowResult& part : parts) {
    double weight = std::exp(part.lse - merged.lse);
    for (int64_t d = 0; d < dim; ++d) merged.out[d] += weight * part.out[d];
  }
  return merged;
}

// Index of the group head `head` falls in, for contiguous groups of the given sizes.
int64_t group_of(int64_t head, const std::vector<int64_t>& sizes) {
  int64_t end = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    end += sizes[g];
    if (head < end) return static_cast<int64_t>(g);
  }
  throw std::invalid_argument("dilated_attention_reference: head outside every group");
}

}  // namespace

HeadsArray HeadsArray::zeros(int64_t batch, int64_t seq, int64_t heads, int64_t dim) {
  HeadsArray a;
  a.batch = batch;
  a.seq = seq;
  a.heads = heads;
  a.dim = dim;
  a.values.assign(batch * seq * heads * dim, 0.0);
  return a;
}

std::vector<int64_t> head_group_sizes(int64_t heads, int64_t groups, bool extra_to_first) {
  std::vector<int64_t> sizes(groups, heads / groups);
  int64_t extra = heads % groups;
  for (int64_t e = 0; e < extra; ++e) {
    int64_t g = extra_to_first ? e : groups - 1 - e;
    sizes[g] += 1;
  }
  return sizes;
}

std::vector<std::vector<int64_t>> segment_selections(int64_t seq, int64_t segment_length,
                                                     int64_t rate, int64_t offset,
                                                     nn::OffsetRule rule) {
  std::vector<std::vector<int64_t>> selections;
  int64_t num_segments = (seq + segment_length - 1) / segment_length;
  for (int64_t s = 0; s < num_segments; ++s) {
    int64_t start = s * segment_length;
    int64_t length = std::min(segment_length, seq - start);
    int64_t o = rule == nn::OffsetRule::kConstant ? offset : (offset + s) % rate;
    std::vector<int64_t> selected;
    for (int64_t t = 0; o + rate * t < length; ++t) selected.push_back(start + o + rate * t);
    selections.push_back(selected);
  }
  return selections;
}

std::vector<int64_t> cycled_index_list(int64_t seq, int64_t rate, int64_t offset) {
  std::vector<int64_t> base;
  for (int64_t p = offset; p < seq; p += rate) base.push_back(p);
  if (base.empty()) return {};
  std::vector<int64_t> list;
  for (int64_t j = 0; j < seq; ++j) list.push_back(base[j % base.size()]);
  return list;
}

std::vector<PairJob> head_jobs(int64_t head, int64_t heads,
                               const nn::DilatedAttentionOptions& options) {
  const auto& rates = options.dilation_rates;
  const int64_t groups = static_cast<int64_t>(rates.size());
  if (options.mixing == nn::HeadMixing::kAllHeads) {
    std::vector<PairJob> jobs;
    for (int64_t i = 0; i < groups; ++i) jobs.push_back({i, head % rates[i]});
    return jobs;
  }
  bool extra_to_first = options.variant == nn::DilationVariant::kSegmentLocal;
  int64_t group = group_of(head, head_group_sizes(heads, groups, extra_to_first));
  return {{group, group % rates[group]}};
}

std::vector<RowPlan> row_plans(int64_t seq, const PairJob& job,
                               const nn::DilatedAttentionOptions& options) {
  const int64_t rate = options.dilation_rates[job.pair];
  std::vector<RowPlan> plans(seq);
  if (options.variant == nn::DilationVariant::kGlobal) {
    std::vector<int64_t> list = cycled_index_list(seq, rate, job.offset);
    if (list.empty()) return plans;
    for (int64_t j = 0; j < seq; ++j) {
      plans[j].query = list[j];
      int64_t visible = options.causal ? j + 1 : seq;  // list order, not original position
      plans[j].keys.assign(list.begin(), list.begin() + visible);
    }
    return plans;
  }
  const int64_t segment_length = options.segment_lengths[job.pair];
  for (const std::vector<int64_t>& selected :
       segment_selections(seq, segment_length, rate, job.offset, options.offset_rule)) {
    for (int64_t p : selected) {
      plans[p].query = p;
      for (int64_t key : selected) {
        if (!options.causal || key <= p) plans[p].keys.push_back(key);
      }
    }
  }
  return plans;
}

HeadsArray heads_array_of(const Tensor& t) {
  HeadsArray a = HeadsArray::zeros(t.size(0), t.size(1), t.size(2), t.size(3));
  a.values = t.to(DType::kFloat64).contiguous().to_vector<double>();
  return a;
}

namespace {

// The document of `position` in a row whose documents start at `starts` (0 without any).
int64_t document_of(const std::vector<int64_t>& starts, int64_t position) {
  int64_t doc = 0;
  for (size_t d = 0; d < starts.size(); ++d) {
    if (starts[d] <= position) doc = static_cast<int64_t>(d);
  }
  return doc;
}

// `plan` without the keys outside the query's document.
RowPlan within_document(RowPlan plan, const std::vector<int64_t>& starts) {
  if (plan.query < 0) return plan;
  const int64_t doc = document_of(starts, plan.query);
  std::vector<int64_t> kept;
  for (int64_t key : plan.keys) {
    if (document_of(starts, key) == doc) kept.push_back(key);
  }
  plan.keys = kept;
  if (plan.keys.empty()) plan.query = -1;
  return plan;
}

}  // namespace

DilatedReferenceResult dilated_attention_reference(
    const HeadsArray& q, const HeadsArray& k, const HeadsArray& v,
    const nn::DilatedAttentionOptions& options,
    const std::vector<std::vector<int64_t>>* document_starts) {
  validate(q, k, v, options);
  const double scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(q.dim));
  DilatedReferenceResult result;
  result.out = HeadsArray::zeros(q.batch, q.seq, q.heads, q.dim);
  result.lse.assign(q.batch * q.heads * q.seq, kNegInf);
  for (int64_t h = 0; h < q.heads; ++h) {
    std::vector<std::vector<RowPlan>> plans_per_job;
    for (const PairJob& job : head_jobs(h, q.heads, options)) {
      plans_per_job.push_back(row_plans(q.seq, job, options));
    }
    for (int64_t b = 0; b < q.batch; ++b) {
      for (int64_t n = 0; n < q.seq; ++n) {
        std::vector<RowResult> parts;
        for (const auto& plans : plans_per_job) {
          const RowPlan plan = document_starts == nullptr
                                   ? plans[n]
                                   : within_document(plans[n], (*document_starts)[b]);
          parts.push_back(attend(q, k, v, b, h, plan, scale));
        }
        RowResult row = merge(parts, q.dim);
        for (int64_t d = 0; d < q.dim; ++d) result.out.at(b, n, h, d) = row.out[d];
        result.lse[(b * q.heads + h) * q.seq + n] = row.lse;
      }
    }
  }
  return result;
}

}  // namespace rd::test
