// Module bookkeeping: parameter and child registration, traversal and mode (see module.h).
#include "ringdilated/nn/module.h"

#include "ringdilated/kernels/error.h"

namespace rd::nn {

void Module::check_new_name(const std::string& name) const {
  RD_CHECK(!name.empty() && name.find('.') == std::string::npos, kInvalidArgument,
           "Module: name '", name, "' must be non-empty and contain no '.'");
  for (const auto& [existing, unused] : parameters_) {
    RD_CHECK(existing != name, kInvalidArgument, "Module: name '", name, "' is already used");
  }
  for (const auto& [existing, unused] : children_) {
    RD_CHECK(existing != name, kInvalidArgument, "Module: name '", name, "' is already used");
  }
}

Tensor& Module::register_parameter(const std::string& name, Tensor value) {
  check_new_name(name);
  RD_CHECK(value.defined(), kInvalidArgument, "Module: parameter '", name, "' is undefined");
  Tensor leaf = value.detach();
  leaf.set_requires_grad(true);
  parameters_.emplace_back(name, std::make_unique<Tensor>(leaf));
  return *parameters_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> child) {
  check_new_name(name);
  RD_CHECK(child != nullptr, kInvalidArgument, "Module: child '", name, "' is null");
  child->train(training_);
  children_.emplace_back(name, std::move(child));
}

void Module::collect(const std::string& prefix,
                     std::vector<std::pair<std::string, Tensor>>* out) const {
  for (const auto& [name, param] : parameters_) out->emplace_back(prefix + name, *param);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", &out);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, param] : named_parameters()) out.push_back(param);
  return out;
}

void Module::train(bool training) {
  training_ = training;
  for (auto& [name, child] : children_) child->train(training);
}

void Module::to(Device device) {
  for (auto& [name, param] : parameters_) {
    Tensor moved = param->detach().to(device);
    moved.set_requires_grad(true);
    *param = moved;
  }
  for (auto& [name, child] : children_) child->to(device);
}

void Module::to(DType dtype) {
  for (auto& [name, param] : parameters_) {
    Tensor converted = param->detach().to(dtype);
    converted.set_requires_grad(true);
    *param = converted;
  }
  for (auto& [name, child] : children_) child->to(dtype);
}

}  // namespace rd::nn
