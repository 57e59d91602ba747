// Tests of dilated attention's dropout numbering (docs/dilated-attention.md, "dropout"): each
// pair draws from its own Philox offset and numbers element (b, h, p, m) by its global place
// ((b * H + h) * N + p) * N + m (the global variant: row j and key list index m). The masks
// are read off the output with one-hot values and checked against Philox computed here; the
// backward in pieces and a sequence split into blocks (the numbering the sequence-parallel
// code uses, nn::block_dropout_indexing) draw the very same mask.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/backend.h"
#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/attention_split.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

using nn::AttentionCallContext;
using nn::DilatedAttentionOptions;
using nn::DilationVariant;
using nn::HeadMixing;
using nn::OffsetRule;

constexpr uint64_t kSeed = 0x5851f42d4c957f2dull;
constexpr double kDropout = 0.35;

DilatedAttentionOptions options(std::vector<int64_t> w, std::vector<int64_t> r) {
  DilatedAttentionOptions o;
  o.segment_lengths = std::move(w);
  o.dilation_rates = std::move(r);
  o.dropout = kDropout;
  o.path = nn::AttentionPath::kMath;
  return o;
}

// q, k random, v one-hot (v[b, n, h] = e_n, D = N): out[b, p, h, c] is the (merged) weight of
// key c, zero exactly where no pair keeps it.
struct OneHot {
  Tensor q, k, v;
};

OneHot one_hot_inputs(int64_t batch, int64_t seq, int64_t heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Shape shape{batch, seq, heads, seq};
  RefArray v = RefArray::filled(shape, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < seq; ++n) {
      for (int64_t h = 0; h < heads; ++h) v.at({b, n, h, n}) = 1.0;
    }
  }
  return {from_ref(random_values(shape, Domain::kAny, DType::kFloat64, rng), DType::kFloat64),
          from_ref(random_values(shape, Domain::kAny, DType::kFloat64, rng), DType::kFloat64),
          from_ref(v, DType::kFloat64)};
}

// The first head of each of G groups of H heads, extra heads to the first or last groups.
int64_t group_of(int64_t h, int64_t heads, int64_t groups, bool extra_to_first) {
  const int64_t base = heads / groups, extra = heads % groups;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const bool more = extra_to_first ? g < extra : g >= groups - extra;
    const int64_t size = base + (more ? 1 : 0);
    if (h < start + size) return g;
    start += size;
  }
  return groups - 1;
}

// Whether the fixed variant's pair (w, r) with base offset o selects position p.
bool selects(int64_t p, int64_t w, int64_t r, int64_t o, OffsetRule rule) {
  const int64_t s = p / w;
  const int64_t o_s = rule == OffsetRule::kConstant ? o : (o + s) % r;
  const int64_t t = p - s * w - o_s;
  return t >= 0 && t % r == 0;
}

// Whether the mask keeps number n of pair i (offset i * B * H * N * N from a fresh generator).
bool keeps(int64_t pair, uint64_t per_pair, uint64_t n) {
  return dropout_keeps(kSeed, static_cast<uint64_t>(pair) * per_pair, kDropout, n);
}

// Whether out[b, p, h, c] of the fixed variant may be non-zero: some pair of head h selects p
// and c in one segment, c is visible (causal) and the pair's mask keeps (b, h, p, c).
bool fixed_keeps(const DilatedAttentionOptions& o, const Shape& shape, int64_t b, int64_t p,
                 int64_t h, int64_t c) {
  const int64_t n = shape[1], heads = shape[2];
  const auto pairs = static_cast<int64_t>(o.segment_lengths.size());
  const uint64_t per_pair = static_cast<uint64_t>(shape[0] * heads * n * n);
  const uint64_t number = static_cast<uint64_t>(((b * heads + h) * n + p) * n + c);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t w = o.segment_lengths[i], r = o.dilation_rates[i];
    int64_t base_offset = h % r;
    if (o.mixing == HeadMixing::kHeadGroups) {
      if (group_of(h, heads, pairs, /*extra_to_first=*/true) != i) continue;
      base_offset = i % r;
    }
    const bool visible = selects(p, w, r, base_offset, o.offset_rule) &&
                         selects(c, w, r, base_offset, o.offset_rule) && p / w == c / w &&
                         (!o.causal || c <= p);
    if (visible && keeps(i, per_pair, number)) return true;
  }
  return false;
}

// The global variant: head h of group i reads row j over the key list P (P[m] = o + r (m mod
// |base|)); out[b, j, h, c] may be non-zero when the mask keeps some (b, h, j, m), P[m] = c.
bool global_keeps(const DilatedAttentionOptions& o, const Shape& shape, int64_t b, int64_t j,
                  int64_t h, int64_t c) {
  const int64_t n = shape[1], heads = shape[2];
  const auto pairs = static_cast<int64_t>(o.dilation_rates.size());
  const uint64_t per_pair = static_cast<uint64_t>(shape[0] * heads * n * n);
  const int64_t i = group_of(h, heads, pairs, /*extra_to_first=*/false);
  const int64_t r = o.dilation_rates[i], offset = i % r, listed = (n - offset + r - 1) / r;
  for (int64_t m = 0; m < n && (!o.causal || m <= j); ++m) {
    if (offset + r * (m % listed) != c) continue;
    if (keeps(i, per_pair, static_cast<uint64_t>(((b * heads + h) * n + j) * n + m))) return true;
  }
  return false;
}

