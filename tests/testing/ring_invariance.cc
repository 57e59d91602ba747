// World-size invariance helpers (see ring_invariance.h).
#include "testing/ring_invariance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "ringdilated/dist/in_process.h"
#include "ringdilated/tensor/ops.h"
#include "testing/dtype_precision.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

// Dropout in training mode, and f's documents.
nn::AttentionCallContext call_context(const nn::DilatedAttentionOptions& o, Generator* gen,
                                      const FullSequence& f) {
  nn::AttentionCallContext context{o.dropout > 0, gen, nullptr};
  if (!f.documents.empty()) context.document_starts = &f.documents;
  return context;
}

}  // namespace

Tensor ring_loss(const Tensor& out, const Tensor& lse, const Tensor& w_out, const Tensor& w_lse) {
  if (!w_lse.defined()) return sum(mul(out, w_out));
  const Tensor finite_lse = where(gt(lse, -1e300), lse, 0.0);
  return add(sum(mul(out, w_out)), sum(mul(finite_lse, w_lse)));
}

FullSequence single_device(const nn::DilatedAttentionOptions& o, DType dtype, uint64_t seed,
                           Device device, RingDims d, nn::DocumentStarts documents,
                           bool loss_reads_lse) {
  Generator gen(seed);
  const TensorOptions opts(dtype);
  const Shape bnhd{d.batch, d.seq, d.heads, d.dim};
  const Shape kv_shape{d.batch, d.seq, d.kv_heads > 0 ? d.kv_heads : d.heads, d.dim};
  FullSequence f;
  f.documents = std::move(documents);
  f.q = randn(bnhd, gen, opts).to(device);
  f.k = randn(kv_shape, gen, opts).to(device);
  f.v = randn(kv_shape, gen, opts).to(device);
  f.w_out = randn(bnhd, gen, opts).to(device);
  f.w_lse = randn({d.batch, d.heads, d.seq}, gen, DType::kFloat32).to(device);
  if (!loss_reads_lse) f.w_lse = Tensor();
  for (Tensor* t : {&f.q, &f.k, &f.v}) t->set_requires_grad(true);
  Generator dropout_gen(kRingDropoutSeed);
  nn::AttentionCallContext context = call_context(o, &dropout_gen, f);
  context.counts = &f.counts;
  const nn::DilatedAttentionResult r = nn::dilated_attention_with_lse(f.q, f.k, f.v, o, context);
  ring_loss(r.out, r.lse, f.w_out, f.w_lse).backward();
  f.out = r.out.detach();
  f.lse = r.lse.detach();
  f.path = r.path_used;
  f.grad_q = f.q.grad();
  f.grad_k = f.k.grad();
  f.grad_v = f.v.grad();
  return f;
}

FullSequence inputs_on(const FullSequence& f, Device device) {
  FullSequence copy = f;
  for (Tensor* t : {&copy.q, &copy.k, &copy.v, &copy.w_out, &copy.w_lse}) {
    if (t->defined()) *t = t->detach().to(device);
  }
  return copy;
}

RankResult run_rank(const FullSequence& f, const nn::DilatedAttentionOptions& o,
                    dist::Communicator& comm, nn::DistStrategy strategy, Device device,
                    nn::SequenceLayout layout) {
  const nn::SequenceLayout resolved = nn::resolve_layout(layout, o, f.q.size(1), comm.size());
  auto block = [&](const Tensor& t, int64_t dim) {
    if (!t.defined()) return t;
    return nn::sequence_block(t.detach(), comm.rank(), comm.size(), resolved, dim)
        .contiguous()
        .to(device);
  };
  Tensor q = block(f.q, 1), k = block(f.k, 1), v = block(f.v, 1);
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  Generator dropout_gen(kRingDropoutSeed);
  RankResult result;
  nn::AttentionCallContext context = call_context(o, &dropout_gen, f);
  context.counts = &result.counts;
  result.info = nn::ring_dilated_attention_with_lse(q, k, v, o, comm, strategy, context, layout);
  ring_loss(result.info.attention.out, result.info.attention.lse, block(f.w_out, 1),
            block(f.w_lse, 2))
      .backward();
  result.out = result.info.attention.out.detach();
  result.lse = result.info.attention.lse.detach();
  result.grad_q = q.grad();
  result.grad_k = k.grad();
  result.grad_v = v.grad();
  result.layout = resolved;
  return result;
}

std::vector<RankResult> run_in_process_ranks(const FullSequence& f,
                                             const nn::DilatedAttentionOptions& o, int P,
                                             nn::DistStrategy strategy, nn::SequenceLayout layout) {
  std::vector<RankResult> results(static_cast<size_t>(P));
  dist::run_in_process(
      P,
      [&](dist::Communicator& comm) {
        results[static_cast<size_t>(comm.rank())] =
            run_rank(f, o, comm, strategy, f.q.device(), layout);
      },
      f.q.device());
  return results;
}

