// AdamW over named parameters in groups with their own weight decay and learning-rate scale:
// one fused multi-tensor kernel call per (device, dtype, hyperparameters) per step, with a
// state dict of plain tensors that checkpoints through safetensors.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::nn {

// Hyperparameters, as in torch.optim.AdamW; the update is documented at AdamWStep in
// kernels/backend.h. Every value must be finite and >= 0, and the betas < 1.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// Parameters that share hyperparameters, as a torch.optim param group: they are updated with
// learning rate AdamWOptions::lr * lr_scale and this weight decay (AdamWOptions::weight_decay
// does not apply to them). Both must be finite and >= 0.
struct ParamGroup {
  std::vector<std::pair<std::string, Tensor>> params;
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};

// The usual exemption from weight decay in transformer training: parameters with fewer than
// two dims (biases, norm gains) and embedding tables, recognised by a component of the
// dotted name containing "embed" in any case ("tok_embeddings.weight", "Embed.w"). A table
// named otherwise (GPT-2's "wte") needs a caller's rule.
bool is_no_weight_decay_parameter(const std::string& name, const Tensor& param);

// Whether a named parameter is exempt from weight decay.
using NoWeightDecayRule = std::function<bool(const std::string& name, const Tensor& param)>;

// Two groups for AdamW: the parameters for which `no_decay` is false, with weight_decay, then
// those for which it is true, with weight decay 0; each keeps the input order, has lr_scale 1,
// and may be empty.
std::vector<ParamGroup> default_param_groups(
    std::vector<std::pair<std::string, Tensor>> named_parameters, double weight_decay,
    const NoWeightDecayRule& no_decay = is_no_weight_decay_parameter);

// Decoupled-weight-decay Adam (Loshchilov & Hutter), matching torch.optim.AdamW.
//
// The optimizer holds handles to the parameters and updates them in place; gradients are
// read from param.grad(). Each parameter has its own state, created at its first update:
// the moments exp_avg and exp_avg_sq (accumulation_dtype of the parameter, on its device)
// and its own count of updates, which drives its bias corrections (a parameter that first
// gets a gradient at the tenth step() starts from t = 1, as in PyTorch).
class AdamW {
 public:
  // Every parameter must be a defined, contiguous, floating tensor under a unique non-empty
  // name, and no two may be the same memory. Throws rd::Error otherwise.
  explicit AdamW(std::vector<std::pair<std::string, Tensor>> parameters,
                 AdamWOptions options = {});
  // Parameter groups (e.g. default_param_groups()): names must be unique across all groups,
  // and each group's weight_decay and lr_scale replace options.weight_decay and 1. Groups may
  // be empty. The single-list constructor above is one group {options.weight_decay, 1}.
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options);

  // One update of every parameter whose gradient is defined; the others are skipped and
  // keep their state. A gradient must match its parameter's shape, dtype and device (it may
  // be non-contiguous). Every gradient is checked before any parameter changes. On CUDA the
  // update is queued on the device's current stream.
  void step();
  // Drops every parameter's gradient (it becomes undefined, like set_to_none in PyTorch).
  void zero_grad();

  // The number of step() calls made, including those restored by load_state_dict().
  int64_t step_count() const { return step_count_; }
  // The base learning rate; a group's is lr() * its lr_scale.
  double lr() const { return options_.lr; }
  void set_lr(double lr);  // e.g. from an LrSchedule; checked like the constructor's options
  const AdamWOptions& options() const { return options_; }

  // The number of groups (1 for the single-list constructor).
  size_t num_groups() const { return groups_.size(); }

  // The state as tensors, for tensor/safetensors.h (the same keys whatever the grouping; a
  // state loads into an optimizer grouped differently):
  //   "step"                 int64 scalar: step_count()
  //   "exp_avg.<name>"       first moment of parameter <name> (its shape,
  //   "exp_avg_sq.<name>"    second moment          accumulation dtype, its device)
  //   "step.<name>"          int64 scalar: the updates <name> has had (>= 1)
  // Parameters never updated have no entries. The moments are the optimizer's live buffers,
  // not copies: serialize (or clone) them before the next step().
  std::map<std::string, Tensor> state_dict() const;
  // Replaces the whole state with `state` (as made by state_dict(), from any device; the
  // tensors are copied). Everything is checked before anything changes: unknown keys, a
  // parameter with only some of its entries, and shapes or dtypes that do not match the
  // parameters throw rd::Error naming the key, and leave the optimizer as it was.
  void load_state_dict(const std::map<std::string, Tensor>& state);

 private:
  struct GroupHyperparameters {
    double weight_decay;
    double lr_scale;
  };
  struct Slot {
    std::string name;
    Tensor param;
    size_t group = 0;   // index into groups_
    Tensor exp_avg;     // undefined until the first update
    Tensor exp_avg_sq;
    int64_t steps = 0;  // updates applied to this parameter
  };

  std::vector<Slot> slots_;
  std::vector<GroupHyperparameters> groups_;
  AdamWOptions options_;
  int64_t step_count_ = 0;
};

}  // namespace rd::nn
