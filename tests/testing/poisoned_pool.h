// A scope in which every new block of a device's pool is filled with 0xff bytes (NaN in
// every float dtype): a kernel or engine that reads memory it never wrote shows NaN.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

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

// PoisonedPool for a whole test binary, on the CPU and (where one is visible) the first
// GPU: `::testing::AddGlobalTestEnvironment(new PoisonedPoolEnvironment)` at namespace
// scope. Buffers the engine zeroes only in part (rows no call writes) then show any element
// left unwritten in every test.
class PoisonedPoolEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    for (const Device device : devices()) {
      allocator_for(device).set_fill_on_allocate(uint8_t{0xff});
    }
  }
  void TearDown() override {
    for (const Device device : devices()) allocator_for(device).set_fill_on_allocate(std::nullopt);
  }

 private:
  static std::vector<Device> devices() {
    if (!cuda_available()) return {Device::cpu()};
    return {Device::cpu(), Device::cuda(0)};
  }
};

}  // namespace rd::test
