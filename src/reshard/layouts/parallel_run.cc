#include "reshard/layouts/parallel_run.h"

#include <fmt/format.h>

#include <array>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

namespace reshard {

namespace {

constexpr std::array<std::pair<ParallelDim, std::string_view>, 8> kDimNames = {{
    {ParallelDim::kTp, "tp"},
    {ParallelDim::kCp, "cp"},
    {ParallelDim::kEp, "ep"},
    {ParallelDim::kEtp, "etp"},
    {ParallelDim::kDp, "dp"},
    {ParallelDim::kEdp, "edp"},
    {ParallelDim::kPp, "pp"},
    {ParallelDim::kRank, "rank"},
}};

// "pp 2 × tp 2 × dp 2": the axes slowest first.
std::string AxesText(const RankGrid& grid) {
  if (grid.axes.empty()) return "1 rank";
  std::string out;
  for (auto it = grid.axes.rbegin(); it != grid.axes.rend(); ++it) {
    if (!out.empty()) out += " × ";
    out += fmt::format("{} {}", ParallelDimName(it->dim), it->size);
  }
  return out;
}

nlohmann::ordered_json AxesJson(const RankGrid& grid) {
  nlohmann::ordered_json axes = nlohmann::ordered_json::array();
  for (const ParallelAxis& a : grid.axes)
    axes.push_back({{"name", ParallelDimName(a.dim)}, {"size", a.size}});
  return axes;
}

Status CheckDivides(int64_t part, int64_t world, std::string_view what) {
  if (part < 1 || world % part != 0) {
    return InvalidArgumentError(
        fmt::format("{} ({}) does not divide the world's {} ranks", what, part, world));
  }
  return Status::Ok();
}

}  // namespace

std::string_view ParallelDimName(ParallelDim dim) {
  for (const auto& [d, name] : kDimNames) {
    if (d == dim) return name;
  }
  return "?";
}

Result<ParallelDim> ParallelDimOf(std::string_view name) {
  for (const auto& [d, n] : kDimNames) {
    if (n == name) return d;
  }
  return InvalidArgumentError(
      fmt::format("\"{}\" is no parallel axis (tp, cp, ep, etp, dp, edp, pp or rank)", name));
}

int64_t RankGrid::world() const {
  int64_t w = 1;
  for (const ParallelAxis& a : axes) w *= a.size;
  return w;
}

int RankGrid::size(ParallelDim dim) const {
  for (const ParallelAxis& a : axes) {
    if (a.dim == dim) return a.size;
  }
  return 1;
}

bool RankGrid::has(ParallelDim dim) const {
  for (const ParallelAxis& a : axes) {
    if (a.dim == dim) return true;
  }
  return false;
}

Status RankGrid::Validate() const {
  int64_t w = 1;
  for (size_t i = 0; i < axes.size(); ++i) {
    const ParallelAxis& a = axes[i];
    if (a.size < 1) {
      return InvalidArgumentError(
          fmt::format("axis {} has size {}: sizes are at least 1", ParallelDimName(a.dim), a.size));
    }
    for (size_t j = 0; j < i; ++j) {
      if (axes[j].dim == a.dim) {
        return InvalidArgumentError(
            fmt::format("axis {} is named twice in {}", ParallelDimName(a.dim), AxesText(*this)));
      }
    }
    w *= a.size;
    if (w > std::numeric_limits<int32_t>::max()) {
      return InvalidArgumentError(
          fmt::format("the axes {} make more than 2^31 - 1 ranks", AxesText(*this)));
    }
  }
  return Status::Ok();
}

Result<std::vector<int>> RankGrid::CoordinatesOf(int64_t rank) const {
  const int64_t w = world();
  if (rank < 0 || rank >= w) {
    return InvalidArgumentError(
        fmt::format("rank {} is outside the {} ranks of {}", rank, w, AxesText(*this)));
  }
  std::vector<int> coords;
  coords.reserve(axes.size());
  for (const ParallelAxis& a : axes) {
    coords.push_back(static_cast<int>(rank % a.size));
    rank /= a.size;
  }
  return coords;
}

Result<int64_t> RankGrid::RankOf(std::span<const int> coords) const {
  if (coords.size() != axes.size()) {
    return InvalidArgumentError(fmt::format("{} coordinates for the {} axes of {}", coords.size(),
                                            axes.size(), AxesText(*this)));
  }
  int64_t rank = 0;
  for (size_t i = axes.size(); i-- > 0;) {
    if (coords[i] < 0 || coords[i] >= axes[i].size) {
      return InvalidArgumentError(fmt::format("coordinate {} is outside axis {} of size {}",
                                              coords[i], ParallelDimName(axes[i].dim),
                                              axes[i].size));
    }
    rank = rank * axes[i].size + coords[i];
  }
  return rank;
}

Result<int> RankGrid::CoordinateOf(int64_t rank, ParallelDim dim) const {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<int> coords, CoordinatesOf(rank));
  for (size_t i = 0; i < axes.size(); ++i) {
    if (axes[i].dim == dim) return coords[i];
  }
  return 0;
}

