// Starting a process group from a launcher's environment: rd_launch and torchrun --no-python
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, with MASTER_ADDR and MASTER_PORT exported by
// hand). docs/launching.md describes the launchers, the variables and the timeouts.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/dist/tcp_store.h"

namespace rd::dist {

// Where this process sits in the job, as the launcher described it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;       // rank among the processes on this machine (picks the GPU)
  std::string master_addr;  // rank 0's host: the store is served there
  int master_port = 0;      // the store's port (RD_STORE_PORT when set, see below)
  std::string launcher;     // "torchrun-style" or "Open MPI": which variables were read
};

// Reads the launcher's variables through `getenv` (std::getenv by default). RANK wins over
// OMPI_COMM_WORLD_RANK when both are set. RD_STORE_PORT, when set, replaces MASTER_PORT as the
// store's port: torchrun's agent already serves its own store on MASTER_PORT
// (TORCHELASTIC_USE_AGENT_STORE=True), and then MASTER_PORT + 1 is used unless RD_STORE_PORT
// says otherwise. A missing or malformed variable is a kInvalidArgument naming it.
using GetEnv = std::function<const char*(const char*)>;
LaunchEnv launch_env_from_environment(const GetEnv& getenv = {});

struct ProcessGroupOptions {
  // "gloo" (CPU tensors) or "nccl" (CUDA tensors, one GPU per process: `device`, or
  // cuda:LOCAL_RANK when it is the CPU).
  std::string backend = "gloo";
  Device device = Device::cpu();
  // Every operation's timeout (a transfer, a collective), see GlooOptions::timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Reaching the store (rank 0 may start later than the others) and connecting the ranks.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
  // The address this rank's connections listen on. Empty: 127.0.0.1 when MASTER_ADDR is a
  // loopback address, else this machine's host name.
  std::string hostname;
};

// This rank's connection to the job's TCP store, as init_process_group makes it: rank 0
// serves it on MASTER_ADDR:MASTER_PORT; every rank retries connecting until
// rendezvous_timeout (then kTimeout naming the address) and announces its rank (so the
// others learn when its process is gone). For what a backend must exchange before it can
// start, e.g. an NCCL unique id.
std::shared_ptr<TcpStore> connect_store(const LaunchEnv& env, const ProcessGroupOptions& options);

// Builds this process's communicator of the whole job: rank 0 serves the TCP store on
// MASTER_ADDR:MASTER_PORT, every rank connects to it (retrying until rendezvous_timeout, then
// kTimeout naming the address), and the backend's rendezvous runs over it. Collective: every
// rank of the job calls it.
std::shared_ptr<Communicator> init_process_group(const ProcessGroupOptions& options = {});
std::shared_ptr<Communicator> init_process_group(const LaunchEnv& env,
                                                 const ProcessGroupOptions& options);

}  // namespace rd::dist
