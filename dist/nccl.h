// The NCCL communicator: ranks on CUDA devices, one process per GPU or one process driving
// several GPUs from threads. NCCL is opened at run time (libnccl.so.2), so every program
// runs without it; nccl_available() says whether it can be used.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/dist/tcp_store.h"

namespace rd::dist {

struct NcclOptions {
  // How long a host wait on NCCL work (barrier, abort checks, every operation of ranks that
  // are threads: make_nccl_group, and, with `nonblocking`, the creation of the communicators
  // and the enqueueing of each operation) may take before the communicator is aborted and
  // the wait fails with kTimeout naming the operation (and, for ranks that are threads, the
  // ranks that never issued it).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Non-blocking NCCL communicators (ncclConfig_t::blocking = 0). A blocking NCCL call may
  // itself wait on the host for the other ranks: creating a communicator, a split, and the
  // first operation between ranks that never exchanged data (NCCL connects them then) do; a
  // rank that never comes then hangs the caller inside NCCL, before any timeout of ours can
  // act (ranks that are threads hung so on 4 H200s, issue 19). Non-blocking, NCCL does that
  // work on a thread of its own and answers ncclInProgress; the caller polls NCCL's state
  // (ncclCommGetAsyncError) under `timeout`, and can abort. Costs NCCL's thread start per
  // operation (tens of microseconds). False: blocking communicators, as before issue 19;
  // kept to compare, should a GPU or NCCL version misbehave with non-blocking ones.
  bool nonblocking = true;
  // The job's store (init_process_group passes it; one process per GPU). With it, a watchdog
  // thread of this process fails the communicator, and its splits, when another rank is gone
  // (its process exited or was killed: TcpStore::left_key), when another rank aborted, or on
  // an asynchronous NCCL error. NCCL work waiting for a dead peer would otherwise spin on the
  // GPU forever: after `peer_grace` it is aborted (ncclCommAbort), so the host waits return
  // and the next operation throws kAborted naming the rank that failed. The abort of one
  // rank is written to the store, so the others stop too. Null: no watchdog (ranks that are
  // threads of one process, make_nccl_group, fail together).
  std::shared_ptr<TcpStore> store;
  std::chrono::milliseconds watch_interval{200};  // how often the watchdog looks
  // How long NCCL work still queued when a peer is found gone may take to finish on its own
  // (a peer that ended normally has done its part of every operation) before the abort.
  std::chrono::milliseconds peer_grace{std::chrono::seconds(2)};
  // make_nccl_group only: operations return once queued, as with one process per GPU, so
  // transfers overlap compute (no per-operation host wait, no per-operation timeout). Safe
  // only while no CUDA call of a rank's thread waits for its own GPU: load every kernel at
  // start (CUDA_MODULE_LOADING=EAGER, read by CUDA when it starts) and let no allocation or
  // free synchronize the device during the run. For benchmarks that want the overlap a
  // training job of one process per GPU has.
  bool thread_ranks_overlap = false;
};

// True when this build has CUDA, libnccl.so.2 loads and a GPU is visible. *why_not (when
// given) says what is missing otherwise.
bool nccl_available(std::string* why_not = nullptr);

// A fresh NCCL unique id (NCCL_UNIQUE_ID_BYTES bytes): one rank makes it and shares it with
// the others (e.g. through the bootstrap's key-value store) before they all connect.
std::string nccl_unique_id();

// This process's rank `rank` of `size`, on `device`, joined through `unique_id`. Collective
// over the ranks: every rank must call it. Non-blocking (options.nonblocking), it waits at
// most options.timeout for the others, then fails with kTimeout.
std::shared_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank,
                                                     int size, Device device,
                                                     NcclOptions options = {});

// One process driving several GPUs: rank i on devices[i]. Give each communicator to its own
// thread (NCCL calls of one group must be issued concurrently). These ranks share the CUDA
// driver, whose process-wide locks a thread may hold while it waits for its own GPU (lazy
// kernel loading, allocations): were an NCCL kernel of its rank still waiting there for a
// peer thread that needs the lock, both would hang. So each operation of these ranks, and of
// their splits, is finished on the host before it returns (no overlap of transfers with
// compute, unlike one process per GPU); a wait past options.timeout aborts every rank of
// the group and fails with kTimeout naming the operation and the ranks that never issued it
// (the other ranks then fail with kAborted and the same message). A rank that skips an
// operation then cannot hang the others inside NCCL's own calls: the communicators are
// non-blocking (NcclOptions::nonblocking).
std::vector<std::shared_ptr<Communicator>> make_nccl_group(const std::vector<Device>& devices,
                                                           NcclOptions options = {});

}  // namespace rd::dist
