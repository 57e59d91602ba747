// The JSON context every GPU bench records (report.py prints it): the command line and the
// device's facts (name, compute capability, SMs, memory, driver, runtime, cuDNN).
#pragma once

#include <string>

namespace rd::bench {

// The command line as one string, for the JSON context.
inline std::string command_line(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) command.push_back(' ');
    command.append(argv[i]);
  }
  return command;
}

}  // namespace rd::bench

#if defined(RD_WITH_CUDA)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "ringdilated/kernels/cuda/cudnn_attention.h"
#include "ringdilated/kernels/cuda/runtime.h"
#include "ringdilated/kernels/error.h"
#include "cuda_bench_util.h"

namespace rd::bench {

// Device facts and the command line for the JSON context (report.py prints them).
inline void add_cuda_context(const std::string& command, int device) {
  benchmark::AddCustomContext("command", command);
  if (!have_cuda_device()) {
    benchmark::AddCustomContext("cuda_device", "none visible");
    return;
  }
  cudaDeviceProp prop{};
  int driver = 0, runtime = 0;
  RD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  RD_CUDA_CHECK(cudaDriverGetVersion(&driver));
  RD_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  auto version = [](int v) { return rd::str_cat(v / 1000, ".", (v % 1000) / 10); };
  benchmark::AddCustomContext("cuda_device", prop.name);
  benchmark::AddCustomContext("cuda_compute_capability", rd::str_cat(prop.major, ".", prop.minor));
  benchmark::AddCustomContext("cuda_sm_count", std::to_string(prop.multiProcessorCount));
  benchmark::AddCustomContext("cuda_memory_gib",
                              rd::str_cat(static_cast<double>(prop.totalGlobalMem) / (1 << 30)));
  benchmark::AddCustomContext("cuda_driver", version(driver));
  benchmark::AddCustomContext("cuda_runtime", version(runtime));
  benchmark::AddCustomContext("cudnn_version",
                              std::to_string(rd::kernels::cuda::cudnn_runtime_version()));
}

}  // namespace rd::bench

#endif  // RD_WITH_CUDA
