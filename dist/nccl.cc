// The NCCL communicator (see nccl.h). libnccl.so.2 is opened at run time and its entry points
// resolved once. Every operation runs on the communicator's own stream after the work the
// caller's current stream queued so far (an event orders them), and the caller's stream then
// waits for it: results are stream-ordered and transfers overlap the compute queued between
// a request and its wait(). Host waits (barrier) poll NCCL's asynchronous error state and
// abort the communicator on an error or past the timeout; with the job's store, a watchdog
// thread also aborts it when another rank is gone, so a failed peer cannot hang us. The
// communicators are non-blocking (NcclOptions::nonblocking): NCCL calls that would wait on
// the host for other ranks return ncclInProgress instead, and the same bounded host wait
// polls them until NCCL has done its part.
#include "ringdilated/dist/nccl.h"

#include "ringdilated/kernels/error.h"

#if defined(RD_WITH_CUDA)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "ringdilated/dist/peer_failures.h"
#include "ringdilated/dist/poll.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/tensor/device.h"
#endif

namespace rd::dist {

#if defined(RD_WITH_CUDA)
namespace {

constexpr const char* kBackend = "nccl";
// Where a rank that aborts its communicator says why, for the other ranks' watchdogs.
constexpr const char* kAbortPrefix = "rd/nccl_abort/";

using Clock = std::chrono::steady_clock;

// How often a host wait looks at a CUDA event or at a non-blocking communicator's state.
constexpr std::chrono::microseconds kPollInterval{100};
// How long a wait for NCCL's thread to enqueue an operation (NcclComm::finish_issue) looks
// again at once before it sleeps kPollInterval between looks: enqueueing usually takes tens
// of microseconds, and a sleep would add a hundred or more to every operation.
constexpr std::chrono::microseconds kEnqueueSpin{500};

// The NCCL entry points this backend uses.
struct NcclApi {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  // With a configuration (non-blocking: NcclOptions::nonblocking); NCCL 2.14 and later,
  // which ncclCommSplit (2.18) implies.
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclCommSplit) split = nullptr;
  decltype(&ncclCommCount) count = nullptr;
  decltype(&ncclCommUserRank) user_rank = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string problem;  // why NCCL cannot be used; empty when it can
};

template <class F>
void resolve(void* handle, const char* name, F* fn, std::string* problem) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  if (*fn == nullptr && problem->empty()) *problem = str_cat("libnccl.so.2 has no ", name);
}

// Loaded once per process and never changed after: read-only state, like the loaded library.
const NcclApi& api() {
  static const NcclApi* const loaded = [] {
    auto* a = new NcclApi;
    void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* error = dlerror();
      a->problem = str_cat("libnccl.so.2 could not be loaded (", error ? error : "?", ")");
      return a;
    }
    resolve(handle, "ncclGetUniqueId", &a->get_unique_id, &a->problem);
    resolve(handle, "ncclCommInitRankConfig", &a->init_rank_config, &a->problem);
    resolve(handle, "ncclCommDestroy", &a->destroy, &a->problem);
    resolve(handle, "ncclCommAbort", &a->abort, &a->problem);
    resolve(handle, "ncclCommGetAsyncError", &a->async_error, &a->problem);
    resolve(handle, "ncclCommSplit", &a->split, &a->problem);
    resolve(handle, "ncclCommCount", &a->count, &a->problem);
    resolve(handle, "ncclCommUserRank", &a->user_rank, &a->problem);
    resolve(handle, "ncclSend", &a->send, &a->problem);
    resolve(handle, "ncclRecv", &a->recv, &a->problem);
    resolve(handle, "ncclAllGather", &a->all_gather, &a->problem);
    resolve(handle, "ncclReduceScatter", &a->reduce_scatter, &a->problem);
    resolve(handle, "ncclAllReduce", &a->all_reduce, &a->problem);
    resolve(handle, "ncclBroadcast", &a->broadcast, &a->problem);
    resolve(handle, "ncclGroupStart", &a->group_start, &a->problem);
    resolve(handle, "ncclGroupEnd", &a->group_end, &a->problem);
    resolve(handle, "ncclGetErrorString", &a->error_string, &a->problem);
    return a;
  }();
  return *loaded;
}

const NcclApi& checked_api(const char* op) {
  const NcclApi& a = api();
  RD_CHECK(a.problem.empty(), kUnimplemented, op, ": NCCL is not available: ", a.problem);
  return a;
}

void check_nccl(ncclResult_t result, const char* op, int rank) {
  if (result == ncclSuccess) return;
  RD_FAIL(kInternal, "nccl ", op, " on rank ", rank, ": ", api().error_string(result));
}

