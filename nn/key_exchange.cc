// The exchange of keys between the ranks of a split sequence (see key_exchange.h,
// docs/distributed.md).
#include "ringdilated/nn/key_exchange.h"

#include <memory>
#include <optional>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/dispatch.h"
#include "ringdilated/tensor/op_util.h"
#include "ringdilated/tensor/ops.h"

namespace rd::nn {
namespace {

using op_util::options_like;

// The communicator of this rank's gather group of `span` ranks: the whole group, or the
// sub-group of ranks [span * (rank / span), + span), split once and kept by `comm`. The
// color names the span too: ranks 0 and 1 are group 0 of spans 2 and 4 alike, and a cache
// keyed by rank / span alone would hand the span-4 call the span-2 group.
dist::Communicator& gather_comm(dist::Communicator& comm, int span) {
  if (span == comm.size()) return comm;
  return *comm.cached_split(span * comm.size() + comm.rank() / span, comm.rank());
}

// Bytes this rank has sent through `comm` and the sub-groups `p` gathers in.
int64_t bytes_sent_in(dist::Communicator& comm, const RankPlan& p) {
  int64_t bytes = comm.stats().bytes_sent;
  for (const ExchangeGroup& g : p.gathers) {
    if (g.span != comm.size()) bytes += gather_comm(comm, g.span).stats().bytes_sent;
  }
  return bytes;
}

// Copies this rank's rows of `group`'s units from k and v into `flat`.
void pack(const RankPlan& p, const ExchangeGroup& group, const Tensor& flat, const Tensor& k,
          const Tensor& v) {
  for (size_t i = 0; i < group.units.size(); ++i) {
    const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
    const RowRun mine = u.rows(p.layout, p.layout.rank);
    auto [kc, vc] = packed_rows(p, group, i, flat, p.layout.rank);
    kc.copy_(unit_rows(k, u.kv_heads, mine));
    vc.copy_(unit_rows(v, u.kv_heads, mine));
  }
}

// The rank `delta` places after `rank` on its ring: the aligned run of `span` ranks that
// holds it, closed into a cycle.
int ring_peer(int rank, int delta, int span) {
  const int first = rank - rank % span;
  return first + ((rank - first + delta) % span + span) % span;
}

// The first `elements` of a flat buffer.
Tensor prefix(const Tensor& flat, int64_t elements) { return flat.narrow(0, 0, elements); }

// The dK/dV accumulators of the ring's blocks, one step behind their K/V: step t adds this
// rank's share of block (me - t) into a zeroed buffer while that block's accumulator, summed
// by the ranks before, is in flight from rank me - 1; then adds it in and sends the sum on to
// me + 1, so each transfer overlaps the next step's calls. Three buffers: the one being
// written, the one being sent and the one being received.
class GradientRing {
 public:
  // Only the buffer written first starts at zero: the others are sent or received into
  // before they are read, and zeroed when they become the one written.
  GradientRing(const RankPlan& p, dist::Communicator& comm, const TensorOptions& acc_opts)
      : p_(p),
        comm_(comm),
        work_(zeros({p.ring.max_elements}, acc_opts)),
        outgoing_(empty({p.ring.max_elements}, acc_opts)),
        incoming_(empty({p.ring.max_elements}, acc_opts)) {}

  // The buffer step t's calls add into.
  const Tensor& work() const { return work_; }

  // After step t's calls on block src: adds the accumulator that arrived for it (t > 0) and,
  // before the last step, sends the sum on and starts receiving next_src's.
  void pass_on(int t, int src, int next_src) {
    if (t > 0) {
      inflight_->wait();
      add_into(prefix(work_, length(src)), prefix(incoming_, length(src)));
    }
    if (t == p_.ring_steps) return;
    std::swap(outgoing_, work_);  // the old outgoing buffer was sent by the wait above
    inflight_ = comm_.isendrecv(prefix(outgoing_, length(src)), peer(1),
                                prefix(incoming_, length(next_src)), peer(-1));
    work_.zero_();
  }

  // After the last step: the last block's sums go back to its owner, and this rank's own
  // arrive from the rank that visited it last.
  Tensor finish() {
    if (p_.ring_steps == 0) return work_;  // only this rank's own rows were read
    const int owner = peer(-p_.ring_steps);
    dist::send_recv(comm_, prefix(work_, length(owner)), owner,
                    prefix(incoming_, length(p_.layout.rank)), peer(p_.ring_steps));
    return incoming_;
  }

 private:
  int peer(int delta) const { return ring_peer(p_.layout.rank, delta, p_.ring_span); }
  int64_t length(int block) const { return p_.ring.elements[static_cast<size_t>(block)]; }

