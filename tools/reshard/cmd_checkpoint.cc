// reshard scatter / gather / convert: the checkpoint commands (logic in
// checkpoint/checkpoint_ops.h).
#include <fmt/format.h>

#include <chrono>

#include "commands.h"
#include "documents.h"
#include "exit_status.h"
#include "progress.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/hf/model_maps.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/descriptor.h"

namespace reshard::cli {

namespace {

struct CommonArgs {
  std::string input;
  std::string output;
  bool force = false;
  std::string max_shard_size;
  bool allow_scaled_optimizer_state = false;
  bool allow_lossy_scale = false;
  bool no_verify_replicas = false;
};

// The flags every checkpoint command takes about scaled values.
void AddScaleFlags(CLI::App* cmd, CommonArgs& args) {
  cmd->add_flag("--allow-scaled-optimizer-state", args.allow_scaled_optimizer_state,
                "move optimizer states through scaled pieces anyway");
  cmd->add_flag("--allow-lossy-scale", args.allow_lossy_scale,
                "apply scales even where a value does not survive the round trip bit for bit "
                "(underflow, overflow, or a factor that is not a power of two)");
}

// Exit status of a failed operation: malformed inputs are 2, failed checks 1, environment 3.
int Fail(std::string_view command, const Status& s) {
  const Stage stage =
      s.code() == StatusCode::kFailedPrecondition ? Stage::kChecking : Stage::kReading;
  return Report(command, s, ExitStatusFor(s, stage));
}

Result<CheckpointOptions> Options(const CommonArgs& args, ProgressBar& bar) {
  CheckpointOptions o;
  o.overwrite = args.force;
  o.allow_scaled_optimizer_state = args.allow_scaled_optimizer_state;
  o.allow_lossy_scale = args.allow_lossy_scale;
  o.verify_replicas = !args.no_verify_replicas;
  o.progress = bar.Callback();
  o.warn = [](const std::string& parameter, const std::string& message) {
    fmt::print(stderr, "reshard: warning: parameter \"{}\": {}\n", parameter, message);
  };
  if (!args.max_shard_size.empty()) {
    RESHARD_ASSIGN_OR_RETURN(o.max_shard_bytes, ParseByteSize(args.max_shard_size));
  }
  return o;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void RegisterCheckpointCommands(CLI::App& app, int& exit_status) {
  {
    struct Args : CommonArgs {
      std::string maps;
      std::string layouts;
      std::string config;
      int tp = 0;
    };
    auto args = std::make_shared<Args>();
    CLI::App* cmd = app.add_subcommand(
        "scatter",
        "Split a full checkpoint (model.safetensors, or an index and parts) into a sharded one: "
        "reshard.json plus model-rank-{r}-part-{p}.safetensors per rank, by map documents or "
        "layout descriptors. Tensors named <param>.exp_avg / <param>.exp_avg_sq take <param>'s "
        "map with scale power -1 / -2.");
    cmd->add_option("FULL_DIR", args->input, "full checkpoint directory")->required();
    auto maps =
        cmd->add_option("--maps", args->maps, "map document: the map of every tensor, by name");
    auto layouts =
        cmd->add_option("--layouts", args->layouts,
                        "layouts file: {\"version\": 1, \"<name>\" or \"*\": <layout descriptor>}");
    auto config = cmd->add_option(
        "--config", args->config,
        "config.json: maps from the model's tensor-parallel plan (as reshard degree --emit-maps)");
    maps->excludes(layouts);
    maps->excludes(config);
    layouts->excludes(config);
    cmd->add_option("--tp", args->tp, "world size (with --layouts or --config)")
        ->check(CLI::Range(1, 1 << 20));
    cmd->add_option("-o,--output", args->output, "output directory (appears atomically)")
        ->required();
    cmd->add_option("--max-shard-size", args->max_shard_size,
                    "split each rank's file into parts of at most this size (e.g. 5GB)");
    cmd->add_flag("--force", args->force, "replace an existing output directory");
    AddScaleFlags(cmd, *args);
    cmd->callback([args, &exit_status] {
      ProgressBar bar("scatter");
      Result<CheckpointOptions> options = Options(*args, bar);
      if (!options.ok()) {
        exit_status = Fail("scatter", options.status());
        return;
      }
      MapProvider provider;
      int world = args->tp;
      if (!args->maps.empty()) {
        Result<MapDocument> doc = ReadMapDocument(args->maps);
        if (!doc.ok()) {
          exit_status = Fail("scatter", doc.status());
          return;
        }
        if (doc->params.empty()) {
          exit_status =
              Report("scatter", InvalidArgumentError("the map document is empty"), kExitUsage);
          return;
        }
        world = doc->params.front().second.world_size();
        provider = MapsFromDocument(*doc);
      } else if (!args->layouts.empty()) {
        if (world < 1) {
          exit_status =
              Report("scatter", InvalidArgumentError("--layouts needs --tp N"), kExitUsage);
          return;
        }
        Result<LayoutsDocument> layouts_doc = ReadLayoutsDocument(args->layouts);
        if (!layouts_doc.ok()) {
          exit_status = Fail("scatter", layouts_doc.status());
          return;
        }
        provider = MapsFromLayouts(std::move(layouts_doc->layouts), world);
      } else if (!args->config.empty()) {
        if (world < 1) {
          exit_status =
              Report("scatter", InvalidArgumentError("--config needs --tp N"), kExitUsage);
          return;
        }
        Result<std::string> text = ReadFileToString(args->config);
        if (!text.ok()) {
          exit_status = Fail("scatter", text.status());
          return;
        }
        Result<ConfigMaps> from_config =
            ConfigMaps::FromConfigJson(BuiltinTpRegistry(), *text, world);
        if (!from_config.ok()) {
          exit_status =
              Finish("scatter", from_config.status().Annotate(fmt::format("\"{}\"", args->config)));
          return;
        }
        options->degree_constraints = DegreeConstraints(from_config->plan());
        provider = [maps = std::make_shared<ConfigMaps>(*std::move(from_config))](
                       const std::string& name, const Shape& shape) -> Result<ProvidedMap> {
          RESHARD_ASSIGN_OR_RETURN(TensorMap m, maps->Map(name, shape));
          return ProvidedMap{std::move(m.map), std::move(m.layout)};
        };
      } else {
        exit_status = Report("scatter",
                             InvalidArgumentError("give --maps MAPS.json, --layouts LAYOUTS.json "
                                                  "--tp N, or --config config.json --tp N"),
                             kExitUsage);
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      Status s = Scatter(args->input, world, provider, args->output, *options);
      if (!s.ok()) {
        exit_status = Fail("scatter", WithForceHint(s, args->force));
        return;
      }
      fmt::print("scattered \"{}\" to {} ranks in \"{}\" ({:.2f} s)\n", args->input, world,
                 args->output, Seconds(t0));
    });
  }
  {
    using Args = CommonArgs;
    auto args = std::make_shared<Args>();
    CLI::App* cmd = app.add_subcommand(
        "gather",
        "Rebuild a full checkpoint from a sharded one, checking that replicas agree (exit 1 "
        "naming the ranks and element where they differ) and dropping padding.");
    cmd->add_option("SHARDED_DIR", args->input, "sharded checkpoint directory")->required();
    cmd->add_option("-o,--output", args->output, "output directory (appears atomically)")
        ->required();
    cmd->add_option("--max-shard-size", args->max_shard_size,
                    "write parts of at most this size and an index (e.g. 5GB)");
    cmd->add_flag("--force", args->force, "replace an existing output directory");
    cmd->add_flag("--no-verify-replicas", args->no_verify_replicas,
                  "take replicated data from the lowest rank without comparing");
    AddScaleFlags(cmd, *args);
    cmd->callback([args, &exit_status] {
      ProgressBar bar("gather");
      Result<CheckpointOptions> options = Options(*args, bar);
      if (!options.ok()) {
        exit_status = Fail("gather", options.status());
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      Status s = Gather(args->input, args->output, *options);
      if (!s.ok()) {
        exit_status = Fail("gather", WithForceHint(s, args->force));
        return;
      }
      fmt::print("gathered \"{}\" into \"{}\" ({:.2f} s)\n", args->input, args->output,
                 Seconds(t0));
    });
  }
  {
    struct Args : CommonArgs {
      int tp = 0;
      std::string target_maps;
    };
    auto args = std::make_shared<Args>();
    CLI::App* cmd = app.add_subcommand(
        "convert",
        "Re-shard a sharded checkpoint to another world size through transfer plans, without "
        "building any full tensor. Target maps come from --target-maps or from the layout "
        "descriptors in the manifest.");
    cmd->add_option("SHARDED_DIR", args->input, "sharded checkpoint directory")->required();
    cmd->add_option("--tp", args->tp, "target world size")
        ->required()
        ->check(CLI::Range(1, 1 << 20));
    cmd->add_option("--target-maps", args->target_maps, "map document of the target layout");
    cmd->add_option("-o,--output", args->output, "output directory (appears atomically)")
        ->required();
    cmd->add_option("--max-shard-size", args->max_shard_size,
                    "split each rank's file into parts of at most this size");
    cmd->add_flag("--force", args->force, "replace an existing output directory");
    cmd->add_flag("--no-verify-replicas", args->no_verify_replicas,
                  "read each replicated block from one holder without comparing the others");
    AddScaleFlags(cmd, *args);
    cmd->callback([args, &exit_status] {
      ProgressBar bar("convert");
      Result<CheckpointOptions> options = Options(*args, bar);
      if (!options.ok()) {
        exit_status = Fail("convert", options.status());
        return;
      }
      std::optional<MapDocument> target;
      if (!args->target_maps.empty()) {
        Result<MapDocument> doc = ReadMapDocument(args->target_maps);
        if (!doc.ok()) {
          exit_status = Fail("convert", doc.status());
          return;
        }
        target = *std::move(doc);
      }
      const auto t0 = std::chrono::steady_clock::now();
      Status s = Convert(args->input, args->tp, target, args->output, *options);
      if (!s.ok()) {
        exit_status = Fail("convert", WithForceHint(s, args->force));
        return;
      }
      fmt::print("converted \"{}\" to {} ranks in \"{}\" ({:.2f} s)\n", args->input, args->tp,
                 args->output, Seconds(t0));
    });
  }
}

}  // namespace reshard::cli
