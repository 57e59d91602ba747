// dist_worker: the program dist_multiprocess_test runs on every rank of a job (through
// rd_launch, or started by hand with the launcher variables set).
//   dist_worker <command> [--timeout-ms T] [--rendezvous-timeout-ms R]
//   collectives   every collective and transfer, with random non-zero data checked against
//                 values each rank computes on its own; sub-groups from split
//   ring          sequence-parallel dilated attention over the gloo communicator against the
//                 single-device call on the whole sequence, float64, every strategy
//   fail-abort    rank 1 aborts (from another thread) while the others wait in a collective
//   fail-exit     rank 1 exits while the others wait in a collective
//   timeout       the last rank joins a collective only after the others timed out
//   barrier       init_process_group and one barrier (the rendezvous tests)
// Success prints "rank R: <command>: OK (N checks)" and exits 0; a failed check exits 1; an
// rd::Error prints "rank R: error (<code>) after S s: <message>" and exits 2.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ringdilated/dist/bootstrap.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"

namespace {

using rd::DType;
using rd::Tensor;
using rd::dist::Communicator;
using rd::dist::ReduceOp;
using Clock = std::chrono::steady_clock;

Clock::time_point g_phase_start = Clock::now();  // what "after S s" in errors counts from

std::string rank_label() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK"}) {
    if (const char* v = std::getenv(name)) return v;
  }
  return "?";
}

// Counts checks; prints each failure.
class Checks {
 public:
  void expect(bool ok, const std::string& what) {
    ++count_;
    if (!ok) {
      ++failed_;
      std::printf("rank %s: CHECK FAILED: %s\n", rank_label().c_str(), what.c_str());
    }
  }
  int count() const { return count_; }
  int failed() const { return failed_; }

 private:
  int count_ = 0, failed_ = 0;
};

// --- data every rank can compute for every other rank -----------------------------------

// Rank `rank`'s data number `tag`: n non-zero integers in [-20, 20]. Integers keep sums exact
// in every dtype used here, 16-bit floats included (|a sum of 4| <= 80 < 256).
std::vector<double> values(int rank, int tag, int64_t n) {
  std::mt19937_64 gen(1000003ULL * static_cast<uint64_t>(rank) +
                      7919ULL * static_cast<uint64_t>(tag));
  std::uniform_int_distribution<int> magnitude(1, 20), sign(0, 1);
  std::vector<double> out(static_cast<size_t>(n));
  for (double& v : out) v = magnitude(gen) * (sign(gen) ? 1.0 : -1.0);
  return out;
}

Tensor tensor_of(const std::vector<double>& v, rd::Shape shape, DType dtype) {
  return rd::from_vector<double>(v, shape).to(dtype);
}

std::vector<double> host(const Tensor& t) {
  return t.to(DType::kFloat64).contiguous().to_vector<double>();
}

double reduce(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kMin: return std::min(a, b);
  }
  return 0;
}

// Element i of the reduction over ranks of values(j, tag, n)[offset + i].
std::vector<double> reduced(ReduceOp op, int size, int tag, int64_t n, int64_t offset,
                            int64_t count) {
  std::vector<double> out;
  for (int64_t i = 0; i < count; ++i) {
    double acc = values(0, tag, n)[static_cast<size_t>(offset + i)];
    for (int j = 1; j < size; ++j) {
      acc = reduce(op, acc, values(j, tag, n)[static_cast<size_t>(offset + i)]);
    }
    out.push_back(acc);
  }
  return out;
}

std::string name_of(DType d, ReduceOp op) {
  return rd::str_cat(rd::dtype_name(d), " ", rd::dist::reduce_op_name(op));
}

// --- collectives -------------------------------------------------------------------------

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};

void check_all_reduce(Communicator& comm, Checks& checks, int& tag) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64, DType::kBFloat16,
                  DType::kFloat16}) {
    for (ReduceOp op : kOps) {
      ++tag;
      Tensor t = tensor_of(values(comm.rank(), tag, 7), {7}, d);
      comm.all_reduce(t, op);
      checks.expect(host(t) == reduced(op, comm.size(), tag, 7, 0, 7),
                    "all_reduce " + name_of(d, op));
    }
  }
}

