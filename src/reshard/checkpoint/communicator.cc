#include "reshard/checkpoint/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
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
