#include "reshard/checkpoint/formats/formats.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/communicator.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/dcp/dcp_writer.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/orbax/maxtext.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/parallel_runs.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/hf/checkpoint_maps.h"
#include "reshard/hf/model_config.h"
#include "reshard/hf/quantization.h"
#include "reshard/hf/registry.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_file.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

bool HasFile(const std::string& dir, const char* name) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / name, ec);
}

Result<PlanOptions> PlanOptionsOf(const SourceOptions& options) {
  PlanOptions plan;
  if (options.distributed_config.empty()) return plan;
  Result<DistributedConfig> parsed =
      ParseDistributedConfigJson(BuiltinTpRegistry(), options.distributed_config);
  if (!parsed.ok()) return parsed.status().Annotate("the distributed config");
  plan.distributed = *std::move(parsed);
  return plan;
}

// What every format but the DeepSpeed one refuses.
Status RefuseDeepSpeedOptions(const std::string& path, const SourceOptions& options,
                              std::string_view what) {
  if (options.master_weights) {
    return InvalidArgumentError(fmt::format(
        "the fp32 master weights come from a DeepSpeed checkpoint's optimizer; \"{}\" is not a "
        "DeepSpeed checkpoint ({})",
        path, what));
  }
  if (options.weights_only) {
    return InvalidArgumentError(fmt::format(
        "leaving the optimizer state out applies to a DeepSpeed checkpoint; \"{}\" is not one "
        "({})",
        path, what));
  }
  return Status::Ok();
}

// A gather that also writes the optimizer's state: formats whose optimizer state has keys of
// its own (DCP) take it.
Status RefuseOptimizerState(const std::string& path, const SourceOptions& options,
                            std::string_view what) {
  if (options.optimizer_state) {
    return InvalidArgumentError(fmt::format(
        "a gather with the optimizer's state applies to a PyTorch Distributed Checkpoint or a "
        "Megatron-Core checkpoint; \"{}\" "
        "is {}: convert it (optimizer state included) to a sharded checkpoint at 1 rank and gather "
        "that",
        path, what));
  }
  return Status::Ok();
}

Status RefuseConfig(const std::string& path, const SourceOptions& options, std::string_view what) {
  if (!options.config_path.empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is {}, which names and lays out its tensors itself: it takes no config.json", path,
        what));
  }
  return Status::Ok();
}

Status RefuseDistributedConfig(const std::string& path, const SourceOptions& options,
                               std::string_view what) {
  if (!options.distributed_config.empty()) {
    return InvalidArgumentError(fmt::format(
        "a distributed config applies to a checkpoint scattered from a model's config.json (its "
        "manifest keeps it); \"{}\" is {}: give the target layout as maps instead",
        path, what));
  }
  return Status::Ok();
}

// ---- block-quantized checkpoints --------------------------------------------------------

std::string DescribeTie(const BlockScales& tie) {
  return fmt::format("the {} of \"{}\" (format {}, block {})",
                     tie.dequantizes ? "block scales" : "per-tensor scale", tie.data, tie.format,
                     FormatShape(tie.block));
}

// Under a config.json whose quantization_config reshard reads, the checkpoint's tensors tie as
// the config says (TieQuantizedTensors: every quantized tensor with its scales), and a sharded
// checkpoint's manifest (`recorded`) records exactly those ties, so that no command moves,
// gathers or dequantizes quantized data apart from its scales. A quantization_config reshard
// does not read is left to the commands that need it (scatter --config, --dequantize).
Status CheckQuantizedTies(const std::string& where, std::string_view config, const Manifest& m,
                          const std::map<std::string, BlockScales>* recorded) {
  if (config.empty()) return Status::Ok();
  Result<std::optional<QuantScheme>> scheme = ReadQuantScheme(config);
  if (!scheme.ok() || !*scheme) return Status::Ok();
  std::vector<QuantTensor> tensors;
  for (const ShardedParam& p : m.params) tensors.push_back({p.name, p.dtype, p.map.valid_shape()});
  Result<std::vector<QuantTie>> ties = TieQuantizedTensors(**scheme, tensors);
  if (!ties.ok()) return ties.status().Annotate(where);
  if (recorded == nullptr) return Status::Ok();
  std::map<std::string, BlockScales> derived;
  for (const QuantTie& t : *ties) {
    derived.emplace(t.scale, BlockScales{t.data, t.block, std::string(QuantFormatName(t.format)),
                                         t.dequantizes});
  }
  for (const auto& [scale, tie] : derived) {
    auto it = recorded->find(scale);
    if (it == recorded->end()) {
      return FailedPreconditionError(fmt::format(
          "{}: params[\"{}\"] records no block_scales, but the model's quantization_config ({}) "
          "makes it {}",
          where, scale, (*scheme)->method, DescribeTie(tie)));
    }
    if (it->second != tie) {
      return FailedPreconditionError(fmt::format(
          "{}: params[\"{}\"].block_scales records {}{}, but the model's quantization_config "
          "({}) makes it {}",
          where, scale, DescribeTie(it->second),
          it->second.dequantizes ? "" : " (\"dequantizes\": false)", (*scheme)->method,
          DescribeTie(tie)));
    }
  }
  for (const auto& [scale, tie] : *recorded) {
    if (!derived.contains(scale)) {
      return FailedPreconditionError(fmt::format(
          "{}: params[\"{}\"].block_scales records {}, which the model's quantization_config ({}) "
          "does not",
          where, scale, DescribeTie(tie), (*scheme)->method));
    }
  }
  return Status::Ok();
}

// ---- reshard sharded checkpoints --------------------------------------------------------

bool DetectSharded(const std::string& path) { return HasFile(path, kManifestName); }