ncclDataType_t nccl_dtype(DType dtype, const char* op) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kBool: return ncclUint8;
  }
  RD_FAIL(kDTypeMismatch, op, ": NCCL cannot move dtype ", dtype_name(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// Destroys a CUDA event (std::unique_ptr's deleter): errors on the way out are not raised.
struct EventDestroyer {
  void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
};

// An event that marks the end of one operation on the communication stream; the tensors it
// touches stay alive until the caller's stream has been told to wait for it.
class StreamRequest final : public Request {
 public:
  StreamRequest(int device, cudaEvent_t done, std::vector<Tensor> keep)
      : device_(device), done_(done), keep_(std::move(keep)) {}
  ~StreamRequest() override {
    if (done_ == nullptr) return;
    try {
      wait();
    } catch (...) {  // destructors must not throw
    }
  }
  // Stream-ordered: the caller's current stream waits; the host does not.
  void wait() override {
    if (done_ == nullptr) return;
    kernels::cuda::DeviceGuard guard(device_);
    const cudaEvent_t done = std::exchange(done_, nullptr);
    RD_CUDA_CHECK(cudaStreamWaitEvent(kernels::cuda::current_stream(device_), done, 0));
    RD_CUDA_CHECK(cudaEventDestroy(done));
    keep_.clear();
  }

 private:
  int device_;
  cudaEvent_t done_;
  std::vector<Tensor> keep_;
};

class NcclComm;

// One per process group made with a store (NcclOptions::store): a thread that looks, every
// watch_interval, for another rank's abort record or departure in the store, and has each
// communicator of this process (the group and its splits) check its health against it.
class PeerWatchdog {
 public:
  explicit PeerWatchdog(const NcclOptions& options)
      : store_(options.store), interval_(options.watch_interval) {
    thread_ = std::thread([this] { loop(); });
  }
  ~PeerWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  PeerWatchdog(const PeerWatchdog&) = delete;
  PeerWatchdog& operator=(const PeerWatchdog&) = delete;

  // A communicator is checked from add() until remove() returns (its destructor calls it).
  void add(NcclComm* comm) {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.push_back(comm);
  }
  void remove(NcclComm* comm) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(comms_, comm);
  }

  // Tells the other ranks' watchdogs that this process aborted and why, naming its rank in
  // the job (a split's own rank would be ambiguous across sub-groups).
  void publish_abort(const std::string& reason) {
    try {
      store_->set(str_cat(kAbortPrefix, own_rank()),
                  str_cat("rank ", own_rank(), " aborted: ", reason));
    } catch (const std::exception&) {  // the store is gone: the others see this rank leave
    }
  }

 private:
  int own_rank() const { return store_->options().rank; }

  void loop();

  // The first failure of another rank the store knows of: an abort record, else a rank
  // whose process left; an unreachable store means rank 0 (which serves it) is gone.
  std::optional<std::string> peer_failure() {
    std::optional<PeerFailure> failure = first_peer_failure(*store_, kAbortPrefix, own_rank());
    if (!failure) return std::nullopt;
    return std::move(failure->text);  // an abort record is already the message
  }

  std::shared_ptr<TcpStore> store_;
  std::chrono::milliseconds interval_;
  std::mutex mu_;  // comms_, stop_
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<NcclComm*> comms_;
  std::thread thread_;
};

// The shared state of one group whose ranks are threads of this process (make_nccl_group),
// or of one color of one of its splits. Ranks that are threads share the CUDA driver, whose
// process-wide locks (taken by lazy kernel loading, cudaMalloc, cudaHostAlloc, ...) a thread
// may hold while it waits for its own GPU; were an NCCL kernel of its rank still waiting
// there for a peer thread that needs the same lock, neither could go on. So these ranks
// finish every operation before they return (NcclComm::settle), and the ledger counts the
// operations each rank issued, so that a rank that waits too long can name the ranks that
// never issued the operation, and abort every rank of the group (a rank alone cannot stop
// the kernels of the others, which would spin forever).
class ThreadLedger {
 public:
  explicit ThreadLedger(int size) : issued_(static_cast<size_t>(size)) {}

  void add(NcclComm* comm) {
    std::lock_guard<std::mutex> lock(mu_);
    members_.push_back(comm);
  }
  void remove(NcclComm* comm) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(members_, comm);
  }

  // Rank `rank` issued its operation number `count` (counting from 1).
  void issued(int rank, int64_t count) { issued_[static_cast<size_t>(rank)].store(count); }

  // The ranks that have not issued operation number `count`, as "1, 3"; empty when all did.
  std::string missing(int64_t count) const {
    std::string ranks;
    for (size_t r = 0; r < issued_.size(); ++r) {
      if (issued_[r].load() < count) ranks += str_cat(ranks.empty() ? "" : ", ", r);
    }
    return ranks;
  }

  // The ledger of the sub-group of color `color` made by split number `split` (the same on
  // every rank: splits are collective and ordered); the first rank to ask creates it.
  std::shared_ptr<ThreadLedger> child(int64_t split, int color, int size) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<ThreadLedger>& c = children_[{split, color}];
    if (!c) c = std::make_shared<ThreadLedger>(size);
    return c;
  }

  // Fails every rank of the group (defined after NcclComm).
  void abort_all(const std::string& reason);

 private:
  std::vector<std::atomic<int64_t>> issued_;
  std::mutex mu_;  // members_, children_
  std::vector<NcclComm*> members_;
  std::map<std::pair<int64_t, int>, std::shared_ptr<ThreadLedger>> children_;
};

