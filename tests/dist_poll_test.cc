// dist::poll_until, the bounded wait behind the NCCL communicator's host waits on
// non-blocking communicators (NcclOptions::nonblocking): checked here on the CPU with fake
// states, since a stuck NCCL wait itself needs several GPUs (cuda_nccl_test).
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>

#include "ringdilated/dist/poll.h"

namespace rd {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(PollUntil, WorkAlreadyDoneIsLookedAtOnce) {
  int looks = 0;
  EXPECT_TRUE(dist::poll_until([&] { return ++looks > 0; }, Clock::now() + milliseconds(500),
                               microseconds(100)));
  EXPECT_EQ(looks, 1);
}

TEST(PollUntil, LooksUntilTheWorkIsDone) {
  int looks = 0;  // "in progress" for four looks, as ncclCommGetAsyncError would say
  EXPECT_TRUE(dist::poll_until([&] { return ++looks == 5; }, Clock::now() + milliseconds(5000),
                               microseconds(100)));
  EXPECT_EQ(looks, 5);
}

// Work that ends within microseconds (NCCL enqueueing an operation on its own thread) is
// looked at again at once during the spin, not after a sleep of `interval`.
TEST(PollUntil, LooksAgainAtOnceWhileSpinning) {
  int looks = 0;
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(dist::poll_until([&] { return ++looks == 5; }, start + milliseconds(30000),
                               std::chrono::seconds(1), milliseconds(500)));
  EXPECT_EQ(looks, 5);
  EXPECT_LT(seconds_since(start), 0.9);  // no sleep of a second between looks
}

// A state that never leaves "in progress" (a rank that never issued its part) ends the wait
// at the deadline, not before it and not long after.
TEST(PollUntil, WorkNeverDoneEndsAtTheDeadline) {
  int looks = 0;
  const auto never_done = [&] { return ++looks < 0; };
  const Clock::time_point start = Clock::now();
  EXPECT_FALSE(dist::poll_until(never_done, start + milliseconds(200), microseconds(100)));
  const double waited = seconds_since(start);
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 2.0);
  EXPECT_GE(looks, 2);  // one look at least after the deadline
}

TEST(PollUntil, APastDeadlineStillLooksOnce) {
  int looks = 0;
  const auto never_done = [&] { return ++looks < 0; };
  EXPECT_FALSE(dist::poll_until(never_done, Clock::now() - milliseconds(1), microseconds(100)));
  EXPECT_EQ(looks, 1);
  EXPECT_TRUE(
      dist::poll_until([] { return true; }, Clock::now() - milliseconds(1), microseconds(100)));
}

// A look that finds a failure (an asynchronous NCCL error, an abort by another rank) ends
// the wait with it.
TEST(PollUntil, AFailureFoundByALookPropagates) {
  int looks = 0;
  const Clock::time_point start = Clock::now();
  const auto fails_at_the_third_look = [&]() -> bool {
    if (++looks == 3) throw std::runtime_error("aborted");
    return false;
  };
  EXPECT_THROW(
      dist::poll_until(fails_at_the_third_look, start + milliseconds(5000), microseconds(100)),
      std::runtime_error);
  EXPECT_EQ(looks, 3);
  EXPECT_LT(seconds_since(start), 2.0);
}

}  // namespace
}  // namespace rd
