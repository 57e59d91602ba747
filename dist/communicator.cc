// Communicator helpers shared by every backend: argument checks, traffic counters and the
// paired send/receive.
#include "ringdilated/dist/communicator.h"

#include <utility>
#include <vector>

#include "ringdilated/kernels/error.h"

namespace rd::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

namespace {

// Waits for a receive, then its send.
class PairRequest final : public Request {
 public:
  PairRequest(std::unique_ptr<Request> receiving, std::unique_ptr<Request> sending)
      : receiving_(std::move(receiving)), sending_(std::move(sending)) {}
  void wait() override {
    receiving_->wait();
    sending_->wait();
  }

 private:
  std::unique_ptr<Request> receiving_, sending_;
};

// An operation that was complete when it was posted.
class CompletedRequest final : public Request {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<Request> Communicator::iall_reduce(const Tensor& tensor, ReduceOp op) {
  all_reduce(tensor, op);
  return std::make_unique<CompletedRequest>();
}

std::unique_ptr<Request> Communicator::isendrecv(const Tensor& send, int to, const Tensor& recv,
                                                 int from) {
  std::unique_ptr<Request> receiving = irecv(recv, from);
  return std::make_unique<PairRequest>(std::move(receiving), isend(send, to));
}

void wait_quietly(Request& request, bool waited) noexcept {
  if (waited) return;
  try {
    request.wait();
  } catch (...) {  // see the declaration
  }
}

void send_recv(Communicator& comm, const Tensor& send, int to, const Tensor& recv, int from) {
  comm.isendrecv(send, to, recv, from)->wait();
}

int64_t nbytes_of(const Tensor& t) {
  return t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
}

void StatsCounter::sent(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_sent += bytes;
  ++stats_.sends;
}

void StatsCounter::received(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_received += bytes;
  ++stats_.receives;
}

void StatsCounter::add(int64_t sent, int64_t received) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_sent += sent;
  stats_.bytes_received += received;
  ++stats_.collectives;
}

std::shared_ptr<Communicator> Communicator::cached_split(int color, int key) {
  std::lock_guard<std::mutex> lock(splits_mu_);
  auto [it, inserted] = splits_.try_emplace({color, key});
  if (inserted) {
    try {
      it->second = split(color, key);
    } catch (...) {
      splits_.erase(it);  // a failed split is not kept: the next call reports it again
      throw;
    }
  }
  return it->second;
}

void StatsCounter::all_gather(int64_t bytes, int size) {
  const int64_t moved = bytes * (size - 1) / size;
  add(moved, moved);
}

void StatsCounter::all_reduce(int64_t bytes, int size) {
  const int64_t moved = 2 * bytes * (size - 1) / size;
  add(moved, moved);
}

void StatsCounter::broadcast(int64_t bytes, int size, bool root) {
  if (root) {
    add(bytes * (size - 1), 0);
  } else {
    add(0, bytes);
  }
}

void StatsCounter::barrier() { add(0, 0); }

CommStats StatsCounter::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void check_peer(const Communicator& comm, const char* op, int peer) {
  RD_CHECK(peer >= 0 && peer < comm.size(), kOutOfRange, op, ": peer rank ", peer,
           " is outside the group of ", comm.size(), " ranks (this is rank ", comm.rank(), ")");
}

void check_comm_tensor(const Communicator& comm, const char* op, const char* name,
                       const Tensor& t) {
  RD_CHECK(t.defined(), kInvalidArgument, op, ": argument '", name, "' is undefined");
  RD_CHECK(t.is_contiguous(), kInvalidArgument, op, ": argument '", name,
           "' must be contiguous, got shape ", shape_str(t.shape()), " with strides ",
           shape_str(t.strides()));
  RD_CHECK(t.device() == comm.device(), kDeviceMismatch, op, ": argument '", name, "' is on ",
           t.device().str(), " but the communicator (", comm.backend_name(), ") moves data on ",
           comm.device().str());
}

void check_peer_and_tensor(const Communicator& comm, const char* op, int peer,
                           const Tensor& tensor) {
  check_peer(comm, op, peer);
  check_comm_tensor(comm, op, "tensor", tensor);
}

namespace {

// [size, inner...] against inner: the shape a gathered or scattered buffer must have.
void check_stacked(const Communicator& comm, const char* op, const char* stacked_name,
                   const Tensor& stacked, const char* inner_name, const Tensor& inner) {
  check_comm_tensor(comm, op, stacked_name, stacked);
  check_comm_tensor(comm, op, inner_name, inner);
  Shape expected{comm.size()};
  for (int64_t d : inner.shape()) expected.push_back(d);
  RD_CHECK(stacked.shape() == expected, kShapeMismatch, op, ": argument '", stacked_name,
           "' must be [size, ", inner_name, ".shape...] = ", shape_str(expected), ", got ",
           shape_str(stacked.shape()));
  RD_CHECK(stacked.dtype() == inner.dtype(), kDTypeMismatch, op, ": arguments '", stacked_name,
           "' (", dtype_name(stacked.dtype()), ") and '", inner_name, "' (",
           dtype_name(inner.dtype()), ") must have one dtype");
}

}  // namespace

void check_all_gather_args(const Communicator& comm, const Tensor& out, const Tensor& in) {
  check_stacked(comm, "all_gather", "out", out, "in", in);
}

void check_reduce_scatter_args(const Communicator& comm, const Tensor& out, const Tensor& in) {
  check_stacked(comm, "reduce_scatter", "in", in, "out", out);
}

}  // namespace rd::dist
