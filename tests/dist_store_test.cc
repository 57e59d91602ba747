// The TCP store behind init_process_group (set/get/wait/check/list, timeouts, connection
// retries, the records of ranks that left), the launcher environment it reads, and a
// one-process gloo group.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "ringdilated/dist/bootstrap.h"
#include "ringdilated/dist/gloo.h"
#include "ringdilated/dist/local_launch.h"
#include "ringdilated/dist/tcp_store.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "testing/raises.h"

namespace rd {
namespace {

using dist::TcpStore;
using dist::TcpStoreOptions;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TcpStoreOptions server_options() {
  TcpStoreOptions o;
  o.is_server = true;  // port 0: a free one
  o.timeout = std::chrono::seconds(10);
  o.connect_timeout = std::chrono::seconds(10);
  return o;
}

TcpStoreOptions client_of(const TcpStore& server, int rank = -1) {
  TcpStoreOptions o = server.options();
  o.is_server = false;
  o.port = server.port();
  o.rank = rank;
  return o;
}

TEST(TcpStore, SetGetCheckAndListInOrder) {
  TcpStore server(server_options());
  TcpStore client(client_of(server));
  EXPECT_FALSE(client.check({"b"}));
  client.set("b", "two");
  server.set("a", std::string("one\0bytes", 9));
  client.set("b", "TWO");  // overwriting keeps its place in the order
  server.set("c/x", "");
  EXPECT_EQ(server.get("b"), "TWO");
  EXPECT_EQ(client.get("a"), std::string("one\0bytes", 9));
  EXPECT_TRUE(client.check({"a", "b", "c/x"}));
  EXPECT_FALSE(client.check({"a", "d"}));
  const std::vector<std::pair<std::string, std::string>> all = client.list("");
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].first, "b");
  EXPECT_EQ(all[1].first, "a");
  EXPECT_EQ(all[2], (std::pair<std::string, std::string>{"c/x", ""}));
  EXPECT_EQ(client.list("c/").size(), 1u);
  EXPECT_TRUE(client.list("zz").empty());
}

TEST(TcpStore, GetAndWaitBlockUntilAnotherClientSets) {
  TcpStore server(server_options());
  TcpStore client(client_of(server));
  std::thread setter([&] {
    TcpStore other(client_of(server));
    std::this_thread::sleep_for(milliseconds(100));
    other.set("k1", "v1");
    std::this_thread::sleep_for(milliseconds(50));
    other.set("k2", "v2");
  });
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(client.get("k1"), "v1");
  client.wait({"k1", "k2"});
  EXPECT_GE(seconds_since(start), 0.1);
  setter.join();
}

// Each request has a connection of its own: a get parked on the server holds up nobody.
TEST(TcpStore, AWaitingGetDoesNotHoldUpOtherThreads) {
  TcpStore server(server_options());
  TcpStore client(client_of(server));
  std::string late;
  std::thread waiter([&] { late = client.get("late"); });
  std::this_thread::sleep_for(milliseconds(50));
  const Clock::time_point start = Clock::now();
  client.set("x", "1");
  EXPECT_TRUE(client.check({"x"}));
  EXPECT_LT(seconds_since(start), 2.0);
  client.set("late", "here");
  waiter.join();
  EXPECT_EQ(late, "here");
}

TEST(TcpStore, GetAndWaitTimeOutNamingTheKeyAndTheAddress) {
  TcpStore server(server_options());
  TcpStore client(client_of(server));
  const std::string address = str_cat("127.0.0.1:", server.port());
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(test::raises([&] { client.get("missing", milliseconds(200)); }, {ErrorCode::kTimeout},
                           {address, "get 'missing'", "200 ms"}));
  EXPECT_GE(seconds_since(start), 0.19);
  EXPECT_LT(seconds_since(start), 3.0);
  EXPECT_TRUE(test::raises(
      [&] {
        client.wait({"a", "b"}, milliseconds(100));
      },
      {ErrorCode::kTimeout}, {address, "'a', 'b'", "100 ms"}));
  client.set("after", "1");  // the connections are still in step after timeouts
  EXPECT_EQ(client.get("after"), "1");
}

TEST(TcpStore, ClientRetriesUntilTheServerStarts) {
  const int port = dist::pick_free_port();
  std::unique_ptr<TcpStore> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    TcpStoreOptions o = server_options();
    o.port = port;
    server = std::make_unique<TcpStore>(o);
    server->set("up", "yes");
  });
  TcpStoreOptions o = server_options();
  o.is_server = false;
  o.port = port;
  TcpStore client(o);
  EXPECT_EQ(client.get("up"), "yes");
  starter.join();
}

