#include "reshard/hf/model_maps.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>

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

Status CheckLaidOutDistributedConfig(const DistributedConfig& d, int world) {
  if (!d.not_laid_out.empty()) {
    return InvalidArgumentError(fmt::format(
        "distributed config: {} set, but the maps lay out tensor and expert parallelism only "
        "(tp_size, tp_plan, ep_size, ep_plan, enable_expert_parallel): a layout over those "
        "would not be what transformers builds; leave {} out",
        fmt::join(d.not_laid_out, ", "), d.not_laid_out.size() == 1 ? "it" : "them"));
  }
  if (d.tp_size && *d.tp_size != world) {
    return InvalidArgumentError(fmt::format(
        "distributed config: tp_size {} and the {} processes of the layout disagree: give one, "
        "or make them equal",
        *d.tp_size, world));
  }
  return Status::Ok();
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
  RESHARD_RETURN_IF_ERROR(CheckLaidOutDistributedConfig(plan.distributed, tp));
  // One process splits nothing: a model without a plan is laid out whole.
  if (tp == 1 && plan.refusal && plan.refusal->reason == "no_tp_plan") {
    plan.refusal.reset();
    plan.entries.clear();
    return ConfigMaps(std::move(plan), tp);
  }
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

namespace {

// Where a stacked-expert conversion source "<A>*<B>" (one `*`: the expert id) matches a
// renamed tensor name: the name is P + A + digits + B. Returns P and the expert id.
std::optional<std::pair<std::string, int>> MatchExpertSource(std::string_view source,
                                                             std::string_view name) {
  const size_t star = source.find('*');
  if (star == std::string_view::npos || source.find('*', star + 1) != std::string_view::npos)
    return std::nullopt;
  const std::string_view a = source.substr(0, star), b = source.substr(star + 1);
  if (name.size() < a.size() + b.size() + 1 || !name.ends_with(b)) return std::nullopt;
  const size_t digits_end = name.size() - b.size();
  for (size_t start = name.rfind(a); start != std::string_view::npos;
       start = start == 0 ? std::string_view::npos : name.rfind(a, start - 1)) {
    const size_t d = start + a.size();
    if (d >= digits_end) continue;
    const std::string_view id = name.substr(d, digits_end - d);
    if (id.size() > 6 || !std::all_of(id.begin(), id.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c));
        }))
      continue;
    return std::pair{std::string(name.substr(0, start)), std::stoi(std::string(id))};
  }
  return std::nullopt;
}

// One stacked buffer being collected: its conversion, and per member the experts' tensors.
struct StackGroup {
  const LoadConversion* conversion = nullptr;
  std::string buffer;
  // members[m][expert id] = index into the checkpoint's tensors
  std::vector<std::map<int, size_t>> members;
};

// Whether a renamed tensor name holds stacked experts: a component "experts" followed by one
// that is not an expert id ("mlp.experts.gate_up_proj", not "mlp.experts.3.w1.weight").
bool IsStackedExpertsName(std::string_view name) {
  for (size_t at = name.find("experts."); at != std::string_view::npos;
       at = name.find("experts.", at + 1)) {
    if (at != 0 && name[at - 1] != '.') continue;
    const std::string_view next = name.substr(at + 8);
    if (!next.empty() && !std::isdigit(static_cast<unsigned char>(next[0]))) return true;
  }
  return false;
}

