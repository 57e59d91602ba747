// Dilated attention on one device (see dilated_attention.h and docs/dilated-attention.md):
// validates the options, plans the attention calls (each a strided selection of q, k, v,
// out and lse, so nothing is gathered for the fixed variant), runs them through the device's
// attention kernels with path selection and fallback, and records one autograd node.
#include "ringdilated/nn/dilated_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/attention_path.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/nn/hilbert.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using kernels::AttentionKernel;
using kernels::AttentionParams;

constexpr const char* kOp = "dilated_attention";
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

kernels::StridedView view_of(const Tensor& t) { return kernel_view(t, kOp); }

// ---------------------------------------------------------------------------------------
// Execution.

// One planned call: its selection, the Philox offset of its pair's dropout mask and, with
// use_hilbert, the order its queries visit the selection's keys in.
struct PlannedCall {
  Selection sel;
  uint64_t dropout_offset = 0;  // of the pair (set by the forward, which draws the offsets)
  int pair = 0;  // which (w, r) pair (for the merge of all-heads mixing)
  Tensor key_order;  // int64 [sel.n] on the inputs' device, or undefined: natural order
};

struct Plan {
  std::vector<PlannedCall> calls;
  int num_pairs = 0;
  bool merged = false;  // all-heads mixing: per-pair partials merged through the LSE
};

Plan plan_fixed(const DilatedAttentionOptions& o, int64_t seq_len, int64_t num_heads,
                Device device, PatternCache& cache) {
  Plan plan;
  plan.num_pairs = static_cast<int>(o.segment_lengths.size());
  plan.merged = o.mixing == HeadMixing::kAllHeads;
  for (int i = 0; i < plan.num_pairs; ++i) {
    const int64_t w = o.segment_lengths[i], r = o.dilation_rates[i];
    for (const auto& [heads, offset] : fixed_pair_heads(o, num_heads, i)) {
      for (const Selection& s : fixed_selections(seq_len, w, r, heads, offset, o.offset_rule)) {
        plan.calls.push_back(
            {s, 0, i, o.use_hilbert ? hilbert_indices(cache, s.n, device) : Tensor()});
      }
    }
  }
  return plan;
}

struct Inputs {
  Tensor q, k, v;  // detached
  AttentionParams params;
  std::vector<AttentionKernel> kernels;
  bool forced = false;
  int64_t backward_piece_elements = 0;
};

const int64_t* key_order_data(const Tensor& key_order) {
  return key_order.defined() ? static_cast<const int64_t*>(view_of(key_order).data) : nullptr;
}

AttentionForwardArgs forward_args(const Inputs& in, const PlannedCall& call, const Tensor& out,
                                  const Tensor& lse) {
  const Selection& s = call.sel;
  AttentionForwardArgs a;
  a.q = view_of(select_bnhd(in.q, s));
  a.k = view_of(select_bnhd(in.k, s));
  a.v = view_of(select_bnhd(in.v, s));
  a.out = view_of(select_bnhd(out, s));
  a.lse = view_of(select_bhn(lse, s));
  a.params = in.params;
  if (in.params.dropout > 0) {
    // Numbered by global position: a piece of the call (or another split) draws its mask.
    a.params.offset += call.dropout_offset;
    a.params.dropout_indexing = dropout_indexing(s, s, in.q.size(1), in.q.size(2));
  }
  a.params.key_order = key_order_data(call.key_order);
  return a;
}