class NcclComm final : public Communicator {
 public:
  // `ledger` is given for ranks that are threads of this process (make_nccl_group), and
  // `watchdog` for a process of a job with a store; never both.
  NcclComm(ncclComm_t comm, int rank, int size, Device device, NcclOptions options,
           std::shared_ptr<PeerWatchdog> watchdog, std::shared_ptr<ThreadLedger> ledger = nullptr)
      : comm_(comm),
        rank_(rank),
        size_(size),
        device_(device),
        options_(std::move(options)),
        watchdog_(std::move(watchdog)),
        ledger_(std::move(ledger)) {
    kernels::cuda::DeviceGuard guard(device_.index);
    RD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (watchdog_) watchdog_->add(this);
    if (ledger_) ledger_->add(this);
  }

  ~NcclComm() override {
    // Nothing here may throw: errors on the way out are reported, not raised.
    if (watchdog_) watchdog_->remove(this);
    if (ledger_) ledger_->remove(this);
    kernels::cuda::DeviceGuard guard(device_.index);
    if (!aborted_) {
      // With a failed peer, destroy could wait for it: abort frees the same resources. So it
      // does for an asynchronous error, where ncclCommDestroy would refuse the communicator
      // (it returns the error and frees nothing).
      ncclResult_t state = ncclSuccess;
      api().async_error(comm_, &state);
      const bool failed = !failure().empty() || state != ncclSuccess;
      if (!failed) cudaStreamSynchronize(stream_);
      const ncclResult_t r = failed ? api().abort(comm_) : api().destroy(comm_);
      if (r != ncclSuccess) {
        std::fprintf(stderr, "[ringdilated] nccl: destroy failed on rank %d\n", rank_);
      }
    }
    cudaStreamDestroy(stream_);
  }