// A picked port lies below the kernel's ephemeral range, where no outgoing connection can take
// it before the store binds it, and the store can bind it.
TEST(PickFreePort, BelowTheEphemeralRangeAndBindable) {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int ephemeral_low = 0;
  if (!(range >> ephemeral_low) || ephemeral_low < 2024) {
    GTEST_SKIP() << "the ephemeral port range leaves no room below it";
  }
  for (int i = 0; i < 20; ++i) {
    const int port = dist::pick_free_port();
    EXPECT_GE(port, 1024);
    EXPECT_LT(port, ephemeral_low);
    TcpStoreOptions o = server_options();
    o.port = port;
    TcpStore server(o);
    EXPECT_EQ(server.port(), port);
  }
  EXPECT_TRUE(test::raises([] { dist::pick_free_port("not-an-address"); },
                           {ErrorCode::kInvalidArgument}, {"pick_free_port", "not-an-address"}));
}

TEST(TcpStore, ConnectTimeoutNamesTheAddress) {
  const int port = dist::pick_free_port();  // nobody serves it
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = milliseconds(300);
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(test::raises([&] { TcpStore client(o); }, {ErrorCode::kTimeout},
                           {str_cat("127.0.0.1:", port), "300 ms", "MASTER_ADDR"}));
  EXPECT_GE(seconds_since(start), 0.25);
  EXPECT_LT(seconds_since(start), 3.0);
}

// How the ranks of a group learn that a process is gone.
TEST(TcpStore, RecordsAnnouncedRanksWhoseConnectionCloses) {
  TcpStore server(server_options());
  std::make_unique<TcpStore>(client_of(server, 3)).reset();
  std::make_unique<TcpStore>(client_of(server)).reset();  // anonymous: no record
  server.wait({TcpStore::left_key(3)}, milliseconds(5000));
  const auto left = server.list(TcpStore::kLeftPrefix);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].first, "rd/left/3");
}

TEST(TcpStore, AServerThatIsGoneIsAnIoErrorNamingTheAddress) {
  auto server = std::make_unique<TcpStore>(server_options());
  TcpStore client(client_of(*server));
  const std::string address = str_cat("127.0.0.1:", server->port());
  server.reset();
  EXPECT_TRUE(test::raises([&] { client.get("k"); }, {ErrorCode::kIo}, {address, "rank 0"}));
  EXPECT_TRUE(test::raises([&] { client.set("k", "v"); }, {ErrorCode::kIo}, {address}));
}

TEST(TcpStore, BadOptionsAndBusyPorts) {
  TcpStoreOptions o;
  o.port = 70000;
  EXPECT_TRUE(test::raises([&] { TcpStore s(o); }, {ErrorCode::kInvalidArgument},
                           {"TcpStore", "port", "70000"}));
  o.port = 0;
  EXPECT_TRUE(
      test::raises([&] { TcpStore s(o); }, {ErrorCode::kInvalidArgument}, {"client", "port"}));
  TcpStore server(server_options());
  TcpStoreOptions twice = server_options();
  twice.port = server.port();
  EXPECT_TRUE(test::raises([&] { TcpStore s(twice); }, {ErrorCode::kIo},
                           {"cannot serve on", str_cat("127.0.0.1:", server.port())}));
}

// --- the launcher environment --------------------------------------------------------------

dist::GetEnv env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

const std::map<std::string, std::string> kTorchrun = {{"RANK", "2"},
                                                      {"WORLD_SIZE", "4"},
                                                      {"LOCAL_RANK", "1"},
                                                      {"MASTER_ADDR", "10.0.0.1"},
                                                      {"MASTER_PORT", "29500"}};

TEST(LaunchEnv, TorchrunStyleVariables) {
  const dist::LaunchEnv env = dist::launch_env_from_environment(env_of(kTorchrun));
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.launcher, "torchrun-style");
}

TEST(LaunchEnv, OpenMpiVariables) {
  const dist::LaunchEnv env =
      dist::launch_env_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                                {"OMPI_COMM_WORLD_SIZE", "8"},
                                                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                                {"MASTER_ADDR", "node0"},
                                                {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.launcher, "Open MPI");
}

TEST(LaunchEnv, StorePortUnderTorchrunsAgentStore) {
  auto vars = kTorchrun;
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  EXPECT_EQ(dist::launch_env_from_environment(env_of(vars)).master_port, 29501);
  vars["RD_STORE_PORT"] = "40000";
  EXPECT_EQ(dist::launch_env_from_environment(env_of(vars)).master_port, 40000);
}

