#include "reshard/sched/simulate.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <queue>
#include <tuple>
#include <utility>

namespace reshard {

namespace {

// The dependencies of a schedule's transfers, inverted: who waits for each transfer.
struct Dependencies {
  std::vector<std::vector<int>> waiters;  // per transfer: the transfers waiting for it
  std::vector<int> waiting;               // per transfer: dependencies not yet arrived

  explicit Dependencies(const SyncSchedule& schedule) {
    const size_t n = schedule.transfers.size();
    waiters.resize(n);
    waiting.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      const SyncTransfer& x = schedule.transfers[i];
      for (int k = 0; k < x.num_dependencies; ++k) {
        const int d = schedule.dependencies[static_cast<size_t>(x.first_dependency + k)];
        waiters[static_cast<size_t>(d)].push_back(static_cast<int>(i));
        ++waiting[i];
      }
    }
  }
};

// Transfers as fluid flows: a link's bandwidth is shared equally by the transfers on it, each
// runs at the smaller of its two shares, and a process runs at most kMaxSends transfers at a
// time, in the order they became ready.
class FluidSimulation {
 public:
  static constexpr int kMaxSends = 8;

  FluidSimulation(const SyncSchedule& schedule, const Topology& topology, SyncPrediction* out)
      : schedule_(schedule), topology_(topology), out_(*out), deps_(schedule) {
    const size_t n = schedule.transfers.size();
    const auto links = static_cast<size_t>(topology.num_links());
    on_link_.resize(links);
    bandwidth_.resize(links);
    for (size_t l = 0; l < links; ++l) bandwidth_[l] = topology.LinkBandwidth(static_cast<int>(l));
    flows_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const SyncTransfer& x = schedule.transfers[i];
      topology.Route(x.from, x.to, &flows_[i].out, &flows_[i].in);
      flows_[i].remaining = static_cast<double>(x.bytes);
    }
    ready_.resize(static_cast<size_t>(topology.num_processes()));
    sending_.assign(static_cast<size_t>(topology.num_processes()), 0);
  }

  void Run() {
    for (size_t i = 0; i < flows_.size(); ++i) {
      if (deps_.waiting[i] == 0) Ready(i, 0.0);
    }
    while (!events_.empty()) {
      const auto [when, i, version] = events_.top();
      events_.pop();
      if (version != flows_[i].version || flows_[i].done) continue;
      Finish(i, when);
    }
  }

 private:
  struct Flow {
    int out = 0;
    int in = 0;
    double remaining = 0;
    double rate = 0;
    double since = 0;
    int version = 0;
    bool done = false;
  };
  using Event = std::tuple<double, size_t, int>;  // (finish time, flow, version)

  void Ready(size_t i, double now) {
    const auto from = static_cast<size_t>(schedule_.transfers[i].from);
    ready_[from].push_back(i);
    StartSends(from, now);
  }

  void StartSends(size_t process, double now) {
    while (sending_[process] < kMaxSends && !ready_[process].empty()) {
      const size_t i = ready_[process].front();
      ready_[process].pop_front();
      ++sending_[process];
      Flow& f = flows_[i];
      f.since = now;
      on_link_[static_cast<size_t>(f.out)].push_back(i);
      on_link_[static_cast<size_t>(f.in)].push_back(i);
      Reshare(f.out, now);
      Reshare(f.in, now);
    }
  }

  // Every flow on `link` at its new share.
  void Reshare(int link, double now) {
    for (size_t g : on_link_[static_cast<size_t>(link)]) {
      Flow& f = flows_[g];
      f.remaining = std::max(0.0, f.remaining - f.rate * (now - f.since));
      f.since = now;
      f.rate = std::min(bandwidth_[static_cast<size_t>(f.out)] /
                            static_cast<double>(on_link_[static_cast<size_t>(f.out)].size()),
                        bandwidth_[static_cast<size_t>(f.in)] /
                            static_cast<double>(on_link_[static_cast<size_t>(f.in)].size()));
      ++f.version;
      events_.emplace(now + f.remaining / f.rate, g, f.version);
    }
  }

  void Finish(size_t i, double now) {
    Flow& f = flows_[i];
    f.done = true;
    for (int l : {f.out, f.in}) {
      auto& v = on_link_[static_cast<size_t>(l)];
      v.erase(std::find(v.begin(), v.end(), i));
    }
    Reshare(f.out, now);
    Reshare(f.in, now);
    const SyncTransfer& x = schedule_.transfers[i];
    out_.link_bytes[static_cast<size_t>(f.out)] += x.bytes;
    out_.link_bytes[static_cast<size_t>(f.in)] += x.bytes;
    out_.total_bytes += x.bytes;
    if (x.from < topology_.trainer_ranks()) out_.trainer_egress_bytes += x.bytes;
    out_.predicted_s = std::max(out_.predicted_s, now);
    double& done = out_.process_done_s[static_cast<size_t>(x.to)];
    done = std::max(done, now);
    for (int w : deps_.waiters[i]) {
      if (--deps_.waiting[static_cast<size_t>(w)] == 0) Ready(static_cast<size_t>(w), now);
    }
    const auto from = static_cast<size_t>(x.from);
    --sending_[from];
    StartSends(from, now);
  }

  const SyncSchedule& schedule_;
  const Topology& topology_;
  SyncPrediction& out_;
  Dependencies deps_;
  std::vector<Flow> flows_;
  std::vector<std::vector<size_t>> on_link_;
  std::vector<double> bandwidth_;
  std::vector<std::deque<size_t>> ready_;
  std::vector<int> sending_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
};

}  // namespace

SyncPrediction Simulate(const SyncSchedule& schedule, const Topology& topology) {
  SyncPrediction out;
  const auto num_links = static_cast<size_t>(topology.num_links());
  out.link_bytes.assign(num_links, 0);
  out.process_done_s.assign(static_cast<size_t>(topology.num_processes()), 0.0);
  out.rounds = schedule.rounds;
  out.one_copy_bytes = schedule.one_copy_bytes;
  out.num_transfers = schedule.transfers.size();
  FluidSimulation(schedule, topology, &out).Run();
  double worst = -1;
  for (size_t l = 0; l < num_links; ++l) {
    const double s =
        static_cast<double>(out.link_bytes[l]) / topology.LinkBandwidth(static_cast<int>(l));
    if (out.link_bytes[l] > 0 && s > worst) {
      worst = s;
      out.busiest_link = static_cast<int>(l);
    }
  }
  out.lower_bound_s = std::max(worst, 0.0);
  return out;
}

}  // namespace reshard
