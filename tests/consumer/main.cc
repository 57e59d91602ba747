// An outside program built against an installed RingDilated: a few ops and a backward pass
// through the public API, checked against values worked out by hand. Exits non-zero on any
// mismatch, so the consumer_package test fails.
#include <ringdilated/ringdilated.h>

#include <cmath>
#include <cstdio>
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

}  // namespace

int main() {
  try {
    check_matmul_backward();
    check_broadcast_and_softmax();
    check_generator_reproducible();
    check_error_model();
  } catch (const std::exception& e) {
    std::printf("FAIL unexpected exception: %s\n", e.what());
    return 2;
  }
  std::printf("%s: %d failure(s)\n", g_failures == 0 ? "consumer OK" : "consumer FAILED",
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