  // The watchdog's check (see NcclOptions::store): a failure of another rank, or NCCL's
  // asynchronous error. A peer's failure fails new operations at once; queued work gets
  // peer_grace to finish. An asynchronous error (often the consequence of a peer's death)
  // waits as long for the store to name its cause.
  void check_health(const std::optional<std::string>& peer_failure) {
    if (aborted_) return;
    const std::string async = async_error_message();
    if (!peer_failure && async.empty()) return;
    const Clock::time_point now = Clock::now();
    if (!trouble_since_) trouble_since_ = now;
    const bool waited = now - *trouble_since_ >= options_.peer_grace;
    if (peer_failure) {
      record_failure(*peer_failure);
      if (waited && has_queued_work()) abort_locally(*peer_failure);
    } else if (waited) {
      abort(async);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  std::string backend_name() const override { return kBackend; }

  std::unique_ptr<Request> isend(const Tensor& tensor, int peer) override {
    check_peer_and_tensor(*this, "isend", peer, tensor);
    stats_.sent(nbytes_of(tensor));
    return settled(p2p("isend", tensor, peer, Tensor(), -1), "isend");
  }

  std::unique_ptr<Request> irecv(const Tensor& tensor, int peer) override {
    check_peer_and_tensor(*this, "irecv", peer, tensor);
    stats_.received(nbytes_of(tensor));
    return settled(p2p("irecv", Tensor(), -1, tensor, peer), "irecv");
  }

  std::unique_ptr<Request> isendrecv(const Tensor& send, int to, const Tensor& recv,
                                     int from) override {
    check_peer(*this, "isendrecv", to);
    check_peer(*this, "isendrecv", from);
    check_comm_tensor(*this, "isendrecv", "send", send);
    check_comm_tensor(*this, "isendrecv", "recv", recv);
    stats_.sent(nbytes_of(send));
    stats_.received(nbytes_of(recv));
    return settled(p2p("isendrecv", send, to, recv, from), "isendrecv");
  }

  void all_gather(const Tensor& out, const Tensor& in) override {
    check_all_gather_args(*this, out, in);
    run("all_gather", [&](cudaStream_t s) {
      return api().all_gather(in.raw_data(), out.raw_data(), static_cast<size_t>(in.numel()),
                              nccl_dtype(in.dtype(), "all_gather"), comm_, s);
    });
    stats_.all_gather(nbytes_of(out), size_);
    settle("all_gather");
  }

  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_reduce_scatter_args(*this, out, in);
    run("reduce_scatter", [&](cudaStream_t s) {
      return api().reduce_scatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                                  nccl_dtype(in.dtype(), "reduce_scatter"), nccl_op(op), comm_, s);
    });
    stats_.reduce_scatter(nbytes_of(in), size_);
    settle("reduce_scatter");
  }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    check_comm_tensor(*this, "all_reduce", "tensor", tensor);
    run("all_reduce", [&](cudaStream_t s) {
      return api().all_reduce(tensor.raw_data(), tensor.raw_data(),
                              static_cast<size_t>(tensor.numel()),
                              nccl_dtype(tensor.dtype(), "all_reduce"), nccl_op(op), comm_, s);
    });
    stats_.all_reduce(nbytes_of(tensor), size_);
    settle("all_reduce");
  }

  // Queued like all_reduce, but the caller's stream waits only in the request's wait(), so
  // that the work the caller queues meanwhile overlaps the reduction.
  std::unique_ptr<Request> iall_reduce(const Tensor& tensor, ReduceOp op) override {
    check_comm_tensor(*this, "iall_reduce", "tensor", tensor);
    std::unique_ptr<Request> request;
    {
      std::unique_lock<std::timed_mutex> lock(issue_mu_);
      check_alive("iall_reduce");
      checked_api("iall_reduce");
      kernels::cuda::DeviceGuard guard(device_.index);
      follow(kernels::cuda::current_stream(device_.index));
      finish_issue(lock,
                   api().all_reduce(
                       tensor.raw_data(), tensor.raw_data(), static_cast<size_t>(tensor.numel()),
                       nccl_dtype(tensor.dtype(), "iall_reduce"), nccl_op(op), comm_, stream_),
                   "iall_reduce");
      request = std::make_unique<StreamRequest>(device_.index, mark_done(),
                                                std::vector<Tensor>{tensor});
    }
    stats_.all_reduce(nbytes_of(tensor), size_);
    settle("iall_reduce");
    return request;
  }

  void broadcast(const Tensor& tensor, int root) override {
    check_peer_and_tensor(*this, "broadcast", root, tensor);
    run("broadcast", [&](cudaStream_t s) {
      return api().broadcast(tensor.raw_data(), tensor.raw_data(),
                             static_cast<size_t>(tensor.numel()),
                             nccl_dtype(tensor.dtype(), "broadcast"), root, comm_, s);
    });
    stats_.broadcast(nbytes_of(tensor), size_, rank_ == root);
    settle("broadcast");
  }

  // A one-element all-reduce the host waits for, polling NCCL's error state.
  void barrier() override {
    const Tensor token = zeros({1}, TensorOptions(DType::kFloat32).with_device(device_));
    cudaEvent_t done = run(
        "barrier",
        [&](cudaStream_t s) {
          return api().all_reduce(token.raw_data(), token.raw_data(), 1, ncclFloat32, ncclSum,
                                  comm_, s);
        },
        /*keep_event=*/true);
    host_wait(done, "barrier");
    stats_.barrier();
  }

  // Collective over this group's ranks, and counted as one of its operations (a rank that
  // never splits is named). The child inherits the configuration (non-blocking or not).
  std::shared_ptr<Communicator> split(int color, int key) override {
    std::unique_lock<std::timed_mutex> lock(issue_mu_);
    check_alive("split");
    kernels::cuda::DeviceGuard guard(device_.index);
    // NCCL's set-up thread writes the child into `slot` when it ends, which for a
    // non-blocking communicator can be after ncclCommSplit returned ncclSuccess (2.28 does:
    // the split's group end answers ncclInProgress, the split returns its own success). So
    // the slot is on the heap and freed only once that write is seen; a failed split leaks
    // it (one pointer) rather than leave NCCL's thread a dangling address.
    auto* slot = new ncclComm_t(nullptr);
    const auto written = [slot] { return __atomic_load_n(slot, __ATOMIC_ACQUIRE); };
    try {
      ncclResult_t result =
          api().split(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, slot, nullptr);
      // The parent's state says when NCCL's thread is done (it is ncclInProgress until then).
      if (options_.nonblocking && result == ncclSuccess) result = ncclInProgress;
      finish_issue(lock, result, "split");
      if (color >= 0 && options_.nonblocking) {
        lock.unlock();
        wait_on_host("split", [&] { return child_ready(written()); });
        lock.lock();
      }
    } catch (...) {
      // NCCL's advice: a child made by a failed split is aborted too.
      if (ncclComm_t child = written(); child != nullptr) api().abort(child);
      throw;
    }
    const ncclComm_t child = written();
    delete slot;
    if (color < 0 || child == nullptr) return nullptr;
    int child_rank = 0, child_size = 0;
    check_nccl(api().user_rank(child, &child_rank), "split", rank_);
    check_nccl(api().count(child, &child_size), "split", rank_);
    std::shared_ptr<ThreadLedger> child_ledger =
        ledger_ ? ledger_->child(splits_made_++, color, child_size) : nullptr;
    return std::make_shared<NcclComm>(child, child_rank, child_size, device_, options_, watchdog_,
                                      std::move(child_ledger));
  }

  // Whether a non-blocking split's child is set up: written by NCCL's thread and out of
  // ncclInProgress. A failed set-up raises, naming the split.
  bool child_ready(ncclComm_t child) {
    if (child == nullptr) return false;
    ncclResult_t state = ncclInProgress;
    check_nccl(api().async_error(child, &state), "split", rank_);
    if (state == ncclInProgress) return false;
    check_nccl(state, "split", rank_);
    return true;
  }

  // Aborts here and on the other ranks: through the store (processes), or directly (threads).
  void abort(const std::string& reason) override {
    if (watchdog_ && failure().empty()) watchdog_->publish_abort(reason);
    if (ledger_) {
      ledger_->abort_all(str_cat("rank ", rank_, ": ", reason));
    } else {
      abort_locally(reason);
    }
  }

  // Fails every later operation and frees NCCL's work. The issuing thread holds issue_mu_
  // only while it enqueues; if it is stuck inside NCCL (waiting for a dead peer), abort
  // anyway after peer_grace, since ncclCommAbort is what releases it.
  void abort_locally(const std::string& reason) {
    record_failure(reason);
    std::unique_lock<std::timed_mutex> lock(issue_mu_, std::defer_lock);
    (void)lock.try_lock_for(options_.peer_grace);
    if (aborted_.exchange(true)) return;
    kernels::cuda::DeviceGuard guard(device_.index);
    // Blocking even for a non-blocking communicator (NCCL's "Fault Tolerance" guide): it
    // stops NCCL's background work (a connection waiting for an absent rank, too) and joins
    // its thread before it frees the communicator.
    api().abort(comm_);
  }

  CommStats stats() const override { return stats_.get(); }

 private:
  // Why the group failed; empty while it has not.
  std::string failure() const {
    std::lock_guard<std::mutex> lock(failure_mu_);
    return failure_;
  }

  // The first failure is kept: it names the cause, later ones its consequences.
  void record_failure(const std::string& reason) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) failure_ = reason;
  }

  // NCCL's asynchronous error, as a message; empty when there is none (or another thread
  // holds issue_mu_: the next look asks again).
  std::string async_error_message() {
    ncclResult_t async = ncclSuccess;
    std::unique_lock<std::timed_mutex> lock(issue_mu_, std::try_to_lock);
    if (lock.owns_lock() && !aborted_) api().async_error(comm_, &async);
    if (async == ncclSuccess || async == ncclInProgress) return "";
    return str_cat("asynchronous NCCL error on rank ", rank_, ": ", api().error_string(async));
  }

  // Whether NCCL work (or the caller's work it waits for) is still queued on our stream.
  bool has_queued_work() const {
    kernels::cuda::DeviceGuard guard(device_.index);
    return cudaStreamQuery(stream_) == cudaErrorNotReady;
  }

  // Called with issue_mu_ held, so that no abort frees comm_ while the caller uses it.
  void check_alive(const char* op) const {
    const std::string why = failure();
    RD_CHECK(why.empty() && !aborted_, kAborted, "nccl ", op, " on rank ", rank_,
             ": the communicator was aborted: ", why);
  }

  // Issues `issue(stream)` on the communication stream after the caller's queued work; the
  // caller's stream then waits for it. Returns the end event when asked to keep it (the
  // caller destroys it), else destroys it.
  cudaEvent_t run(const char* op, const std::function<ncclResult_t(cudaStream_t)>& issue,
                  bool keep_event = false) {
    std::unique_lock<std::timed_mutex> lock(issue_mu_);
    check_alive(op);
    checked_api(op);
    kernels::cuda::DeviceGuard guard(device_.index);
    const cudaStream_t caller = kernels::cuda::current_stream(device_.index);
    follow(caller);
    finish_issue(lock, issue(stream_), op);
    const cudaEvent_t done = mark_done();
    RD_CUDA_CHECK(cudaStreamWaitEvent(caller, done, 0));
    if (keep_event) return done;
    RD_CUDA_CHECK(cudaEventDestroy(done));
    return nullptr;
  }

  // Called with issue_mu_ held after an operation was issued: counts it, for the ledger.
  void count_issued() {
    ++ops_issued_;
    if (ledger_) ledger_->issued(rank_, ops_issued_);
  }

  // Called with issue_mu_ held (by `lock`) right after the NCCL call of `op` on comm_
  // returned `result`. A non-blocking communicator answers ncclInProgress while NCCL's own
  // thread does the call's work, which may wait for the other ranks (the first operation
  // between two ranks connects them); until its state leaves ncclInProgress, NCCL forbids
  // another call on comm_ and any CUDA work on our stream (an event recorded there would come
  // before NCCL's kernel). So this waits for it on the host, bounded by the timeout like every
  // host wait, without issue_mu_ (an abort, by the watchdog or by another rank's thread,
  // needs it to stop the stuck work), and fails as host_wait does. The operation counts as
  // issued either way: a rank that waits here has done its part.
  void finish_issue(std::unique_lock<std::timed_mutex>& lock, ncclResult_t result, const char* op) {
    if (result != ncclInProgress) {
      check_nccl(result, op, rank_);
      count_issued();
      return;
    }
    count_issued();
    lock.unlock();
    wait_on_host(
        op, [this] { return enqueued(); }, kEnqueueSpin);
    lock.lock();
    check_alive(op);  // aborted after the last look
  }

  // Whether NCCL's background work on comm_ (see finish_issue) ended without error. False
  // while it goes on, after an error (wait_on_host's look at NCCL's asynchronous error
  // handles that) and once aborted (comm_ is gone).
  bool enqueued() {
    std::lock_guard<std::timed_mutex> lock(issue_mu_);
    if (aborted_) return false;
    ncclResult_t state = ncclInProgress;
    return api().async_error(comm_, &state) == ncclSuccess && state == ncclSuccess;
  }

  // Ranks that are threads (see ThreadLedger) wait here, on the host, until the operation
  // just issued is done, failing past the timeout; other ranks return at once (their
  // operations are stream-ordered). Called without issue_mu_, which an abort may need.
  void settle(const char* op) {
    if (!ledger_ || options_.thread_ranks_overlap) return;
    cudaEvent_t done = nullptr;
    {
      kernels::cuda::DeviceGuard guard(device_.index);
      RD_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      RD_CUDA_CHECK(cudaEventRecord(done, stream_));
    }
    host_wait(done, op);
  }

  std::unique_ptr<Request> settled(std::unique_ptr<Request> request, const char* op) {
    settle(op);
    return request;
  }

  // For a timeout message: the ranks that never issued this rank's latest operation, when
  // known (ranks that are threads); empty otherwise.
  std::string waiting_for() const {
    if (!ledger_) return "";
    const std::string missing = ledger_->missing(ops_issued_);
    return missing.empty() ? std::string("; every rank issued it")
                           : str_cat("; ranks that never issued it: ", missing);
  }

  // Makes the communication stream wait for the work `caller` queued so far.
  void follow(cudaStream_t caller) {
    cudaEvent_t ready = nullptr;
    RD_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    RD_CUDA_CHECK(cudaEventRecord(ready, caller));
    RD_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    RD_CUDA_CHECK(cudaEventDestroy(ready));
  }

  // An event at the end of the work queued on the communication stream so far.
  cudaEvent_t mark_done() {
    cudaEvent_t done = nullptr;
    RD_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    RD_CUDA_CHECK(cudaEventRecord(done, stream_));
    return done;
  }

  // A send and/or a receive in one NCCL group, so that a ring of them cannot deadlock.
  std::unique_ptr<Request> p2p(const char* op, const Tensor& send, int to, const Tensor& recv,
                               int from) {
    std::unique_lock<std::timed_mutex> lock(issue_mu_);
    check_alive(op);
    checked_api(op);
    kernels::cuda::DeviceGuard guard(device_.index);
    follow(kernels::cuda::current_stream(device_.index));
    check_nccl(api().group_start(), op, rank_);
    ncclResult_t result = ncclSuccess;
    if (send.defined()) {
      result = api().send(send.raw_data(), static_cast<size_t>(send.numel()),
                          nccl_dtype(send.dtype(), op), to, comm_, stream_);
    }
    if (result == ncclSuccess && recv.defined()) {
      result = api().recv(recv.raw_data(), static_cast<size_t>(recv.numel()),
                          nccl_dtype(recv.dtype(), op), from, comm_, stream_);
    }
    // The group's end does the work: ncclInProgress from it, as from any call.
    const ncclResult_t ended = api().group_end();
    check_nccl(result, op, rank_);
    finish_issue(lock, ended, op);
    return std::make_unique<StreamRequest>(device_.index, mark_done(),
                                           std::vector<Tensor>{send, recv});
  }

  // Blocks until `done` fires, as wait_on_host; destroys it however the wait ends.
  void host_wait(cudaEvent_t done, const char* op) {
    const std::unique_ptr<CUevent_st, EventDestroyer> owned(done);
    wait_on_host(op, [done] {
      const cudaError_t status = cudaEventQuery(done);
      if (status != cudaErrorNotReady) RD_CUDA_CHECK(status);
      return status == cudaSuccess;
    });
  }

  // Called without issue_mu_: polls `finished` until it says the awaited NCCL work is done
  // (at once again during `spin`, see poll_until). Fails (and aborts the communicator) on an
  // asynchronous NCCL error or past the timeout, naming the op and the rank, and, for ranks that
  // are threads, the ranks that never issued the op; fails with kAborted when the communicator was
  // aborted meanwhile (by the watchdog, or by another rank of a group of threads).
  void wait_on_host(const char* op, const std::function<bool()>& finished,
                    std::chrono::microseconds spin = std::chrono::microseconds(0)) {
    const auto look = [&] {
      if (finished()) return true;
      const std::string async = async_error_message();
      if (aborted_) {  // the work is over, or never will be
        RD_FAIL(kAborted, "nccl ", op, " on rank ", rank_, ": the communicator was aborted: ",
                failure());
      }
      // With a watchdog, it decides (it first looks in the store for the cause).
      if (!async.empty() && !watchdog_) {
        abort(async);
        RD_FAIL(kAborted, "nccl ", op, " on rank ", rank_, ": ", failure());
      }
      return false;
    };
    if (poll_until(look, Clock::now() + options_.timeout, kPollInterval, spin)) return;
    const std::string why = str_cat(
        "nccl ", op, " (operation #", ops_issued_, " of a group of ", size_, ") on rank ", rank_,
        " waited more than ", options_.timeout.count(), " ms for the other ranks", waiting_for());
    abort(why);
    RD_FAIL(kTimeout, why, "; communicator aborted");
  }

  ncclComm_t comm_;
  int rank_, size_;
  Device device_;
  NcclOptions options_;
  std::shared_ptr<PeerWatchdog> watchdog_;  // null without a store
  std::shared_ptr<ThreadLedger> ledger_;    // null unless the ranks are threads
  int64_t ops_issued_ = 0;                  // operations enqueued (under issue_mu_)
  int64_t splits_made_ = 0;                 // split() calls (under issue_mu_)
  cudaStream_t stream_ = nullptr;
  // Held while NCCL calls are issued on comm_ (abort_locally waits for it): ncclCommAbort
  // frees comm_, so nothing may be using it then.
  std::timed_mutex issue_mu_;
  std::atomic<bool> aborted_{false};  // ncclCommAbort was called: comm_ is gone
  mutable std::mutex failure_mu_;
  std::string failure_;  // why the group failed: the first reason; empty while healthy
  std::optional<Clock::time_point> trouble_since_;  // the watchdog's: when it first saw trouble
  StatsCounter stats_;
};

