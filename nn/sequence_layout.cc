// How a sequence is split among the ranks (see sequence_layout.h, docs/distributed.md).
#include "ringdilated/nn/sequence_layout.h"

#include <algorithm>
#include <string>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::nn {
namespace {

// Whether the zigzag layout would make pairs exchange keys that the contiguous one keeps
// local: segments that tile a rank's block but not its half (zigzag pieces of N / 2P).
// Splitting them would cost more traffic and ring steps than the balance gains (measured:
// N = 1M, P = 4, segments of N / P: 60% strong-scaling efficiency against 85%).
bool zigzag_splits_local_segments(const DilatedAttentionOptions& o, int64_t seq_len, int ranks) {
  if (o.variant == DilationVariant::kGlobal) return false;  // no segments to keep local
  const int64_t block = seq_len / ranks, piece = block / 2;
  for (int64_t length : o.segment_lengths) {
    const int64_t w = std::min(length, seq_len);
    const bool local_in_blocks = w <= block && block % w == 0;
    const bool local_in_pieces = w <= piece && piece % w == 0;
    if (local_in_blocks && !local_in_pieces) return true;
  }
  return false;
}

// Pairs attended by the queries of `piece` in the global variant: query row p of a head
// group reads list entries m <= p under the causal mask, else all N.
int64_t global_piece_pairs(const DilatedAttentionOptions& o, int64_t seq_len, int64_t heads,
                           const Block& piece) {
  const std::vector<Heads> groups =
      head_groups(heads, static_cast<int64_t>(o.segment_lengths.size()), false);
  // sum of p + 1 over [begin, end), or N per row.
  const int64_t per_head = o.causal
                               ? (piece.end * (piece.end + 1) - piece.begin * (piece.begin + 1)) / 2
                               : piece.size() * seq_len;
  int64_t pairs = 0;
  for (const Heads& g : groups) pairs += per_head * g.count;
  return pairs;
}

// Pairs attended by the calls of the fixed variant between two pieces.
int64_t fixed_piece_pairs(const DilatedAttentionOptions& o, int64_t seq_len, int64_t heads,
                          const Block& qb, const Block& kb) {
  int64_t pairs = 0;
  for (const BlockCall& c : plan_block_calls(o, seq_len, heads, qb, kb)) {
    const int64_t per_segment = c.causal ? c.q.count * (c.q.count + 1) / 2 : c.q.count * c.k.count;
    pairs += per_segment * c.q.segments * c.q.head_count;
  }
  return pairs;
}

}  // namespace

const char* layout_name(SequenceLayout layout) {
  switch (layout) {
    case SequenceLayout::kAuto: return "auto";
    case SequenceLayout::kContiguous: return "contiguous";
    case SequenceLayout::kZigzag: return "zigzag";
  }
  return "?";
}

SequenceLayout resolve_layout_for(const char* op, SequenceLayout layout,
                                  const DilatedAttentionOptions* options, int64_t seq_len,
                                  int ranks) {
  RD_CHECK(ranks >= 1 && seq_len >= 0, kInvalidArgument, op, ": ", ranks,
           " ranks and a sequence of ", seq_len);
  RD_CHECK(seq_len % ranks == 0, kShapeMismatch, op, ": the sequence length ", seq_len,
           " does not split into ", ranks, " equal blocks (N % P = ", seq_len % ranks,
           "); pad the sequence or pick P dividing N");
  const int64_t pieces = 2 * static_cast<int64_t>(ranks);
  const bool zigzag_fits = seq_len % pieces == 0;
  if (layout == SequenceLayout::kAuto) {
    RD_CHECK(options != nullptr, kInvalidArgument, op, ": resolve kAuto first (resolve_layout)");
    const bool zigzag = options->causal && ranks > 1 && zigzag_fits &&
                        !zigzag_splits_local_segments(*options, seq_len, ranks);
    return zigzag ? SequenceLayout::kZigzag : SequenceLayout::kContiguous;
  }
  RD_CHECK(layout != SequenceLayout::kZigzag || zigzag_fits, kShapeMismatch, op,
           ": the zigzag layout needs 2P = ", pieces, " equal pieces, but the sequence length ",
           seq_len, " leaves N % 2P = ", seq_len % pieces,
           "; pad the sequence or use the contiguous layout");
  return layout;
}

SequenceLayout resolve_layout(SequenceLayout layout, const DilatedAttentionOptions& options,
                              int64_t seq_len, int ranks) {
  return resolve_layout_for("resolve_layout", layout, &options, seq_len, ranks);
}

