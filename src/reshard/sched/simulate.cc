#include "reshard/sched/simulate.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <unordered_map>
#include <utility>

namespace reshard {

namespace {

// A key for "what step `step` of tensor `tensor` delivers into process `process`".
struct Key {
  int tensor;
  int step;
  int process;
  friend bool operator==(const Key&, const Key&) = default;
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return (static_cast<size_t>(k.tensor) * 1000003u + static_cast<size_t>(k.step)) * 1000033u +
           static_cast<size_t>(k.process);
  }
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
  const size_t n = schedule.transfers.size();
  // Arrivals each key waits for, and which transfers wait on each key.
  std::unordered_map<Key, int, KeyHash> key_id;
  std::vector<int> key_pending;
  std::vector<double> key_done;
  std::vector<std::vector<int>> waiters;
  auto id_of = [&](const Key& k) {
    auto [it, fresh] = key_id.emplace(k, static_cast<int>(key_pending.size()));
    if (fresh) {
      key_pending.push_back(0);
      key_done.push_back(0.0);
      waiters.emplace_back();
    }
    return it->second;
  };
  std::vector<int> arrives_key(n);
  for (size_t i = 0; i < n; ++i) {
    const SyncTransfer& x = schedule.transfers[i];
    const int k = id_of(Key{x.tensor, x.step, x.to});
    arrives_key[i] = k;
    ++key_pending[static_cast<size_t>(k)];
  }
  std::vector<int> waiting(n, 0);
  std::vector<double> ready(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const SyncTransfer& x = schedule.transfers[i];
    const SyncStep& step = schedule.tensors[static_cast<size_t>(x.tensor)].steps[static_cast<size_t>(x.step)];
    for (int s : step.after) {
      auto it = key_id.find(Key{x.tensor, s, x.from});
      if (it == key_id.end()) continue;  // nothing arrives there: nothing to wait for
      waiters[static_cast<size_t>(it->second)].push_back(static_cast<int>(i));
      ++waiting[i];
    }
  }
  using Entry = std::pair<double, size_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  for (size_t i = 0; i < n; ++i) {
    if (waiting[i] == 0) queue.emplace(0.0, i);
  }
  std::vector<double> link_free(num_links, 0.0);
  size_t done = 0;
  while (!queue.empty()) {
    const auto [t_ready, i] = queue.top();
    queue.pop();
    const SyncTransfer& x = schedule.transfers[i];
    int out_link = 0;
    int in_link = 0;
    topology.Route(x.from, x.to, &out_link, &in_link);
    const auto o = static_cast<size_t>(out_link);
    const auto in = static_cast<size_t>(in_link);
    const double bw = std::min(topology.LinkBandwidth(out_link), topology.LinkBandwidth(in_link));
    const double start = std::max({t_ready, link_free[o], link_free[in]});
    const double end = start + static_cast<double>(x.bytes) / bw;
    link_free[o] = end;
    link_free[in] = end;
    out.link_bytes[o] += x.bytes;
    out.link_bytes[in] += x.bytes;
    out.total_bytes += x.bytes;
    if (x.from < topology.trainer_ranks()) out.trainer_egress_bytes += x.bytes;
    out.predicted_s = std::max(out.predicted_s, end);
    double& pd = out.process_done_s[static_cast<size_t>(x.to)];
    pd = std::max(pd, end);
    ++done;
    const auto k = static_cast<size_t>(arrives_key[i]);
    key_done[k] = std::max(key_done[k], end);
    if (--key_pending[k] == 0) {
      for (int w : waiters[k]) {
        const auto wi = static_cast<size_t>(w);
        ready[wi] = std::max(ready[wi], key_done[k]);
        if (--waiting[wi] == 0) queue.emplace(ready[wi], wi);
      }
    }
  }
  // Every transfer runs: the steps' dependencies point only backwards.
  (void)done;
  double worst = -1;
  for (size_t l = 0; l < num_links; ++l) {
    const double s = static_cast<double>(out.link_bytes[l]) / topology.LinkBandwidth(static_cast<int>(l));
    if (out.link_bytes[l] > 0 && s > worst) {
      worst = s;
      out.busiest_link = static_cast<int>(l);
    }
  }
  out.lower_bound_s = std::max(worst, 0.0);
  return out;
}

}  // namespace reshard
