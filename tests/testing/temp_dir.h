// A fresh folder for one test under the system's temporary folder, named after the running
// test and the process, removed with its contents when the test ends.
#pragma once

#include <filesystem>

namespace rd::test {

class TestTempDir {
 public:
  TestTempDir();
  ~TestTempDir();
  TestTempDir(const TestTempDir&) = delete;
  TestTempDir& operator=(const TestTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace rd::test
