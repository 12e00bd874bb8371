// The machines a weight sync runs on (DESIGN.md 21): hosts with GPUs, the links between them,
// and where the trainer's ranks and each engine's workers run.
//
// JSON form (every key but "hosts" optional):
//
//   {"hosts": [{"name": "node", "count": 64, "gpus": 8}, {"name": "spare", "gpus": 4}],
//    "nvlink_gbps": 450, "nic_gbps": 400, "nic": "host",
//    "placement": {"trainer": ["node0", "node1:3"], "engines": [["node2"], ["node3"]]}}
//
// A host entry with "count" N stands for N hosts named name0 .. name{N-1}. "nvlink_gbps" is
// the NVLink bandwidth of one GPU in each direction, "nic_gbps" that of one NIC in each
// direction, in GB/s (10^9 bytes per second); "nic" says whether each host has one NIC (the
// host's NICs bonded: its GPUs share it) or each GPU its own ("gpu"). A placement entry is a
// host name (all its GPUs, in order) or "host:gpu" (one GPU). Without a placement, the
// trainer's ranks fill the GPUs from the first host on, and the engines' workers follow,
// engine by engine.
#ifndef RESHARD_SCHED_TOPOLOGY_H_
#define RESHARD_SCHED_TOPOLOGY_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

enum class NicKind { kPerHost, kPerGpu };

/// The bandwidths a topology may give a link, in GB/s: from 1 MB/s (below that a sync's
/// seconds stop meaning anything) to 10^9 GB/s.
inline constexpr double kMinGbps = 1e-3;
inline constexpr double kMaxGbps = 1e9;

/// A process's place: a GPU of a host.
struct Slot {
  int host = 0;
  int gpu = 0;
  friend bool operator==(const Slot&, const Slot&) = default;
};

/// A placement entry before it is resolved against the processes: the slots it names, with
/// the JSON path of each (for errors).
struct PlacementEntry {
  Slot slot;
  std::string path;
};

/// The topology file as read: hosts, bandwidths, and an optional explicit placement.
struct TopologySpec {
  std::vector<std::string> host_names;
  std::vector<int> host_gpus;
  double nvlink_gbps = 450.0;
  double nic_gbps = 400.0;
  NicKind nic = NicKind::kPerHost;
  std::optional<std::vector<PlacementEntry>> trainer;
  std::optional<std::vector<std::vector<PlacementEntry>>> engines;
  int num_slots() const;
};

/// Parses and validates a topology document. InvalidArgument naming the JSON path: unknown
/// keys, a host named twice, a GPU count or bandwidth that is not positive, a placement that
/// names a host that does not exist, a GPU the host does not have, or a GPU twice; more
/// than 2^24 GPUs in all; a bandwidth outside [kMinGbps, kMaxGbps].
Result<TopologySpec> ParseTopologyJson(std::string_view text);

/// The kinds of link a transfer uses.
enum class LinkKind { kNvlinkOut, kNvlinkIn, kNicOut, kNicIn };

/// The topology with every process placed: process ids are the trainer's ranks
/// 0 .. trainer_ranks-1, then engine 0's workers, engine 1's, and so on.
class Topology {
 public:
  /// Places `trainer_ranks` trainer processes and engines of `engine_workers[e]` workers.
  /// InvalidArgument (naming the path "hosts" or "placement...") when there are more
  /// processes than GPUs, or a placement lists the wrong number of GPUs.
  static Result<Topology> Place(TopologySpec spec, int trainer_ranks,
                                const std::vector<int>& engine_workers);

  const TopologySpec& spec() const { return spec_; }
  int num_processes() const { return static_cast<int>(slots_.size()); }
  int trainer_ranks() const { return trainer_ranks_; }
  int num_engines() const { return static_cast<int>(engine_first_.size()); }
  int engine_workers(int engine) const { return engine_size_[static_cast<size_t>(engine)]; }
  /// The process id of engine `engine`'s worker `worker`.
  int engine_process(int engine, int worker) const {
    return engine_first_[static_cast<size_t>(engine)] + worker;
  }
  const Slot& slot(int process) const { return slots_[static_cast<size_t>(process)]; }
  /// "node3:5".
  std::string SlotName(int process) const;

  /// Links: the NVLink out and in of every GPU a process runs on, and the out and in of every
  /// NIC such a GPU uses (GPUs and NICs no process uses have no link: a topology's size costs
  /// nothing beyond the sync's own processes). Numbered in host and GPU order, NVLink first.
  int num_links() const;
  double LinkBandwidth(int link) const;  // bytes per second
  std::string LinkName(int link) const;  // "node3:5 nvlink out", "node3 nic in"
  /// The two links a transfer from process `from` to process `to` (distinct) uses: NVLink
  /// out and in on one host, NIC out and in across hosts.
  void Route(int from, int to, int* out_link, int* in_link) const;
  /// The NIC links of process `process` (what Route uses towards or from another host).
  int NicOutLink(int process) const;
  int NicInLink(int process) const;
  /// The hosts processes run on, and the index among them of process `process`'s host.
  int num_used_hosts() const { return static_cast<int>(nic_hosts_.size()); }
  int UsedHost(int process) const { return host_of_[static_cast<size_t>(process)]; }

 private:
  void NumberLinks();  // gpus_, gpu_of_, nic_hosts_, nic_of_ from slots_

  TopologySpec spec_;
  std::vector<Slot> slots_;
  std::vector<Slot> gpus_;      // the GPUs processes run on, in host and GPU order
  std::vector<int> gpu_of_;     // per process: its index in gpus_
  std::vector<int> nic_hosts_;  // the hosts processes run on, in order
  std::vector<int> host_of_;    // per process: its host's index in nic_hosts_
  std::vector<int> nic_of_;     // per process: its NIC's index (in nic_hosts_, or in gpus_)
  int trainer_ranks_ = 0;
  std::vector<int> engine_first_;
  std::vector<int> engine_size_;
};

}  // namespace reshard

#endif  // RESHARD_SCHED_TOPOLOGY_H_
