// The Gloo communicator (see gloo.h). Collectives are Gloo's (allgather, ring allreduce,
// broadcast), each preceded by an allgather of a small signature (op, dtype, shape, root,
// color, key), so that ranks calling different collectives or shapes fail with a clear error
// instead of corrupting Gloo's stream (a mismatched size kills Gloo's event-loop thread), and
// so that barrier and split are that exchange itself. Point-to-point transfers are Gloo
// unbound buffers: a fixed-size header then the payload, on two slots whose per-pair FIFO
// order keeps sends to one peer in order. Failures go through the store (see gloo.h).
#include "ringdilated/dist/gloo.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <csignal>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "ringdilated/dist/peer_failures.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/strided.h"
#include "ringdilated/tensor/ops.h"

namespace rd::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kBackend = "gloo";
// Store keys: rd/gloo/<group>/... for Gloo's rendezvous; rd/failed/<world rank> for the
// record a rank leaves when it aborts or times out (a code letter, then the message).
constexpr const char* kFailedPrefix = "rd/failed/";
constexpr char kTimeoutRecord = 'T', kAbortRecord = 'A';
// Gloo slots (prefix byte, as gloo::Slot builds them) of point-to-point headers and
// payloads, apart from the prefixes Gloo's collectives use (0x01-0x08).
constexpr uint64_t kHeaderSlot = uint64_t{0x52} << 56;
constexpr uint64_t kPayloadSlot = uint64_t{0x53} << 56;

// Gloo signals timeouts only through the text of its IoException.
bool is_gloo_timeout(const std::string& message) {
  return message.find("Timed out") != std::string::npos ||
         message.find("timeout") != std::string::npos;
}

// A tensor's dtype and shape, as a fixed-size record that can cross the wire.
struct Layout {
  int32_t dtype = -1;  // -1: no tensor
  int32_t ndim = 0;
  int64_t shape[kernels::kMaxDims] = {};

  static Layout of(const char* op, const Tensor& t) {
    RD_CHECK(t.dim() <= kernels::kMaxDims, kInvalidArgument, op, ": tensors may have at most ",
             kernels::kMaxDims, " dims, got shape ", shape_str(t.shape()));
    Layout l;
    l.dtype = static_cast<int32_t>(t.dtype());
    l.ndim = static_cast<int32_t>(t.dim());
    std::copy(t.shape().begin(), t.shape().end(), l.shape);
    return l;
  }
  bool operator==(const Layout& o) const {
    return dtype == o.dtype && ndim == o.ndim && std::equal(shape, shape + ndim, o.shape);
  }
  std::string str() const {
    if (dtype < 0) return "no tensor";
    return str_cat(shape_str(Shape(shape, shape + ndim)), " ",
                   dtype_name(static_cast<DType>(dtype)));
  }
  int64_t nbytes() const {
    int64_t n = dtype < 0 ? 0 : static_cast<int64_t>(dtype_size(static_cast<DType>(dtype)));
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
};

enum class CollectiveOp : int32_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kSplit
};

const char* collective_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kBarrier: return "barrier";
    case CollectiveOp::kSplit: return "split";
  }
  return "?";
}

// What every rank announces before a collective.
struct Signature {
  CollectiveOp op = CollectiveOp::kBarrier;
  int32_t arg = 0;  // the root (broadcast), the ReduceOp (reductions) or the color (split)
  int32_t key = 0;  // split
  int32_t pad = 0;
  Layout layout;
};

// Gloo's rendezvous store interface over a TcpStore, under a key prefix (one per group).
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<TcpStore> store, std::string prefix, milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = store_->get(prefix_ + key, timeout_);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    for (const std::string& k : keys) prefixed.push_back(prefix_ + k);
    store_->wait(prefixed, timeout);
  }

 private:
  std::shared_ptr<TcpStore> store_;
  std::string prefix_;
  milliseconds timeout_;
};

// What the communicators one process builds (the world and its splits) share.
struct Process {
  std::shared_ptr<TcpStore> store;
  std::shared_ptr<gloo::transport::Device> device;
  GlooOptions options;
};

struct Failure {
  ErrorCode code;
  std::string message;
};

