// Internal to rd_dist: a wait for work that finishes in the background, bounded by a
// deadline. The NCCL communicator waits on the host with it: NCCL offers no call that blocks
// until a non-blocking communicator is ready, only a state to look at (ncclInProgress while
// the work goes on). Apart from NCCL, so that its timing is tested on the CPU.
#pragma once

#include <chrono>
#include <functional>

namespace rd::dist {

// Asks `finished` until it returns true, and returns true then; returns false once `deadline`
// has passed with `finished` still false. It is always asked at least once, and once more at
// or after the deadline, so work done just in time counts. For the first `spin` after the
// call it is asked again at once (yielding the CPU in between: work that ends within
// microseconds is not delayed by a sleep), then every `interval`. An exception from
// `finished` (a failure it found) ends the wait and propagates.
bool poll_until(const std::function<bool()>& finished,
                std::chrono::steady_clock::time_point deadline, std::chrono::microseconds interval,
                std::chrono::microseconds spin = std::chrono::microseconds(0));

}  // namespace rd::dist
