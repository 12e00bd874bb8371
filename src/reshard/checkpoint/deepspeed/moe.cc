#include "reshard/checkpoint/deepspeed/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>
#include <set>

#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_writer.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/basic.h"
#include "reshard/layouts/deepspeed_meta.h"

namespace reshard {

namespace fs = std::filesystem;
using Value = nlohmann::json;

namespace {

constexpr size_t Slot(DeepSpeedState s) { return static_cast<size_t>(s); }
constexpr const char* kWeights[] = {"w1", "w2", "w3"};

Shape RowMajorStrides(const Shape& shape) {
  Shape s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

// ---- the object tree (the dense reader's helpers, for the keys AutoEP adds) --------------

using internal::Get;
using internal::IsNone;
using internal::ToJson;
using internal::Walk;

// The element of F that a piece puts at element `dest` of its rank's shard, if it covers it.
std::optional<Index> SourceOf(const Piece& p, Index dest) {
  Index rel = dest - p.dest.offset;
  if (rel < 0) return std::nullopt;
  std::vector<size_t> dims(p.shape.size());
  std::iota(dims.begin(), dims.end(), 0);
  std::sort(dims.begin(), dims.end(),
            [&](size_t a, size_t b) { return p.dest.strides[a] > p.dest.strides[b]; });
  Index source = p.source.offset;
  for (size_t d : dims) {
    const Index stride = p.dest.strides[d];
    const Index i = stride > 0 ? rel / stride : 0;
    if (i >= p.shape[d]) return std::nullopt;
    rel -= i * stride;
    source += i * p.source.strides[d];
  }
  if (rel != 0) return std::nullopt;
  return source;
}

}  // namespace

// ---- AutoEP affine maps ------------------------------------------------------------------

Result<std::string> AutoEpAffineMapJson(const ExpertPlacement& placement,
                                        const Shape& logical_shape) {
  RESHARD_RETURN_IF_ERROR(placement.Validate());
  if (logical_shape.empty() || logical_shape[0] != placement.num_experts) {
    return InvalidArgumentError(
        fmt::format("an expert parameter's shape must start with its {} experts; got {}",
                    placement.num_experts, FormatShape(logical_shape)));
  }
  const Shape inner(logical_shape.begin() + 1, logical_shape.end());
  const Index per_expert = ProductOf(inner);
  const Shape source_strides = RowMajorStrides(logical_shape);
  const std::vector<std::vector<ExpertSlot>> slots = placement.SlotsByExpert();
  auto holders_of = [&](int e) {
    std::vector<int> holders;
    for (const ExpertSlot& s : slots[static_cast<size_t>(e)]) holders.push_back(s.rank);
    return holders;
  };
  Value ranks = Value::object();
  for (int k = 0; k < placement.ep_size(); ++k) {
    const std::vector<int>& experts = placement.experts[static_cast<size_t>(k)];
    Shape shard = inner;
    shard.insert(shard.begin(), static_cast<Index>(experts.size()));
    const Shape dest_strides = RowMajorStrides(shard);
    Value pieces = Value::array();
    size_t start = 0;
    for (size_t i = 1; i <= experts.size(); ++i) {
      // A run continues through consecutive ids held by this rank alone.
      const bool run = i < experts.size() && experts[i] == experts[i - 1] + 1 &&
                       slots[static_cast<size_t>(experts[i])].size() == 1 &&
                       slots[static_cast<size_t>(experts[i - 1])].size() == 1;
      if (run) continue;
      Shape shape = inner;
      shape.insert(shape.begin(), static_cast<Index>(i - start));
      pieces.push_back({{"shape", shape},
                        {"source", {experts[start] * per_expert, source_strides}},
                        {"dest", {static_cast<Index>(start) * per_expert, dest_strides}},
                        {"locations", holders_of(experts[start])}});
      start = i;
    }
    ranks[std::to_string(k)] = {{"shard_shape", shard}, {"pieces", pieces}};
  }
  return Value{{"logical_shape", logical_shape}, {"ranks", ranks}}.dump();
}

Result<ParamMap> AutoEpAffineMap(const ExpertPlacement& placement, const Shape& logical_shape) {
  RESHARD_ASSIGN_OR_RETURN(std::string json, AutoEpAffineMapJson(placement, logical_shape));
  return ReadDeepSpeedAffineMap(json);
}

Result<ExpertPlacement> AutoEpPlacementOfMap(const ParamMap& map) {
  const Shape& shape = map.logical_shape();
  if (shape.empty() || shape[0] < 1) {
    return InvalidArgumentError(
        fmt::format("an expert parameter's map has shape {}: its first dimension is not experts",
                    FormatShape(shape)));
  }
  ExpertPlacement placement;
  placement.num_experts = static_cast<int>(shape[0]);
  const Index per_expert = ProductOf(shape) / shape[0];
  for (Rank r = 0; r < map.world_size(); ++r) {
    const Shape& shard = map.rank(r).shard_shape;
    Shape inner(shape.begin() + 1, shape.end());
    if (shard.size() != shape.size() ||
        !std::equal(inner.begin(), inner.end(), shard.begin() + 1)) {
      return InvalidArgumentError(
          fmt::format("EP rank {}: shard shape {} is not whole experts of {}", r,
                      FormatShape(shard), FormatShape(shape)));
    }
    std::vector<int> experts;
    for (Index slot = 0; slot < shard[0]; ++slot) {
      std::optional<Index> source;
      for (const Piece& p : map.rank(r).pieces) {
        if ((source = SourceOf(p, slot * per_expert))) break;
      }
      if (!source || per_expert == 0 || *source % per_expert != 0) {
        return InvalidArgumentError(
            fmt::format("EP rank {}, slot {}: the map does not start an expert there", r, slot));
      }
      experts.push_back(static_cast<int>(*source / per_expert));
    }
    placement.experts.push_back(std::move(experts));
  }
  RESHARD_RETURN_IF_ERROR(placement.Validate());
  Result<ParamMap> again = AutoEpAffineMap(placement, shape);
  if (!again.ok() || *again != map) {
    return InvalidArgumentError(
        "the map moves parts of experts, or experts in pieces AutoEP would not record: it is "
        "not a placement's map");
  }
  return placement;
}

// ---- reading -----------------------------------------------------------------------------

namespace {

// One EP rank's flat tensors of the expert group in the files of its expert-DP ranks.
struct ExpertGroupFiles {
  std::vector<const TorchFile*> files;                         // per expert-DP rank
  std::vector<std::string> master, exp_avg, exp_avg_sq, step;  // key paths per file
};

Status ReadLayer(const AutoEpInput& in, const PickleTree& t, PickleNodeId entry,
                 DeepSpeedExperts& out) {
  const Value e = ToJson(t, entry);
  auto str = [&](const char* key) -> Result<std::string> {
    if (!e.contains(key) || !e[key].is_string())
      return InvalidArgumentError(fmt::format("{} is missing or not a string", key));
    return e[key].get<std::string>();
  };
  auto integer = [&](const char* key) -> Result<int> {
    if (!e.contains(key) || !e[key].is_number_integer() || e[key].get<int64_t>() < 0 ||
        e[key].get<int64_t>() > (1 << 24))
      return InvalidArgumentError(fmt::format("{} is missing or not a count", key));
    return e[key].get<int>();
  };
  AutoEpLayer layer;
  layer.entry = entry;
  RESHARD_ASSIGN_OR_RETURN(layer.moe_layer_id, integer("moe_layer_id"));
  RESHARD_ASSIGN_OR_RETURN(layer.module_path, str("module_path"));
  RESHARD_ASSIGN_OR_RETURN(layer.prefix, str("expert_key_prefix"));
  // AutoEP's layer at module_path holds its experts and its router: both named under it.
  if (!layer.prefix.starts_with(layer.module_path + ".")) {
    return InvalidArgumentError(
        fmt::format("expert_key_prefix \"{}\" does not lie in module_path \"{}\" (AutoEP keeps "
                    "a layer's experts in its module)",
                    layer.prefix, layer.module_path));
  }
  if (const std::string router = layer.module_path + ".router.gate.weight";
      std::find(in.names.begin(), in.names.end(), router) == in.names.end()) {
    return InvalidArgumentError(fmt::format(
        "module_path \"{}\": its router \"{}\" is not in param_shapes", layer.module_path, router));
  }
  RESHARD_ASSIGN_OR_RETURN(const int num_experts, integer("num_experts"));
  RESHARD_ASSIGN_OR_RETURN(const int num_local, integer("num_local_experts"));
  RESHARD_ASSIGN_OR_RETURN(const int ep, integer("ep_size"));
  if (e.contains("checkpoint_format") && e["checkpoint_format"] != "per_expert_files") {
    return UnimplementedError(
        fmt::format("checkpoint_format is {}: only AutoEP's per-expert files (ZeRO 0-2) are read; "
                    "DeepSpeed does not convert its ZeRO 3 partitioned experts either",
                    e["checkpoint_format"].dump()));
  }
  if (e.contains("expert_placement") && !e["expert_placement"].is_null()) {
    Result<ExpertPlacement> p = ParseExpertPlacementJson(e["expert_placement"].dump());
    if (!p.ok()) return p.status().Annotate("expert_placement");
    layer.placement = *std::move(p);
  } else {  // before placement descriptors: contiguous, num_local_experts each
    RESHARD_ASSIGN_OR_RETURN(layer.placement, ContiguousExperts(num_experts, ep));
  }
  const ExpertPlacement& placement = layer.placement;
  if (placement.num_experts != num_experts || placement.ep_size() != ep) {
    return InvalidArgumentError(
        fmt::format("expert_placement has {} experts over {} ranks, but the layer says {} over {}",
                    placement.num_experts, placement.ep_size(), num_experts, ep));
  }
  for (const std::vector<int>& held : placement.experts) {
    if (static_cast<int>(held.size()) != num_local) {
      return UnimplementedError(fmt::format(
          "an uneven placement ({} experts on one rank, num_local_experts {}): DeepSpeed names "
          "the expert files by EP rank x num_local_experts + slot, which then collide",
          held.size(), num_local));
    }
  }
  if (!out.layers.empty() && ep != out.ep_size) {
    return InvalidArgumentError(
        fmt::format("ep_size {} differs from the first layer's {} (DeepSpeed keeps one EP group)",
                    ep, out.ep_size));
  }
  out.ep_size = ep;
  if (in.dp % ep != 0) {
    return InvalidArgumentError(
        fmt::format("ep_size {} does not divide the {} DP ranks that hold the experts", ep, in.dp));
  }
  const size_t layer_index = out.layers.size();
  const Value maps = e.contains("affine_maps") ? e["affine_maps"] : Value();
  if (maps.is_object() && maps.value("version", 0) != 1) {
    return InvalidArgumentError(
        fmt::format("affine_maps: version {} is not 1", maps.value("version", Value()).dump()));
  }
  for (const char* w : kWeights) {
    const std::string name = layer.prefix + "." + w;
    auto at = std::find(in.names.begin(), in.names.end(), name);
    if (at == in.names.end()) {
      return InvalidArgumentError(
          fmt::format("expert parameter \"{}\" is not in param_shapes", name));
    }
    const Shape& local = in.shapes[static_cast<size_t>(at - in.names.begin())];
    if (local.empty() || local[0] != num_local) {
      return InvalidArgumentError(
          fmt::format("param_shapes gives \"{}\" the shape {}, not {} experts first", name,
                      FormatShape(local), num_local));
    }
    Shape logical = local;
    logical[0] = num_experts;
    Result<ParamMap> derived = AutoEpAffineMap(placement, logical);
    if (!derived.ok()) return derived.status().Annotate(name);
    AutoEpParam p{name, w, layer_index, *std::move(derived), {}, {}};
    if (maps.is_object() && maps.contains("params") && maps["params"].contains(p.name)) {
      Result<ParamMap> recorded = ReadDeepSpeedAffineMap(maps["params"][p.name].dump());
      if (!recorded.ok()) {
        return recorded.status().Annotate(fmt::format("affine_maps.params[\"{}\"]", p.name));
      }
      if (*recorded != p.ep_map) {
        return InvalidArgumentError(fmt::format(
            "affine_maps.params[\"{}\"] disagrees with the expert placement descriptor", p.name));
      }
    }
    p.spans.resize(static_cast<size_t>(ep));
    out.params.push_back(std::move(p));
  }
  out.layers.push_back(std::move(layer));
  return Status::Ok();
}

// The module weights: expert file f holds slot f mod E_k of EP rank f div E_k.
Status ReadExpertFiles(const AutoEpInput& in, DeepSpeedExperts& out) {
  bool first = true;
  for (AutoEpParam& p : out.params) {
    const AutoEpLayer& layer = out.layers[p.layer];
    const Shape inner(p.ep_map.logical_shape().begin() + 1, p.ep_map.logical_shape().end());
    const Index n = ProductOf(inner);
    for (int k = 0; k < out.ep_size; ++k) {
      const auto& held = layer.placement.experts[static_cast<size_t>(k)];
      for (size_t slot = 0; slot < held.size(); ++slot) {
        const size_t f = static_cast<size_t>(k) * held.size() + slot;
        RESHARD_ASSIGN_OR_RETURN(
            const TorchFile* file,
            in.open(fmt::format("layer_{}_expert_{}_mp_rank_00_model_states.pt", layer.moe_layer_id,
                                f)));
        const std::string key = fmt::format("{}.{}.{}", layer.prefix, p.weight, f);
        const TorchTensor* tensor = file->TensorAt(Get(file->tree(), file->tree().root(), key));
        if (tensor == nullptr || tensor->shape != inner || !tensor->dtype.dtype ||
            !tensor->is_contiguous()) {
          return InvalidArgumentError(
              fmt::format("\"{}\": \"{}\" is missing or is not a dense tensor of shape {}",
                          in.where(file), key, FormatShape(inner)));
        }
        if (first) out.module_dtype = *tensor->dtype.dtype;
        first = false;
        if (*tensor->dtype.dtype != out.module_dtype) {
          return InvalidArgumentError(
              fmt::format("\"{}\": \"{}\" is {}, other experts are {}", in.where(file), key,
                          DTypeName(*tensor->dtype.dtype), DTypeName(out.module_dtype)));
        }
        p.spans[static_cast<size_t>(k)][Slot(DeepSpeedState::kModule)].push_back(
            {static_cast<Index>(slot) * n, n, {file, tensor, 0}});
      }
    }
  }
  return Status::Ok();
}

// Every file of the tag dir named as an expert file is one a layer of ds_autoep_layers names:
// a stray one (another run's, a larger world's) is refused rather than ignored.
Status CheckNoStrayExpertFiles(const AutoEpInput& in, const DeepSpeedExperts& out) {
  static const std::regex kExpertFile(
      "layer_[0-9]+_expert_[0-9]+_mp_rank_[0-9]+_model_states\\.pt");
  std::set<std::string> named;
  for (const AutoEpLayer& layer : out.layers) {
    const size_t files =
        static_cast<size_t>(layer.placement.ep_size()) * layer.placement.experts[0].size();
    for (size_t f = 0; f < files; ++f) {
      named.insert(
          fmt::format("layer_{}_expert_{}_mp_rank_00_model_states.pt", layer.moe_layer_id, f));
    }
  }
  for (const std::string& name : in.files) {
    if (!std::regex_match(name, kExpertFile) || named.contains(name)) continue;
    return InvalidArgumentError(
        fmt::format("\"{}\": an expert file that no layer of ds_autoep_layers names (they name "
                    "{} expert files; a file from another run or another world size?)",
                    name, named.size()));
  }
  return Status::Ok();
}

// The element at `k` of an EP rank's flattened shard, from the span holding it, or nullptr.
const std::byte* SpanElement(const std::vector<AutoEpSpan>& spans, Index k, size_t size,
                             const AutoEpSpan** holder) {
  auto it = std::upper_bound(spans.begin(), spans.end(), k,
                             [](Index v, const AutoEpSpan& s) { return v < s.start; });
  if (it == spans.begin()) return nullptr;
  --it;
  if (k >= it->start + it->length) return nullptr;
  *holder = &*it;
  const TorchTensor& t = *it->where.tensor;
  return it->where.file->storages()[t.storage].bytes.data() +
         static_cast<size_t>(t.storage_offset + it->where.offset + (k - it->start)) * size;
}

// DeepSpeed copies the fp32 masters into the module after each step, experts included: every
// element of an expert file is its master (in the expert-DP ranks' optimizer files, which the
// run's metadata ties together) rounded to the module's dtype. The first and last elements of
// every expert file and of every fragment are compared (a bounded sample), so an expert file
// from another run is refused naming it.
Status CheckExpertModulesAreMastersRounded(const AutoEpInput& in, const DeepSpeedExperts& out) {
  constexpr Index kEnds = 16;
  const size_t module_size = DTypeSize(out.module_dtype);
  for (const AutoEpParam& p : out.params) {
    for (size_t k = 0; k < p.spans.size(); ++k) {
      const auto& module = p.spans[k][Slot(DeepSpeedState::kModule)];
      const auto& master = p.spans[k][Slot(DeepSpeedState::kMaster)];
      std::vector<Index> positions;
      for (const auto* spans : {&module, &master}) {
        for (const AutoEpSpan& s : *spans) {
          for (Index i = 0; i < std::min(s.length, kEnds); ++i) positions.push_back(s.start + i);
          for (Index i = std::max(kEnds, s.length - kEnds); i < s.length; ++i) {
            positions.push_back(s.start + i);
          }
        }
      }
      std::sort(positions.begin(), positions.end());
      positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
      for (const Index at : positions) {
        const AutoEpSpan* module_span = nullptr;
        const AutoEpSpan* master_span = nullptr;
        const std::byte* w = SpanElement(module, at, module_size, &module_span);
        const std::byte* m = SpanElement(master, at, sizeof(float), &master_span);
        if (w == nullptr || m == nullptr || IsMasterRounded(out.module_dtype, w, m)) continue;
        return InvalidArgumentError(fmt::format(
            "\"{}\" does not belong with \"{}\": expert parameter \"{}\" (EP rank {}), element {} "
            "of the file's expert is {} there but its fp32 master weight is {} (a file from "
            "another run or another step?)",
            in.where(module_span->where.file), in.where(master_span->where.file), p.name, k,
            at - module_span->start, FormatElement(out.module_dtype, w),
            FormatElement(DType::kF32, m)));
      }
    }
  }
  return Status::Ok();
}

// ZeRO 1/2: each EP rank's flat partitions over its expert-DP ranks.
Status ReadExpertPartitions(const AutoEpInput& in, DeepSpeedExperts& out) {
  const int ep = out.ep_size;
  const int edp = in.dp / ep;
  std::map<std::string, size_t> group_of;
  for (size_t i = 0; i < in.names.size(); ++i) group_of[in.names[i]] = in.groups[i];
  for (AutoEpParam& p : out.params) {
    const size_t g = group_of[p.name];
    const Index n = p.ep_map.shard_num_elements(0);
    for (int k = 0; k < ep; ++k) {
      Index covered = 0;
      for (int j = 0; j < edp; ++j) {
        const int d = out.data_before_expert ? k * edp + j : k + ep * j;
        const TorchFile* f = in.optim[static_cast<size_t>(d)];
        const PickleTree& t = f->tree();
        const PickleNodeId frag = Get(
            t, Walk(t, t.root(), fmt::format("optimizer_state_dict.param_slice_mappings.{}", g)),
            p.name);
        const std::string where =
            fmt::format("\"{}\": param_slice_mappings[{}][\"{}\"]", in.where(f), g, p.name);
        if (frag == kNoPickleNode) {
          // ZeRO cuts the group's flat tensor, not each parameter: ranks before the first
          // fragment and after the last hold none of it.
          if (covered == 0 || covered == n) continue;
          return InvalidArgumentError(fmt::format(
              "{} is missing, but EP rank {}'s fragments before it hold {} of {} elements "
              "(DP rank {} is its expert-DP rank {})",
              where, k, covered, n, d, j));
        }
        const PickleNodeId numel_node = Get(t, frag, "numel"), start_node = Get(t, frag, "start");
        if (numel_node == kNoPickleNode || start_node == kNoPickleNode ||
            t.node(numel_node).kind != PickleKind::kInt ||
            t.node(start_node).kind != PickleKind::kInt) {
          return InvalidArgumentError(where + ": not a fragment_address");
        }
        const Index numel = t.node(numel_node).int_value, start = t.node(start_node).int_value;
        const std::string opt = "optimizer_state_dict.base_optimizer_state";
        const PickleNodeId key =
            Walk(t, t.root(), fmt::format("{}.param_groups.{}.params.0", opt, g));
        const std::string state = fmt::format(
            "{}.state.{}", opt, key != kNoPickleNode ? t.node(key).int_value : int64_t{-1});
        const std::pair<DeepSpeedState, std::string> paths[] = {
            {DeepSpeedState::kMaster,
             fmt::format("optimizer_state_dict.single_partition_of_fp32_groups.{}", g)},
            {DeepSpeedState::kExpAvg, state + ".exp_avg"},
            {DeepSpeedState::kExpAvgSq, state + ".exp_avg_sq"}};
        for (const auto& [s, path] : paths) {
          const TorchTensor* tensor = f->TensorAt(Walk(t, t.root(), path));
          if (tensor == nullptr || tensor->shape.size() != 1 || !tensor->is_contiguous() ||
              tensor->dtype.dtype != DType::kF32 || numel < 0 || start < 0 ||
              start > tensor->numel() || numel > tensor->numel() - start || numel > n - covered ||
              (covered > 0 && start != 0)) {
            return InvalidArgumentError(fmt::format(
                "{}: (numel {}, start {}) does not continue EP rank {}'s {} elements inside {}, "
                "a flat F32 tensor (a file from another run?)",
                where, numel, start, k, n, path));
          }
          p.spans[static_cast<size_t>(k)][Slot(s)].push_back({covered, numel, {f, tensor, start}});
        }
        if (p.step.file == nullptr) p.step = {f, Walk(t, t.root(), state + ".step")};
        covered += numel;
      }
      if (covered != n) {
        return InvalidArgumentError(fmt::format(
            "expert parameter \"{}\": EP rank {}'s fragments hold {} of its {} elements (files "
            "from different runs?)",
            p.name, k, covered, n));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::optional<DeepSpeedExperts>> ReadAutoEpExperts(const AutoEpInput& in) {
  const PickleTree& t = in.model_states->tree();
  PickleNodeId list = Get(t, t.root(), "ds_autoep_layers");
  if (IsNone(t, list)) list = Get(t, t.root(), "autoep_layers");
  if (IsNone(t, list)) return std::optional<DeepSpeedExperts>();
  const std::string where = fmt::format("\"{}\": ds_autoep_layers", in.where(in.model_states));
  if (t.node(list).kind != PickleKind::kList) return InvalidArgumentError(where + ": not a list");
  if (in.tp > 1) {
    return UnimplementedError(
        fmt::format("{}: AutoEP folded with AutoTP (TP {}) keeps an expert file per TP rank, which "
                    "DeepSpeed's own converter does not read either",
                    where, in.tp));
  }
  if (in.stage == 3 || in.stage == 0) {
    return UnimplementedError(fmt::format(
        "{}: AutoEP at ZeRO {} is not read (ZeRO 1 and 2 are: their optimizer states are "
        "per-DP-rank partitions)",
        where, in.stage));
  }
  DeepSpeedExperts out;
  const PickleNodeId before = Walk(t, t.root(), "ds_config.use_data_before_expert_parallelism");
  out.data_before_expert = before != kNoPickleNode && t.node(before).kind == PickleKind::kBool &&
                           t.node(before).bool_value;
  const auto& items = t.node(list).items;
  for (size_t i = 0; i < items.size(); ++i) {
    Status s = ReadLayer(in, t, items[i], out);
    if (!s.ok()) return s.Annotate(fmt::format("{}[{}]", where, i));
  }
  if (out.params.empty()) return std::optional<DeepSpeedExperts>();
  // The expert parameters' groups hold nothing else.
  for (size_t i = 0; i < in.names.size(); ++i) {
    for (const AutoEpParam& p : out.params) {
      const auto at = std::find(in.names.begin(), in.names.end(), p.name);
      const size_t g = in.groups[static_cast<size_t>(at - in.names.begin())];
      if (in.groups[i] == g && !ClaimsName(out, in.names[i])) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": param_shapes[{}] holds expert \"{}\" and dense \"{}\"; AutoEP keeps its "
            "experts in groups of their own",
            in.where(in.model_states), g, p.name, in.names[i]));
      }
    }
  }
  RESHARD_RETURN_IF_ERROR(ReadExpertFiles(in, out));
  if (in.optim.size() != static_cast<size_t>(in.dp)) {
    return NotFoundError(
        fmt::format("{}: the optimizer files of the {} DP ranks are missing", where, in.dp));
  }
  RESHARD_RETURN_IF_ERROR(ReadExpertPartitions(in, out));
  RESHARD_RETURN_IF_ERROR(CheckNoStrayExpertFiles(in, out));
  RESHARD_RETURN_IF_ERROR(CheckExpertModulesAreMastersRounded(in, out));
  return std::optional<DeepSpeedExperts>(std::move(out));
}

bool ClaimsName(const DeepSpeedExperts& experts, const std::string& name) {
  return std::any_of(experts.params.begin(), experts.params.end(),
                     [&](const AutoEpParam& p) { return p.name == name; });
}

Status ReadAutoEpShard(const DeepSpeedExperts& experts, size_t i, DeepSpeedState state,
                       Rank ep_rank, Index begin, MutableBuffer out) {
  const AutoEpParam& p = experts.params[i];
  const auto& spans = p.spans[static_cast<size_t>(ep_rank)][Slot(state)];
  if (spans.empty() && p.ep_map.shard_num_elements(ep_rank) > 0) {
    return NotFoundError(fmt::format("the checkpoint holds no {} for expert parameter \"{}\"",
                                     DeepSpeedStateName(state), p.name));
  }
  const size_t size =
      DTypeSize(state == DeepSpeedState::kModule ? experts.module_dtype : DType::kF32);
  const Index end = begin + out.num_elements;
  Index filled = 0;
  for (const AutoEpSpan& s : spans) {
    const Index lo = std::max(begin, s.start), hi = std::min(end, s.start + s.length);
    if (lo >= hi) continue;
    const TorchTensor& t = *s.where.tensor;
    const std::byte* base = s.where.file->storages()[t.storage].bytes.data() +
                            static_cast<size_t>(t.storage_offset + s.where.offset) * size;
    std::memcpy(out.data + static_cast<size_t>(lo - begin) * size,
                base + static_cast<size_t>(lo - s.start) * size,
                static_cast<size_t>(hi - lo) * size);
    filled += hi - lo;
  }
  if (filled != out.num_elements) {
    return InternalError(fmt::format("expert parameter \"{}\": EP rank {} covers {} of {} elements",
                                     p.name, ep_rank, filled, out.num_elements));
  }
  return Status::Ok();
}

Status ReadAutoEpFull(const DeepSpeedExperts& experts, size_t i, DeepSpeedState state,
                      MutableBuffer out, const CheckpointOptions& options) {
  const AutoEpParam& p = experts.params[i];
  const DType dtype = state == DeepSpeedState::kModule ? experts.module_dtype : DType::kF32;
  std::vector<std::vector<std::byte>> shards(static_cast<size_t>(experts.ep_size));
  std::vector<ConstBuffer> views;
  for (Rank k = 0; k < experts.ep_size; ++k) {
    const Index n = p.ep_map.shard_num_elements(k);
    shards[static_cast<size_t>(k)].resize(static_cast<size_t>(n) * DTypeSize(dtype));
    RESHARD_RETURN_IF_ERROR(
        ReadAutoEpShard(experts, i, state, k, 0, {shards[static_cast<size_t>(k)].data(), n}));
    views.push_back({shards[static_cast<size_t>(k)].data(), n});
  }
  ExecOptions o;
  o.num_threads = 1;
  o.scale_power = state == DeepSpeedState::kExpAvg     ? -1
                  : state == DeepSpeedState::kExpAvgSq ? -2
                                                       : 1;
  o.allow_scaled_optimizer_state = true;
  o.verify_replicas = options.verify_replicas;
  return Rebuild(p.ep_map, dtype, views, out, o);
}

// ---- gather: the model as transformers saves it --------------------------------------------

namespace {

// How a model type's checkpoint names what AutoEP renamed.
struct HfExpertNames {
  std::string block;  // the MoE block's name in the checkpoint ("block_sparse_moe", "mlp")
  std::map<std::string, std::string> weights;  // w1 -> "w1.weight" / "gate_proj.weight"
};

std::optional<HfExpertNames> HfNamesOf(const std::string& model_type) {
  if (model_type == "mixtral") {
    return HfExpertNames{"block_sparse_moe",
                         {{"w1", "w1.weight"}, {"w2", "w2.weight"}, {"w3", "w3.weight"}}};
  }
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe") {
    return HfExpertNames{
        "mlp", {{"w1", "gate_proj.weight"}, {"w2", "down_proj.weight"}, {"w3", "up_proj.weight"}}};
  }
  return std::nullopt;
}

// The checkpoint name of the MoE block at `module_path` ("model.layers.0.mlp").
std::string BlockName(const std::string& module_path, const HfExpertNames& names) {
  const size_t dot = module_path.rfind('.');
  return (dot == std::string::npos ? std::string() : module_path.substr(0, dot + 1)) + names.block;
}

// Gathers the dense parameters (renamed) and every expert's tensors, each whole at world 1.
class AutoEpGatherSource : public ShardSource {
 public:
  AutoEpGatherSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt, DeepSpeedState state)
      : ckpt_(std::move(ckpt)), state_(state) {}

  Status Init(const HfExpertNames& names) {
    const DeepSpeedExperts& ex = *ckpt_->experts();
    manifest_.world_size = 1;
    for (size_t i = 0; i < ckpt_->params().size(); ++i) {
      const DeepSpeedParam& p = ckpt_->params()[i];
      std::string name = p.name;
      for (const AutoEpLayer& layer : ex.layers) {
        const std::string inside = layer.module_path + ".";
        if (!name.starts_with(inside)) continue;
        std::string rest = name.substr(inside.size());
        if (rest != "router.gate.weight") {
          return UnimplementedError(fmt::format(
              "\"{}\" lies in AutoEP layer \"{}\" but is not its router: this reader knows no "
              "transformers name for it (shared experts?)",
              name, layer.module_path));
        }
        name = BlockName(layer.module_path, names) + ".gate.weight";
      }
      manifest_.params.push_back(
          ShardedParam{name, ckpt_->StateDType(state_), p.tp_map, std::nullopt, 1});
      which_.push_back({i, false, 0, 0, 0});
    }
    for (size_t j = 0; j < ex.params.size(); ++j) {
      const AutoEpParam& p = ex.params[j];
      const AutoEpLayer& layer = ex.layers[p.layer];
      const Shape inner(p.ep_map.logical_shape().begin() + 1, p.ep_map.logical_shape().end());
      RESHARD_ASSIGN_OR_RETURN(ParamMap whole, ReplicatedMap(inner, 1));
      const std::vector<std::vector<ExpertSlot>> slots = layer.placement.SlotsByExpert();
      for (int e = 0; e < layer.placement.num_experts; ++e) {
        const auto [k, slot] = slots[static_cast<size_t>(e)].front();
        manifest_.params.push_back(
            ShardedParam{fmt::format("{}.experts.{}.{}", BlockName(layer.module_path, names), e,
                                     names.weights.at(p.weight)),
                         state_ == DeepSpeedState::kModule ? ex.module_dtype : DType::kF32, whole,
                         std::nullopt, 1});
        which_.push_back({j, true, k, slot * ProductOf(inner), ProductOf(inner)});
      }
    }
    return Status::Ok();
  }

  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {ckpt_->tag_dir()};
    for (const std::string& p : ckpt_->file_paths()) inputs.push_back(p);
    return inputs;
  }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const ParamMap& map = manifest_.params[i].map;  // one rank
    return cache_.Acquire(i, map, [&](std::vector<std::vector<std::byte>>& data) {
      const Which& w = which_[i];
      const Index n = map.shard_num_elements(0);
      std::vector<std::byte>& bytes = data[0];
      bytes.resize(static_cast<size_t>(n) * DTypeSize(manifest_.params[i].dtype));
      return w.expert ? ReadAutoEpShard(*ckpt_->experts(), w.index, state_, w.ep_rank, w.begin,
                                        {bytes.data(), n})
                      : ckpt_->ReadTpShard(w.index, state_, 0, {bytes.data(), n});
    });
  }
  void ReleaseShards(size_t i) override { cache_.Release(i); }