// Every MoE layer's experts are the model's: each stacked group holds (per member) as many
// experts as the config gives (or, when it gives none, as the first group), and so does dim 0 of
// every tensor stored stacked (gpt-oss' experts.gate_up_proj and down_proj).
Status CheckExpertCounts(const ModelPlan& plan, const std::vector<StoredTensor>& tensors,
                         const std::vector<StackGroup>& groups,
                         const std::vector<std::optional<std::pair<size_t, size_t>>>& stacked) {
  std::optional<int64_t> expected = plan.experts;
  std::string first;  // what set `expected` when the config does not
  const auto check = [&](int64_t n, const std::string& what) -> Status {
    if (!expected) {
      expected = n;
      first = what;
      return Status::Ok();
    }
    if (n == *expected) return Status::Ok();
    return FailedPreconditionError(fmt::format(
        "{} holds {} experts, but {}: the config does not describe this checkpoint (or an "
        "expert's tensor is missing)",
        what, n,
        first.empty() ? fmt::format("config.json's model has {} (num_local_experts / num_experts "
                                    "/ n_routed_experts)",
                                    *expected)
                      : fmt::format("{} holds {}", first, *expected)));
  };
  for (const StackGroup& g : groups) {
    for (size_t m = 0; m < g.members.size(); ++m) {
      RESHARD_RETURN_IF_ERROR(check(static_cast<int64_t>(g.members[m].size()),
                                    fmt::format("\"{}\" (from the checkpoint's \"{}\" tensors)",
                                                g.buffer, g.conversion->sources[m])));
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (stacked[i] || tensors[i].shape.empty()) continue;
    if (!IsStackedExpertsName(ApplyLoadRenames(plan.load_renames, tensors[i].name))) continue;
    RESHARD_RETURN_IF_ERROR(
        check(tensors[i].shape[0], fmt::format("tensor \"{}\" (shape {}, experts along dim 0)",
                                               tensors[i].name, FormatShape(tensors[i].shape))));
  }
  return Status::Ok();
}

// Which tensors stack into which buffers (transformers' load conversions: one buffer per
// group, a member per conversion source), in first-seen order; stacked[i] = (group, member) of
// tensor i.
Result<std::vector<StackGroup>> GroupStackedExperts(
    const ModelPlan& plan, const std::vector<StoredTensor>& tensors,
    std::vector<std::optional<std::pair<size_t, size_t>>>& stacked) {
  std::vector<StackGroup> groups;
  std::map<std::string, size_t> group_of_buffer;
  for (size_t i = 0; i < tensors.size(); ++i) {
    // Adam's moments ("<param>.exp_avg", ".exp_avg_sq") and the fp32 master weight (".fp32")
    // stack as their parameter does, into a buffer of the same suffix.
    std::string_view base = tensors[i].name, suffix;
    for (std::string_view s : {std::string_view(".exp_avg_sq"), std::string_view(".exp_avg"),
                               std::string_view(".fp32")}) {
      if (base.size() > s.size() && base.ends_with(s)) {
        suffix = s;
        base.remove_suffix(s.size());
        break;
      }
    }
    const std::string renamed = ApplyLoadRenames(plan.load_renames, base);
    for (const auto& [model_type, conversion] : plan.load_conversions) {
      for (size_t m = 0; m < conversion.sources.size() && !stacked[i]; ++m) {
        auto hit = MatchExpertSource(conversion.sources[m], renamed);
        if (!hit) continue;
        const std::string buffer = hit->first + conversion.target + std::string(suffix);
        auto [it, fresh] = group_of_buffer.try_emplace(buffer, groups.size());
        if (fresh) {
          groups.push_back(
              {&conversion, buffer, std::vector<std::map<int, size_t>>(conversion.sources.size())});
        }
        StackGroup& g = groups[it->second];
        if (!g.members[m].emplace(hit->second, i).second) {
          return FailedPreconditionError(
              fmt::format("tensors \"{}\" and \"{}\" are both expert {} of \"{}\"", tensors[i].name,
                          tensors[g.members[m][hit->second]].name, hit->second, buffer));
        }
        stacked[i] = std::pair{it->second, m};
      }
      if (stacked[i]) break;
    }
  }
  return groups;
}

// One stacked group laid out: its buffer (into `buffers`) and each member expert's map (into
// `stacked_maps`, by tensor index), split as the stacked tensor's plan entry says.
Status LayOutStackGroup(const StackGroup& g, const ModelPlan& plan,
                        const std::vector<StoredTensor>& tensors, int world,
                        BufferSetBuilder& buffers,
                        std::map<size_t, CheckpointTensorMap>& stacked_maps) {
  const size_t experts = g.members[0].size();
  std::vector<ExpertMember> members;
  DType dtype = tensors[g.members[0].begin()->second].dtype;
  for (size_t m = 0; m < g.members.size(); ++m) {
    const auto& by_expert = g.members[m];
    const std::string& source = g.conversion->sources[m];
    if (by_expert.size() != experts || by_expert.rbegin()->first != static_cast<int>(experts) - 1) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": transformers stacks {} experts' \"{}\" tensors into it, but the checkpoint "
          "holds {} of them (ids {} to {}); every expert 0..E-1 needs each of {}",
          g.buffer, experts, source, by_expert.size(), by_expert.begin()->first,
          by_expert.rbegin()->first, fmt::join(g.conversion->sources, ", ")));
    }
    const StoredTensor& first = tensors[by_expert.begin()->second];
    for (const auto& [e, i] : by_expert) {
      if (tensors[i].shape != first.shape || tensors[i].dtype != dtype) {
        return FailedPreconditionError(
            fmt::format("\"{}\" ({} {}) does not stack with \"{}\" ({} {}) into \"{}\"",
                        tensors[i].name, DTypeName(tensors[i].dtype), FormatShape(tensors[i].shape),
                        first.name, DTypeName(dtype), FormatShape(first.shape), g.buffer));
      }
    }
    // The member's name pattern for BuildStackedExpertMaps: its first expert's name with the
    // id replaced (names are matched back by expert id below).
    members.push_back({std::string(), first.shape, -1, 0, {}});
  }
  // The stacked tensor is [E, member...] (members concatenated along member dim 0, the
  // stacked dim 1: Concatenate(dim=1)); its plan entry says how it is split.
  std::string_view stacked_name = g.buffer;
  for (std::string_view s :
       {std::string_view(".exp_avg_sq"), std::string_view(".exp_avg"), std::string_view(".fp32")}) {
    if (stacked_name.ends_with(s)) stacked_name.remove_suffix(s.size());
  }
  const ResolvedEntry* entry = MatchPlanEntry(plan, stacked_name);
  const StyleEffect effect = entry ? entry->effect : StyleEffect::kNone;
  const size_t nd = members[0].shape.size();
  RankOrder order{1, world, true};
  ExpertPlacement placement{static_cast<int>(experts), {{}}};
  for (int e = 0; e < static_cast<int>(experts); ++e) placement.experts[0].push_back(e);
  int split_dim = -1;  // of the member
  switch (effect) {
    case StyleEffect::kNone:
      break;
    case StyleEffect::kExperts: {
      Result<ExpertPlacement> p = ContiguousExperts(static_cast<int>(experts), world);
      if (!p.ok()) return FailedPreconditionError(p.status().message()).Annotate(g.buffer);
      placement = *std::move(p);
      order = RankOrder{world, 1, true};
      break;
    }
    case StyleEffect::kPackedOut:
    case StyleEffect::kSplitOut:
      // The stacked dim ndim-2 (>= 1) is the member's dim ndim-3... of [E, rows, cols]: rows.
      split_dim = static_cast<int>(nd) - 2;
      break;
    case StyleEffect::kPackedIn:
    case StyleEffect::kSplitIn:
      split_dim = static_cast<int>(nd) - 1;
      break;
    default:
      return FailedPreconditionError(
          fmt::format("\"{}\" ({} {}): reshard does not lay out stacked experts under this style",
                      g.buffer, entry->pattern, entry->style));
  }
  for (ExpertMember& m : members) {
    m.split_dim = split_dim;
    m.name = "{e}";
  }
  Result<StackedExpertMaps> built =
      BuildStackedExpertMaps(g.buffer, dtype, members, placement, order);
  if (!built.ok()) {
    return FailedPreconditionError(built.status().message())
        .Annotate(fmt::format("\"{}\"{}", g.buffer,
                              entry ? fmt::format(" ({} {})", entry->pattern, entry->style) : ""));
  }
  // built->maps are per member, per expert id in order ("{e}" -> the id).
  for (size_t m = 0; m < g.members.size(); ++m) {
    for (const auto& [e, i] : g.members[m]) {
      ParamMap map = built->maps[m * experts + static_cast<size_t>(e)].second;
      stacked_maps.emplace(i, CheckpointTensorMap{tensors[i].name, std::move(map), std::nullopt});
    }
  }
  buffers.add(std::move(built->buffer));
  return Status::Ok();
}

}  // namespace