void ThreadLedger::abort_all(const std::string& reason) {
  std::vector<std::shared_ptr<ThreadLedger>> children;
  {
    std::lock_guard<std::mutex> lock(mu_);  // members stay alive: their destructors wait here
    for (NcclComm* comm : members_) comm->abort_locally(reason);
    for (const auto& [key, child] : children_) children.push_back(child);
  }
  // The sub-groups fail too, as a process's watchdog fails every communicator it watches.
  for (const std::shared_ptr<ThreadLedger>& child : children) child->abort_all(reason);
}

void PeerWatchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, interval_, [this] { return stop_; })) {
    // The store is asked without the lock: a communicator's destructor may wait for it.
    lock.unlock();
    const std::optional<std::string> failure = peer_failure();
    lock.lock();
    for (NcclComm* comm : comms_) comm->check_health(failure);
  }
}

void check_cuda_device(Device device, const char* op) {
  RD_CHECK(device.is_cuda(), kDeviceMismatch, op, ": NCCL ranks live on CUDA devices, got ",
           device.str());
}

// The state of communicators being set up: ncclInProgress while one still is, else the
// first error, else ncclSuccess.
ncclResult_t setup_state(const std::vector<ncclComm_t>& comms) {
  ncclResult_t first_error = ncclSuccess;
  for (ncclComm_t comm : comms) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = api().async_error(comm, &state);
    if (asked != ncclSuccess) state = asked;
    if (state == ncclInProgress) return ncclInProgress;
    if (first_error == ncclSuccess) first_error = state;
  }
  return first_error;
}