// Reduction kernels for Gloo's allreduce. Max and min propagate NaN (as rd::maximum does).
template <class T>
gloo::AllreduceOptions::Func reduce_function(ReduceOp op) {
  auto apply = [](auto pick) {
    return [pick](void* out, const void* a, const void* b, size_t n) {
      T* o = static_cast<T*>(out);
      const T* x = static_cast<const T*>(a);
      const T* y = static_cast<const T*>(b);
      for (size_t i = 0; i < n; ++i) o[i] = pick(x[i], y[i]);
    };
  };
  switch (op) {
    case ReduceOp::kSum: return apply([](T x, T y) { return x + y; });
    case ReduceOp::kMax: return apply([](T x, T y) { return (x > y || x != x) ? x : y; });
    case ReduceOp::kMin: return apply([](T x, T y) { return (x < y || x != x) ? x : y; });
  }
  return nullptr;
}

// Gloo's allreduce on a contiguous CPU tensor of a dtype Gloo can add natively.
void gloo_allreduce(const std::shared_ptr<gloo::Context>& context, const Tensor& work, ReduceOp op,
                    uint32_t tag, milliseconds timeout) {
  gloo::AllreduceOptions o(context);
  auto in_place = [&]<class T>(T*) {
    o.setOutput(work.data_ptr<T>(), static_cast<size_t>(work.numel()));
    o.setReduceFunction(reduce_function<T>(op));
  };
  switch (work.dtype()) {
    case DType::kFloat32: in_place(static_cast<float*>(nullptr)); break;
    case DType::kFloat64: in_place(static_cast<double*>(nullptr)); break;
    case DType::kInt32: in_place(static_cast<int32_t*>(nullptr)); break;
    case DType::kInt64: in_place(static_cast<int64_t*>(nullptr)); break;
    default:
      RD_FAIL(kInternal, "gloo_allreduce: no native reduction for ", dtype_name(work.dtype()));
  }
  o.setTag(tag);
  o.setTimeout(timeout);
  gloo::allreduce(o);
}

// 16-bit floats and bools reduce in float32, as the in-process backend does (16-bit sums
// would round at every step); the other dtypes natively.
bool reduces_natively(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kInt32 || d == DType::kInt64;
}

class GlooComm;

// One irecv: its header arrives first; once checked, its payload's receive is posted.
struct Incoming {
  int peer = 0;
  Tensor into;
  Layout expected, header;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_buffer, payload_buffer;
  bool payload_posted = false;
};

class GlooComm final : public Communicator, public std::enable_shared_from_this<GlooComm> {
 public:
  GlooComm(std::shared_ptr<Process> process, std::string group, std::vector<int> world_ranks,
           int rank)
      : process_(std::move(process)),
        group_(std::move(group)),
        world_ranks_(std::move(world_ranks)),
        rank_(rank) {}

