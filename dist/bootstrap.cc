// init_process_group and the launcher environment it reads (see bootstrap.h).
#include "ringdilated/dist/bootstrap.h"

#include <unistd.h>

#include <cstdlib>

#include "ringdilated/dist/gloo.h"
#include "ringdilated/dist/nccl.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/number_text.h"

namespace rd::dist {
namespace {

constexpr const char* kOp = "init_process_group";

bool is_set(const GetEnv& getenv, const char* name) {
  const char* value = getenv(name);
  return value != nullptr && *value != '\0';
}

std::string string_var(const GetEnv& getenv, const char* name, const char* why) {
  RD_CHECK(is_set(getenv, name), kInvalidArgument, kOp, ": environment variable ", name,
           " is not set (", why, ")");
  return getenv(name);
}

int int_var(const GetEnv& getenv, const char* name, int min, int max, const char* why) {
  const std::string text = string_var(getenv, name, why);
  const std::optional<int> value = number_from_text<int>(text);
  RD_CHECK(value && *value >= min && *value <= max, kInvalidArgument, kOp,
           ": environment variable ", name, " must be an integer in [", min, ", ", max, "], got '",
           text, "'");
  return *value;
}

constexpr int kMaxWorld = 1 << 24;
constexpr const char* kLauncherHint =
    "rd_launch and torchrun --no-python set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
    "MASTER_PORT; mpirun sets OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK";

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1";
}

// The address other ranks reach this one at: loopback for a one-machine job, else the host
// name (which Gloo resolves to this machine's address).
std::string default_hostname(const std::string& master_addr) {
  if (is_loopback(master_addr)) return "127.0.0.1";
  char name[256] = {};
  RD_CHECK(::gethostname(name, sizeof(name) - 1) == 0, kIo, kOp,
           ": gethostname failed; set ProcessGroupOptions::hostname");
  return name;
}

}  // namespace

LaunchEnv launch_env_from_environment(const GetEnv& getenv_arg) {
  const GetEnv getenv =
      getenv_arg ? getenv_arg : GetEnv([](const char* name) { return std::getenv(name); });
  LaunchEnv env;
  if (is_set(getenv, "RANK")) {
    env.launcher = "torchrun-style";
    env.world_size = int_var(getenv, "WORLD_SIZE", 1, kMaxWorld, kLauncherHint);
    env.rank = int_var(getenv, "RANK", 0, kMaxWorld - 1, kLauncherHint);
    env.local_rank = int_var(getenv, "LOCAL_RANK", 0, kMaxWorld - 1, kLauncherHint);
  } else if (is_set(getenv, "OMPI_COMM_WORLD_RANK")) {
    env.launcher = "Open MPI";
    env.world_size = int_var(getenv, "OMPI_COMM_WORLD_SIZE", 1, kMaxWorld, kLauncherHint);
    env.rank = int_var(getenv, "OMPI_COMM_WORLD_RANK", 0, kMaxWorld - 1, kLauncherHint);
    env.local_rank = int_var(getenv, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxWorld - 1, kLauncherHint);
  } else {
    RD_FAIL(kInvalidArgument, kOp, ": no launcher environment: neither RANK nor ",
            "OMPI_COMM_WORLD_RANK is set (", kLauncherHint, ")");
  }
  RD_CHECK(env.rank < env.world_size, kInvalidArgument, kOp, ": rank ", env.rank,
           " is outside a world of ", env.world_size, " ranks (", env.launcher, " variables)");
  const char* store_why =
      "the TCP store is served by rank 0 at MASTER_ADDR:MASTER_PORT; under mpirun export "
      "them, e.g. mpirun -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500";
  env.master_addr = string_var(getenv, "MASTER_ADDR", store_why);
  if (is_set(getenv, "RD_STORE_PORT")) {
    env.master_port = int_var(getenv, "RD_STORE_PORT", 1, 65535, store_why);
  } else {
    env.master_port = int_var(getenv, "MASTER_PORT", 1, 65535, store_why);
    // torchrun's agent serves its own store on MASTER_PORT and says so with this variable.
    const char* agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent_store != nullptr && std::string(agent_store) == "True") {
      RD_CHECK(env.master_port < 65535, kInvalidArgument, kOp,
               ": MASTER_PORT 65535 is torchrun's store; set RD_STORE_PORT for ours");
      ++env.master_port;
    }
  }
  return env;
}

std::shared_ptr<TcpStore> connect_store(const LaunchEnv& env, const ProcessGroupOptions& options) {
  TcpStoreOptions store_options;
  store_options.host = env.master_addr;
  store_options.port = env.master_port;
  store_options.is_server = env.rank == 0;
  store_options.rank = env.rank;
  store_options.connect_timeout = options.rendezvous_timeout;
  store_options.timeout = options.timeout;
  return std::make_shared<TcpStore>(store_options);
}

std::shared_ptr<Communicator> init_process_group(const ProcessGroupOptions& options) {
  return init_process_group(launch_env_from_environment(), options);
}

std::shared_ptr<Communicator> init_process_group(const LaunchEnv& env,
                                                 const ProcessGroupOptions& options) {
  RD_CHECK(options.backend == "gloo" || options.backend == "nccl", kInvalidArgument, kOp,
           ": unknown backend '", options.backend, "' (gloo or nccl)");
  const std::string who = str_cat(kOp, ": rank ", env.rank, " of ", env.world_size, ": ");
  if (options.backend == "nccl") {
    std::string why_not;
    RD_CHECK(nccl_available(&why_not), kUnimplemented, who, "backend 'nccl' cannot run: ", why_not);
    try {
      // Rank 0 makes the NCCL unique id and shares it through the store.
      std::shared_ptr<TcpStore> store = connect_store(env, options);
      constexpr const char* kIdKey = "nccl_unique_id";
      if (env.rank == 0) store->set(kIdKey, nccl_unique_id());
      const std::string id = store->get(kIdKey);
      NcclOptions nccl_options;
      nccl_options.timeout = options.timeout;
      nccl_options.store = store;  // the watchdog learns from it when a rank is gone
      const Device device = options.device.is_cuda() ? options.device : Device::cuda(env.local_rank);
      return make_nccl_communicator(id, env.rank, env.world_size, device, nccl_options);
    } catch (const Error& e) {
      throw Error(e.code(), who + e.what());
    }
  }
  RD_CHECK(gloo_available(), kUnimplemented, kOp, ": backend 'gloo' is not in this build ",
           "(libgloo-dev was not found when it was configured)");
  try {
    std::shared_ptr<TcpStore> store = connect_store(env, options);
    GlooOptions gloo_options;
    gloo_options.timeout = options.timeout;
    gloo_options.rendezvous_timeout = options.rendezvous_timeout;
    gloo_options.hostname =
        options.hostname.empty() ? default_hostname(env.master_addr) : options.hostname;
    return make_gloo_communicator(std::move(store), env.rank, env.world_size, gloo_options);
  } catch (const Error& e) {
    throw Error(e.code(), who + e.what());
  }
}

}  // namespace rd::dist