Status CheckSharded(const std::string& path, const SourceOptions& options) {
  RESHARD_RETURN_IF_ERROR(RefuseDeepSpeedOptions(path, options, "a reshard sharded checkpoint"));
  if (options.optimizer_state) {
    return InvalidArgumentError(fmt::format(
        "a gather of a reshard sharded checkpoint writes every tensor it holds, optimizer state "
        "included; \"{}\" needs no more",
        path));
  }
  return RefuseConfig(path, options, "a reshard sharded checkpoint");
}

Result<OpenedCheckpoint> OpenSharded(const std::string& path, const SourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(ShardedCheckpoint opened, ShardedCheckpoint::Open(path));
  OpenedCheckpoint out;
  out.format = "reshard";
  out.source =
      SourceOfShardedDir(path, std::make_shared<const ShardedCheckpoint>(std::move(opened)));
  out.run = ShardedRunOf(out.source->manifest());
  // The model's config: the one the manifest keeps, else the config.json beside it.
  const Manifest& m = out.source->manifest();
  std::string config = m.model_config;
  if (config.empty() && HasFile(path, "config.json")) {
    RESHARD_ASSIGN_OR_RETURN(config, ReadFileToString((fs::path(path) / "config.json").string()));
  }
  RESHARD_RETURN_IF_ERROR(
      CheckQuantizedTies(fmt::format("\"{}\"", (fs::path(path) / kManifestName).string()), config,
                         m, &m.block_scales));
  // A scattered PEFT adapter gathers back into one (its adapter_config.json beside).
  if (HasFile(path, kAdapterConfigName)) {
    RESHARD_ASSIGN_OR_RETURN(std::string adapter,
                             ReadFileToString((fs::path(path) / kAdapterConfigName).string()));
    out.extra_files.push_back({kAdapterConfigName, std::move(adapter)});
  }
  RESHARD_ASSIGN_OR_RETURN(PlanOptions plan, PlanOptionsOf(options));
  const bool require = !options.distributed_config.empty();
  // Scattered from a config.json: the target layout from the model's plans again (MoE experts
  // into their stacked buffers included), so that it converts between TP and EP.
  out.target_maps = [path, plan = std::move(plan), require](int world) {
    return RecordedConfigMaps(path, world, plan, require);
  };
  return out;
}

// ---- Hugging Face full checkpoints ------------------------------------------------------

bool DetectFull(const std::string& path) {
  return !DetectSharded(path) &&
         (HasFile(path, "model.safetensors") || HasFile(path, "model.safetensors.index.json"));
}

Status CheckFull(const std::string& path, const SourceOptions& options) {
  if (options.use == SourceUse::kGather && !options.dequantize) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds full tensors already (model.safetensors, no {}): there is nothing to "
        "gather",
        path, kManifestName));
  }
  RESHARD_RETURN_IF_ERROR(RefuseDeepSpeedOptions(path, options, "a Hugging Face checkpoint"));
  RESHARD_RETURN_IF_ERROR(RefuseConfig(path, options, "a Hugging Face checkpoint"));
  return RefuseDistributedConfig(path, options, "a Hugging Face checkpoint");
}

Result<OpenedCheckpoint> OpenFull(const std::string& path, const SourceOptions&) {
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint opened, FullCheckpoint::Open(path));
  OpenedCheckpoint out;
  out.format = "hf";
  out.run = HuggingFaceRun();
  RESHARD_ASSIGN_OR_RETURN(
      out.source, SourceOfFullDir(path, std::make_shared<const FullCheckpoint>(std::move(opened))));
  if (HasFile(path, "config.json")) {
    RESHARD_ASSIGN_OR_RETURN(std::string config,
                             ReadFileToString((fs::path(path) / "config.json").string()));
    RESHARD_RETURN_IF_ERROR(
        CheckQuantizedTies(fmt::format("\"{}\"", path), config, out.source->manifest(), nullptr));
    out.extra_files.push_back({"config.json", std::move(config)});
  }
  return out;
}

// ---- PEFT LoRA adapters ----------------------------------------------------------------

bool DetectPeft(const std::string& path) { return !DetectSharded(path) && IsPeftAdapterDir(path); }

Status CheckPeft(const std::string& path, const SourceOptions& options) {
  if (options.use == SourceUse::kGather) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is a PEFT adapter of full tensors already ({}, no {}): there is nothing to "
        "gather",
        path, kAdapterWeightsName, kManifestName));
  }
  RESHARD_RETURN_IF_ERROR(RefuseDeepSpeedOptions(path, options, "a PEFT adapter"));
  RESHARD_RETURN_IF_ERROR(RefuseConfig(path, options, "a PEFT adapter"));
  return RefuseDistributedConfig(path, options, "a PEFT adapter");
}

Result<OpenedCheckpoint> OpenPeft(const std::string& path, const SourceOptions&) {
  RESHARD_ASSIGN_OR_RETURN(std::string text,
                           ReadFileToString((fs::path(path) / kAdapterConfigName).string()));
  Result<LoraConfig> config = ParseLoraConfigJson(text);
  if (!config.ok()) return config.status().Annotate(fmt::format("\"{}\"", path));
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint opened, FullCheckpoint::Open(path));
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const TensorRef& t : opened.tensors()) shapes.emplace_back(t.info->name, t.info->shape);
  RESHARD_RETURN_IF_ERROR(CheckLoraTensors(*config, shapes).Annotate(fmt::format("\"{}\"", path)));
  OpenedCheckpoint out;
  out.format = "peft";
  out.run = HuggingFaceRun();
  RESHARD_ASSIGN_OR_RETURN(
      out.source, SourceOfFullDir(path, std::make_shared<const FullCheckpoint>(std::move(opened))));
  out.extra_files.push_back({kAdapterConfigName, std::move(text)});
  return out;
}

// ---- a single torch.save file -----------------------------------------------------------

bool DetectTorchSaveFile(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  const std::string name = fs::path(path).filename().string();
  return name.ends_with(".pt") || name.ends_with(".pth") || name.ends_with(".bin");
}

