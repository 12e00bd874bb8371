// For unit tests: a fresh directory per test, removed with everything in it when it goes out
// of scope. Named after the process and the running test, so tests in parallel (ctest -j) and
// tests in one binary never share one. Needs GoogleTest (the running test's name).
#ifndef RESHARD_BASE_TEMP_DIR_TESTING_H_
#define RESHARD_BASE_TEMP_DIR_TESTING_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace reshard::test_support {

class TempDir {
 public:
  /// A directory named after the running test; `suffix` tells apart two of one test.
  explicit TempDir(const std::string& suffix = "") {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "reshard_" + std::string(test->test_suite_name()) + "_" + test->name() +
                       "_" + std::to_string(::getpid()) + suffix;
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized: "Suite/Name/0"
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  // The names of the entries in the directory, sorted.
  std::vector<std::string> Listing() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) {
      out.push_back(e.path().filename());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace reshard::test_support

#endif  // RESHARD_BASE_TEMP_DIR_TESTING_H_