// The forward pass of the fixed variant. Returns out (q's dtype) and lse.
std::pair<Tensor, Tensor> fixed_forward(const Inputs& in, Plan& plan, Generator* generator,
                                        AttentionPath* path_used) {
  const Tensor& q = in.q;
  const int64_t batch = q.size(0), seq_len = q.size(1), heads = q.size(2);
  kernels::KernelBackend& backend = backend_for(q.device());
  // Partials and LSEs in the accumulation type: float32, float64 for float64 inputs.
  const TensorOptions acc_options =
      TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device());
  AttentionKernel slowest = AttentionKernel::kCudnn;
  if (in.params.dropout > 0) {
    const std::vector<uint64_t> offsets =
        draw_dropout_pair_offsets(*generator, plan.num_pairs, batch, heads, seq_len);
    for (PlannedCall& call : plan.calls) {
      call.dropout_offset = offsets[static_cast<size_t>(call.pair)];
    }
  }
  auto run_call = [&](const PlannedCall& call, const Tensor& out, const Tensor& lse) {
    const AttentionForwardArgs args = forward_args(in, call, out, lse);
    const AttentionKernel used =
        run_with_fallback(backend, in.kernels, args, /*backward=*/nullptr, in.forced, kOp,
                          [&](AttentionKernel k) { backend.attention_forward(k, args); });
    slowest = slower(slowest, used);
  };

  Tensor out, lse;
  if (!plan.merged) {
    // Head groups: every (position, head) belongs to at most one call, which writes it.
    out = zeros({batch, seq_len, heads, q.size(3)}, TensorOptions(q.dtype()).with_device(q.device()));
    lse = full({batch, heads, seq_len}, kNegInf, acc_options);
    for (const PlannedCall& call : plan.calls) run_call(call, out, lse);
  } else {
    // All heads: each pair's partial in q's dtype (what every kernel, cuDNN included,
    // writes; rounded once), merged through the LSE into a float32 accumulator.
    Tensor acc_out = zeros({batch, seq_len, heads, q.size(3)}, acc_options);
    Tensor acc_lse = full({batch, heads, seq_len}, kNegInf, acc_options);
    Tensor out_i = empty(acc_out.shape(), TensorOptions(q.dtype()).with_device(q.device()));
    Tensor lse_i = empty(acc_lse.shape(), acc_options);
    for (int pair = 0; pair < plan.num_pairs; ++pair) {
      out_i.zero_();
      lse_i.fill_(kNegInf);
      for (const PlannedCall& call : plan.calls) {
        if (call.pair == pair) run_call(call, out_i, lse_i);
      }
      attention_merge_(acc_out, acc_lse, out_i, lse_i);
    }
    out = acc_out.to(q.dtype()).contiguous();
    lse = acc_lse.contiguous();
  }
  *path_used = path_of(slowest);
  return {out, lse};
}

// ---------------------------------------------------------------------------------------
// Gradients.

// Where the backward adds the gradients of q, k and v: zero-filled buffers of the gradient
// dtype, either three [B, N, H, D] tensors or the q/k/v selections of one [B, N, 3, H, D]
// tensor when the inputs came packed (then no gradient-sized copy is ever made to pack them).
struct GradBuffers {
  Tensor packed;            // [B, N, 3, H, D], or undefined
  std::vector<Tensor> qkv;  // [B, N, H, D] each
};

GradBuffers zero_grads(const Shape& bnhd, DType dtype, Device device, bool packed) {
  const TensorOptions opts = TensorOptions(dtype).with_device(device);
  GradBuffers g;
  if (packed) {
    g.packed = zeros({bnhd[0], bnhd[1], 3, bnhd[2], bnhd[3]}, opts);
    for (int64_t i = 0; i < 3; ++i) g.qkv.push_back(g.packed.select(2, i));
  } else {
    for (int i = 0; i < 3; ++i) g.qkv.push_back(zeros(bnhd, opts));
  }
  return g;
}

// The gradients of the autograd inputs (q, k, v; or the packed qkv) in their dtype.
std::vector<Tensor> input_grads(const GradBuffers& g, DType dtype) {
  if (g.packed.defined()) return {g.packed.to(dtype)};
  return {g.qkv[0].to(dtype), g.qkv[1].to(dtype), g.qkv[2].to(dtype)};
}

// The tensors the autograd node differentiates: q, k and v, or the packed qkv they are
// selections of.
struct Differentiated {
  std::vector<Tensor> inputs;
  bool packed = false;
};

