// How a rank's calls get other ranks' keys: the exchange units of a RankPlan go around the
// ring (keys one step ahead, dK/dV one step behind) or are all-gathered in their sub-groups
// (dK/dV reduce-scattered back), and a visitor runs the calls on each block as it arrives.
#pragma once

#include <cstdint>
#include <functional>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/nn/rank_plan.h"
#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// What a pass does with the exchanged rows: `local()` runs the calls on this rank's own
// keys; `visit(src, group, flat, grads)` the calls on block src's packed rows of `group`'s
// units in `flat`; the backward also gets, in `grads`, a float32 buffer laid out like `flat`
// for src's dK/dV, and `home(group, mine)` with this rank's own dK/dV once every rank has
// added to them.
struct ExchangeVisitor {
  std::function<void()> local;
  std::function<void(int src, const ExchangeGroup& group, const Tensor& flat, const Tensor& grads)>
      visit;
  std::function<void(const ExchangeGroup& group, const Tensor& mine)> home;
  bool backward = false;
};

// Runs `visitor` over every block this rank needs: local() first, then the ring's blocks as
// they arrive (each transfer overlapping the previous block's calls), then the all-gathered
// ones. `comm` may be null when the plan exchanges nothing (one rank).
void exchange_keys(const RankPlan& plan, const Tensor& k, const Tensor& v, dist::Communicator* comm,
                   const ExchangeVisitor& visitor);

// Adds this rank's packed dK/dV rows of `group` (in `flat`, laid out as the group packs
// them) into grad_k and grad_v.
void unpack_key_grads(const RankPlan& plan, const ExchangeGroup& group, const Tensor& flat,
                      const Tensor& grad_k, const Tensor& grad_v);

// Bytes this rank has sent through `comm` and the sub-groups `plan` gathers in (0 for none).
int64_t exchange_bytes_sent(dist::Communicator* comm, const RankPlan& plan);

// target += addend, summed in the wider of the two dtypes and stored in target's dtype: one
// rounding when that is a 16-bit float; a float32 target keeps its precision under a 16-bit
// addend (widened first).
void add_into(const Tensor& target, const Tensor& addend);

}  // namespace rd::nn
