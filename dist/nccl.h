// The NCCL communicator: ranks on CUDA devices, one process per GPU or one process driving
// several GPUs from threads. NCCL is opened at run time (libnccl.so.2), so every program
// runs without it; nccl_available() says whether it can be used.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ringdilated/dist/communicator.h"

namespace rd::dist {

struct NcclOptions {
  // How long a host wait on NCCL work (barrier, abort checks) may take before the
  // communicator is aborted and the wait fails with kTimeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// True when this build has CUDA, libnccl.so.2 loads and a GPU is visible. *why_not (when
// given) says what is missing otherwise.
bool nccl_available(std::string* why_not = nullptr);

// A fresh NCCL unique id (NCCL_UNIQUE_ID_BYTES bytes): one rank makes it and shares it with
// the others (e.g. through the bootstrap's key-value store) before they all connect.
std::string nccl_unique_id();

// This process's rank `rank` of `size`, on `device`, joined through `unique_id`. Collective
// over the ranks: every rank must call it.
std::shared_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank,
                                                     int size, Device device,
                                                     NcclOptions options = {});

// One process driving several GPUs: rank i on devices[i]. Give each communicator to its own
// thread (NCCL calls of one group must be issued concurrently).
std::vector<std::shared_ptr<Communicator>> make_nccl_group(const std::vector<Device>& devices,
                                                           NcclOptions options = {});

}  // namespace rd::dist
