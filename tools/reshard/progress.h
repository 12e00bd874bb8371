// A progress bar on stderr when it is a terminal (bytes, rate, time left); silent otherwise.
#ifndef RESHARD_TOOLS_PROGRESS_H_
#define RESHARD_TOOLS_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace reshard::cli {

class ProgressBar {
 public:
  /// Draws when stderr is a terminal, or always with `always` (under mpirun, whose processes
  /// write to pipes).
  explicit ProgressBar(std::string label, bool always = false);
  ~ProgressBar();
  /// A callback for CheckpointOptions::progress, or an empty function when stderr is not a
  /// terminal.
  std::function<void(uint64_t, uint64_t)> Callback();

 private:
  void Draw(uint64_t done, uint64_t total, bool final);
  std::string label_;
  bool active_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_PROGRESS_H_
