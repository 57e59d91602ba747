// The in-process communicator (see in_process.h). The ranks of a group share one Group: a
// mailbox per (sender, receiver) for point-to-point transfers, and numbered rounds for
// collectives, in which every rank posts its tensors, waits for the others, reads what it
// needs, and leaves only when all have read (so no tensor dies while another rank reads it).
// Data moves by tensor copies on the receiving thread. On a GPU every rank has its own
// stream and nothing waits on the host: a rank records an event after the work that wrote a
// tensor it exposes, the reader's stream waits for it before copying, and the owner's stream
// waits for the reader's copy before it may write or free the tensor (its memory returns to
// the owner's stream, whose later work is thus ordered after the copy).
#include "ringdilated/dist/in_process.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/stream.h"

namespace rd::dist {
namespace {

constexpr const char* kBackend = "in-process";

// What one rank posts to a collective round.
struct Contribution {
  std::string op;
  Tensor in;  // what others read (all_gather, reduce_scatter, all_reduce, broadcast)
  int root = 0;
  int color = 0, key = 0;  // split
  Event ready;             // marks the work that wrote `in`
};

class InProcessComm;

// The state every rank of one group shares.
class Group : public std::enable_shared_from_this<Group> {
 public:
  Group(int size, Device device, InProcessOptions options)
      : size_(size), device_(device), options_(options) {}

  int size() const { return size_; }
  Device device() const { return device_; }
  const InProcessOptions& options() const { return options_; }

  // --- point-to-point ---
  struct Message {
    Tensor data;
    Event ready;   // the sender's work that wrote `data`
    Event copied;  // the receiver's copy of it
    bool taken = false;
  };

  std::shared_ptr<Message> post(int from, int to, const Tensor& data, const Event& ready) {
    auto message = std::make_shared<Message>(Message{data, ready, Event(), false});
    {
      std::lock_guard<std::mutex> lock(mu_);
      check_not_aborted();
      mailbox_[{from, to}].push_back(message);
    }
    cv_.notify_all();
    return message;
  }

  // Waits for the next message from `from` to `to` and copies it into `into`.
  void take(int from, int to, const Tensor& into) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& queue = mailbox_[{from, to}];
    wait(lock, to, str_cat("a receive from rank ", from), [&] { return !queue.empty(); });
    std::shared_ptr<Message> message = queue.front();
    queue.pop_front();
    const Tensor& data = message->data;
    RD_CHECK(data.shape() == into.shape() && data.dtype() == into.dtype(), kShapeMismatch,
             "irecv: rank ", to, " posted a receive of ", shape_str(into.shape()), " ",
             dtype_name(into.dtype()), " but rank ", from, " sent ", shape_str(data.shape()), " ",
             dtype_name(data.dtype()));
    lock.unlock();
    const Stream stream = Stream::current(device_);
    message->ready.block(stream);
    into.detach().copy_(data);
    // No record_stream of the sender's tensor here: the sender's stream waits for `copied`
    // (wait_taken) before it can reuse that memory, and this rank's stream may be gone by the
    // time the sender frees it.
    message->copied.record(stream);
    lock.lock();
    message->taken = true;
    cv_.notify_all();
  }

  // Waits until the receiver has taken the message; the sender's stream then waits for the
  // receiver's copy, so later writes to the sent tensor cannot overtake it.
  void wait_taken(int rank, int peer, const std::shared_ptr<Message>& message) {
    std::unique_lock<std::mutex> lock(mu_);
    wait(lock, rank, str_cat("rank ", peer, " to receive a send"), [&] { return message->taken; });
    lock.unlock();
    message->copied.block(Stream::current(device_));
  }

