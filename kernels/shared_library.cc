// dlopen / dlsym behind SharedLibrary: libraries that are loaded on first use, not linked.
#include "ringdilated/kernels/shared_library.h"

#include <dlfcn.h>

#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::kernels {
namespace {

// dlerror()'s text, or `fallback` when the loader gave none.
std::string loader_error(const std::string& fallback) {
  const char* error = dlerror();
  return error != nullptr ? std::string(error) : fallback;
}

}  // namespace

void* SharedLibrary::find_symbol(const char* symbol) {
  if (handle == nullptr) {
    if (problem.empty()) problem = str_cat(name, " is not loaded");
    return nullptr;
  }
  dlerror();  // clear a stale error so that the one read below is this lookup's
  void* address = dlsym(handle, symbol);
  if (address == nullptr && problem.empty()) {
    problem = str_cat(name, " has no ", symbol, " (", loader_error("symbol not found"), ")");
  }
  return address;
}

SharedLibrary open_shared_library(std::string name, const std::vector<std::string>& candidates) {
  SharedLibrary library;
  library.name = std::move(name);
  std::string reasons;
  for (const std::string& candidate : candidates) {
    library.handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library.handle != nullptr) return library;
    reasons += str_cat(reasons.empty() ? "" : "; ", loader_error(candidate + ": not found"));
  }
  library.problem = str_cat(library.name, " could not be loaded (",
                            candidates.empty() ? "no candidate file" : reasons, ")");
  return library;
}

}  // namespace rd::kernels
