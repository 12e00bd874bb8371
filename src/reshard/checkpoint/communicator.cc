#include "reshard/checkpoint/communicator.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <map>
#include <mutex>
#include <numeric>

namespace reshard {

namespace {

class OneProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    return std::vector<std::string>{mine};
  }
  void PublishProgress(uint64_t bytes_done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (listener_) listener_(bytes_done);
  }
  void SetProgressListener(std::function<void(uint64_t)> listener) override {
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = std::move(listener);
  }

 private:
  std::mutex mu_;
  std::function<void(uint64_t)> listener_;
};

// A status as text: "<code number> <message>".
std::string Encode(const Status& s) {
  return fmt::format("{} {}", static_cast<int>(s.code()), s.message());
}

Status Decode(const std::string& text) {
  int code = static_cast<int>(StatusCode::kInternal);
  const size_t space = text.find(' ');
  const std::string_view number = std::string_view(text).substr(0, space);
  if (std::from_chars(number.data(), number.data() + number.size(), code).ec != std::errc() ||
      code < 0 || code > static_cast<int>(StatusCode::kUnavailable)) {
    return InternalError(fmt::format("a peer sent the malformed status \"{}\"", text));
  }
  return Status(static_cast<StatusCode>(code),
                space == std::string::npos ? std::string() : text.substr(space + 1));
}

}  // namespace

Communicator& SingleProcess() {
  static OneProcess* one = new OneProcess;  // never destroyed: shared by every operation
  return *one;
}

Status AgreeOnStatus(Communicator& comm, const Status& local) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all, comm.AllGather(Encode(local)));
  for (size_t p = 0; p < all.size(); ++p) {
    Status s = Decode(all[p]);
    if (s.ok()) continue;
    if (comm.size() == 1) return s;
    return std::move(s).Annotate(fmt::format("process {}", p));
  }
  return Status::Ok();
}

Result<std::string> Broadcast(Communicator& comm, const std::string& value, int root) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all,
                           comm.AllGather(comm.rank() == root ? value : std::string()));
  if (root < 0 || static_cast<size_t>(root) >= all.size()) {
    return InternalError(fmt::format("no process {} among {}", root, all.size()));
  }
  return std::move(all[static_cast<size_t>(root)]);
}

namespace {

// Items as text: "<name>\x1f<value>\x1e" each (names and values hold neither byte: they are
// paths and numbers; one that does is cut there, which only makes two of them compare equal
// when they were already equal up to that byte).
std::string EncodeRun(const RunDescription& items) {
  std::string text;
  for (const auto& [name, value] : items) {
    text += name.substr(0, name.find_first_of("\x1e\x1f"));
    text += '\x1f';
    text += value.substr(0, value.find_first_of("\x1e\x1f"));
    text += '\x1e';
  }
  return text;
}

std::vector<std::pair<std::string, std::string>> DecodeRun(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> items;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\x1e', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view item(text.data() + begin, end - begin);
    const size_t sep = item.find('\x1f');
    items.emplace_back(std::string(item.substr(0, sep)), sep == std::string_view::npos
                                                             ? std::string()
                                                             : std::string(item.substr(sep + 1)));
    begin = end + 1;
  }
  return items;
}

std::string Quoted(const std::string& value) {
  if (value.size() > 200) return fmt::format("\"{}...\"", value.substr(0, 197));
  return fmt::format("\"{}\"", value);
}

}  // namespace

Status AgreeOnRun(Communicator& comm, const RunDescription& mine) {
  if (comm.size() == 1) return Status::Ok();
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all, comm.AllGather(EncodeRun(mine)));
  const auto want = DecodeRun(all.front());
  for (size_t p = 1; p < all.size(); ++p) {
    if (all[p] == all.front()) continue;
    const auto got = DecodeRun(all[p]);
    std::map<std::string, std::string> theirs(got.begin(), got.end());
    std::map<std::string, std::string> ours(want.begin(), want.end());
    std::string what;
    for (const auto& [name, value] : want) {
      auto it = theirs.find(name);
      if (it == theirs.end()) {
        what = fmt::format("process 0 has {} {} and process {} none", name, Quoted(value), p);
      } else if (it->second != value) {
        what = fmt::format("{} is {} on process {} but {} on process 0", name, Quoted(it->second),
                           p, Quoted(value));
      }
      if (!what.empty()) break;
    }
    for (size_t k = 0; what.empty() && k < got.size(); ++k) {
      if (!ours.contains(got[k].first)) {
        what = fmt::format("process {} has {} {} and process 0 none", p, got[k].first,
                           Quoted(got[k].second));
      }
    }
    if (what.empty()) what = fmt::format("process {} lists its items in another order", p);
    return InvalidArgumentError(fmt::format(
        "the processes of this job were not given the same command and inputs: {}; every "
        "process must run the same command on the same files",
        what));
  }
  return Status::Ok();
}

void DescribeInput(const std::string& what, const std::string& path, RunDescription& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec).lexically_normal();
  out.emplace_back(what, ec ? path : absolute.string());
  auto describe = [&](const fs::path& file, const std::string& name) {
    struct stat st;
    if (::stat(file.c_str(), &st) != 0) {
      out.emplace_back(fmt::format("{} file {}", what, name), "(cannot be read)");
      return;
    }
    if (!S_ISREG(st.st_mode)) return;
    out.emplace_back(fmt::format("{} file {}", what, name),
                     fmt::format("{} bytes, modified {}.{:09d}", st.st_size,
                                 static_cast<int64_t>(st.st_mtim.tv_sec), st.st_mtim.tv_nsec));
  };
  if (!fs::is_directory(absolute, ec)) {
    describe(absolute, absolute.filename().string());
    return;
  }
  std::vector<std::string> names;
  constexpr size_t kMaxEntries = 100000;  // a checkpoint of many tags still describes quickly
  fs::recursive_directory_iterator it(absolute,
                                      fs::directory_options::follow_directory_symlink |
                                          fs::directory_options::skip_permission_denied,
                                      ec);
  for (; !ec && it != fs::recursive_directory_iterator() && names.size() < kMaxEntries;
       it.increment(ec)) {
    if (it.depth() >= 3) it.disable_recursion_pending();
    names.push_back(fs::relative(it->path(), absolute, ec).string());
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) describe(absolute / name, name);
}

std::vector<int> BalanceByBytes(std::span<const uint64_t> bytes, int processes) {
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<uint64_t> load(static_cast<size_t>(std::max(processes, 1)), 0);
  std::vector<int> owner(bytes.size(), 0);
  for (const size_t item : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[item] = static_cast<int>(least);
    load[static_cast<size_t>(least)] += bytes[item];
  }
  return owner;
}

}  // namespace reshard