void check_all_gather(Communicator& comm, Checks& checks, int& tag) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kInt64, DType::kBFloat16}) {
    ++tag;
    const Tensor in = tensor_of(values(comm.rank(), tag, 6), {2, 3}, d);
    const Tensor out = rd::empty({comm.size(), 2, 3}, d);
    comm.all_gather(out, in);
    for (int j = 0; j < comm.size(); ++j) {
      checks.expect(host(out.select(0, j)) == values(j, tag, 6),
                    rd::str_cat("all_gather ", rd::dtype_name(d), " row ", j));
    }
  }
}

void check_reduce_scatter(Communicator& comm, Checks& checks, int& tag) {
  const int P = comm.size();
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kFloat16}) {
    for (ReduceOp op : kOps) {
      ++tag;
      const Tensor in = tensor_of(values(comm.rank(), tag, P * 5), {P, 5}, d);
      const Tensor out = rd::empty({5}, d);
      comm.reduce_scatter(out, in, op);
      checks.expect(host(out) == reduced(op, P, tag, P * 5, comm.rank() * 5, 5),
                    "reduce_scatter " + name_of(d, op));
    }
  }
}

void check_broadcast(Communicator& comm, Checks& checks, int& tag) {
  for (int root = 0; root < comm.size(); ++root) {
    ++tag;
    Tensor t = tensor_of(values(comm.rank(), tag, 4), {4}, DType::kFloat64);
    comm.broadcast(t, root);
    checks.expect(host(t) == values(root, tag, 4), rd::str_cat("broadcast from ", root));
  }
}

// Three messages of different shapes to the next rank, received from the previous one and
// waited for in reverse order: each must still land in the receive posted in its order.
void check_point_to_point(Communicator& comm, Checks& checks, int& tag) {
  const int P = comm.size(), r = comm.rank();
  const int to = (r + 1) % P, from = (r + P - 1) % P;
  const std::vector<std::pair<rd::Shape, DType>> layouts = {{{3}, DType::kFloat32},
                                                            {{2, 2}, DType::kFloat64},
                                                            {{5}, DType::kInt64},
                                                            {{0}, DType::kFloat32}};
  std::vector<Tensor> sent, received;
  std::vector<std::unique_ptr<rd::dist::Request>> sends, receives;
  const int first = tag + 1;
  for (const auto& [shape, dtype] : layouts) {
    ++tag;
    const int64_t n = shape.size() == 1 ? shape[0] : 4;
    received.push_back(rd::empty(shape, dtype));
    receives.push_back(comm.irecv(received.back(), from));
    sent.push_back(tensor_of(values(r, tag, n), shape, dtype));
    sends.push_back(comm.isend(sent.back(), to));
  }
  for (size_t i = receives.size(); i-- > 0;) receives[i]->wait();
  for (auto& s : sends) s->wait();
  for (size_t i = 0; i < layouts.size(); ++i) {
    checks.expect(host(received[i]) ==
                      host(tensor_of(values(from, first + static_cast<int>(i), received[i].numel()),
                                     layouts[i].first, layouts[i].second)),
                  rd::str_cat("irecv #", i, " from rank ", from));
  }
  ++tag;
  const Tensor mine = tensor_of(values(r, tag, 3), {3}, DType::kFloat64);
  const Tensor theirs = rd::empty({3}, DType::kFloat64);
  rd::dist::send_recv(comm, mine, to, theirs, from);
  checks.expect(host(theirs) == values(from, tag, 3), "send_recv around the ring");
  const Tensor own = rd::empty({3}, DType::kFloat64);
  rd::dist::send_recv(comm, mine, r, own, r);
  checks.expect(host(own) == values(r, tag, 3), "send_recv to itself");
}

