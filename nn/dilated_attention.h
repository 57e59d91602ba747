// Dilated attention (LongNet-style) on one device: the options and the functional form.
// The exact semantics, with worked examples, are in docs/dilated-attention.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ringdilated/kernels/attention.h"
#include "ringdilated/nn/pattern_cache.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Where dilation applies: inside each segment (the fixed variant, recommended) or over the
// whole sequence (the original hybrid implementation, kept for comparison only).
enum class DilationVariant { kSegmentLocal, kGlobal };

// How heads use the (segment length, dilation rate) pairs: each group of heads one pair (the
// original library), or every head every pair, merged through the log-sum-exp (the paper).
enum class HeadMixing { kHeadGroups, kAllHeads };

// Offsets of the fixed variant: the same offset in every segment, or one that rotates with
// the segment index.
enum class OffsetRule { kConstant, kRotating };

// Which implementation computes attention: one of the kernels of kernels/attention.h (the
// values ARE kernels::AttentionKernel's, so a path other than kAuto converts to its kernel
// and back without a table), or kAuto, which chooses per call (device and compute
// capability, dtype, head dim, shapes, cuDNN at run time). A forced kernel falls back to the
// next slower one (cuDNN -> flash -> math) when it cannot run, logging the reason once. The
// environment variable RD_ATTENTION_PATH (auto|cudnn|flash|math) overrides kAuto.
enum class AttentionPath : uint8_t {
  kMath = static_cast<uint8_t>(kernels::AttentionKernel::kMath),
  kFlash = static_cast<uint8_t>(kernels::AttentionKernel::kFlash),
  kCudnn = static_cast<uint8_t>(kernels::AttentionKernel::kCudnn),
  kAuto = 0xff,
};

// The path that is `kernel`, and the kernel a path other than kAuto is.
constexpr AttentionPath path_of(kernels::AttentionKernel kernel) {
  return static_cast<AttentionPath>(kernel);
}
constexpr kernels::AttentionKernel kernel_of(AttentionPath path) {
  return static_cast<kernels::AttentionKernel>(path);
}

const char* path_name(AttentionPath path);

struct DilatedAttentionOptions {
  std::vector<int64_t> segment_lengths{2048, 4096, 8192};
  std::vector<int64_t> dilation_rates{1, 2, 4};
  DilationVariant variant = DilationVariant::kSegmentLocal;
  HeadMixing mixing = HeadMixing::kHeadGroups;
  OffsetRule offset_rule = OffsetRule::kConstant;
  bool causal = false;
  double dropout = 0.0;         // attention-probability dropout, applied only in training
  std::optional<double> scale;  // default 1 / sqrt(head_dim)
  // Visit keys in Hilbert-curve order inside each segment (the whole cycled list for the
  // global variant): the same result up to rounding, and with dropout the same mask. Only
  // the math kernels visit keys out of storage order, so kAuto then runs the math path.
  bool use_hilbert = false;
  AttentionPath path = AttentionPath::kAuto;
};

// The attention kernel calls one dilated-attention call ran, forward and backward, by path:
// what tests and profiles read to see which kernels served it. Counts are added to.
struct AttentionCallCounts {
  struct Calls {
    int64_t cudnn = 0, flash = 0, math = 0;
    int64_t over_pieces = 0;  // of them, calls over document pieces (one call for many)
  };
  Calls forward, backward;
};

class RankPlanCache;  // nn/rank_plan_cache.h

// Per-call state that is not an option: training mode, the dropout generator (required
// when training with dropout > 0; it is advanced by the counters the masks use) and the
// cache of index patterns (cycled lists, Hilbert orders) to use; nullptr: the global one.
struct AttentionCallContext {
  bool training = false;
  Generator* generator = nullptr;
  PatternCache* patterns = nullptr;
  // Where the fixed variant keeps its rank plans (nn/rank_plan_cache.h): a call planned
  // before (the same options, layout and documents: another layer, the recomputed forward)
  // reuses its plan. Null: every call plans anew.
  RankPlanCache* plans = nullptr;
  // The fixed variant's backward runs each attention call in pieces of whole segments of at
  // most this many q elements, bounding the kernels' per-call workspace (cuDNN's float32 dQ
  // accumulator is twice the piece's q); with dropout the pieces draw the call's mask. Must
  // be >= 1.
  int64_t backward_piece_elements = int64_t{1} << 26;
  // Document masks for packed sequences: per batch row, the global positions where its
  // documents start (strictly increasing, the first 0). A query attends only keys of its own
  // document (intersected with the pattern and the causal mask; docs/dilated-attention.md).
  // Null, or empty rows: one document per row. Segment-local variant only.
  const std::vector<std::vector<int64_t>>* document_starts = nullptr;
  // Where to count the kernel calls (forward, and the backward when it runs), or null. Must
  // outlive the backward; one per rank when ranks are threads.
  AttentionCallCounts* counts = nullptr;
};

// Per batch row, the global positions where its documents start (see
// AttentionCallContext::document_starts).
using DocumentStarts = std::vector<std::vector<int64_t>>;

struct DilatedAttentionResult {
  Tensor out;  // [B, N, H, D], q's dtype
  Tensor lse;  // float32 [B, H, N]; -inf where a position attended to no key
  // The path that computed it, after any fallback (the slowest one when calls differed).
  AttentionPath path_used = AttentionPath::kMath;
};

// q: [B, N, H, D]; k, v: [B, N, H_kv, D] with H_kv dividing H (grouped-query attention:
// query head h reads key/value head h / (H / H_kv); H_kv = 1 is multi-query attention); one
// floating dtype and device, any strides. Differentiable in q, k and v (through out and lse);
// a shared key/value head's gradient sums those of the query heads that read it.
DilatedAttentionResult dilated_attention_with_lse(const Tensor& q, const Tensor& k,
                                                  const Tensor& v,
                                                  const DilatedAttentionOptions& options,
                                                  const AttentionCallContext& context = {});

// The output only.
Tensor dilated_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const DilatedAttentionOptions& options,
                         const AttentionCallContext& context = {});

// The same attention on q, k and v packed as one [B, N, 3, H, D] tensor (q, k, v at index
// 0, 1, 2 of dim 2, e.g. a QKV projection's output viewed so): differentiable in `qkv`, whose
// gradient is built in one packed buffer, where three separate q/k/v selections of it would
// each materialize a gradient of the whole packed tensor.
DilatedAttentionResult dilated_attention_qkv_with_lse(const Tensor& qkv,
                                                      const DilatedAttentionOptions& options,
                                                      const AttentionCallContext& context = {});

// Throws rd::Error naming `op` and the argument unless q, k and v are defined floating
// [B, N, H, D] tensors (`layout` names that shape in the message) of one dtype and device, k
// and v of one shape with H_kv heads dividing q's H (otherwise q's shape).
void check_qkv_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op,
                      const char* layout);

// Throws rd::Error (kInvalidArgument) naming the offending option and values unless the
// options are valid for `num_heads` heads: equal, non-empty pair lists, w_i >= 1, r_i >= 1,
// w_i % r_i == 0, dropout in [0, 1), a finite positive scale, H >= G for head groups, and
// head groups for the global variant.
void validate_options(const DilatedAttentionOptions& options, int64_t num_heads);

}  // namespace rd::nn
