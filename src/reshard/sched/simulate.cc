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
  // Events: transfers finishing. A link runs one transfer at a time; a ready transfer waits in
  // the queues of both its links and starts as soon as both are free (the earliest ready
  // first, on each link that frees).
  std::vector<int> out_of(n);
  std::vector<int> in_of(n);
  for (size_t i = 0; i < n; ++i) {
    topology.Route(schedule.transfers[i].from, schedule.transfers[i].to, &out_of[i], &in_of[i]);
  }
  std::vector<char> busy(num_links, 0);
  std::vector<char> started(n, 0);
  std::vector<std::vector<size_t>> queue_of(num_links);
  std::vector<size_t> queue_head(num_links, 0);
  using Event = std::pair<double, size_t>;  // (end time, transfer)
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  auto start = [&](size_t i, double now) {
    const SyncTransfer& x = schedule.transfers[i];
    const auto o = static_cast<size_t>(out_of[i]);
    const auto in = static_cast<size_t>(in_of[i]);
    const double bw = std::min(topology.LinkBandwidth(out_of[i]), topology.LinkBandwidth(in_of[i]));
    started[i] = 1;
    busy[o] = 1;
    busy[in] = 1;
    events.emplace(now + static_cast<double>(x.bytes) / bw, i);
  };
  auto offer = [&](size_t i, double now) {
    if (!busy[static_cast<size_t>(out_of[i])] && !busy[static_cast<size_t>(in_of[i])]) {
      start(i, now);
      return;
    }
    queue_of[static_cast<size_t>(out_of[i])].push_back(i);
    queue_of[static_cast<size_t>(in_of[i])].push_back(i);
  };
  // The first waiting transfer on `link` whose other link is free, started.
  auto dispatch = [&](size_t link, double now) {
    if (busy[link]) return;
    std::vector<size_t>& q = queue_of[link];
    size_t& head = queue_head[link];
    while (head < q.size() && started[q[head]]) ++head;
    for (size_t k = head; k < q.size(); ++k) {
      const size_t i = q[k];
      if (started[i]) continue;
      if (!busy[static_cast<size_t>(out_of[i])] && !busy[static_cast<size_t>(in_of[i])]) {
        start(i, now);
        return;
      }
    }
  };
  for (size_t i = 0; i < n; ++i) {
    if (waiting[i] == 0) offer(i, 0.0);
  }
  std::vector<size_t> freed;
  while (!events.empty()) {
    const double now = events.top().first;
    freed.clear();
    // Every transfer ending now: free its links, release what waited on it.
    while (!events.empty() && events.top().first == now) {
      const size_t i = events.top().second;
      events.pop();
      const SyncTransfer& x = schedule.transfers[i];
      const auto o = static_cast<size_t>(out_of[i]);
      const auto in = static_cast<size_t>(in_of[i]);
      busy[o] = 0;
      busy[in] = 0;
      freed.push_back(o);
      freed.push_back(in);
      out.link_bytes[o] += x.bytes;
      out.link_bytes[in] += x.bytes;
      out.total_bytes += x.bytes;
      if (x.from < topology.trainer_ranks()) out.trainer_egress_bytes += x.bytes;
      out.predicted_s = std::max(out.predicted_s, now);
      double& pd = out.process_done_s[static_cast<size_t>(x.to)];
      pd = std::max(pd, now);
      const auto k = static_cast<size_t>(arrives_key[i]);
      key_done[k] = std::max(key_done[k], now);
      if (--key_pending[k] == 0) {
        for (int w : waiters[k]) {
          const auto wi = static_cast<size_t>(w);
          if (--waiting[wi] == 0) freed.push_back(num_links + wi);  // ready now
        }
      }
    }
    for (size_t f : freed) {
      if (f >= num_links) {
        offer(f - num_links, now);
      } else {
        dispatch(f, now);
      }
    }
  }
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