// The backward of a call in pieces of whole segments, each of at most `piece_elements` q
// elements (AttentionCallContext::backward_piece_elements): cuDNN's backward takes a float32
// dQ workspace twice the size of its q, which for one large call would sit on top of the
// memory peak. With dropout too: a piece numbers its mask by global position, as the call.
std::vector<PlannedCall> backward_pieces(const PlannedCall& call, int64_t batch, int64_t head_dim,
                                         int64_t piece_elements) {
  const Selection& s = call.sel;
  const int64_t per_segment = batch * s.hc * s.n * head_dim;
  if (per_segment * s.segments <= piece_elements) return {call};
  const int64_t segments_per_piece = std::max<int64_t>(1, piece_elements / per_segment);
  std::vector<PlannedCall> pieces;
  for (int64_t first = 0; first < s.segments; first += segments_per_piece) {
    PlannedCall piece = call;
    piece.sel.p0 = s.p0 + first * s.ss;
    piece.sel.segments = std::min(segments_per_piece, s.segments - first);
    pieces.push_back(piece);
  }
  return pieces;
}

// Gradients of the fixed variant: each call's share, added into `grads` (zeros). `out` and
// `lse` are the final (merged) results, which is what makes each share exact under
// all-heads mixing.
void fixed_backward(const Inputs& in, const Plan& plan, const Tensor& out, const Tensor& lse,
                    const Tensor& grad_out, const Tensor& grad_lse, const GradBuffers& grads) {
  kernels::KernelBackend& backend = backend_for(in.q.device());
  std::vector<PlannedCall> pieces;
  for (const PlannedCall& call : plan.calls) {
    for (const PlannedCall& piece :
         backward_pieces(call, in.q.size(0), in.q.size(3), in.backward_piece_elements)) {
      pieces.push_back(piece);
    }
  }
  for (const PlannedCall& call : pieces) {
    const Selection& s = call.sel;
    const AttentionForwardArgs fwd = forward_args(in, call, out, lse);
    AttentionBackwardArgs b = backward_args(
        kOp, fwd, select_bnhd(grad_out, s), grad_lse.defined() ? select_bhn(grad_lse, s) : Tensor(),
        select_bnhd(grads.qkv[0], s), select_bnhd(grads.qkv[1], s), select_bnhd(grads.qkv[2], s));
    b.grads_start_at_zero = !plan.merged;  // head groups: disjoint selections of zeros
    run_with_fallback(backend, in.kernels, fwd, &b, in.forced, kOp,
                      [&](AttentionKernel k) { backend.attention_backward(k, b); });
  }
}

// ---------------------------------------------------------------------------------------
// The original (global) variant: gathered copies along the cycled index list.

// P[j] = o + r * (j mod |base|) for j < N, base = (o, o + r, ... < N): cached per key.
Tensor cycled_indices(PatternCache& cache, int64_t seq_len, int64_t r, int64_t o, Device device) {
  const std::string key = str_cat("cycled/N=", seq_len, "/r=", r, "/o=", o, "/", device.str());
  return cache.get(key, [&] {
    const int64_t base = (seq_len - o + r - 1) / r;
    std::vector<int64_t> p(static_cast<size_t>(seq_len));
    for (int64_t j = 0; j < seq_len; ++j) p[static_cast<size_t>(j)] = o + r * (j % base);
    return from_vector<int64_t>(p, {seq_len}).to(device);
  });
}

struct GlobalGroup {
  int pair = 0;
  Heads heads;
  Tensor indices;    // int64 [N]
  Tensor key_order;  // int64 [N] Hilbert order of the gathered keys, or undefined
};

std::vector<GlobalGroup> global_groups(const DilatedAttentionOptions& o, int64_t seq_len,
                                       int64_t num_heads, Device device, PatternCache& cache) {
  const int64_t pairs = static_cast<int64_t>(o.dilation_rates.size());
  const std::vector<Heads> groups = head_groups(num_heads, pairs, /*extra_to_first=*/false);
  std::vector<GlobalGroup> result;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = o.dilation_rates[i];
    if (groups[i].hc == 0) continue;
    result.push_back({static_cast<int>(i), groups[i],
                      cycled_indices(cache, seq_len, r, i % r, device),
                      o.use_hilbert ? hilbert_indices(cache, seq_len, device) : Tensor()});
  }
  return result;
}