// The accounting of communicator.h's CommStats comment, as the in-process backend keeps it.
void check_stats(Communicator& comm, Checks& checks) {
  const int64_t P = comm.size(), bytes = 8 * 8;
  const rd::dist::CommStats before = comm.stats();
  Tensor t = rd::ones({8}, DType::kFloat64);
  comm.all_reduce(t);
  const rd::dist::CommStats after = comm.stats();
  checks.expect(after.bytes_sent - before.bytes_sent == 2 * bytes * (P - 1) / P &&
                    after.bytes_received - before.bytes_received == 2 * bytes * (P - 1) / P &&
                    after.collectives - before.collectives == 1,
                "stats of all_reduce");
  comm.broadcast(t, 0);
  const rd::dist::CommStats last = comm.stats();
  if (comm.rank() == 0) {
    checks.expect(
        last.bytes_sent - after.bytes_sent == bytes * (P - 1) &&
            last.collectives - after.collectives == 1,
        "stats of broadcast at the root");
  } else {
    checks.expect(
        last.bytes_received - after.bytes_received == bytes &&
            last.collectives - after.collectives == 1,
        "stats of broadcast off the root");
  }
}

// Non-integer data: the sum's bits depend on the order of additions, and must still be the
// same on every rank.
void check_identical_results(Communicator& comm, Checks& checks) {
  rd::Generator gen(99 + static_cast<uint64_t>(comm.rank()));
  Tensor t = rd::randn({16}, gen, DType::kFloat64);
  comm.all_reduce(t);
  const Tensor all = rd::empty({comm.size(), 16}, DType::kFloat64);
  comm.all_gather(all, t);
  for (int j = 0; j < comm.size(); ++j) {
    checks.expect(host(all.select(0, j)) == host(t), rd::str_cat("all_reduce bits of rank ", j));
  }
}

// Every rank sees every rank's shape, so all of them throw, and the group stays usable.
void check_mismatch(Communicator& comm, Checks& checks) {
  Tensor t = rd::ones({comm.rank() + 1}, DType::kFloat32);
  std::string message;
  try {
    comm.all_reduce(t);
  } catch (const rd::Error& e) {
    message = e.what();
    checks.expect(e.code() == rd::ErrorCode::kShapeMismatch, "mismatch code");
  }
  checks.expect(message.find("all_reduce: rank") != std::string::npos &&
                    message.find("[1] float32") != std::string::npos,
                "mismatch message: " + message);
  comm.barrier();
}

void check_split(Communicator& comm, Checks& checks) {
  const int P = comm.size(), r = comm.rank();
  // Parity groups, ranked by key = -rank: the highest old rank comes first.
  std::shared_ptr<Communicator> sub = comm.split(r % 2, -r);
  std::vector<int> members;  // old ranks of my color, in new-rank order
  for (int j = P - 1; j >= 0; --j) {
    if (j % 2 == r % 2) members.push_back(j);
  }
  const int expected_rank =
      static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  checks.expect(
      sub && sub->size() == static_cast<int>(members.size()) && sub->rank() == expected_rank,
      "split ranks");
  if (!sub) return;
  Tensor t = rd::full({2}, r + 1.0, DType::kFloat64);
  sub->all_reduce(t);
  double sum = 0;
  for (int j : members) sum += j + 1;
  checks.expect(host(t) == std::vector<double>{sum, sum}, "all_reduce in a split group");
  const Tensor gathered = rd::empty({sub->size(), 1}, DType::kFloat64);
  sub->all_gather(gathered, rd::full({1}, r, DType::kFloat64));
  std::vector<double> order(members.begin(), members.end());
  checks.expect(host(gathered) == order, "all_gather order in a split group");
  // Rank 0 opts out; the rest form one group (of one rank when P == 2).
  std::shared_ptr<Communicator> rest = comm.split(r == 0 ? -1 : 0, r);
  checks.expect((r == 0) == (rest == nullptr), "split with a negative color");
  if (rest) {
    checks.expect(rest->size() == P - 1 && rest->rank() == r - 1, "split rest ranks");
    rest->barrier();
  }
  comm.barrier();
}

void run_collectives(Communicator& comm, Checks& checks) {
  int tag = 0;
  check_all_reduce(comm, checks, tag);
  check_all_gather(comm, checks, tag);
  check_reduce_scatter(comm, checks, tag);
  check_broadcast(comm, checks, tag);
  comm.barrier();
  check_point_to_point(comm, checks, tag);
  Tensor empty = rd::empty({0}, DType::kFloat32);
  comm.all_reduce(empty);
  check_stats(comm, checks);
  check_identical_results(comm, checks);
  check_mismatch(comm, checks);
  check_split(comm, checks);
}

// --- ring --------------------------------------------------------------------------------

