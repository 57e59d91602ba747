// The in-process communicator: P ranks as threads of one process, exchanging tensors by
// copies, on the CPU or with all ranks sharing one device. Every distributed test runs on it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "ringdilated/dist/communicator.h"

namespace rd::dist {

struct InProcessOptions {
  // How long any wait (a peer's send, the other ranks of a collective) may take before it
  // fails with kTimeout, naming the ranks it waited for, and aborts the group.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// `size` communicators of one group: element i is rank i. Give each to its own thread; on a
// GPU, give each thread its own stream (a rank orders its exchanges by events on it).
std::vector<std::shared_ptr<Communicator>> make_in_process_group(int size, Device device = {},
                                                                 InProcessOptions options = {});

// Runs body(comm) on `size` threads, rank i on thread i (on a GPU with a stream of its own,
// synchronized before the thread ends), and waits for all. When a rank
// throws, the group is aborted, so the others fail fast (kAborted, naming the rank) instead
// of waiting for it; the first failure (by rank) is then rethrown, its message prefixed with
// its rank.
void run_in_process(int size, const std::function<void(Communicator& comm)>& body,
                    Device device = {}, InProcessOptions options = {});

}  // namespace rd::dist
