#include "reshard/hf/checkpoint_maps.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/hf/quantized_maps.h"
#include "reshard/hf/registry.h"
#include "reshard/io/file.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

namespace {

// An adapter tensor's map from its base weight's: the base's descriptor moved onto the
// dimension they share, or whole on every rank when they share none that is split.
Result<ProvidedMap> AdapterMap(const StoredTensor& t, const LoraTensorName& n, bool fan_in_fan_out,
                               const ProvidedMap& base, int world) {
  if (!base.layout) {
    return FailedPreconditionError(fmt::format(
        "adapter tensor \"{}\": its base weight \"{}\" is laid out into a buffer shared with "
        "other tensors (stacked experts), which an adapter's layout does not follow",
        t.name, n.base));
  }
  LayoutDescriptor d = *base.layout;
  if (d.family != LayoutFamily::kReplicated) {
    const std::optional<int> along = LoraDimAlong(n.part, d.dim, fan_in_fan_out);
    if (along) {
      d.dim = *along;
    } else {
      d = LayoutDescriptor{};
    }
  }
  Result<ParamMap> map = BuildMap(d, t.shape, world);
  if (!map.ok()) return map.status().Annotate(fmt::format("adapter tensor \"{}\"", t.name));
  return ProvidedMap{*std::move(map), d, true};
}

// The base weights a PEFT adapter's tensors imply (name, dtype, shape), by name; DataLoss for
// two tensors of one module that disagree on its weight's shape.
Result<std::map<std::string, StoredTensor>> AdapterBaseTensors(
    const std::vector<StoredTensor>& tensors, bool fan_in_fan_out) {
  std::map<std::string, const StoredTensor*> a_of, b_of;
  std::map<std::string, StoredTensor> base;
  auto add = [&](const StoredTensor& from, const std::string& name, Shape shape) -> Status {
    auto [it, added] = base.emplace(name, StoredTensor{name, from.dtype, shape});
    if (!added && it->second.shape != shape) {
      return DataLossError(fmt::format(
          "adapter tensor \"{}\" implies base weight \"{}\" of shape [{}], another tensor of "
          "the adapter [{}]",
          from.name, name, fmt::join(shape, ", "), fmt::join(it->second.shape, ", ")));
    }
    return Status::Ok();
  };
  for (const StoredTensor& t : tensors) {
    const std::optional<LoraTensorName> n = ParseLoraTensorName(t.name);
    if (!n) continue;  // CheckLoraTensors refused it
    if (n->part == LoraPart::kBaseCopy) {
      RESHARD_RETURN_IF_ERROR(add(t, n->base, t.shape));
    } else if (n->part == LoraPart::kA || n->part == LoraPart::kEmbeddingA) {
      a_of[n->module] = &t;
    } else {
      b_of[n->module] = &t;
    }
  }
  for (const auto& [module, a] : a_of) {
    const StoredTensor* b = b_of.at(module);  // CheckLoraTensors saw both
    const LoraPart part = ParseLoraTensorName(a->name)->part;
    RESHARD_RETURN_IF_ERROR(
        add(*a, module + ".weight", LoraBaseShape(part, a->shape, b->shape, fan_in_fan_out)));
  }
  return base;
}

// scatter --config of a PEFT adapter: each tensor laid out as its base weight is (DESIGN 23).
// The manifest keeps no model config: the adapter converts by its recorded descriptors.
Result<ConfigScatter> AdapterScatterMaps(const std::string& dir, const FullCheckpoint& full,
                                         std::string_view config_json, int world,
                                         const PlanOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(
      const std::string text,
      ReadFileToString((std::filesystem::path(dir) / kAdapterConfigName).string()));
  RESHARD_ASSIGN_OR_RETURN(const LoraConfig lora, ParseLoraConfigJson(text));
  std::vector<StoredTensor> tensors;
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const TensorRef& t : full.tensors()) {
    tensors.push_back({t.info->name, t.info->dtype, t.info->shape});
    shapes.emplace_back(t.info->name, t.info->shape);
  }
  RESHARD_RETURN_IF_ERROR(
      CheckLoraTensors(lora, shapes).Annotate(fmt::format("the adapter \"{}\"", dir)));
  RESHARD_ASSIGN_OR_RETURN(auto base, AdapterBaseTensors(tensors, lora.fan_in_fan_out));
  std::vector<StoredTensor> base_tensors;
  for (auto& [name, t] : base) base_tensors.push_back(t);
  RESHARD_ASSIGN_OR_RETURN(ConfigScatter planned,
                           ConfigScatterMaps(base_tensors, config_json, world, options));
  auto by_name = std::make_shared<std::map<std::string, ProvidedMap>>();
  for (const StoredTensor& t : tensors) {
    const LoraTensorName n = *ParseLoraTensorName(t.name);
    RESHARD_ASSIGN_OR_RETURN(const ProvidedMap base_map,
                             planned.maps(n.base, base.at(n.base).shape));
    RESHARD_ASSIGN_OR_RETURN(ProvidedMap map,
                             AdapterMap(t, n, lora.fan_in_fan_out, base_map, world));
    by_name->emplace(t.name, std::move(map));
  }
  ConfigScatter out;
  out.maps = [by_name](const std::string& name, const Shape&) -> Result<ProvidedMap> {
    auto it = by_name->find(name);
    if (it == by_name->end()) return NotFoundError(fmt::format("no map for \"{}\"", name));
    return it->second;
  };
  out.constraints = std::move(planned.constraints);
  return out;
}

}  // namespace

