// Activation recomputation: forward without a graph, recompute with one during backward.
#include "ringdilated/tensor/recompute.h"

#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"

namespace rd {
namespace {

// Restores generators to the states they had at the first run, and back on destruction.
class ReplayGenerators {
 public:
  ReplayGenerators(const std::vector<Generator*>& generators,
                   const std::vector<Generator::State>& first_run)
      : generators_(generators) {
    for (size_t i = 0; i < generators_.size(); ++i) {
      now_.push_back(generators_[i]->state());
      generators_[i]->set_state(first_run[i]);
    }
  }
  ~ReplayGenerators() {
    for (size_t i = 0; i < generators_.size(); ++i) generators_[i]->set_state(now_[i]);
  }
  ReplayGenerators(const ReplayGenerators&) = delete;
  ReplayGenerators& operator=(const ReplayGenerators&) = delete;

 private:
  const std::vector<Generator*>& generators_;
  std::vector<Generator::State> now_;
};

// Backward of a recomputed region: re-runs fn over fresh leaves made of the saved inputs and
// backpropagates the outputs' gradients through it. Returns the inputs' gradients, then the
// captured `leaves`' gradients.
std::vector<Tensor> recompute_backward(const RecomputeFn& fn,
                                       const std::vector<Tensor>& saved_inputs,
                                       const std::vector<Tensor>& leaves,
                                       const std::vector<Generator*>& generators,
                                       const std::vector<Generator::State>& generator_states,
                                       const std::vector<Tensor>& grads) {
  std::vector<Tensor> input_leaves;
  for (const Tensor& input : saved_inputs) {
    Tensor leaf = input.detach();
    if (is_floating(leaf.dtype())) leaf.set_requires_grad(true);
    input_leaves.push_back(leaf);
  }
  autograd::LeafGradientCapture capture(leaves);
  std::vector<Tensor> recomputed;
  {
    // Replay with the generators as they were, so random ops draw the same values.
    ReplayGenerators replay(generators, generator_states);
    autograd::GradModeGuard enable(true);
    recomputed = fn(input_leaves);
  }
  std::vector<Tensor> roots, root_grads;
  for (size_t i = 0; i < recomputed.size() && i < grads.size(); ++i) {
    if (grads[i].defined() && recomputed[i].requires_grad()) {
      roots.push_back(recomputed[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) autograd::backward(roots, root_grads);
  std::vector<Tensor> input_grads;
  for (const Tensor& leaf : input_leaves) input_grads.push_back(leaf.grad());
  for (Tensor& grad : capture.take()) input_grads.push_back(std::move(grad));
  return input_grads;
}

}  // namespace

std::vector<Tensor> recompute(const RecomputeFn& fn, const std::vector<Tensor>& inputs,
                              const std::vector<Generator*>& generators,
                              const std::vector<Tensor>& leaves) {
  std::vector<Generator::State> generator_states;
  for (Generator* gen : generators) generator_states.push_back(gen->state());

  std::vector<Tensor> outputs;
  {
    autograd::NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  if (!autograd::needs_grad(inputs) && !autograd::needs_grad(leaves)) return outputs;

  // Outputs computed under no_grad may alias inputs (fn could return an input or a view of
  // one); give every output its own TensorImpl so recording a grad_fn touches only it.
  for (Tensor& out : outputs) out = out.detach();

  std::vector<Tensor> saved_inputs;
  for (const Tensor& input : inputs) saved_inputs.push_back(input.detach());
  std::vector<Tensor> edges = inputs;
  edges.insert(edges.end(), leaves.begin(), leaves.end());
  autograd::record(outputs, "recompute", edges,
                   [fn, saved_inputs, leaves, generators,
                    generator_states](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
                     return recompute_backward(fn, saved_inputs, leaves, generators,
                                               generator_states, grads);
                   });
  return outputs;
}

}  // namespace rd
