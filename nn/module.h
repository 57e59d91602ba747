// Module: the base of nn/ layers. It owns named parameters, buffers and child modules, walks
// them in registration order for optimizers and state dicts, and carries the train/eval
// mode. UnaryModule is the interface of layers with one input and one output (Sequential).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Where a buffer lives when its module moves. kFollowsModule buffers move with to(Device)
// (running statistics, masks). kHost buffers stay on the CPU: host-side state that kernels
// take as arguments (a generator's seed and offset), so reading it never waits on a device.
enum class BufferDevice { kFollowsModule, kHost };

// What load_state_dict found. Keys are qualified names ("child.weight").
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;     // the module's, absent from the dict
  std::vector<std::string> unexpected_keys;  // the dict's, unknown to the module
  // One message per key whose shape or dtype does not fit, naming both.
  std::vector<std::string> mismatched;
  bool ok() const { return missing_keys.empty() && unexpected_keys.empty() && mismatched.empty(); }
};

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Registers a parameter (made a leaf that requires grad) and returns it. Names are unique
  // within a module (across parameters, buffers and children) and may not contain '.'. The
  // reference stays valid for the module's life; to() and load_state_dict() update it.
  Tensor& register_parameter(const std::string& name, Tensor value);
  // Registers non-parameter state: saved by state_dict(), never given to optimizers, never
  // requiring grad (the value is detached).
  Tensor& register_buffer(const std::string& name, Tensor value,
                          BufferDevice placement = BufferDevice::kFollowsModule);
  // Registers a child; its parameters and buffers appear under "name.". The child takes
  // this module's train/eval mode.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    add_child(name, child);
    return child;
  }

  // Parameters of this module and its children, depth first in registration order (own
  // parameters first), named "child.grandchild.param" (the keys of state_dict()).
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  // Buffers, in the same order and naming as named_parameters().
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  std::vector<Tensor> buffers() const;
  // This module (name "") and every descendant, depth first in registration order, named
  // like parameters' prefixes ("child", "child.grandchild").
  std::vector<std::pair<std::string, Module*>> named_modules();
  // Calls fn on every descendant, children before their parent, then on this module (the
  // order of PyTorch's Module.apply).
  void apply(const std::function<void(Module&)>& fn);

  // Parameters and buffers by qualified name. The tensors are the live ones, detached: they
  // share memory with the module, so serialize (or clone) them before the next update.
  std::map<std::string, Tensor> state_dict() const;
  // Copies `state` into the module's existing tensors in place, so parameter handles (held
  // by optimizers) stay valid. A value must have the target's shape; floating values convert
  // to a floating target's dtype, other targets need the same dtype; any device is accepted.
  // Everything is checked first. With `strict`, any missing, unexpected or mismatched key
  // throws rd::Error listing every problem and nothing changes; without it, the keys that
  // fit are copied and the problems are returned.
  LoadStateDictResult load_state_dict(const std::map<std::string, Tensor>& state,
                                      bool strict = true);

  // Sets the mode of this module and every child; layers such as dropout read it.
  void train(bool training = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves every parameter and kFollowsModule buffer to `device`, or converts every
  // parameter and floating buffer to `dtype` (integer buffers keep theirs, as in PyTorch),
  // in place of the module's references; gradients are dropped. Parameters stay leaves
  // that require grad.
  void to(Device device);
  void to(DType dtype);

 protected:
  // Called on every module of the tree after load_state_dict() copied values in, for
  // layers that keep a buffer's value in another form too (a Generator).
  virtual void on_state_loaded() {}

 private:
  struct Buffer {
    std::string name;
    std::unique_ptr<Tensor> value;
    BufferDevice placement;
  };
  // A state_dict entry of this module tree: where it lives and whether it is a parameter.
  struct StateSlot {
    Tensor* tensor;
    bool is_parameter;
  };

  void add_child(const std::string& name, std::shared_ptr<Module> child);
  void check_new_name(const std::string& name) const;
  void collect_parameters(const std::string& prefix,
                          std::vector<std::pair<std::string, Tensor>>* out) const;
  void collect_buffers(const std::string& prefix,
                       std::vector<std::pair<std::string, Tensor>>* out) const;
  void collect_modules(const std::string& name, std::vector<std::pair<std::string, Module*>>* out);
  void collect_slots(const std::string& prefix, std::map<std::string, StateSlot>* out);

  // unique_ptr keeps each tensor's address stable: registration hands out references that
  // layers keep using.
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> parameters_;
  std::vector<Buffer> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

// A layer with one tensor in and one out, the element type of Sequential.
class UnaryModule : public Module {
 public:
  virtual Tensor forward(const Tensor& x) = 0;
};

}  // namespace rd::nn
