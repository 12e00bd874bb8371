#include "progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

namespace reshard::cli {

namespace {

std::string Human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

}  // namespace

ProgressBar::ProgressBar(std::string label, bool always)
    : label_(std::move(label)),
      active_(always || ::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

ProgressBar::~ProgressBar() {
  if (drawn_) std::fputc('\n', stderr);
}

std::function<void(uint64_t, uint64_t)> ProgressBar::Callback() {
  if (!active_) return {};
  return [this](uint64_t done, uint64_t total) { Draw(done, total, done == total); };
}

void ProgressBar::Draw(uint64_t done, uint64_t total, bool final) {
  const auto now = std::chrono::steady_clock::now();
  if (!final && drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double seconds = std::chrono::duration<double>(now - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
  const double fraction = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int width = 30;
  const int filled = static_cast<int>(fraction * width);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(width, ' ');
  const double left = rate > 0 ? static_cast<double>(total - done) / rate : 0;
  fmt::print(stderr, "\r{} [{}] {} / {}  {}/s  {:.0f}s left   ", label_, bar,
             Human(static_cast<double>(done)), Human(static_cast<double>(total)), Human(rate),
             left);
  drawn_ = true;
  if (final) {
    std::fputc('\n', stderr);
    drawn_ = false;
  }
  std::fflush(stderr);
}

}  // namespace reshard::cli
