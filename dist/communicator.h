// The communicator interface every transport implements (in-process threads, NCCL, Gloo):
// point-to-point transfers, collectives, sub-groups, abort and traffic counters, all over
// Tensors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "ringdilated/tensor/tensor.h"

namespace rd::dist {

enum class ReduceOp { kSum, kMax, kMin };

const char* reduce_op_name(ReduceOp op);

// Bytes this rank moved. Point-to-point transfers count their payload; a collective counts
// what a bandwidth-optimal ring algorithm would send and receive per rank (all_gather and
// reduce_scatter (P - 1) / P of the gathered size, all_reduce twice that, broadcast the size
// on every rank but the root), so that figures compare across backends.
struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t sends = 0;
  int64_t receives = 0;
  int64_t collectives = 0;
};

// The CommStats accounting every backend shares, thread-safe.
class StatsCounter {
 public:
  void sent(int64_t bytes);      // one point-to-point send
  void received(int64_t bytes);  // one point-to-point receive
  // A collective over `size` ranks of `bytes` per rank (the whole gathered or reduced
  // tensor): all_gather and reduce_scatter send and receive (P - 1) / P of it, all_reduce
  // twice that, a broadcast root sends it to P - 1 ranks and the others receive it once.
  void all_gather(int64_t bytes, int size);
  void reduce_scatter(int64_t bytes, int size) { all_gather(bytes, size); }
  void all_reduce(int64_t bytes, int size);
  void broadcast(int64_t bytes, int size, bool root);
  void barrier();
  CommStats get() const;

 private:
  void add(int64_t sent, int64_t received);
  mutable std::mutex mu_;
  CommStats stats_;
};

int64_t nbytes_of(const Tensor& t);

// A pending isend or irecv. wait() returns once a send's tensor may be reused or a receive's
// tensor holds the data; it throws rd::Error (kTimeout, kAborted) when the transfer cannot
// finish. A Request destroyed unwaited waits first, swallowing any error.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

// One rank's handle on a group of `size()` ranks. Every call that names a tensor needs it
// contiguous and on device(); a violation is an rd::Error naming the op, the argument and
// the shapes. Collectives must be called by every rank of the group in the same order with
// matching shapes and dtypes. A communicator is used by one thread at a time.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  virtual std::string backend_name() const = 0;

  // Non-blocking point-to-point. Sends to one peer arrive in the order they were posted. The
  // tensor must stay alive and unchanged (send) or untouched (receive) until wait() returns.
  virtual std::unique_ptr<Request> isend(const Tensor& tensor, int peer) = 0;
  virtual std::unique_ptr<Request> irecv(const Tensor& tensor, int peer) = 0;
  // A send and a receive posted together, as one ring step needs: on transports that run
  // transfers in order on one stream (NCCL), posting them separately would deadlock a ring
  // in which every rank sends before it receives. By default, an irecv and an isend.
  virtual std::unique_ptr<Request> isendrecv(const Tensor& send, int to, const Tensor& recv,
                                             int from);

  // out [size, in.shape...]: out[j] = rank j's `in`.
  virtual void all_gather(const Tensor& out, const Tensor& in) = 0;
  // in [size, out.shape...]: out = the reduction over ranks j of rank j's in[rank()].
  virtual void reduce_scatter(const Tensor& out, const Tensor& in,
                              ReduceOp op = ReduceOp::kSum) = 0;
  // tensor = the reduction over ranks of their `tensor`, on every rank, in place.
  virtual void all_reduce(const Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // all_reduce that may return before the reduction is done, so that work queued after it
  // (the rest of a backward pass) overlaps it: `tensor` must stay alive and untouched until
  // wait() returns, and holds the result from then on. By default (the CPU backends) the
  // reduction is done before this returns. NCCL queues it on the communicator's stream after
  // the work the caller's stream queued so far; wait() then makes the caller's current
  // stream wait for it (the host does not).
  virtual std::unique_ptr<Request> iall_reduce(const Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // tensor = root's tensor, on every rank.
  virtual void broadcast(const Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;

  // Collective: the ranks that pass the same color >= 0 form a new communicator, ranked by
  // (key, old rank). A negative color joins none and gets nullptr.
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;
  // split(color, key), made by the first call and kept by this communicator for the later
  // ones, so that a layer can ask for its sub-group on every call. Collective the first time:
  // every rank must ask for its (color, key) in the same order.
  std::shared_ptr<Communicator> cached_split(int color, int key);

  // Fails the group: every pending and later operation of every rank throws kAborted, naming
  // this rank and `reason`. How a rank that failed stops the others instead of hanging them.
  virtual void abort(const std::string& reason) = 0;

  virtual CommStats stats() const = 0;

 private:
  std::mutex splits_mu_;
  std::map<std::pair<int, int>, std::shared_ptr<Communicator>> splits_;
};

// For Request destructors: waits unless the request was waited for already, swallowing any
// error (a destructor must not throw; wait()'s callers got the error when there were any).
void wait_quietly(Request& request, bool waited) noexcept;

// Sends `send` to rank `to` while receiving `recv` from rank `from` (isendrecv), and waits.
void send_recv(Communicator& comm, const Tensor& send, int to, const Tensor& recv, int from);

// The argument checks every backend runs (so a bad call reads the same on every backend).
void check_peer(const Communicator& comm, const char* op, int peer);
void check_comm_tensor(const Communicator& comm, const char* op, const char* name, const Tensor& t);
// check_peer and check_comm_tensor of argument 'tensor': what isend, irecv and broadcast check.
void check_peer_and_tensor(const Communicator& comm, const char* op, int peer,
                           const Tensor& tensor);
void check_all_gather_args(const Communicator& comm, const Tensor& out, const Tensor& in);
void check_reduce_scatter_args(const Communicator& comm, const Tensor& out, const Tensor& in);

}  // namespace rd::dist
