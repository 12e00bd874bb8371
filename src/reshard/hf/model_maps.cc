#include "reshard/hf/model_maps.h"

#include <fmt/format.h>

#include <cctype>

namespace reshard {

std::string WildcardLayerNumbers(std::string_view name) {
  // ".<digits>" followed by "." or the end becomes ".*".
  std::string out;
  size_t i = 0;
  while (i < name.size()) {
    if (name[i] == '.') {
      size_t j = i + 1;
      while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
      if (j > i + 1 && (j == name.size() || name[j] == '.')) {
        out += ".*";
        i = j;
        continue;
      }
    }
    out += name[i++];
  }
  return out;
}

namespace {

// Suffixes of `name` starting at a component boundary, longest first.
std::vector<std::string_view> Suffixes(std::string_view name) {
  std::vector<std::string_view> out = {name};
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '.') out.push_back(name.substr(i + 1));
  }
  return out;
}

Index Extent(const Shape& shape, int dim) { return shape[static_cast<size_t>(dim)]; }

}  // namespace

const ResolvedEntry* MatchPlanEntry(const ModelPlan& plan, std::string_view tensor_name) {
  // "*" in the leading position would match a layer index at the very start: normalise it.
  const std::string generic =
      WildcardLayerNumbers(std::string(".") + std::string(tensor_name)).substr(1);
  std::string_view module = generic;
  if (const size_t dot = module.rfind('.'); dot != std::string_view::npos)
    module = module.substr(0, dot);
  for (std::string_view candidate : {std::string_view(generic), module}) {
    for (std::string_view suffix : Suffixes(candidate)) {
      for (const ResolvedEntry& e : plan.entries) {
        if (e.pattern == suffix) return &e;
      }
    }
  }
  return nullptr;
}

Result<LayoutDescriptor> TensorLayout(const ResolvedEntry* entry, std::string_view tensor_name,
                                      const Shape& shape) {
  LayoutDescriptor replicated;  // family kReplicated
  if (entry == nullptr || entry->effect == StyleEffect::kNone || shape.empty()) return replicated;
  const int ndim = static_cast<int>(shape.size());
  int dim = 0;
  bool packed = false;
  switch (entry->effect) {
    case StyleEffect::kNone:
      return replicated;
    case StyleEffect::kSplitOut:
      dim = ndim >= 2 ? ndim - 2 : 0;
      break;
    case StyleEffect::kSplitIn:
      if (ndim < 2) return replicated;  // the bias is added once, after the reduction
      dim = ndim - 1;
      break;
    case StyleEffect::kPackedOut:
      dim = ndim >= 2 ? ndim - 2 : 0;
      packed = true;
      break;
    case StyleEffect::kPackedIn:
      if (ndim < 2) return replicated;
      dim = ndim - 1;
      packed = true;
      break;
    case StyleEffect::kEmbeddingVocab:
      dim = 0;
      break;
    case StyleEffect::kEmbeddingHidden:
      if (ndim < 2) return replicated;
      dim = 1;
      break;
    case StyleEffect::kExperts:
      dim = 0;
      break;
  }
  const Index extent = Extent(shape, dim);
  if (entry->count) {
    const Index unit = packed ? 2 * *entry->count : *entry->count;
    // A split that replicates above its count (vLLM's key/value heads) is not laid out here.
    if (extent % unit != 0) {
      return InvalidArgumentError(fmt::format(
          "tensor \"{}\" (shape [{}]) disagrees with the config: {} ({}) splits {} {}{}, but "
          "its dim {} has {}, not a multiple of {}",
          tensor_name, fmt::join(shape, ", "), entry->pattern, entry->style, *entry->count,
          entry->meaning, packed ? " in each of two packed halves" : "", dim, extent, unit));
    }
  }
  LayoutDescriptor d;
  d.dim = dim;
  // transformers' DTensor shards: ceil(extent / world) per rank, a short or empty last rank
  // (identical to an exact split whenever the count divides the degree).
  d.rule.remainder = entry->uneven ? Remainder::kCeil : Remainder::kExact;
  if (packed) {
    d.family = LayoutFamily::kFused;
    d.equal_parts = 2;
  } else {
    d.family = LayoutFamily::kSplit;
  }
  return d;
}

