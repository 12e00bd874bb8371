// reshard._core: the fleet sync planner (reshard.plan_sync, DESIGN.md 21).
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "core.h"
#include "reshard/base/dtype.h"
#include "reshard/ir/map_json.h"
#include "reshard/sched/sync_plan.h"
#include "reshard/sched/topology.h"

namespace reshard::python {

namespace {

template <typename T>
T Check(Result<T> r) {
  if (!r.ok()) Raise(r.status(), ErrorKind::kMap);
  return *std::move(r);
}

// The report of reshard.plan_sync as JSON text (the package parses it).
std::string PlanSync(const std::string& topology_json, std::optional<std::string> config_json,
                     std::optional<std::string> trainer, std::vector<int> engine_tp,
                     std::optional<std::string> source_json, std::vector<std::string> target_jsons,
                     const std::string& dtype_name, bool transfers) {
  const std::optional<DType> dtype = DTypeFromName(dtype_name);
  if (!dtype) Raise(InvalidArgumentError("unknown dtype \"" + dtype_name + "\""), ErrorKind::kMap);
  TopologySpec topo;
  {
    Result<TopologySpec> t = ParseTopologyJson(topology_json);
    if (!t.ok()) Raise(t.status().Annotate("topology"), ErrorKind::kMap);
    topo = *std::move(t);
  }
  std::optional<SyncPlanResult> result;
  {
    py::gil_scoped_release release;
    if (config_json) {
      Result<GridLayout> grid = ParseGridLayout(trainer.value_or(""));
      SyncFormat format = SyncFormat::kBf16;
      if (*dtype == DType::kF8E4M3) {
        format = SyncFormat::kFp8;
      } else if (*dtype != DType::kBF16) {
        grid = InvalidArgumentError("a config's weights are synchronised as BF16 or F8_E4M3");
      }
      if (grid.ok()) {
        Result<SyncPlanResult> r =
            PlanSyncFromConfig(*config_json, *grid, engine_tp, format, std::move(topo));
        if (r.ok())
          result = *std::move(r);
        else
          grid = r.status();
      }
      if (!grid.ok()) {
        py::gil_scoped_acquire acquire;
        Raise(grid.status(), ErrorKind::kMap);
      }
    } else {
      Status status = Status::Ok();
      Result<MapDocument> source = ReadMapDocumentJson(source_json.value_or(""));
      std::vector<MapDocument> targets;
      if (!source.ok()) status = source.status().Annotate("source");
      for (size_t e = 0; status.ok() && e < target_jsons.size(); ++e) {
        Result<MapDocument> d = ReadMapDocumentJson(target_jsons[e]);
        if (!d.ok()) {
          status = d.status().Annotate("targets[" + std::to_string(e) + "]");
        } else {
          targets.push_back(*std::move(d));
        }
      }
      if (status.ok()) {
        std::vector<const MapDocument*> engines;
        for (const MapDocument& d : targets) engines.push_back(&d);
        Result<SyncPlanResult> r = PlanSyncFromMaps(
            *source, engines, static_cast<Index>(DTypeSize(*dtype)), std::move(topo));
        if (r.ok())
          result = *std::move(r);
        else
          status = r.status();
      }
      if (!status.ok()) {
        py::gil_scoped_acquire acquire;
        Raise(status, ErrorKind::kMap);
      }
    }
  }
  return result->Json(transfers);
}

// Where each process of a sync runs ("host:gpu" per process: the trainer's ranks, then each
// engine's workers), as the topology places them; MapError naming the JSON path otherwise.
std::vector<std::string> PlaceProcesses(const std::string& topology_json, int trainer_ranks,
                                        const std::vector<int>& engine_workers) {
  Result<TopologySpec> spec = ParseTopologyJson(topology_json);
  if (!spec.ok()) Raise(spec.status().Annotate("topology"), ErrorKind::kMap);
  Result<Topology> placed = Topology::Place(*std::move(spec), trainer_ranks, engine_workers);
  if (!placed.ok()) Raise(placed.status().Annotate("topology"), ErrorKind::kMap);
  std::vector<std::string> out;
  for (int p = 0; p < placed->num_processes(); ++p) out.push_back(placed->SlotName(p));
  return out;
}

}  // namespace

void BindSync(py::module_& m) {
  m.def("place_processes", &PlaceProcesses, py::arg("topology_json"), py::arg("trainer_ranks"),
        py::arg("engine_workers"));
  m.def("plan_sync", &PlanSync, py::arg("topology_json"), py::arg("config_json"),
        py::arg("trainer"), py::arg("engine_tp"), py::arg("source_json"), py::arg("target_jsons"),
        py::arg("dtype"), py::arg("transfers"));
}

}  // namespace reshard::python
