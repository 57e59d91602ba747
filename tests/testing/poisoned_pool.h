// A scope in which every new block of a device's pool is filled with 0xff bytes (NaN in
// every float dtype): a kernel or engine that reads memory it never wrote shows NaN.
#pragma once

#include <cstdint>
#include <optional>

#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/device.h"

namespace rd::test {

class PoisonedPool {
 public:
  explicit PoisonedPool(Device device) : device_(device) {
    allocator_for(device_).set_fill_on_allocate(uint8_t{0xff});
  }
  ~PoisonedPool() { allocator_for(device_).set_fill_on_allocate(std::nullopt); }
  PoisonedPool(const PoisonedPool&) = delete;
  PoisonedPool& operator=(const PoisonedPool&) = delete;

 private:
  Device device_;
};

}  // namespace rd::test