// [B, hc, N, D] attention layout of the gathered rows of t's heads.
Tensor gathered(const Tensor& t, const GlobalGroup& g) {
  return index_select(t.narrow(2, g.heads.h0, g.heads.hc), 1, g.indices).permute({0, 2, 1, 3});
}

AttentionForwardArgs global_args(const Inputs& in, const GlobalGroup& g, const Tensor& out,
                                 const Tensor& lse, std::vector<Tensor>* keep) {
  keep->push_back(gathered(in.q, g));
  keep->push_back(gathered(in.k, g));
  keep->push_back(gathered(in.v, g));
  AttentionForwardArgs a;
  a.q = view_of((*keep)[keep->size() - 3]);
  a.k = view_of((*keep)[keep->size() - 2]);
  a.v = view_of((*keep)[keep->size() - 1]);
  a.out = view_of(out.narrow(2, g.heads.h0, g.heads.hc).permute({0, 2, 1, 3}));
  a.lse = view_of(lse.narrow(1, g.heads.h0, g.heads.hc));
  a.params = in.params;
  a.params.key_order = key_order_data(g.key_order);
  if (in.params.dropout > 0) {
    a.params.dropout_indexing =
        global_dropout_indexing(g.heads.h0, /*first_row=*/0, in.q.size(1), in.q.size(2));
  }
  return a;
}

}  // namespace

void check_qkv_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op,
                      const char* layout) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    RD_CHECK(t->defined(), kInvalidArgument, op, ": argument '", name, "' is undefined");
    RD_CHECK(t->dim() == 4, kShapeMismatch, op, ": argument '", name, "' must be ", layout,
             ", got shape ", shape_str(t->shape()));
    RD_CHECK(is_floating(t->dtype()), kDTypeMismatch, op, ": argument '", name,
             "' must be floating, got ", dtype_name(t->dtype()));
  }
  RD_CHECK(k.shape() == q.shape() && v.shape() == q.shape(), kShapeMismatch, op,
           ": q, k and v must have one shape, got ", shape_str(q.shape()), ", ",
           shape_str(k.shape()), " and ", shape_str(v.shape()));
  RD_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(), kDTypeMismatch, op,
           ": q, k and v must have one dtype, got ", dtype_name(q.dtype()), ", ",
           dtype_name(k.dtype()), " and ", dtype_name(v.dtype()));
  check_same_device({&q, &k, &v}, op);
}

void validate_options(const DilatedAttentionOptions& o, int64_t num_heads) {
  const size_t pairs = o.segment_lengths.size();
  RD_CHECK(pairs > 0 && pairs == o.dilation_rates.size(), kInvalidArgument, kOp,
           ": options 'segment_lengths' (", pairs, " values) and 'dilation_rates' (",
           o.dilation_rates.size(), " values) must be non-empty and of equal length");
  for (size_t i = 0; i < pairs; ++i) {
    const int64_t w = o.segment_lengths[i], r = o.dilation_rates[i];
    RD_CHECK(w >= 1 && r >= 1 && w % r == 0, kInvalidArgument, kOp, ": pair ", i,
             " (segment_lengths[", i, "] = ", w, ", dilation_rates[", i, "] = ", r,
             ") needs w >= 1, r >= 1 and w % r == 0");
  }
  RD_CHECK(o.dropout >= 0 && o.dropout < 1, kInvalidArgument, kOp,
           ": option 'dropout' must be in [0, 1), got ", o.dropout);
  RD_CHECK(!o.scale.has_value() || (std::isfinite(*o.scale) && *o.scale > 0), kInvalidArgument,
           kOp, ": option 'scale' must be finite and positive, got ", o.scale.value_or(0.0));
  RD_CHECK(o.variant != DilationVariant::kGlobal || o.mixing == HeadMixing::kHeadGroups,
           kInvalidArgument, kOp,
           ": option 'mixing' must be kHeadGroups with variant kGlobal (the original "
           "implementation it reproduces has head groups only)");
  const bool groups = o.mixing == HeadMixing::kHeadGroups || o.variant == DilationVariant::kGlobal;
  RD_CHECK(!groups || num_heads >= static_cast<int64_t>(pairs), kInvalidArgument, kOp,
           ": head groups need at least one head per pair, got ", num_heads, " heads for ",
           pairs, " pairs");
}