std::string_view OptimizerShardingText(OptimizerSharding s) {
  switch (s) {
    case OptimizerSharding::kUnknown:
      return "optimizer sharding unknown";
    case OptimizerSharding::kNone:
      return "no optimizer state";
    case OptimizerSharding::kReplicated:
      return "ZeRO 0 (optimizer state per parameter shard)";
    case OptimizerSharding::kZero1:
      return "ZeRO 1";
    case OptimizerSharding::kZero2:
      return "ZeRO 2";
    case OptimizerSharding::kZero3:
      return "ZeRO 3";
    case OptimizerSharding::kDistributed:
      return "distributed optimizer over dp";
    case OptimizerSharding::kAsTensors:
      return "optimizer state laid out as its parameters";
    case OptimizerSharding::kWhole:
      return "whole tensors";
  }
  return "?";
}

std::string_view OptimizerShardingKey(OptimizerSharding s) {
  switch (s) {
    case OptimizerSharding::kUnknown:
      return "unknown";
    case OptimizerSharding::kNone:
      return "none";
    case OptimizerSharding::kReplicated:
      return "replicated";
    case OptimizerSharding::kZero1:
      return "zero1";
    case OptimizerSharding::kZero2:
      return "zero2";
    case OptimizerSharding::kZero3:
      return "zero3";
    case OptimizerSharding::kDistributed:
      return "distributed";
    case OptimizerSharding::kAsTensors:
      return "as_tensors";
    case OptimizerSharding::kWhole:
      return "whole";
  }
  return "?";
}

Status ParallelRun::Validate() const {
  RESHARD_RETURN_IF_ERROR(grid.Validate());
  if (vpp && *vpp < 1) {
    return InvalidArgumentError(fmt::format("{} virtual pipeline stages per pipeline rank", *vpp));
  }
  if (!experts) return Status::Ok();
  if (Status s = experts->Validate(); !s.ok()) return s.Annotate("the expert grid");
  if (experts->world() != grid.world()) {
    return InvalidArgumentError(
        fmt::format("the expert grid {} makes {} ranks, the grid {} makes {}", AxesText(*experts),
                    experts->world(), AxesText(grid), grid.world()));
  }
  if (experts->size(ParallelDim::kPp) != grid.size(ParallelDim::kPp)) {
    return InvalidArgumentError(fmt::format(
        "the expert grid {} has {} pipeline stages, the grid {} has {}", AxesText(*experts),
        experts->size(ParallelDim::kPp), AxesText(grid), grid.size(ParallelDim::kPp)));
  }
  return Status::Ok();
}

Status ParallelRun::ValidateWorld(int64_t world_size) const {
  RESHARD_RETURN_IF_ERROR(Validate());
  if (grid.world() != world_size) {
    return InvalidArgumentError(fmt::format("the axes {} make {} ranks, but there are {}",
                                            AxesText(grid), grid.world(), world_size));
  }
  return Status::Ok();
}

