// reshard scatter / gather / convert: the checkpoint commands (logic in
// checkpoint/checkpoint_ops.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "documents.h"
#include "exit_status.h"
#include "processes.h"
#include "progress.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/deepspeed/pipeline_writer.h"
#include "reshard/checkpoint/formats/formats.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/exec/dequantize.h"
#include "reshard/hf/checkpoint_maps.h"
#include "reshard/hf/model_maps.h"
#include "reshard/hf/quantization.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/descriptor.h"

namespace reshard::cli {

namespace {

struct CommonArgs {
  std::string input;
  std::string output;
  bool force = false;
  bool no_sync = false;
  std::string max_shard_size;
  bool allow_scaled_optimizer_state = false;
  bool allow_lossy_scale = false;
  bool no_verify_replicas = false;
  bool json = false;
  bool progress = false;
  double peer_timeout = 600;
  bool dequantize = false;  // --dequantize [--dtype]
  std::string dtype = "bf16";
  mutable CheckpointStats stats;  // filled by the run
};

struct GatherArgs : CommonArgs {
  bool fp32 = false;
  bool optimizer_state = false;
  std::string config;
  std::string names;  // an Orbax input's: "maxtext"
};

// --dequantize [--dtype bf16|fp16|fp32] as options.
Result<std::optional<DequantizeOptions>> DequantizeOf(bool on, const std::string& dtype) {
  if (!on) return std::optional<DequantizeOptions>();
  const std::optional<DType> d = DequantizedDTypeFromName(dtype);
  if (!d)
    return InvalidArgumentError(fmt::format("--dtype {}: expected bf16, fp16 or fp32", dtype));
  return std::optional<DequantizeOptions>(DequantizeOptions{*d, {}});
}

// The flags every checkpoint command takes about scaled values.
void AddScaleFlags(CLI::App* cmd, CommonArgs& args) {
  cmd->add_flag("--allow-scaled-optimizer-state", args.allow_scaled_optimizer_state,
                "move optimizer states through scaled pieces anyway");
  cmd->add_flag("--allow-lossy-scale", args.allow_lossy_scale,
                "apply scales even where a value does not survive the round trip bit for bit "
                "(underflow, overflow, or a factor that is not a power of two)");
}

// What a checkpoint command was asked, for the processes of a job to compare before any work:
// the command, the input's and the output's absolute paths, the input's files, and every
// option that changes what is written (`extra`: the command's own).
RunDescription Describe(std::string_view command, const CommonArgs& args, RunDescription extra) {
  RunDescription d = {{"the command", std::string(command)}};
  DescribeInput("the input", args.input, d);
  std::error_code ec;
  const std::filesystem::path out = std::filesystem::absolute(args.output, ec).lexically_normal();
  d.emplace_back("-o", ec ? args.output : out.string());
  auto flag = [](bool on) { return std::string(on ? "on" : "off"); };
  d.emplace_back("--force", flag(args.force));
  d.emplace_back("--no-sync", flag(args.no_sync));
  d.emplace_back("--max-shard-size", args.max_shard_size);
  d.emplace_back("--allow-scaled-optimizer-state", flag(args.allow_scaled_optimizer_state));
  d.emplace_back("--allow-lossy-scale", flag(args.allow_lossy_scale));
  d.emplace_back("--no-verify-replicas", flag(args.no_verify_replicas));
  d.insert(d.end(), extra.begin(), extra.end());
  return d;
}

// A map, layouts or config file given as an option: its identity, when given.
RunDescription OptionalInput(const std::string& option, const std::string& path) {
  RunDescription d;
  if (path.empty()) {
    d.emplace_back(option, "");
  } else {
    DescribeInput(option, path, d);
  }
  return d;
}

// --distributed-config: JSON text as given, or the identity of the file holding it.
RunDescription DistributedConfigInput(const std::string& value) {
  std::error_code ec;
  if (!value.empty() && std::filesystem::is_regular_file(value, ec))
    return OptionalInput("--distributed-config", value);
  return {{"--distributed-config", value}};
}

template <typename... Parts>
RunDescription Joined(Parts... parts) {
  RunDescription d;
  (d.insert(d.end(), parts.begin(), parts.end()), ...);
  return d;
}

// The options of a run; under mpirun, once every process has been given the same run.
Result<CheckpointOptions> Options(const CommonArgs& args, ProgressBar& bar,
                                  const RunDescription& run) {
  CheckpointOptions o;
  RESHARD_ASSIGN_OR_RETURN(o.communicator, Processes(args.peer_timeout));
  RESHARD_RETURN_IF_ERROR(AgreeOnRun(*o.communicator, run));
  o.stats = &args.stats;
  o.overwrite = args.force;
  o.sync = !args.no_sync;
  // RESHARD_COPY_FILE_RANGE=0: every byte through memory (to compare, or where a file system's
  // copy_file_range misbehaves); the output is the same.
  const char* copy = std::getenv("RESHARD_COPY_FILE_RANGE");
  o.copy_file_ranges = copy == nullptr || std::string_view(copy) != "0";
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

// The output may not be, contain or lie inside anything the command was given to read: the
// whole directory named (a DeepSpeed save dir, not only the tag dir read through its `latest`)
// and the map, layout and config files. Checked before any work, on every process alike.
Status CheckOutputOutsideInputs(const CommonArgs& args, std::vector<std::string> inputs) {
  inputs.push_back(args.input);
  std::erase(inputs, std::string());
  return CheckOutputAgainstInputs(args.output, inputs);
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string Gigabytes(uint64_t bytes) {
  return fmt::format("{:.3f} GB", static_cast<double>(bytes) / 1e9);
}

// Prints what a checkpoint command did (process 0 only): `line`, then, from several processes,
// a line per process; with --json one document instead: the output, the time and every
// process's files and bytes.
void Report(const CommonArgs& args, const std::string& line, double seconds) {
  if (!PrintsResults()) return;
  const std::vector<ProcessStats>& processes = args.stats.processes;
  if (!args.json) {
    fmt::print("{}\n", line);
    for (size_t p = 0; processes.size() > 1 && p < processes.size(); ++p) {
      const ProcessStats& s = processes[p];
      fmt::print("  process {}: wrote {} files ({}), read {} (+{} comparing replicas)\n", s.rank,
                 s.files.size(), Gigabytes(s.bytes_written), Gigabytes(s.bytes_read),
                 Gigabytes(s.bytes_verified));
    }
    return;
  }
  nlohmann::ordered_json doc = {{"output", args.output}, {"seconds", seconds}};
  doc["processes"] = nlohmann::ordered_json::array();
  for (const ProcessStats& s : processes) {
    doc["processes"].push_back({{"rank", s.rank},
                                {"files", s.files},
                                {"bytes_written", s.bytes_written},
                                {"bytes_read", s.bytes_read},
                                {"bytes_verified", s.bytes_verified},
                                {"bytes_copied", s.bytes_copied}});
  }
  fmt::print("{}\n", doc.dump(2));
}

struct ScatterArgs : CommonArgs {
  std::string maps;
  std::string layouts;
  std::string config;
  std::string distributed_config;
  int tp = 0;
};

struct ConvertArgs : CommonArgs {
  int tp = 0;
  std::string distributed_config;
  std::string to;  // "universal", "dcp" or "orbax": that format instead of a sharded dir
  int world = 0;   // --to dcp: the world size it is saved for
  int pp = 0;      // a DeepSpeed pipeline checkpoint of that many stages
  std::string pp_stages_text;  // --pp-stages as given: read into pp_stages by RunConvert
  std::vector<int> pp_stages;
  int dp = 0;
  std::string target_maps;
  bool weights_only = false;
  std::string config;
  std::vector<std::string> drop;  // --to universal: tensors left out, by name
  std::string mesh;               // --to orbax: "fsdp=2,tensor=4"
  std::string partition_specs;    // --to orbax: a JSON file of name patterns -> specs
  std::string orbax_storage;      // --to orbax: "zarr3" (default), "zarr2", "plain"
  std::string names;              // the Orbax side's (input, or --to orbax): "maxtext"
};

// The maps scatter uses, their world size and the buffers they fill, from --maps, --layouts
// or --config.
struct ScatterMapsOf {
  MapProvider maps;
  int world = 0;
  BufferSetBuilder buffers;
};

// --distributed-config (JSON text, or a file holding it) as plan options.
Result<PlanOptions> PlanOptionsOf(const std::string& distributed_config) {
  PlanOptions options;
  if (distributed_config.empty()) return options;  // not given (NotEmptyJson refuses "")
  RESHARD_ASSIGN_OR_RETURN(const std::string text,
                           JsonTextOrFile("--distributed-config", distributed_config));
  Result<DistributedConfig> parsed = ParseDistributedConfigJson(BuiltinTpRegistry(), text);
  if (!parsed.ok()) return parsed.status().Annotate("--distributed-config");
  options.distributed = *std::move(parsed);
  return options;
}

// The maps of scatter --config: every tensor laid out as transformers holds it at `world`
// processes under the distributed config; records the plan's constraints and the config in
// `options` for the manifest.
Result<ScatterMapsOf> MapsFromConfig(const ScatterArgs& args, int world,
                                     CheckpointOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(args.config));
  RESHARD_ASSIGN_OR_RETURN(PlanOptions plan_options, PlanOptionsOf(args.distributed_config));
  RESHARD_RETURN_IF_ERROR(CheckLaidOutDistributedConfig(plan_options.distributed, world)
                              .Annotate(fmt::format("--distributed-config with --tp {}", world)));
  Result<ConfigScatter> planned = ConfigScatterMaps(args.input, text, world, plan_options);
  if (!planned.ok() && planned.status().code() != StatusCode::kNotFound) {
    return planned.status().Annotate(fmt::format("\"{}\"", args.config));
  }
  RESHARD_RETURN_IF_ERROR(planned.status());
  options.degree_constraints = std::move(planned->constraints);
  options.model_config = std::move(planned->model_config);
  options.block_scales = std::move(planned->block_scales);
  return ScatterMapsOf{std::move(planned->maps), world, std::move(planned->buffers)};
}

// --maps, or --layouts / --config with --tp.
Status CheckScatterMapArgs(const ScatterArgs& args) {
  if (!args.maps.empty()) return Status::Ok();
  if (args.layouts.empty() && args.config.empty()) {
    return InvalidArgumentError(
        "give --maps MAPS.json, --layouts LAYOUTS.json --tp N, or --config config.json --tp N");
  }
  if (args.tp < 1) {
    return InvalidArgumentError(
        fmt::format("{} needs --tp N", args.layouts.empty() ? "--config" : "--layouts"));
  }
  return Status::Ok();
}

Result<ScatterMapsOf> ScatterMaps(const ScatterArgs& args, CheckpointOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckScatterMapArgs(args));
  if (!args.maps.empty()) {
    RESHARD_ASSIGN_OR_RETURN(MapDocument doc, ReadMapDocument(args.maps));
    if (doc.params.empty()) return InvalidArgumentError("the map document is empty");
    const int world = doc.params.front().second.world_size();
    if (IsPeftAdapterDir(args.input)) {  // the maps are the base model's
      Result<MapDocument> adapter = AdapterMapsFromDocument(args.input, doc);
      if (!adapter.ok()) return adapter.status().Annotate(fmt::format("--maps \"{}\"", args.maps));
      return ScatterMapsOf{MapsFromDocument(*adapter), world, BufferSetBuilder(adapter->buffers)};
    }
    MapProvider provider = MapsFromDocument(doc);
    RESHARD_ASSIGN_OR_RETURN(options.block_scales, FollowBlockScales(args.input, provider));
    return ScatterMapsOf{std::move(provider), world, BufferSetBuilder(doc.buffers)};
  }
  if (!args.layouts.empty()) {
    RESHARD_ASSIGN_OR_RETURN(LayoutsDocument doc, ReadLayoutsDocument(args.layouts));
    MapProvider provider = MapsFromLayouts(std::move(doc.layouts), args.tp);
    RESHARD_ASSIGN_OR_RETURN(options.block_scales, FollowBlockScales(args.input, provider));
    return ScatterMapsOf{std::move(provider), args.tp, {}};
  }
  return MapsFromConfig(args, args.tp, options);
}

// scatter --dequantize: the dequantized tensors laid out by --maps (which name them), --layouts
// or --config (the model's plan without its quantization_config).
ScatterLayoutOf DequantizedLayout(const ScatterArgs& args) {
  return [&args](const std::vector<StoredTensor>& tensors,
                 const std::string&) -> Result<ScatterLayout> {
    if (!args.maps.empty()) {
      RESHARD_ASSIGN_OR_RETURN(MapDocument doc, ReadMapDocument(args.maps));
      return ScatterLayout{MapsFromDocument(doc), BufferSetBuilder(doc.buffers), {}, {}};
    }
    if (!args.layouts.empty()) {
      RESHARD_ASSIGN_OR_RETURN(LayoutsDocument doc, ReadLayoutsDocument(args.layouts));
      return ScatterLayout{MapsFromLayouts(std::move(doc.layouts), args.tp), {}, {}, {}};
    }
    RESHARD_ASSIGN_OR_RETURN(const std::string quantized, ReadFileToString(args.config));
    Result<std::string> text = WithoutQuantizationConfig(quantized);
    if (!text.ok()) return text.status().Annotate(fmt::format("\"{}\"", args.config));
    RESHARD_ASSIGN_OR_RETURN(PlanOptions plan, PlanOptionsOf(args.distributed_config));
    Result<ConfigScatter> laid = ConfigScatterMaps(tensors, *text, args.tp, plan);
    if (!laid.ok()) return laid.status().Annotate(fmt::format("\"{}\"", args.config));
    return ScatterLayout{std::move(laid->maps), std::move(laid->buffers),
                         std::move(laid->model_config), std::move(laid->constraints)};
  };
}

Status RunScatter(const ScatterArgs& args) {
  ProgressBar bar("scatter", args.progress);
  RESHARD_ASSIGN_OR_RETURN(
      CheckpointOptions options,
      Options(
          args, bar,
          Describe(
              "scatter", args,
              Joined(OptionalInput("--maps", args.maps), OptionalInput("--layouts", args.layouts),
                     OptionalInput("--config", args.config),
                     DistributedConfigInput(args.distributed_config),
                     RunDescription{{"--tp", std::to_string(args.tp)},
                                    {"--dequantize", args.dequantize ? args.dtype : "off"}}))));
  RESHARD_RETURN_IF_ERROR(CheckOutputOutsideInputs(args, {args.maps, args.layouts, args.config}));
  RESHARD_ASSIGN_OR_RETURN(options.dequantize, DequantizeOf(args.dequantize, args.dtype));
  const auto t0 = std::chrono::steady_clock::now();
  int world = args.tp;  // of --maps: the document's
  if (options.dequantize) {
    RESHARD_RETURN_IF_ERROR(CheckScatterMapArgs(args));
    RESHARD_RETURN_IF_ERROR(WithForceHint(
        ScatterDequantized(args.input, DequantizedLayout(args), args.output, options), args.force));
  } else {
    RESHARD_ASSIGN_OR_RETURN(auto maps, ScatterMaps(args, options));
    world = maps.world;
    RESHARD_RETURN_IF_ERROR(WithForceHint(
        Scatter(args.input, maps.world, maps.maps, maps.buffers, args.output, options),
        args.force));
  }
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("scattered \"{}\"{} in \"{}\" ({:.2f} s)", args.input,
                     world > 0 ? fmt::format(" to {} ranks", world) : "", args.output, seconds),
         seconds);
  return Status::Ok();
}

Status RunGather(const GatherArgs& args) {
  ProgressBar bar("gather", args.progress);
  RESHARD_ASSIGN_OR_RETURN(
      CheckpointOptions options,
      Options(
          args, bar,
          Describe("gather", args,
                   Joined(RunDescription{{"--fp32", args.fp32 ? "on" : "off"},
                                         {"--optimizer-state", args.optimizer_state ? "on" : "off"},
                                         {"--dequantize", args.dequantize ? args.dtype : "off"},
                                         {"--names", args.names}},
                          OptionalInput("--config", args.config)))));
  RESHARD_RETURN_IF_ERROR(CheckOutputOutsideInputs(args, {args.config}));
  RESHARD_ASSIGN_OR_RETURN(options.dequantize, DequantizeOf(args.dequantize, args.dtype));
  const auto t0 = std::chrono::steady_clock::now();
  SourceOptions source;
  source.use = SourceUse::kGather;
  source.master_weights = args.fp32;
  source.optimizer_state = args.optimizer_state;
  source.config_path = args.config;
  source.names = args.names;
  RESHARD_RETURN_IF_ERROR(
      WithForceHint(GatherCheckpoint(args.input, source, args.output, options), args.force));
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("gathered \"{}\" into \"{}\" ({:.2f} s)", args.input, args.output, seconds),
         seconds);
  return Status::Ok();
}

