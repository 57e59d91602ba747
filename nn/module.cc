// Module bookkeeping: registration of parameters, buffers and children, traversal, state
// dicts and mode (see module.h).
#include "ringdilated/nn/module.h"

#include <sstream>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"

namespace rd::nn {
namespace {

// "[4, 3] float32", how load_state_dict describes a tensor.
std::string describe(const Tensor& t) {
  return str_cat(shape_str(t.shape()), " ", dtype_name(t.dtype()));
}

// Why `given` cannot be copied into `target`, or "" when it can.
std::string mismatch(const std::string& key, const Tensor& target, const Tensor& given) {
  const bool shape_ok = given.defined() && given.shape() == target.shape();
  const bool dtype_ok =
      given.defined() && (given.dtype() == target.dtype() ||
                          (is_floating(given.dtype()) && is_floating(target.dtype())));
  if (shape_ok && dtype_ok) return "";
  return str_cat("'", key, "': expected ", describe(target), ", got ",
                 given.defined() ? describe(given) : std::string("an undefined tensor"));
}

// The tensors of a named list, in its order.
std::vector<Tensor> tensors_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<Tensor> out;
  out.reserve(named.size());
  for (const auto& [name, tensor] : named) out.push_back(tensor);
  return out;
}

std::string join_problems(const LoadStateDictResult& r) {
  std::ostringstream out;
  for (const std::string& key : r.missing_keys) out << "\n  missing key '" << key << "'";
  for (const std::string& key : r.unexpected_keys) out << "\n  unexpected key '" << key << "'";
  for (const std::string& message : r.mismatched) out << "\n  mismatched " << message;
  return out.str();
}

// A detached copy of `value` that is a leaf requiring grad, as parameters are kept.
Tensor as_parameter(const Tensor& value) {
  Tensor leaf = value.detach();
  leaf.set_requires_grad(true);
  return leaf;
}

}  // namespace

void Module::check_new_name(const std::string& name) const {
  RD_CHECK(!name.empty() && name.find('.') == std::string::npos, kInvalidArgument, "Module: name '",
           name, "' must be non-empty and contain no '.'");
  bool used = false;
  for (const auto& [existing, unused] : parameters_) used |= existing == name;
  for (const Buffer& buffer : buffers_) used |= buffer.name == name;
  for (const auto& [existing, unused] : children_) used |= existing == name;
  RD_CHECK(!used, kInvalidArgument, "Module: name '", name, "' is already used");
}

Tensor& Module::register_parameter(const std::string& name, Tensor value) {
  check_new_name(name);
  RD_CHECK(value.defined(), kInvalidArgument, "Module: parameter '", name, "' is undefined");
  parameters_.emplace_back(name, std::make_unique<Tensor>(as_parameter(value)));
  return *parameters_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor value, BufferDevice placement) {
  check_new_name(name);
  RD_CHECK(value.defined(), kInvalidArgument, "Module: buffer '", name, "' is undefined");
  RD_CHECK(placement != BufferDevice::kHost || value.device().is_cpu(), kDeviceMismatch,
           "Module: host buffer '", name, "' must be on the cpu, got ", value.str());
  buffers_.push_back({name, std::make_unique<Tensor>(value.detach()), placement});
  return *buffers_.back().value;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> child) {
  check_new_name(name);
  RD_CHECK(child != nullptr, kInvalidArgument, "Module: child '", name, "' is null");
  RD_CHECK(child.get() != this, kInvalidArgument, "Module: child '", name,
           "' is the module itself");
  child->train(training_);
  children_.emplace_back(name, std::move(child));
}

void Module::collect_parameters(const std::string& prefix,
                                std::vector<std::pair<std::string, Tensor>>* out) const {
  for (const auto& [name, param] : parameters_) out->emplace_back(prefix + name, *param);
  for (const auto& [name, child] : children_) child->collect_parameters(prefix + name + ".", out);
}

