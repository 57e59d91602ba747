// Central-difference gradient checking in float64 against the autograd engine.
#include "testing/gradcheck.h"

#include <cmath>
#include <random>
#include <sstream>

#include "ringdilated/tensor/autograd.h"
#include "testing/tensor_util.h"

namespace rd::test {
namespace {

bool is_checked_input(const Tensor& t) { return t.defined() && t.dtype() == DType::kFloat64; }

// Fresh leaves sharing the inputs' memory, so writes into an input's storage move the leaf.
std::vector<Tensor> make_leaves(const std::vector<Tensor>& inputs) {
  std::vector<Tensor> leaves;
  for (const Tensor& in : inputs) {
    if (!is_checked_input(in)) {
      leaves.push_back(in);
      continue;
    }
    Tensor leaf = in.detach();
    leaf.set_requires_grad(true);
    leaves.push_back(leaf);
  }
  return leaves;
}

// L = sum_j sum(out_j * w_j), in float64 on the host.
double weighted_sum(const std::vector<Tensor>& outputs, const std::vector<Tensor>& weights) {
  double total = 0.0;
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (!weights[j].defined()) continue;
    RefArray out = to_ref(outputs[j]);
    RefArray w = to_ref(weights[j]);
    for (int64_t i = 0; i < out.numel(); ++i) total += out.data[i] * w.data[i];
  }
  return total;
}

// Storage slot of the logical element `flat` of a CPU float64 tensor.
double* element_ptr(const Tensor& t, int64_t flat) {
  ref::Index idx = ref::unravel(flat, t.shape());
  double* p = static_cast<double*>(t.raw_data());
  for (size_t d = 0; d < idx.size(); ++d) p += idx[d] * t.strides()[d];
  return p;
}

bool overlaps_itself(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) == 0) return true;
  }
  return false;
}

std::vector<Tensor> backward_gradients(const MultiOutputFn& fn, const std::vector<Tensor>& leaves,
                                       uint64_t seed, std::vector<Tensor>* weights_out) {
  std::vector<Tensor> outputs = fn(leaves);
  std::vector<Tensor> weights = upstream_gradients(outputs, seed);
  std::vector<Tensor> roots, grads;
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (weights[j].defined() && outputs[j].requires_grad()) {
      roots.push_back(outputs[j]);
      grads.push_back(weights[j].to(outputs[j].device()));
    }
  }
  if (!roots.empty()) autograd::backward(roots, grads);
  if (weights_out) *weights_out = weights;
  std::vector<Tensor> result;
  for (const Tensor& leaf : leaves) {
    result.push_back(is_checked_input(leaf) ? leaf.grad() : Tensor());
  }
  return result;
}

}  // namespace

std::vector<Tensor> upstream_gradients(const std::vector<Tensor>& outputs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> magnitude(0.5, 1.5);
  std::bernoulli_distribution coin(0.5);
  std::vector<Tensor> weights;
  for (const Tensor& out : outputs) {
    if (!is_floating(out.dtype())) {
      weights.emplace_back();
      continue;
    }
    std::vector<double> w(out.numel());
    for (double& v : w) v = (coin(rng) ? 1.0 : -1.0) * magnitude(rng);
    weights.push_back(from_vector<double>(w, out.shape()).to(out.dtype()));
  }
  return weights;
}

std::vector<Tensor> analytic_gradients(const MultiOutputFn& fn, const std::vector<Tensor>& inputs,
                                       uint64_t seed) {
  return backward_gradients(fn, make_leaves(inputs), seed, nullptr);
}

::testing::AssertionResult gradcheck(const MultiOutputFn& fn, const std::vector<Tensor>& inputs,
                                     const GradcheckOptions& options) {
  std::vector<Tensor> leaves = make_leaves(inputs);
  bool any_checked = false;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!is_checked_input(leaves[i])) continue;
    any_checked = true;
    if (overlaps_itself(leaves[i]) || !leaves[i].device().is_cpu()) {
      return ::testing::AssertionFailure() << "gradcheck: input " << i << " (" << leaves[i].str()
                                           << ") must be a CPU tensor without stride-0 dims";
    }
  }
  if (!any_checked) return ::testing::AssertionFailure() << "gradcheck: no float64 input";

  std::vector<Tensor> weights;
  std::vector<Tensor> analytic = backward_gradients(fn, leaves, options.seed, &weights);
  bool any_root = false;
  for (const Tensor& w : weights) any_root |= w.defined();
  if (!any_root) return ::testing::AssertionFailure() << "gradcheck: no floating output";

  auto loss = [&] {
    autograd::NoGradGuard no_grad;
    return weighted_sum(fn(leaves), weights);
  };
  std::ostringstream failures;
  failures.precision(10);
  int64_t bad = 0;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& leaf = leaves[i];
    if (!is_checked_input(leaf)) continue;
    RefArray got =
        analytic[i].defined() ? to_ref(analytic[i]) : RefArray::filled(leaf.shape(), 0.0);
    if (analytic[i].defined() &&
        (analytic[i].shape() != leaf.shape() || analytic[i].dtype() != DType::kFloat64)) {
      return ::testing::AssertionFailure()
             << "gradcheck: gradient of input " << i << " is " << analytic[i].str()
             << ", expected float64 of shape " << shape_string(leaf.shape());
    }
    for (int64_t e = 0; e < leaf.numel(); ++e) {
      double* slot = element_ptr(leaf, e);
      const double original = *slot;
      *slot = original + options.eps;
      double plus = loss();
      *slot = original - options.eps;
      double minus = loss();
      *slot = original;
      double numeric = (plus - minus) / (2.0 * options.eps);
      double analytic_value = got.data[e];
      if (!(std::abs(analytic_value - numeric) <=
            options.atol + options.rtol * std::abs(numeric))) {
        if (bad++ < 8) {
          failures << "\n  input " << i << " " << shape_string(leaf.shape()) << " at "
                   << shape_string(ref::unravel(e, leaf.shape())) << ": analytic " << analytic_value
                   << ", numeric " << numeric;
        }
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " gradient entries differ" << failures.str();
}

::testing::AssertionResult gradcheck(const SingleOutputFn& fn, const std::vector<Tensor>& inputs,
                                     const GradcheckOptions& options) {
  MultiOutputFn multi = [&fn](const std::vector<Tensor>& xs) {
    return std::vector<Tensor>{fn(xs)};
  };
  return gradcheck(multi, inputs, options);
}

}  // namespace rd::test
