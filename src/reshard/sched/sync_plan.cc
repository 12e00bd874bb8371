#include "reshard/sched/sync_plan.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <optional>
#include <utility>

#include "reshard/sched/sync_report.h"

namespace reshard {

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

SyncPlanResult Finish(Topology topology, SyncPlanner planner, double planning_s) {
  SyncPlanResult r{std::move(topology), std::move(planner).Finish(), {}, planning_s};
  r.prediction = Simulate(r.schedule, r.topology);
  return r;
}

}  // namespace

SyncOptions OptionsFor(size_t num_engines) {
  SyncOptions options;
  options.hand_on_within_root = num_engines > 1;
  return options;
}

std::string SyncPlanResult::Json(bool include_transfers) const {
  return SyncReportJson(schedule, topology, prediction, planning_s, include_transfers);
}

Result<SyncPlanResult> PlanSyncFromConfig(std::string_view config_json, const GridLayout& trainer,
                                          const std::vector<int>& engine_tp, SyncFormat format,
                                          TopologySpec topology) {
  const auto t0 = std::chrono::steady_clock::now();
  RESHARD_ASSIGN_OR_RETURN(ModelSpec model, ModelFromConfigJson(config_json, format));
  if (engine_tp.empty()) return InvalidArgumentError("no engines to synchronise");
  RESHARD_ASSIGN_OR_RETURN(Topology topo,
                           Topology::Place(std::move(topology), trainer.world(), engine_tp));
  SyncPlanner planner(topo, OptionsFor(engine_tp.size()));
  for (const ModelTensor& t : model.tensors) {
    RESHARD_ASSIGN_OR_RETURN(ParamMap source, GridMap(t, trainer, model.num_layers));
    std::map<int, ParamMap> by_tp;  // engines of one degree share their map
    for (int tp : engine_tp) {
      if (by_tp.count(tp)) continue;
      RESHARD_ASSIGN_OR_RETURN(ParamMap m, GridMap(t, GridLayout{tp, 1, 1}, model.num_layers));
      by_tp.emplace(tp, std::move(m));
    }
    SyncTensorInput in{t.name, t.element_bytes, &source, {}};
    for (int tp : engine_tp) in.engines.push_back(&by_tp.at(tp));
    RESHARD_RETURN_IF_ERROR(planner.Add(in));
  }
  return Finish(std::move(topo), std::move(planner), SecondsSince(t0));
}

Result<SyncPlanResult> PlanSyncFromMaps(const MapDocument& source,
                                        const std::vector<const MapDocument*>& engines,
                                        Index element_bytes, TopologySpec topology) {
  const auto t0 = std::chrono::steady_clock::now();
  if (engines.empty()) return InvalidArgumentError("no engines to synchronise");
  if (source.params.empty()) return InvalidArgumentError("the trainer's map document is empty");
  const int trainer_ranks = source.params.front().second.world_size();
  for (const auto& [name, map] : source.params) {
    if (map.world_size() != trainer_ranks) {
      return FailedPreconditionError(
          fmt::format("the trainer's maps disagree on its ranks: \"{}\" has {}, \"{}\" has {}",
                      source.params.front().first, trainer_ranks, name, map.world_size()));
    }
  }
  std::vector<int> workers;
  std::vector<std::map<std::string_view, const ParamMap*>> by_name(engines.size());
  std::map<std::string_view, int> in_source;
  for (const auto& [name, map] : source.params) in_source[name] = 0;
  for (size_t e = 0; e < engines.size(); ++e) {
    const MapDocument& doc = *engines[e];
    if (doc.params.empty()) {
      return InvalidArgumentError(fmt::format("engine {}'s map document is empty", e));
    }
    const int w = doc.params.front().second.world_size();
    for (const auto& [name, map] : doc.params) {
      if (map.world_size() != w) {
        return FailedPreconditionError(
            fmt::format("engine {}'s maps disagree on its workers: \"{}\" has {}, \"{}\" has {}", e,
                        doc.params.front().first, w, name, map.world_size()));
      }
      if (!in_source.count(name)) {
        return FailedPreconditionError(fmt::format(
            "engine {} needs tensor \"{}\", which the trainer's map document lacks", e, name));
      }
      by_name[e][name] = &map;
    }
    workers.push_back(w);
  }
  RESHARD_ASSIGN_OR_RETURN(Topology topo,
                           Topology::Place(std::move(topology), trainer_ranks, workers));
  SyncPlanner planner(topo, OptionsFor(engines.size()));
  for (const auto& [name, map] : source.params) {
    SyncTensorInput in{name, element_bytes, &map, {}};
    for (size_t e = 0; e < engines.size(); ++e) {
      auto it = by_name[e].find(name);
      in.engines.push_back(it == by_name[e].end() ? nullptr : it->second);
    }
    RESHARD_RETURN_IF_ERROR(planner.Add(in));
  }
  return Finish(std::move(topo), std::move(planner), SecondsSince(t0));
}

}  // namespace reshard