  // Joins the group's Gloo context: the store rendezvous, then a connection to every peer.
  void connect() {
    const GlooOptions& o = process_->options;
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size());
    context->setTimeout(o.rendezvous_timeout);
    StoreAdapter store(process_->store, str_cat("rd/gloo/", group_, "/"), o.rendezvous_timeout);
    const std::string what =
        str_cat("gloo communicator: ", who(), " could not join group '", group_, "' (", size(),
                " ranks) through the store at ", process_->store->address(), ": ");
    try {
      context->connectFullMesh(store, process_->device);
    } catch (const Error& e) {
      throw Error(e.code(), what + e.what() +
                                (e.code() == ErrorCode::kTimeout
                                     ? str_cat(" (did all ", size(), " ranks start?)")
                                     : std::string()));
    } catch (const std::exception& e) {  // Gloo's own: a peer that never connected, ...
      throw Error(is_gloo_timeout(e.what()) ? ErrorCode::kTimeout : ErrorCode::kIo,
                  what + e.what());
    }
    context->setTimeout(o.timeout);
    context_ = std::move(context);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(world_ranks_.size()); }
  Device device() const override { return Device::cpu(); }
  std::string backend_name() const override { return kBackend; }

  std::unique_ptr<Request> isend(const Tensor& tensor, int peer) override;
  std::unique_ptr<Request> irecv(const Tensor& tensor, int peer) override;

  void all_gather(const Tensor& out, const Tensor& in) override {
    check_all_gather_args(*this, out, in);
    collective(signature(CollectiveOp::kAllGather, in), [&](uint32_t tag, const auto&) {
      const auto bytes = static_cast<size_t>(nbytes_of(in));
      if (bytes == 0) return;
      gloo::AllgatherOptions o(context_);
      o.setInput(static_cast<uint8_t*>(in.raw_data()), bytes);
      o.setOutput(static_cast<uint8_t*>(out.raw_data()), bytes * static_cast<size_t>(size()));
      o.setTag(tag);
      o.setTimeout(timeout());
      gloo::allgather(o);
    });
    stats_.all_gather(nbytes_of(out), size());
  }

  // Gloo's reduce-scatter is the old bound-buffer API over float types only; an allreduce of
  // a copy, sliced, serves every dtype and is deterministic (the ring's reduction order does
  // not depend on the rank that reads the result). It moves twice the bytes of a ring
  // reduce-scatter; the stats count the ring's, like every backend.
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_reduce_scatter_args(*this, out, in);
    collective(signature(CollectiveOp::kReduceScatter, in, static_cast<int>(op)),
               [&](uint32_t tag, const auto&) {
                 const Tensor work = reduce_copy(in, op, tag);
                 out.detach().copy_(work.select(0, rank_));
               });
    stats_.reduce_scatter(nbytes_of(in), size());
  }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    check_comm_tensor(*this, "all_reduce", "tensor", tensor);
    collective(signature(CollectiveOp::kAllReduce, tensor, static_cast<int>(op)),
               [&](uint32_t tag, const auto&) {
                 if (reduces_natively(tensor.dtype())) {
                   if (tensor.numel() > 0) gloo_allreduce(context_, tensor, op, tag, timeout());
                 } else {
                   tensor.detach().copy_(reduce_copy(tensor, op, tag));
                 }
               });
    stats_.all_reduce(nbytes_of(tensor), size());
  }

  void broadcast(const Tensor& tensor, int root) override {
    check_peer_and_tensor(*this, "broadcast", root, tensor);
    collective(signature(CollectiveOp::kBroadcast, tensor, root), [&](uint32_t tag, const auto&) {
      const auto bytes = static_cast<size_t>(nbytes_of(tensor));
      if (bytes == 0 || size() == 1) return;
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<uint8_t*>(tensor.raw_data()), bytes);
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(timeout());
      gloo::broadcast(o);
    });
    stats_.broadcast(nbytes_of(tensor), size(), rank_ == root);
  }

  // The signature exchange is an allgather, which no rank leaves before every rank entered.
  void barrier() override {
    collective(Signature{}, [](uint32_t, const auto&) {});
    stats_.barrier();
  }

  std::shared_ptr<Communicator> split(int color, int key) override;

  void abort(const std::string& reason) override {
    record_failure(kAbortRecord, str_cat(world_name(), " aborted: ", reason));
  }

  CommStats stats() const override { return stats_.get(); }

  // --- used by the requests ---
  milliseconds timeout() const { return process_->options.timeout; }

  // Runs `body`, turning Gloo's exceptions into rd::Errors (see fail()); `what` names the
  // operation in messages.
  template <class Body>
  void guarded(const std::string& what, Body&& body) {
    throw_if_failed(what);
    try {
      body();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      fail(what, e.what());
    }
  }

  void wait_send(gloo::transport::UnboundBuffer& buffer) {
    RD_CHECK(buffer.waitSend(timeout()), kAborted, "gloo communicator: ", who(),
             ": a send was interrupted");
  }
  void wait_recv(gloo::transport::UnboundBuffer& buffer) {
    RD_CHECK(buffer.waitRecv(timeout()), kAborted, "gloo communicator: ", who(),
             ": a receive was interrupted");
  }

  // The n-th irecv from this rank itself takes the n-th message it sent itself. The
  // communicator serves one thread at a time, so a message not sent yet never will be.
  void receive_from_self(uint64_t number, const Tensor& into) {
    throw_if_failed("irecv from itself");
    const auto it = to_self_.find(number);
    RD_CHECK(it != to_self_.end(), kInvalidArgument, "irecv: rank ", rank_,
             " waits for its message #", number, " to itself, which it has not sent (a send ",
             "to oneself must be posted before the matching receive is waited for)");
    const Tensor message = it->second;
    to_self_.erase(it);
    RD_CHECK(message.shape() == into.shape() && message.dtype() == into.dtype(), kShapeMismatch,
             "irecv: rank ", rank_, " posted a receive of ", Layout::of("irecv", into).str(),
             " but sent itself ", Layout::of("isend", message).str());
    into.detach().copy_(message);
  }

  // Completes the header stage of every irecv from in->peer posted before `in` (so payload
  // receives are posted in irecv order, which Gloo's FIFO matching needs), then waits for
  // in's payload.
  void finish_recv(Incoming& in) {
    guarded(str_cat("irecv from rank ", in.peer), [&] {
      std::deque<std::shared_ptr<Incoming>>& queue = unposted_[in.peer];
      while (!in.payload_posted) {
        const std::shared_ptr<Incoming> first = queue.front();
        queue.pop_front();
        post_payload(*first);
      }
      if (in.payload_buffer) wait_recv(*in.payload_buffer);
    });
  }

 private:
  std::string who() const {
    if (group_ == "world") return str_cat("rank ", rank_);
    return str_cat("rank ", rank_, " of group '", group_, "' (world rank ", world_rank(), ")");
  }
  int world_rank() const { return world_ranks_[static_cast<size_t>(rank_)]; }
  std::string world_name() const { return str_cat("rank ", world_rank()); }

  Signature signature(CollectiveOp op, const Tensor& t, int arg = 0) const {
    Signature s;
    s.op = op;
    s.arg = arg;
    s.layout = Layout::of(collective_name(op), t);
    return s;
  }

  // Exchanges signatures, checks that they agree, runs body(tag, signatures), counts it.
  template <class Body>
  void collective(const Signature& mine, Body&& body) {
    const uint32_t number = next_collective_++;
    const std::string what = str_cat(collective_name(mine.op), " (collective #", number, ")");
    guarded(what, [&] {
      const std::vector<Signature> all = exchange(mine, 2 * number);
      check_signatures(all, number);
      body(2 * number + 1, all);
    });
  }

  std::vector<Signature> exchange(const Signature& mine, uint32_t tag) {
    std::vector<Signature> all(static_cast<size_t>(size()));
    if (size() == 1) {
      all[0] = mine;
      return all;
    }
    Signature in = mine;
    gloo::AllgatherOptions o(context_);
    o.setInput(&in, 1);
    o.setOutput(all.data(), all.size());
    o.setTag(tag);
    o.setTimeout(timeout());
    gloo::allgather(o);
    return all;
  }

  // Every rank sees every signature, so every rank throws the same error on a mismatch and
  // none is left waiting.
  void check_signatures(const std::vector<Signature>& all, uint32_t number) const {
    const Signature& mine = all[static_cast<size_t>(rank_)];
    const char* op = collective_name(mine.op);
    for (int j = 0; j < size(); ++j) {
      const Signature& theirs = all[static_cast<size_t>(j)];
      RD_CHECK(theirs.op == mine.op, kInvalidArgument, "gloo communicator: collective #", number,
               " is ", op, " on rank ", rank_, " but ", collective_name(theirs.op), " on rank ", j,
               ": every rank must call the same collectives in the same order");
      RD_CHECK(theirs.layout == mine.layout, kShapeMismatch, op, ": rank ", rank_, " passed ",
               mine.layout.str(), " but rank ", j, " passed ", theirs.layout.str());
      if (mine.op == CollectiveOp::kBroadcast) {
        RD_CHECK(theirs.arg == mine.arg, kInvalidArgument, "broadcast: rank ", rank_,
                 " names root ", mine.arg, " but rank ", j, " names ", theirs.arg);
      } else if (mine.op == CollectiveOp::kAllReduce || mine.op == CollectiveOp::kReduceScatter) {
        RD_CHECK(theirs.arg == mine.arg, kInvalidArgument, op, ": rank ", rank_, " reduces with ",
                 reduce_op_name(static_cast<ReduceOp>(mine.arg)), " but rank ", j, " with ",
                 reduce_op_name(static_cast<ReduceOp>(theirs.arg)));
      }
    }
  }

  // The allreduce of a copy of `t` in a dtype Gloo reduces natively.
  Tensor reduce_copy(const Tensor& t, ReduceOp op, uint32_t tag) {
    Tensor work = reduces_natively(t.dtype()) ? t.detach().clone()
                                              : t.detach().to(DType::kFloat32).contiguous();
    if (work.numel() > 0) gloo_allreduce(context_, work, op, tag, timeout());
    return work;
  }

  void post_payload(Incoming& in) {
    wait_recv(*in.header_buffer);
    if (!(in.header == in.expected)) {
      const std::string message =
          str_cat("irecv: rank ", rank_, " posted a receive of ", in.expected.str(), " but rank ",
                  in.peer, " sent ", in.header.str());
      // The payload that follows has nowhere to go: this stream, and so the group, is broken.
      record_failure(kAbortRecord, str_cat(world_name(), " aborted: ", message));
      RD_FAIL(kShapeMismatch, message);
    }
    const auto bytes = static_cast<size_t>(in.expected.nbytes());
    if (bytes > 0) {
      in.payload_buffer = context_->createUnboundBuffer(in.into.raw_data(), bytes);
      in.payload_buffer->recv(in.peer, kPayloadSlot);
    }
    in.payload_posted = true;
  }

  // After a failure (an abort, a timeout, a broken connection) every operation, pending or
  // new, throws kAborted with the first failure's message.
  void throw_if_failed(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    RD_CHECK(!failure_, kAborted, "gloo communicator: ", who(), ": ", what,
             " failed: the group was aborted: ", failure_->message);
  }

  // Records this rank's failure, once: locally (every later operation throws), in the store
  // (so the other ranks can name this rank), then closes this rank's connections (so theirs
  // fail now rather than at their timeout). Returns false when a failure was recorded before.
  bool record_failure(char kind, const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_) return false;
      failure_ =
          Failure{kind == kTimeoutRecord ? ErrorCode::kTimeout : ErrorCode::kAborted, message};
    }
    try {
      process_->store->set(str_cat(kFailedPrefix, world_rank()), std::string(1, kind) + message);
    } catch (const std::exception&) {  // the store is gone too: the peers still see us close
    }
    close_connections();
    return true;
  }

  // Gloo has no public call that fails a context's pending operations. An unbound buffer
  // whose wait times out does exactly that (every pair of the context fails its pending
  // operations and closes its socket), so a zero-timeout wait on an idle buffer is the abort.
  void close_connections() {
    if (!context_) return;
    char unused = 0;
    const std::unique_ptr<gloo::transport::UnboundBuffer> buffer =
        context_->createUnboundBuffer(&unused, 1);
    try {
      buffer->waitRecv(nullptr, milliseconds(0));
    } catch (const std::exception&) {  // the "timeout" we asked for
    }
  }

  // Turns a Gloo exception during `what` into an rd::Error. A timeout of this rank is recorded
  // (kTimeout); a broken connection is explained by the first failure another rank recorded.
  [[noreturn]] void fail(const std::string& what, const std::string& gloo_message) {
    throw_if_failed(what);  // this rank aborted (or failed) while the operation ran
    if (is_gloo_timeout(gloo_message)) {
      const std::string message =
          str_cat(world_name(), " timed out after ", timeout().count(), " ms in ", what);
      record_failure(kTimeoutRecord, message);
      RD_FAIL(kTimeout, "gloo communicator: ", who(), " waited more than ", timeout().count(),
              " ms in ", what, " for the other ranks (gloo: ", gloo_message, ")");
    }
    const std::optional<Failure> cause = first_recorded_failure();
    const Failure failure = cause.value_or(Failure{
        ErrorCode::kAborted, "a connection to another rank broke and no rank recorded a failure"});
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_) failure_ = failure;
    }
    close_connections();
    throw Error(failure.code, str_cat("gloo communicator: ", who(), ": ", what, " failed because ",
                                      failure.message, " (gloo: ", gloo_message, ")"));
  }

  // The first failure another rank recorded: an abort or timeout record, else a rank whose
  // process left. Looks for up to options.failure_lookup, since the record may land just
  // after the connection broke (a timed-out rank closes its connections before recording).
  std::optional<Failure> first_recorded_failure() const {
    const Clock::time_point deadline = Clock::now() + process_->options.failure_lookup;
    for (;;) {
      if (const std::optional<PeerFailure> failure =
              first_peer_failure(*process_->store, kFailedPrefix, world_rank())) {
        if (!failure->recorded) return Failure{ErrorCode::kAborted, failure->text};
        // A code letter, then the message (first_peer_failure skips empty records).
        const std::string& record = failure->text;
        return Failure{record[0] == kTimeoutRecord ? ErrorCode::kTimeout : ErrorCode::kAborted,
                       record.substr(1)};
      }
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  std::shared_ptr<Process> process_;
  std::string group_;             // "world", or "world/split<n>/color<c>" and so on
  std::vector<int> world_ranks_;  // group rank -> world rank
  int rank_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t next_collective_ = 0;
  // Per peer, the irecvs whose payload receive is not posted yet, in irecv order.
  std::map<int, std::deque<std::shared_ptr<Incoming>>> unposted_;
  // Transfers to this rank itself never touch Gloo (it has no connection to itself): an isend
  // copies its tensor here under its number, which the matching irecv takes.
  std::map<uint64_t, Tensor> to_self_;
  uint64_t self_sends_ = 0, self_receives_ = 0;
  mutable std::mutex mu_;  // failure_: abort() may come from another thread
  std::optional<Failure> failure_;
  StatsCounter stats_;
};

// An isend: the header and the payload are both posted at once.
class SendRequest final : public Request {
 public:
  SendRequest(std::shared_ptr<GlooComm> comm, int peer, const Tensor& tensor,
              const std::shared_ptr<gloo::Context>& context)
      : comm_(std::move(comm)), peer_(peer), tensor_(tensor), header_(Layout::of("isend", tensor)) {
    header_buffer_ = context->createUnboundBuffer(&header_, sizeof(header_));
    header_buffer_->send(peer, kHeaderSlot);
    const auto bytes = static_cast<size_t>(header_.nbytes());
    if (bytes > 0) {
      payload_buffer_ = context->createUnboundBuffer(tensor.raw_data(), bytes);
      payload_buffer_->send(peer, kPayloadSlot);
    }
  }
  ~SendRequest() override { wait_quietly(*this, done_); }
  void wait() override {
    done_ = true;
    comm_->guarded(str_cat("isend to rank ", peer_), [&] {
      comm_->wait_send(*header_buffer_);
      if (payload_buffer_) comm_->wait_send(*payload_buffer_);
    });
  }

 private:
  std::shared_ptr<GlooComm> comm_;
  int peer_;
  Tensor tensor_;  // kept alive while Gloo reads it
  Layout header_;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_buffer_, payload_buffer_;
  bool done_ = false;
};

class RecvRequest final : public Request {
 public:
  RecvRequest(std::shared_ptr<GlooComm> comm, std::shared_ptr<Incoming> incoming)
      : comm_(std::move(comm)), incoming_(std::move(incoming)) {}
  ~RecvRequest() override { wait_quietly(*this, done_); }
  void wait() override {
    done_ = true;
    comm_->finish_recv(*incoming_);
  }

 private:
  std::shared_ptr<GlooComm> comm_;
  std::shared_ptr<Incoming> incoming_;
  bool done_ = false;
};

// An isend to this rank itself: the copy is made at once, so there is nothing to wait for.
class DoneRequest final : public Request {
 public:
  void wait() override {}
};

// An irecv from this rank itself: the n-th one takes the n-th message this rank sent itself.
class SelfRecvRequest final : public Request {
 public:
  SelfRecvRequest(std::shared_ptr<GlooComm> comm, uint64_t number, Tensor into)
      : comm_(std::move(comm)), number_(number), into_(std::move(into)) {}
  ~SelfRecvRequest() override { wait_quietly(*this, done_); }
  void wait() override {
    done_ = true;
    comm_->receive_from_self(number_, into_);
  }

 private:
  std::shared_ptr<GlooComm> comm_;
  uint64_t number_;
  Tensor into_;
  bool done_ = false;
};

std::unique_ptr<Request> GlooComm::isend(const Tensor& tensor, int peer) {
  check_peer_and_tensor(*this, "isend", peer, tensor);
  throw_if_failed(str_cat("isend to rank ", peer));
  stats_.sent(nbytes_of(tensor));
  if (peer == rank_) {
    to_self_[self_sends_++] = tensor.detach().clone();
    return std::make_unique<DoneRequest>();
  }
  std::unique_ptr<Request> request;
  guarded(str_cat("isend to rank ", peer), [&] {
    request = std::make_unique<SendRequest>(shared_from_this(), peer, tensor, context_);
  });
  return request;
}

std::unique_ptr<Request> GlooComm::irecv(const Tensor& tensor, int peer) {
  check_peer_and_tensor(*this, "irecv", peer, tensor);
  throw_if_failed(str_cat("irecv from rank ", peer));
  stats_.received(nbytes_of(tensor));
  if (peer == rank_) {
    return std::make_unique<SelfRecvRequest>(shared_from_this(), self_receives_++, tensor);
  }
  auto incoming = std::make_shared<Incoming>();
  incoming->peer = peer;
  incoming->into = tensor;
  incoming->expected = Layout::of("irecv", tensor);
  guarded(str_cat("irecv from rank ", peer), [&] {
    incoming->header_buffer = context_->createUnboundBuffer(&incoming->header, sizeof(Layout));
    incoming->header_buffer->recv(peer, kHeaderSlot);
  });
  unposted_[peer].push_back(incoming);
  return std::make_unique<RecvRequest>(shared_from_this(), std::move(incoming));
}

std::shared_ptr<Communicator> GlooComm::split(int color, int key) {
  Signature mine;
  mine.op = CollectiveOp::kSplit;
  mine.arg = color;
  mine.key = key;
  const uint32_t number = next_collective_;
  std::shared_ptr<GlooComm> result;
  collective(mine, [&](uint32_t, const std::vector<Signature>& all) {
    if (color < 0) return;
    std::vector<std::pair<int, int>> members;  // (key, old rank) of this color
    for (int j = 0; j < size(); ++j) {
      const Signature& s = all[static_cast<size_t>(j)];
      if (s.arg == color) members.push_back({s.key, j});
    }
    std::sort(members.begin(), members.end());
    std::vector<int> world_ranks;
    int new_rank = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      world_ranks.push_back(world_ranks_[static_cast<size_t>(members[i].second)]);
      if (members[i].second == rank_) new_rank = static_cast<int>(i);
    }
    result =
        std::make_shared<GlooComm>(process_, str_cat(group_, "/split", number, "/color", color),
                                   std::move(world_ranks), new_rank);
    result->connect();
  });
  return result;
}