 private:
  struct Which {
    size_t index;  // into params() or experts()->params
    bool expert;
    Rank ep_rank;
    Index begin;
    Index count;
  };
  std::shared_ptr<const DeepSpeedCheckpoint> ckpt_;
  DeepSpeedState state_;
  Manifest manifest_;
  std::vector<Which> which_;
  ShardCache cache_;
};

}  // namespace

Status GatherAutoEp(const std::shared_ptr<const DeepSpeedCheckpoint>& ckpt, DeepSpeedState state,
                    const std::string& out_dir, const CheckpointOptions& options) {
  if (ckpt->config_path().empty()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" is an AutoEP checkpoint with no config.json beside it: gather names the "
        "experts as the model's checkpoint does, which needs its model_type (save the model's "
        "config with save_pretrained into the save dir)",
        ckpt->tag_dir()));
  }
  RESHARD_ASSIGN_OR_RETURN(std::string config, ReadFileToString(ckpt->config_path()));
  const Value cfg = Value::parse(config, nullptr, false);
  const std::string model_type =
      cfg.is_object() && cfg.contains("model_type") && cfg["model_type"].is_string()
          ? cfg["model_type"].get<std::string>()
          : "";
  std::optional<HfExpertNames> names = HfNamesOf(model_type);
  if (!names) {
    return UnimplementedError(fmt::format(
        "\"{}\": gather of an AutoEP checkpoint of model type \"{}\": the per-expert names of "
        "its checkpoint are known for mixtral, qwen3_moe and qwen2_moe (a conversion to a "
        "universal checkpoint reads any)",
        ckpt->config_path(), model_type));
  }
  auto source = std::make_unique<AutoEpGatherSource>(ckpt, state);
  RESHARD_RETURN_IF_ERROR(source->Init(*names));
  return GatherFrom(*source, out_dir, options, {{"config.json", std::move(config)}});
}

