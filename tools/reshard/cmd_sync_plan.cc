// reshard sync-plan (--config CONFIG --trainer tp=..,pp=..,ep=.. --engines N --engine-tp T |
//                    --source MAPS.json --target MAPS.json...) --topology TOPO.json
//                   [--dtype D] [--json [--transfers]]
#include <fmt/format.h>

#include <string>
#include <vector>

#include "commands.h"
#include "documents.h"
#include "exit_status.h"
#include "reshard/base/dtype.h"
#include "reshard/io/file.h"
#include "reshard/sched/sync_plan.h"

namespace reshard::cli {

namespace {

struct SyncPlanArgs {
  std::string config;
  std::string trainer;
  int engines = 0;
  std::vector<int> engine_tp;
  std::string source;
  std::vector<std::string> targets;
  std::string topology;
  std::string dtype = "BF16";
  bool json = false;
  bool transfers = false;
};

std::string Gb(Index bytes) { return fmt::format("{:.2f} GB", static_cast<double>(bytes) / 1e9); }

void PrintText(const SyncPlanResult& r) {
  const SyncPrediction& p = r.prediction;
  const Topology& t = r.topology;
  fmt::print("trainer: {} ranks; engines: {} ({} workers); {} hosts; {} tensors\n",
             t.trainer_ranks(), t.num_engines(), t.num_processes() - t.trainer_ranks(),
             t.spec().host_names.size(), r.schedule.tensors.size());
  fmt::print("one copy: {}; out of the trainer: {}; over all links: {}\n", Gb(p.one_copy_bytes),
             Gb(p.trainer_egress_bytes), Gb(p.total_bytes));
  fmt::print("{} transfers in {} rounds\n", p.num_transfers, p.rounds);
  if (p.busiest_link >= 0) {
    fmt::print("busiest link: {} ({}, {:.0f} GB/s)\n", t.LinkName(p.busiest_link),
               Gb(p.link_bytes[static_cast<size_t>(p.busiest_link)]),
               t.LinkBandwidth(p.busiest_link) / 1e9);
  }
  fmt::print("lower bound: {:.3f} s; predicted: {:.3f} s ({:.2f}x); planned in {:.2f} s\n",
             p.lower_bound_s, p.predicted_s,
             p.lower_bound_s > 0 ? p.predicted_s / p.lower_bound_s : 1.0, r.planning_s);
}

Status RunSyncPlan(const SyncPlanArgs& args) {
  if (args.transfers && !args.json) {
    return InvalidArgumentError("--transfers lists the transfers in the --json report; add --json");
  }
  const std::optional<DType> dtype = DTypeFromName(args.dtype);
  if (!dtype) return InvalidArgumentError(fmt::format("--dtype: unknown dtype \"{}\"", args.dtype));
  RESHARD_ASSIGN_OR_RETURN(std::string topo_text, ReadFileToString(args.topology));
  Result<TopologySpec> topo = ParseTopologyJson(topo_text);
  if (!topo.ok()) return topo.status().Annotate(fmt::format("topology \"{}\"", args.topology));
  Result<SyncPlanResult> result = InvalidArgumentError("");
  if (!args.config.empty()) {
    if (!args.source.empty() || !args.targets.empty()) {
      return InvalidArgumentError("--config lays out both sides: it takes no --source or --target");
    }
    if (args.trainer.empty() || args.engine_tp.empty()) {
      return InvalidArgumentError("--config needs --trainer and --engine-tp");
    }
    std::vector<int> tps = args.engine_tp;
    if (args.engines > 0 && tps.size() == 1) tps.assign(static_cast<size_t>(args.engines), tps[0]);
    if (args.engines > 0 && tps.size() != static_cast<size_t>(args.engines)) {
      return InvalidArgumentError(
          fmt::format("--engine-tp gives {} degrees for --engines {}: give one, or one per engine",
                      tps.size(), args.engines));
    }
    SyncFormat format = SyncFormat::kBf16;
    if (*dtype == DType::kF8E4M3) {
      format = SyncFormat::kFp8;
    } else if (*dtype != DType::kBF16) {
      return InvalidArgumentError("--dtype with --config is BF16 or F8_E4M3 (block-quantized)");
    }
    Result<GridLayout> grid = ParseGridLayout(args.trainer);
    if (!grid.ok()) return grid.status().Annotate("--trainer");
    RESHARD_ASSIGN_OR_RETURN(std::string config, ReadFileToString(args.config));
    result = PlanSyncFromConfig(config, *grid, tps, format, *std::move(topo));
  } else {
    if (args.source.empty() || args.targets.empty()) {
      return InvalidArgumentError("give --config, or --source and one --target per engine");
    }
    if (args.engines > 0 || !args.engine_tp.empty() || !args.trainer.empty()) {
      return InvalidArgumentError("--trainer, --engines and --engine-tp go with --config");
    }
    RESHARD_ASSIGN_OR_RETURN(MapDocument source, ReadMapDocument(args.source));
    std::vector<MapDocument> targets;
    for (const std::string& path : args.targets) {
      RESHARD_ASSIGN_OR_RETURN(MapDocument doc, ReadMapDocument(path));
      targets.push_back(std::move(doc));
    }
    std::vector<const MapDocument*> engines;
    for (const MapDocument& d : targets) engines.push_back(&d);
    result =
        PlanSyncFromMaps(source, engines, static_cast<Index>(DTypeSize(*dtype)), *std::move(topo));
  }
  if (!result.ok()) {
    const Status& s = result.status();
    if (s.code() == StatusCode::kInvalidArgument && s.message().starts_with("hosts")) {
      return s.Annotate(fmt::format("topology \"{}\"", args.topology));
    }
    return s.code() == StatusCode::kFailedPrecondition ? CheckFailed(s) : s;
  }
  if (args.json) {
    fmt::print("{}\n", result->Json(args.transfers));
  } else {
    PrintText(*result);
  }
  return Status::Ok();
}

void AddSyncPlanOptions(CLI::App* cmd, SyncPlanArgs* args) {
  cmd->add_option("--config", args->config, "the model's config.json: lay out both sides from it");
  cmd->add_option("--trainer", args->trainer,
                  "with --config: the trainer's grid, e.g. tp=8,pp=8,ep=8 (Megatron's rank order)");
  cmd->add_option("--engines", args->engines, "with --config: the number of engines")
      ->check(IntegerIn(1, 1 << 16));
  cmd->add_option("--engine-tp", args->engine_tp,
                  "with --config: each engine's tensor-parallel degree (one for all, or one per "
                  "engine, comma-separated)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--source", args->source, "map document of the trainer's ranks");
  cmd->add_option("--target", args->targets,
                  "map document of one engine's workers (repeat per engine)");
  cmd->add_option("--topology", args->topology,
                  "topology JSON: hosts, GPUs, NVLink and NIC bandwidths, placement")
      ->required();
  cmd->add_option("--dtype", args->dtype,
                  "element type on the wire: BF16 (default); with --config F8_E4M3 for "
                  "block-quantized FP8 with its scales; with maps any dtype's size");
  AddJsonFlag(cmd, args->json, "print the report as JSON");
  cmd->add_flag("--transfers", args->transfers,
                "with --json: list every transfer (round, from, to, bytes, tensor, step, move)");
}

}  // namespace

CommandBody SyncPlanCommand() { return {AddSyncPlanOptions, RunSyncPlan}; }

}  // namespace reshard::cli