Status CheckTorchSaveFile(const std::string& path, const SourceOptions& options) {
  if (options.use == SourceUse::kGather) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is one torch.save file of whole tensors: there is nothing to gather (export "
        "writes its tensors as safetensors)",
        path));
  }
  RESHARD_RETURN_IF_ERROR(RefuseDeepSpeedOptions(path, options, "a torch.save file"));
  RESHARD_RETURN_IF_ERROR(RefuseConfig(path, options, "a torch.save file"));
  return RefuseDistributedConfig(path, options, "a torch.save file");
}

// The tensors of one torch.save file (a state dict: each tensor named by its dotted path in
// the object tree) at world size 1, each one rank's whole shard: read in place where it is
// stored dense, else copied (a view with other strides) while acquired. No pickle code runs.
class TorchSaveSource : public ShardSource {
 public:
  static Result<std::unique_ptr<ShardSource>> Open(const std::string& path) {
    RESHARD_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(path));
    auto source = std::unique_ptr<TorchSaveSource>(new TorchSaveSource(path, std::move(f)));
    RESHARD_RETURN_IF_ERROR(source->ListTensors());
    return std::unique_ptr<ShardSource>(std::move(source));
  }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override { return {path_}; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const TorchTensor& t = *tensors_[i];
    if (t.is_contiguous()) {
      const std::byte* base = file_.storages()[t.storage].bytes.data();
      return std::vector<ConstBuffer>{
          {base + static_cast<size_t>(t.storage_offset) * DTypeSize(*t.dtype.dtype),
           static_cast<Index>(t.numel())}};
    }
    return cache_.Acquire(i, manifest_.params[i].map,
                          [&](std::vector<std::vector<std::byte>>& data) {
                            data[0].resize(t.num_bytes());
                            return file_.CopyTo(t, data[0]);
                          });
  }
  void ReleaseShards(size_t i) override {
    if (!tensors_[i]->is_contiguous()) cache_.Release(i);
  }

 private:
  TorchSaveSource(std::string path, TorchFile f) : path_(std::move(path)), file_(std::move(f)) {}

  Status ListTensors() {
    manifest_.world_size = 1;
    std::set<std::string_view> names;
    for (const TorchTensor& t : file_.tensors()) {
      if (!t.dtype.dtype) {
        return UnimplementedError(
            fmt::format("\"{}\": tensor \"{}\" is {}, which reshard does "
                        "not read",
                        path_, t.name, t.dtype.name));
      }
      if (!names.insert(t.name).second) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": two tensors are both named \"{}\" (dotted paths collide)", path_, t.name));
      }
      // A view with other strides is copied dense while it is read: at most its storage's size
      // plus 1 GiB, so that an expanded view (stride 0) cannot claim memory its file lacks.
      const uint64_t stored = file_.storages()[t.storage].bytes.size();
      if (!t.is_contiguous() && t.num_bytes() > stored + (uint64_t{1} << 30)) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": tensor \"{}\" (size {}, stride {}) is {} bytes read dense, from a storage "
            "of {} bytes: a view may be read dense up to its storage's size plus 1 GiB (save it "
            "with .contiguous())",
            path_, t.name, FormatShape(t.shape), FormatShape(t.strides), t.num_bytes(), stored));
      }
      RESHARD_ASSIGN_OR_RETURN(ParamMap map, ReplicatedMap(t.shape, 1));
      manifest_.params.push_back(
          ShardedParam{t.name, *t.dtype.dtype, std::move(map), std::nullopt, 1});
      tensors_.push_back(&t);
    }
    return Status::Ok();
  }

  std::string path_;
  TorchFile file_;
  Manifest manifest_;
  std::vector<const TorchTensor*> tensors_;  // by manifest parameter
  ShardCache cache_;
};

Result<OpenedCheckpoint> OpenTorchSaveFile(const std::string& path, const SourceOptions&) {
  OpenedCheckpoint out;
  out.format = "pt";
  out.run = HuggingFaceRun();
  RESHARD_ASSIGN_OR_RETURN(out.source, TorchSaveSource::Open(path));
  return out;
}

// ---- DeepSpeed --------------------------------------------------------------------------

Status CheckDeepSpeed(const std::string& path, const SourceOptions& options) {
  if (options.master_weights && options.use != SourceUse::kGather) {
    return InvalidArgumentError(
        "a convert of a DeepSpeed checkpoint carries the master weights "
        "as \"<param>.fp32\" already");
  }
  if (options.weights_only && options.use != SourceUse::kConvert) {
    return InvalidArgumentError("a gather writes the model's weights only already");
  }
  RESHARD_RETURN_IF_ERROR(RefuseConfig(path, options, "a DeepSpeed checkpoint"));
  RESHARD_RETURN_IF_ERROR(RefuseOptimizerState(path, options, "a DeepSpeed checkpoint"));
  return RefuseDistributedConfig(path, options, "a DeepSpeed checkpoint");
}

Result<OpenedCheckpoint> OpenDeepSpeedWithMaps(const std::string& path,
                                               const SourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint out, OpenDeepSpeed(path, options));
  // Parameters that record no layout take one from the save dir's config.json.
  out.target_maps = [path, weights_only = options.weights_only](int world) {
    return DeepSpeedConfigMaps(path, world, weights_only);
  };
  return out;
}

// ---- DeepSpeed's universal checkpoint -----------------------------------------------------

// The options a DeepSpeed checkpoint takes, as it takes them: the universal checkpoint holds
// the same states (its fp32 masters, their moments), whole.
Status CheckUniversal(const std::string& path, const SourceOptions& options) {
  if (options.master_weights && options.use != SourceUse::kGather) {
    return InvalidArgumentError(
        "a convert of a universal checkpoint carries the master weights as \"<param>.fp32\" "
        "already");
  }
  if (options.weights_only && options.use != SourceUse::kConvert) {
    return InvalidArgumentError("a gather writes the model's weights only already");
  }
  RESHARD_RETURN_IF_ERROR(RefuseOptimizerState(path, options, "a DeepSpeed universal checkpoint"));
  return RefuseDistributedConfig(path, options, "a DeepSpeed universal checkpoint");
}

