// The backward engine: dependency counting over the reachable graph, then a ready queue.
// Iterative throughout, so graph depth is limited by memory, not the call stack.
#include "ringdilated/tensor/autograd.h"

#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::autograd {

namespace {

thread_local bool grad_mode_enabled = true;
// The innermost live LeafGradientCapture of this thread (each links to the one it encloses).
thread_local LeafGradientCapture* innermost_capture = nullptr;

// Whether a live capture took `grad` for `leaf`, searching from the innermost outwards.
bool captured(const TensorImpl* leaf, const Tensor& grad) {
  for (LeafGradientCapture* capture = innermost_capture; capture != nullptr;
       capture = capture->enclosing()) {
    if (capture->add(leaf, grad)) return true;
  }
  return false;
}

// Whether `t` is held by `handles` Tensor handles and no more, and is a whole, packed
// storage of its own (no other view of its storage exists).
bool sole_owner(const Tensor& t, long handles) {
  const TensorImpl& impl = *t.impl();
  return t.impl_ptr().use_count() == handles && impl.storage.use_count() == 1 &&
         impl.offset == 0 && t.is_contiguous() &&
         impl.storage->nbytes() == static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
}

// Whether `grad` (the incoming gradient `incoming`, or its dtype conversion) is held by no
// one but the engine's input slot and this call: then making it a leaf's .grad aliases
// nothing and pins no larger buffer.
bool exclusively_owned(const Tensor& grad, const Tensor& incoming) {
  return sole_owner(grad, grad.impl() == incoming.impl() ? 2 : 1);  // the slot, and `grad`
}

void run_post_accumulate_hooks(const std::shared_ptr<TensorImpl>& leaf) {
  if (leaf->post_accumulate_hooks == nullptr) return;
  // A copy: a hook may register or remove hooks of this leaf while the others run.
  const std::vector<std::pair<uint64_t, PostAccumulateGradHook>> hooks =
      leaf->post_accumulate_hooks->hooks;
  const Tensor tensor(leaf);
  for (const auto& [id, hook] : hooks) hook(tensor);
}

// The sink of a leaf that requires grad: adds incoming gradients into leaf.grad.
class AccumulateGrad : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf)
      : Node("AccumulateGrad", 1, {}, nullptr), leaf_(leaf) {}

  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override {
    std::shared_ptr<TensorImpl> leaf = leaf_.lock();
    if (leaf == nullptr || !grads[0].defined()) return {};
    Tensor grad = grads[0].to(leaf->dtype);
    RD_CHECK(grad.shape() == leaf->shape, kInternal, "backward: gradient of shape ",
             shape_str(grad.shape()), " reached a leaf of shape ", shape_str(leaf->shape));
    if (captured(leaf.get(), grad)) return {};
    if (leaf->grad == nullptr) {
      // .grad must be private: users modify it in place (clipping, zeroing), and the
      // incoming tensor may also be another leaf's gradient or a user's seed. A gradient
      // nobody else holds is adopted as it is, which saves a gradient-sized copy at the peak.
      leaf->grad = exclusively_owned(grad, grads[0]) ? grad.impl_ptr() : grad.clone().impl_ptr();
    } else {
      leaf->grad = add(Tensor(leaf->grad), grad).impl_ptr();
    }
    run_post_accumulate_hooks(leaf);
    return {};
  }
  // A leaf's accumulator holds no saved tensors; it stays usable across backward passes.
  void release() override {}

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  TensorImpl* impl = leaf.impl();
  std::shared_ptr<Node> node = impl->grad_accumulator.lock();
  if (node == nullptr) {
    node = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
    impl->grad_accumulator = node;
  }
  return node;
}

Edge edge_to(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return Edge{};
  if (t.grad_fn() != nullptr) return Edge{t.grad_fn(), t.impl()->output_nr};
  return Edge{grad_accumulator(t), 0};
}

Tensor sum_gradients(const Tensor& existing, const Tensor& incoming) {
  if (!existing.defined()) return incoming;
  return add(existing, incoming);
}

}  // namespace

bool is_exclusive_gradient(const Tensor& grad) {
  // The one handle is the engine's input slot, which the backward function gets by reference.
  return grad.defined() && sole_owner(grad, 1);
}