void Module::collect_buffers(const std::string& prefix,
                             std::vector<std::pair<std::string, Tensor>>* out) const {
  for (const Buffer& buffer : buffers_) out->emplace_back(prefix + buffer.name, *buffer.value);
  for (const auto& [name, child] : children_) child->collect_buffers(prefix + name + ".", out);
}

void Module::collect_modules(const std::string& name,
                             std::vector<std::pair<std::string, Module*>>* out) {
  out->emplace_back(name, this);
  for (const auto& [child_name, child] : children_) {
    child->collect_modules(name.empty() ? child_name : name + "." + child_name, out);
  }
}

void Module::collect_slots(const std::string& prefix, std::map<std::string, StateSlot>* out) {
  for (auto& [name, param] : parameters_) out->emplace(prefix + name, StateSlot{param.get(), true});
  for (Buffer& buffer : buffers_) {
    out->emplace(prefix + buffer.name, StateSlot{buffer.value.get(), false});
  }
  for (auto& [name, child] : children_) child->collect_slots(prefix + name + ".", out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect_parameters("", &out);
  return out;
}

std::vector<Tensor> Module::parameters() const { return tensors_of(named_parameters()); }

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect_buffers("", &out);
  return out;
}

std::vector<Tensor> Module::buffers() const { return tensors_of(named_buffers()); }

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  collect_modules("", &out);
  return out;
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [name, child] : children_) child->apply(fn);
  fn(*this);
}

std::map<std::string, Tensor> Module::state_dict() const {
  std::map<std::string, Tensor> out;
  for (auto& [name, param] : named_parameters()) out.emplace(name, param.detach());
  for (auto& [name, buffer] : named_buffers()) out.emplace(name, buffer.detach());
  return out;
}

LoadStateDictResult Module::load_state_dict(const std::map<std::string, Tensor>& state,
                                            bool strict) {
  std::map<std::string, StateSlot> slots;
  collect_slots("", &slots);
  LoadStateDictResult result;
  std::vector<std::pair<const Tensor*, StateSlot>> copies;
  for (const auto& [key, slot] : slots) {
    auto given = state.find(key);
    if (given == state.end()) {
      result.missing_keys.push_back(key);
    } else if (std::string why = mismatch(key, *slot.tensor, given->second); !why.empty()) {
      result.mismatched.push_back(std::move(why));
    } else {
      copies.emplace_back(&given->second, slot);
    }
  }
  for (const auto& [key, value] : state) {
    if (!slots.contains(key)) result.unexpected_keys.push_back(key);
  }
  RD_CHECK(!strict || result.ok(), kInvalidArgument,
           "Module::load_state_dict: the state does not fit the module (nothing was loaded):",
           join_problems(result));
  // In place, outside autograd: parameters keep their identity (optimizers hold them).
  autograd::NoGradGuard no_grad;
  for (const auto& [value, slot] : copies) {
    Tensor target = *slot.tensor;
    target.copy_(value->to(target.device()));  // copy_ converts the dtype
  }
  apply([](Module& m) { m.on_state_loaded(); });
  return result;
}

void Module::train(bool training) {
  training_ = training;
  for (auto& [name, child] : children_) child->train(training);
}

void Module::to(Device device) {
  for (auto& [name, param] : parameters_) *param = as_parameter(param->detach().to(device));
  for (Buffer& buffer : buffers_) {
    if (buffer.placement == BufferDevice::kFollowsModule) *buffer.value = buffer.value->to(device);
  }
  for (auto& [name, child] : children_) child->to(device);
}

void Module::to(DType dtype) {
  for (auto& [name, param] : parameters_) *param = as_parameter(param->detach().to(dtype));
  for (Buffer& buffer : buffers_) {
    if (is_floating(buffer.value->dtype())) *buffer.value = buffer.value->to(dtype);
  }
  for (auto& [name, child] : children_) child->to(dtype);
}

}  // namespace rd::nn
