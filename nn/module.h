// Module: the base of nn/ layers. It owns named parameters and child modules, walks them in
// registration order for optimizers and checkpoints, and carries the train/eval mode.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Parameters of this module and its children, depth first in registration order, named
  // "child.grandchild.param" (the keys a checkpoint uses).
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;

  // Sets the mode of this module and every child; layers such as dropout read it.
  void train(bool training = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves (or converts) every parameter in place of the module's references; gradients are
  // dropped. Parameters stay leaves that require grad.
  void to(Device device);
  void to(DType dtype);

 protected:
  // Registers a parameter (made a leaf that requires grad) and returns it. Names are unique
  // within a module and may not contain '.'.
  Tensor& register_parameter(const std::string& name, Tensor value);
  // Registers a child; its parameters appear under "name.".
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    add_child(name, child);
    return child;
  }

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> child);
  void check_new_name(const std::string& name) const;
  void collect(const std::string& prefix,
               std::vector<std::pair<std::string, Tensor>>* out) const;

  // unique_ptr keeps each parameter's address stable: register_parameter hands out a
  // reference that layers keep using.
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> parameters_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace rd::nn