struct MaskCase {
  std::string name;
  Shape shape;  // [B, N, H]; D = N
  DilatedAttentionOptions options;
};

void PrintTo(const MaskCase& c, std::ostream* os) { *os << c.name; }

DilatedAttentionOptions with(DilatedAttentionOptions o, DilationVariant variant, HeadMixing mixing,
                             OffsetRule rule, bool causal) {
  o.variant = variant;
  o.mixing = mixing;
  o.offset_rule = rule;
  o.causal = causal;
  return o;
}

std::vector<MaskCase> mask_cases() {
  constexpr auto kFixed = DilationVariant::kSegmentLocal;
  constexpr auto kGroups = HeadMixing::kHeadGroups;
  return {
      {"GroupsConstant", {2, 16, 2}, with(options({16, 8}, {1, 2}), kFixed, kGroups, OffsetRule::kConstant, false)},
      {"GroupsRaggedRotatingCausal", {1, 13, 3}, with(options({4, 8}, {2, 4}), kFixed, kGroups, OffsetRule::kRotating, true)},
      {"AllHeads", {2, 12, 3}, with(options({4, 12}, {1, 3}), kFixed, HeadMixing::kAllHeads, OffsetRule::kConstant, false)},
      {"AllHeadsRotatingCausal", {1, 14, 2}, with(options({6, 14}, {2, 7}), kFixed, HeadMixing::kAllHeads, OffsetRule::kRotating, true)},
      {"Global", {2, 16, 3}, with(options({8, 8}, {1, 2}), DilationVariant::kGlobal, kGroups, OffsetRule::kConstant, false)},
      {"GlobalCausal", {1, 15, 2}, with(options({8, 9}, {2, 3}), DilationVariant::kGlobal, kGroups, OffsetRule::kConstant, true)},
  };
}

class DilatedDropoutMask : public ::testing::TestWithParam<MaskCase> {};

TEST_P(DilatedDropoutMask, IsNumberedByGlobalPositionWithOneOffsetPerPair) {
  const MaskCase& c = GetParam();
  const int64_t batch = c.shape[0], n = c.shape[1], heads = c.shape[2];
  const OneHot in = one_hot_inputs(batch, n, heads, 31);
  Generator gen(kSeed);
  const RefArray out = to_ref(nn::dilated_attention(in.q, in.k, in.v, c.options, {true, &gen}));
  const bool global = c.options.variant == DilationVariant::kGlobal;
  int64_t wrong = 0, kept = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t key = 0; key < n; ++key) {
          const bool want = global ? global_keeps(c.options, c.shape, b, p, h, key)
                                   : fixed_keeps(c.options, c.shape, b, p, h, key);
          const bool got = out.at({b, p, h, key}) != 0.0;
          wrong += want != got;
          kept += got;
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << out.numel() << " elements (" << kept << " kept)";
  EXPECT_GT(kept, 0);
  // One advance per pair of B * H * N * N numbers.
  const auto pairs = static_cast<uint64_t>(c.options.dilation_rates.size());
  EXPECT_EQ(gen.state().offset, pairs * static_cast<uint64_t>(batch * heads * n * n));
}

