// Shared libraries opened at run time (dlopen) instead of linked, so that a program needs one
// only when it uses what that library serves (cuBLASLt for CUDA GEMMs, cuDNN for kCudnn
// attention): a CPU-only run of a CUDA build starts without them (docs/architecture.md).
#pragma once

#include <string>
#include <vector>

namespace rd::kernels {

// A library opened by open_shared_library(). It is never closed: like a linked library it
// stays loaded for the rest of the process, so the function pointers taken from it stay valid.
struct SharedLibrary {
  std::string name;      // for messages, e.g. "cuBLASLt"
  void* handle = nullptr;
  std::string problem;   // why the library (or one of its symbols) cannot be used; "" if it can

  bool usable() const { return problem.empty(); }

  // The address of `symbol`, or nullptr (recording the first missing symbol in `problem`)
  // when the library lacks it or was not opened.
  void* find_symbol(const char* symbol);

  // Sets *fn to `symbol` cast to F, the function-pointer type of the entry point.
  template <class F>
  void resolve(const char* symbol, F* fn) {
    *fn = reinterpret_cast<F>(find_symbol(symbol));
  }
};

// Opens the first of `candidates` that the dynamic loader accepts (a bare soname is looked up
// on the loader's search path, a path is taken as is), with RTLD_NOW | RTLD_LOCAL. When none
// opens, `problem` names `name` and every candidate with the loader's reason.
SharedLibrary open_shared_library(std::string name, const std::vector<std::string>& candidates);

}  // namespace rd::kernels
