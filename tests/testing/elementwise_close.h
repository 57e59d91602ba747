// An elementwise closeness check with a tolerance per element, naming the first failure:
// for kernel results compared with a reference or with another device's results.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::test {

// Expects |got[e] - want[e]| <= tolerance(e) for every e. An infinite want must be matched
// exactly (tolerance is not asked); NaN never passes, so an unwritten (poisoned) element
// fails. On failure, names how many elements are off and the first one, calling the two
// sides got_name and want_name.
void expect_elementwise_close(const std::string& what, const std::vector<double>& got,
                              const std::vector<double>& want,
                              const std::function<double(size_t e)>& tolerance,
                              const std::string& got_name = "got",
                              const std::string& want_name = "want");

// The same for two tensors (any floating dtypes and devices) of one shape, each element within
// rel_tol * max(1, |want|).
void expect_tensors_close(const std::string& what, const Tensor& got, const Tensor& want,
                          double rel_tol);

}  // namespace rd::test
