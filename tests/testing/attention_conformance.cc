// The attention conformance table, its float64 reference and its harness (see the header).
#include "testing/attention_conformance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <utility>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/attention_split.h"
#include "testing/dtype_precision.h"
#include "testing/elementwise_close.h"

namespace rd::test {

using kernels::AttentionBackwardArgs;
using kernels::AttentionForwardArgs;
using kernels::AttentionKernel;
using kernels::AttentionParams;
using kernels::StridedView;
using Shape = std::vector<int64_t>;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kF32 = DType::kFloat32, kF64 = DType::kFloat64, kBF16 = DType::kBFloat16,
                kF16 = DType::kFloat16;
constexpr DType kFloatTypes[] = {kF32, kF64, kBF16, kF16};
constexpr DType kFusedTypes[] = {kF32, kBF16, kF16};  // what the flash kernels serve

std::string tag(DType t) { return std::string(dtype_name(t)); }
std::string signed_tag(int64_t value) {
  return value < 0 ? "m" + std::to_string(-value) : "p" + std::to_string(value);
}

// ---------------------------------------------------------------------------------------
// The table. Names say what a case is; the sizes of the cases that came from the flash and
// cuDNN tests are theirs (several tiles of those kernels).

void add_math_cases(std::vector<AttentionCase>& t) {
  for (DType dt : kFloatTypes) {
    for (int64_t d : {16, 64, 128, 256, 300}) {  // 300: two passes over the keys on the GPU
      t.push_back({.name = tag(dt) + "_d" + std::to_string(d), .dtype = dt, .lq = 37, .lk = 45,
                   .d = d});
    }
  }
  const std::vector<std::pair<std::string, Shape>> batches = {
      {"no_batch", {}}, {"batch3", {3}}, {"batch2x3", {2, 3}}, {"batch2x1x3", {2, 1, 3}},
      {"batch1x2x1x2", {1, 2, 1, 2}}};
  for (const auto& [name, batch] : batches) t.push_back({.name = name, .batch = batch});
  for (DType dt : {kF32, kBF16}) {
    for (auto [lq, lk] : {std::pair{6, 10}, std::pair{10, 6}}) {
      for (int64_t offset : {0, 3, -2}) {
        t.push_back({.name = tag(dt) + "_causal_q" + std::to_string(lq) + "_k" +
                             std::to_string(lk) + "_offset" + signed_tag(offset),
                     .dtype = dt, .lq = lq, .lk = lk, .causal = true, .causal_offset = offset});
      }
    }
    for (int64_t offset : {0, 5, -7}) {
      t.push_back({.name = tag(dt) + "_causal_q40_k70_offset" + signed_tag(offset), .dtype = dt,
                   .lq = 40, .lk = 70, .causal = true, .causal_offset = offset});
    }
  }
  t.push_back({.name = "causal_every_row_masked", .lq = 37, .lk = 45, .causal = true,
               .causal_offset = -100});
  t.push_back({.name = "causal_offset_past_the_end", .causal = true, .causal_offset = 100});
  t.push_back({.name = "no_keys", .lk = 0});
  t.push_back({.name = "no_queries", .lq = 0});
  // Several CPU query blocks and key tiles (32 queries, 64 keys per tile).
  t.push_back({.name = "tiles_f32_causal", .lq = 70, .lk = 150, .causal = true, .causal_offset = 5});
  t.push_back({.name = "tiles_f16_causal_dropout", .dtype = kF16, .lq = 70, .lk = 150,
               .causal = true, .causal_offset = 5, .dropout = 0.3});
  t.push_back({.name = "tiles_f64_negative_offset", .dtype = kF64, .lq = 100, .lk = 70,
               .causal = true, .causal_offset = -40});
  t.push_back({.name = "larger_bf16", .dtype = kBF16, .batch = {2, 3}, .lq = 200, .lk = 300,
               .d = 64, .causal = true, .causal_offset = 100, .dropout = 0.1});
  t.push_back({.name = "bf16_with_float32_out_and_grads", .dtype = kBF16, .out_dtype = kF32,
               .grad_dtype = kF32});
  t.push_back({.name = "f16_with_float32_out", .dtype = kF16, .out_dtype = kF32});
  t.push_back({.name = "f64_with_float32_grads", .dtype = kF64, .grad_dtype = kF32});
  t.push_back({.name = "f32_no_lse", .lse = false});
  t.push_back({.name = "bf16_no_lse", .dtype = kBF16, .lse = false});
  t.push_back({.name = "f32_no_grad_lse", .grad_lse = false});
  t.push_back({.name = "f16_no_grad_lse_causal", .dtype = kF16, .causal = true, .grad_lse = false});
  for (DType dt : kFloatTypes) {
    t.push_back({.name = tag(dt) + "_dropout", .dtype = dt, .dropout = 0.25});
  }
  t.push_back({.name = "dropout_half_causal", .causal = true, .causal_offset = 2, .dropout = 0.5});
  t.push_back({.name = "bf16_causal_dropout_q50_k40", .dtype = kBF16, .lq = 50, .lk = 40,
               .causal = true, .causal_offset = 3, .dropout = 0.5});
  // Dropout numbered as a block of a larger call (kernels::DropoutIndexing).
  for (DType dt : {kF32, kBF16}) {
    t.push_back({.name = tag(dt) + "_dropout_custom_numbering", .dtype = dt, .batch = {2, 3},
                 .lq = 37, .lk = 45, .causal = true, .causal_offset = 4, .dropout = 0.3,
                 .scattered_numbering = true});
  }
  t.push_back({.name = "odd_d_custom_scale", .d = 3, .scale = 0.7});
  t.push_back({.name = "negative_scale", .d = 5, .scale = -0.3});
  t.push_back({.name = "strided_f32", .batch = {2, 3}, .layout = AttentionLayout::kStrided});
  t.push_back({.name = "strided_bf16_causal_dropout", .dtype = kBF16, .causal = true,
               .causal_offset = 1, .dropout = 0.2, .layout = AttentionLayout::kStrided});
  t.push_back({.name = "strided_bf16_causal_dropout_d64", .dtype = kBF16, .lq = 37, .lk = 45,
               .d = 64, .causal = true, .causal_offset = 2, .dropout = 0.2,
               .layout = AttentionLayout::kStrided});
  t.push_back({.name = "strided_f64_no_batch", .dtype = kF64, .batch = {},
               .layout = AttentionLayout::kStrided});
  for (DType dt : kFloatTypes) {
    t.push_back({.name = "dilated_" + tag(dt), .dtype = dt, .batch = {2, 2, 3}, .lq = 4, .lk = 4,
                 .layout = AttentionLayout::kDilated});
  }
  for (DType dt : {kF32, kF64, kF16}) {
    t.push_back({.name = "dilated_rows40_" + tag(dt), .dtype = dt, .batch = {2, 3, 2}, .lq = 40,
                 .lk = 40, .d = 32, .causal = dt == kF16, .layout = AttentionLayout::kDilated});
  }
  t.push_back({.name = "dilated_causal_dropout", .batch = {2, 3, 2}, .lq = 6, .lk = 6,
               .causal = true, .dropout = 0.3, .layout = AttentionLayout::kDilated});
  for (DType dt : {kF32, kBF16, kF16}) {
    t.push_back({.name = "extreme_" + tag(dt), .dtype = dt, .lq = 8, .lk = 11, .scale = 1.0,
                 .values = AttentionValues::kExtreme});
  }
  t.push_back({.name = "extreme_causal_f32", .lq = 8, .lk = 11, .scale = 1.0, .causal = true,
               .causal_offset = 1, .values = AttentionValues::kExtreme});
  // A key visiting order changes only the order of the sums: the reference ignores it.
  for (DType dt : kFloatTypes) {
    t.push_back({.name = "key_order_" + tag(dt), .dtype = dt, .key_order = true});
  }
  t.push_back({.name = "key_order_tiles_causal_dropout", .lq = 70, .lk = 150, .causal = true,
               .causal_offset = 5, .dropout = 0.3, .key_order = true});
  t.push_back({.name = "key_order_causal_negative_offset", .dtype = kF64, .lq = 100, .lk = 70,
               .causal = true, .causal_offset = -40, .key_order = true});
  t.push_back({.name = "key_order_strided_bf16_causal", .dtype = kBF16, .causal = true,
               .causal_offset = 1, .layout = AttentionLayout::kStrided, .key_order = true});
  t.push_back({.name = "key_order_bf16_causal_dropout_d300", .dtype = kBF16, .lq = 60, .lk = 90,
               .d = 300, .causal = true, .causal_offset = -4, .dropout = 0.2, .key_order = true});
  // One-hot values: the zeros of out are the dropout mask, element by element.
  t.push_back({.name = "one_hot_dropout_f64", .dtype = kF64, .batch = {3}, .lq = 20, .lk = 16,
               .dropout = 0.3, .seed = 0x0123456789abcdefull, .offset = 777,
               .values = AttentionValues::kOneHotV});
  t.push_back({.name = "one_hot_dropout_counter_crosses_2_32", .batch = {3}, .lq = 50, .lk = 40,
               .d = 48, .scale = 0.2, .dropout = 0.4, .seed = 1234567,
               .offset = 0xffffffffull - 100, .values = AttentionValues::kOneHotV});
  // Keys in two calls merged through the lse (the contract of AttentionBackwardArgs).
  for (bool causal : {false, true}) {
    t.push_back({.name = causal ? "split_keys_causal_f64" : "split_keys_f64", .dtype = kF64,
                 .lq = 7, .lk = 10, .d = 8, .causal = causal, .causal_offset = 1, .key_split = 4});
  }
}

// From the flash tests: every head-dim bucket, padded dims, offsets, views, dropout.
void add_flash_cases(std::vector<AttentionCase>& t) {
  for (DType dt : kFusedTypes) {
    for (int64_t d : {32, 64, 128, 256}) {
      const std::string name = "flash_" + tag(dt) + "_d" + std::to_string(d);
      // Two batch dims, Lq != Lk, neither a multiple of a tile.
      t.push_back({.name = name + "_dense", .dtype = dt, .batch = {2, 3}, .lq = 77, .lk = 131,
                   .d = d, .must = kFlashForward});
      // Bottom-right alignment with more keys than rows; a negative offset with fewer keys
      // than rows (rows 0..4 see nothing).
      t.push_back({.name = name + "_causal_p54", .dtype = dt, .batch = {3}, .lq = 77, .lk = 131,
                   .d = d, .causal = true, .causal_offset = 54, .must = kFlashForward});
      t.push_back({.name = name + "_causal_m5", .dtype = dt, .lq = 150, .lk = 90, .d = d,
                   .causal = true, .causal_offset = -5, .must = kFlashForward});
      // The backward's accumulation, with grad_lse, and causal without.
      t.push_back({.name = name + "_backward_grad_lse", .dtype = dt, .lq = 70, .lk = 100, .d = d,
                   .must = kFlash});
      t.push_back({.name = name + "_backward_causal_p30", .dtype = dt, .lq = 70, .lk = 100,
                   .d = d, .causal = true, .causal_offset = 30, .grad_lse = false, .must = kFlash});
    }
    // Head dims between buckets (zero-padded in shared memory; 36 and 200 are not whole
    // 16-byte chunks in 16-bit types).
    for (int64_t d : {24, 36, 72, 200}) {
      t.push_back({.name = "flash_" + tag(dt) + "_padded_d" + std::to_string(d), .dtype = dt,
                   .lq = 65, .lk = 97, .d = d, .causal = d == 72, .must = kFlashForward});
    }
    t.push_back({.name = "flash_" + tag(dt) + "_unaligned_q_reversed_k", .dtype = dt,
                 .batch = {}, .lq = 50, .lk = 70, .d = 64, .scale = 0.3,
                 .layout = AttentionLayout::kUnaligned, .must = kFlashForward});
    // A dilated selection read and written in place: segments of w = 128, rate 4, offset 1,
    // heads 1..2 of 4; float32 partial out for 16-bit inputs, as the all-heads merge asks.
    for (bool causal : {false, true}) {
      t.push_back({.name = "flash_" + tag(dt) + (causal ? "_dilated_causal" : "_dilated"),
                   .dtype = dt, .out_dtype = kF32, .batch = {2, 3, 2}, .lq = 32, .lk = 32,
                   .d = 64, .scale = 0.125, .causal = causal,
                   .layout = AttentionLayout::kDilated,
                   .dilation = {.rate = 4, .offset = 1, .heads = 4, .first_head = 1,
                                .lse_heads_last = true},
                   .must = kFlashForward});
    }
    t.push_back({.name = "flash_" + tag(dt) + "_one_hot_dropout", .dtype = dt, .batch = {3},
                 .lq = 100, .lk = 64, .d = 64, .dropout = 0.3, .seed = 0x1234abcd5678ull,
                 .offset = 977, .values = AttentionValues::kOneHotV, .must = kFlashForward});
    t.push_back({.name = "flash_" + tag(dt) + "_dropout_causal_p50", .dtype = dt,
                 .batch = {2, 2}, .lq = 90, .lk = 140, .d = 128, .causal = true,
                 .causal_offset = 50, .dropout = 0.1, .seed = 42, .offset = 1ull << 40,
                 .must = kFlashForward});
    t.push_back({.name = "flash_" + tag(dt) + "_backward_causal_dropout", .dtype = dt,
                 .lq = 80, .lk = 80, .d = 64, .causal = true, .dropout = 0.2, .seed = 7,
                 .offset = 123456789, .must = kFlash});
  }
  t.push_back({.name = "flash_bf16_every_row_masked", .dtype = kBF16, .lq = 40, .lk = 64,
               .d = 64, .causal = true, .causal_offset = -1000, .must = kFlashForward});
  t.push_back({.name = "flash_f32_no_keys", .batch = {3}, .lq = 20, .lk = 0, .d = 32,
               .must = kFlashForward});
  for (DType dt : {kBF16, kF16}) {
    t.push_back({.name = "flash_" + tag(dt) + "_float32_out_no_lse", .dtype = dt,
                 .out_dtype = kF32, .batch = {2, 2}, .lq = 100, .lk = 100, .d = 128,
                 .lse = false, .must = kFlashForward});
  }
  // Large scores: a nearly one-hot softmax must neither overflow nor lose the lse.
  t.push_back({.name = "flash_bf16_peaked_softmax", .dtype = kBF16, .lq = 64, .lk = 96, .d = 64,
               .scale = 1.0, .q_range = 2, .k_range = 2, .must = kFlashForward});
  // bf16 inputs with float32 out, grad_out and gradients (dQ atomics straight into grad_q).
  t.push_back({.name = "flash_bf16_float32_gradients", .dtype = kBF16, .out_dtype = kF32,
               .grad_dtype = kF32, .batch = {2, 2}, .lq = 90, .lk = 60, .d = 128, .must = kFlash});
  t.push_back({.name = "flash_f16_backward_d36", .dtype = kF16, .batch = {3}, .lq = 50, .lk = 80,
               .d = 36, .grad_lse = false, .must = kFlash});
  t.push_back({.name = "flash_f32_backward_d30", .lq = 50, .lk = 80, .d = 30, .must = kFlash});
  t.push_back({.name = "flash_bf16_float32_gradients_d30", .dtype = kBF16, .out_dtype = kF32,
               .grad_dtype = kF32, .lq = 50, .lk = 80, .d = 30, .grad_lse = false,
               .must = kFlash});
  t.push_back({.name = "flash_bf16_backward_d200", .dtype = kBF16, .lq = 50, .lk = 80, .d = 200,
               .must = kFlash});
  // Rows 0..6 see nothing (lse -inf): they add nothing.
  t.push_back({.name = "flash_f32_backward_masked_rows", .lq = 90, .lk = 70, .d = 64,
               .causal = true, .causal_offset = -7, .must = kFlash});
  t.push_back({.name = "flash_bf16_backward_masked_rows", .dtype = kBF16, .lq = 90, .lk = 70,
               .d = 64, .causal = true, .causal_offset = -7, .grad_lse = false, .must = kFlash});
  for (DType dt : {kF32, kBF16}) {
    t.push_back({.name = "flash_" + tag(dt) + "_dilated_backward", .dtype = dt,
                 .batch = {2, 3, 2}, .lq = 32, .lk = 32, .d = 64, .scale = 0.125,
                 .causal = true, .grad_lse = false, .layout = AttentionLayout::kDilated,
                 .dilation = {.rate = 4, .offset = 1, .heads = 4, .first_head = 1,
                              .lse_heads_last = true},
                 .must = kFlash});
    // Keys split in two calls merged through the lse: the shares sum to the full gradient.
    t.push_back({.name = "flash_" + tag(dt) + "_split_keys_causal", .dtype = dt, .lq = 70,
                 .lk = 120, .d = 64, .causal = true, .causal_offset = 60, .grad_lse = false,
                 .key_split = 56, .must = kFlash});
  }
}

// From the cuDNN tests: q in [-2, 2], no grad_lse (cuDNN takes none), float32 gradients
// unless said.
void add_cudnn_cases(std::vector<AttentionCase>& t) {
  const AttentionCase base{.name = "", .grad_dtype = kF32, .q_range = 2, .must = kCudnn};
  auto add = [&](AttentionCase c) {
    c.grad_lse = false;
    t.push_back(std::move(c));
  };
  // Grouped-query attention: 3 key/value heads, each shared by 4 query heads (stride 0). The
  // forward runs natively (k and v fold to their own heads). Gradients per query head: the
  // backward is refused and left to the other kernels; gradients shared like k and v: cuDNN
  // writes each key/value head's sum (the other kernels refuse them).
  for (bool shared : {false, true}) {
    for (bool causal : {false, true}) {
      AttentionCase grouped = base;
      grouped.name = std::string("cudnn_bf16_grouped_heads") + (shared ? "_shared_grads" : "") +
                     (causal ? "_causal" : "");
      grouped.dtype = kBF16;
      grouped.batch = {2, 3, 4};
      grouped.lq = grouped.lk = 64;
      grouped.d = 64;
      grouped.causal = causal;
      grouped.layout =
          shared ? AttentionLayout::kGroupedHeadsSharedGrads : AttentionLayout::kGroupedHeads;
      grouped.must = shared ? kCudnn : kCudnnForward;
      add(grouped);
      if (shared && causal) {
        // Overwritten in q's dtype: cuDNN writes each key/value head's sum straight into the
        // NaN-poisoned buffer.
        grouped.name += "_overwritten";
        grouped.grad_dtype = kBF16;
        grouped.overwrite_grads = true;
        add(grouped);
      }
    }
  }
  AttentionCase c = base;
  c.name = "cudnn_bf16_packed_heads_first";
  c.dtype = kBF16;
  c.batch = {2, 3};
  c.lq = c.lk = c.d = 64;
  add(c);
  // q and out as [B, L, H, D] storage, k and v packed; L = 77 is no multiple of 64.
  c = base;
  c.name = "cudnn_f16_heads_inside_causal";
  c.dtype = kF16;
  c.grad_dtype = kF16;
  c.batch = {2, 2};
  c.lq = c.lk = 77;
  c.d = 128;
  c.causal = true;
  c.layout = AttentionLayout::kHeadsInside;
  add(c);
  for (int64_t offset : {56, 5}) {
    c = base;
    c.name = "cudnn_bf16_causal_q40_k96_offset" + std::to_string(offset);
    c.dtype = kBF16;
    c.batch = {3};
    c.lq = 40;
    c.lk = 96;
    c.d = 64;
    c.causal = true;
    c.causal_offset = offset;
    add(c);
  }
  // More keys than queries, some of which no query sees: their overwritten dK/dV rows must
  // come out 0, not the NaN they held.
  c.name = "cudnn_bf16_causal_q40_k96_offset5_overwritten";
  c.grad_dtype = kBF16;
  c.overwrite_grads = true;
  add(c);
  c = base;
  c.name = "cudnn_f16_no_batch_custom_scale";
  c.dtype = kF16;
  c.batch = {};
  c.lq = 33;
  c.lk = 50;
  c.d = 128;
  c.causal = true;
  c.causal_offset = 5;
  c.scale = 0.3;
  add(c);
  c = base;
  c.name = "cudnn_bf16_offset_that_masks_nothing";
  c.dtype = kBF16;
  c.lq = c.lk = 48;
  c.d = 64;
  c.causal = true;
  c.causal_offset = 100;
  add(c);
  // Heads 1..2 of 4, segments of 16, every 2nd position from 1; the lse selection has
  // sequence stride 2, which cuDNN's stats cannot take, so it goes through scratch.
  c = base;
  c.name = "cudnn_bf16_dilated_causal";
  c.dtype = kBF16;
  c.batch = {2, 4, 2};
  c.lq = c.lk = 8;
  c.d = 64;
  c.causal = true;
  c.layout = AttentionLayout::kDilated;
  c.dilation = {.rate = 2, .offset = 1, .heads = 4, .first_head = 1};
  add(c);
  // Segments 0..3 of 7 per batch row (a rank's block of two zigzag pieces): batch and
  // segments do not fold into one dim, so cuDNN runs one graph per batch entry.
  c.name = "cudnn_bf16_dilated_causal_batch_entries";
  c.dilation.spare_segments = 3;
  add(c);
  c.dilation.spare_segments = 0;
  // Calls that overwrite their gradients (poisoned with NaN first): cuDNN writes q-dtype
  // ones in place, float32 ones through scratch and a copy; the others zero them first.
  for (DType grad : {kBF16, kF32}) {
    c.name = "cudnn_bf16_dilated_causal_overwritten_" + tag(grad) + "_gradients";
    c.grad_dtype = grad;
    c.overwrite_grads = true;
    add(c);
  }
  // All 3 heads, segments of 32, every 4th position from 3; a packed lse; the backward gets
  // a float32 out and gives float32 gradients.
  c = base;
  c.name = "cudnn_f16_dilated_float32_out_in_backward";
  c.dtype = kF16;
  c.backward_out_dtype = kF32;
  c.batch = {1, 3, 3};
  c.lq = c.lk = 8;
  c.d = 128;
  c.layout = AttentionLayout::kDilated;
  c.dilation = {.rate = 4, .offset = 3, .heads = 3, .first_head = 0, .packed_lse = true};
  add(c);
}

// ---------------------------------------------------------------------------------------
// Operands.

Operand plain(DType dtype, const Shape& shape) {
  return make_strided_operand(dtype, shape, contiguous_strides(shape), 0, product(shape));
}

enum class Style { kPlain, kTransposed, kReversedRows, kBroadcastFirst, kBroadcastLastBatch,
                   kEveryOther, kShifted, kHeadsInside, kDilated };

Style style_for(const AttentionCase& c, Role role) {
  const bool q_like = role == Role::kQ || role == Role::kOut || role == Role::kGradOut ||
                      role == Role::kGradQ;
  switch (c.layout) {
    case AttentionLayout::kContiguous: return Style::kPlain;
    case AttentionLayout::kDilated:
      return (role == Role::kLse || role == Role::kGradLse) && c.dilation.packed_lse
                 ? Style::kPlain
                 : Style::kDilated;
    case AttentionLayout::kHeadsInside: return q_like ? Style::kHeadsInside : Style::kPlain;
    case AttentionLayout::kGroupedHeads:
      return role == Role::kK || role == Role::kV ? Style::kBroadcastLastBatch : Style::kPlain;
    case AttentionLayout::kGroupedHeadsSharedGrads:
      return role == Role::kK || role == Role::kV || role == Role::kGradK || role == Role::kGradV
                 ? Style::kBroadcastLastBatch
                 : Style::kPlain;
    case AttentionLayout::kUnaligned:
      return role == Role::kQ ? Style::kShifted : role == Role::kK ? Style::kReversedRows
                                                                   : Style::kPlain;
    case AttentionLayout::kStrided:
      switch (role) {
        case Role::kQ:
        case Role::kOut:
        case Role::kGradQ: return Style::kTransposed;
        case Role::kK:
        case Role::kGradOut:
        case Role::kGradK: return Style::kReversedRows;
        case Role::kV: return Style::kBroadcastFirst;
        default: return Style::kEveryOther;  // lse, grad_lse, grad_v
      }
  }
  return Style::kPlain;
}

}  // namespace