// Creates this process's communicators: rank ranks[i] of `size` on devices[i], joined
// through `id`, in one NCCL group (a thread that creates several must: NCCL's "Group Calls"
// guide). Non-blocking ones (NcclOptions::nonblocking) are set up by NCCL's thread, which
// waits for the other ranks: that wait is bounded by options.timeout. A failure or the
// timeout aborts the communicators made (which also stops a setup still waiting) and fails,
// with kTimeout for the timeout.
std::vector<ncclComm_t> init_comms(const ncclUniqueId& id, int size, const std::vector<int>& ranks,
                                   const std::vector<Device>& devices, const NcclOptions& options,
                                   const char* op) {
  const NcclApi& a = api();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.nonblocking ? 0 : 1;
  std::vector<ncclComm_t> comms(ranks.size(), nullptr);
  ncclResult_t failed = ncclSuccess;  // the first error of a call; not ncclInProgress
  {
    kernels::cuda::DeviceGuard guard(devices[0].index);  // gives the caller its device back
    check_nccl(a.group_start(), op, ranks[0]);
    for (size_t i = 0; i < ranks.size() && failed == ncclSuccess; ++i) {
      // Each rank's device is current when its communicator is made; nothing may throw
      // before the group ends.
      if (cudaSetDevice(devices[i].index) != cudaSuccess) failed = ncclUnhandledCudaError;
      const ncclResult_t r = failed == ncclSuccess
                                 ? a.init_rank_config(&comms[i], size, id, ranks[i], &config)
                                 : ncclSuccess;
      if (r != ncclSuccess && r != ncclInProgress) failed = r;
    }
    const ncclResult_t ended = a.group_end();
    if (failed == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) failed = ended;
  }
  bool timed_out = false;
  if (failed == ncclSuccess) {
    ncclResult_t state = ncclSuccess;
    const auto set_up = [&] { return (state = setup_state(comms)) != ncclInProgress; };
    timed_out = !poll_until(set_up, Clock::now() + options.timeout, kPollInterval);
    if (!timed_out) failed = state;
  }
  if (failed == ncclSuccess && !timed_out) return comms;
  for (ncclComm_t comm : comms) {
    if (comm != nullptr) a.abort(comm);
  }
  const std::string ranks_text =
      ranks.size() == 1 ? str_cat("rank ", ranks[0]) : str_cat(ranks.size(), " ranks");
  if (timed_out) {
    RD_FAIL(kTimeout, op, ": NCCL's setup of ", ranks_text, " of a group of ", size,
            " waited more than ", options.timeout.count(),
            " ms for the other ranks; communicators aborted");
  }
  RD_FAIL(kInternal, "nccl init of ", ranks_text, " of a group of ", size, ": ",
          a.error_string(failed));
}

}  // namespace

