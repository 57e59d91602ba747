// Activation recomputation ("activation checkpointing" in PyTorch): run a function without
// keeping its intermediate tensors, and recompute them during the backward pass, trading
// compute for memory. Named recompute so it cannot be confused with training checkpoints.
#pragma once

#include <functional>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd {

using RecomputeFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Returns fn(inputs). Only the inputs are saved; backward re-runs fn with grad enabled and
// backpropagates through the recomputed graph. Generators named in `generators` are
// restored to their state at the first call before re-running, so dropout masks match.
//
// `leaves`: the leaf tensors fn reads besides its inputs (a module's parameters). Their
// gradients leave through the recompute node like the inputs' (autograd::LeafGradientCapture),
// so the enclosing pass sums the contributions of every region that reads a leaf and runs
// its post-accumulate hooks once per pass, exactly as without recomputation. A leaf left out
// still gets its gradient, accumulated from inside the region's own pass, once per region:
// gradient buckets (data parallelism) then see several gradients in one step.
std::vector<Tensor> recompute(const RecomputeFn& fn, const std::vector<Tensor>& inputs,
                              const std::vector<Generator*>& generators = {},
                              const std::vector<Tensor>& leaves = {});

}  // namespace rd
