// Sequential and ModuleList (see containers.h).
#include "ringdilated/nn/containers.h"

#include <string>
#include <utility>

#include "ringdilated/kernels/error.h"

namespace rd::nn {
namespace containers_internal {

void check_index(const char* container, size_t index, size_t size) {
  RD_CHECK(index < size, kOutOfRange, container, ": index ", index, " is out of range for ",
           size, " modules");
}

void throw_wrong_type(const char* container, size_t index, const char* wanted) {
  RD_FAIL(kInvalidArgument, container, ": module ", index, " is not a ", wanted);
}

}  // namespace containers_internal

Sequential::Sequential(std::vector<std::shared_ptr<UnaryModule>> layers) {
  for (std::shared_ptr<UnaryModule>& layer : layers) append(std::move(layer));
}

void Sequential::append(std::shared_ptr<UnaryModule> layer) {
  register_module(std::to_string(layers_.size()), layer);  // checks for null
  layers_.push_back(std::move(layer));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const std::shared_ptr<UnaryModule>& layer : layers_) y = layer->forward(y);
  return y;
}

UnaryModule& Sequential::operator[](size_t index) const {
  containers_internal::check_index("Sequential", index, layers_.size());
  return *layers_[index];
}

ModuleList::ModuleList(std::vector<std::shared_ptr<Module>> modules) {
  for (std::shared_ptr<Module>& module : modules) append(std::move(module));
}

void ModuleList::append(std::shared_ptr<Module> module) {
  register_module(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
}

Module& ModuleList::operator[](size_t index) const {
  containers_internal::check_index("ModuleList", index, modules_.size());
  return *modules_[index];
}

}  // namespace rd::nn