Tensor joined(const std::vector<RankResult>& rs, Tensor RankResult::*field, int64_t dim) {
  const Device first = (rs.front().*field).device();
  std::vector<Tensor> blocks;
  for (const RankResult& r : rs) blocks.push_back((r.*field).to(first));
  return nn::sequence_from_blocks(blocks, rs.front().layout, dim);
}

double relative_error(const Tensor& got, const Tensor& want) {
  const RefArray g = to_ref(got), w = to_ref(want);
  EXPECT_EQ(g.shape, w.shape);
  double num = 0, den = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    if (std::isinf(w.data[i])) {
      EXPECT_EQ(g.data[i], w.data[i]) << "element " << i;
      continue;
    }
    EXPECT_FALSE(std::isnan(g.data[i])) << "element " << i;
    num += (g.data[i] - w.data[i]) * (g.data[i] - w.data[i]);
    den += w.data[i] * w.data[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

FullSequence block_of(const FullSequence& f, int rank, int P, nn::SequenceLayout layout) {
  auto rows = [&](const Tensor& t, int64_t dim) {
    return nn::sequence_block(t, rank, P, layout, dim);
  };
  FullSequence b = f;
  b.out = rows(f.out, 1);
  b.lse = rows(f.lse, 2);
  b.grad_q = rows(f.grad_q, 1);
  b.grad_k = rows(f.grad_k, 1);
  b.grad_v = rows(f.grad_v, 1);
  return b;
}

RingTolerance gpu_ring_tolerance(DType dtype) {
  const double out = 4 * unit_roundoff(dtype) + 64 * compute_roundoff(dtype);
  return {out, 64 * compute_roundoff(dtype), 2 * out};
}

bool expect_ranks_match(const std::vector<RankResult>& rs, const FullSequence& f,
                        RingTolerance tol) {
  const Device here = f.out.device();
  auto check = [&](Tensor RankResult::*field, int64_t dim, const Tensor& want, double limit,
                   const char* name) {
    const double err = relative_error(joined(rs, field, dim).to(here), want);
    EXPECT_LE(err, limit) << name;
    return err <= limit;
  };
  bool ok = check(&RankResult::out, 1, f.out, tol.out, "out");
  ok &= check(&RankResult::lse, 2, f.lse, tol.lse, "lse");
  ok &= check(&RankResult::grad_q, 1, f.grad_q, tol.grads, "grad q");
  ok &= check(&RankResult::grad_k, 1, f.grad_k, tol.grads, "grad k");
  ok &= check(&RankResult::grad_v, 1, f.grad_v, tol.grads, "grad v");
  return ok;
}

void expect_every_split_matches(const FullSequence& f, const nn::DilatedAttentionOptions& o,
                                RingTolerance tol) {
  for (const int P : {2, 4}) {
    for (const nn::DistStrategy strategy :
         {nn::DistStrategy::kRing, nn::DistStrategy::kAllGather}) {
      for (const nn::SequenceLayout layout :
           {nn::SequenceLayout::kContiguous, nn::SequenceLayout::kZigzag}) {
        SCOPED_TRACE("P" + std::to_string(P) + " " + nn::strategy_name(strategy) + " " +
                     nn::layout_name(layout));
        expect_ranks_match(run_in_process_ranks(f, o, P, strategy, layout), f, tol);
      }
    }
  }
}

std::vector<RingCase> every_ring_case() {
  std::vector<RingCase> cases;
  for (const int P : {2, 4}) {
    for (const nn::DistStrategy strategy :
         {nn::DistStrategy::kRing, nn::DistStrategy::kAllGather}) {
      for (const nn::HeadMixing mixing : {nn::HeadMixing::kHeadGroups, nn::HeadMixing::kAllHeads}) {
        for (const bool causal : {false, true}) {
          for (const nn::SequenceLayout layout :
               {nn::SequenceLayout::kContiguous, nn::SequenceLayout::kZigzag}) {
            cases.emplace_back(P, strategy, mixing, causal, layout);
          }
        }
      }
    }
  }
  return cases;
}

std::string ring_case_name(const ::testing::TestParamInfo<RingCase>& info) {
  const auto [P, strategy, mixing, causal, layout] = info.param;
  return "P" + std::to_string(P) + "_" + nn::strategy_name(strategy) + "_" +
         (mixing == nn::HeadMixing::kAllHeads ? "allheads" : "groups") + (causal ? "_causal" : "") +
         "_" + nn::layout_name(layout);
}

}  // namespace rd::test