Node::~Node() {
  // Destroying the last owner of a long chain would recurse once per node. Instead the
  // outermost destructor collects children it solely owns and destroys them in a loop;
  // nested destructors only hand their children to that loop.
  thread_local std::vector<std::shared_ptr<Node>>* pending = nullptr;
  std::vector<std::shared_ptr<Node>> local;
  bool outermost = pending == nullptr;
  if (outermost) pending = &local;
  fn_ = nullptr;  // saved tensors may own further nodes; drop them inside the loop too
  for (Edge& edge : next_) {
    if (edge.node != nullptr && edge.node.use_count() == 1) pending->push_back(std::move(edge.node));
  }
  next_.clear();
  if (outermost) {
    while (!local.empty()) {
      std::shared_ptr<Node> node = std::move(local.back());
      local.pop_back();
      node.reset();
    }
    pending = nullptr;
  }
}

std::vector<Tensor> Node::apply(const std::vector<Tensor>& grad_outputs) {
  RD_CHECK(!released_, kAutograd, "backward: node '", name_,
           "' was already run and its saved tensors freed; pass retain_graph=true to the first "
           "backward to run through the graph again");
  return fn_(grad_outputs);
}

void Node::release() {
  fn_ = nullptr;
  released_ = true;
}

HookHandle& HookHandle::operator=(HookHandle&& other) noexcept {
  if (this != &other) {
    remove();
    hooks_ = std::exchange(other.hooks_, {});
    id_ = other.id_;
  }
  return *this;
}

void HookHandle::remove() {
  const std::shared_ptr<LeafHooks> hooks = std::exchange(hooks_, {}).lock();
  if (hooks == nullptr) return;
  std::erase_if(hooks->hooks, [this](const auto& entry) { return entry.first == id_; });
}

HookHandle register_post_accumulate_grad_hook(const Tensor& leaf, PostAccumulateGradHook hook) {
  RD_CHECK(leaf.defined() && leaf.requires_grad() && leaf.grad_fn() == nullptr, kAutograd,
           "register_post_accumulate_grad_hook: the tensor must be a leaf that requires grad, got ",
           leaf.defined() ? leaf.str() : std::string("an undefined tensor"),
           leaf.defined() && leaf.grad_fn() != nullptr ? " (the result of an op)" : "");
  RD_CHECK(hook != nullptr, kInvalidArgument, "register_post_accumulate_grad_hook: empty hook");
  std::shared_ptr<LeafHooks>& hooks = leaf.impl()->post_accumulate_hooks;
  if (hooks == nullptr) hooks = std::make_shared<LeafHooks>();
  const uint64_t id = hooks->next_id++;
  hooks->hooks.emplace_back(id, std::move(hook));
  return HookHandle(hooks, id);
}

LeafGradientCapture::LeafGradientCapture(const std::vector<Tensor>& leaves)
    : grads_(leaves.size()), enclosing_(innermost_capture) {
  leaves_.reserve(leaves.size());
  for (const Tensor& leaf : leaves) leaves_.push_back(leaf.defined() ? leaf.impl() : nullptr);
  innermost_capture = this;
}

LeafGradientCapture::~LeafGradientCapture() { innermost_capture = enclosing_; }

std::vector<Tensor> LeafGradientCapture::take() { return std::exchange(grads_, {}); }

bool LeafGradientCapture::add(const TensorImpl* leaf, const Tensor& grad) {
  for (size_t i = 0; i < leaves_.size(); ++i) {
    if (leaves_[i] != leaf) continue;
    // A clone the first time: the incoming gradient may be shared with other nodes.
    grads_[i] = grads_[i].defined() ? rd::add(grads_[i], grad) : grad.clone();
    return true;
  }
  return false;
}

bool grad_enabled() { return grad_mode_enabled; }

GradModeGuard::GradModeGuard(bool enabled) : previous_(grad_mode_enabled) {
  grad_mode_enabled = enabled;
}
GradModeGuard::~GradModeGuard() { grad_mode_enabled = previous_; }

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_mode_enabled) return false;
  for (const Tensor* t : inputs) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

void record(const std::vector<Tensor>& outputs, std::string name,
            const std::vector<Tensor>& inputs, Node::BackwardFn fn) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& input : inputs) edges.push_back(edge_to(input));
  auto node = std::make_shared<Node>(std::move(name), static_cast<int>(outputs.size()),
                                     std::move(edges), std::move(fn));
  for (size_t i = 0; i < outputs.size(); ++i) {
    TensorImpl* impl = outputs[i].impl();
    impl->grad_fn = node;
    impl->output_nr = static_cast<int>(i);
    impl->requires_grad = true;
  }
}

