// Reverse-mode autograd: graph nodes, the iterative backward engine and grad-mode guards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::autograd {

// An edge to output `output_nr` of the node that produced an input; node is null when that
// input needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  int output_nr = 0;
};

// One step of the backward graph: given the gradients of its outputs (undefined where no
// gradient flowed), returns one gradient per input (undefined where the input needs none).
// Saved tensors live in the closure and are dropped by release().
class Node {
 public:
  using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;
  using SingleBackwardFn = std::function<std::vector<Tensor>(const Tensor& grad)>;

  Node(std::string name, int num_outputs, std::vector<Edge> next, BackwardFn fn)
      : name_(std::move(name)),
        num_outputs_(num_outputs),
        next_(std::move(next)),
        fn_(std::move(fn)) {}
  // Iterative: a chain of thousands of nodes is torn down without deep recursion.
  virtual ~Node();

  const std::string& name() const { return name_; }
  int num_outputs() const { return num_outputs_; }
  const std::vector<Edge>& next_edges() const { return next_; }
  virtual std::vector<Tensor> apply(const std::vector<Tensor>& grad_outputs);
  // Frees saved tensors; a later apply() fails with kAutograd.
  virtual void release();
  bool released() const { return released_; }

 protected:
  std::string name_;
  int num_outputs_;
  std::vector<Edge> next_;
  BackwardFn fn_;
  bool released_ = false;
};

// Whether ops record graph nodes on this thread.
bool grad_enabled();

// Turns recording off (or on) for the guard's lifetime, on this thread.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled);
  ~GradModeGuard();
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

// Runs the backward pass from `roots` seeded with `grads` (undefined means ones for a
// scalar). Iterative: graph depth is bounded only by memory. Without retain_graph, each
// node it runs is released right after it ran, so saved tensors go as early as they can;
// a backward that throws part way leaves the nodes it ran released.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false);

// Runs after a backward pass accumulated a gradient into `leaf`.grad(); gets the leaf, so
// that it need not hold it (a hook that held its own leaf would keep it alive for ever).
using PostAccumulateGradHook = std::function<void(const Tensor& leaf)>;

// The hooks of one leaf (TensorImpl::post_accumulate_hooks), in registration order.
struct LeafHooks {
  uint64_t next_id = 0;
  std::vector<std::pair<uint64_t, PostAccumulateGradHook>> hooks;
};

// Unregisters its hook when destroyed or on remove(); a no-op once the leaf is gone. Movable.
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<LeafHooks> hooks, uint64_t id) : hooks_(std::move(hooks)), id_(id) {}
  HookHandle(HookHandle&& other) noexcept { *this = std::move(other); }
  HookHandle& operator=(HookHandle&& other) noexcept;
  HookHandle(const HookHandle&) = delete;
  HookHandle& operator=(const HookHandle&) = delete;
  ~HookHandle() { remove(); }
  void remove();

 private:
  std::weak_ptr<LeafHooks> hooks_;
  uint64_t id_ = 0;
};

// Calls `hook(leaf)` each time a backward pass has accumulated a gradient into the leaf's
// .grad: once per pass that reaches the leaf (a pass sums every path's contribution first),
// right when that leaf's gradient is final for the pass, while the pass goes on with the
// rest of the graph (what gradient all-reduce overlapped with backward needs). Runs on
// backward's thread with grad mode off; hooks of one leaf run in registration order, and an
// exception a hook throws ends backward. `leaf` must be a leaf tensor that requires grad.
[[nodiscard]] HookHandle register_post_accumulate_grad_hook(const Tensor& leaf,
                                                            PostAccumulateGradHook hook);

// While alive, the gradients that backward passes on this thread send to `leaves` are
// summed here instead of into their .grad, and their post-accumulate hooks do not run.
// recompute() uses it so that the leaves a recomputed function reads (a module's
// parameters) get their gradients through the recompute node: the outer pass then sums
// every region's contribution and runs a leaf's hooks once, as if nothing were recomputed
// (gradient buckets refuse a second gradient in one step). Captures nest: a gradient goes
// to the innermost capture that lists its leaf.
class LeafGradientCapture {
 public:
  explicit LeafGradientCapture(const std::vector<Tensor>& leaves);
  ~LeafGradientCapture();
  LeafGradientCapture(const LeafGradientCapture&) = delete;
  LeafGradientCapture& operator=(const LeafGradientCapture&) = delete;

  // The summed gradient of each leaf, in the leaves' order (undefined where none came).
  std::vector<Tensor> take();
  // Adds `grad` to `leaf`'s slot when this capture lists it; returns whether it did.
  bool add(const TensorImpl* leaf, const Tensor& grad);
  LeafGradientCapture* enclosing() const { return enclosing_; }

 private:
  std::vector<const TensorImpl*> leaves_;
  std::vector<Tensor> grads_;
  LeafGradientCapture* enclosing_;
};

// For op implementations: true when grad mode is on and any input requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

// For backward functions: whether `grad`, the gradient the function was given, is held by
// the engine alone (a user's seed, a gradient also passed to another node or a view of a
// bigger buffer is not) and is a whole, packed storage: the function may then overwrite it
// and return it as an input's gradient instead of allocating a new one.
bool is_exclusive_gradient(const Tensor& grad);

// For op implementations: makes `output` the result of a node named `name` over `inputs`,
// whose gradients `fn` computes from the output's gradient (never called with an undefined
// one). Call only when needs_grad(inputs). `fn` runs with grad mode off.
// Never capture `output` itself in fn: output -> node -> fn -> output is a reference cycle
// that leaks the graph. Capture output.detach() instead (same storage, no grad_fn).
void record(const Tensor& output, std::string name, const std::vector<Tensor>& inputs,
            Node::SingleBackwardFn fn);
// The same for a node with several outputs.
void record(const std::vector<Tensor>& outputs, std::string name,
            const std::vector<Tensor>& inputs, Node::BackwardFn fn);

}  // namespace rd::autograd