TEST(LaunchEnv, MissingOrMalformedVariablesAreNamed) {
  auto without = [](const std::string& name) {
    auto vars = kTorchrun;
    vars.erase(name);
    return env_of(vars);
  };
  auto with = [](const std::string& name, const std::string& value) {
    auto vars = kTorchrun;
    vars[name] = value;
    return env_of(vars);
  };
  using dist::launch_env_from_environment;
  EXPECT_TRUE(test::raises([&] { launch_env_from_environment(env_of({})); },
                           {ErrorCode::kInvalidArgument}, {"RANK", "OMPI_COMM_WORLD_RANK"}));
  for (const char* name : {"WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    EXPECT_TRUE(test::raises([&] { launch_env_from_environment(without(name)); },
                             {ErrorCode::kInvalidArgument}, {name, "is not set"}))
        << name;
  }
  EXPECT_TRUE(test::raises([&] { launch_env_from_environment(with("RANK", "two")); },
                           {ErrorCode::kInvalidArgument}, {"RANK", "'two'"}));
  EXPECT_TRUE(test::raises([&] { launch_env_from_environment(with("MASTER_PORT", "70000")); },
                           {ErrorCode::kInvalidArgument}, {"MASTER_PORT", "'70000'"}));
  // Past int's range, or with trailing text: refused, not clamped or cut.
  for (const char* value : {"99999999999999999999", "4 ", "+4", ""}) {
    EXPECT_TRUE(test::raises([&] { launch_env_from_environment(with("WORLD_SIZE", value)); },
                             {ErrorCode::kInvalidArgument}, {"WORLD_SIZE"}))
        << "'" << value << "'";
  }
  EXPECT_TRUE(test::raises([&] { launch_env_from_environment(with("RANK", "4")); },
                           {ErrorCode::kInvalidArgument}, {"rank 4", "world of 4"}));
  EXPECT_TRUE(test::raises(
      [&] {
        launch_env_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "0"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                            {"MASTER_PORT", "1"}}));
      },
      {ErrorCode::kInvalidArgument}, {"MASTER_ADDR", "mpirun -x"}));
}

// --- a one-process group -----------------------------------------------------------------

dist::LaunchEnv single_rank_env() {
  dist::LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = dist::pick_free_port();
  return env;
}

TEST(InitProcessGroup, UnknownBackendIsNamed) {
  dist::ProcessGroupOptions o;
  o.backend = "mpi";
  EXPECT_TRUE(test::raises([&] { dist::init_process_group(single_rank_env(), o); },
                           {ErrorCode::kInvalidArgument}, {"init_process_group", "'mpi'", "gloo"}));
}

TEST(InitProcessGroup, OneRankGlooGroupRunsEveryOperation) {
  if (!dist::gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  dist::ProcessGroupOptions o;
  o.timeout = std::chrono::seconds(10);
  o.rendezvous_timeout = std::chrono::seconds(10);
  const std::shared_ptr<dist::Communicator> comm = dist::init_process_group(single_rank_env(), o);
  EXPECT_EQ(comm->backend_name(), "gloo");
  EXPECT_EQ(comm->size(), 1);
  Tensor t = full({3}, 2.5, DType::kFloat16);
  comm->all_reduce(t, dist::ReduceOp::kMax);
  EXPECT_EQ(t.to(DType::kFloat64).to_vector<double>(), (std::vector<double>{2.5, 2.5, 2.5}));
  const Tensor out = empty({1, 3}, DType::kFloat16);
  comm->all_gather(out, t);
  comm->reduce_scatter(t, out);
  comm->broadcast(t, 0);
  comm->barrier();
  EXPECT_EQ(t.to(DType::kFloat64).to_vector<double>(), (std::vector<double>{2.5, 2.5, 2.5}));
  // Transfers to itself: matched in order, checked, and a receive of nothing sent fails.
  const Tensor first = full({2}, 1.0, DType::kFloat64), second = full({3}, 2.0, DType::kFloat32);
  const Tensor a = empty({2}, DType::kFloat64), b = empty({3}, DType::kFloat32);
  std::unique_ptr<dist::Request> recv_a = comm->irecv(a, 0), recv_b = comm->irecv(b, 0);
  comm->isend(first, 0)->wait();
  comm->isend(second, 0)->wait();
  recv_b->wait();
  recv_a->wait();
  EXPECT_EQ(a.to_vector<double>(), (std::vector<double>{1, 1}));
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{2, 2, 2}));
  comm->isend(second, 0);
  EXPECT_TRUE(test::raises([&] { comm->irecv(a, 0)->wait(); }, {ErrorCode::kShapeMismatch},
                           {"irecv", "[2] float64", "[3] float32"}));
  EXPECT_TRUE(test::raises([&] { comm->irecv(a, 0)->wait(); }, {ErrorCode::kInvalidArgument},
                           {"irecv", "itself", "not sent"}));
  EXPECT_TRUE(test::raises(
      [&] {
        comm->all_reduce(t.expand({2, 3}).t());
      },
      {ErrorCode::kInvalidArgument}, {"all_reduce", "contiguous"}));
  std::shared_ptr<dist::Communicator> sub = comm->split(5, 0);
  ASSERT_NE(sub, nullptr);
  sub->barrier();
  EXPECT_EQ(comm->split(-1, 0), nullptr);
  EXPECT_EQ(comm->stats().collectives, 5);  // splits move no payload and are not counted
  comm->abort("done here");
  EXPECT_TRUE(
      test::raises([&] { comm->barrier(); }, {ErrorCode::kAborted}, {"rank 0 aborted: done here"}));
}

}  // namespace
}  // namespace rd
