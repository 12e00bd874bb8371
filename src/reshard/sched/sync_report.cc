#include "reshard/sched/sync_report.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace reshard {

namespace {

nlohmann::ordered_json ViewJson(const StridedView& v) { return {v.offset, v.strides}; }

// A tensor's steps and plans: what a runtime needs to execute its transfers.
nlohmann::ordered_json TensorJson(const SyncTensor& t) {
  static constexpr const char* kKinds[] = {"from_trainer", "within_root", "relay"};
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const SyncStep& s : t.steps) {
    steps.push_back({{"plan", s.plan},
                     {"from_engine", s.from_engine},
                     {"to_engine", s.to_engine},
                     {"kind", kKinds[static_cast<int>(s.kind)]},
                     {"after", s.after}});
  }
  nlohmann::ordered_json plans = nlohmann::ordered_json::array();
  for (const ParamPlan& p : t.plans) {
    nlohmann::ordered_json moves = nlohmann::ordered_json::array();
    for (const Move& m : p.moves) {
      moves.push_back({m.src_rank, m.dst_rank, m.shape, ViewJson(m.src), ViewJson(m.dst)});
    }
    plans.push_back({{"source_buffers", p.source_buffers},
                     {"target_buffers", p.target_buffers},
                     {"moves", std::move(moves)}});
  }
  return {{"name", t.name},
          {"element_bytes", t.element_bytes},
          {"steps", std::move(steps)},
          {"plans", std::move(plans)}};
}

}  // namespace

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
      nlohmann::ordered_json deps = nlohmann::ordered_json::array();
      for (int k = 0; k < x.num_dependencies; ++k) {
        deps.push_back(schedule.dependencies[static_cast<size_t>(x.first_dependency + k)]);
      }
      transfers.push_back({x.round, x.from, x.to, x.bytes, x.tensor, x.step, x.move, deps});
    }
    nlohmann::ordered_json processes = nlohmann::ordered_json::array();
    for (int p = 0; p < topology.num_processes(); ++p) processes.push_back(topology.SlotName(p));
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const SyncTensor& t : schedule.tensors) {
      names.push_back(t.name);
      tensors.push_back(TensorJson(t));
    }
    out["transfers"] = std::move(transfers);
    out["processes"] = std::move(processes);
    out["tensor_names"] = std::move(names);
    out["tensor_plans"] = std::move(tensors);
  }
  return out.dump(2);
}

}  // namespace reshard
