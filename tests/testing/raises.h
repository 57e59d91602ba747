// raises(f, codes, fragments): a GoogleTest assertion that f throws rd::Error with one of
// the codes and a message naming every fragment (the op, the argument, the shapes).
#pragma once

#include <initializer_list>
#include <string>

#include <gtest/gtest.h>

#include "ringdilated/kernels/error.h"

namespace rd::test {

// Runs f, which must throw rd::Error with one of `codes` and a message containing every
// fragment of `fragments`.
template <class F>
::testing::AssertionResult raises(F&& f, std::initializer_list<ErrorCode> codes,
                                  std::initializer_list<std::string> fragments) {
  try {
    f();
  } catch (const Error& e) {
    bool code_ok = false;
    for (ErrorCode c : codes) code_ok |= e.code() == c;
    std::string message = e.what();
    auto failure = [&] {
      return ::testing::AssertionFailure()
             << "code " << error_code_name(e.code()) << ", message \"" << message << "\"";
    };
    if (!code_ok) return failure() << ": unexpected code";
    for (const std::string& fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        return failure() << ": missing \"" << fragment << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-rd::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace rd::test
