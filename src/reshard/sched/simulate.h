// A discrete-event simulation of a SyncSchedule on a topology's links (DESIGN.md 21).
//
// Every transfer uses two links: its sender's out link and its receiver's in link (NVLink
// within a host, the NICs across hosts; each direction of a link is its own resource). The
// policy is store-and-forward over serialized links: a transfer becomes ready when every
// transfer it depends on (what its sender forwards) has arrived; ready transfers are taken in
// order of readiness (ties in schedule order), each starts when both of its links are free and
// holds both for bytes / the slower link's bandwidth. Nothing overlaps on a link, so no link
// is ever faster than its bandwidth, and the predicted time is never below the lower bound:
// the busiest link's bytes over its bandwidth.
#ifndef RESHARD_SCHED_SIMULATE_H_
#define RESHARD_SCHED_SIMULATE_H_

#include <vector>

#include "reshard/sched/sync_schedule.h"
#include "reshard/sched/topology.h"

namespace reshard {

struct SyncPrediction {
  std::vector<Index> link_bytes;  // per link of the topology
  int busiest_link = -1;          // the link with the largest bytes / bandwidth (-1: none)
  double lower_bound_s = 0;       // the busiest link's bytes over its bandwidth
  double predicted_s = 0;         // when the last transfer arrives
  int rounds = 0;
  Index trainer_egress_bytes = 0;  // bytes sent by the trainer's processes
  Index one_copy_bytes = 0;        // one copy of what the engines need
  Index total_bytes = 0;           // bytes over all links (each transfer once)
  size_t num_transfers = 0;
  /// Per process: when its last incoming transfer arrives (0 when none).
  std::vector<double> process_done_s;
};

SyncPrediction Simulate(const SyncSchedule& schedule, const Topology& topology);

}  // namespace reshard

#endif  // RESHARD_SCHED_SIMULATE_H_
