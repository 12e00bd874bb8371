// The report of a sync plan as JSON: what `reshard sync-plan --json` prints and
// reshard.plan_sync returns.
//
//   {"trainer_ranks": 512, "engines": [16, 16, ...], "hosts": 96, "tensors": 1650,
//    "one_copy_bytes": ..., "trainer_egress_bytes": ..., "total_bytes": ...,
//    "num_transfers": ..., "rounds": 5, "lower_bound_s": 1.68, "predicted_s": 1.74,
//    "predicted_over_lower_bound": 1.03, "planning_s": 2.1,
//    "busiest_link": {"name": "e3 nic in", "bandwidth_gbps": 400, "bytes": ..., "seconds": ...},
//    "links": [... every link that carries bytes, busiest first ...],
//    "transfers": [[round, from, to, bytes, tensor, step, move, [dependencies]], ...],
//    "processes": ["node0:0", ...], "tensor_names": [...],
//    "tensor_plans": [{"name", "element_bytes",
//                      "steps": [{"plan", "from_engine", "to_engine", "kind", "after"}],
//                      "plans": [{"source_buffers", "target_buffers",
//                                 "moves": [[src_rank, dst_rank, shape, [offset, strides],
//                                            [offset, strides]], ...]}]}]}
//   (the last four only when transfers are asked for: the schedule a runtime executes;
//   from_engine -1 is the trainer, whose ranks are the plans' source ranks).
#ifndef RESHARD_SCHED_SYNC_REPORT_H_
#define RESHARD_SCHED_SYNC_REPORT_H_

#include <string>

#include "reshard/sched/simulate.h"
#include "reshard/sched/sync_schedule.h"
#include "reshard/sched/topology.h"

namespace reshard {

std::string SyncReportJson(const SyncSchedule& schedule, const Topology& topology,
                           const SyncPrediction& prediction, double planning_s,
                           bool include_transfers);

}  // namespace reshard

#endif  // RESHARD_SCHED_SYNC_REPORT_H_