  // --- collectives ---
  // Runs one collective round for `rank`: posts `mine`, waits until every rank posted, runs
  // `work` with all contributions (outside the lock, after this rank's stream waited for
  // each contribution's `ready` event), then waits until every rank finished its work, and
  // makes this rank's stream wait for the others' reads, so that it cannot overwrite its
  // contribution while they still read it.
  void round(int rank, uint64_t number, Contribution mine,
             const std::function<void(const std::vector<Contribution>&)>& work) {
    std::unique_lock<std::mutex> lock(mu_);
    check_not_aborted();
    Round& r = rounds_[number];
    if (r.posts.empty()) {
      r.posts.resize(static_cast<size_t>(size_));
      r.read.resize(static_cast<size_t>(size_));
    }
    r.posts[static_cast<size_t>(rank)] = std::move(mine);
    r.posted.push_back(rank);
    cv_.notify_all();
    wait(
        lock, rank, str_cat(r.posts[static_cast<size_t>(rank)].op, " (collective #", number, ")"),
        [&] { return static_cast<int>(r.posted.size()) == size_; }, &r.posted);
    for (int j = 0; j < size_; ++j) {
      const Contribution& c = r.posts[static_cast<size_t>(j)];
      RD_CHECK(c.op == r.posts[static_cast<size_t>(rank)].op, kInvalidArgument,
               "in-process communicator: collective #", number, " is ",
               r.posts[static_cast<size_t>(rank)].op, " on rank ", rank, " but ", c.op, " on rank ",
               j, ": every rank must call the same collectives in the same order");
    }
    const std::vector<Contribution> posts = r.posts;
    lock.unlock();
    const Stream stream = Stream::current(device_);
    for (const Contribution& c : posts) c.ready.block(stream);
    work(posts);
    Event read;
    read.record(stream);
    lock.lock();
    r.read[static_cast<size_t>(rank)] = read;
    r.finished.push_back(rank);
    cv_.notify_all();
    wait(
        lock, rank,
        str_cat(posts[static_cast<size_t>(rank)].op, " (collective #", number,
                ") to be read by every rank"),
        [&] { return static_cast<int>(r.finished.size()) == size_; }, &r.finished);
    const std::vector<Event> reads = r.read;
    if (++r.left == size_) rounds_.erase(number);
    lock.unlock();
    for (const Event& e : reads) e.block(stream);
  }

  // A sub-group shared by the ranks of one color of one split round: the first to ask
  // creates it.
  std::shared_ptr<Group> subgroup(uint64_t number, int color, int size) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Group>& g = rounds_[number].subgroups[color];
    if (!g) g = std::make_shared<Group>(size, device_, options_);
    return g;
  }

  void abort(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return;
      aborted_ = true;
      abort_reason_ = reason;
    }
    cv_.notify_all();
  }

 private:
  struct Round {
    std::vector<Contribution> posts;
    std::vector<Event> read;  // per rank: its reads of the others' contributions
    std::vector<int> posted, finished;
    int left = 0;
    std::map<int, std::shared_ptr<Group>> subgroups;
  };

  void check_not_aborted() const {
    RD_CHECK(!aborted_, kAborted,
             "in-process communicator: the group was aborted: ", abort_reason_);
  }

  // Waits for `ready` under `lock`; fails on abort, or on timeout (which aborts the group,
  // so the other ranks stop too). `arrived`, when given, names the ranks that did arrive so
  // the message can name those that did not.
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, int rank, const std::string& what, Ready ready,
            const std::vector<int>* arrived = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (!ready()) {
      check_not_aborted();
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !ready()) {
        check_not_aborted();
        std::string missing;
        if (arrived != nullptr) {
          for (int j = 0; j < size_; ++j) {
            if (std::find(arrived->begin(), arrived->end(), j) == arrived->end()) {
              missing += str_cat(missing.empty() ? "" : ", ", j);
            }
          }
          missing = str_cat(" (ranks not there: ", missing, ")");
        }
        const std::string message =
            str_cat("in-process communicator: rank ", rank, " waited more than ",
                    options_.timeout.count(), " ms for ", what, missing);
        aborted_ = true;
        abort_reason_ = message;
        cv_.notify_all();
        RD_FAIL(kTimeout, message);
      }
    }
    check_not_aborted();
  }

  const int size_;
  const Device device_;
  const InProcessOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool aborted_ = false;
  std::string abort_reason_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mailbox_;
  std::map<uint64_t, Round> rounds_;
};

// A send or receive between two ranks of the group, which `complete_` carries out: in
// wait(), or in the destructor when never waited for.
class PeerRequest final : public Request {
 public:
  explicit PeerRequest(std::function<void()> complete) : complete_(std::move(complete)) {}
  ~PeerRequest() override { wait_quietly(*this, done_); }
  void wait() override {
    done_ = true;
    complete_();
  }

