// How a sequence is split among the ranks of a context-parallel group: the layouts
// (contiguous, zigzag), the global positions of each rank's rows, and the work each gets.
#pragma once

#include <cstdint>
#include <vector>

#include "ringdilated/nn/dilated_attention.h"
#include "ringdilated/nn/dilated_plan.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// How a sequence is split among the P ranks of a context-parallel group:
//   kContiguous  rank r holds positions [r N / P, (r + 1) N / P).
//   kZigzag      the sequence is cut into 2P pieces of N / (2P); rank r holds pieces r and
//                2P - 1 - r, in that order. Under a causal mask this balances the work: in a
//                segment of 2^k pieces the two pieces of a rank sit at mirrored places, so
//                every rank attends the same number of (query, key) pairs
//                (docs/distributed.md, "Causal load balance").
//   kAuto        kZigzag for causal attention when 2P divides N and no pair's segments
//                that fit a contiguous block would be split by the zigzag pieces (that
//                would add traffic the balance does not repay); else kContiguous.
// The caller splits its data with the same layout (sequence_block) and gives rotary
// embeddings the pieces' global positions (sequence_pieces).
enum class SequenceLayout { kAuto, kContiguous, kZigzag };

const char* layout_name(SequenceLayout layout);

// The layout a call with `options` uses for a sequence of `seq_len` positions over `ranks`
// ranks (kAuto resolved as above). Errors name N and P when they do not split: P must divide
// N, and 2P for the zigzag layout.
SequenceLayout resolve_layout(SequenceLayout layout, const DilatedAttentionOptions& options,
                              int64_t seq_len, int ranks);

// resolve_layout with its errors naming `op`. `options` may be null for a layout that is not
// kAuto (then only the split is checked).
SequenceLayout resolve_layout_for(const char* op, SequenceLayout layout,
                                  const DilatedAttentionOptions* options, int64_t seq_len,
                                  int ranks);

// The global positions of rank `rank`'s rows, in the order it holds them: one block
// (contiguous) or two (zigzag). `layout` must be resolved (not kAuto), here and below.
std::vector<Block> sequence_pieces(SequenceLayout layout, int64_t seq_len, int rank, int size);

// This rank's rows [B, N / P, ...] of a whole sequence [B, N, ...] under a resolved layout,
// and back: the whole sequence from every rank's rows (blocks[r] is rank r's). `dim` is the
// sequence's dimension (2 for a [B, H, N] row statistic such as an LSE).
Tensor sequence_block(const Tensor& sequence, int rank, int size, SequenceLayout layout,
                      int64_t dim = 1);
Tensor sequence_from_blocks(const std::vector<Tensor>& blocks, SequenceLayout layout,
                            int64_t dim = 1);

// The (query, key) pairs the queries of each rank attend under a layout, summed over heads
// (per batch row): the work the plan gives each rank. Its largest over its mean is the work
// imbalance of docs/distributed.md ("Causal load balance").
std::vector<int64_t> attended_pairs_per_rank(const DilatedAttentionOptions& options,
                                             int64_t seq_len, int64_t num_heads, int ranks,
                                             SequenceLayout layout);

// One rank's rows of a split [B, N, H, D] sequence and where they sit in it: rows_per_rank
// rows, one piece of the sequence (contiguous layout) or two (zigzag: pieces rank and
// 2P - 1 - rank of 2P, in that order). One device is the split with one rank.
struct RankLayout {
  int64_t batch = 0, rows_per_rank = 0, heads = 0, head_dim = 0;
  int rank = 0, ranks = 1;
  bool zigzag = false;
  int64_t kv_heads = 0;  // key/value heads (grouped-query attention); 0: as many as heads

  // Query heads per key/value head.
  int64_t kv_group() const { return kv_heads > 0 ? heads / kv_heads : 1; }

  int64_t seq_len() const { return rows_per_rank * ranks; }
  int pieces() const { return zigzag ? 2 : 1; }
  int64_t piece_len() const { return rows_per_rank / pieces(); }
  // Global positions of piece `j` of rank `r` (its rows [j * piece_len, + piece_len)).
  Block piece(int r, int j) const {
    const int64_t index = !zigzag ? r : (j == 0 ? r : 2 * ranks - 1 - r);
    return {index * piece_len(), (index + 1) * piece_len()};
  }
};

// Rank r's rows, along `dim`, of a tensor over the whole sequence, and the whole sequence
// from every rank's rows (blocks[r]: rank r's): the unchecked forms of sequence_block and
// sequence_from_blocks.
Tensor rank_rows(const Tensor& full, const RankLayout& layout, int r, int64_t dim);
Tensor join_rank_rows(const std::vector<Tensor>& blocks, const RankLayout& layout, int64_t dim);

}  // namespace rd::nn
