// Activation recomputation: forward without a graph, recompute with one during backward.
#include "ringdilated/tensor/recompute.h"

#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/ops.h"

namespace rd {

std::vector<Tensor> recompute(const RecomputeFn& fn, const std::vector<Tensor>& inputs,
                              const std::vector<Generator*>& generators) {
  std::vector<Generator::State> generator_states;
  for (Generator* gen : generators) generator_states.push_back(gen->state());

  std::vector<Tensor> outputs;
  {
    autograd::NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  if (!autograd::needs_grad(inputs)) return outputs;

  // Outputs computed under no_grad may alias inputs (fn could return an input or a view of
  // one); give every output its own TensorImpl so recording a grad_fn touches only it.
  for (Tensor& out : outputs) out = out.detach();

  std::vector<Tensor> saved_inputs;
  for (const Tensor& input : inputs) saved_inputs.push_back(input.detach());
  size_t num_inputs = inputs.size();
  autograd::record(
      outputs, "recompute", inputs,
      [fn, saved_inputs, generators, generator_states,
       num_inputs](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
        // Replay with the generators as they were, so random ops draw the same values.
        std::vector<Generator::State> now;
        for (size_t i = 0; i < generators.size(); ++i) {
          now.push_back(generators[i]->state());
          generators[i]->set_state(generator_states[i]);
        }
        std::vector<Tensor> leaves;
        for (const Tensor& input : saved_inputs) {
          Tensor leaf = input.detach();
          if (is_floating(leaf.dtype())) leaf.set_requires_grad(true);
          leaves.push_back(leaf);
        }
        std::vector<Tensor> recomputed;
        {
          autograd::GradModeGuard enable(true);
          recomputed = fn(leaves);
        }
        for (size_t i = 0; i < generators.size(); ++i) generators[i]->set_state(now[i]);

        std::vector<Tensor> roots, root_grads;
        for (size_t i = 0; i < recomputed.size() && i < grads.size(); ++i) {
          if (grads[i].defined() && recomputed[i].requires_grad()) {
            roots.push_back(recomputed[i]);
            root_grads.push_back(grads[i]);
          }
        }
        if (!roots.empty()) autograd::backward(roots, root_grads);
        std::vector<Tensor> input_grads(num_inputs);
        for (size_t i = 0; i < num_inputs; ++i) input_grads[i] = leaves[i].grad();
        return input_grads;
      });
  return outputs;
}

}  // namespace rd