std::vector<Block> sequence_pieces(SequenceLayout layout, int64_t seq_len, int rank, int size) {
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "sequence_pieces: rank ", rank,
           " is not in a group of ", size);
  const bool zigzag = resolve_layout_for("sequence_pieces", layout, nullptr, seq_len, size) ==
                      SequenceLayout::kZigzag;
  const RankLayout l{0, seq_len / size, 0, 0, rank, size, zigzag};
  std::vector<Block> pieces;
  for (int j = 0; j < l.pieces(); ++j) pieces.push_back(l.piece(rank, j));
  return pieces;
}

std::vector<int64_t> attended_pairs_per_rank(const DilatedAttentionOptions& options,
                                             int64_t seq_len, int64_t num_heads, int ranks,
                                             SequenceLayout layout) {
  validate_options(options, num_heads);
  const SequenceLayout resolved =
      resolve_layout_for("attended_pairs_per_rank", layout, &options, seq_len, ranks);
  std::vector<std::vector<Block>> pieces;
  for (int r = 0; r < ranks; ++r) pieces.push_back(sequence_pieces(resolved, seq_len, r, ranks));
  std::vector<int64_t> work(static_cast<size_t>(ranks), 0);
  for (int a = 0; a < ranks; ++a) {
    for (const Block& qb : pieces[static_cast<size_t>(a)]) {
      if (options.variant == DilationVariant::kGlobal) {
        work[static_cast<size_t>(a)] += global_piece_pairs(options, seq_len, num_heads, qb);
        continue;
      }
      for (const std::vector<Block>& key_pieces : pieces) {
        for (const Block& kb : key_pieces) {
          work[static_cast<size_t>(a)] += fixed_piece_pairs(options, seq_len, num_heads, qb, kb);
        }
      }
    }
  }
  return work;
}

Tensor join_rank_rows(const std::vector<Tensor>& blocks, const RankLayout& l, int64_t dim) {
  if (!l.zigzag) return cat(blocks, dim);
  std::vector<Tensor> pieces(static_cast<size_t>(2 * l.ranks));
  for (int r = 0; r < l.ranks; ++r) {
    for (int j = 0; j < 2; ++j) {
      pieces[static_cast<size_t>(l.piece(r, j).begin / l.piece_len())] =
          blocks[static_cast<size_t>(r)].narrow(dim, j * l.piece_len(), l.piece_len());
    }
  }
  return cat(pieces, dim);
}

Tensor rank_rows(const Tensor& full, const RankLayout& l, int r, int64_t dim) {
  std::vector<Tensor> pieces;
  for (int j = 0; j < l.pieces(); ++j) {
    const Block b = l.piece(r, j);
    pieces.push_back(full.narrow(dim, b.begin, b.size()));
  }
  return pieces.size() == 1 ? pieces[0] : cat(pieces, dim);
}

Tensor sequence_block(const Tensor& sequence, int rank, int size, SequenceLayout layout,
                      int64_t dim) {
  RD_CHECK(sequence.defined() && dim >= 0 && sequence.dim() > dim, kShapeMismatch,
           "sequence_block: argument 'sequence' must have the sequence in dim ", dim, ", got ",
           sequence.defined() ? shape_str(sequence.shape()) : std::string("undefined"));
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "sequence_block: rank ", rank,
           " is not in a group of ", size);
  const int64_t n = sequence.size(dim);
  const bool zigzag =
      resolve_layout_for("sequence_block", layout, nullptr, n, size) == SequenceLayout::kZigzag;
  return rank_rows(sequence, RankLayout{0, n / size, 0, 0, rank, size, zigzag}, rank, dim);
}

Tensor sequence_from_blocks(const std::vector<Tensor>& blocks, SequenceLayout layout, int64_t dim) {
  RD_CHECK(!blocks.empty() && blocks[0].defined() && dim >= 0 && blocks[0].dim() > dim,
           kShapeMismatch, "sequence_from_blocks: needs every rank's block, the sequence in dim ",
           dim);
  const auto size = static_cast<int>(blocks.size());
  const int64_t chunk = blocks[0].size(dim);
  for (const Tensor& b : blocks) {
    RD_CHECK(b.defined() && b.shape() == blocks[0].shape(), kShapeMismatch,
             "sequence_from_blocks: every block must have the shape ", shape_str(blocks[0].shape()),
             ", got ", b.defined() ? shape_str(b.shape()) : std::string("undefined"));
  }
  const bool zigzag = resolve_layout_for("sequence_from_blocks", layout, nullptr, chunk * size,
                                         size) == SequenceLayout::kZigzag;
  return join_rank_rows(blocks, RankLayout{0, chunk, 0, 0, 0, size, zigzag}, dim);
}

}  // namespace rd::nn