void ignore_sigpipe_if_default() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

bool gloo_available() { return true; }

std::shared_ptr<Communicator> make_gloo_communicator(std::shared_ptr<TcpStore> store, int rank,
                                                     int size, const GlooOptions& options) {
  RD_CHECK(store != nullptr, kInvalidArgument, "make_gloo_communicator: argument 'store' is null");
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "make_gloo_communicator: rank ",
           rank, " is outside a group of ", size, " ranks");
  RD_CHECK(options.timeout.count() > 0 && options.rendezvous_timeout.count() > 0, kInvalidArgument,
           "make_gloo_communicator: options 'timeout' and 'rendezvous_timeout' must be "
           "positive, got ",
           options.timeout.count(), " and ", options.rendezvous_timeout.count(), " ms");
  ignore_sigpipe_if_default();
  auto process = std::make_shared<Process>();
  process->store = std::move(store);
  process->options = options;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    process->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    RD_FAIL(kInvalidArgument, "make_gloo_communicator: cannot listen on host '", options.hostname,
            "': ", e.what());
  }
  std::vector<int> world_ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) world_ranks[static_cast<size_t>(r)] = r;
  auto comm = std::make_shared<GlooComm>(std::move(process), "world", std::move(world_ranks), rank);
  comm->connect();
  return comm;
}

}  // namespace rd::dist