// ---- universal ----------------------------------------------------------------------------

namespace {

TorchWriteOptions Options(const std::string& path, const TorchWriteOptions& given) {
  TorchWriteOptions o = given;
  o.root = fs::path(path).stem().string();
  return o;
}

// A module tensor as float32, dense (tensor.float()).
Status ModuleTensorAsF32(const TorchFile& f, const TorchTensor& t, std::span<std::byte> out) {
  if (!t.dtype.dtype || (*t.dtype.dtype != DType::kF32 && *t.dtype.dtype != DType::kBF16)) {
    return UnimplementedError(fmt::format(
        "module tensor \"{}\" is {}: only F32 and BF16 module tensors without optimizer state "
        "are written to a universal checkpoint",
        t.name, t.dtype.dtype ? DTypeName(*t.dtype.dtype) : "not a number type"));
  }
  if (*t.dtype.dtype == DType::kF32) return f.CopyTo(t, out);
  std::vector<std::byte> half(static_cast<size_t>(t.numel()) * 2);
  RESHARD_RETURN_IF_ERROR(f.CopyTo(t, half));
  for (size_t k = 0; k < static_cast<size_t>(t.numel()); ++k) {
    uint16_t h;
    std::memcpy(&h, half.data() + 2 * k, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(out.data() + 4 * k, &bits, 4);
  }
  return Status::Ok();
}

// A model-states file with universal_checkpoint_info as ds_to_universal leaves it.
Status RewriteModelStates(const DeepSpeedCheckpoint& c, const TorchFile& f, const std::string& path,
                          const TorchWriteOptions& options) {
  TorchTreeBuilder b;
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId root, b.Copy(f, f.tree().root()));
  const PickleTree& t = b.tree();
  auto entry_of = [&](PickleNodeId dict, std::string_view key) -> PickleNodeId* {
    for (auto& [k, v] : b.mutable_node(dict).entries) {
      if (t.node(k).kind == PickleKind::kStr && t.node(k).text == key) return &v;
    }
    return nullptr;
  };
  PickleNodeId* uc = entry_of(root, "universal_checkpoint_info");
  if (uc == nullptr || t.node(*uc).kind != PickleKind::kDict) {
    const PickleNodeId made = b.Dict();
    if (uc != nullptr) {
      *uc = made;
    } else {
      b.Insert(root, b.Str("universal_checkpoint_info"), made);
    }
    uc = entry_of(root, "universal_checkpoint_info");
  }
  const PickleNodeId uc_dict = *uc;
  const PickleNodeId patterns = b.List({b.Str("\\.experts\\.w[123]$")});
  if (PickleNodeId* p = entry_of(uc_dict, "expert_parameter_patterns")) {
    *p = patterns;
  } else {
    b.Insert(uc_dict, b.Str("expert_parameter_patterns"), patterns);
  }
  // The six fields DeepSpeed keeps of each layer's metadata, in its order.
  constexpr const char* kKept[] = {"moe_layer_id", "module_path",       "expert_key_prefix",
                                   "num_experts",  "num_local_experts", "ep_size"};
  const PickleNodeId layers = b.List();
  for (const AutoEpLayer& layer : c.experts()->layers) {
    const PickleNodeId d = b.Dict();
    for (const char* key : kKept) {
      const PickleTree& ft = f.tree();
      for (const auto& [k, v] : ft.node(layer.entry).entries) {
        if (ft.node(k).kind != PickleKind::kStr || ft.node(k).text != key) continue;
        RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, b.Copy(f, v));
        b.Insert(d, b.Str(key), value);
      }
    }
    b.Append(layers, d);
  }
  if (PickleNodeId* l = entry_of(uc_dict, "ds_autoep_layers")) {
    *l = layers;
  } else {
    b.Insert(uc_dict, b.Str("ds_autoep_layers"), layers);
  }
  return b.Write(path, root, Options(path, options));
}

}  // namespace

