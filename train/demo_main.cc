// rd_demo: the library end to end on the CPU. Fits a two-layer MLP (matmul, gelu, matmul)
// to a synthetic 4-class problem with cross-entropy and plain SGD, saves the weights as
// safetensors and reloads them. Exits non-zero when the loss does not drop clearly.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ringdilated/ringdilated.h"

namespace {

constexpr int64_t kSamples = 1024;
constexpr int64_t kFeatures = 16;
constexpr int64_t kTeacherHidden = 32;
constexpr int64_t kHidden = 64;
constexpr int64_t kClasses = 4;
constexpr int kSteps = 400;
constexpr int kLogEvery = 50;
constexpr double kLearningRate = 1.0;
// Training counts as working when the final loss is this many times below the first one.
constexpr double kRequiredLossDrop = 4.0;

struct Dataset {
  rd::Tensor inputs;  // [kSamples, kFeatures] float32
  rd::Tensor labels;  // [kSamples] int64
};

// Labels come from a fixed random nonlinear "teacher", so the classes are learnable but
// not linearly separable.
Dataset make_dataset(rd::Generator& gen) {
  rd::Tensor inputs = rd::randn({kSamples, kFeatures}, gen);
  rd::Tensor teacher_in = rd::randn({kFeatures, kTeacherHidden}, gen);
  rd::Tensor teacher_out = rd::randn({kTeacherHidden, kClasses}, gen);
  rd::Tensor scores = rd::matmul(rd::tanh(rd::matmul(inputs, teacher_in)), teacher_out);
  return {inputs, rd::argmax(scores, /*dim=*/1)};
}

// A weight drawn with stddev 1/sqrt(fan_in), which keeps activations near unit scale.
rd::Tensor init_weight(int64_t fan_in, int64_t fan_out, rd::Generator& gen) {
  rd::Tensor weight = rd::randn({fan_in, fan_out}, gen) * (1.0 / std::sqrt(double(fan_in)));
  weight.set_requires_grad(true);
  return weight;
}

struct Mlp {
  rd::Tensor w1, b1, w2, b2;

  explicit Mlp(rd::Generator& gen)
      : w1(init_weight(kFeatures, kHidden, gen)),
        b1(rd::zeros({kHidden}, rd::TensorOptions().with_requires_grad(true))),
        w2(init_weight(kHidden, kClasses, gen)),
        b2(rd::zeros({kClasses}, rd::TensorOptions().with_requires_grad(true))) {}

  rd::Tensor forward(const rd::Tensor& inputs) const {
    rd::Tensor hidden = rd::gelu(rd::matmul(inputs, w1) + b1);
    return rd::matmul(hidden, w2) + b2;  // logits [N, kClasses]
  }

  std::map<std::string, rd::Tensor> named_parameters() const {
    return {{"w1", w1}, {"b1", b1}, {"w2", w2}, {"b2", b2}};
  }
};

// p -= lr * p.grad for every parameter. The update itself must not be recorded by autograd,
// hence the guard; in-place ops on tensors that require grad are refused without it.
void sgd_step(const std::map<std::string, rd::Tensor>& parameters, double learning_rate) {
  rd::autograd::NoGradGuard no_grad;
  for (const auto& [name, parameter] : parameters) {
    rd::Tensor p = parameter;  // a handle: updates the same storage
    p.add_(p.grad(), -learning_rate);
    p.zero_grad();
  }
}

double accuracy(const rd::Tensor& logits, const rd::Tensor& labels) {
  rd::Tensor correct = rd::eq(rd::argmax(logits, /*dim=*/1), labels);
  return rd::mean(correct.to(rd::DType::kFloat32)).item<double>();
}

// Saves the trained parameters, loads them back and checks that the reloaded model gives
// the same logits.
bool round_trip_checkpoint(const Mlp& model, const rd::Tensor& inputs) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "rd_demo_mlp.safetensors").string();
  rd::save_safetensors(path, model.named_parameters(), {{"model", "rd_demo mlp"}});
  rd::SafetensorsFile file = rd::load_safetensors(path);
  std::filesystem::remove(path);

  rd::autograd::NoGradGuard no_grad;
  Mlp reloaded = model;
  reloaded.w1 = file.tensors.at("w1");
  reloaded.b1 = file.tensors.at("b1");
  reloaded.w2 = file.tensors.at("w2");
  reloaded.b2 = file.tensors.at("b2");
  // Tight tolerances: the weights are bit-identical, only BLAS scheduling may differ.
  bool same = rd::allclose(reloaded.forward(inputs), model.forward(inputs), 1e-6, 1e-6);
  std::printf("checkpoint: saved and reloaded %zu tensors via %s: %s\n", file.tensors.size(),
              path.c_str(), same ? "same logits" : "LOGITS DIFFER");
  return same;
}

int run() {
  rd::Generator gen(/*seed=*/2024);
  Dataset data = make_dataset(gen);
  Mlp model(gen);
  std::printf("rd_demo: %lld samples, %lld features -> %lld hidden (gelu) -> %lld classes, "
              "SGD lr %.2f, %d full-batch steps\n",
              (long long)kSamples, (long long)kFeatures, (long long)kHidden,
              (long long)kClasses, kLearningRate, kSteps);

  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0.0;
  double last_loss = 0.0;
  for (int step = 0; step <= kSteps; ++step) {
    rd::Tensor loss = rd::cross_entropy(model.forward(data.inputs), data.labels);
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (step % kLogEvery == 0) std::printf("step %4d  loss %.4f\n", step, last_loss);
    if (step == kSteps) break;  // the last iteration only measures
    loss.backward();
    sgd_step(model.named_parameters(), kLearningRate);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  double train_accuracy;
  {
    rd::autograd::NoGradGuard no_grad;
    train_accuracy = accuracy(model.forward(data.inputs), data.labels);
  }
  std::printf("trained in %.2f s: loss %.4f -> %.4f (%.1fx lower), accuracy %.1f%%\n", seconds,
              first_loss, last_loss, first_loss / last_loss, 100.0 * train_accuracy);

  bool ok = std::isfinite(last_loss) && last_loss * kRequiredLossDrop < first_loss;
  if (!ok) {
    std::printf("FAILED: the loss did not drop by at least %.0fx\n", kRequiredLossDrop);
  }
  ok = round_trip_checkpoint(model, data.inputs) && ok;
  std::printf("%s\n", ok ? "rd_demo: OK" : "rd_demo: FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const rd::Error& e) {
    std::fprintf(stderr, "rd_demo: %s error: %s\n",
                 std::string(rd::error_code_name(e.code())).c_str(), e.what());
    return 2;
  }
}
