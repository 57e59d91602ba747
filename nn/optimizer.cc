// AdamW (nn/optimizer.h): parameter groups and checks, the grouping of a step into one
// multi-tensor kernel call per (device, dtype, update count, hyperparameters), and the state
// dict.
#include "ringdilated/nn/optimizer.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <string_view>
#include <tuple>

#include "ringdilated/kernels/backend.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/dispatch.h"

namespace rd::nn {
namespace {

constexpr std::string_view kStepKey = "step";
constexpr std::string_view kExpAvgPrefix = "exp_avg.";
constexpr std::string_view kExpAvgSqPrefix = "exp_avg_sq.";
constexpr std::string_view kStepPrefix = "step.";

void check_finite_non_negative(const char* op, const char* option, double value) {
  RD_CHECK(std::isfinite(value) && value >= 0, kInvalidArgument, op, ": option '", option,
           "' must be finite and >= 0, got ", value);
}

void check_options(const char* op, const AdamWOptions& o) {
  check_finite_non_negative(op, "lr", o.lr);
  check_finite_non_negative(op, "eps", o.eps);
  check_finite_non_negative(op, "weight_decay", o.weight_decay);
  RD_CHECK(o.beta1 >= 0 && o.beta1 < 1, kInvalidArgument, op,
           ": option 'beta1' must be in [0, 1), got ", o.beta1);
  RD_CHECK(o.beta2 >= 0 && o.beta2 < 1, kInvalidArgument, op,
           ": option 'beta2' must be in [0, 1), got ", o.beta2);
}

void check_parameter(const std::string& name, const Tensor& p) {
  RD_CHECK(!name.empty(), kInvalidArgument, "AdamW: every parameter needs a non-empty name");
  RD_CHECK(p.defined(), kInvalidArgument, "AdamW: parameter '", name, "' is undefined");
  RD_CHECK(is_floating(p.dtype()), kDTypeMismatch, "AdamW: parameter '", name,
           "' must be floating, got ", dtype_name(p.dtype()));
  // The kernel updates the parameter's memory in place as a flat array.
  RD_CHECK(p.is_contiguous(), kInvalidArgument, "AdamW: parameter '", name,
           "' must be contiguous, got shape ", shape_str(p.shape()), " with strides ",
           shape_str(p.strides()));
}

void check_group(size_t index, const ParamGroup& group) {
  RD_CHECK(std::isfinite(group.weight_decay) && group.weight_decay >= 0, kInvalidArgument,
           "AdamW: groups[", index, "].weight_decay must be finite and >= 0, got ",
           group.weight_decay);
  RD_CHECK(std::isfinite(group.lr_scale) && group.lr_scale >= 0, kInvalidArgument,
           "AdamW: groups[", index, "].lr_scale must be finite and >= 0, got ", group.lr_scale);
}

// A gradient the kernel can use (contiguous), after checking it against its parameter.
Tensor checked_gradient(const std::string& name, const Tensor& param, const Tensor& grad) {
  RD_CHECK(grad.shape() == param.shape(), kShapeMismatch, "AdamW.step: the gradient of '", name,
           "' has shape ", shape_str(grad.shape()), " but the parameter has ",
           shape_str(param.shape()));
  RD_CHECK(grad.dtype() == param.dtype(), kDTypeMismatch, "AdamW.step: the gradient of '", name,
           "' is ", dtype_name(grad.dtype()), " but the parameter is ", dtype_name(param.dtype()));
  RD_CHECK(grad.device() == param.device(), kDeviceMismatch, "AdamW.step: the gradient of '",
           name, "' is on ", grad.device().str(), " but the parameter is on ",
           param.device().str());
  return grad.contiguous();
}

Tensor count_tensor(int64_t value) {
  return scalar_tensor(static_cast<double>(value), DType::kInt64);
}

// The value of an int64 scalar entry of a state dict.
int64_t read_count(const std::string& key, const Tensor& value) {
  RD_CHECK(value.defined() && value.dtype() == DType::kInt64 && value.numel() == 1,
           kInvalidArgument, "AdamW.load_state_dict: '", key,
           "' must be an int64 tensor of one element, got ", value.str());
  return value.item<int64_t>();
}

// A moment of the state dict checked against its parameter, copied into memory of the
// optimizer's own on the parameter's device (never an alias of the caller's tensor).
Tensor read_moment(const std::string& key, const Tensor& value, const Tensor& param) {
  RD_CHECK(value.defined(), kInvalidArgument, "AdamW.load_state_dict: '", key,
           "' is undefined");
  RD_CHECK(value.shape() == param.shape(), kShapeMismatch, "AdamW.load_state_dict: '", key,
           "' has shape ", shape_str(value.shape()), " but the parameter has ",
           shape_str(param.shape()));
  const DType want = accumulation_dtype(param.dtype());
  RD_CHECK(value.dtype() == want, kDTypeMismatch, "AdamW.load_state_dict: '", key, "' is ",
           dtype_name(value.dtype()), " but a ", dtype_name(param.dtype()),
           " parameter keeps its moments in ", dtype_name(want));
  Tensor moved = value.to(param.device());
  return moved.storage() == value.storage() ? moved.clone() : moved.contiguous();
}

// The entries of one parameter found in a state dict (null when absent).
struct StateEntries {
  const Tensor* exp_avg = nullptr;
  const Tensor* exp_avg_sq = nullptr;
  const Tensor* steps = nullptr;
};

bool contains_embed(std::string_view component) {
  std::string lower(component);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.find("embed") != std::string::npos;
}

}  // namespace

bool is_no_weight_decay_parameter(const std::string& name, const Tensor& param) {
  if (param.defined() && param.dim() < 2) return true;
  // Dotted components one by one, so that the rule reads as documented even though a
  // substring search over the whole name would give the same answer.
  std::string_view rest = name;
  while (!rest.empty()) {
    const size_t dot = rest.find('.');
    if (contains_embed(rest.substr(0, dot))) return true;
    if (dot == std::string_view::npos) break;
    rest.remove_prefix(dot + 1);
  }
  return false;
}

std::vector<ParamGroup> default_param_groups(
    std::vector<std::pair<std::string, Tensor>> named_parameters, double weight_decay,
    const NoWeightDecayRule& no_decay) {
  RD_CHECK(static_cast<bool>(no_decay), kInvalidArgument,
           "default_param_groups: argument 'no_decay' is empty");
  ParamGroup decay{{}, weight_decay, 1.0};
  ParamGroup exempt{{}, 0.0, 1.0};
  for (auto& named : named_parameters) {
    (no_decay(named.first, named.second) ? exempt : decay).params.push_back(std::move(named));
  }
  return {std::move(decay), std::move(exempt)};
}

AdamW::AdamW(std::vector<std::pair<std::string, Tensor>> parameters, AdamWOptions options)
    : AdamW(std::vector<ParamGroup>{{std::move(parameters), options.weight_decay, 1.0}},
            options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options) : options_(options) {
  check_options("AdamW", options_);
  std::set<std::string> names;
  std::set<std::pair<const Storage*, int64_t>> memory;
  for (size_t g = 0; g < groups.size(); ++g) {
    check_group(g, groups[g]);
    groups_.push_back({groups[g].weight_decay, groups[g].lr_scale});
    for (auto& [name, param] : groups[g].params) {
      check_parameter(name, param);
      RD_CHECK(names.insert(name).second, kInvalidArgument, "AdamW: parameter name '", name,
               "' is used twice");
      // Two handles on one tensor would be updated twice per step.
      RD_CHECK(
          param.numel() == 0 || memory.emplace(param.storage().get(), param.offset()).second,
          kInvalidArgument, "AdamW: parameter '", name,
          "' is the same memory as an earlier parameter");
      slots_.push_back(Slot{name, std::move(param), g, Tensor(), Tensor(), 0});
    }
  }
}

void AdamW::set_lr(double lr) {
  AdamWOptions changed = options_;
  changed.lr = lr;
  check_options("AdamW.set_lr", changed);
  options_ = changed;
}

void AdamW::zero_grad() {
  for (Slot& slot : slots_) slot.param.zero_grad();
}

void AdamW::step() {
  autograd::NoGradGuard no_grad;  // the contiguous copies of gradients are not graph nodes
  struct Update {
    Slot* slot;
    Tensor grad;  // contiguous; kept alive until the kernels are queued
  };
  std::vector<Update> updates;
  for (Slot& slot : slots_) {
    const Tensor grad = slot.param.grad();
    if (!grad.defined()) continue;
    updates.push_back({&slot, checked_gradient(slot.name, slot.param, grad)});
  }

  // Parameters of one device and dtype share a kernel call when their update counts (and so
  // their bias corrections) and their hyperparameters agree: after the first step, one call
  // per distinct (weight decay, lr scale) among the groups.
  using GroupKey = std::tuple<DeviceType, int, DType, int64_t, double, double>;
  std::map<GroupKey, std::vector<kernels::AdamWTensor>> groups;
  for (Update& u : updates) {
    Slot& s = *u.slot;
    if (!s.exp_avg.defined()) {
      const TensorOptions moments =
          TensorOptions(accumulation_dtype(s.param.dtype())).with_device(s.param.device());
      s.exp_avg = zeros(s.param.shape(), moments);
      s.exp_avg_sq = zeros(s.param.shape(), moments);
    }
    const Device device = s.param.device();
    const GroupHyperparameters& h = groups_[s.group];
    groups[{device.type, device.index, s.param.dtype(), s.steps + 1, h.weight_decay,
            options_.lr * h.lr_scale}]
        .push_back(
        {s.param.raw_data(), u.grad.raw_data(), s.exp_avg.raw_data(), s.exp_avg_sq.raw_data(),
         s.param.numel()});
  }
  for (const auto& [key, tensors] : groups) {
    const auto& [device_type, device_index, dtype, steps, weight_decay, lr] = key;
    const kernels::AdamWStep step{lr, options_.beta1, options_.beta2, options_.eps, weight_decay,
                                  steps};
    backend_for(Device{device_type, device_index}).adamw(tensors, dtype, step);
  }
  for (Update& u : updates) ++u.slot->steps;
  ++step_count_;
}

std::map<std::string, Tensor> AdamW::state_dict() const {
  std::map<std::string, Tensor> state;
  state.emplace(kStepKey, count_tensor(step_count_));
  for (const Slot& slot : slots_) {
    if (slot.steps == 0) continue;
    state.emplace(str_cat(kExpAvgPrefix, slot.name), slot.exp_avg);
    state.emplace(str_cat(kExpAvgSqPrefix, slot.name), slot.exp_avg_sq);
    state.emplace(str_cat(kStepPrefix, slot.name), count_tensor(slot.steps));
  }
  return state;
}

void AdamW::load_state_dict(const std::map<std::string, Tensor>& state) {
  autograd::NoGradGuard no_grad;
  const auto step_entry = state.find(std::string(kStepKey));
  RD_CHECK(step_entry != state.end(), kInvalidArgument,
           "AdamW.load_state_dict: the state has no '", kStepKey, "' entry");
  const int64_t step_count = read_count(step_entry->first, step_entry->second);
  RD_CHECK(step_count >= 0, kInvalidArgument, "AdamW.load_state_dict: '", kStepKey,
           "' must be >= 0, got ", step_count);

  // Sort the entries by parameter, refusing keys that name nothing.
  std::map<std::string_view, size_t> slot_of;
  for (size_t i = 0; i < slots_.size(); ++i) slot_of.emplace(slots_[i].name, i);
  std::vector<StateEntries> entries(slots_.size());
  for (const auto& [key, value] : state) {
    if (key == kStepKey) continue;
    const Tensor* StateEntries::*field = nullptr;
    std::string_view name;
    for (auto [prefix, f] : {std::pair{kExpAvgPrefix, &StateEntries::exp_avg},
                             std::pair{kExpAvgSqPrefix, &StateEntries::exp_avg_sq},
                             std::pair{kStepPrefix, &StateEntries::steps}}) {
      if (std::string_view(key).starts_with(prefix)) {
        field = f;
        name = std::string_view(key).substr(prefix.size());
      }
    }
    RD_CHECK(field != nullptr, kInvalidArgument, "AdamW.load_state_dict: unknown key '", key,
             "' (expected 'step', 'exp_avg.<name>', 'exp_avg_sq.<name>' or 'step.<name>')");
    const auto slot = slot_of.find(name);
    RD_CHECK(slot != slot_of.end(), kInvalidArgument, "AdamW.load_state_dict: key '", key,
             "' names no parameter of this optimizer");
    entries[slot->second].*field = &value;
  }

  // Check and copy everything before changing anything.
  std::vector<Slot> loaded = slots_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const StateEntries& e = entries[i];
    Slot& slot = loaded[i];
    slot.exp_avg = slot.exp_avg_sq = Tensor();
    slot.steps = 0;
    const int present = (e.exp_avg != nullptr) + (e.exp_avg_sq != nullptr) + (e.steps != nullptr);
    if (present == 0) continue;
    const char* missing = e.exp_avg == nullptr      ? "exp_avg."
                          : e.exp_avg_sq == nullptr ? "exp_avg_sq."
                          : e.steps == nullptr      ? "step."
                                                    : nullptr;
    RD_CHECK(missing == nullptr, kInvalidArgument, "AdamW.load_state_dict: parameter '",
             slot.name, "' has some state entries but not '", missing, slot.name, "'");
    const std::string steps_key = str_cat(kStepPrefix, slot.name);
    slot.steps = read_count(steps_key, *e.steps);
    RD_CHECK(slot.steps >= 1 && slot.steps <= step_count, kInvalidArgument,
             "AdamW.load_state_dict: '", steps_key, "' must be in [1, step = ", step_count,
             "], got ", slot.steps);
    slot.exp_avg = read_moment(str_cat(kExpAvgPrefix, slot.name), *e.exp_avg, slot.param);
    slot.exp_avg_sq = read_moment(str_cat(kExpAvgSqPrefix, slot.name), *e.exp_avg_sq, slot.param);
  }
  slots_ = std::move(loaded);
  step_count_ = step_count;
}

}  // namespace rd::nn
