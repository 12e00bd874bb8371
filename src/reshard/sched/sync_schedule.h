// The schedule of one weight sync from a trainer into M inference engines (DESIGN.md 21).
//
// Every element an engine needs leaves the trainer exactly once: for each tensor, one engine
// (the root) receives it, each replicated piece of the root's layout into one of its holders
// (its primary holder); the root's workers then hand replicated pieces to their other holders,
// and every other engine receives the tensor from an engine that already holds it, so the
// engines form a relay tree per tensor. A relay sends a piece only after it has received it.
//
// The root of each tensor is the engine that has sent the fewest bytes so far (every engine
// takes in one copy whichever is root; what differs is what each sends). The cost model picks
// each relay's parent: it keeps, per link, the seconds of traffic already scheduled on it
// (bytes / bandwidth), and takes the holder whose busiest link would be least loaded after the
// relay (same-host NVLink is much faster than a NIC, so engines on one host relay to each
// other first; load spreads over hosts and NICs).
//
// Transfers are moves of composed plans (ir/compose.h), cut to at most
// SyncOptions::max_transfer_bytes: step k of a tensor is a plan from a sender (the trainer, or
// an engine) to an engine's workers; an engine whose tensor parallelism differs from its
// parent's gets moves assembled from several of the parent's workers (the parent's maps
// composed as the source). A relayed move waits for the transfers into its sender whose target
// region overlaps its source region. The same schedule object drives a runtime and the
// simulation (simulate.h).
#ifndef RESHARD_SCHED_SYNC_SCHEDULE_H_
#define RESHARD_SCHED_SYNC_SCHEDULE_H_

#include <memory>
#include <string>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/param_map.h"
#include "reshard/sched/topology.h"

namespace reshard {

/// The sender of a step: the trainer, or an engine.
inline constexpr int kTrainer = -1;

/// One plan of a tensor's sync: `plan`'s source ranks are the trainer's ranks (from_engine
/// kTrainer) or from_engine's workers, its target ranks to_engine's workers.
struct SyncStep {
  int plan = 0;  // index into SyncTensor::plans (plans are shared by steps between equal layouts)
  int from_engine = kTrainer;
  int to_engine = 0;
  /// From the trainer into the root's primary holders only, or within the root from the
  /// primary holders to the other holders of replicated pieces.
  enum class Kind { kFromTrainer, kWithinRoot, kRelay } kind = Kind::kRelay;
  /// The steps of this tensor that deliver what a sender of this step sends: a transfer
  /// starts once the transfers of these steps into its sender that overlap what it sends
  /// have arrived (SyncTransfer's dependencies).
  std::vector<int> after;
};

struct SyncTensor {
  std::string name;
  Index element_bytes = 2;
  /// Bytes of one copy of the tensor (its non-padding elements).
  Index bytes = 0;
  std::vector<ParamPlan> plans;
  std::vector<SyncStep> steps;
};

/// One move that crosses a link: move `move` of step `step`'s plan of tensor `tensor`, from
/// process `from` to process `to` (Topology's process ids). Moves whose two ends are one
/// process (a worker that already holds the piece) have no transfer.
struct SyncTransfer {
  int round = 1;  // 1: from the trainer; a relay is one more than what it forwards
  int from = 0;
  int to = 0;
  Index bytes = 0;
  int tensor = 0;
  int step = 0;
  int move = 0;
  /// The transfers that deliver what this one sends (its sender's incoming transfers of the
  /// steps `step` comes after whose target region overlaps this one's source region):
  /// SyncSchedule::dependencies[first_dependency, first_dependency + num_dependencies).
  int64_t first_dependency = 0;
  int num_dependencies = 0;
};

struct SyncSchedule {
  std::vector<SyncTensor> tensors;
  std::vector<SyncTransfer> transfers;  // in the order they were planned
  std::vector<int> dependencies;        // indices into transfers (see SyncTransfer)
  int rounds = 0;
  /// Bytes of one copy of every tensor some engine needs.
  Index one_copy_bytes = 0;
};

/// One tensor to synchronise: its map over the trainer's ranks and, per engine, its map over
/// that engine's workers (nullptr: the engine does not hold it).
struct SyncTensorInput {
  std::string name;
  Index element_bytes = 2;
  const ParamMap* source = nullptr;
  std::vector<const ParamMap*> engines;
};

struct SyncOptions {
  /// Moves of more bytes are cut along their outer dimensions into moves of at most this many
  /// (whole rows of the innermost dimension at least), so that relays forward a large tensor
  /// piece by piece instead of after all of it. 0: never cut.
  Index max_transfer_bytes = Index{32} << 20;
  /// An engine relays a tensor to at most this many engines (0: any number), and relay trees
  /// are at most this deep (0: any depth): every hop queues behind busy links.
  int max_fanout = 0;
  int max_depth = 0;
  /// Each replicated piece of the root's layout goes from the trainer to one of its holders,
  /// which hands it on to the others (a step within the root). False: the trainer sends every
  /// holder its copy (no step within the root: one exchange into a lone engine, as a push into
  /// one engine runs).
  bool hand_on_within_root = true;
  /// A relay's parent is the cheapest holder; with this on, holders on other hosts than the
  /// child are kept ordered by their sending load, so that finding it costs about the holders
  /// on the child's hosts rather than every holder. The choice is the same either way (off:
  /// every holder is costed, as with the caps above).
  bool prune_parents = true;
};

/// Builds a SyncSchedule one tensor at a time (maps of a large model need not all be held).
class SyncPlanner {
 public:
  explicit SyncPlanner(const Topology& topology, SyncOptions options = {});
  ~SyncPlanner();
  SyncPlanner(SyncPlanner&&) noexcept;
  SyncPlanner& operator=(SyncPlanner&&) noexcept;

  /// Plans one tensor. InvalidArgument when the maps' worlds disagree with the topology's
  /// processes; FailedPrecondition when the maps do not describe one tensor (Compose's
  /// refusal, naming the tensor).
  Status Add(const SyncTensorInput& tensor);
  /// The schedule of everything added.
  SyncSchedule Finish() &&;
  /// How many candidate parents the relays of everything added were costed against (the
  /// planning's work: about the engines per tensor, not their square, with prune_parents).
  int64_t parents_costed() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace reshard

#endif  // RESHARD_SCHED_SYNC_SCHEDULE_H_