Result<CheckpointMaps> PlanCheckpointMaps(const ConfigMaps& maps,
                                          const std::vector<StoredTensor>& tensors) {
  const ModelPlan& plan = maps.plan();
  const int world = maps.tp();
  CheckpointMaps out;
  std::vector<std::optional<std::pair<size_t, size_t>>> stacked(tensors.size());  // group, member
  RESHARD_ASSIGN_OR_RETURN(const std::vector<StackGroup> groups,
                           GroupStackedExperts(plan, tensors, stacked));
  RESHARD_RETURN_IF_ERROR(CheckExpertCounts(plan, tensors, groups, stacked));
  // The buffers and the maps of their members.
  std::map<size_t, CheckpointTensorMap> stacked_maps;
  for (const StackGroup& g : groups) {
    RESHARD_RETURN_IF_ERROR(LayOutStackGroup(g, plan, tensors, world, out.buffers, stacked_maps));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (auto it = stacked_maps.find(i); it != stacked_maps.end()) {
      out.tensors.push_back(std::move(it->second));
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(TensorMap m, maps.Map(tensors[i].name, tensors[i].shape));
    // A tensor transformers renames at load (Mixtral's block_sparse_moe -> mlp) is held under
    // its new name: a buffer of that name holding the tensor alone, so that the rank files use
    // transformers' names while the checkpoint's (gather's) stay.
    const std::string renamed = ApplyLoadRenames(plan.load_renames, tensors[i].name);
    if (renamed != tensors[i].name) {
      ParamMapBuilder b(m.map);
      BufferDecl decl{renamed, tensors[i].dtype, {}};
      for (Rank r = 0; r < m.map.world_size(); ++r) {
        b.set_buffer(r, renamed);
        decl.ranks.push_back({m.map.rank(r).shard_shape, {}});
      }
      RESHARD_ASSIGN_OR_RETURN(ParamMap held, b.Finalize());
      out.buffers.add(std::move(decl));
      out.tensors.push_back({tensors[i].name, std::move(held), std::nullopt});
      continue;
    }
    out.tensors.push_back({tensors[i].name, std::move(m.map), std::move(m.layout)});
  }
  return out;
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