  const RankPlan& p_;
  dist::Communicator& comm_;
  Tensor work_, outgoing_, incoming_;
  std::unique_ptr<dist::Request> inflight_;
};

// The ring: step t attends block (me - t) while block (me - t - 1) is in flight; step 0 is
// `local()` and this rank's own rows (the zigzag layout's calls between its pieces).
void ring_exchange(const RankPlan& p, const Tensor& k, const Tensor& v, dist::Communicator& comm,
                   const ExchangeVisitor& visitor) {
  const int me = p.layout.rank;
  auto peer = [&](int delta) { return ring_peer(me, delta, p.ring_span); };
  auto length = [&](int block) { return p.ring.elements[static_cast<size_t>(block)]; };
  const bool ring = !p.ring.empty();
  Tensor cur, nxt;
  std::optional<GradientRing> grads;
  if (ring) {
    cur = empty({p.ring.max_elements}, options_like(k));
    nxt = empty({p.ring.max_elements}, options_like(k));
    pack(p, p.ring, prefix(cur, length(me)), k, v);
    if (visitor.backward) {
      grads.emplace(p, comm, TensorOptions(accumulation_dtype(k.dtype())).with_device(k.device()));
    }
  }
  for (int t = 0; t <= p.ring_steps; ++t) {
    const int src = peer(-t), next_src = peer(-t - 1);
    std::unique_ptr<dist::Request> step;
    if (t < p.ring_steps) {
      step = comm.isendrecv(prefix(cur, length(src)), peer(1), prefix(nxt, length(next_src)),
                            peer(-1));
    }
    if (t == 0) visitor.local();
    if (ring) visitor.visit(src, p.ring, cur, grads ? grads->work() : Tensor());
    if (grads) grads->pass_on(t, src, next_src);
    if (!step) continue;
    step->wait();
    std::swap(cur, nxt);
  }
  if (grads) visitor.home(p.ring, grads->finish());
}

// The all-gathered units: each gather group's rows, visited block by block (this rank's
// own too: the zigzag layout's calls between its pieces); the backward reduce-scatters
// their dK/dV to their owners.
void gather_exchange(const RankPlan& p, const Tensor& k, const Tensor& v, dist::Communicator& comm,
                     const ExchangeVisitor& visitor) {
  const int me = p.layout.rank;
  const TensorOptions acc_opts =
      TensorOptions(accumulation_dtype(k.dtype())).with_device(k.device());
  for (const ExchangeGroup& group : p.gathers) {
    dist::Communicator& gc = gather_comm(comm, group.span);
    const int first = me - gc.rank();  // the group's ranks: first, ..., first + span - 1
    Tensor mine = empty({group.max_elements}, options_like(k));
    pack(p, group, mine, k, v);
    Tensor all = empty({group.span, group.max_elements}, options_like(k));
    gc.all_gather(all, mine);
    const Tensor all_grads =
        visitor.backward ? zeros({group.span, group.max_elements}, acc_opts) : Tensor();
    for (int i = 0; i < group.span; ++i) {
      visitor.visit(first + i, group, all.select(0, i),
                    visitor.backward ? all_grads.select(0, i) : Tensor());
    }
    if (visitor.backward) {
      Tensor summed = empty({group.max_elements}, acc_opts);
      gc.reduce_scatter(summed, all_grads);
      visitor.home(group, summed);
    }
  }
}

}  // namespace

void exchange_keys(const RankPlan& plan, const Tensor& k, const Tensor& v, dist::Communicator* comm,
                   const ExchangeVisitor& visitor) {
  const bool exchanges = plan.ring_steps > 0 || !plan.ring.empty() || !plan.gathers.empty();
  RD_CHECK(comm != nullptr || !exchanges, kInternal,
           "exchange_keys: the plan exchanges keys but there is no communicator");
  if (!exchanges) {
    visitor.local();
    return;
  }
  ring_exchange(plan, k, v, *comm, visitor);
  gather_exchange(plan, k, v, *comm, visitor);
}

void unpack_key_grads(const RankPlan& p, const ExchangeGroup& group, const Tensor& flat,
                      const Tensor& grad_k, const Tensor& grad_v) {
  for (size_t i = 0; i < group.units.size(); ++i) {
    const ExchangeUnit& u = p.units[static_cast<size_t>(group.units[i])];
    const RowRun mine = u.rows(p.layout, p.layout.rank);
    auto [dk, dv] = packed_rows(p, group, i, flat, p.layout.rank);
    add_into(unit_rows(grad_k, u.kv_heads, mine), dk);
    add_into(unit_rows(grad_v, u.kv_heads, mine), dv);
  }
}

int64_t exchange_bytes_sent(dist::Communicator* comm, const RankPlan& plan) {
  return comm != nullptr ? bytes_sent_in(*comm, plan) : 0;
}

// target += addend, summed in the wider of the two dtypes and stored in target's: one
// rounding when that is a 16-bit float, none of target's float32 when the addend is narrower.
void add_into(const Tensor& target, const Tensor& addend) {
  if (accumulate_takes(target.dtype(), addend.dtype())) {
    backend_for(target.device())
        .accumulate(kernel_view(target, "add_into"), kernel_view(addend, "add_into"));
  } else if (dtype_size(addend.dtype()) < dtype_size(target.dtype())) {
    add_into(target, addend.to(target.dtype()));
  } else {
    target.detach().copy_(add(target.to(addend.dtype()), addend));
  }
}

}  // namespace rd::nn