void record(const Tensor& output, std::string name, const std::vector<Tensor>& inputs,
            Node::SingleBackwardFn fn) {
  size_t num_inputs = inputs.size();
  record(std::vector<Tensor>{output}, std::move(name), inputs,
         [fn = std::move(fn), num_inputs](const std::vector<Tensor>& grads) {
           if (!grads[0].defined()) return std::vector<Tensor>(num_inputs);
           return fn(grads[0]);
         });
}

namespace {

// One seed gradient per root: the given one, or ones for a single-element root.
std::vector<std::pair<Edge, Tensor>> seed_gradients(const std::vector<Tensor>& roots,
                                                    const std::vector<Tensor>& grads) {
  RD_CHECK(grads.empty() || grads.size() == roots.size(), kInvalidArgument, "backward: got ",
           grads.size(), " gradients for ", roots.size(), " tensors");
  std::vector<std::pair<Edge, Tensor>> seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    RD_CHECK(root.defined() && root.requires_grad(), kAutograd, "backward: tensor ", i, " (",
             root.str(), ") does not require grad and has no grad_fn");
    Tensor grad = grads.empty() ? Tensor() : grads[i];
    if (!grad.defined()) {
      RD_CHECK(root.numel() == 1, kAutograd,
               "backward: a gradient can be created implicitly only for a single-element "
               "output; pass one for shape ",
               shape_str(root.shape()));
      grad = ones_like(root);
    }
    RD_CHECK(grad.shape() == root.shape(), kShapeMismatch, "backward: gradient shape ",
             shape_str(grad.shape()), " differs from the output shape ", shape_str(root.shape()));
    seeds.emplace_back(edge_to(root), grad);
  }
  return seeds;
}

// The nodes reachable from the seeds, and for each how many edges point at it: a node runs
// once all of them have delivered their gradient.
struct ReachableGraph {
  std::vector<std::shared_ptr<Node>> nodes;
  std::unordered_map<Node*, int> dependencies;
};

ReachableGraph reachable_from(const std::vector<std::pair<Edge, Tensor>>& seeds) {
  ReachableGraph graph;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  auto visit = [&](const std::shared_ptr<Node>& node) {
    if (!seen.insert(node.get()).second) return;
    stack.push_back(node.get());
    graph.nodes.push_back(node);
  };
  for (const auto& [edge, grad] : seeds) visit(edge.node);
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& next : node->next_edges()) {
      if (next.node == nullptr) continue;
      ++graph.dependencies[next.node.get()];
      visit(next.node);
    }
  }
  return graph;
}

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph) {
  NoGradGuard no_grad;
  const std::vector<std::pair<Edge, Tensor>> seeds = seed_gradients(roots, grads);
  ReachableGraph graph = reachable_from(seeds);

  // Gradient buffers, one slot per node output.
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  auto add_to_buffer = [&buffers](const Edge& edge, const Tensor& grad) {
    std::vector<Tensor>& slots = buffers[edge.node.get()];
    if (slots.empty()) slots.resize(edge.node->num_outputs());
    slots[edge.output_nr] = sum_gradients(slots[edge.output_nr], grad);
  };
  for (const auto& [edge, grad] : seeds) add_to_buffer(edge, grad);

  std::deque<std::shared_ptr<Node>> ready;
  for (const auto& node : graph.nodes) {
    if (graph.dependencies[node.get()] == 0) ready.push_back(node);
  }
  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.front();
    ready.pop_front();
    std::vector<Tensor> inputs = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    if (inputs.empty()) inputs.resize(node->num_outputs());
    std::vector<Tensor> input_grads = node->apply(inputs);
    // Saved tensors are dead once their node ran: free them now, not after the whole pass,
    // so the peak of a deep backward holds only the activations still ahead of it.
    if (!retain_graph) node->release();
    const std::vector<Edge>& next = node->next_edges();
    RD_CHECK(input_grads.size() == next.size() || next.empty(), kInternal, "backward: node '",
             node->name(), "' returned ", input_grads.size(), " gradients for ", next.size(),
             " inputs");
    for (size_t i = 0; i < next.size(); ++i) {
      if (next[i].node == nullptr) continue;
      if (input_grads[i].defined()) add_to_buffer(next[i], input_grads[i]);
      if (--graph.dependencies[next[i].node.get()] == 0) ready.push_back(next[i].node);
    }
  }
}

}  // namespace rd::autograd