Result<MapDocument> AdapterMapsFromDocument(const std::string& adapter_dir,
                                            const MapDocument& base) {
  RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint full, FullCheckpoint::Open(adapter_dir));
  RESHARD_ASSIGN_OR_RETURN(
      const std::string text,
      ReadFileToString((std::filesystem::path(adapter_dir) / kAdapterConfigName).string()));
  Result<LoraConfig> lora = ParseLoraConfigJson(text);
  if (!lora.ok()) return lora.status().Annotate(fmt::format("\"{}\"", adapter_dir));
  std::vector<LoraTensorToLay> tensors;
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const TensorRef& t : full.tensors()) {
    tensors.push_back({t.info->name, t.info->dtype, t.info->shape});
    shapes.emplace_back(t.info->name, t.info->shape);
  }
  const std::string where = fmt::format("the adapter \"{}\"", adapter_dir);
  RESHARD_RETURN_IF_ERROR(CheckLoraTensors(*lora, shapes).Annotate(where));
  Result<MapDocument> doc = LoraMapsFromBase(tensors, lora->fan_in_fan_out, base);
  if (!doc.ok()) return doc.status().Annotate(where);
  return doc;
}

Result<ConfigScatter> ConfigScatterMaps(const std::string& full_dir, std::string_view config_json,
                                        int world, const PlanOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint full, FullCheckpoint::Open(full_dir));
  if (IsPeftAdapterDir(full_dir)) {
    return AdapterScatterMaps(full_dir, full, config_json, world, options);
  }
  std::vector<StoredTensor> tensors;
  for (const TensorRef& t : full.tensors()) {
    tensors.push_back({t.info->name, t.info->dtype, t.info->shape});
  }
  return ConfigScatterMaps(tensors, config_json, world, options);
}