// The model's config.json for a universal checkpoint: the one given, else one in `path` (as
// in a DeepSpeed save dir), else "".
std::string UniversalConfigPath(const std::string& path, const SourceOptions& options) {
  if (!options.config_path.empty()) return options.config_path;
  return HasFile(path, "config.json") ? (fs::path(path) / "config.json").string() : "";
}

// The parameter of a tensor that a DeepSpeed-like source names "<param>.<state>".
std::string_view BaseParamName(std::string_view name, const std::set<std::string_view>& names) {
  for (std::string_view state : {".fp32", ".exp_avg_sq", ".exp_avg"}) {
    if (name.ends_with(state) && names.contains(name.substr(0, name.size() - state.size())))
      return name.substr(0, name.size() - state.size());
  }
  return name;
}

// convert's target maps from the model's config.json, for every tensor (a state as its
// parameter), when some parameter records no layout (TP 1 runs, sub-parameters, DCP sources),
// as for a DeepSpeed checkpoint.
Result<std::optional<MapDocument>> UniversalConfigMaps(const ShardSource& source,
                                                       const std::string& config_path, int world) {
  const Manifest& m = source.manifest();
  const bool all_laid_out = std::all_of(m.params.begin(), m.params.end(),
                                        [](const ShardedParam& p) { return p.layout.has_value(); });
  if (all_laid_out || config_path.empty()) return std::optional<MapDocument>();
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
  Result<ConfigMaps> maps = ConfigMaps::FromConfigJson(BuiltinTpRegistry(), text, world);
  if (!maps.ok()) return maps.status().Annotate(fmt::format("\"{}\"", config_path));
  std::set<std::string_view> names;
  for (const ShardedParam& p : m.params) names.insert(p.name);
  MapDocument doc;
  for (const ShardedParam& p : m.params) {
    Result<TensorMap> t = maps->Map(BaseParamName(p.name, names), p.map.valid_shape());
    if (!t.ok()) return t.status().Annotate(fmt::format("\"{}\"", config_path));
    doc.params.emplace_back(p.name, std::move(t->map));
  }
  return std::optional<MapDocument>(std::move(doc));
}

// A universal checkpoint with the model's config.json, when there is one: copied by a gather,
// and laying out a convert's parameters that record no layout.
Result<OpenedCheckpoint> OpenUniversalWithConfig(const std::string& path,
                                                 const SourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint out, OpenUniversal(path, options));
  const Manifest& m = out.source->manifest();
  out.run = UniversalRun(std::any_of(m.params.begin(), m.params.end(), [](const ShardedParam& p) {
    return p.name.ends_with(".exp_avg") || p.name.ends_with(".fp32");
  }));
  const std::string config = UniversalConfigPath(path, options);
  if (config.empty()) return out;
  if (options.use == SourceUse::kGather) {
    RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config));
    out.extra_files.push_back({"config.json", std::move(text)});
  }
  out.target_maps = [source = out.source, config](int world) {
    return UniversalConfigMaps(*source, config, world);
  };
  return out;
}

// ---- Megatron-Core dist-ckpt (torch_dist) ----------------------------------------------

Status CheckMegatron(const std::string& path, const SourceOptions& options) {
  if (options.master_weights) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is a Megatron-Core checkpoint: its gather writes the model's weights, and the "
        "optimizer's fp32 main weights beside them with the optimizer state",
        path));
  }
  if (options.config_path.empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is a Megatron-Core checkpoint, which does not record its model's shapes (heads, "
        "query groups, MLP widths) or Hugging Face names: give the model's config.json",
        path));
  }
  if (options.distributed_config.empty() || options.use == SourceUse::kConvert) {
    return Status::Ok();
  }
  return InvalidArgumentError("a distributed config applies to a convert, not a gather");
}

// Each optimizer state of `m` ("<param>.fp32", ...) in `doc` laid out as its parameter: the
// parameter's map, or where that map is over buffers (stacked experts) the planner's, which
// stacks the state as its parameter into buffers of the state's own ("<buffer>.exp_avg").
void AlignStateMaps(const Manifest& m, const std::set<std::string_view>& names, MapDocument& doc) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < doc.params.size(); ++i) index.emplace(doc.params[i].first, i);
  for (const ShardedParam& p : m.params) {
    const std::string_view base = BaseParamName(p.name, names);
    if (base == p.name) continue;
    const auto param = index.find(std::string(base));
    const auto state = index.find(p.name);
    if (param == index.end() || state == index.end()) continue;
    const ParamMap& map = doc.params[param->second].second;
    if (!map.has_buffers()) doc.params[state->second].second = map;
  }
}

// adapter_config.json of the PEFT adapter a Megatron-Bridge LoRA checkpoint holds: its rank and
// alpha, and as target_modules the projections its tensors adapt (as Megatron-Bridge's own
// export names them).
std::string MegatronAdapterConfigJson(const Manifest& m, const MegatronPeftConfig& peft) {
  std::set<std::string> modules;
  for (const ShardedParam& p : m.params) {
    const std::optional<LoraTensorName> name = ParseLoraTensorName(p.name);
    if (!name) continue;
    const size_t dot = name->module.rfind('.');
    modules.insert(name->module.substr(dot == std::string::npos ? 0 : dot + 1));
  }
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["r"] = peft.dim;
  // An integer alpha (Megatron-Bridge's is an int) is written as one, as PEFT writes it.
  if (peft.alpha == std::floor(peft.alpha) && peft.alpha < 1e15) {
    j["lora_alpha"] = static_cast<int64_t>(peft.alpha);
  } else {
    j["lora_alpha"] = peft.alpha;
  }
  j["lora_dropout"] = peft.dropout;
  j["target_modules"] = std::vector<std::string>(modules.begin(), modules.end());
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["modules_to_save"] = nullptr;
  j["base_model_name_or_path"] = nullptr;
  j["inference_mode"] = true;
  return j.dump(2) + "\n";
}

