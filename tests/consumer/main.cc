// An outside program built against an installed RingDilated: a few ops and a backward pass
// through the public API, checked against values worked out by hand, and the worked example
// of README.md ("Building a model"). Exits non-zero on any mismatch, so the consumer_package
// test fails.
#include <ringdilated/ringdilated.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

int g_failures = 0;

void expect_values(const std::string& what, const rd::Tensor& got_tensor,
                   const std::vector<double>& want, double tolerance = 1e-5) {
  std::vector<float> got = got_tensor.to_vector<float>();
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < got.size(); ++i) {
    ok = std::abs(double(got[i]) - want[i]) <= tolerance * (1.0 + std::abs(want[i]));
  }
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) {
    ++g_failures;
    for (size_t i = 0; i < got.size() || i < want.size(); ++i) {
      std::printf("  [%zu] got %s want %s\n", i,
                  i < got.size() ? std::to_string(got[i]).c_str() : "-",
                  i < want.size() ? std::to_string(want[i]).c_str() : "-");
    }
  }
}

void expect_true(const std::string& what, bool ok) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

// loss = sum((a @ w)^2) with
//   a = [[1, 2], [3, 4]], w = [[0.5, -1], [2, 0.25]]
//   y = a @ w = [[4.5, -0.5], [9.5, -2]]        loss = 20.25 + 0.25 + 90.25 + 4 = 114.75
//   dy = 2y = [[9, -1], [19, -4]]
//   da = dy @ w^T = [[5.5, 17.75], [13.5, 37]]  dw = a^T @ dy = [[66, -13], [94, -18]]
void check_matmul_backward() {
  rd::Tensor a = rd::from_vector<float>({1, 2, 3, 4}, {2, 2});
  rd::Tensor w = rd::from_vector<float>({0.5f, -1, 2, 0.25f}, {2, 2});
  a.set_requires_grad(true);
  w.set_requires_grad(true);
  rd::Tensor y = rd::matmul(a, w);
  rd::Tensor loss = rd::sum(y * y);
  expect_values("matmul forward", y, {4.5, -0.5, 9.5, -2});
  expect_values("sum of squares", loss, {114.75});
  loss.backward();
  expect_values("grad of a", a.grad(), {5.5, 17.75, 13.5, 37});
  expect_values("grad of w", w.grad(), {66, -13, 94, -18});
}

void check_broadcast_and_softmax() {
  rd::Tensor column = rd::from_vector<float>({1, 2}, {2, 1});
  rd::Tensor row = rd::from_vector<float>({10, 20, 30}, {3});
  expect_values("broadcast add", column + row, {11, 21, 31, 12, 22, 32});
  // softmax([0, ln 3]) = [1/4, 3/4]
  rd::Tensor logits = rd::from_vector<float>({0.0f, float(std::log(3.0))}, {2});
  expect_values("softmax", rd::softmax(logits, 0), {0.25, 0.75});
}

void check_generator_reproducible() {
  rd::Generator first(7), second(7);
  rd::Tensor x = rd::randn({64}, first);
  rd::Tensor y = rd::randn({64}, second);
  expect_true("randn is reproducible for a seed", rd::allclose(x, y, 0.0, 0.0));
  expect_true("randn is not constant", rd::max(x).item<float>() > rd::min(x).item<float>());
}

void check_error_model() {
  try {
    rd::matmul(rd::ones({2, 2}), rd::ones({3, 1}));
    expect_true("matmul of [2, 2] and [3, 1] throws", false);
  } catch (const rd::Error& e) {
    std::printf("     (message: %s)\n", e.what());
    expect_true("matmul of [2, 2] and [3, 1] throws kShapeMismatch",
                e.code() == rd::ErrorCode::kShapeMismatch);
  }
}


// --- The worked example of README.md ("Building a model"); keep the two in step. ---

// A residual MLP block, a norm and a linear head: a Module subclass that registers its
// children, so named_parameters() and state_dict() see "mlp.fc1.weight", "head.bias", ...
class Regressor : public rd::nn::Module {
 public:
  explicit Regressor(rd::Generator& gen) {
    mlp_ = register_module("mlp", std::make_shared<rd::nn::MLP>(
                                      4, 32, rd::nn::MLPActivation::kGelu, /*bias=*/true, gen));
    norm_ = register_module("norm", std::make_shared<rd::nn::LayerNorm>(4));
    head_ = register_module("head", std::make_shared<rd::nn::Linear>(4, 1, /*bias=*/true, gen));
  }
  rd::Tensor forward(const rd::Tensor& x) {
    return head_->forward(norm_->forward(x + mlp_->forward(x)));
  }

 private:
  std::shared_ptr<rd::nn::MLP> mlp_;
  std::shared_ptr<rd::nn::LayerNorm> norm_;
  std::shared_ptr<rd::nn::Linear> head_;
};

void check_module_training_example() {
  rd::Generator gen(0);  // one seed reproduces the whole model
  Regressor model(gen);
  const rd::Tensor x = rd::randn({256, 4}, gen);
  const rd::Tensor target = rd::tanh(x.select(1, 0) * 2.0).unsqueeze(1) +
                            (x.select(1, 1) * x.select(1, 2)).unsqueeze(1);

  rd::nn::AdamW optimizer(model.named_parameters(), {.lr = 1e-2});
  auto loss_of = [&] { return rd::mean(rd::square(model.forward(x) - target)); };
  const double first_loss = loss_of().item<double>();
  for (int step = 0; step < 300; ++step) {
    rd::Tensor loss = loss_of();
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  const double final_loss = loss_of().item<double>();
  std::printf("     (example loss %.4f -> %.4f)\n", first_loss, final_loss);
  expect_true("the example model trains (loss drops 4x)", final_loss < first_loss / 4);

  // Save the state dict as safetensors; load it into a model built from another seed.
  const std::string path =
      (std::filesystem::temp_directory_path() / "rd_consumer_example.safetensors").string();
  rd::save_safetensors(path, model.state_dict());
  rd::Generator other(1);
  Regressor restored(other);
  const rd::nn::LoadStateDictResult report =
      restored.load_state_dict(rd::load_safetensors(path).tensors);  // strict: throws on a misfit
  std::filesystem::remove(path);
  expect_true("the saved state fits the model", report.ok());
  expect_true("the restored model computes the same",
              rd::allclose(restored.forward(x), model.forward(x), 0.0, 0.0));
}

}  // namespace

int main() {
  try {
    check_matmul_backward();
    check_broadcast_and_softmax();
    check_generator_reproducible();
    check_error_model();
    check_module_training_example();
  } catch (const std::exception& e) {
    std::printf("FAIL unexpected exception: %s\n", e.what());
    return 2;
  }
  std::printf("%s: %d failure(s)\n", g_failures == 0 ? "consumer OK" : "consumer FAILED",
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