// convert --to universal: a DeepSpeed, DCP, Megatron-Core or Orbax checkpoint into the universal
// checkpoint DeepSpeed resumes from at any TP x DP.
Status RunConvertToUniversal(const ConvertArgs& args, const CheckpointOptions& options) {
  if (args.tp != 0 || args.world != 0 || !args.target_maps.empty() || args.weights_only ||
      !args.max_shard_size.empty()) {
    return InvalidArgumentError(
        "--to universal takes no --tp, --world, --target-maps, --weights-only or --max-shard-size: "
        "the "
        "universal checkpoint holds full tensors of every optimizer state");
  }
  if (!args.names.empty()) {
    return InvalidArgumentError(
        "--names applies to a gather, --tp, --to dcp and --to orbax: a universal checkpoint "
        "needs optimizer state, which MaxText's names do not map");
  }
  // Before DCP: a Megatron-Core checkpoint is a DCP checkpoint with a metadata.json.
  const bool megatron = IsMegatronCheckpoint(args.input);
  const bool dcp = !megatron && IsDcpCheckpoint(args.input);
  const bool orbax = !megatron && !dcp && IsOrbaxCheckpoint(args.input);
  if (!IsDeepSpeedCheckpoint(args.input) && !dcp && !megatron && !orbax) {
    return InvalidArgumentError(
        "--to universal converts a DeepSpeed checkpoint, a PyTorch Distributed Checkpoint, a "
        "Megatron-Core dist-ckpt or an Orbax checkpoint with Adam's moments; \"" +
        args.input + "\" is not one");
  }
  if (megatron && args.config.empty()) {
    return InvalidArgumentError(
        "\"" + args.input +
        "\" is a Megatron-Core checkpoint, which does not record its model's shapes or Hugging "
        "Face names: give the model's config.json with --config");
  }
  if (!megatron && !args.config.empty()) {
    return InvalidArgumentError(
        "--config applies to --to universal from a Megatron-Core checkpoint");
  }
  if (megatron && !args.drop.empty()) {
    return InvalidArgumentError(
        "--drop applies to --to universal from a PyTorch Distributed Checkpoint, a DeepSpeed "
        "checkpoint or an Orbax checkpoint");
  }
  const auto t0 = std::chrono::steady_clock::now();
  RESHARD_RETURN_IF_ERROR(WithForceHint(
      megatron ? ConvertMegatronToUniversal(args.input, args.config, args.output, options)
      : dcp    ? ConvertDcpToUniversal(args.input, args.output, options)
      : orbax  ? ConvertOrbaxToUniversal(args.input, args.output, options)
               : ConvertDeepSpeedToUniversal(args.input, args.output, options),
      args.force));
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("converted \"{}\" to a universal checkpoint in \"{}\" ({:.2f} s)", args.input,
                     args.output, seconds),
         seconds);
  return Status::Ok();
}