const std::vector<AttentionCase>& attention_cases() {
  static const std::vector<AttentionCase> cases = [] {
    std::vector<AttentionCase> t;
    add_math_cases(t);
    add_flash_cases(t);
    add_cudnn_cases(t);
    return t;
  }();
  return cases;
}

Operand make_attention_operand(const AttentionCase& c, Role role, DType dtype, const Shape& shape) {
  const int n = static_cast<int>(shape.size());
  Shape strides = contiguous_strides(shape);
  int64_t offset = 0, count = product(shape);
  switch (style_for(c, role)) {
    case Style::kPlain: break;
    case Style::kTransposed:
      if (n >= 2) {
        Shape stored = shape;
        std::swap(stored[n - 1], stored[n - 2]);
        strides = contiguous_strides(stored);
        std::swap(strides[n - 1], strides[n - 2]);
      }
      break;
    case Style::kReversedRows: {
      const int rows = role == Role::kLse || role == Role::kGradLse ? n - 1 : n - 2;
      if (rows >= 0 && shape[rows] > 0) {
        offset = (shape[rows] - 1) * strides[rows];
        strides[rows] = -strides[rows];
      }
      break;
    }
    case Style::kBroadcastFirst:
      if (n > 2 && shape[0] > 1) {
        strides = concat({0}, contiguous_strides(Shape(shape.begin() + 1, shape.end())));
        count = product(shape) / shape[0];
      }
      break;
    case Style::kBroadcastLastBatch:  // [batch..., G, L, D] reading [batch..., L, D]
      if (n > 2 && shape[n - 3] > 1) {
        const Shape stored(shape.begin(), shape.begin() + (n - 3));
        const Shape rows = concat(stored, Shape{shape[n - 2], shape[n - 1]});
        const Shape packed = contiguous_strides(rows);
        strides = concat(Shape(packed.begin(), packed.begin() + (n - 3)),
                         Shape{0, packed[n - 3], packed[n - 2]});
        count = product(rows);
      }
      break;
    case Style::kEveryOther:
      for (int64_t& s : strides) s *= 2;
      offset = 1;
      count = 2 * count + 1;
      break;
    case Style::kShifted:
      offset = 1;
      count += 1;
      break;
    case Style::kHeadsInside:  // [B, H, L, D] of [B, L, H, D]
      strides = {shape[2] * shape[1] * shape[3], shape[3], shape[1] * shape[3], 1};
      break;
    case Style::kDilated: {
      const Dilation& x = c.dilation;
      const int64_t b = shape[0], segments = shape[1], group = shape[2], rows = shape[3];
      const int64_t heads = x.heads > 0 ? x.heads : group, w = rows * x.rate;
      const int64_t seq = (segments + x.spare_segments) * w;
      if (n == 5) {  // [B, S, Hg, n, D] of [B, N, H, D]
        const int64_t d = shape[4];
        strides = {seq * heads * d, w * heads * d, d, x.rate * heads * d, 1};
        offset = x.offset * heads * d + x.first_head * d;
        count = b * seq * heads * d;
      } else if (x.lse_heads_last) {  // [B, S, Hg, n] of [B, N, H]
        strides = {seq * heads, w * heads, 1, x.rate * heads};
        offset = x.offset * heads + x.first_head;
        count = b * seq * heads;
      } else {  // [B, S, Hg, n] of [B, H, N]
        strides = {heads * seq, w, seq, x.rate};
        offset = x.first_head * seq + x.offset;
        count = b * heads * seq;
      }
      break;
    }
  }
  return make_strided_operand(dtype, shape, strides, offset, count);
}