// ||got - want|| / ||want||.
double relative_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = host(got), w = host(want);
  double num = 0, den = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return g.size() == w.size() ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
}

struct Grads {
  Tensor out, q, k, v;
};

// out and the gradients of sum(out * w) in q, k and v.
Grads attention_and_grads(
    const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& w,
    const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& f) {
  Tensor q = q0.detach().clone(), k = k0.detach().clone(), v = v0.detach().clone();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  const Tensor out = f(q, k, v);
  rd::sum(rd::mul(out, w)).backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// Both sequence layouts, each with every strategy.
std::vector<std::pair<rd::nn::SequenceLayout, rd::nn::DistStrategy>> layouts_and_strategies() {
  std::vector<std::pair<rd::nn::SequenceLayout, rd::nn::DistStrategy>> all;
  for (auto layout : {rd::nn::SequenceLayout::kContiguous, rd::nn::SequenceLayout::kZigzag}) {
    for (auto strategy : {rd::nn::DistStrategy::kRing, rd::nn::DistStrategy::kAllGather,
                          rd::nn::DistStrategy::kAuto}) {
      all.emplace_back(layout, strategy);
    }
  }
  return all;
}

void run_ring(Communicator& comm, Checks& checks) {
  constexpr int64_t B = 1, N = 24, H = 4, D = 8;
  const int P = comm.size(), r = comm.rank();
  std::vector<rd::nn::DilatedAttentionOptions> configs(2);
  configs[0].segment_lengths = {4, 12, 24};
  configs[0].dilation_rates = {1, 2, 4};
  configs[1] = configs[0];
  configs[1].segment_lengths = {6, 10, 24};  // 10 straddles blocks; short last segment
  configs[1].mixing = rd::nn::HeadMixing::kAllHeads;
  configs[1].offset_rule = rd::nn::OffsetRule::kRotating;
  configs[1].causal = true;
  for (size_t c = 0; c < configs.size(); ++c) {
    const rd::nn::DilatedAttentionOptions& o = configs[c];
    rd::Generator gen(2024 + c);  // the same inputs on every rank
    const Tensor q = rd::randn({B, N, H, D}, gen, DType::kFloat64);
    const Tensor k = rd::randn({B, N, H, D}, gen, DType::kFloat64);
    const Tensor v = rd::randn({B, N, H, D}, gen, DType::kFloat64);
    const Tensor w = rd::randn({B, N, H, D}, gen, DType::kFloat64);
    const Grads full =
        attention_and_grads(q, k, v, w, [&](const Tensor& a, const Tensor& b, const Tensor& cc) {
          return rd::nn::dilated_attention_with_lse(a, b, cc, o).out;
        });
    for (auto [layout, strategy] : layouts_and_strategies()) {
      auto mine = [&](const Tensor& t) {
        return rd::nn::sequence_block(t, r, P, layout).contiguous();
      };
      const Grads got = attention_and_grads(
          mine(q), mine(k), mine(v), mine(w),
          [&](const Tensor& a, const Tensor& b, const Tensor& cc) {
            return rd::nn::ring_dilated_attention_with_lse(a, b, cc, o, comm, strategy, {}, layout)
                .attention.out;
          });
      const std::string what = rd::str_cat("config ", c, " ", rd::nn::strategy_name(strategy),
                                           " ", rd::nn::layout_name(layout));
      for (auto [name, g, want] :
           {std::tuple{"out", got.out, full.out}, std::tuple{"grad q", got.q, full.q},
            std::tuple{"grad k", got.k, full.k}, std::tuple{"grad v", got.v, full.v}}) {
        const double err = relative_error(g, mine(want));
        checks.expect(err <= 1e-10, rd::str_cat(what, " ", name, ": relative error ", err));
      }
    }
  }
}

// --- failures ----------------------------------------------------------------------------

// Rank 1 leaves while the others wait in an all_reduce it never joins: by abort (from a
// watchdog thread, while its own receive is pending: that receive must fail with kAborted)
// or by exiting. The others must fail naming rank 1, long before their timeout.
int run_fail(Communicator& comm, bool by_abort) {
  comm.barrier();  // everyone is up
  g_phase_start = Clock::now();
  if (comm.rank() == 1) {
    if (!by_abort) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::printf("rank 1: exiting in the middle of the job\n");
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::thread watchdog([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.abort("injected failure");
    });
    struct Join {
      std::thread& thread;
      ~Join() { thread.join(); }  // before the communicator goes, even on the error below
    } join{watchdog};
    Tensor never = rd::empty({4}, DType::kFloat32);
    comm.irecv(never, 0)->wait();  // rank 0 sends nothing: only the abort ends this
    std::printf("rank 1: CHECK FAILED: the pending receive survived abort\n");
    return 1;
  }
  Tensor t = rd::ones({1024}, DType::kFloat32);
  comm.all_reduce(t);
  std::printf("rank %d: CHECK FAILED: all_reduce finished without rank 1\n", comm.rank());
  return 1;
}

// The last rank does not join the all_reduce in time; the others must fail with kTimeout
// within their timeout. When it joins (a barrier, late) it must fail too, at once.
int run_timeout(Communicator& comm, std::chrono::milliseconds timeout) {
  comm.barrier();
  g_phase_start = Clock::now();
  if (comm.rank() == comm.size() - 1) {
    std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
    g_phase_start = Clock::now();
    comm.barrier();
    std::printf("rank %d: CHECK FAILED: a late barrier worked\n", comm.rank());
    return 1;
  }
  Tensor t = rd::ones({16}, DType::kFloat32);
  comm.all_reduce(t);
  std::printf("rank %d: CHECK FAILED: all_reduce finished without the last rank\n", comm.rank());
  return 1;
}

// --- main --------------------------------------------------------------------------------

struct Args {
  std::string command;
  rd::dist::ProcessGroupOptions options;
};

Args parse(int argc, char** argv) {
  RD_CHECK(argc >= 2, kInvalidArgument, "usage: dist_worker <command> [--timeout-ms T] ",
           "[--rendezvous-timeout-ms R]");
  Args args;
  args.command = argv[1];
  args.options.timeout = std::chrono::seconds(20);
  args.options.rendezvous_timeout = std::chrono::seconds(20);
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::chrono::milliseconds value(std::atoll(argv[i + 1]));
    if (flag == "--timeout-ms") {
      args.options.timeout = value;
    } else if (flag == "--rendezvous-timeout-ms") {
      args.options.rendezvous_timeout = value;
    } else {
      RD_FAIL(kInvalidArgument, "dist_worker: unknown flag '", flag, "'");
    }
  }
  return args;
}