// convert --to dcp: any checkpoint into a PyTorch Distributed Checkpoint saved for --world
// ranks (FSDP2's dim-0 chunks), which torch.distributed.checkpoint loads at any world size.
Status RunConvertToDcp(const ConvertArgs& args, const CheckpointOptions& options) {
  if (!args.target_maps.empty() || !args.max_shard_size.empty() ||
      !args.distributed_config.empty()) {
    return InvalidArgumentError(
        "--to dcp takes no --target-maps, --distributed-config or --max-shard-size: a DCP "
        "checkpoint holds each tensor in dim-0 chunks, one file per rank");
  }
  if (args.world < 1)
    return InvalidArgumentError("--to dcp needs --world N (the ranks it is saved for)");
  const auto t0 = std::chrono::steady_clock::now();
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = args.weights_only;
  source.config_path = args.config;
  source.names = args.names;
  RESHARD_RETURN_IF_ERROR(WithForceHint(
      WriteDcpCheckpoint(args.input, source, DcpTargetRun(args.world), args.output, options),
      args.force));
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("converted \"{}\" to a DCP checkpoint for {} ranks in \"{}\" ({:.2f} s)",
                     args.input, args.world, args.output, seconds),
         seconds);
  return Status::Ok();
}

// convert --to orbax: any checkpoint into an Orbax checkpoint item on --mesh, which
// orbax.checkpoint restores into jax arrays on that mesh.
Status RunConvertToOrbax(const ConvertArgs& args, const CheckpointOptions& options) {
  if (args.world != 0 || !args.target_maps.empty() || !args.max_shard_size.empty() ||
      !args.distributed_config.empty()) {
    return InvalidArgumentError(
        "--to orbax takes no --world, --target-maps, --distributed-config or --max-shard-size: "
        "the mesh and the partition specs say how each array is split");
  }
  if (args.mesh.empty()) {
    return InvalidArgumentError("--to orbax needs --mesh (e.g. --mesh fsdp=2,tensor=4)");
  }
  std::string specs;
  if (!args.partition_specs.empty()) {
    RESHARD_ASSIGN_OR_RETURN(specs, ReadFileToString(args.partition_specs));
  }
  Result<OrbaxTarget> target = ParseOrbaxTarget(args.mesh, specs);
  if (!target.ok()) {
    return target.status().Annotate(
        args.partition_specs.empty() ? "--mesh" : "--mesh / \"" + args.partition_specs + "\"");
  }
  target->names = args.names;
  if (!args.orbax_storage.empty()) {
    RESHARD_ASSIGN_OR_RETURN(target->storage, ParseOrbaxStorage(args.orbax_storage));
  }
  const auto t0 = std::chrono::steady_clock::now();
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = args.weights_only;
  source.config_path = args.config;
  RESHARD_RETURN_IF_ERROR(WithForceHint(
      WriteOrbaxCheckpoint(args.input, source, *target, args.output, options), args.force));
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("converted \"{}\" to an Orbax checkpoint on mesh {} in \"{}\" ({:.2f} s)",
                     args.input, args.mesh, args.output, seconds),
         seconds);
  return Status::Ok();
}

