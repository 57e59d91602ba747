// The bounded wait the NCCL communicator polls its background work with (see poll.h).
#include "ringdilated/dist/poll.h"

#include <thread>

namespace rd::dist {

bool poll_until(const std::function<bool()>& finished,
                std::chrono::steady_clock::time_point deadline, std::chrono::microseconds interval,
                std::chrono::microseconds spin) {
  const std::chrono::steady_clock::time_point spin_until = std::chrono::steady_clock::now() + spin;
  for (;;) {
    // The clock is read before the look: a look that began before the deadline and found the
    // work done counts as done, however long the look itself took.
    const std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now();
    if (finished()) return true;
    if (now >= deadline) return false;
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(interval);
    }
  }
}

}  // namespace rd::dist
