// TestTempDir: a per-test folder, made empty at the start and removed at the end.
#include "testing/temp_dir.h"

#include <unistd.h>

#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace rd::test {

TestTempDir::TestTempDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info != nullptr ? std::string(info->test_suite_name()) + "_" + info->name()
                                     : std::string("no_test");
  for (char& c : name) {
    if (c == '/') c = '_';  // parameterized test names
  }
  path_ = std::filesystem::temp_directory_path() /
          ("rd_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TestTempDir::~TestTempDir() {
  std::error_code ec;  // best effort: a destructor must not throw
  std::filesystem::remove_all(path_, ec);
}

}  // namespace rd::test