// convert --pp: a DeepSpeed PipelineModule checkpoint into one at other PP x TP x DP degrees,
// which DeepSpeed's load_checkpoint reads as its own.
Status RunConvertToPipeline(const ConvertArgs& args, const CheckpointOptions& options) {
  if (!args.to.empty() || args.world != 0 || !args.target_maps.empty() || args.weights_only ||
      !args.max_shard_size.empty() || !args.distributed_config.empty() || !args.config.empty() ||
      args.dequantize) {
    return InvalidArgumentError(
        "--pp takes only --tp, --dp and --pp-stages: it writes a DeepSpeed pipeline checkpoint "
        "with its optimizer state (in the source's dtypes: no --dequantize)");
  }
  if (!IsDeepSpeedCheckpoint(args.input)) {
    return InvalidArgumentError(
        "--pp writes a DeepSpeed pipeline checkpoint from a DeepSpeed PipelineModule "
        "checkpoint; \"" +
        args.input + "\" is not a DeepSpeed checkpoint");
  }
  DeepSpeedPipelineTarget target;
  target.pp = args.pp;
  target.tp = args.tp;
  target.dp = args.dp == 0 ? 1 : args.dp;
  target.stage_layers = args.pp_stages;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = ConvertDeepSpeedToPipeline(args.input, target, args.output, options);
  if (s.message().starts_with("the stage list")) s = s.Annotate("--pp-stages");
  RESHARD_RETURN_IF_ERROR(WithForceHint(s, args.force));
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("converted \"{}\" to a DeepSpeed pipeline checkpoint of {} stages x DP {} in "
                     "\"{}\" ({:.2f} s)",
                     args.input, args.pp, target.dp, args.output, seconds),
         seconds);
  return Status::Ok();
}