// A Megatron-Bridge LoRA checkpoint: its gather writes a PEFT adapter directory. convert lays an
// adapter out from its base model's layout, which a PEFT directory's scatter does.
Result<OpenedCheckpoint> OpenedMegatronAdapter(const std::string& path,
                                               std::unique_ptr<ShardSource> source,
                                               const MegatronPeftConfig& peft, ParallelRun run) {
  OpenedCheckpoint out;
  out.format = "megatron";
  out.run = std::move(run);
  out.extra_files.push_back(
      {kAdapterConfigName, MegatronAdapterConfigJson(source->manifest(), peft)});
  out.source = std::move(source);
  out.target_maps = [path](int) -> Result<std::optional<MapDocument>> {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds LoRA adapters: gather it into a PEFT adapter directory, then scatter that "
        "with the base model's config.json to lay it out at another degree",
        path));
  };
  return out;
}

// The distributed optimizer's state is read for a gather that asks for it and for a convert
// unless weights_only: "<name>.fp32", "<name>.exp_avg", "<name>.exp_avg_sq" beside each
// Hugging Face tensor, laid out at the target as their parameter (ResolveMap's convention).
Result<OpenedCheckpoint> OpenMegatron(const std::string& path, const SourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::string config, ReadFileToString(options.config_path));
  const bool optimizer_state =
      options.use == SourceUse::kGather ? options.optimizer_state : !options.weights_only;
  ParallelRun run;
  std::optional<MegatronPeftConfig> peft;
  MegatronSourceOptions source_options{config, options.config_path, optimizer_state, &run};
  source_options.peft = &peft;
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<ShardSource> source,
                           OpenMegatronSource(path, source_options));
  if (peft && options.use == SourceUse::kGather && options.optimizer_state) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds LoRA adapters, gathered into a PEFT adapter, which keeps no optimizer "
        "state: gather its weights alone",
        path));
  }
  if (peft) return OpenedMegatronAdapter(path, std::move(source), *peft, std::move(run));
  if (options.use == SourceUse::kGather && options.optimizer_state &&
      std::none_of(source->manifest().params.begin(), source->manifest().params.end(),
                   [](const ShardedParam& p) { return p.name.ends_with(".exp_avg"); })) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds no distributed-optimizer state (\"optimizer.state.exp_avg.<key>\"): it was "
        "saved without the optimizer",
        path));
  }
  OpenedCheckpoint out;
  out.format = "megatron";
  out.run = std::move(run);
  out.source = std::move(source);
  RESHARD_ASSIGN_OR_RETURN(PlanOptions plan, PlanOptionsOf(options));
  // convert lays the Hugging Face tensors out as transformers holds them at the target degree.
  out.target_maps = [source = out.source, config, plan = std::move(plan),
                     config_path =
                         options.config_path](int world) -> Result<std::optional<MapDocument>> {
    std::set<std::string_view> names;
    std::vector<StoredTensor> tensors;
    for (const ShardedParam& p : source->manifest().params) {
      names.insert(p.name);
      tensors.push_back({p.name, p.dtype, p.map.valid_shape()});
    }
    Result<MapDocument> doc = ConfigTargetMaps(config, tensors, world, plan);
    if (!doc.ok()) return doc.status().Annotate(fmt::format("\"{}\"", config_path));
    AlignStateMaps(source->manifest(), names, *doc);
    return std::optional<MapDocument>(*std::move(doc));
  };
  out.extra_files.push_back({"config.json", std::move(config)});
  return out;
}

constexpr std::array kFormats = {
    CheckpointFormat{"reshard", "a reshard sharded checkpoint", DetectSharded, CheckSharded,
                     OpenSharded},
    // Before DCP: a Megatron checkpoint is a DCP checkpoint with a metadata.json.
    CheckpointFormat{"megatron", "a Megatron-Core dist-ckpt (torch_dist)", IsMegatronCheckpoint,
                     CheckMegatron, OpenMegatron},
    // Before DeepSpeed: the universal folder keeps copies of DeepSpeed's model-states files.
    CheckpointFormat{"universal", "a DeepSpeed universal checkpoint", IsUniversalCheckpoint,
                     CheckUniversal, OpenUniversalWithConfig},
    CheckpointFormat{"deepspeed", "a DeepSpeed checkpoint", IsDeepSpeedCheckpoint, CheckDeepSpeed,
                     OpenDeepSpeedWithMaps},
    CheckpointFormat{"dcp", "a PyTorch Distributed Checkpoint", IsDcpCheckpoint, CheckDcpOptions,
                     OpenDcp},
    CheckpointFormat{"orbax", "an Orbax checkpoint", IsOrbaxCheckpoint, CheckOrbaxOptions,
                     OpenOrbax},
    CheckpointFormat{"hf", "a Hugging Face checkpoint", DetectFull, CheckFull, OpenFull},
    CheckpointFormat{"peft", "a PEFT LoRA adapter", DetectPeft, CheckPeft, OpenPeft},
    CheckpointFormat{"pt", "a torch.save file", DetectTorchSaveFile, CheckTorchSaveFile,
                     OpenTorchSaveFile},
};

}  // namespace

std::span<const CheckpointFormat> CheckpointFormats() { return kFormats; }

const CheckpointFormat& DetectFormat(const std::string& path) {
  for (const CheckpointFormat& f : kFormats) {
    if (f.detect(path)) return f;
  }
  return kFormats.front();
}