 private:
  std::function<void()> complete_;
  bool done_ = false;
};

// The sum, max or min of `parts` in their accumulation dtype, in rank order (so every rank
// computes the same bits), converted into `out`.
void reduce_into(const Tensor& out, const std::vector<Tensor>& parts, ReduceOp op) {
  Tensor acc = parts[0].to(accumulation_dtype(out.dtype()));
  for (size_t j = 1; j < parts.size(); ++j) {
    const Tensor part = parts[j].to(acc.dtype());
    switch (op) {
      case ReduceOp::kSum: acc = add(acc, part); break;
      case ReduceOp::kMax: acc = maximum(acc, part); break;
      case ReduceOp::kMin: acc = minimum(acc, part); break;
    }
  }
  out.detach().copy_(acc);
}

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Device device() const override { return group_->device(); }
  std::string backend_name() const override { return kBackend; }

  std::unique_ptr<Request> isend(const Tensor& tensor, int peer) override {
    check_peer_and_tensor(*this, "isend", peer, tensor);
    Event ready;
    ready.record(Stream::current(device()));
    stats_.sent(nbytes_of(tensor));
    return std::make_unique<PeerRequest>(
        [group = group_, rank = rank_, peer, message = group_->post(rank_, peer, tensor, ready)] {
          group->wait_taken(rank, peer, message);
        });
  }

  std::unique_ptr<Request> irecv(const Tensor& tensor, int peer) override {
    check_peer_and_tensor(*this, "irecv", peer, tensor);
    stats_.received(nbytes_of(tensor));
    return std::make_unique<PeerRequest>(
        [group = group_, rank = rank_, peer, into = tensor] { group->take(peer, rank, into); });
  }

  void all_gather(const Tensor& out, const Tensor& in) override {
    check_all_gather_args(*this, out, in);
    collective("all_gather", in, [&](const std::vector<Contribution>& posts) {
      for (int j = 0; j < size(); ++j) {
        check_same_layout("all_gather", posts[static_cast<size_t>(j)].in, in, j);
        out.select(0, j).copy_(posts[static_cast<size_t>(j)].in);
      }
    });
    stats_.all_gather(nbytes_of(out), size());
  }

  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_reduce_scatter_args(*this, out, in);
    collective("reduce_scatter", in, [&](const std::vector<Contribution>& posts) {
      std::vector<Tensor> parts;
      for (int j = 0; j < size(); ++j) {
        check_same_layout("reduce_scatter", posts[static_cast<size_t>(j)].in, in, j);
        parts.push_back(posts[static_cast<size_t>(j)].in.select(0, rank_));
      }
      reduce_into(out, parts, op);
    });
    stats_.reduce_scatter(nbytes_of(in), size());
  }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    check_comm_tensor(*this, "all_reduce", "tensor", tensor);
    // Everyone reads every input before anyone writes its result: reduce into a copy.
    Tensor result = empty_like(tensor);
    collective("all_reduce", tensor, [&](const std::vector<Contribution>& posts) {
      std::vector<Tensor> parts;
      for (int j = 0; j < size(); ++j) {
        check_same_layout("all_reduce", posts[static_cast<size_t>(j)].in, tensor, j);
        parts.push_back(posts[static_cast<size_t>(j)].in);
      }
      reduce_into(result, parts, op);
    });
    tensor.detach().copy_(result);
    stats_.all_reduce(nbytes_of(tensor), size());
  }

  void broadcast(const Tensor& tensor, int root) override {
    check_peer_and_tensor(*this, "broadcast", root, tensor);
    Contribution mine{"broadcast", tensor, root, 0, 0, Event()};
    collective(std::move(mine), [&](const std::vector<Contribution>& posts) {
      const Contribution& from = posts[static_cast<size_t>(root)];
      RD_CHECK(from.root == root, kInvalidArgument, "broadcast: rank ", rank_, " names root ", root,
               " but rank ", root, " names ", from.root);
      check_same_layout("broadcast", from.in, tensor, root);
      // Only the root's tensor is read, so the others may write theirs during the round.
      if (rank_ != root) tensor.detach().copy_(from.in);
    });
    stats_.broadcast(nbytes_of(tensor), size(), rank_ == root);
  }

  void barrier() override {
    collective("barrier", Tensor(), [](const std::vector<Contribution>&) {});
    stats_.barrier();
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    Contribution mine{"split", Tensor(), 0, color, key, Event()};
    const uint64_t number = next_round_;
    std::shared_ptr<Communicator> result;
    collective(std::move(mine), [&](const std::vector<Contribution>& posts) {
      if (color < 0) return;
      std::vector<std::pair<int, int>> members;  // (key, old rank) of this color
      for (int j = 0; j < size(); ++j) {
        if (posts[static_cast<size_t>(j)].color == color) {
          members.push_back({posts[static_cast<size_t>(j)].key, j});
        }
      }
      std::sort(members.begin(), members.end());
      const int new_rank = static_cast<int>(
          std::find(members.begin(), members.end(), std::pair{key, rank_}) - members.begin());
      result = std::make_shared<InProcessComm>(
          group_->subgroup(number, color, static_cast<int>(members.size())), new_rank);
    });
    return result;
  }

  void abort(const std::string& reason) override {
    group_->abort(str_cat("rank ", rank_, ": ", reason));
  }

  CommStats stats() const override { return stats_.get(); }

 private:
  void collective(const char* op, const Tensor& in,
                  const std::function<void(const std::vector<Contribution>&)>& work) {
    collective(Contribution{op, in, 0, 0, 0, Event()}, work);
  }

  void collective(Contribution mine,
                  const std::function<void(const std::vector<Contribution>&)>& work) {
    mine.ready.record(Stream::current(device()));
    group_->round(rank_, next_round_++, std::move(mine), work);
  }

  void check_same_layout(const char* op, const Tensor& theirs, const Tensor& mine, int j) const {
    RD_CHECK(theirs.shape() == mine.shape() && theirs.dtype() == mine.dtype(), kShapeMismatch, op,
             ": rank ", rank_, " passed ", shape_str(mine.shape()), " ", dtype_name(mine.dtype()),
             " but rank ", j, " passed ", shape_str(theirs.shape()), " ",
             dtype_name(theirs.dtype()));
  }

  std::shared_ptr<Group> group_;
  int rank_;
  uint64_t next_round_ = 0;
  StatsCounter stats_;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_in_process_group(int size, Device device,
                                                                 InProcessOptions options) {
  RD_CHECK(size >= 1, kInvalidArgument, "make_in_process_group: argument 'size' must be >= 1, got ",
           size);
  RD_CHECK(options.timeout.count() > 0, kInvalidArgument,
           "make_in_process_group: option 'timeout' must be positive, got ",
           options.timeout.count(), " ms");
  auto group = std::make_shared<Group>(size, device, options);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_shared<InProcessComm>(group, r));
  return comms;
}

