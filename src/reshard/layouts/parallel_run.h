// One description of a run's parallelism (docs/design.md, "One model of a parallel run"): which
// rank is which (its pipeline stage, tensor rank, expert rank, data-parallel rank, ...), how the
// optimizer's state is partitioned, and how the format's files map onto the ranks. Every
// checkpoint reader fills one (OpenedCheckpoint::run); convert takes the target's; `reshard
// inspect` prints it.
//
// A run's ranks are a mixed-radix grid of named axes, the first axis varying fastest:
//   Megatron-Core   tp, cp, dp, pp      (its order "tp-cp-ep-dp-pp" with ep 1 for dense
//                                        tensors); experts: etp, ep, edp, pp
//   DeepSpeed       tp, dp, pp          (PipeModelDataParallelTopology: axes pipe, data, model,
//                                        the last fastest); experts inside dp: ep, edp (EP
//                                        fastest) or edp, ep (use_data_before_expert_parallelism)
//   DCP             rank                (a flat world; the trainer's mesh is not recorded)
//   reshard, vLLM   tp                  (a rank per tensor-parallel rank)
// Expert tensors are numbered by a second grid over the same ranks (same world, same pp).
// Virtual pipeline stages are no axis of ranks: each pipeline rank holds `vpp` model chunks.
// What the format does not record is said so (`unknown`), never guessed.
#ifndef RESHARD_LAYOUTS_PARALLEL_RUN_H_
#define RESHARD_LAYOUTS_PARALLEL_RUN_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// A named axis of a run's ranks.
enum class ParallelDim : uint8_t {
  kTp,    // tensor parallel
  kCp,    // context parallel
  kEp,    // expert parallel
  kEtp,   // expert tensor parallel (Megatron's expert grid)
  kDp,    // data parallel: ZeRO and the distributed optimizer partition over it
  kEdp,   // expert data parallel: the ranks one expert shard is replicated over
  kPp,    // pipeline stage
  kRank,  // a flat world whose decomposition the format does not record
};

/// "tp", "cp", "ep", "etp", "dp", "edp", "pp", "rank".
std::string_view ParallelDimName(ParallelDim dim);
/// The inverse. InvalidArgument naming the name and the known ones.
Result<ParallelDim> ParallelDimOf(std::string_view name);

struct ParallelAxis {
  ParallelDim dim = ParallelDim::kRank;
  int size = 1;
  friend bool operator==(const ParallelAxis&, const ParallelAxis&) = default;
};

/// How ranks are numbered: rank = c0 + s0 * (c1 + s1 * (c2 + ...)) for coordinates c_i of the
/// axes (sizes s_i), the first axis varying fastest.
struct RankGrid {
  std::vector<ParallelAxis> axes;

  /// The product of the sizes (1 for no axes).
  int64_t world() const;
  /// The size of `dim`; 1 when the grid has no such axis.
  int size(ParallelDim dim) const;
  bool has(ParallelDim dim) const;
  /// InvalidArgument for a size below 1, an axis named twice, a world beyond 2^31 - 1.
  Status Validate() const;
  /// The coordinates of `rank`, one per axis. InvalidArgument for a rank outside the world.
  Result<std::vector<int>> CoordinatesOf(int64_t rank) const;
  /// The rank at `coords` (one per axis). InvalidArgument for a wrong count or a coordinate
  /// outside its axis.
  Result<int64_t> RankOf(std::span<const int> coords) const;
  /// `rank`'s coordinate on `dim` (0 when the grid has no such axis).
  Result<int> CoordinateOf(int64_t rank, ParallelDim dim) const;
  friend bool operator==(const RankGrid&, const RankGrid&) = default;
};