namespace {

// MaxText's names (SourceOptions::names) are an Orbax checkpoint's.
Status CheckNames(const std::string& path, const CheckpointFormat& format,
                  const SourceOptions& options) {
  if (!options.names.empty() && format.name != "orbax") {
    return InvalidArgumentError(fmt::format(
        "names \"{}\" are read from an Orbax checkpoint (a convert to Orbax writes them); \"{}\" "
        "is {}",
        options.names, path, format.description));
  }
  return Status::Ok();
}

}  // namespace

Status CheckSourceOptions(const std::string& path, const SourceOptions& options) {
  const CheckpointFormat& format = DetectFormat(path);
  RESHARD_RETURN_IF_ERROR(CheckNames(path, format, options));
  return format.check(path, options);
}

Result<OpenedCheckpoint> OpenCheckpoint(const std::string& path, const SourceOptions& options) {
  const CheckpointFormat& format = DetectFormat(path);
  RESHARD_RETURN_IF_ERROR(CheckNames(path, format, options));
  RESHARD_RETURN_IF_ERROR(format.check(path, options));
  return format.open(path, options);
}

namespace {

// Opens `path` on every process; all fail when one does.
Result<OpenedCheckpoint> OpenEverywhere(const std::string& path, const SourceOptions& source,
                                        const CheckpointOptions& options) {
  Result<OpenedCheckpoint> opened = OpenCheckpoint(path, source);
  if (options.communicator != nullptr) {
    RESHARD_RETURN_IF_ERROR(AgreeOnStatus(*options.communicator, opened.status()));
  }
  return opened;
}

// The ties a dequantizing gather applies (those the manifest records, else those of the model's
// quantization_config) and its config.json without quantization_config.
Status DequantizePlan(const std::string& path, const Manifest& m, DequantizeOptions& dequantize,
                      std::vector<ExtraFile>& extra) {
  std::string config = m.model_config;
  ExtraFile* config_file = nullptr;
  for (ExtraFile& f : extra) {
    if (f.name == "config.json") config_file = &f;
  }
  if (config_file != nullptr) config = config_file->contents;
  const bool recorded = !m.block_scales.empty();
  if (!recorded && dequantize.ties.empty()) {
    if (config.empty()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" records no block scales and has no config.json: nothing says what to dequantize",
          path));
    }
    RESHARD_ASSIGN_OR_RETURN(const std::optional<QuantScheme> scheme, ReadQuantScheme(config));
    if (!scheme) {
      return FailedPreconditionError(fmt::format(
          "the config.json of \"{}\" has no quantization_config: nothing to dequantize", path));
    }
    std::vector<QuantTensor> tensors;
    for (const ShardedParam& p : m.params)
      tensors.push_back({p.name, p.dtype, p.map.valid_shape()});
    RESHARD_ASSIGN_OR_RETURN(const std::vector<QuantTie> ties,
                             TieQuantizedTensors(*scheme, tensors));
    for (const QuantTie& t : ties) {
      dequantize.ties.emplace(
          t.scale,
          BlockScales{t.data, t.block, std::string(QuantFormatName(t.format)), t.dequantizes});
    }
  }
  if (config.empty()) return Status::Ok();
  Result<std::string> without = WithoutQuantizationConfig(config);
  if (!without.ok()) return without.status().Annotate(fmt::format("\"{}\"", path));
  const std::string& dropped = *without;
  if (config_file != nullptr) {
    config_file->contents = dropped;
  } else {
    extra.push_back({"config.json", dropped});
  }
  return Status::Ok();
}

// Opens `path` with its block-quantized tensors dequantized: the checkpoint, the options (with
// the ties), the view, and the model's config.json without quantization_config ("": none).
struct DequantizedCheckpoint {
  OpenedCheckpoint opened;
  CheckpointOptions options;
  std::unique_ptr<ShardSource> view;
  std::string config;
};

Result<DequantizedCheckpoint> OpenDequantized(const std::string& path, const SourceOptions& source,
                                              const CheckpointOptions& options) {
  SourceOptions s = source;
  s.dequantize = true;
  DequantizedCheckpoint d;
  RESHARD_ASSIGN_OR_RETURN(d.opened, OpenEverywhere(path, s, options));
  if (d.opened.gather || d.opened.source == nullptr) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is {}: dequantizing takes a reshard sharded or a Hugging Face checkpoint", path,
        DetectFormat(path).description));
  }
  d.options = options;
  std::vector<ExtraFile> extra = d.opened.extra_files;
  RESHARD_RETURN_IF_ERROR(
      DequantizePlan(path, d.opened.source->manifest(), *d.options.dequantize, extra));
  for (const ExtraFile& f : extra) {
    if (f.name == "config.json") d.config = f.contents;
  }
  d.options.output_config = d.config;
  RESHARD_ASSIGN_OR_RETURN(d.view, DequantizedView(*d.opened.source, d.options));
  return d;
}

std::vector<StoredTensor> StoredTensorsOf(const Manifest& m) {
  std::vector<StoredTensor> tensors;
  for (const ShardedParam& p : m.params) tensors.push_back({p.name, p.dtype, p.map.valid_shape()});
  return tensors;
}

// Dequantizing converts of a checkpoint scattered from a config.json (its manifest keeps it)
// lay the numbers out from the config without quantization_config: the view's target maps,
// and the view again recording that config and its plan's constraints.
Result<std::optional<MapDocument>> DequantizedConfigMaps(DequantizedCheckpoint& d,
                                                         const SourceOptions& source, int world) {
  if (d.config.empty() || d.opened.source->manifest().model_config.empty()) {
    return std::optional<MapDocument>();
  }
  RESHARD_ASSIGN_OR_RETURN(PlanOptions plan, PlanOptionsOf(source));
  RESHARD_ASSIGN_OR_RETURN(
      ConfigScatter laid,
      ConfigScatterMaps(StoredTensorsOf(d.view->manifest()), d.config, world, plan));
  RESHARD_ASSIGN_OR_RETURN(MapDocument doc,
                           DocumentOfMaps(laid.maps, laid.buffers, d.view->manifest()));
  RESHARD_ASSIGN_OR_RETURN(
      d.view, DequantizedView(*d.opened.source, d.options, {laid.model_config, laid.constraints}));
  return std::optional<MapDocument>(std::move(doc));
}