// --pp-stages: layer counts, comma-separated, each 1..2^20 (an empty one, as a trailing
// comma leaves, is refused rather than skipped).
Result<std::vector<int>> PpStagesOf(const std::string& text) {
  std::vector<int> stages;
  if (text.empty()) return stages;
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string part = text.substr(begin, end - begin);
    const bool digits = !part.empty() && part.size() <= 7 &&
                        part.find_first_not_of("0123456789") == std::string::npos;
    const int value = digits ? std::stoi(part) : 0;
    if (value < 1 || value > (1 << 20)) {
      return InvalidArgumentError(fmt::format(
          "--pp-stages {}: \"{}\" is not a layer count from 1 to {} (give each stage's layer "
          "count, comma-separated, e.g. 2,1,1,2)",
          text, part, 1 << 20));
    }
    stages.push_back(value);
    if (end == text.size()) return stages;
    begin = end + 1;
  }
}

Status RunConvert(const ConvertArgs& given) {
  ConvertArgs args = given;
  RESHARD_ASSIGN_OR_RETURN(args.pp_stages, PpStagesOf(given.pp_stages_text));
  ProgressBar bar("convert", args.progress);
  RESHARD_ASSIGN_OR_RETURN(
      CheckpointOptions options,
      Options(
          args, bar,
          Describe("convert", args,
                   Joined(RunDescription{{"--tp", std::to_string(args.tp)},
                                         {"--to", args.to},
                                         {"--world", std::to_string(args.world)},
                                         {"--pp", std::to_string(args.pp)},
                                         {"--pp-stages",
                                          fmt::format("{}", fmt::join(args.pp_stages, ","))},
                                         {"--dp", std::to_string(args.dp)},
                                         {"--drop", fmt::format("{}", fmt::join(args.drop, ","))}},
                          DistributedConfigInput(args.distributed_config),
                          OptionalInput("--target-maps", args.target_maps),
                          OptionalInput("--config", args.config),
                          OptionalInput("--partition-specs", args.partition_specs),
                          RunDescription{{"--weights-only", args.weights_only ? "on" : "off"},
                                         {"--dequantize", args.dequantize ? args.dtype : "off"},
                                         {"--mesh", args.mesh},
                                         {"--names", args.names}}))));
  RESHARD_RETURN_IF_ERROR(
      CheckOutputOutsideInputs(args, {args.target_maps, args.config, args.partition_specs}));
  RESHARD_ASSIGN_OR_RETURN(options.dequantize, DequantizeOf(args.dequantize, args.dtype));
  if (options.dequantize && !args.to.empty()) {
    return InvalidArgumentError("--dequantize converts to a reshard sharded checkpoint, not --to " +
                                args.to);
  }
  if (!args.drop.empty() && args.to != "universal") {
    return InvalidArgumentError(
        "--drop applies to --to universal (which cannot hold every tensor of a checkpoint)");
  }
  options.drop = args.drop;
  if (args.pp != 0) return RunConvertToPipeline(args, options);
  if (!args.names.empty() && args.pp != 0) {
    return InvalidArgumentError("--names applies to an Orbax input or --to orbax");
  }
  if (!args.pp_stages.empty() || args.dp != 0)
    return InvalidArgumentError("--pp-stages and --dp apply to --pp (a DeepSpeed pipeline output)");
  if (args.to == "dcp") return RunConvertToDcp(args, options);
  if (args.to == "orbax") return RunConvertToOrbax(args, options);
  if (!args.mesh.empty() || !args.partition_specs.empty() || !args.orbax_storage.empty()) {
    return InvalidArgumentError(
        "--mesh, --partition-specs and --orbax-storage apply to --to orbax");
  }
  if (!args.to.empty()) return RunConvertToUniversal(args, options);
  if (args.world != 0) return InvalidArgumentError("--world applies to --to dcp; give --tp N");
  if (args.tp < 1)
    return InvalidArgumentError("give --tp N (or --to universal, or --to dcp --world N)");
  std::optional<MapDocument> target;
  if (!args.target_maps.empty()) {
    RESHARD_ASSIGN_OR_RETURN(target, ReadMapDocument(args.target_maps));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string distributed_config;
  if (!args.distributed_config.empty()) {
    RESHARD_ASSIGN_OR_RETURN(distributed_config,
                             JsonTextOrFile("--distributed-config", args.distributed_config));
  }
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = args.weights_only;
  source.config_path = args.config;
  source.distributed_config = distributed_config;
  source.names = args.names;
  Status s = WithForceHint(ConvertCheckpoint(args.input, source, ShardedTargetRun(args.tp), target,
                                             args.output, options),
                           args.force);
  if (s.message().ends_with("without target maps")) {
    return Status(s.code(), s.message() +
                                "; give them with --target-maps MAPS.json (or put the model's "
                                "config.json in a DeepSpeed save dir; a universal checkpoint "
                                "also takes --config config.json)");
  }
  if (s.code() == StatusCode::kUnimplemented &&
      s.message().find("universal") != std::string::npos) {
    return Status(s.code(), s.message() + " (--to universal)");
  }
  RESHARD_RETURN_IF_ERROR(s);
  const double seconds = Seconds(t0);
  Report(args,
         fmt::format("converted \"{}\" to {} ranks in \"{}\" ({:.2f} s)", args.input, args.tp,
                     args.output, seconds),
         seconds);
  return Status::Ok();
}

// The input, -o and --force, --max-shard-size, and the scale flags.
void AddCommonOptions(CLI::App* cmd, CommonArgs& args, const std::string& input,
                      const std::string& input_help, const std::string& max_shard_help) {
  cmd->add_option(input, args.input, input_help)->required();
  cmd->add_option("-o,--output", args.output, "output directory (appears atomically)")->required();
  cmd->add_option("--max-shard-size", args.max_shard_size, max_shard_help);
  cmd->add_flag("--force", args.force,
                "replace an existing output directory (only an empty one or one reshard wrote)");
  cmd->add_flag("--no-sync", args.no_sync,
                "do not wait for the output to reach the disk: it still appears by one rename, "
                "but a crash of the machine soon after may leave it incomplete");
  AddScaleFlags(cmd, args);
  AddJsonFlag(cmd, args.json, "what was written and read, by every process");
  cmd->add_flag("--progress", args.progress,
                "draw the progress bar even when stderr is not a terminal (under mpirun: "
                "process 0 draws the whole job's)");
  cmd->add_option("--peer-timeout", args.peer_timeout,
                  "under mpirun: seconds a process waits for the others at one exchange before "
                  "ending the whole job (default 600)")
      ->check(CLI::Range(1.0, 1e7));
}

// --dequantize [--dtype bf16|fp16|fp32].
void AddDequantizeFlags(CLI::App* cmd, CommonArgs& args, const std::string& more_help) {
  auto dequantize = cmd->add_flag(
      "--dequantize", args.dequantize,
      "write block-quantized tensors (FP8, MXFP4, NVFP4) as numbers, without their scales, and "
      "config.json without quantization_config (docs/quantization.md)" +
          more_help);
  cmd->add_option("--dtype", args.dtype, "with --dequantize: bf16 (default), fp16 or fp32")
      ->needs(dequantize);
}

void AddScatterOptions(CLI::App* cmd, ScatterArgs* args) {
  AddCommonOptions(cmd, *args, "FULL_DIR", "full checkpoint directory",
                   "split each rank's file into parts of at most this size (e.g. 5GB)");
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
      ->check(IntegerIn(1, 1 << 20));
  cmd->add_option("--distributed-config", args->distributed_config,
                  "with --config: transformers' DistributedConfig as JSON text or a file, e.g. "
                  "'{\"tp_plan\": \"auto\", \"ep_size\": 2}' for expert parallelism")
      ->needs(config)
      ->check(NotEmptyJson());
  AddDequantizeFlags(cmd, *args, "; --maps and --layouts then name the dequantized tensors");
}

void AddGatherOptions(CLI::App* cmd, GatherArgs* args) {
  AddCommonOptions(cmd, *args, "SHARDED_DIR",
                   "checkpoint directory: reshard sharded, DeepSpeed (or its universal "
                   "checkpoint), PyTorch DCP, Megatron torch_dist, Orbax (docs/formats.md)",
                   "write parts of at most this size and an index (e.g. 5GB)");
  cmd->add_flag("--fp32", args->fp32,
                "DeepSpeed or universal input: write the optimizer's fp32 master weights "
                "instead of the module's");
  cmd->add_flag("--optimizer-state", args->optimizer_state,
                "DCP input: write the optimizer's state too, by its keys (optim.state.<fqn>...); "
                "Megatron input: the distributed optimizer's, as <name>.fp32, .exp_avg, "
                ".exp_avg_sq; Orbax input: the optimizer's leaves (opt_state...), by their names");
  cmd->add_option("--config", args->config,
                  "a model's config.json, for a checkpoint that needs one to name and split its "
                  "tensors (Megatron; Orbax with --names maxtext)");
  cmd->add_option("--names", args->names,
                  "maxtext: read an Orbax checkpoint's arrays as MaxText's model (with --config) "
                  "and write the Hugging Face tensors they hold (docs/jax.md)")
      ->check(CLI::IsMember({"maxtext"}));
  cmd->add_flag("--no-verify-replicas", args->no_verify_replicas,
                "take replicated data from the lowest rank without comparing");
  AddDequantizeFlags(cmd, *args, "; takes a Hugging Face directory too");
}

void AddConvertOptions(CLI::App* cmd, ConvertArgs* args) {
  AddCommonOptions(cmd, *args, "SHARDED_DIR",
                   "checkpoint directory: reshard sharded, DeepSpeed, PyTorch DCP, Megatron "
                   "torch_dist, Orbax, Hugging Face (docs/formats.md)",
                   "split each rank's file into parts of at most this size");
  cmd->add_flag("--weights-only", args->weights_only,
                "DeepSpeed, DCP, Megatron or Orbax input: the model's weights only, no optimizer "
                "state");
  auto tp = cmd->add_option("--tp", args->tp, "target world size")->check(IntegerIn(1, 1 << 20));
  cmd->add_option("--to", args->to,
                  "universal: write the DeepSpeed universal checkpoint of a DeepSpeed checkpoint "
                  "(what ds_to_universal writes; OUT/latest_universal names its folder), or the "
                  "per-parameter files of one from a DCP checkpoint with Adam's state, a "
                  "Megatron-Core checkpoint with its distributed optimizer's or an Orbax "
                  "checkpoint with optax's Adam moments; dcp: a "
                  "PyTorch Distributed Checkpoint saved for --world ranks (from a DCP checkpoint: "
                  "its keys and non-tensor values kept); orbax: an Orbax checkpoint item on "
                  "--mesh (docs/jax.md)")
      ->check(CLI::IsMember({"universal", "dcp", "orbax"}))
      ->excludes(tp);
  auto pp = cmd->add_option("--pp", args->pp,
                            "DeepSpeed PipelineModule input: write a DeepSpeed pipeline checkpoint "
                            "of this many stages (with --tp, --dp, --pp-stages), which "
                            "load_checkpoint resumes from (docs/deepspeed_checkpoints.md)")
                ->check(IntegerIn(1, 1 << 16));
  cmd->add_option("--pp-stages", args->pp_stages_text,
                  "with --pp: the layers of each stage, comma-separated (e.g. 2,1,1,2; default: "
                  "DeepSpeed's uniform partition)");
  cmd->add_option("--dp", args->dp,
                  "with --pp: the data-parallel ranks of each stage, over which the ZeRO "
                  "optimizer state is partitioned (default 1; at most 65536)")
      ->check(IntegerIn(1, 1 << 16));
  pp->excludes("--to");
  cmd->add_option("--mesh", args->mesh,
                  "with --to orbax: the device mesh, axis=size pairs (e.g. fsdp=2,tensor=4; "
                  "devices 0..N-1 row-major)");
  cmd->add_option("--partition-specs", args->partition_specs,
                  "with --to orbax: a JSON file of array name patterns (* any characters) -> "
                  "partition specs ([null, \"tensor\"], ...), the first match wins; default: "
                  "replicated");
  cmd->add_option("--orbax-storage", args->orbax_storage,
                  "with --to orbax: how the arrays are stored: zarr3 (default: an OCDBT database "
                  "of zarr v3 arrays), zarr2 (OCDBT + zarr v2, Orbax's default) or plain (a zarr "
                  "v2 directory per array)")
      ->check(CLI::IsMember({"zarr3", "zarr2", "plain"}));
  cmd->add_option("--names", args->names,
                  "maxtext: the Orbax side holds MaxText's model: an Orbax input read as the "
                  "Hugging Face tensors it holds (with --config), or with --to orbax a Hugging "
                  "Face model (its config.json) written as MaxText's tree (docs/jax.md)")
      ->check(CLI::IsMember({"maxtext"}));
  cmd->add_option("--world", args->world,
                  "with --to dcp: the ranks it is saved for (a file each; dim-0 chunks as FSDP2 "
                  "shards); torch loads it at any world size")
      ->check(IntegerIn(1, 1 << 20));
  auto target =
      cmd->add_option("--target-maps", args->target_maps, "map document of the target layout");
  cmd->add_option("--distributed-config", args->distributed_config,
                  "a checkpoint scattered with --config: transformers' DistributedConfig of the "
                  "target (JSON text or a file), e.g. '{\"tp_plan\": \"auto\", \"ep_size\": 4}'")
      ->excludes(target)
      ->check(NotEmptyJson());
  cmd->add_option("--config", args->config,
                  "a model's config.json, for a checkpoint that needs one to name and split its "
                  "tensors (Megatron) or to lay them out (a universal checkpoint without "
                  "universal_checkpoint_info)");
  cmd->add_flag("--no-verify-replicas", args->no_verify_replicas,
                "read each replicated block from one holder without comparing the others");
  cmd->add_option("--drop", args->drop,
                  "with --to universal: leave out this tensor of the input (repeatable), one the "
                  "universal checkpoint cannot hold (a buffer, an integer array; optimizer state "
                  "other than Adam's), "
                  "which is refused otherwise")
      ->allow_extra_args(false);
  AddDequantizeFlags(cmd, *args,
                     "; --target-maps then name the dequantized tensors; a checkpoint scattered "
                     "with --config is laid out from that config without quantization_config");
}

}  // namespace

CommandBody ScatterCommand() { return {AddScatterOptions, RunScatter}; }
CommandBody GatherCommand() { return {AddGatherOptions, RunGather}; }
CommandBody ConvertCommand() { return {AddConvertOptions, RunConvert}; }

}  // namespace reshard::cli