std::vector<AutoEpUniversalFile> AutoEpUniversalFiles(
    std::shared_ptr<const DeepSpeedCheckpoint> ckpt, const std::string& folder,
    const CheckpointOptions& options) {
  std::vector<AutoEpUniversalFile> files;
  const DeepSpeedExperts& ex = *ckpt->experts();
  for (size_t i = 0; i < ex.params.size(); ++i) {
    const AutoEpParam& p = ex.params[i];
    const Shape shape = p.ep_map.logical_shape();
    const uint64_t bytes = static_cast<uint64_t>(ProductOf(shape)) * 4;
    const int num_experts = ex.layers[p.layer].placement.num_experts;
    for (DeepSpeedState s :
         {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq}) {
      files.push_back(
          {fmt::format("{}/zero/{}/{}.pt", folder, p.name, DeepSpeedStateName(s)), bytes,
           [ckpt, i, s, shape, num_experts, &options](const std::string& path,
                                                      const TorchWriteOptions& o) -> Status {
             TorchTreeBuilder b;
             const PickleNodeId tensor = b.Tensor(
                 DType::kF32, shape,
                 [&](std::span<std::byte> out) {
                   return ReadAutoEpFull(*ckpt->experts(), i, s,
                                         {out.data(), static_cast<Index>(out.size() / 4)}, options);
                 },
                 s == DeepSpeedState::kMaster);
             const PickleNodeId root = b.Dict({{b.Str("param"), tensor},
                                               {b.Str("cat_dim"), b.Int(0)},
                                               {b.Str("is_expert_param"), b.Bool(true)},
                                               {b.Str("ep_num_experts"), b.Int(num_experts)}});
             return b.Write(path, root, Options(path, o));
           }});
    }
    if (p.step.file != nullptr && p.step.node != kNoPickleNode) {
      files.push_back(
          {fmt::format("{}/zero/{}/step.pt", folder, p.name), 4,
           [step = p.step](const std::string& path, const TorchWriteOptions& o) -> Status {
             TorchTreeBuilder b;
             RESHARD_ASSIGN_OR_RETURN(PickleNodeId root, b.Copy(*step.file, step.node));
             return b.Write(path, root, Options(path, o));
           }});
    }
  }
  // Module tensors that have no optimizer state (AutoEP's gate.gate alias of router.gate):
  // ds_to_universal saves each as zero/<name>/fp32.pt, {"param": tensor.float()}, from the
  // first model-states file that has it.
  std::set<std::string> known;
  for (const DeepSpeedParam& p : ckpt->params()) known.insert(p.name);
  for (const std::string& path : ckpt->model_states_paths()) {
    if (fs::path(path).filename().string().starts_with("layer_")) continue;
    const TorchFile* f = ckpt->FileAt(path);
    if (f == nullptr) continue;
    for (const TorchTensor& t : f->tensors()) {
      if (!t.name.starts_with("module.")) continue;
      const std::string name = t.name.substr(7);
      if (!known.insert(name).second || name.find('/') != std::string::npos) continue;
      files.push_back({fmt::format("{}/zero/{}/fp32.pt", folder, name),
                       static_cast<uint64_t>(t.numel()) * 4,
                       [f, &t](const std::string& out, const TorchWriteOptions& o) -> Status {
                         TorchTreeBuilder b;
                         const PickleNodeId tensor =
                             b.Tensor(DType::kF32, t.shape, [f, &t](std::span<std::byte> bytes) {
                               return ModuleTensorAsF32(*f, t, bytes);
                             });
                         return b.Write(out, b.Dict({{b.Str("param"), tensor}}), Options(out, o));
                       }});
    }
  }
  // The model-states files: TorchFile handles of the opened checkpoint, by path.
  for (const std::string& path : ckpt->model_states_paths()) {
    const std::string base = fs::path(path).filename().string();
    if (base.starts_with("layer_")) continue;  // the expert files are not part of it
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    files.push_back({fmt::format("{}/{}", folder, base), ec ? 0 : size,
                     [ckpt, path](const std::string& out, const TorchWriteOptions& o) -> Status {
                       const TorchFile* f = ckpt->FileAt(path);
                       if (f == nullptr) return InternalError("\"" + path + "\" is not open");
                       return RewriteModelStates(*ckpt, *f, out, o);
                     }});
  }
  return files;
}