Status ConvertDequantized(const std::string& path, const SourceOptions& source, int world_size,
                          const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                          const CheckpointOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(DequantizedCheckpoint d, OpenDequantized(path, source, options));
  std::optional<MapDocument> target = target_maps;
  if (!target) {
    RESHARD_ASSIGN_OR_RETURN(target, DequantizedConfigMaps(d, source, world_size));
  }
  return ConvertFrom(*d.view, world_size, target, out_dir, d.options);
}

// A side of a diff: its source, through a dequantized view when asked and it has block-quantized
// tensors.
struct DiffSide {
  OpenedCheckpoint opened;
  std::optional<DequantizedCheckpoint> dequantized;
  ShardSource& source() { return dequantized ? *dequantized->view : *opened.source; }
};

// Whether the checkpoint has block-quantized tensors that a dequantizing read would turn into
// numbers: block scales recorded, or a quantization_config in its config.json.
Result<bool> HasQuantizedTensors(const OpenedCheckpoint& opened) {
  const Manifest& m = opened.source->manifest();
  if (!m.block_scales.empty()) return true;
  std::string config = m.model_config;
  for (const ExtraFile& f : opened.extra_files) {
    if (f.name == "config.json") config = f.contents;
  }
  if (config.empty()) return false;
  RESHARD_ASSIGN_OR_RETURN(const std::optional<QuantScheme> scheme, ReadQuantScheme(config));
  return scheme.has_value();
}

// Whether the format of `path` takes a model's config.json.
bool TakesConfig(const std::string& path, const SourceOptions& s, const std::string& config) {
  SourceOptions with = s;
  with.config_path = config;
  return !config.empty() && CheckSourceOptions(path, with).ok();
}

Result<DiffSide> OpenDiffSide(const std::string& path,
                              const std::optional<DequantizeOptions>& dequantize,
                              const std::string& config) {
  SourceOptions s;
  s.use = SourceUse::kConvert;
  // The weights only, where the format holds more (a DeepSpeed checkpoint's optimizer state).
  s.weights_only = true;
  if (!CheckSourceOptions(path, s).ok()) s.weights_only = false;
  if (TakesConfig(path, s, config)) s.config_path = config;
  DiffSide side;
  RESHARD_ASSIGN_OR_RETURN(side.opened, OpenCheckpoint(path, s));
  if (side.opened.source == nullptr) return InvalidArgumentError(side.opened.not_convertible);
  if (!dequantize) return side;
  RESHARD_ASSIGN_OR_RETURN(const bool quantized, HasQuantizedTensors(side.opened));
  if (!quantized) return side;
  CheckpointOptions o;
  o.dequantize = dequantize;
  RESHARD_ASSIGN_OR_RETURN(side.dequantized, OpenDequantized(path, s, o));
  return side;
}

}  // namespace

Result<DiffReport> DiffCheckpoints(const std::string& a, const std::string& b,
                                   const std::optional<DequantizeOptions>& dequantize,
                                   const DiffOptions& options, const std::string& config_path) {
  if (!config_path.empty()) {
    SourceOptions s;
    s.use = SourceUse::kConvert;
    if (!TakesConfig(a, s, config_path) && !TakesConfig(b, s, config_path)) {
      return InvalidArgumentError(
          fmt::format("\"{}\" names a model's config.json, which neither checkpoint's format takes",
                      config_path));
    }
  }
  Result<DiffSide> side_a = OpenDiffSide(a, dequantize, config_path);
  if (!side_a.ok()) return side_a.status().Annotate(fmt::format("A \"{}\"", a));
  Result<DiffSide> side_b = OpenDiffSide(b, dequantize, config_path);
  if (!side_b.ok()) return side_b.status().Annotate(fmt::format("B \"{}\"", b));
  return DiffSources(side_a->source(), side_b->source(), options);
}

Status ScatterDequantized(const std::string& full_dir, const ScatterLayoutOf& layout,
                          const std::string& out_dir, const CheckpointOptions& options) {
  SourceOptions source;
  source.use = SourceUse::kConvert;
  if (!DetectFull(full_dir)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is not a Hugging Face checkpoint (no model.safetensors or its index)", full_dir));
  }
  RESHARD_ASSIGN_OR_RETURN(DequantizedCheckpoint d, OpenDequantized(full_dir, source, options));
  RESHARD_ASSIGN_OR_RETURN(ScatterLayout laid,
                           layout(StoredTensorsOf(d.view->manifest()), d.config));
  RESHARD_ASSIGN_OR_RETURN(MapDocument doc,
                           DocumentOfMaps(laid.maps, laid.buffers, d.view->manifest()));
  if (doc.params.empty()) return InvalidArgumentError("the checkpoint holds no tensors");
  const int world = doc.params.front().second.world_size();
  RESHARD_ASSIGN_OR_RETURN(
      d.view, DequantizedView(*d.opened.source, d.options, {laid.model_config, laid.constraints}));
  return ConvertFrom(*d.view, world, doc, out_dir, d.options);
}