void run_in_process(int size, const std::function<void(Communicator& comm)>& body, Device device,
                    InProcessOptions options) {
  const std::vector<std::shared_ptr<Communicator>> comms =
      make_in_process_group(size, device, options);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  // The ranks' streams do not wait for the caller's: let its work (their inputs) finish.
  Stream::current(device).synchronize();
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        // Each rank queues its work on a stream of its own, as separate processes would.
        const Stream stream = Stream::create(device);
        const StreamGuard guard(stream);
        body(*comms[static_cast<size_t>(r)]);
        stream.synchronize();  // the caller reads the results on its own stream
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        comms[static_cast<size_t>(r)]->abort(str_cat("failed: ", e.what()));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        comms[static_cast<size_t>(r)]->abort("failed with a non-standard exception");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The first rank that failed on its own (not because the group was aborted) is the cause.
  for (int pass = 0; pass < 2; ++pass) {
    for (int r = 0; r < size; ++r) {
      if (!errors[static_cast<size_t>(r)]) continue;
      try {
        std::rethrow_exception(errors[static_cast<size_t>(r)]);
      } catch (const Error& e) {
        if (pass == 0 && e.code() == ErrorCode::kAborted) continue;
        throw Error(e.code(), str_cat("rank ", r, " of ", size, ": ", e.what()));
      } catch (const std::exception& e) {
        throw Error(ErrorCode::kInternal, str_cat("rank ", r, " of ", size, ": ", e.what()));
      }
    }
  }
}

}  // namespace rd::dist