bool nccl_available(std::string* why_not) {
  std::string problem = api().problem;
  if (problem.empty() && !cuda_available()) problem = "no CUDA device is visible";
  if (why_not != nullptr) *why_not = problem;
  return problem.empty();
}

std::string nccl_unique_id() {
  ncclUniqueId id;
  check_nccl(checked_api("nccl_unique_id").get_unique_id(&id), "get_unique_id", -1);
  return std::string(id.internal, sizeof(id.internal));
}

std::shared_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank,
                                                     int size, Device device, NcclOptions options) {
  constexpr const char* kOp = "make_nccl_communicator";
  checked_api(kOp);
  check_cuda_device(device, kOp);
  RD_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, kOp, ": rank ", rank,
           " is not in a group of ", size);
  ncclUniqueId id;
  RD_CHECK(unique_id.size() == sizeof(id.internal), kInvalidArgument, kOp,
           ": argument 'unique_id' has ", unique_id.size(), " bytes, expected ",
           sizeof(id.internal), " (from nccl_unique_id())");
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  const ncclComm_t comm = init_comms(id, size, {rank}, {device}, options, kOp)[0];
  std::shared_ptr<PeerWatchdog> watchdog =
      options.store ? std::make_shared<PeerWatchdog>(options) : nullptr;
  return std::make_shared<NcclComm>(comm, rank, size, device, std::move(options),
                                    std::move(watchdog));
}

