// Generator: a seeded, reproducible random stream (Philox4x32-10, counter based). Each draw
// advances the counter by the number of values used, so results do not depend on the device
// or the thread count.
#pragma once

#include <cstdint>

namespace rd {

class Generator {
 public:
  struct State {
    uint64_t seed = 0;
    uint64_t offset = 0;
    friend bool operator==(const State&, const State&) = default;
  };

  explicit Generator(uint64_t seed = 0) : state_{seed, 0} {}
  void manual_seed(uint64_t seed) { state_ = {seed, 0}; }
  uint64_t seed() const { return state_.seed; }
  State state() const { return state_; }
  void set_state(State s) { state_ = s; }
  // Reserves `count` counters and returns the first; the caller uses [first, first + count).
  uint64_t advance(uint64_t count) {
    uint64_t first = state_.offset;
    state_.offset += count;
    return first;
  }

 private:
  State state_;
};

}  // namespace rd