int run_command(Communicator& comm, const Args& args) {
  if (args.command == "fail-abort" || args.command == "fail-exit") {
    return run_fail(comm, args.command == "fail-abort");
  }
  if (args.command == "timeout") return run_timeout(comm, args.options.timeout);
  Checks checks;
  if (args.command == "collectives") {
    run_collectives(comm, checks);
  } else if (args.command == "ring") {
    run_ring(comm, checks);
  } else if (args.command == "barrier") {
    comm.barrier();
  } else {
    RD_FAIL(kInvalidArgument, "dist_worker: unknown command '", args.command, "'");
  }
  comm.barrier();  // nobody leaves while another still talks to it
  std::printf("rank %d: %s: %s (%d checks)\n", comm.rank(), args.command.c_str(),
              checks.failed() == 0 ? "OK" : "FAILED", checks.count());
  return checks.failed() == 0 ? 0 : 1;
}

// Prints the "error (<code>) after S s" line; returns the exit status of an rd::Error.
int report(const rd::Error& e) {
  const double seconds = std::chrono::duration<double>(Clock::now() - g_phase_start).count();
  std::printf("rank %s: error (%s) after %.2f s: %s\n", rank_label().c_str(),
              std::string(rd::error_code_name(e.code())).c_str(), seconds, e.what());
  std::fflush(stdout);
  return 2;
}

int run(const Args& args) {
  const std::shared_ptr<Communicator> comm = rd::dist::init_process_group(args.options);
  // Reported while the communicator lives: on rank 0, destroying it waits for the other
  // ranks to leave the store it serves (TcpStoreOptions::linger), which "after S s" must
  // not count.
  try {
    return run_command(*comm, args);
  } catch (const rd::Error& e) {
    return report(e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const rd::Error& e) {  // bad arguments, or the process group could not be made
    return report(e);
  }
}
