// reshard._core: the fleet sync planner (reshard.plan_sync, DESIGN.md 21).
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core.h"
#include "reshard/base/dtype.h"
#include "reshard/ir/map_json.h"
#include "reshard/sched/sync_plan.h"
#include "reshard/sched/sync_schedule.h"
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

// The schedule a WeightSync executes (DESIGN.md 21): the same SyncPlanner as plan_sync, fed
// the maps of the sync's tensors one at a time; its steps' plans become the exchanges.
class ScheduleHandle {
 public:
  ScheduleHandle(const std::string& topology_json, int trainer_ranks,
                 const std::vector<int>& engine_workers) {
    Result<TopologySpec> spec = ParseTopologyJson(topology_json);
    if (!spec.ok()) Raise(spec.status().Annotate("topology"), ErrorKind::kMap);
    Result<Topology> placed = Topology::Place(*std::move(spec), trainer_ranks, engine_workers);
    if (!placed.ok()) Raise(placed.status().Annotate("topology"), ErrorKind::kMap);
    topology_ = std::make_unique<Topology>(*std::move(placed));
    planner_ = std::make_unique<SyncPlanner>(*topology_, OptionsFor(engine_workers.size()));
  }

  // Plans one tensor: its map over the trainer's ranks, and per engine its map over the
  // engine's workers (None: the engine does not take it from this tensor's tree).
  void Add(const std::string& name, Index element_bytes, MapHandle* source,
           const std::vector<MapHandle*>& engines) {
    if (!planner_) throw py::value_error("the schedule is finished");
    SyncTensorInput in{name, element_bytes, &source->Valid(), {}};
    for (MapHandle* e : engines) in.engines.push_back(e == nullptr ? nullptr : &e->Valid());
    Status status;
    {
      py::gil_scoped_release release;
      status = planner_->Add(in);
    }
    if (!status.ok()) Raise(status, ErrorKind::kMap);
  }

  void Finish() {
    if (!planner_) return;
    schedule_ = std::move(*planner_).Finish();
    planner_.reset();
  }

  size_t NumTensors() const { return Done().tensors.size(); }

  // Tensor t's steps: (kind, from engine (-1: the trainer), to engine, steps it comes after).
  std::vector<std::tuple<std::string, int, int, std::vector<int>>> Steps(size_t t) const {
    static constexpr const char* kKinds[] = {"from_trainer", "within_root", "relay"};
    std::vector<std::tuple<std::string, int, int, std::vector<int>>> out;
    for (const SyncStep& s : Tensor(t).steps) {
      out.emplace_back(kKinds[static_cast<int>(s.kind)], s.from_engine, s.to_engine, s.after);
    }
    return out;
  }

  // The plans of the given (tensor, step)s, in order.
  PlanSet Plans(const std::vector<std::pair<size_t, size_t>>& steps) const {
    PlanSet out;
    for (const auto& [t, s] : steps) {
      const SyncTensor& tensor = Tensor(t);
      if (s >= tensor.steps.size()) throw py::index_error("no such step");
      const SyncStep& step = tensor.steps[s];
      ParamPlan plan = tensor.plans[static_cast<size_t>(step.plan)];
      if (step.kind == SyncStep::Kind::kWithinRoot) {  // a primary holder's own pieces stay
        std::erase_if(plan.moves, [](const Move& m) {
          return m.src_rank == m.dst_rank && m.src == m.dst && m.factor == 1.0;
        });
      }
      out.plans.push_back(std::move(plan));
    }
    return out;
  }

  // Bytes per (sending process, receiving process), the processes numbered as the topology's.
  std::map<std::pair<int, int>, Index> Links() const {
    std::map<std::pair<int, int>, Index> out;
    for (const SyncTransfer& x : Done().transfers) out[{x.from, x.to}] += x.bytes;
    return out;
  }

  Index OneCopyBytes() const { return Done().one_copy_bytes; }

 private:
  const SyncSchedule& Done() const {
    if (!schedule_) throw py::value_error("the schedule is not finished");
    return *schedule_;
  }
  const SyncTensor& Tensor(size_t t) const {
    if (t >= Done().tensors.size()) throw py::index_error("no such tensor");
    return Done().tensors[t];
  }

  std::unique_ptr<Topology> topology_;
  std::unique_ptr<SyncPlanner> planner_;
  std::optional<SyncSchedule> schedule_;
};

}  // namespace

void BindSync(py::module_& m) {
  py::class_<PlanSet>(m, "PlanSet").def("__len__", [](const PlanSet& p) { return p.plans.size(); });
  py::class_<ScheduleHandle>(m, "SyncSchedule")
      .def(py::init<const std::string&, int, const std::vector<int>&>(), py::arg("topology_json"),
           py::arg("trainer_ranks"), py::arg("engine_workers"))
      .def("add", &ScheduleHandle::Add, py::arg("name"), py::arg("element_bytes"),
           py::arg("source"), py::arg("engines"))
      .def("finish", &ScheduleHandle::Finish)
      .def_property_readonly("num_tensors", &ScheduleHandle::NumTensors)
      .def_property_readonly("one_copy_bytes", &ScheduleHandle::OneCopyBytes)
      .def("steps", &ScheduleHandle::Steps, py::arg("tensor"))
      .def("plans", &ScheduleHandle::Plans, py::arg("steps"))
      .def("links", &ScheduleHandle::Links);
  m.def("place_processes", &PlaceProcesses, py::arg("topology_json"), py::arg("trainer_ranks"),
        py::arg("engine_workers"));
  m.def("plan_sync", &PlanSync, py::arg("topology_json"), py::arg("config_json"),
        py::arg("trainer"), py::arg("engine_tp"), py::arg("source_json"), py::arg("target_jsons"),
        py::arg("dtype"), py::arg("transfers"));
}

}  // namespace reshard::python