INSTANTIATE_TEST_SUITE_P(Cases, DilatedDropoutMask, ::testing::ValuesIn(mask_cases()),
                         [](const ::testing::TestParamInfo<MaskCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------
// The same mask, however the work is cut.

struct Grads {
  RefArray out, q, k, v;
};

// Forward and backward of sum(out * w) in float64 with dropout, from a fresh generator.
Grads forward_backward(const Tensor& q0, const Tensor& k0, const Tensor& v0,
                       const DilatedAttentionOptions& o, int64_t piece_elements) {
  Tensor q = q0.detach(), k = k0.detach(), v = v0.detach();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  Generator gen(kSeed);
  AttentionCallContext context{true, &gen};
  context.backward_piece_elements = piece_elements;
  const Tensor out = nn::dilated_attention(q, k, v, o, context);
  std::mt19937_64 rng(32);
  const Tensor w = from_ref(random_values(out.shape(), Domain::kAny, DType::kFloat64, rng),
                            DType::kFloat64);
  autograd::backward({out}, {w});
  return {to_ref(out), to_ref(q.grad()), to_ref(k.grad()), to_ref(v.grad())};
}

// The backward runs each call in pieces of whole segments when asked (one segment a piece
// here); with dropout each piece numbers its mask by global position, so the gradients are
// the whole call's.
TEST(DilatedDropoutPieces, BackwardInPiecesGivesTheSameGradients) {
  for (const MaskCase& c : mask_cases()) {
    if (c.options.variant == DilationVariant::kGlobal) continue;  // no pieces there
    SCOPED_TRACE(c.name);
    std::mt19937_64 rng(33);
    const Shape shape{c.shape[0], c.shape[1], c.shape[2], 8};
    Tensor t[3];
    for (Tensor& x : t) {
      x = from_ref(random_values(shape, Domain::kAny, DType::kFloat64, rng), DType::kFloat64);
    }
    const Grads whole = forward_backward(t[0], t[1], t[2], c.options, int64_t{1} << 40);
    const Grads pieces = forward_backward(t[0], t[1], t[2], c.options, 1);
    const Tolerance tol{1e-12, 1e-12};
    EXPECT_TRUE(values_close(whole.out, pieces.out, {0.0, 0.0}));
    EXPECT_TRUE(values_close(whole.q, pieces.q, tol));
    EXPECT_TRUE(values_close(whole.k, pieces.k, tol));
    EXPECT_TRUE(values_close(whole.v, pieces.v, tol));
  }
}

// A sequence cut into `blocks` equal blocks, each (query block, key block) run as the
// planner's BlockCalls numbered by nn::block_dropout_indexing (what the sequence-parallel
// code does on each rank) and merged through the LSE, equals the one-device result.
RefArray by_blocks(const Tensor& q, const Tensor& k, const Tensor& v,
                   const DilatedAttentionOptions& o, int64_t blocks) {
  const int64_t batch = q.size(0), n = q.size(1), heads = q.size(2);
  const TensorOptions f64 = TensorOptions(DType::kFloat64);
  const double inf = std::numeric_limits<double>::infinity();
  Tensor acc_out = zeros(q.shape(), f64), acc_lse = full({batch, heads, n}, -inf, f64);
  Generator gen(kSeed);  // as each rank holds one
  const std::vector<uint64_t> pair_offsets = nn::draw_dropout_pair_offsets(
      gen, static_cast<int>(o.dilation_rates.size()), batch, heads, n);
  const int64_t size = n / blocks;
  for (int64_t a = 0; a < blocks; ++a) {
    const nn::Block qb{a * size, (a + 1) * size};
    for (int64_t c = 0; c < blocks; ++c) {
      const nn::Block kb{c * size, (c + 1) * size};
      for (const nn::BlockCall& call : nn::plan_block_calls(o, n, heads, qb, kb)) {
        const Tensor part_out = zeros(q.shape(), f64), part_lse = full({batch, heads, n}, -inf, f64);
        kernels::AttentionForwardArgs args;
        args.q = kernel_view(nn::select_bnhd(q.narrow(1, qb.begin, size), call.q));
        args.k = kernel_view(nn::select_bnhd(k.narrow(1, kb.begin, size), call.k));
        args.v = kernel_view(nn::select_bnhd(v.narrow(1, kb.begin, size), call.k));
        args.out = kernel_view(nn::select_bnhd(part_out.narrow(1, qb.begin, size), call.q));
        args.lse = kernel_view(nn::select_bhn(part_lse.narrow(2, qb.begin, size), call.q));
        args.params.scale = 1 / std::sqrt(static_cast<double>(q.size(3)));
        args.params.causal = call.causal;
        args.params.dropout = o.dropout;
        args.params.seed = kSeed;
        args.params.offset = pair_offsets[static_cast<size_t>(call.pair)];
        args.params.dropout_indexing = nn::block_dropout_indexing(call, qb, kb, n, heads);
        backend_for(Device::cpu()).attention_forward(kernels::AttentionKernel::kMath, args);
        attention_merge_(acc_out, acc_lse, part_out, part_lse);
      }
    }
  }
  return to_ref(acc_out);
}

TEST(DilatedDropoutBlocks, BlocksOfASplitSequenceDrawTheOneDeviceMask) {
  for (const MaskCase& c : mask_cases()) {
    if (c.options.variant == DilationVariant::kGlobal) continue;  // not split by blocks
    for (int64_t blocks : {2, 4}) {
      SCOPED_TRACE(c.name + " in " + std::to_string(blocks) + " blocks");
      const int64_t n = c.shape[1] / blocks * blocks;  // whole blocks
      const OneHot in = one_hot_inputs(c.shape[0], n, c.shape[2], 34);
      Generator gen(kSeed);
      const RefArray one_device =
          to_ref(nn::dilated_attention(in.q, in.k, in.v, c.options, {true, &gen}));
      EXPECT_TRUE(values_close(one_device, by_blocks(in.q, in.k, in.v, c.options, blocks),
                               {1e-12, 1e-12}));
    }
  }
}

TEST(DilatedDropoutNumbering, CountersPerPairRefuseWhatPassesTwoToThe64) {
  EXPECT_EQ(nn::dropout_counters_per_pair(2, 3, 5), uint64_t{2 * 3 * 5 * 5});
  EXPECT_EQ(nn::dropout_counters_per_pair(1, 1, int64_t{1} << 31), uint64_t{1} << 62);
  try {
    nn::dropout_counters_per_pair(1, 16, int64_t{1} << 31);  // 2^66
    ADD_FAILURE() << "2^66 counters were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnimplemented);
    EXPECT_NE(std::string(e.what()).find("H = 16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rd::test
