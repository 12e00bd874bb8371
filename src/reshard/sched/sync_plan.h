// The whole sync-plan question (DESIGN.md 21), shared by `reshard sync-plan` and
// reshard.plan_sync: the trainer's and the engines' layouts (from a config.json and parallel
// degrees, or from map documents), a topology; the schedule, simulated.
#ifndef RESHARD_SCHED_SYNC_PLAN_H_
#define RESHARD_SCHED_SYNC_PLAN_H_

#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/map_json.h"
#include "reshard/sched/fleet_model.h"
#include "reshard/sched/simulate.h"
#include "reshard/sched/sync_schedule.h"
#include "reshard/sched/topology.h"

namespace reshard {

struct SyncPlanResult {
  Topology topology;
  SyncSchedule schedule;
  SyncPrediction prediction;
  double planning_s = 0;  // building the schedule (maps, composition, tree), not simulating
  /// SyncReportJson of the above.
  std::string Json(bool include_transfers) const;
};

/// The options of a sync into `num_engines` engines: the defaults, but a lone engine's
/// replicated pieces go from the trainer to each holder (one exchange, as WeightSync runs it).
SyncOptions OptionsFor(size_t num_engines);

/// The sync of a model from its config: the trainer on `trainer` (Megatron's grid), engine e
/// a vLLM-style TP group of `engine_tp[e]` workers, in `format`.
/// \error InvalidArgument  a malformed config, or a topology too small for the processes.
/// \error FailedPrecondition  a degree the model cannot be split at (naming the tensor).
Result<SyncPlanResult> PlanSyncFromConfig(std::string_view config_json, const GridLayout& trainer,
                                          const std::vector<int>& engine_tp, SyncFormat format,
                                          TopologySpec topology);

/// The sync from map documents: the trainer's maps over its ranks and one document per engine
/// (a tensor an engine's document lacks is one that engine does not need); every tensor
/// `element_bytes` bytes per element.
/// \error FailedPrecondition  an engine's tensor the trainer's document lacks, or maps that do
///        not describe one tensor.
Result<SyncPlanResult> PlanSyncFromMaps(const MapDocument& source,
                                        const std::vector<const MapDocument*>& engines,
                                        Index element_bytes, TopologySpec topology);

}  // namespace reshard

#endif  // RESHARD_SCHED_SYNC_PLAN_H_