// ---- summaries ----------------------------------------------------------------------------

std::string AutoEpSummaryText(const DeepSpeedExperts& ex) {
  std::string out = fmt::format("AutoEP: EP {}, {} MoE layers\n", ex.ep_size, ex.layers.size());
  for (const AutoEpLayer& layer : ex.layers) {
    out += fmt::format("  {}  {} experts:", layer.module_path, layer.placement.num_experts);
    for (int k = 0; k < layer.placement.ep_size(); ++k) {
      out += fmt::format(" EP {} [", k);
      const auto& held = layer.placement.experts[static_cast<size_t>(k)];
      out += fmt::format("{}", fmt::join(held, " "));
      out += "]";
    }
    out += "\n";
  }
  for (const AutoEpParam& p : ex.params) {
    out += fmt::format("  {}  {}  EP shard {}  [affine map]\n", p.name,
                       FormatShape(p.ep_map.logical_shape()),
                       FormatShape(p.ep_map.rank(0).shard_shape));
  }
  return out;
}

std::string AutoEpSummaryJson(const DeepSpeedExperts& ex) {
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (size_t l = 0; l < ex.layers.size(); ++l) {
    const AutoEpLayer& layer = ex.layers[l];
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const AutoEpParam& p : ex.params) {
      if (p.layer != l) continue;
      nlohmann::ordered_json shards = nlohmann::ordered_json::array();
      for (Rank k = 0; k < p.ep_map.world_size(); ++k)
        shards.push_back(p.ep_map.rank(k).shard_shape);
      params.push_back({{"name", p.name},
                        {"shape", p.ep_map.logical_shape()},
                        {"ep_shard_shapes", shards},
                        {"affine_map", nlohmann::ordered_json::parse(ParamMapToJson(p.ep_map))}});
    }
    layers.push_back(
        {{"module_path", layer.module_path},
         {"moe_layer_id", layer.moe_layer_id},
         {"num_experts", layer.placement.num_experts},
         {"placement", nlohmann::ordered_json::parse(ExpertPlacementToJson(layer.placement))},
         {"params", params}});
  }
  nlohmann::ordered_json doc = {{"ep_size", ex.ep_size},
                                {"data_before_expert_parallelism", ex.data_before_expert},
                                {"layers", layers}};
  return doc.dump();
}

}  // namespace reshard
