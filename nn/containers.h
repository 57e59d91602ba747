// Containers of modules: Sequential (unary layers applied in order) and ModuleList (any
// modules, indexed). Children are named by position: "0", "1", ..., so parameters read
// "0.weight", "1.fc1.bias".
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "ringdilated/nn/module.h"

namespace rd::nn {
namespace containers_internal {

// Throws rd::Error naming the container and the bound when index >= size.
void check_index(const char* container, size_t index, size_t size);
// Throws rd::Error: the module at `index` is not a `wanted`.
[[noreturn]] void throw_wrong_type(const char* container, size_t index, const char* wanted);

template <class M, class Base>
M& checked_cast(const char* container, size_t index, Base& module) {
  auto* typed = dynamic_cast<M*>(&module);
  if (typed == nullptr) throw_wrong_type(container, index, typeid(M).name());
  return *typed;
}

}  // namespace containers_internal

// forward(x) = layer[n-1](... layer[0](x)); x itself when empty.
class Sequential : public UnaryModule {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<UnaryModule>> layers);

  // Appends `layer` as child "<size()>" and returns it.
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> layer) {
    static_assert(std::is_base_of_v<UnaryModule, M>, "Sequential holds UnaryModules");
    append(layer);
    return layer;
  }
  Tensor forward(const Tensor& x) override;

  size_t size() const { return layers_.size(); }
  // The layer at `index` (< size(), else rd::Error), as a UnaryModule or as M (rd::Error
  // when it is not an M).
  UnaryModule& operator[](size_t index) const;
  template <class M>
  M& at(size_t index) const {
    return containers_internal::checked_cast<M>("Sequential", index, (*this)[index]);
  }

 private:
  void append(std::shared_ptr<UnaryModule> layer);
  std::vector<std::shared_ptr<UnaryModule>> layers_;
};

// An indexed list of modules of any kind (e.g. a stack of transformer blocks); it has no
// forward of its own: the owner iterates it.
class ModuleList : public Module {
 public:
  ModuleList() = default;
  explicit ModuleList(std::vector<std::shared_ptr<Module>> modules);

  // Appends `module` as child "<size()>" and returns it.
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    append(module);
    return module;
  }

  size_t size() const { return modules_.size(); }
  Module& operator[](size_t index) const;
  template <class M>
  M& at(size_t index) const {
    return containers_internal::checked_cast<M>("ModuleList", index, (*this)[index]);
  }
  auto begin() const { return modules_.begin(); }
  auto end() const { return modules_.end(); }

 private:
  void append(std::shared_ptr<Module> module);
  std::vector<std::shared_ptr<Module>> modules_;
};

}  // namespace rd::nn
