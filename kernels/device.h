// Device: where memory lives (the CPU, or CUDA device `index`). Plain data, shared by every
// layer; runtime queries about devices live in tensor/device.h.
#pragma once

#include <cstdint>
#include <string>

namespace rd {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static constexpr Device cpu() { return Device{DeviceType::kCPU, 0}; }
  static constexpr Device cuda(int index = 0) { return Device{DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  std::string str() const {
    return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
  }
  friend bool operator==(const Device&, const Device&) = default;
};

}  // namespace rd
