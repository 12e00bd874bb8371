#include "reshard/sched/sync_report.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace reshard {

std::string SyncReportJson(const SyncSchedule& schedule, const Topology& topology,
                           const SyncPrediction& prediction, double planning_s,
                           bool include_transfers) {
  nlohmann::ordered_json engines = nlohmann::ordered_json::array();
  for (int e = 0; e < topology.num_engines(); ++e) engines.push_back(topology.engine_workers(e));
  auto link_json = [&](int l) {
    const double bw = topology.LinkBandwidth(l);
    const auto bytes = prediction.link_bytes[static_cast<size_t>(l)];
    return nlohmann::ordered_json{{"name", topology.LinkName(l)},
                                  {"bandwidth_gbps", bw / 1e9},
                                  {"bytes", bytes},
                                  {"seconds", static_cast<double>(bytes) / bw}};
  };
  std::vector<int> used;
  for (int l = 0; l < topology.num_links(); ++l) {
    if (prediction.link_bytes[static_cast<size_t>(l)] > 0) used.push_back(l);
  }
  std::stable_sort(used.begin(), used.end(), [&](int a, int b) {
    return static_cast<double>(prediction.link_bytes[static_cast<size_t>(a)]) /
               topology.LinkBandwidth(a) >
           static_cast<double>(prediction.link_bytes[static_cast<size_t>(b)]) /
               topology.LinkBandwidth(b);
  });
  nlohmann::ordered_json links = nlohmann::ordered_json::array();
  for (int l : used) links.push_back(link_json(l));
  nlohmann::ordered_json out = {
      {"trainer_ranks", topology.trainer_ranks()},
      {"engines", std::move(engines)},
      {"hosts", topology.spec().host_names.size()},
      {"tensors", schedule.tensors.size()},
      {"one_copy_bytes", prediction.one_copy_bytes},
      {"trainer_egress_bytes", prediction.trainer_egress_bytes},
      {"total_bytes", prediction.total_bytes},
      {"num_transfers", prediction.num_transfers},
      {"rounds", prediction.rounds},
      {"lower_bound_s", prediction.lower_bound_s},
      {"predicted_s", prediction.predicted_s},
      {"predicted_over_lower_bound",
       prediction.lower_bound_s > 0 ? prediction.predicted_s / prediction.lower_bound_s : 1.0},
      {"planning_s", planning_s},
      {"busiest_link", prediction.busiest_link >= 0 ? link_json(prediction.busiest_link)
                                                    : nlohmann::ordered_json(nullptr)},
      {"links", std::move(links)}};
  if (include_transfers) {
    nlohmann::ordered_json transfers = nlohmann::ordered_json::array();
    for (const SyncTransfer& x : schedule.transfers) {
      transfers.push_back({x.round, x.from, x.to, x.bytes, x.tensor, x.step, x.move});
    }
    nlohmann::ordered_json processes = nlohmann::ordered_json::array();
    for (int p = 0; p < topology.num_processes(); ++p) processes.push_back(topology.SlotName(p));
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    for (const SyncTensor& t : schedule.tensors) names.push_back(t.name);
    out["transfers"] = std::move(transfers);
    out["processes"] = std::move(processes);
    out["tensor_names"] = std::move(names);
  }
  return out.dump(2);
}

}  // namespace reshard