Result<ConfigScatter> ConfigScatterMaps(const std::vector<StoredTensor>& tensors,
                                        std::string_view config_json, int world,
                                        const PlanOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(ConfigMaps maps, ConfigMaps::FromConfigJson(
                                                BuiltinTpRegistry(), config_json, world, options));
  RESHARD_ASSIGN_OR_RETURN(ModelCheckpointMaps model,
                           PlanModelCheckpointMaps(maps, config_json, tensors));
  CheckpointMaps& planned = model.maps;
  auto by_name = std::make_shared<std::map<std::string, ProvidedMap>>();
  for (CheckpointTensorMap& t : planned.tensors) {
    by_name->emplace(t.name, ProvidedMap{std::move(t.map), std::move(t.layout), true});
  }
  ConfigScatter out;
  out.maps = [by_name](const std::string& name, const Shape&) -> Result<ProvidedMap> {
    auto it = by_name->find(name);
    if (it == by_name->end()) return NotFoundError(fmt::format("no map for \"{}\"", name));
    return it->second;
  };
  out.buffers = std::move(planned.buffers);
  for (const QuantTie& tie : model.ties) {
    out.block_scales.emplace(
        tie.scale, BlockScales{tie.data, tie.block, std::string(QuantFormatName(tie.format)),
                               tie.dequantizes});
  }
  out.constraints = DegreeConstraints(maps.plan());
  // Parsed already (FromConfigJson): kept compact.
  out.model_config = nlohmann::json::parse(config_json).dump();
  return out;
}

Result<std::map<std::string, BlockScales>> BlockScalesOfDir(const std::string& full_dir) {
  const std::string config_path = (std::filesystem::path(full_dir) / "config.json").string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config_path, ec))
    return std::map<std::string, BlockScales>();
  RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(config_path));
  Result<std::optional<QuantScheme>> scheme = ReadQuantScheme(text);
  if (!scheme.ok()) return scheme.status().Annotate(fmt::format("\"{}\"", config_path));
  if (!*scheme) return std::map<std::string, BlockScales>();
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint full, FullCheckpoint::Open(full_dir));
  std::vector<QuantTensor> tensors;
  for (const TensorRef& t : full.tensors()) {
    tensors.push_back({t.info->name, t.info->dtype, t.info->shape});
  }
  RESHARD_ASSIGN_OR_RETURN(const std::vector<QuantTie> ties,
                           TieQuantizedTensors(**scheme, tensors));
  std::map<std::string, BlockScales> out;
  for (const QuantTie& t : ties) {
    out.emplace(t.scale, BlockScales{t.data, t.block, std::string(QuantFormatName(t.format)),
                                     t.dequantizes});
  }
  return out;
}

Result<std::map<std::string, BlockScales>> FollowBlockScales(const std::string& full_dir,
                                                             MapProvider& maps) {
  using Ties = std::map<std::string, BlockScales>;
  RESHARD_ASSIGN_OR_RETURN(Ties out, BlockScalesOfDir(full_dir));
  if (out.empty()) return out;
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint full, FullCheckpoint::Open(full_dir));
  std::map<std::string, Shape> shapes;
  for (const TensorRef& t : full.tensors()) shapes.emplace(t.info->name, t.info->shape);
  auto by_scale = std::make_shared<std::map<std::string, std::pair<BlockScales, Shape>>>();
  for (const auto& [scale, b] : out) by_scale->emplace(scale, std::pair{b, shapes.at(b.data)});
  maps = [inner = maps, by_scale](const std::string& name,
                                  const Shape& shape) -> Result<ProvidedMap> {
    auto it = by_scale->find(name);
    if (it == by_scale->end()) return inner(name, shape);
    const auto& [tie, data_shape] = it->second;
    RESHARD_ASSIGN_OR_RETURN(ProvidedMap data, inner(tie.data, data_shape));
    // A map given for the scales is checked against the data's (a buffered one names its scale
    // buffers, as vLLM's fused block-scale parameters do); else the scales follow the data.
    if (Result<ProvidedMap> own = inner(name, shape); own.ok() && own->exact) {
      if (Status tied = CheckBlockTie(data.map, own->map, tie.block); !tied.ok()) {
        return FailedPreconditionError(
            fmt::format("the map given for \"{}\", the scales of \"{}\" "
                        "in blocks of {}: {}",
                        name, tie.data, FormatShape(tie.block), tied.message()));
      }
      return own;
    }
    Result<ParamMap> image = BlockImage(data.map, tie.block, shape);
    if (!image.ok()) {
      return Status(
          image.status().code(),
          fmt::format("the scales \"{}\" of \"{}\" (blocks of {}) cannot follow its map: {}", name,
                      tie.data, FormatShape(tie.block), image.status().message()));
    }
    return ProvidedMap{*std::move(image), std::nullopt, true};
  };
  return out;
}