Status GatherCheckpoint(const std::string& path, const SourceOptions& source,
                        const std::string& out_dir, const CheckpointOptions& options) {
  SourceOptions s = source;
  s.use = SourceUse::kGather;
  s.dequantize = options.dequantize.has_value();
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenEverywhere(path, s, options));
  if (!options.dequantize) {
    if (opened.gather) return opened.gather(out_dir, options);
    return GatherFrom(*opened.source, out_dir, options, opened.extra_files);
  }
  if (opened.gather || opened.source == nullptr) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is {}: dequantizing takes a reshard sharded or a Hugging Face checkpoint", path,
        DetectFormat(path).description));
  }
  CheckpointOptions o = options;
  std::vector<ExtraFile> extra = opened.extra_files;
  RESHARD_RETURN_IF_ERROR(DequantizePlan(path, opened.source->manifest(), *o.dequantize, extra));
  return GatherFrom(*opened.source, out_dir, o, extra);
}

Status ConvertCheckpoint(const std::string& path, const SourceOptions& source, int world_size,
                         const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                         const CheckpointOptions& options) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  }
  SourceOptions s = source;
  s.use = SourceUse::kConvert;
  if (target_maps && !s.distributed_config.empty()) {
    return InvalidArgumentError("give target maps or a distributed config, not both");
  }
  if (options.dequantize)
    return ConvertDequantized(path, s, world_size, target_maps, out_dir, options);
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenEverywhere(path, s, options));
  if (opened.source == nullptr) return UnimplementedError(opened.not_convertible);
  std::optional<MapDocument> target = target_maps;
  if (!target && opened.target_maps) {
    RESHARD_ASSIGN_OR_RETURN(target, opened.target_maps(world_size));
  }
  return ConvertFrom(*opened.source, world_size, target, out_dir, options);
}

Status WriteDcpCheckpoint(const std::string& path, const SourceOptions& source, int world_size,
                          const std::string& out_dir, const CheckpointOptions& options) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  }
  SourceOptions s = source;
  s.use = SourceUse::kConvert;
  s.trainer_state_dict = true;
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenEverywhere(path, s, options));
  if (opened.source == nullptr) return UnimplementedError(opened.not_convertible);
  return WriteDcp(*opened.source, world_size, out_dir, options, opened.state_dict.get());
}

Status WriteOrbaxCheckpoint(const std::string& path, const SourceOptions& source,
                            const OrbaxTarget& target, const std::string& out_dir,
                            const CheckpointOptions& options) {
  if (options.communicator != nullptr && options.communicator->size() > 1) {
    return InvalidArgumentError("an Orbax checkpoint is written by one process");
  }
  SourceOptions s = source;
  s.use = SourceUse::kConvert;
  if (!target.names.empty() && target.names != "maxtext") {
    return InvalidArgumentError(fmt::format(
        "names \"{}\": an Orbax checkpoint is written with its tensors' names or MaxText's "
        "(\"maxtext\")",
        target.names));
  }
  if (!target.names.empty() && DetectFormat(path).name == "orbax") {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is an Orbax checkpoint: written again as one it keeps its own names (read it "
        "with MaxText's names to convert it to another format)",
        path));
  }
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenCheckpoint(path, s));
  if (opened.source == nullptr) return UnimplementedError(opened.not_convertible);
  if (target.names.empty()) return WriteOrbax(*opened.source, target, out_dir, options);
  const auto config = std::find_if(opened.extra_files.begin(), opened.extra_files.end(),
                                   [](const ExtraFile& f) { return f.name == "config.json"; });
  if (config == opened.extra_files.end()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" has no config.json, which MaxText's layout of its model needs (its shapes and "
        "layers)",
        path));
  }
  RESHARD_ASSIGN_OR_RETURN(
      const MaxTextModelConfig model,
      ParseMaxTextModelConfig(config->contents, fmt::format("the config.json of \"{}\"", path)));
  Result<std::unique_ptr<ShardSource>> view = MaxTextViewOf(opened.source, model);
  if (!view.ok()) return view.status().Annotate(fmt::format("\"{}\"", path));
  return WriteOrbax(**view, target, out_dir, options);
}

namespace {

// A target the output formats can hold: valid, and one flat axis of ranks (the reshard sharded
// checkpoint and DCP record no pipeline stages or expert grid of their own).
Status CheckFlatTarget(const ParallelRun& target, std::string_view output) {
  for (const ParallelAxis& a : target.grid.axes) {
    if (a.size < 1) return InvalidArgumentError(fmt::format("{} is not a world size", a.size));
  }
  RESHARD_RETURN_IF_ERROR(target.Validate());
  if (target.world() < 1) return InvalidArgumentError("the target run has no ranks");
  int split = 0;
  for (const ParallelAxis& a : target.grid.axes) split += a.size > 1 ? 1 : 0;
  if (split > 1 || target.experts) {
    return InvalidArgumentError(fmt::format(
        "{} holds a flat world of ranks; the target run {} is a grid of several axes: give its "
        "world as one axis",
        output, ParallelRunText(target)));
  }
  return Status::Ok();
}

}  // namespace

ParallelRun ShardedTargetRun(int world_size) {
  return FlatRun(world_size, ParallelDim::kTp, "reshard: a rank per tensor rank");
}

ParallelRun DcpTargetRun(int world_size) {
  return FlatRun(world_size, ParallelDim::kRank, "DCP flat world");
}

Status ConvertCheckpoint(const std::string& path, const SourceOptions& source,
                         const ParallelRun& target, const std::optional<MapDocument>& target_maps,
                         const std::string& out_dir, const CheckpointOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckFlatTarget(target, "a reshard sharded checkpoint"));
  return ConvertCheckpoint(path, source, static_cast<int>(target.world()), target_maps, out_dir,
                           options);
}

Status WriteDcpCheckpoint(const std::string& path, const SourceOptions& source,
                          const ParallelRun& target, const std::string& out_dir,
                          const CheckpointOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckFlatTarget(target, "a PyTorch Distributed Checkpoint"));
  return WriteDcpCheckpoint(path, source, static_cast<int>(target.world()), out_dir, options);
}

}  // namespace reshard