void fill_extreme(const StridedView& view, bool alternate_sign) {
  const int64_t d = view.shape[view.ndim - 1], rows = view.shape[view.ndim - 2];
  std::vector<double> values(view.numel(), 0);
  for (int64_t r = 0; r < view.numel() / d; ++r) {
    values[r * d] = alternate_sign && (r % rows) % 2 == 1 ? -100 : 100;
    if (d > 1) values[r * d + 1] = static_cast<double>((r * 7 + 3) % 5) - 2;
  }
  write_view(view, values);
}

// ---------------------------------------------------------------------------------------
// The float64 reference, written from kernels/attention.h.

namespace {

bool visible(const AttentionParams& p, int64_t i, int64_t j) {
  return !p.causal || j <= i + p.causal_offset;
}

// The dropout factor keep / (1 - dropout) of element (b, i, j): the documented numbering
// (the default or the custom one) into the Philox stream (seed, offset).
double dropout_factor(const AttentionProblem& pr, int64_t b, int64_t i, int64_t j) {
  const AttentionParams& p = pr.params;
  if (p.dropout == 0) return 1;
  uint64_t n = (static_cast<uint64_t>(b) * pr.lq + i) * pr.lk + j;
  if (p.dropout_indexing.custom) {
    Shape index(pr.batch_shape.size());
    for (int dim = static_cast<int>(index.size()) - 1; dim >= 0; --dim) {
      index[dim] = b % pr.batch_shape[dim];
      b /= pr.batch_shape[dim];
    }
    n = custom_dropout_number(p.dropout_indexing, index, i, j);
  }
  return dropout_keeps(p.seed, p.offset, p.dropout, n) ? 1 / (1 - p.dropout) : 0;
}

}  // namespace