/// How the optimizer's state is partitioned over the ranks.
enum class OptimizerSharding : uint8_t {
  kUnknown,      // the format does not say
  kNone,         // no optimizer state in the checkpoint
  kReplicated,   // each rank's state for its parameter shards (ZeRO 0)
  kZero1,        // DeepSpeed ZeRO 1: flat fp32 partitions over dp
  kZero2,        // ZeRO 2 (the same files as ZeRO 1)
  kZero3,        // ZeRO 3: parameters too, flat over dp
  kDistributed,  // Megatron's distributed optimizer: each dp rank a range of the flat buffer
  kAsTensors,    // states are tensors laid out as their parameters (DCP, reshard)
  kWhole,        // whole tensors, one file per parameter and state (universal)
};

/// "unknown", "none", "replicated", "ZeRO 1", ... (text); "unknown", "none", "replicated",
/// "zero1", "zero2", "zero3", "distributed", "as_tensors", "whole" (JSON).
std::string_view OptimizerShardingText(OptimizerSharding s);
std::string_view OptimizerShardingKey(OptimizerSharding s);

/// A run's parallelism.
struct ParallelRun {
  /// The numbering convention: "Megatron tp-cp-ep-dp-pp", "DeepSpeed pipe/data/model grid",
  /// "DCP flat world", ...
  std::string convention;
  /// Every tensor but the experts: the ranks and their axes.
  RankGrid grid;
  /// Expert tensors' numbering of the same ranks (nullopt: the run has no experts, or the
  /// format does not say, then "ep" is in `unknown`).
  std::optional<RankGrid> experts;
  /// Model chunks per pipeline rank (virtual pipeline stages); nullopt: not recorded.
  std::optional<int> vpp = 1;
  OptimizerSharding optimizer = OptimizerSharding::kUnknown;
  /// The axes the format does not record ("tp", "pp", "ep", ...): their sizes are not guessed.
  std::vector<std::string> unknown;
  /// How the format's files map onto coordinates ("mp_rank_{pp*tp+tp:02d}_model_states.pt"...).
  std::string files;

  int64_t world() const { return grid.world(); }
  /// The grids valid, the expert grid over the same world with the same pp, vpp >= 1.
  Status Validate() const;
  /// Validate, and `world` ranks (what the checkpoint's files say): InvalidArgument naming both
  /// counts when the axes do not multiply to it.
  Status ValidateWorld(int64_t world) const;
  friend bool operator==(const ParallelRun&, const ParallelRun&) = default;
};

/// Megatron-Core's grid (parallel_state's RankGenerator, order "tp-cp-ep-dp-pp"): dense
/// tensors over tp, cp, dp, pp; expert tensors over etp, ep, edp, pp with edp = world / (etp ep
/// pp). `world` ranks; dp = world / (tp cp pp); `etp` 0: tp (Megatron's default). No expert
/// grid when ep is 1 and etp is tp. InvalidArgument when a product does not divide the world.
Result<ParallelRun> MegatronRun(int64_t world, int tp, int pp, int cp = 1, int ep = 1, int etp = 0,
                                int vpp = 1);

/// DeepSpeed's grid (PipeModelDataParallelTopology, axes pipe, data, model; model fastest):
/// tp, dp, pp. With `ep` > 1 the experts over tp, ep, edp, pp (edp = dp / ep; DP rank d is EP
/// rank d mod ep), or tp, edp, ep, pp when `data_before_expert`.
Result<ParallelRun> DeepSpeedRun(int pp, int tp, int dp, OptimizerSharding optimizer, int ep = 1,
                                 bool data_before_expert = false);

/// A flat world of `world` ranks on axis `dim` (kRank: its decomposition not recorded).
ParallelRun FlatRun(int64_t world, ParallelDim dim, std::string convention);

/// "pp 2 × tp 2 × dp 2 (DeepSpeed pipe/data/model grid), ZeRO 1; experts ep 2 × edp 1; ..."
/// (axes slowest first, as people write them).
std::string ParallelRunText(const ParallelRun& run);
/// {"convention", "world", "axes": [{"name", "size"}] (fastest first), "experts": [...] | null,
///  "vpp": n | null, "optimizer", "unknown": [...], "files"}, as JSON text.
std::string ParallelRunJson(const ParallelRun& run);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_PARALLEL_RUN_H_
