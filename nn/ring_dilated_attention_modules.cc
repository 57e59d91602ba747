// RingDilatedAttention and RingMultiheadDilatedAttention (see ring_dilated_attention_modules.h).
#include "ringdilated/nn/ring_dilated_attention_modules.h"

#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace {

std::shared_ptr<dist::Communicator> checked(std::shared_ptr<dist::Communicator> comm,
                                            const char* module) {
  RD_CHECK(comm != nullptr, kInvalidArgument, module, ": argument 'comm' is null");
  return comm;
}

}  // namespace

RingDilatedAttention::RingDilatedAttention(DilatedAttentionOptions options,
                                           std::shared_ptr<dist::Communicator> comm,
                                           DistStrategy strategy, uint64_t dropout_seed,
                                           SequenceLayout layout)
    : DilatedAttention(std::move(options), dropout_seed,
                       checked(std::move(comm), "RingDilatedAttention"), strategy, layout) {}

SequenceLayout RingDilatedAttention::layout_for(int64_t seq_len) const {
  return resolve_layout(layout_, options_, seq_len, comm_->size());
}

RingMultiheadDilatedAttention::RingMultiheadDilatedAttention(
    int64_t embed_dim, int64_t num_heads, DilatedAttentionOptions options,
    std::shared_ptr<dist::Communicator> comm, Generator& generator, DistStrategy strategy,
    const MultiheadOptions& module_options, SequenceLayout layout)
    : MultiheadDilatedAttention("RingMultiheadDilatedAttention", embed_dim, num_heads, options,
                                generator, module_options, [&](uint64_t seed) {
                                  return std::make_shared<RingDilatedAttention>(
                                      options, checked(comm, "RingMultiheadDilatedAttention"),
                                      strategy, seed, layout);
                                }) {}

}  // namespace rd::nn