std::vector<std::shared_ptr<Communicator>> make_nccl_group(const std::vector<Device>& devices,
                                                           NcclOptions options) {
  constexpr const char* kOp = "make_nccl_group";
  const NcclApi& a = checked_api(kOp);
  RD_CHECK(!devices.empty(), kInvalidArgument, kOp, ": argument 'devices' is empty");
  std::vector<int> ranks;
  for (const Device& d : devices) {
    check_cuda_device(d, kOp);
    ranks.push_back(static_cast<int>(ranks.size()));
  }
  ncclUniqueId id;
  check_nccl(a.get_unique_id(&id), "get_unique_id", -1);
  const std::vector<ncclComm_t> comms =
      init_comms(id, static_cast<int>(devices.size()), ranks, devices, options, kOp);
  auto ledger = std::make_shared<ThreadLedger>(static_cast<int>(devices.size()));
  std::vector<std::shared_ptr<Communicator>> result;
  for (size_t i = 0; i < devices.size(); ++i) {
    result.push_back(std::make_shared<NcclComm>(comms[i], static_cast<int>(i),
                                                static_cast<int>(devices.size()), devices[i],
                                                options, nullptr, ledger));
  }
  return result;
}

#else  // no CUDA in this build

bool nccl_available(std::string* why_not) {
  if (why_not != nullptr) *why_not = "this build has no CUDA backend";
  return false;
}

std::string nccl_unique_id() {
  RD_FAIL(kUnimplemented, "nccl_unique_id: this build has no CUDA backend");
}

std::shared_ptr<Communicator> make_nccl_communicator(const std::string&, int, int, Device,
                                                     NcclOptions) {
  RD_FAIL(kUnimplemented, "make_nccl_communicator: this build has no CUDA backend");
}

std::vector<std::shared_ptr<Communicator>> make_nccl_group(const std::vector<Device>&,
                                                           NcclOptions) {
  RD_FAIL(kUnimplemented, "make_nccl_group: this build has no CUDA backend");
}

#endif

}  // namespace rd::dist