namespace {

// The forward of both public forms, and its one autograd node over `diff`'s inputs.
DilatedAttentionResult attend(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Differentiated& diff, const DilatedAttentionOptions& options,
                              const AttentionCallContext& context) {
  check_qkv_inputs(q, k, v, kOp, "[B, N, H, D]");
  validate_options(options, q.size(2));
  const bool dropout = context.training && options.dropout > 0;
  RD_CHECK(context.backward_piece_elements >= 1, kInvalidArgument, kOp,
           ": context's backward_piece_elements must be >= 1, got ",
           context.backward_piece_elements);
  RD_CHECK(!dropout || context.generator != nullptr, kInvalidArgument, kOp,
           ": dropout in training needs a generator in the call context");

  Inputs in{q.detach(), k.detach(), v.detach(), {}, {}, false};
  in.params.scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  in.params.causal = options.causal;
  in.params.dropout = dropout ? options.dropout : 0.0;
  if (dropout) in.params.seed = context.generator->seed();
  const AttentionPath requested = requested_path(options.path, kOp);
  in.kernels = candidate_kernels(requested, q.device());
  in.forced = requested != AttentionPath::kAuto;
  in.backward_piece_elements = context.backward_piece_elements;
  PatternCache& patterns =
      context.patterns != nullptr ? *context.patterns : global_pattern_cache();

  DilatedAttentionResult result;
  if (options.variant == DilationVariant::kSegmentLocal) {
    auto plan =
        std::make_shared<Plan>(plan_fixed(options, q.size(1), q.size(2), q.device(), patterns));
    auto [out, lse] = fixed_forward(in, *plan, context.generator, &result.path_used);
    result.out = out;
    result.lse = lse.to(DType::kFloat32);  // the internal lse keeps float64 for float64 data
    if (autograd::needs_grad(diff.inputs)) {
      autograd::record(
          {result.out, result.lse}, kOp, diff.inputs,
          [in, plan, packed = diff.packed, out = out.detach(), lse = lse.detach()](
              const std::vector<Tensor>& grads) {
            const Tensor grad_out =
                grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
            const Tensor grad_lse =
                grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
            // Head groups write disjoint elements: q's dtype is exact. Overlapping shares
            // (all heads) add up in the accumulation dtype.
            const DType dtype = plan->merged ? accumulation_dtype(out.dtype()) : out.dtype();
            const GradBuffers buffers = zero_grads(out.shape(), dtype, out.device(), packed);
            fixed_backward(in, *plan, out, lse, grad_out, grad_lse, buffers);
            return input_grads(buffers, out.dtype());
          });
    }
    return result;
  }

  // The original variant: per head group, attention over the gathered cycled rows, written to
  // row j (never scattered back). Gradients of the gathered copies are index-added back.
  const int64_t batch = q.size(0), seq_len = q.size(1), heads = q.size(2);
  kernels::KernelBackend& backend = backend_for(q.device());
  Tensor out = zeros(q.shape(), TensorOptions(q.dtype()).with_device(q.device()));
  Tensor lse = full({batch, heads, seq_len}, kNegInf,
                    TensorOptions(accumulation_dtype(q.dtype())).with_device(q.device()));
  const std::vector<GlobalGroup> groups =
      global_groups(options, seq_len, heads, q.device(), patterns);
  // One offset per pair (also for a pair whose head group is empty), as the fixed variant.
  const std::vector<uint64_t> offsets =
      dropout ? draw_dropout_pair_offsets(*context.generator,
                                          static_cast<int>(options.dilation_rates.size()), batch,
                                          heads, seq_len)
              : std::vector<uint64_t>(options.dilation_rates.size(), 0);
  AttentionKernel slowest = AttentionKernel::kCudnn;
  for (const GlobalGroup& g : groups) {
    std::vector<Tensor> keep;
    AttentionForwardArgs args = global_args(in, g, out, lse, &keep);
    args.params.offset += offsets[static_cast<size_t>(g.pair)];
    const AttentionKernel used =
        run_with_fallback(backend, in.kernels, args, /*backward=*/nullptr, in.forced, kOp,
                          [&](AttentionKernel kk) { backend.attention_forward(kk, args); });
    slowest = slower(slowest, used);
  }
  result.out = out;
  result.lse = lse.to(DType::kFloat32);
  result.path_used = path_of(slowest);
  if (autograd::needs_grad(diff.inputs)) {
    autograd::record(
        {result.out, result.lse}, kOp, diff.inputs,
        [in, groups, offsets, packed = diff.packed, out = out.detach(), lse = lse.detach()](
            const std::vector<Tensor>& grads) {
          const Tensor grad_out =
              grads[0].defined() ? grads[0].to(out.dtype()).contiguous() : zeros_like(out);
          const Tensor grad_lse =
              grads[1].defined() ? grads[1].to(lse.dtype()).contiguous() : Tensor();
          kernels::KernelBackend& be = backend_for(out.device());
          const DType acc = accumulation_dtype(out.dtype());
          const TensorOptions opts = TensorOptions(acc).with_device(out.device());
          const GradBuffers result_grads = zero_grads(out.shape(), acc, out.device(), packed);
          for (const GlobalGroup& g : groups) {
            std::vector<Tensor> keep;
            AttentionForwardArgs fwd = global_args(in, g, out, lse, &keep);
            fwd.params.offset += offsets[static_cast<size_t>(g.pair)];
            const Shape gathered_shape{out.size(0), g.heads.hc, out.size(1), out.size(3)};
            std::vector<Tensor> gathered_grads{zeros(gathered_shape, opts),
                                               zeros(gathered_shape, opts),
                                               zeros(gathered_shape, opts)};
            AttentionBackwardArgs b = backward_args(
                kOp, fwd, grad_out.narrow(2, g.heads.h0, g.heads.hc).permute({0, 2, 1, 3}),
                grad_lse.defined() ? grad_lse.narrow(1, g.heads.h0, g.heads.hc) : Tensor(),
                gathered_grads[0], gathered_grads[1], gathered_grads[2]);
            b.grads_start_at_zero = true;  // fresh zeros, one call per group
            run_with_fallback(be, in.kernels, fwd, &b, in.forced, kOp,
                              [&](AttentionKernel kk) { be.attention_backward(kk, b); });
            // Row m of a gathered copy came from position P[m]: add it back there.
            for (int t = 0; t < 3; ++t) {
              be.index_add(view_of(result_grads.qkv[t].narrow(2, g.heads.h0, g.heads.hc)), 1,
                           view_of(g.indices), view_of(gathered_grads[t].permute({0, 2, 1, 3})));
            }
          }
          return input_grads(result_grads, out.dtype());
        });
  }
  return result;
}

}  // namespace

DilatedAttentionResult dilated_attention_with_lse(const Tensor& q, const Tensor& k,
                                                  const Tensor& v,
                                                  const DilatedAttentionOptions& options,
                                                  const AttentionCallContext& context) {
  return attend(q, k, v, {{q, k, v}, false}, options, context);
}

Tensor dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const DilatedAttentionOptions& options,
                         const AttentionCallContext& context) {
  return dilated_attention_with_lse(q, k, v, options, context).out;
}

DilatedAttentionResult dilated_attention_qkv_with_lse(const Tensor& qkv,
                                                      const DilatedAttentionOptions& options,
                                                      const AttentionCallContext& context) {
  RD_CHECK(qkv.defined(), kInvalidArgument, kOp, ": argument 'qkv' is undefined");
  RD_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, kShapeMismatch, kOp,
           ": argument 'qkv' must be [B, N, 3, H, D], got shape ", shape_str(qkv.shape()));
  // The selections are computed on a detached base: the node differentiates qkv itself.
  const Tensor base = qkv.detach();
  return attend(base.select(2, 0), base.select(2, 1), base.select(2, 2), {{qkv}, true}, options,
                context);
}

}  // namespace rd::nn