Result<std::optional<MapDocument>> RecordedConfigMaps(const std::string& sharded_dir, int world,
                                                      const PlanOptions& options, bool require) {
  const std::string path = (std::filesystem::path(sharded_dir) / kManifestName).string();
  Result<std::string> text = ReadFileToString(path);
  Result<Manifest> m = text.ok() ? ParseManifestJson(*text) : text.status();
  if (!m.ok() || m->model_config.empty()) {
    if (require) {
      return InvalidArgumentError(fmt::format(
          "a distributed config applies to a checkpoint scattered from a config.json (its "
          "manifest keeps it); \"{}\" was not, so the model's plans are unknown: give the target "
          "layout as target maps",
          sharded_dir));
    }
    return std::optional<MapDocument>();  // Convert reports a bad manifest itself
  }
  std::vector<StoredTensor> tensors;
  for (const ShardedParam& p : m->params) tensors.push_back({p.name, p.dtype, p.map.valid_shape()});
  Result<MapDocument> doc = ConfigTargetMaps(m->model_config, tensors, world, options);
  if (!doc.ok()) return doc.status().Annotate(fmt::format("the model config kept in \"{}\"", path));
  return std::optional<MapDocument>(*std::move(doc));
}

Result<MapDocument> ConfigTargetMaps(std::string_view config_json,
                                     const std::vector<StoredTensor>& tensors, int world,
                                     const PlanOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(ConfigMaps maps, ConfigMaps::FromConfigJson(
                                                BuiltinTpRegistry(), config_json, world, options));
  RESHARD_ASSIGN_OR_RETURN(ModelCheckpointMaps model,
                           PlanModelCheckpointMaps(maps, config_json, tensors));
  CheckpointMaps& planned = model.maps;
  MapDocument doc;
  for (CheckpointTensorMap& t : planned.tensors) doc.params.emplace_back(t.name, std::move(t.map));
  RESHARD_RETURN_IF_ERROR(ValidateBuffers(doc, planned.buffers));
  return doc;
}

Result<std::optional<MapDocument>> DeepSpeedConfigMaps(const std::string& dir, int world,
                                                       bool weights_only) {
  RESHARD_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ckpt, DeepSpeedCheckpoint::Open(dir));
  const std::vector<DeepSpeedParam>& params = ckpt.params();
  const bool all_laid_out =
      std::all_of(params.begin(), params.end(), [](const auto& p) { return p.layout.has_value(); });
  if (all_laid_out || ckpt.config_path().empty()) return std::optional<MapDocument>();
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(ckpt.config_path()));
  Result<ConfigMaps> maps = ConfigMaps::FromConfigJson(BuiltinTpRegistry(), text, world);
  if (!maps.ok()) return maps.status().Annotate(fmt::format("\"{}\"", ckpt.config_path()));
  std::vector<std::string> suffixes = {""};
  if (!weights_only && ckpt.has_optimizer_state()) {
    for (DeepSpeedState s :
         {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq}) {
      suffixes.push_back("." + std::string(DeepSpeedStateName(s)));
    }
  }
  MapDocument doc;
  for (const std::string& suffix : suffixes) {
    for (const DeepSpeedParam& p : params) {
      // A frozen parameter or a buffer has no optimizer state.
      if (!suffix.empty() && p.kind != DeepSpeedParamKind::kTrained) continue;
      Result<TensorMap> m = maps->Map(p.name, p.tp_map.valid_shape());
      if (!m.ok()) return m.status().Annotate(fmt::format("\"{}\"", ckpt.config_path()));
      doc.params.emplace_back(p.name + suffix, std::move(m->map));
    }
  }
  return std::optional<MapDocument>(std::move(doc));
}

}  // namespace reshard