namespace {

// A load conversion consuming `name` (as stored, or as transformers renames it), if any.
std::optional<std::string> ConversionRefusal(const ModelPlan& plan, std::string_view name,
                                             std::string_view renamed) {
  for (const auto& [model_type, conversion] : plan.load_conversions) {
    for (const std::string& source : conversion.sources) {
      if (!MatchesConversionSource(source, renamed) && !MatchesConversionSource(source, name))
        continue;
      return fmt::format(
          "tensor \"{}\": transformers {} converts it when it loads a {} model ({} -> {} by "
          "{}) and then applies its plan to the result; reshard lays out checkpoint tensors as "
          "stored and does not express that conversion, so it refuses rather than place the "
          "tensor differently from transformers. Shard a checkpoint that stores {} as "
          "transformers holds it, or let transformers split this one",
          name, plan.registry->transformers_version, model_type,
          fmt::join(conversion.sources, " + "), conversion.target,
          fmt::join(conversion.operations, ", "), conversion.target);
    }
  }
  return std::nullopt;
}

}  // namespace

Result<TensorMap> PlanTensorMap(const ModelPlan& plan, int tp, std::string_view tensor_name,
                                const Shape& shape) {
  // transformers renames checkpoint keys before it matches its plan (Mixtral's
  // block_sparse_moe -> mlp, EXAONE's transformer.h -> model.layers); the output keeps the
  // stored name.
  const std::string renamed = ApplyLoadRenames(plan.load_renames, tensor_name);
  if (std::optional<std::string> refusal = ConversionRefusal(plan, tensor_name, renamed))
    return FailedPreconditionError(*refusal);
  const ResolvedEntry* entry = MatchPlanEntry(plan, renamed);
  Result<LayoutDescriptor> layout = TensorLayout(entry, tensor_name, shape);
  // A shape that disagrees with the config is a failed check of well-formed input.
  if (!layout.ok()) return FailedPreconditionError(layout.status().message());
  Result<ParamMap> map = BuildMap(*layout, shape, tp);
  if (!map.ok()) {
    return map.status().Annotate(
        fmt::format("tensor \"{}\"{}", tensor_name,
                    entry ? fmt::format(" ({} {})", entry->pattern, entry->style) : ""));
  }
  return TensorMap{*std::move(map), *std::move(layout)};
}

Result<ConfigMaps> ConfigMaps::FromConfigJson(const TpRegistry& registry,
                                              std::string_view config_json, int tp,
                                              const PlanOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(ModelConfig config, ReadModelConfigJson(registry, config_json));
  return FromPlan(ResolvePlan(registry, config, options), tp);
}

Result<ConfigMaps> ConfigMaps::FromPlan(ModelPlan plan, int tp) {
  if (plan.engine != Engine::kTransformers) {
    return UnimplementedError(
        "model maps follow transformers' layouts; vLLM's (replicated key/value heads, padded "
        "vocabulary) are not generated");
  }
  if (tp < 1) return InvalidArgumentError(fmt::format("tp {}: expected a positive degree", tp));
  if (plan.refusal) return FailedPreconditionError(plan.refusal->message);
  // The gate the degree planner uses, asked again entry by entry: the two refuse one set.
  for (const ResolvedEntry& e : plan.entries) {
    Result<StyleEffect> effect = ResolveStyle(*plan.registry, e.style);
    if (!effect.ok()) return effect.status().Annotate(fmt::format("{} ({})", e.pattern, e.style));
  }
  const DegreeAnswer answer = PlanDegree(plan, tp);
  if (answer.refusal) return FailedPreconditionError(answer.refusal->message);
  return ConfigMaps(std::move(plan), tp);
}

Result<MapDocument> ModelMaps(const ModelPlan& plan, int tp,
                              const std::vector<std::pair<std::string, Shape>>& tensors) {
  RESHARD_ASSIGN_OR_RETURN(ConfigMaps maps, ConfigMaps::FromPlan(plan, tp));
  MapDocument doc;
  for (const auto& [name, shape] : tensors) {
    RESHARD_ASSIGN_OR_RETURN(TensorMap m, maps.Map(name, shape));
    doc.params.emplace_back(name, std::move(m.map));
  }
  return doc;
}

}  // namespace reshard
