#include "reshard/io/temporaries.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

namespace reshard {

namespace fs = std::filesystem;

namespace {

std::string BootId() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(in, text);
    std::string hex;
    for (char c : text) {
      if (std::isxdigit(static_cast<unsigned char>(c))) hex.push_back(c);
    }
    return hex.size() >= 8 ? hex.substr(0, 8) : std::string("00000000");
  }();
  return id;
}

// The start time of process `pid` in clock ticks since boot; nullopt if there is no such
// process.
std::optional<uint64_t> ProcessStart(long pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold spaces: count from the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return std::nullopt;
  }
  uint64_t start = 0;
  auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), start);
  if (ec != std::errc() || end != field.data() + field.size()) return std::nullopt;
  return start;
}

struct Registry {
  std::mutex mu;
  std::set<std::string> paths;
  bool ending = false;
};

Registry& TheRegistry() {
  static Registry* registry = new Registry;  // never destroyed: a signal thread may hold it
  return *registry;
}

Status Ending() { return UnavailableError("the process is ending (interrupted)"); }

// Splits "a-b-c-d" into its parts.
std::vector<std::string_view> SplitDashes(std::string_view s) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t dash = s.find('-', start);
    parts.push_back(s.substr(start, dash == std::string_view::npos ? dash : dash - start));
    if (dash == std::string_view::npos) return parts;
    start = dash + 1;
  }
}

fs::path OutputPath(const std::string& path) {
  fs::path target(path);
  if (target.filename().empty()) target = target.parent_path();
  return target;
}

}  // namespace

std::string TemporaryPathFor(const std::string& path) {
  const fs::path target = OutputPath(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  static thread_local std::mt19937 rng{std::random_device{}()};
  const long pid = ::getpid();
  return (dir / fmt::format(".{}.tmp-{}-{}-{}-{:08x}", target.filename().string(), BootId(), pid,
                            ProcessStart(pid).value_or(0), rng()))
      .string();
}

Status CreateTemporary(const std::string& temp, const std::function<Status()>& create) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.ending) return Ending();
  Status s = create();
  if (s.ok()) r.paths.insert(temp);
  return s;
}

Status FinishTemporary(const std::string& temp, const std::function<Status()>& finish) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.ending) return Ending();
  Status s = finish();
  r.paths.erase(temp);
  return s;
}

void RemoveTemporariesAndHold() {
  Registry& r = TheRegistry();
  r.mu.lock();  // never unlocked: the process is about to end
  r.ending = true;
  for (const std::string& p : r.paths) {
    // Several processes of one job may remove the same directory at once: each stops at the
    // first entry another removed first, so go again until it is gone.
    std::error_code ec;
    for (int attempt = 0; attempt < 100 && fs::exists(fs::symlink_status(p, ec)); ++attempt) {
      fs::remove_all(p, ec);
    }
  }
  r.paths.clear();
}

int RemoveStaleTemporaries(const std::string& path) {
  const fs::path target = OutputPath(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string prefix = fmt::format(".{}.tmp-", target.filename().string());
  int removed = 0;
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::vector<std::string_view> parts =
        SplitDashes(std::string_view(name).substr(prefix.size()));
    if (parts.size() != 4 || parts[0] != BootId()) continue;  // not ours to judge
    long pid = 0;
    uint64_t start = 0;
    if (std::from_chars(parts[1].data(), parts[1].data() + parts[1].size(), pid).ec !=
            std::errc() ||
        std::from_chars(parts[2].data(), parts[2].data() + parts[2].size(), start).ec !=
            std::errc() ||
        pid <= 0) {
      continue;
    }
    if (pid == ::getpid()) continue;
    const std::optional<uint64_t> now = ProcessStart(pid);
    if (now && *now == start) continue;  // its owner is still running
    stale.push_back(e.path());
  }
  for (const fs::path& p : stale) {
    std::error_code remove_ec;
    if (fs::remove_all(p, remove_ec) > 0 && !remove_ec) ++removed;
  }
  return removed;
}

}  // namespace reshard