ForwardReference reference_forward(const AttentionProblem& pr) {
  const int64_t lq = pr.lq, lk = pr.lk, d = pr.d, batch = pr.batch();
  const double eps = compute_roundoff(pr.dtype), scale = pr.params.scale;
  ForwardReference f;
  f.out.assign(batch * lq * d, 0);
  f.out_err = f.out_abs = f.out;
  f.lse.assign(batch * lq, -kInf);
  f.lse_err.assign(batch * lq, 0);
  f.prob.assign(batch * lq * lk, 0);
  f.factor = f.prob;
  f.prob_err = f.lse_err;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = b * lq + i;
      const double* qi = &pr.q[row * d];
      std::vector<double> s(lk, -kInf);
      double max_score = -kInf, max_abs_terms = 0;
      for (int64_t j = 0; j < lk; ++j) {
        if (!visible(pr.params, i, j)) continue;
        const double* kj = &pr.k[(b * lk + j) * d];
        double dot = 0, abs_terms = 0;
        for (int64_t c = 0; c < d; ++c) {
          dot += qi[c] * kj[c];
          abs_terms += std::fabs(qi[c] * kj[c]);
        }
        s[j] = scale * dot;
        max_score = std::max(max_score, s[j]);
        max_abs_terms = std::max(max_abs_terms, std::fabs(scale) * abs_terms);
      }
      if (max_score == -kInf) continue;  // no visible key: out 0, lse -inf
      double sum = 0;
      for (int64_t j = 0; j < lk; ++j) sum += std::exp(s[j] - max_score);
      const double lse = max_score + std::log(sum);
      const double rel = eps * (d + 16) * (2 + (pr.exact_scores ? 0 : max_abs_terms)) +
                         eps * (lk + 16);
      f.lse[row] = lse;
      f.lse_err[row] = rel;
      f.prob_err[row] = rel;
      f.score_abs = std::max({f.score_abs, max_abs_terms, std::fabs(lse)});
      for (int64_t j = 0; j < lk; ++j) {
        if (s[j] == -kInf) continue;
        const double p = std::exp(s[j] - lse), factor = dropout_factor(pr, b, i, j);
        f.prob[row * lk + j] = p;
        f.factor[row * lk + j] = factor;
        for (int64_t c = 0; c < d; ++c) {
          const double term = p * factor * pr.v[(b * lk + j) * d + c];
          f.out[row * d + c] += term;
          f.out_err[row * d + c] += rel * std::fabs(term);
          f.out_abs[row * d + c] += std::fabs(term);
        }
      }
    }
  }
  return f;
}

