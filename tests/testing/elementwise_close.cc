// An elementwise closeness check with a tolerance per element.
#include "testing/elementwise_close.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"
#include "ringdilated/tensor/shape_util.h"

namespace rd::test {

void expect_elementwise_close(const std::string& what, const std::vector<double>& got,
                              const std::vector<double>& want,
                              const std::function<double(size_t e)>& tolerance,
                              const std::string& got_name, const std::string& want_name) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t failures = 0, first = -1;
  double first_tol = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    bool ok;
    double tol = 0;
    if (std::isinf(want[e])) {
      ok = got[e] == want[e];
    } else {
      tol = tolerance(e);
      ok = std::fabs(got[e] - want[e]) <= tol;  // false for NaN
    }
    if (!ok && failures++ == 0) {
      first = static_cast<int64_t>(e);
      first_tol = tol;
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << got.size()
                         << " elements off; first at " << first << ": " << got_name << " "
                         << (first >= 0 ? got[first] : 0) << ", " << want_name << " "
                         << (first >= 0 ? want[first] : 0) << ", tolerance " << first_tol;
}

void expect_tensors_close(const std::string& what, const Tensor& got, const Tensor& want,
                          double rel_tol) {
  ASSERT_EQ(got.shape(), want.shape())
      << what << ": shapes " << shape_str(got.shape()) << " and " << shape_str(want.shape());
  auto host = [](const Tensor& t) {
    return t.detach().to(Device::cpu()).to(DType::kFloat64).contiguous().to_vector<double>();
  };
  const std::vector<double> w = host(want);
  expect_elementwise_close(what, host(got), w,
                           [&](size_t e) { return rel_tol * std::max(1.0, std::abs(w[e])); });
}

}  // namespace rd::test