Result<ParallelRun> MegatronRun(int64_t world, int tp, int pp, int cp, int ep, int etp, int vpp) {
  if (world < 1) return InvalidArgumentError(fmt::format("{} is not a world size", world));
  if (etp == 0) etp = tp;
  RESHARD_RETURN_IF_ERROR(CheckDivides(int64_t{tp} * cp * pp, world, "tp × cp × pp"));
  RESHARD_RETURN_IF_ERROR(CheckDivides(int64_t{etp} * ep * pp, world, "etp × ep × pp"));
  ParallelRun run;
  run.convention = "Megatron tp-cp-ep-dp-pp";
  const auto dp = static_cast<int>(world / (int64_t{tp} * cp * pp));
  run.grid.axes = {{ParallelDim::kTp, tp},
                   {ParallelDim::kCp, cp},
                   {ParallelDim::kDp, dp},
                   {ParallelDim::kPp, pp}};
  if (ep > 1 || etp != tp) {
    const auto edp = static_cast<int>(world / (int64_t{etp} * ep * pp));
    run.experts = RankGrid{{{ParallelDim::kEtp, etp},
                            {ParallelDim::kEp, ep},
                            {ParallelDim::kEdp, edp},
                            {ParallelDim::kPp, pp}}};
  }
  run.vpp = vpp;
  RESHARD_RETURN_IF_ERROR(run.Validate());
  return run;
}

Result<ParallelRun> DeepSpeedRun(int pp, int tp, int dp, OptimizerSharding optimizer, int ep,
                                 bool data_before_expert) {
  ParallelRun run;
  run.convention = pp > 1 ? "DeepSpeed pipe/data/model grid" : "DeepSpeed data/model grid";
  run.grid.axes = {{ParallelDim::kTp, tp}, {ParallelDim::kDp, dp}, {ParallelDim::kPp, pp}};
  run.optimizer = optimizer;
  if (ep > 1) {
    RESHARD_RETURN_IF_ERROR(CheckDivides(ep, dp, "the expert-parallel size"));
    const ParallelAxis e{ParallelDim::kEp, ep};
    const ParallelAxis d{ParallelDim::kEdp, dp / ep};
    run.experts = RankGrid{{{ParallelDim::kTp, tp},
                            data_before_expert ? d : e,
                            data_before_expert ? e : d,
                            {ParallelDim::kPp, pp}}};
  }
  RESHARD_RETURN_IF_ERROR(run.Validate());
  return run;
}

ParallelRun FlatRun(int64_t world, ParallelDim dim, std::string convention) {
  ParallelRun run;
  run.convention = std::move(convention);
  run.grid.axes = {{dim, static_cast<int>(world)}};
  return run;
}

std::string ParallelRunText(const ParallelRun& run) {
  std::string out = AxesText(run.grid);
  if (!run.convention.empty()) out += fmt::format(" ({})", run.convention);
  if (run.experts) out += fmt::format("; experts {}", AxesText(*run.experts));
  if (!run.vpp) {
    out += "; virtual pipeline stages unknown";
  } else if (*run.vpp > 1) {
    out += fmt::format("; vpp {}", *run.vpp);
  }
  out += fmt::format(", {}", OptimizerShardingText(run.optimizer));
  if (!run.unknown.empty()) {
    std::string names;
    for (const std::string& u : run.unknown) names += (names.empty() ? "" : ", ") + u;
    out += fmt::format("; not recorded: {}", names);
  }
  return out;
}

std::string ParallelRunJson(const ParallelRun& run) {
  nlohmann::ordered_json doc = {
      {"convention", run.convention}, {"world", run.world()}, {"axes", AxesJson(run.grid)}};
  doc["experts"] = run.experts ? AxesJson(*run.experts) : nlohmann::ordered_json(nullptr);
  doc["vpp"] = run.vpp ? nlohmann::ordered_json(*run.vpp) : nlohmann::ordered_json(nullptr);
  doc["optimizer"] = OptimizerShardingKey(run.optimizer);
  doc["unknown"] = run.unknown;
  doc["files"] = run.files;
  doc["text"] = ParallelRunText(run);
  return doc.dump();
}

}  // namespace reshard