// Through the softmax Jacobian dp_j / ds_k = p_j (delta_jk - p_k) and dlse / ds_k = p_k.
GradReference reference_backward(const AttentionProblem& pr, const ForwardReference& f,
                                 const std::vector<double>& g, const std::vector<double>& gl,
                                 DType out_dtype) {
  const int64_t lq = pr.lq, lk = pr.lk, d = pr.d;
  const double eps = compute_roundoff(pr.dtype), eps_out = unit_roundoff(out_dtype);
  const double eps_lse = unit_roundoff(DType::kFloat32), scale = pr.params.scale;
  GradReference r;
  r.dq.assign(pr.q.size(), 0);
  r.dq_err = r.dq_abs = r.dq;
  r.dk.assign(pr.k.size(), 0);
  r.dk_err = r.dk_abs = r.dv = r.dv_err = r.dv_abs = r.dk;
  for (int64_t b = 0; b < pr.batch(); ++b) {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = b * lq + i;
      if (f.lse[row] == -kInf) continue;
      const double* gi = &g[row * d];
      const double* qi = &pr.q[row * d];
      const double* p = &f.prob[row * lk];
      const double* factor = &f.factor[row * lk];
      const double grad_lse = gl.empty() ? 0 : gl[row];
      const double rel = f.prob_err[row] + 2 * eps_lse * std::fabs(f.lse[row]);
      std::vector<double> dp(lk, 0), dp_abs(lk, 0);
      double delta_abs = std::fabs(grad_lse), go_abs = 0;
      for (int64_t c = 0; c < d; ++c) go_abs += std::fabs(gi[c] * f.out[row * d + c]);
      for (int64_t j = 0; j < lk; ++j) {
        if (p[j] == 0) continue;
        for (int64_t c = 0; c < d; ++c) {
          dp[j] += gi[c] * pr.v[(b * lk + j) * d + c];
          dp_abs[j] += std::fabs(gi[c] * pr.v[(b * lk + j) * d + c]);
        }
        dp[j] *= factor[j];
        dp_abs[j] *= factor[j];
        delta_abs += std::fabs(dp[j]) * p[j];
      }
      const double delta_err =
          2 * eps_out * go_abs + eps * (d + 16) * (go_abs + std::fabs(grad_lse));
      for (int64_t k = 0; k < lk; ++k) {
        if (p[k] == 0) continue;
        double ds = grad_lse * p[k];
        for (int64_t j = 0; j < lk; ++j) ds += dp[j] * p[j] * ((j == k ? 1.0 : 0.0) - p[k]);
        const double ds_err =
            p[k] * (rel * (std::fabs(dp[k]) + delta_abs) + eps * (d + 16) * dp_abs[k] + delta_err);
        const double ds_abs = p[k] * (dp_abs[k] + go_abs + std::fabs(grad_lse));
        const double* kk = &pr.k[(b * lk + k) * d];
        for (int64_t c = 0; c < d; ++c) {
          const int64_t qc = row * d + c, kc = (b * lk + k) * d + c;
          r.dq[qc] += scale * ds * kk[c];
          r.dq_err[qc] += std::fabs(scale) * (ds_err * std::fabs(kk[c]) +
                                              eps * (lk + 16) * std::fabs(ds * kk[c]));
          r.dq_abs[qc] += std::fabs(scale) * ds_abs * std::fabs(kk[c]);
          r.dk[kc] += scale * ds * qi[c];
          r.dk_err[kc] += std::fabs(scale) * (ds_err * std::fabs(qi[c]) +
                                              eps * (lq + 16) * std::fabs(ds * qi[c]));
          r.dk_abs[kc] += std::fabs(scale) * ds_abs * std::fabs(qi[c]);
          const double dv = p[k] * factor[k] * gi[c];
          r.dv[kc] += dv;
          r.dv_err[kc] += (rel + eps * (lq + 16)) * std::fabs(dv);
          r.dv_abs[kc] += std::fabs(dv);
        }
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------
// The harness.

namespace {

// An operand's buffer on the device the run uses: the host buffer itself on the CPU, a copy
// of its bytes elsewhere, with the view rebased onto it.
class Mirror {
 public:
  Mirror(Operand& host, Device device) : host_(&host), view_(host.view) {
    if (device.is_cpu()) return;
    device_ = empty({std::max<int64_t>(host.buffer.count(), 1)},
                    TensorOptions(host.buffer.dtype()).with_device(device));
    upload();
    if (host.view.data != nullptr) {
      view_.data = static_cast<unsigned char*>(kernel_view(device_).data) +
                   (static_cast<const unsigned char*>(host.view.data) - host.buffer.data());
    }
  }
  const StridedView& view() const { return view_; }
  void upload() {
    const int64_t n = host_->buffer.count();
    if (!device_.defined() || n == 0) return;
    // copy_ stays on one device: the host bytes travel through to() first.
    device_.narrow(0, 0, n).copy_(
        from_blob(host_->buffer.data(), {n}, host_->buffer.dtype()).to(device_.device()));
  }
  void download() {
    if (!device_.defined() || host_->buffer.count() == 0) return;
    const Tensor copy = device_.narrow(0, 0, host_->buffer.count()).to(Device::cpu());
    std::memcpy(host_->buffer.data(), copy.raw_data(), host_->buffer.size_bytes());
  }

 private:
  Operand* host_;
  StridedView view_;
  Tensor device_;
};

// Gradients shared like k and v (kGroupedHeadsSharedGrads): each element of the last batch
// dim's group holds the group's sum, as the shared storage does. The reference is per query
// head, in [batch..., lk, d] order.
void sum_shared_key_grads(const AttentionCase& c, GradReference& gr) {
  const int64_t group = c.batch.back(), row = c.lk * c.d;
  for (std::vector<double>* v : {&gr.dk, &gr.dv, &gr.dk_err, &gr.dv_err, &gr.dk_abs, &gr.dv_abs}) {
    std::vector<double>& x = *v;
    for (size_t first = 0; first < x.size(); first += static_cast<size_t>(group * row)) {
      for (int64_t e = 0; e < row; ++e) {
        double sum = 0;
        for (int64_t g = 0; g < group; ++g) sum += x[first + static_cast<size_t>(g * row + e)];
        for (int64_t g = 0; g < group; ++g) x[first + static_cast<size_t>(g * row + e)] = sum;
      }
    }
  }
}

// Rows [begin, end) of dim -2 of a view.
StridedView narrow_rows(StridedView v, int64_t begin, int64_t end) {
  const int dim = v.ndim - 2;
  if (v.data != nullptr) {
    v.data = static_cast<unsigned char*>(v.data) +
             begin * v.strides[dim] * static_cast<int64_t>(dtype_size(v.dtype));
  }
  v.shape[dim] = end - begin;
  return v;
}

// How a kernel's results may differ from the reference beyond the reference's bound.
enum class Deviation { kCpu, kGpuMath, kFused };

struct Context {
  Deviation deviation;
  DType dtype;  // of q, k, v
  int64_t d;
  double score_abs;
};

// Expects got close to base + times * delta (elementwise; base null: 0), the reference's
// error bound err (for one run) and sums of |terms| abs (null: none) as the file comment
// says. lse: the tolerances of a log-sum-exp.
void expect_near(const std::string& what, const std::vector<double>& got,
                 const std::vector<double>& delta, const std::vector<double>& err,
                 const std::vector<double>* abs, const std::vector<double>* base, double times,
                 DType stored, const Context& x, bool lse = false) {
  std::vector<double> want(delta.size());
  double spread = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    want[e] = (base ? (*base)[e] : 0) + times * delta[e];
    if (std::isfinite(want[e])) spread = std::max(spread, std::fabs(times * delta[e]));
  }
  spread *= 8.0 * (x.d + 16) * compute_roundoff(x.dtype);
  const double u = unit_roundoff(stored), u_in = unit_roundoff(x.dtype), tiny = tiny_step(stored);
  const double fused_rel = 8 * u_in + std::ldexp(1.0, -24) * (64 + 4.0 * x.d * x.score_abs);
  expect_elementwise_close(what, got, want, [&](size_t e) {
    const double w = std::fabs(want[e]), b = base ? std::fabs((*base)[e]) : 0;
    const double g = base ? times * std::fabs(delta[e]) : 0;
    double tol = times * err[e] + 2 * u * (w + b + g) + tiny;
    if (x.deviation == Deviation::kGpuMath) tol += 4 * u * (w + b) + spread + tiny;
    if (x.deviation == Deviation::kFused) {
      tol += (abs ? fused_rel * times * (*abs)[e] : 0) +
             2 * std::max(u, u_in) * (w + b + times * std::fabs(delta[e])) + tiny;
      if (lse) {
        tol += std::ldexp(1.0, -24) * (16 * w + 4.0 * x.d * x.score_abs + 16) +
               std::ldexp(1.0, -14) * (1 + w);
      }
    }
    return tol;
  });
}

}  // namespace

void check_attention_case(const AttentionCase& c, Device device, AttentionKernel kernel) {
  if (!device.is_cpu() && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(c.key_split == 0 || (c.dropout == 0 && c.lse)) << "a split case draws no dropout";
  kernels::KernelBackend& backend = backend_for(device);
  if (!device.is_cpu()) allocator_for(device).set_fill_on_allocate(0xff);  // NaN scratch
  std::mt19937_64 rng(std::hash<std::string>{}(c.name));
  const DType out_dtype = c.out_dtype.value_or(c.dtype), grad_dtype = c.grad_dtype.value_or(c.dtype);
  const DType bw_out_dtype = c.backward_out_dtype.value_or(out_dtype);
  const Shape q_shape = concat(c.batch, {c.lq, c.d}), k_shape = concat(c.batch, {c.lk, c.d});
  const Shape lse_shape = concat(c.batch, {c.lq});
  auto operand = [&](Role role, DType dtype, const Shape& shape) {
    return make_attention_operand(c, role, dtype, shape);
  };

  // Inputs and the reference.
  Operand q = operand(Role::kQ, c.dtype, q_shape), k = operand(Role::kK, c.dtype, k_shape);
  Operand v = operand(Role::kV, c.dtype, k_shape);
  q.buffer.fill_uniform(rng, -c.q_range, c.q_range);
  k.buffer.fill_uniform(rng, -c.k_range, c.k_range);
  v.buffer.fill_uniform(rng);
  if (c.values == AttentionValues::kExtreme) {
    fill_extreme(q.view, /*alternate_sign=*/true);
    fill_extreme(k.view, /*alternate_sign=*/false);
  }
  if (c.values == AttentionValues::kOneHotV) {
    ASSERT_GE(c.d, c.lk);
    std::vector<double> one_hot(product(k_shape), 0.0);
    for (int64_t row = 0; row < product(k_shape) / c.d; ++row) one_hot[row * c.d + row % c.lk] = 1;
    write_view(v.view, one_hot);
  }
  AttentionProblem pr;
  pr.dtype = c.dtype;
  pr.batch_shape = c.batch;
  pr.lq = c.lq;
  pr.lk = c.lk;
  pr.d = c.d;
  pr.params.scale = c.scale.value_or(1 / std::sqrt(static_cast<double>(c.d)));
  pr.params.causal = c.causal;
  pr.params.causal_offset = c.causal_offset;
  pr.params.dropout = c.dropout;
  pr.params.seed = c.seed;
  pr.params.offset = c.offset;
  if (c.scattered_numbering) pr.params.dropout_indexing = scattered_numbering();
  pr.q = read_view(q.view);
  pr.k = read_view(k.view);
  pr.v = read_view(v.view);
  pr.exact_scores = c.values == AttentionValues::kExtreme;
  const ForwardReference ref = reference_forward(pr);

  // The parameters the kernel gets: a key order in the device's memory.
  std::vector<int64_t> key_order(static_cast<size_t>(c.lk));
  std::iota(key_order.begin(), key_order.end(), int64_t{0});
  std::shuffle(key_order.begin(), key_order.end(), rng);
  Tensor device_key_order;
  AttentionParams params = pr.params;
  if (c.key_order) {
    device_key_order = from_vector<int64_t>(key_order, {c.lk}).to(device);
    params.key_order = static_cast<const int64_t*>(kernel_view(device_key_order).data);
  }
  const std::vector<std::pair<int64_t, int64_t>> key_blocks =
      c.key_split > 0 ? std::vector<std::pair<int64_t, int64_t>>{{0, c.key_split},
                                                                 {c.key_split, c.lk}}
                      : std::vector<std::pair<int64_t, int64_t>>{{0, c.lk}};
  // Key blocks add into one dQ: a call that overwrites would drop the first block's share.
  ASSERT_FALSE(c.overwrite_grads && key_blocks.size() > 1) << "overwrite_grads with key_split";
  const Mirror dq(q, device), dk(k, device), dv(v, device);

  // Forward, into poisoned outputs (float32 partials merged here for a split).
  std::string why_not;
  AttentionForwardArgs args;
  args.q = dq.view();
  args.k = dk.view();
  args.v = dv.view();
  args.params = params;
  Operand out = operand(Role::kOut, out_dtype, q_shape), lse = operand(Role::kLse, kF32, lse_shape);
  out.buffer.poison();
  lse.buffer.poison();
  const auto out_before = out.buffer.bytes(), lse_before = lse.buffer.bytes();
  auto run_forward = [&](Mirror& o, Mirror& l, AttentionForwardArgs call) {
    call.out = o.view();
    call.lse = c.lse ? l.view() : StridedView{};
    backend.attention_forward(kernel, call);
    o.download();
    l.download();
  };
  Mirror d_out(out, device), d_lse(lse, device);
  args.out = d_out.view();
  args.lse = c.lse ? d_lse.view() : StridedView{};
  if (!backend.attention_supports(kernel, args, nullptr, &why_not)) {
    ASSERT_FALSE(kernel == AttentionKernel::kFlash && (c.must & kFlashForward))
        << "flash refused: " << why_not;
    ASSERT_FALSE(kernel == AttentionKernel::kCudnn && (c.must & kCudnnForward))
        << "cuDNN refused: " << why_not;
    GTEST_SKIP() << kernels::kernel_name(kernel) << " does not run this case: " << why_not;
  }
  if (key_blocks.size() == 1) {
    run_forward(d_out, d_lse, args);
  } else {
    std::vector<std::vector<double>> part_out, part_lse;
    for (auto [begin, end] : key_blocks) {
      const DType partial = c.dtype == kF64 ? kF64 : kF32;  // float32, float64 for float64
      Operand po = plain(partial, q_shape), pl = plain(partial, lse_shape);
      po.buffer.poison();
      pl.buffer.poison();
      AttentionForwardArgs part = args;
      part.k = narrow_rows(args.k, begin, end);
      part.v = narrow_rows(args.v, begin, end);
      part.params.causal_offset -= begin;  // key j of the part is key begin + j of the whole
      Mirror d_po(po, device), d_pl(pl, device);
      // Some kernels write only q's dtype (cuDNN): those skip the float32 partials.
      AttentionForwardArgs probe = part;
      probe.out = d_po.view();
      probe.lse = c.lse ? d_pl.view() : StridedView{};
      if (!backend.attention_supports(kernel, probe, nullptr, &why_not)) {
        ASSERT_FALSE(kernel == AttentionKernel::kFlash && (c.must & kFlashForward))
            << "flash refused a split's partial: " << why_not;
        GTEST_SKIP() << kernels::kernel_name(kernel)
                     << " does not run this case's float32 partials: " << why_not;
      }
      run_forward(d_po, d_pl, part);
      part_out.push_back(read_view(po.view));
      part_lse.push_back(read_view(pl.view));
    }
    std::vector<double> merged_out(part_out[0].size()), merged_lse(part_lse[0].size());
    for (size_t row = 0; row < merged_lse.size(); ++row) {
      const double a = part_lse[0][row], b = part_lse[1][row], m = std::max(a, b);
      merged_lse[row] = m == -kInf ? -kInf : m + std::log(std::exp(a - m) + std::exp(b - m));
      for (int64_t col = 0; col < c.d; ++col) {
        const size_t e = row * c.d + col;
        merged_out[e] = m == -kInf ? 0
                                   : std::exp(a - merged_lse[row]) * part_out[0][e] +
                                         std::exp(b - merged_lse[row]) * part_out[1][e];
      }
    }
    write_view(out.view, merged_out);
    write_view(lse.view, merged_lse);
  }
  const Context x{device.is_cpu() && kernel == AttentionKernel::kMath ? Deviation::kCpu
                  : kernel == AttentionKernel::kMath                  ? Deviation::kGpuMath
                                                                      : Deviation::kFused,
                  c.dtype, c.d, ref.score_abs};
  const std::vector<double> got_out = read_view(out.view), got_lse = read_view(lse.view);
  expect_near("out", got_out, ref.out, ref.out_err, &ref.out_abs, nullptr, 1, out_dtype, x);
  expect_untouched_outside("out", out, out_before);
  if (c.lse) {
    expect_near("lse", got_lse, ref.lse, ref.lse_err, nullptr, nullptr, 1, kF32, x, true);
    expect_untouched_outside("lse", lse, lse_before);
  } else {
    EXPECT_EQ(lse.buffer.bytes(), lse_before) << "lse was written though its data is null";
  }
  // Rows that see no key: exactly 0 and -inf, never NaN.
  for (int64_t row = 0; row < pr.batch() * c.lq; ++row) {
    if (ref.lse[row] != -kInf) continue;
    for (int64_t col = 0; col < c.d; ++col) {
      ASSERT_EQ(got_out[row * c.d + col], 0.0) << "row " << row;
    }
    if (c.lse) {
      ASSERT_EQ(got_lse[row], -kInf) << "row " << row;
    }
  }
  // One-hot values: out[b, i, j] is zero exactly where the reference masks or drops.
  if (c.values == AttentionValues::kOneHotV) {
    int64_t mismatches = 0, dropped = 0, visible_count = 0;
    for (int64_t row = 0; row < pr.batch() * c.lq; ++row) {
      for (int64_t j = 0; j < c.lk; ++j) {
        const double p = ref.prob[row * c.lk + j], factor = ref.factor[row * c.lk + j];
        mismatches += (got_out[row * c.d + j] == 0) != (p * factor == 0);
        visible_count += p != 0;
        dropped += p != 0 && factor == 0;
      }
    }
    EXPECT_EQ(mismatches, 0) << "elements whose dropout differs from the documented mask";
    // The drop rate is the requested one, within 5 standard deviations: the mask is live.
    const double expected = c.dropout * static_cast<double>(visible_count);
    EXPECT_NEAR(static_cast<double>(dropped), expected, 5 * std::sqrt(expected * (1 - c.dropout)) + 1);
  }
  // The math kernels are bitwise reproducible: the same mask and sums on a second run.
  if (kernel == AttentionKernel::kMath && c.dropout > 0 && key_blocks.size() == 1) {
    Operand again = operand(Role::kOut, out_dtype, q_shape), again_lse = operand(Role::kLse, kF32, lse_shape);
    again.buffer.poison();
    again_lse.buffer.poison();
    Mirror d_again(again, device), d_again_lse(again_lse, device);
    run_forward(d_again, d_again_lse, args);
    EXPECT_EQ(again.buffer.bytes(), out.buffer.bytes()) << "a second run gave other bits";
  }

  // Backward from the reference's out and lse, rounded to their dtypes.
  Operand bw_out = operand(Role::kOut, bw_out_dtype, q_shape), bw_lse = operand(Role::kLse, kF32, lse_shape);
  write_view(bw_out.view, ref.out);
  write_view(bw_lse.view, ref.lse);
  Operand grad_out = operand(Role::kGradOut, out_dtype, q_shape);
  Operand grad_lse = operand(Role::kGradLse, kF32, lse_shape);
  Operand grad_q = operand(Role::kGradQ, grad_dtype, q_shape);
  Operand grad_k = operand(Role::kGradK, grad_dtype, k_shape);
  Operand grad_v = operand(Role::kGradV, grad_dtype, k_shape);
  grad_out.buffer.fill_uniform(rng);
  grad_lse.buffer.fill_uniform(rng);
  for (Operand* o : {&grad_q, &grad_k, &grad_v}) {
    if (c.overwrite_grads) {
      o->buffer.fill_bytes(0xff);  // NaN: an element the call fails to overwrite shows
    } else {
      o->buffer.fill_uniform(rng, -0.5, 0.5);
    }
  }
  const std::vector<double> g0_q = read_view(grad_q.view), g0_k = read_view(grad_k.view),
                            g0_v = read_view(grad_v.view);
  const auto q_before = grad_q.buffer.bytes(), k_before = grad_k.buffer.bytes(),
             v_before = grad_v.buffer.bytes();
  Mirror d_bw_out(bw_out, device), d_bw_lse(bw_lse, device), d_go(grad_out, device);
  Mirror d_gl(grad_lse, device);
  Mirror d_gq(grad_q, device), d_gk(grad_k, device), d_gv(grad_v, device);
  AttentionBackwardArgs bargs;
  bargs.q = dq.view();
  bargs.k = dk.view();
  bargs.v = dv.view();
  bargs.out = d_bw_out.view();
  bargs.lse = d_bw_lse.view();
  bargs.grad_out = d_go.view();
  if (c.grad_lse) bargs.grad_lse = d_gl.view();
  bargs.grad_q = d_gq.view();
  bargs.grad_k = d_gk.view();
  bargs.grad_v = d_gv.view();
  bargs.params = params;
  bargs.overwrite_grads = c.overwrite_grads;
  if (!backend.attention_supports(kernel, args, &bargs, &why_not)) {
    ASSERT_FALSE(kernel == AttentionKernel::kFlash && (c.must & kFlashBackward))
        << "flash refused the backward: " << why_not;
    ASSERT_FALSE(kernel == AttentionKernel::kCudnn && (c.must & kCudnnBackward))
        << "cuDNN refused the backward: " << why_not;
    std::cout << "[ note     ] " << kernels::kernel_name(kernel)
              << " runs no backward of this case: " << why_not << "\n";
    return;
  }
  GradReference gr = reference_backward(
      pr, ref, read_view(grad_out.view), c.grad_lse ? read_view(grad_lse.view) : std::vector<double>{},
      bw_out_dtype);
  if (c.layout == AttentionLayout::kGroupedHeadsSharedGrads) sum_shared_key_grads(c, gr);
  const bool check_scratch = !device.is_cpu() && kernel != AttentionKernel::kCudnn;
  // Twice: accumulated gradients hold twice the reference after the second run, overwritten
  // ones the reference after each.
  for (int run = 1; run <= 2; ++run) {
    SCOPED_TRACE("backward run " + std::to_string(run));
    const int64_t held = check_scratch ? allocator_for(device).stats().allocated_bytes : 0;
    for (auto [begin, end] : key_blocks) {
      AttentionBackwardArgs part = bargs;
      part.k = narrow_rows(bargs.k, begin, end);
      part.v = narrow_rows(bargs.v, begin, end);
      part.grad_k = narrow_rows(bargs.grad_k, begin, end);
      part.grad_v = narrow_rows(bargs.grad_v, begin, end);
      part.params.causal_offset -= begin;
      backend.attention_backward(kernel, part);
    }
    for (Mirror* m : {&d_gq, &d_gk, &d_gv}) m->download();
    if (check_scratch) {
      EXPECT_EQ(allocator_for(device).stats().allocated_bytes, held) << "scratch not returned";
    }
    const bool overwritten = c.overwrite_grads;
    const double times = overwritten ? 1 : run;
    expect_near("grad_q", read_view(grad_q.view), gr.dq, gr.dq_err, &gr.dq_abs,
                overwritten ? nullptr : &g0_q, times, grad_dtype, x);
    expect_near("grad_k", read_view(grad_k.view), gr.dk, gr.dk_err, &gr.dk_abs,
                overwritten ? nullptr : &g0_k, times, grad_dtype, x);
    expect_near("grad_v", read_view(grad_v.view), gr.dv, gr.dv_err, &gr.dv_abs,
                overwritten ? nullptr : &g0_v, times, grad_dtype, x);
    expect_untouched_outside("grad_q", grad_q, q_before);
    expect_untouched_outside("grad_k", grad_k, k_before);
    expect_untouched_outside("grad_v", grad_v, v_before);
  }
}

std::vector<AttentionRun> attention_runs(const std::vector<AttentionKernel>& kernels) {
  std::vector<AttentionRun> runs;
  for (AttentionKernel kernel : kernels) {
    for (const AttentionCase& c : attention_cases()) runs.push_back({kernel, &c});
  }
  return runs;
}

std::string attention_run_name(const ::testing::TestParamInfo<AttentionRun>& info) {
  return std::string(kernels::kernel_name(info.param.kernel)) + "_" + info.param.c->name;
}

}  // namespace rd::test
