#include "reshard/checkpoint/deepspeed/deepspeed.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <tuple>

#include "reshard/base/json_writer.h"
#include "reshard/checkpoint/deepspeed/moe.h"
#include "reshard/checkpoint/parallel_runs.h"
#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/basic.h"
#include "reshard/layouts/deepspeed_meta.h"

namespace reshard {

namespace fs = std::filesystem;
using Value = nlohmann::json;

std::string_view DeepSpeedStateName(DeepSpeedState state) {
  switch (state) {
    case DeepSpeedState::kModule:
      return "module";
    case DeepSpeedState::kMaster:
      return "fp32";
    case DeepSpeedState::kExpAvg:
      return "exp_avg";
    case DeepSpeedState::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

std::string_view DeepSpeedParamKindName(DeepSpeedParamKind kind) {
  switch (kind) {
    case DeepSpeedParamKind::kTrained:
      return "trained";
    case DeepSpeedParamKind::kFrozen:
      return "frozen";
    case DeepSpeedParamKind::kBuffer:
      return "buffer";
  }
  return "?";
}

namespace {

constexpr size_t Slot(DeepSpeedState s) { return static_cast<size_t>(s); }

// ---- the object tree (checkpoint/pickle_paths.h) ----------------------------------------

using internal::Get;
using internal::IntAt;
using internal::IsNone;
using internal::kMaxJsonObjects;
using internal::ToJson;
using internal::Walk;

// A shape (tuple or list of non-negative ints: torch.Size reads as a tuple).
std::optional<Shape> ShapeAt(const PickleTree& t, PickleNodeId id) {
  if (id == kNoPickleNode) return std::nullopt;
  const PickleNode& n = t.node(id);
  if (n.kind != PickleKind::kTuple && n.kind != PickleKind::kList) return std::nullopt;
  Shape s;
  for (PickleNodeId c : n.items) {
    std::optional<int64_t> v = IntAt(t, c);
    if (!v || *v < 0) return std::nullopt;
    s.push_back(*v);
  }
  return s;
}

// ---- names matched as DeepSpeed matches them ---------------------------------------------

// A pattern as re.match applies it: anchored at the start only. DeepSpeed writes
// "^<re.escape(name)>$"; such a pattern is compared as the literal name it escapes.
class NamePattern {
 public:
  static Result<NamePattern> Make(const std::string& pattern) {
    NamePattern p;
    p.text_ = pattern;
    if (std::optional<std::string> literal = Literal(pattern)) {
      p.literal_ = std::move(literal);
      return p;
    }
    try {
      p.regex_ = std::make_shared<std::regex>(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return InvalidArgumentError(
          fmt::format("pattern \"{}\" is not a regular expression this reader takes", pattern));
    }
    return p;
  }
  bool Matches(const std::string& name) const {
    if (literal_) return *literal_ == name;
    return std::regex_search(name, *regex_, std::regex_constants::match_continuous);
  }
  const std::string& text() const { return text_; }

 private:
  // "^a\.b_c$" -> "a.b_c" when every special character is escaped.
  static std::optional<std::string> Literal(const std::string& p) {
    if (p.size() < 2 || p.front() != '^' || p.back() != '$') return std::nullopt;
    std::string out;
    for (size_t i = 1; i + 1 < p.size(); ++i) {
      const char c = p[i];
      if (c == '\\') {
        if (i + 2 >= p.size()) return std::nullopt;
        const char e = p[++i];
        if (std::isalnum(static_cast<unsigned char>(e))) return std::nullopt;  // \d, \w, ...
        out += e;
      } else if (std::strchr(".^$*+?()[]{}|", c) != nullptr) {
        return std::nullopt;
      } else {
        out += c;
      }
    }
    return out;
  }
  std::string text_;
  std::optional<std::string> literal_;
  std::shared_ptr<std::regex> regex_;
};

// The patterns of a list (or the keys of an object) that match `name`: at most one may.
Result<std::optional<std::string>> MatchOne(const std::vector<NamePattern>& patterns,
                                            const std::string& name, std::string_view list) {
  std::optional<std::string> found;
  for (const NamePattern& p : patterns) {
    if (!p.Matches(name)) continue;
    if (found) {
      return InvalidArgumentError(
          fmt::format("universal_checkpoint_info.{}: parameter \"{}\" matches both \"{}\" and "
                      "\"{}\"",
                      list, name, *found, p.text()));
    }
    found = p.text();
  }
  return found;
}

Result<std::vector<NamePattern>> Patterns(const Value& uc, const char* key) {
  std::vector<NamePattern> out;
  auto it = uc.find(key);
  if (it == uc.end() || it->is_null()) return out;
  std::vector<std::string> texts;
  if (it->is_object()) {
    for (auto& [k, v] : it->items()) texts.push_back(k);
  } else if (it->is_array()) {
    for (const Value& v : *it) {
      if (v.is_string()) texts.push_back(v.get<std::string>());
      if (v.is_object() && v.contains("patterns") && v["patterns"].is_array()) {
        for (const Value& s : v["patterns"])
          if (s.is_string()) texts.push_back(s.get<std::string>());
      }
    }
  }
  for (const std::string& s : texts) {
    Result<NamePattern> p = NamePattern::Make(s);
    if (!p.ok()) return p.status().Annotate(fmt::format("universal_checkpoint_info.{}", key));
    out.push_back(*std::move(p));
  }
  return out;
}

// ---- TP maps ----------------------------------------------------------------------------

// F's shape from the TP shards when they are concatenated along `dim`.
Shape Concatenated(const std::vector<Shape>& shards, int dim) {
  Shape s = shards.front();
  if (dim < 0 || dim >= static_cast<int>(s.size())) return s;
  s[static_cast<size_t>(dim)] = 0;
  for (const Shape& x : shards) s[static_cast<size_t>(dim)] += x[static_cast<size_t>(dim)];
  return s;
}

// The universal-checkpoint information, with its patterns compiled once.
struct UcInfo {
  Value raw = Value::object();
  std::vector<NamePattern> affine;
  std::map<std::string, std::vector<NamePattern>> lists;
};

constexpr const char* kPatternLists[] = {
    "tp_replicated_parameter_patterns",      "parameter_to_average_patterns",
    "parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params",
    "vocabulary_parameter_patterns",         "parameter_with_row_parallelism_patterns"};

Result<UcInfo> ReadUcInfo(const PickleTree& t, PickleNodeId root) {
  UcInfo uc;
  const PickleNodeId node = Get(t, root, "universal_checkpoint_info");
  if (IsNone(t, node)) return uc;
  if (t.expanded_size(node) > kMaxJsonObjects) {
    return InvalidArgumentError(fmt::format(
        "universal_checkpoint_info: its shared pickle objects expand to more than {} objects; "
        "DeepSpeed writes plain metadata here",
        kMaxJsonObjects));
  }
  uc.raw = ToJson(t, node);
  if (!uc.raw.is_object()) return InvalidArgumentError("universal_checkpoint_info: not a dict");
  if (auto a = uc.raw.find("affine_map"); a != uc.raw.end() && a->is_object()) {
    if (!a->contains("version") || (*a)["version"] != 1) {
      return InvalidArgumentError(fmt::format(
          "universal_checkpoint_info.affine_map: version {} is not 1, the one this reader knows",
          a->contains("version") ? (*a)["version"].dump() : "(none)"));
    }
    Value params = a->contains("params") ? (*a)["params"] : Value::object();
    RESHARD_ASSIGN_OR_RETURN(uc.affine, Patterns(Value{{"params", params}}, "params"));
  }
  for (const char* key : kPatternLists) {
    RESHARD_ASSIGN_OR_RETURN(uc.lists[key], Patterns(uc.raw, key));
  }
  return uc;
}

// The metadata DeepSpeed's converter would consult for `name`, in the form
// layouts/deepspeed_meta.h lowers (the first list that matches decides, in its order).
Result<std::optional<Value>> PatternMeta(const UcInfo& uc, const std::string& name,
                                         const std::vector<Shape>& shards) {
  for (const char* key : kPatternLists) {
    auto list = uc.lists.find(key);
    if (list == uc.lists.end()) continue;
    RESHARD_ASSIGN_OR_RETURN(std::optional<std::string> hit, MatchOne(list->second, name, key));
    if (!hit) continue;
    const std::string_view k(key);
    Value meta = {{"name", name}};
    if (k == "tp_replicated_parameter_patterns") {
      meta["replicated"] = true;
      meta["logical_shape"] = shards.front();
    } else if (k == "parameter_to_average_patterns") {
      meta["average"] = true;
      meta["logical_shape"] = shards.front();
    } else if (k == "parameter_with_2_sub_params_cat_dim_0") {
      meta["param_n_sub_params"] = 2;
      meta["cat_dim"] = 0;
      meta["logical_shape"] = Concatenated(shards, 0);
    } else if (k == "parameter_with_sub_params") {
      for (const Value& s : uc.raw[key]) {
        if (!s.is_object() || !s.contains("patterns")) continue;
        for (const Value& p : s["patterns"]) {
          if (p != *hit) continue;
          const int dim = s.value("partition_dim", 0);
          meta["sub_param_shape"] = s;
          meta["partition_dim"] = dim;
          meta["logical_shape"] = Concatenated(shards, dim);
          meta["universal_checkpoint_version"] = uc.raw.value("universal_checkpoint_version", 0.0);
          auto widths = uc.raw.find("sub_param_shard_widths");
          if (widths != uc.raw.end() && widths->contains(*hit))
            meta["sub_param_shard_widths"] = (*widths)[*hit];
        }
      }
    } else if (k == "vocabulary_parameter_patterns") {
      meta["vocab_tensor"] = true;
      meta["logical_shape"] = Concatenated(shards, 0);
      if (uc.raw.contains("original_vocab_size"))
        meta["original_vocab_size"] = uc.raw["original_vocab_size"];
    } else {
      meta["cat_dim"] = 1;
      meta["logical_shape"] = Concatenated(shards, 1);
    }
    return std::optional<Value>(std::move(meta));
  }
  if (uc.raw.empty() || shards.front().empty()) return std::optional<Value>();
  // DeepSpeed's converter concatenates every other parameter along dim 0.
  return std::optional<Value>(
      Value{{"name", name}, {"cat_dim", 0}, {"logical_shape", Concatenated(shards, 0)}});
}

// The descriptor that lays `map` out at its own world size, when it is a split along one
// dimension (DeepSpeed's front-loaded rule) or a replica: what converting to another degree
// needs. nullopt for anything else (and at one rank, where every rule gives the same map).
std::optional<LayoutDescriptor> Recognise(const ParamMap& map) {
  if (map.world_size() < 2) return std::nullopt;
  std::vector<LayoutDescriptor> candidates;
  for (int d = 0; d < static_cast<int>(map.logical_shape().size()); ++d) {
    LayoutDescriptor split;
    split.family = LayoutFamily::kSplit;
    split.dim = d;
    candidates.push_back(split);
  }
  candidates.push_back(LayoutDescriptor{});  // replicated
  for (const LayoutDescriptor& c : candidates) {
    Result<ParamMap> built = BuildMap(c, map.valid_shape(), map.world_size());
    if (built.ok() && *built == map) return c;
  }
  return std::nullopt;
}

// What ds_to_universal writes beside `name`'s tensor: its category keys when no affine map
// gives the layout (cat_dim 0 when no category matches, as with universal_checkpoint_info
// missing and injected), and vocab_tensor whenever a vocabulary pattern matches.
// The parameter_with_sub_params entry of universal_checkpoint_info (in file `f`) whose
// patterns hold `pattern`, for a parameter of `full_shape`.
Result<DeepSpeedSubParamShape> SubParamShapeOf(const UcInfo& uc, const TorchFile& f,
                                               const std::string& pattern,
                                               const Shape& full_shape) {
  const PickleTree& t = f.tree();
  const PickleNodeId list =
      Get(t, Get(t, t.root(), "universal_checkpoint_info"), "parameter_with_sub_params");
  const auto listed = uc.raw.find("parameter_with_sub_params");
  const Value entries = listed != uc.raw.end() && listed->is_array() ? *listed : Value::array();
  for (size_t i = 0; list != kNoPickleNode && i < entries.size() && i < t.node(list).items.size();
       ++i) {
    const Value& e = entries[i];
    if (!e.is_object() || !e.contains("patterns") || !e["patterns"].is_array()) continue;
    const auto& patterns = e["patterns"];
    if (std::find(patterns.begin(), patterns.end(), pattern) == patterns.end()) continue;
    if (!e.contains("shape") || !e["shape"].is_array() || !e.contains("partition_dim") ||
        !e["partition_dim"].is_number_integer() || e.size() != 3) {
      return InvalidArgumentError(
          fmt::format("parameter_with_sub_params[{}]: not a SubparamShape record (patterns, shape, "
                      "partition_dim): {}",
                      i, e.dump()));
    }
    DeepSpeedSubParamShape s{&f, t.node(list).items[i], 0};
    const int dim = e["partition_dim"].get<int>();
    const double version = uc.raw.value("universal_checkpoint_version", 0.0);
    if (dim < 0 || static_cast<size_t>(dim) >= e["shape"].size() ||
        static_cast<size_t>(dim) >= full_shape.size()) {
      return InvalidArgumentError(fmt::format(
          "parameter_with_sub_params[{}]: partition_dim {} is outside the shape", i, dim));
    }
    const Value& count = e["shape"][static_cast<size_t>(dim)];
    if (version < 0.4 && count.is_number_integer()) {
      const Index n = count.get<Index>();
      if (n <= 0 || full_shape[static_cast<size_t>(dim)] % n != 0) {
        return InvalidArgumentError(fmt::format(
            "parameter_with_sub_params[{}]: {} sub-parameters do not divide dimension {} of {}", i,
            n, dim, FormatShape(full_shape)));
      }
      s.legacy_size = full_shape[static_cast<size_t>(dim)] / n;
    }
    return s;
  }
  return InternalError(fmt::format("no parameter_with_sub_params entry holds \"{}\"", pattern));
}

Result<DeepSpeedUniversalKeys> UniversalKeys(const UcInfo& uc, const std::string& name,
                                             const TorchFile& f, const Shape& full_shape) {
  DeepSpeedUniversalKeys keys;
  auto matches = [&](const char* list) -> Result<bool> {
    auto it = uc.lists.find(list);
    if (it == uc.lists.end()) return false;
    RESHARD_ASSIGN_OR_RETURN(std::optional<std::string> hit, MatchOne(it->second, name, list));
    return hit.has_value();
  };
  RESHARD_ASSIGN_OR_RETURN(keys.vocab_tensor, matches("vocabulary_parameter_patterns"));
  if (keys.vocab_tensor) {
    auto v = uc.raw.find("original_vocab_size");
    if (v != uc.raw.end() && v->is_number_integer()) keys.original_vocab_size = v->get<Index>();
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<std::string> affine,
                           MatchOne(uc.affine, name, "affine_map.params"));
  if (affine) return keys;
  RESHARD_ASSIGN_OR_RETURN(bool replicated, matches("tp_replicated_parameter_patterns"));
  RESHARD_ASSIGN_OR_RETURN(bool average, matches("parameter_to_average_patterns"));
  RESHARD_ASSIGN_OR_RETURN(bool two, matches("parameter_with_2_sub_params_cat_dim_0"));
  std::optional<std::string> sub_params;
  if (auto it = uc.lists.find("parameter_with_sub_params"); it != uc.lists.end()) {
    RESHARD_ASSIGN_OR_RETURN(sub_params, MatchOne(it->second, name, "parameter_with_sub_params"));
  }
  if (sub_params) {
    RESHARD_ASSIGN_OR_RETURN(keys.sub_param_shape, SubParamShapeOf(uc, f, *sub_params, full_shape));
  }
  RESHARD_ASSIGN_OR_RETURN(bool rows, matches("parameter_with_row_parallelism_patterns"));
  if (replicated || average || keys.sub_param_shape) return keys;
  keys.cat_dim = two ? 0 : rows ? 1 : 0;
  if (two) keys.n_sub_params = 2;
  return keys;
}

struct TpLayout {
  ParamMap map;
  std::optional<LayoutDescriptor> layout;
  std::string source;
};

// The affine map universal_checkpoint_info gives parameter `name`, if one of its patterns
// matches it.
Result<std::optional<ParamMap>> AffineMapOf(const UcInfo& uc, const std::string& name) {
  RESHARD_ASSIGN_OR_RETURN(std::optional<std::string> affine,
                           MatchOne(uc.affine, name, "affine_map.params"));
  if (!affine) return std::optional<ParamMap>();
  Result<ParamMap> map = ReadDeepSpeedAffineMap(uc.raw["affine_map"]["params"][*affine].dump());
  if (!map.ok()) {
    return map.status().Annotate(
        fmt::format("universal_checkpoint_info.affine_map.params[\"{}\"]", *affine));
  }
  return std::optional<ParamMap>(*std::move(map));
}

// The TP map of parameter `name` from the shapes its TP ranks hold.
Result<TpLayout> BuildTpMap(const UcInfo& uc, const std::string& name,
                            const std::vector<Shape>& shards) {
  const int tp = static_cast<int>(shards.size());
  RESHARD_ASSIGN_OR_RETURN(std::optional<ParamMap> affine, AffineMapOf(uc, name));
  if (affine) {
    std::optional<LayoutDescriptor> layout = Recognise(*affine);
    return TpLayout{*std::move(affine), std::move(layout), "affine map"};
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<Value> meta, PatternMeta(uc, name, shards));
  if (meta) {
    Result<LoweredDeepSpeedMeta> lowered = LowerDeepSpeedMeta(meta->dump());
    if (!lowered.ok()) return lowered.status().Annotate("universal_checkpoint_info");
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, BuildMap(lowered->descriptor, lowered->shape, tp));
    return TpLayout{std::move(map), lowered->descriptor, "pattern lists"};
  }
  if (tp != 1) {
    return InvalidArgumentError(fmt::format(
        "the checkpoint has {} TP ranks but no universal_checkpoint_info says how they split it",
        tp));
  }
  RESHARD_ASSIGN_OR_RETURN(ParamMap map, ReplicatedMap(shards.front(), 1));
  return TpLayout{std::move(map), std::nullopt, "whole"};
}

// ---- DP maps ----------------------------------------------------------------------------

struct FragmentSpan {
  Rank rank = 0;
  Index start = 0;   // in the flattened TP shard
  Index length = 0;  // elements
};

// The DP map of a TP shard of `n` elements held as `spans` by `world` ranks.
Result<ParamMap> FragmentMap(Index n, int world, const std::vector<FragmentSpan>& spans) {
  ParamMapBuilder b;
  b.set_logical_shape({n}).set_world_size(world);
  for (Rank r = 0; r < world; ++r) b.set_shard_shape(r, {0});
  for (const FragmentSpan& s : spans) {
    b.set_shard_shape(s.rank, {s.length});
    if (s.length == 0) continue;
    // Member by member: GCC 12 at -O3 takes the nested braced temporaries of one aggregate
    // initializer for uninitialized vectors (-Wmaybe-uninitialized).
    Piece piece;
    piece.shape = {s.length};
    piece.source = StridedView{s.start, {1}};
    piece.dest = StridedView{0, {1}};
    piece.locations = {s.rank};
    b.add_piece(s.rank, std::move(piece));
  }
  return b.Finalize();
}

// One parameter group's flat tensors on every DP rank of one TP rank: [state][dp rank] (the
// module state is unused).
struct FlatGroup {
  std::array<std::vector<DeepSpeedFragment>, kNumDeepSpeedStates> flat;
  std::vector<Index> numel;        // per DP rank (the master's and the moments' agree)
  std::vector<PickleNodeId> step;  // per DP rank: the optimizer's step of the group, if any
};

// What a parameter is (a module tensor no param group holds: its kind and dtype).
struct ModuleOnlyKind {
  DeepSpeedParamKind kind = DeepSpeedParamKind::kTrained;
  std::optional<DType> dtype;  // a frozen parameter's or a buffer's own
};

// The group of a parameter no param group holds.
constexpr size_t kNoGroup = static_cast<size_t>(-1);

}  // namespace

// ---- the reader -------------------------------------------------------------------------

class DeepSpeedReader {
 public:
  explicit DeepSpeedReader(DeepSpeedCheckpoint& c) : c_(c) {}
  Status Read(const std::string& path);

 private:
  Status ResolveTag(const std::string& path);
  Result<const TorchFile*> OpenFile(const std::string& name);
  Status ReadTopology();
  Status CheckDpModelStates();
  Status ReadParams();
  Status ReadListed(const TorchFile* f, std::vector<std::pair<std::string, Shape>>& found,
                    std::vector<size_t>& groups, std::vector<ModuleOnlyKind>& kinds) const;
  Status AppendModuleOnly(const TorchFile* f, std::vector<std::pair<std::string, Shape>>& found,
                          std::vector<ModuleOnlyKind>& kinds) const;
  Status AppendLayerModuleOnly();
  void AddParam(std::string name, size_t group, int stage, ModuleOnlyKind kind);
  Status ReadExperts();
  Status ReadPartitions();
  Status ReadTorchOptimizer();
  Status ReadModuleFragments();
  Status CheckMetadataAgrees() const;
  Status CheckModuleIsMasterRounded() const;
  Status CheckTpReplicasAgree() const;
  Status ReadPipelineTopology(const TorchFile& first);
  Status ReadLayerWeights();
  Status CheckLayerFilesRead(const std::map<const TorchFile*, std::set<std::string>>& read);
  Result<std::map<std::string, int>> TiedModuleKeys();
  Result<const TorchFile*> LayerFile(int layer, Rank t);
  Status CheckTiedCopies();  // after c_.params_ is set
  Result<FlatGroup> ReadFlatGroup(Rank t, size_t g);
  Status CheckPartitionCounts(const TorchFile* f, size_t g, Index partition) const;
  Status Place(Rank t, size_t i, const std::vector<FragmentSpan>& spans,
               const std::vector<Index>& flat_offsets, const FlatGroup& group);
  Status CheckSliceMappings(Rank t, size_t g, const FlatGroup& group) const;
  Result<std::vector<FragmentSpan>> SliceMappings(Rank t, size_t g, size_t i,
                                                  const FlatGroup& group,
                                                  std::vector<Index>& flat_offsets);
  std::string ModelStatesName(Rank t, int d) const;
  std::string Where(const TorchFile* f) const;
  const std::vector<Shape>& ShapesOf(size_t param) const { return tp_shapes_[param]; }
  // The file index (model_, optim_) of TP rank t of parameter i's pipeline stage.
  size_t SliceOf(size_t i, Rank t) const {
    return static_cast<size_t>(stage_of_[i]) * static_cast<size_t>(c_.tp_) + static_cast<size_t>(t);
  }

  DeepSpeedCheckpoint& c_;
  std::map<const TorchFile*, std::string> names_;
  // Indexed by slice (stage * TP + TP rank; the TP rank without pipeline stages).
  std::vector<const TorchFile*> model_;               // [slice] (ZeRO 3: DP rank 0's)
  std::vector<const TorchFile*> all_model_;           // every model-states file
  std::vector<std::vector<const TorchFile*>> optim_;  // [slice][dp], empty without optimizer files
  // Pipeline: the layer files by their names, whether TP ranks name them ("-model_XX").
  std::set<std::string> layer_files_;
  bool layer_files_name_tp_ = false;
  std::map<std::string, const TorchFile*> opened_layers_;
  std::vector<std::string> names_in_order_;    // a tied parameter once per stage holding it
  std::vector<int> stage_of_;                  // per parameter: its pipeline stage
  std::vector<size_t> group_of_;               // per parameter: its group (kNoGroup)
  std::vector<ModuleOnlyKind> kind_of_;        // per parameter
  std::vector<std::vector<Shape>> tp_shapes_;  // [param][tp]
  std::vector<DeepSpeedParam> params_;
};

std::string DeepSpeedReader::Where(const TorchFile* f) const {
  auto it = names_.find(f);
  return it == names_.end() ? std::string("?") : it->second;
}

std::string DeepSpeedReader::ModelStatesName(Rank t, int d) const {
  if (c_.stage_ == 3) return fmt::format("zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt", d, t);
  return fmt::format("mp_rank_{:02d}_model_states.pt", t);
}

Status DeepSpeedReader::ResolveTag(const std::string& path) {
  fs::path dir(path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError(fmt::format("\"{}\" is not a directory", path));
  }
  fs::path save_dir = dir.parent_path();
  if (fs::exists(dir / "latest", ec)) {
    RESHARD_ASSIGN_OR_RETURN(std::string tag, ReadFileToString((dir / "latest").string()));
    while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
    if (tag.empty() || tag.find('/') != std::string::npos || !fs::is_directory(dir / tag, ec)) {
      return NotFoundError(fmt::format("\"{}\" names \"{}\", which is not a directory in \"{}\"",
                                       (dir / "latest").string(), tag, path));
    }
    save_dir = dir;
    dir /= tag;
  }
  c_.tag_dir_ = dir.string();
  for (const fs::path& d : {dir, save_dir}) {
    if (fs::is_regular_file(d / "config.json", ec)) {
      c_.config_path_ = (d / "config.json").string();
      break;
    }
  }
  return Status::Ok();
}

Result<const TorchFile*> DeepSpeedReader::OpenFile(const std::string& name) {
  const std::string path = (fs::path(c_.tag_dir_) / name).string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    const std::string pp = c_.pp_ > 1 ? fmt::format("{} PP x ", c_.pp_) : "";
    return NotFoundError(fmt::format("\"{}\" is missing (the checkpoint has {}{} TP x {} DP ranks)",
                                     path, pp, c_.tp_, c_.dp_));
  }
  Result<TorchFile> f = TorchFile::Open(path);
  if (!f.ok()) return f.status();
  c_.files_.push_back(std::make_unique<TorchFile>(*std::move(f)));
  c_.paths_.push_back(path);
  names_[c_.files_.back().get()] = path;
  return c_.files_.back().get();
}

Status DeepSpeedReader::ReadTopology() {
  std::error_code ec;
  const fs::path dir(c_.tag_dir_);
  if (fs::exists(dir / "zero_pp_rank_0_mp_rank_00_model_states.pt", ec)) {
    c_.stage_ = 3;
  } else if (!fs::exists(dir / "mp_rank_00_model_states.pt", ec)) {
    return NotFoundError(
        fmt::format("\"{}\" holds no DeepSpeed model states (mp_rank_00_model_states.pt or "
                    "zero_pp_rank_0_mp_rank_00_model_states.pt)",
                    c_.tag_dir_));
  }
  RESHARD_ASSIGN_OR_RETURN(const TorchFile* first, OpenFile(ModelStatesName(0, 0)));
  const PickleTree& t = first->tree();
  std::optional<int64_t> tp = IntAt(t, Get(t, t.root(), "mp_world_size"));
  std::optional<int64_t> dp = IntAt(t, Get(t, t.root(), "dp_world_size"));
  if (!tp || !dp || *tp < 1 || *dp < 1 || *tp > 65536 || *dp > 65536) {
    return InvalidArgumentError(fmt::format(
        "\"{}\": mp_world_size and dp_world_size must be positive integers", Where(first)));
  }
  c_.tp_ = static_cast<int>(*tp);
  c_.dp_ = static_cast<int>(*dp);
  const PickleNodeId stage = Walk(t, t.root(), "ds_config.zero_optimization.stage");
  if (c_.stage_ != 3) c_.stage_ = static_cast<int>(IntAt(t, stage).value_or(0));
  if (c_.stage_ < 0 || c_.stage_ > 3) {
    return InvalidArgumentError(
        fmt::format("\"{}\": ds_config.zero_optimization.stage is {}", Where(first), c_.stage_));
  }
  RESHARD_RETURN_IF_ERROR(ReadPipelineTopology(*first));
  const Rank slices = c_.pp_ * c_.tp_;
  model_.push_back(first);
  for (Rank r = 1; r < slices; ++r) {
    RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, OpenFile(ModelStatesName(r, 0)));
    model_.push_back(f);
  }
  all_model_ = model_;
  RESHARD_RETURN_IF_ERROR(CheckDpModelStates());
  // The optimizer files, when this stage has them ("bf16_" with DeepSpeed's bf16 optimizer).
  const std::string prefix =
      fs::exists(dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", ec) ? "bf16_" : "";
  if (!fs::exists(dir / (prefix + "zero_pp_rank_0_mp_rank_00_optim_states.pt"), ec)) {
    if (c_.stage_ > 0) {
      return NotFoundError(
          fmt::format("\"{}\" is missing (ZeRO stage {} keeps its optimizer "
                      "state there)",
                      (dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").string(), c_.stage_));
    }
    return Status::Ok();
  }
  optim_.assign(static_cast<size_t>(slices), {});
  for (Rank r = 0; r < slices; ++r) {
    for (int d = 0; d < c_.dp_; ++d) {
      RESHARD_ASSIGN_OR_RETURN(
          const TorchFile* f,
          OpenFile(fmt::format("{}zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt", prefix, d, r)));
      optim_[static_cast<size_t>(r)].push_back(f);
    }
  }
  c_.optimizer_file_ = optim_[0][0];
  return Status::Ok();
}

// A PipelineModule's checkpoint: layer files (layer_XX[-model_YY]-model_states.pt) beside the
// model states, whose mp_world_size counts PP x TP slices; checkpoint_parallel_dimensions
// says how many of each (without it: TP from the layer files' names, the rest stages).
Status DeepSpeedReader::ReadPipelineTopology(const TorchFile& first) {
  static const std::regex kLayerFile(R"(layer_(\d+)-(model_(\d+)-)?model_states\.pt)");
  std::error_code ec;
  int named_tp = 1;
  for (const fs::directory_entry& e : fs::directory_iterator(c_.tag_dir_, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, kLayerFile)) continue;
    layer_files_.insert(name);
    if (m[2].matched) {
      layer_files_name_tp_ = true;
      named_tp = std::max(named_tp, std::stoi(m[3].str().substr(0, 6)) + 1);
    }
  }
  if (ec)
    return NotFoundError(fmt::format("\"{}\": cannot list it: {}", c_.tag_dir_, ec.message()));
  if (layer_files_.empty()) return Status::Ok();
  if (c_.stage_ == 3) {
    return UnimplementedError(fmt::format(
        "\"{}\" holds pipeline layer files and ZeRO 3 model states, which DeepSpeed does not "
        "combine",
        c_.tag_dir_));
  }
  const PickleTree& t = first.tree();
  const PickleNodeId dims = Get(t, t.root(), "checkpoint_parallel_dimensions");
  std::optional<int64_t> pp = IntAt(t, Get(t, dims, "pp_degree"));
  std::optional<int64_t> tp = IntAt(t, Get(t, dims, "tp_degree"));
  const int64_t slices = c_.tp_;  // mp_world_size
  if (!tp) tp = named_tp;
  if (!pp) pp = slices % *tp == 0 ? slices / *tp : 0;
  if (*pp < 1 || *tp < 1 || *pp * *tp != slices) {
    return InvalidArgumentError(
        fmt::format("\"{}\": mp_world_size {} is not pp_degree x tp_degree ({} x {}) of its "
                    "checkpoint_parallel_dimensions",
                    Where(&first), slices, *pp, *tp));
  }
  c_.pp_ = static_cast<int>(*pp);
  c_.tp_ = static_cast<int>(*tp);
  return Status::Ok();
}

// ZeRO 3 keeps model states per DP rank: each must list the parameters and shapes DP rank 0's
// does.
Status DeepSpeedReader::CheckDpModelStates() {
  if (c_.stage_ != 3) return Status::Ok();
  for (Rank r = 0; r < c_.tp_; ++r) {
    const TorchFile* base = model_[static_cast<size_t>(r)];
    const Value want = ToJson(base->tree(), Get(base->tree(), base->tree().root(), "param_shapes"));
    for (int d = 1; d < c_.dp_; ++d) {
      RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, OpenFile(ModelStatesName(r, d)));
      all_model_.push_back(f);
      const Value got = ToJson(f->tree(), Get(f->tree(), f->tree().root(), "param_shapes"));
      if (got != want) {
        return InvalidArgumentError(
            fmt::format("\"{}\": param_shapes differ from those of \"{}\" (a file from another "
                        "run?)",
                        Where(f), Where(base)));
      }
    }
  }
  return Status::Ok();
}

// The names, groups and kinds one model-states file lists, with its TP shard shapes:
// param_shapes (one dict per group) when the checkpoint has it, then the module tensors no
// group holds (AppendModuleOnly); without it (ZeRO 0), the module's tensors, buffer_names
// telling the buffers.
Status DeepSpeedReader::ReadListed(const TorchFile* f,
                                   std::vector<std::pair<std::string, Shape>>& found,
                                   std::vector<size_t>& groups,
                                   std::vector<ModuleOnlyKind>& kinds) const {
  const PickleTree& t = f->tree();
  const PickleNodeId shapes = Get(t, t.root(), "param_shapes");
  if (!IsNone(t, shapes)) {
    const PickleNode& list = t.node(shapes);
    for (size_t g = 0; g < list.items.size(); ++g) {
      const PickleNode& dict = t.node(list.items[g]);
      for (const auto& [k, v] : dict.entries) {
        std::optional<Shape> s = ShapeAt(t, v);
        if (t.node(k).kind != PickleKind::kStr || !s) {
          return InvalidArgumentError(
              fmt::format("\"{}\": param_shapes[{}] is not a dict of shapes", Where(f), g));
        }
        found.emplace_back(t.node(k).text, *s);
        groups.push_back(g);
        kinds.emplace_back();
      }
    }
    if (!layer_files_.empty()) return Status::Ok();  // AppendLayerModuleOnly
    RESHARD_RETURN_IF_ERROR(AppendModuleOnly(f, found, kinds));
    groups.resize(found.size(), kNoGroup);
    return Status::Ok();
  }
  if (!layer_files_.empty()) {
    return UnimplementedError(fmt::format(
        "\"{}\" has no param_shapes (ZeRO 0), so which parameters a pipeline stage holds, "
        "by name, is not recorded; pipeline checkpoints are read at ZeRO 1 and 2",
        Where(f)));
  }
  std::set<std::string> buffers;
  const PickleNodeId b = Get(t, t.root(), "buffer_names");
  if (!IsNone(t, b)) {
    for (PickleNodeId c : t.node(b).items) buffers.insert(t.node(c).text);
  }
  for (const TorchTensor& tensor : f->tensors()) {
    if (!tensor.name.starts_with("module.")) continue;
    std::string name = tensor.name.substr(7);
    const bool buffer = buffers.contains(name);
    if (buffer && !tensor.dtype.dtype) {
      return InvalidArgumentError(
          fmt::format("\"{}\": buffer {} has no dtype reshard reads", Where(f), tensor.name));
    }
    found.emplace_back(std::move(name), tensor.shape);
    groups.push_back(buffer ? kNoGroup : 0);
    kinds.push_back(buffer ? ModuleOnlyKind{DeepSpeedParamKind::kBuffer, tensor.dtype.dtype}
                           : ModuleOnlyKind{});
  }
  return Status::Ok();
}

void DeepSpeedReader::AddParam(std::string name, size_t group, int stage, ModuleOnlyKind kind) {
  names_in_order_.push_back(std::move(name));
  group_of_.push_back(group);
  stage_of_.push_back(stage);
  kind_of_.push_back(kind);
  tp_shapes_.emplace_back();
}

// Names, groups and TP shard shapes of every stage's parameters (ReadListed), each TP rank's
// file listing the same.
Status DeepSpeedReader::ReadParams() {
  tp_shapes_.clear();
  size_t stage_begin = 0;  // the first parameter of the stage being read
  for (size_t slice = 0; slice < model_.size(); ++slice) {
    const Rank r = static_cast<Rank>(slice % static_cast<size_t>(c_.tp_));
    const TorchFile* f = model_[slice];
    const TorchFile* base = model_[slice - static_cast<size_t>(r)];  // the stage's TP rank 0
    std::vector<std::pair<std::string, Shape>> found;
    std::vector<size_t> groups;
    std::vector<ModuleOnlyKind> kinds;
    RESHARD_RETURN_IF_ERROR(ReadListed(f, found, groups, kinds));
    if (r == 0) {
      stage_begin = names_in_order_.size();
      for (size_t k = 0; k < found.size(); ++k) {
        AddParam(found[k].first, groups[k], static_cast<int>(slice / static_cast<size_t>(c_.tp_)),
                 kinds[k]);
      }
    } else if (found.size() != names_in_order_.size() - stage_begin) {
      return InvalidArgumentError(fmt::format("\"{}\" lists {} parameters but \"{}\" lists {}",
                                              Where(f), found.size(), Where(base),
                                              names_in_order_.size() - stage_begin));
    }
    for (size_t k = 0; k < found.size(); ++k) {
      if (found[k].first != names_in_order_[stage_begin + k]) {
        return InvalidArgumentError(
            fmt::format("\"{}\": parameter {} is \"{}\" but \"{}\" has \"{}\"", Where(f), k,
                        found[k].first, Where(base), names_in_order_[stage_begin + k]));
      }
      tp_shapes_[stage_begin + k].push_back(found[k].second);
    }
  }
  if (!layer_files_.empty()) RESHARD_RETURN_IF_ERROR(AppendLayerModuleOnly());
  const PickleTree& t0 = model_[0]->tree();
  if (c_.pp_ == 1) RESHARD_RETURN_IF_ERROR(ReadExperts());
  RESHARD_ASSIGN_OR_RETURN(UcInfo uc, ReadUcInfo(t0, t0.root()));
  for (size_t i = 0; i < names_in_order_.size(); ++i) {
    const std::string& name = names_in_order_[i];
    const std::vector<Shape>& shapes = tp_shapes_[i];
    const DeepSpeedParamKind kind = kind_of_[i].kind;
    const bool alike =
        std::all_of(shapes.begin(), shapes.end(), [&](const Shape& s) { return s == shapes[0]; });
    // AutoTP cuts modules' parameters, frozen ones too, never their buffers: a buffer every TP
    // rank holds in one shape is a replica, whatever the patterns (written for parameters)
    // say; so is a frozen parameter no rule names. CheckTpReplicasAgree compares the ranks'
    // values.
    Result<TpLayout> tp = InvalidArgumentError("");
    if (kind != DeepSpeedParamKind::kBuffer || !alike || c_.tp_ == 1)
      tp = BuildTpMap(uc, name, shapes);
    if (!tp.ok() && kind != DeepSpeedParamKind::kTrained && alike) {
      Result<ParamMap> map = ReplicatedMap(shapes.front(), c_.tp_);
      if (map.ok()) tp = TpLayout{*std::move(map), LayoutDescriptor{}, "replicated (no rule)"};
    }
    if (!tp.ok()) {
      return tp.status().Annotate(fmt::format("\"{}\": parameter \"{}\"", Where(model_[0]), name));
    }
    for (Rank r = 0; r < c_.tp_; ++r) {
      const Shape& held = tp_shapes_[i][static_cast<size_t>(r)];
      if (tp->map.world_size() != c_.tp_ || tp->map.rank(r).shard_shape != held) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": parameter \"{}\" has shape {}, but its map gives TP rank {} of {} the "
            "shape {}",
            Where(model_[SliceOf(i, r)]), name, FormatShape(held), r, c_.tp_,
            r < tp->map.world_size() ? FormatShape(tp->map.rank(r).shard_shape) : "(none)"));
      }
    }
    Result<DeepSpeedUniversalKeys> keys =
        UniversalKeys(uc, name, *model_[0], tp->map.logical_shape());
    if (!keys.ok()) {
      return keys.status().Annotate(
          fmt::format("\"{}\": parameter \"{}\"", Where(model_[0]), name));
    }
    params_.push_back(DeepSpeedParam{name,
                                     kind_of_[i].kind,
                                     kind_of_[i].dtype,
                                     std::move(tp->map),
                                     std::move(tp->layout),
                                     std::move(tp->source),
                                     {},
                                     *keys,
                                     {}});
    params_.back().parts.resize(static_cast<size_t>(c_.tp_));
    params_.back().steps.resize(static_cast<size_t>(c_.tp_));
  }
  return Status::Ok();
}

// ZeRO 1 and 2 save the module's state_dict whole: its tensors are the parameters param_shapes
// lists, the persistent buffers buffer_names lists, ties (state_dict names a shared parameter
// twice; param_shapes once) and frozen parameters, which no param group holds. Below ZeRO 2
// DeepSpeed records no frozen_param_shapes (None), so a frozen parameter is told by its
// absence from param_shapes (and from buffer_names). Frozen parameters and buffers are read
// from the module alone, in their own dtypes; a second name of a tensor already read (its
// storage, offset and shape) is the tie it is. ZeRO 3 partitions frozen parameters over the
// DP ranks (frozen_param_fragments), which is not read: refused, as is a module tensor it
// does not account for.
Status DeepSpeedReader::AppendModuleOnly(const TorchFile* f,
                                         std::vector<std::pair<std::string, Shape>>& found,
                                         std::vector<ModuleOnlyKind>& kinds) const {
  const PickleTree& t = f->tree();
  // AutoEP keeps module tensors no group holds (its router's alias), read by its own reader.
  if (!IsNone(t, Get(t, t.root(), "ds_autoep_layers"))) return Status::Ok();
  const PickleNodeId frozen = Get(t, t.root(), "frozen_param_shapes");
  if (c_.stage_ == 3 && !IsNone(t, frozen) && !t.node(frozen).entries.empty()) {
    return UnimplementedError(fmt::format(
        "\"{}\" has frozen parameters (frozen_param_shapes), which ZeRO 3 partitions over the "
        "DP ranks; those partitions are not read yet, and the checkpoint is refused rather than "
        "read without them",
        Where(f)));
  }
  std::set<std::string> params;
  for (const auto& entry : found) params.insert(entry.first);
  std::set<std::string> buffers;
  const PickleNodeId b = Get(t, t.root(), "buffer_names");
  if (!IsNone(t, b)) {
    for (PickleNodeId c : t.node(b).items) buffers.insert(t.node(c).text);
  }
  std::set<std::tuple<size_t, Index, Shape>> held;  // the storage of the tensors read
  for (const TorchTensor& tensor : f->tensors()) {
    if (tensor.name.starts_with("module.") && params.contains(tensor.name.substr(7)))
      held.emplace(tensor.storage, tensor.storage_offset, tensor.shape);
  }
  for (const TorchTensor& tensor : f->tensors()) {
    if (!tensor.name.starts_with("module.")) continue;
    std::string name = tensor.name.substr(7);
    if (params.contains(name)) continue;
    if (!held.emplace(tensor.storage, tensor.storage_offset, tensor.shape).second) continue;
    const bool buffer = buffers.contains(name);
    if (!buffer && c_.stage_ == 3) {
      return UnimplementedError(fmt::format(
          "\"{}\": {} is a module tensor that neither param_shapes nor buffer_names lists (a "
          "frozen parameter, which ZeRO 3 partitions over the DP ranks, is not read yet)",
          Where(f), tensor.name));
    }
    if (!tensor.dtype.dtype) {
      return InvalidArgumentError(
          fmt::format("\"{}\": {} has no dtype reshard reads", Where(f), tensor.name));
    }
    found.emplace_back(std::move(name), tensor.shape);
    kinds.push_back(
        {buffer ? DeepSpeedParamKind::kBuffer : DeepSpeedParamKind::kFrozen, tensor.dtype.dtype});
  }
  return Status::Ok();
}

// AutoEP's experts (deepspeed_moe.h): read there, and left out of the dense parameters.
Status DeepSpeedReader::ReadExperts() {
  AutoEpInput in;
  in.model_states = model_[0];
  in.stage = c_.stage_;
  in.tp = c_.tp_;
  in.dp = c_.dp_;
  if (!optim_.empty()) in.optim = optim_[0];
  in.names = names_in_order_;
  in.groups = group_of_;
  for (const auto& shapes : tp_shapes_) in.shapes.push_back(shapes.front());
  in.open = [this](const std::string& name) { return OpenFile(name); };
  in.where = [this](const TorchFile* f) { return Where(f); };
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(c_.tag_dir_, ec)) {
    in.files.push_back(e.path().filename().string());
  }
  if (ec) {
    return NotFoundError(fmt::format("\"{}\": cannot list it: {}", c_.tag_dir_, ec.message()));
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<DeepSpeedExperts> experts, ReadAutoEpExperts(in));
  if (!experts) return Status::Ok();
  size_t kept = 0;
  for (size_t i = 0; i < names_in_order_.size(); ++i) {
    if (ClaimsName(*experts, names_in_order_[i])) continue;
    names_in_order_[kept] = names_in_order_[i];
    group_of_[kept] = group_of_[i];
    kind_of_[kept] = kind_of_[i];
    tp_shapes_[kept] = tp_shapes_[i];
    ++kept;
  }
  names_in_order_.resize(kept);
  group_of_.resize(kept);
  kind_of_.resize(kept);
  tp_shapes_.resize(kept);
  stage_of_.resize(kept);
  c_.experts_ = std::make_shared<const DeepSpeedExperts>(*std::move(experts));
  return Status::Ok();
}

// The flat tensors of group `g` (key paths depend on the stage: ZeRO 1/2 keep
// single_partition_of_fp32_groups and base_optimizer_state, ZeRO 3 fp32_flat_groups and
// optimizer_state_dict); every DP rank's must be 1-D, contiguous, F32 and of one size.
Result<FlatGroup> DeepSpeedReader::ReadFlatGroup(Rank t, size_t g) {
  const bool z3 = c_.stage_ == 3;
  const std::string master =
      z3 ? fmt::format("optimizer_state_dict.fp32_flat_groups.{}", g)
         : fmt::format("optimizer_state_dict.single_partition_of_fp32_groups.{}", g);
  const std::string opt = z3 ? "optimizer_state_dict.optimizer_state_dict"
                             : "optimizer_state_dict.base_optimizer_state";
  FlatGroup group;
  const auto& files = optim_[static_cast<size_t>(t)];
  for (size_t d = 0; d < files.size(); ++d) {
    const TorchFile* f = files[d];
    const PickleTree& tree = f->tree();
    // The optimizer keys its state by the group's flat parameter, params[0] of the group.
    std::optional<int64_t> key =
        IntAt(tree, Walk(tree, tree.root(), fmt::format("{}.param_groups.{}.params.0", opt, g)));
    const std::string state = fmt::format("{}.state.{}", opt, key.value_or(-1));
    group.step.push_back(Walk(tree, tree.root(), state + ".step"));
    const std::pair<DeepSpeedState, std::string> paths[] = {
        {DeepSpeedState::kMaster, master},
        {DeepSpeedState::kExpAvg, state + ".exp_avg"},
        {DeepSpeedState::kExpAvgSq, state + ".exp_avg_sq"}};
    for (const auto& [s, path] : paths) {
      const TorchTensor* tensor = f->TensorAt(Walk(tree, tree.root(), path));
      if (tensor == nullptr || tensor->shape.size() != 1 || !tensor->is_contiguous() ||
          tensor->dtype.dtype != DType::kF32) {
        return InvalidArgumentError(
            fmt::format("\"{}\": {} is not a flat F32 tensor", Where(f), path));
      }
      if (s == DeepSpeedState::kMaster) group.numel.push_back(tensor->numel());
      // The last rank's master weights may end without ZeRO's padding; its moments keep it.
      if (tensor->numel() < group.numel.back()) {
        return InvalidArgumentError(
            fmt::format("\"{}\": {} has {} elements, fewer than the master weights beside it ({})",
                        Where(f), path, tensor->numel(), group.numel.back()));
      }
      group.flat[Slot(s)].push_back({f, tensor, 0});
    }
    if (!z3)
      RESHARD_RETURN_IF_ERROR(CheckPartitionCounts(
          f, g, group.flat[Slot(DeepSpeedState::kExpAvg)].back().tensor->numel()));
  }
  return group;
}

// ZeRO 1/2: what a DP rank's file records of group g's partitioning agrees with its files:
// partition_count[g] is the DP degree and group_paddings[g] (the zeros that end the flat
// group, on the ranks its padding reaches) lies inside the rank's partition of `partition`
// elements (its moments keep the padding).
Status DeepSpeedReader::CheckPartitionCounts(const TorchFile* f, size_t g, Index partition) const {
  const PickleTree& tree = f->tree();
  const PickleNodeId count =
      Walk(tree, tree.root(), fmt::format("optimizer_state_dict.partition_count.{}", g));
  if (count != kNoPickleNode && IntAt(tree, count) != std::optional<int64_t>(c_.dp_)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\": optimizer_state_dict.partition_count[{}] is {}, but the checkpoint has {} DP "
        "ranks (a file of another DP degree?)",
        Where(f), g, ToJson(tree, count).dump(), c_.dp_));
  }
  const PickleNodeId padding =
      Walk(tree, tree.root(), fmt::format("optimizer_state_dict.group_paddings.{}", g));
  const std::optional<int64_t> pad = IntAt(tree, padding);
  if (padding != kNoPickleNode && (!pad || *pad < 0 || *pad > partition)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\": optimizer_state_dict.group_paddings[{}] is {}, but the rank's partition of "
        "group {} has {} elements",
        Where(f), g, ToJson(tree, padding).dump(), g, partition));
  }
  return Status::Ok();
}

// ZeRO 1/2: every DP rank's param_slice_mappings[g] names only parameters of group g, and
// their fragments do not overlap inside the partition.
Status DeepSpeedReader::CheckSliceMappings(Rank t, size_t g, const FlatGroup& group) const {
  std::map<std::string, size_t> in_group;
  for (size_t i = 0; i < names_in_order_.size(); ++i) {
    if (group_of_[i] == g && static_cast<Rank>(SliceOf(i, 0)) == t - t % c_.tp_)
      in_group.emplace(names_in_order_[i], i);
  }
  const auto& files = optim_[static_cast<size_t>(t)];
  for (size_t d = 0; d < files.size(); ++d) {
    const PickleTree& tree = files[d]->tree();
    const PickleNodeId mappings =
        Walk(tree, tree.root(), fmt::format("optimizer_state_dict.param_slice_mappings.{}", g));
    if (IsNone(tree, mappings) || tree.node(mappings).kind != PickleKind::kDict) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": optimizer_state_dict.param_slice_mappings[{}] is missing", Where(files[d]), g));
    }
    std::vector<std::pair<Index, Index>> used;  // (start, end)
    for (const auto& [k, v] : tree.node(mappings).entries) {
      const std::string& name = tree.node(k).text;
      if (tree.node(k).kind != PickleKind::kStr || !in_group.contains(name)) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": param_slice_mappings[{}] maps \"{}\", which is not a parameter of group {} "
            "in \"{}\" (a file from another run?)",
            Where(files[d]), g, name, g, Where(model_[static_cast<size_t>(t)])));
      }
      const Index start = IntAt(tree, Get(tree, v, "start")).value_or(-1);
      const Index numel = IntAt(tree, Get(tree, v, "numel")).value_or(-1);
      if (numel > 0) used.emplace_back(start, start + numel);
    }
    std::sort(used.begin(), used.end());
    for (size_t k = 1; k < used.size(); ++k) {
      if (used[k].first < used[k - 1].second) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": param_slice_mappings[{}] has fragments that overlap at element {} of the "
            "partition of {}",
            Where(files[d]), g, used[k].first, group.numel[d]));
      }
    }
  }
  return Status::Ok();
}

// ZeRO 1/2: where parameter i lies in group g's partitions, from each DP rank's
// param_slice_mappings. A parameter's fragments, in DP rank order, are its flat TP shard: each
// but the last ends its partition, each but the first starts one, on consecutive ranks.
Result<std::vector<FragmentSpan>> DeepSpeedReader::SliceMappings(Rank t, size_t g, size_t i,
                                                                 const FlatGroup& group,
                                                                 std::vector<Index>& flat_offsets) {
  const std::string& name = names_in_order_[i];
  const Index n = ProductOf(tp_shapes_[i][static_cast<size_t>(t % c_.tp_)]);
  std::vector<FragmentSpan> spans;
  Index covered = 0;
  const auto& files = optim_[static_cast<size_t>(t)];
  for (size_t d = 0; d < files.size(); ++d) {
    const PickleTree& tree = files[d]->tree();
    const PickleNodeId mappings =
        Walk(tree, tree.root(), fmt::format("optimizer_state_dict.param_slice_mappings.{}", g));
    const PickleNodeId frag = Get(tree, mappings, name);
    if (frag == kNoPickleNode) continue;
    std::optional<int64_t> numel = IntAt(tree, Get(tree, frag, "numel"));
    std::optional<int64_t> start = IntAt(tree, Get(tree, frag, "start"));
    const std::string where =
        fmt::format("\"{}\": param_slice_mappings[{}][\"{}\"]", Where(files[d]), g, name);
    const Index size = group.numel[d];
    if (!numel || !start || *numel < 0 || *start < 0 || *start > size || *numel > size - *start) {
      return InvalidArgumentError(fmt::format(
          "{}: not a fragment_address inside the partition of {} elements", where, size));
    }
    const bool continues =
        spans.empty() ||
        (spans.back().rank + 1 == static_cast<Rank>(d) &&
         flat_offsets.back() + spans.back().length == group.numel[d - 1] && *start == 0);
    if (!continues || *numel > n - covered) {
      return InvalidArgumentError(fmt::format(
          "{}: (numel {}, start {}) does not continue the parameter's fragments on the DP ranks "
          "before it (a file from another run?)",
          where, *numel, *start));
    }
    spans.push_back({static_cast<Rank>(d), covered, *numel});
    flat_offsets.push_back(*start);
    covered += *numel;
  }
  if (covered != n) {
    return InvalidArgumentError(fmt::format(
        "\"{}\": parameter \"{}\" has {} elements but the DP ranks' param_slice_mappings hold {} "
        "(files from different runs?)",
        Where(model_[static_cast<size_t>(t)]), name, n, covered));
  }
  return spans;
}

// Records parameter i's TP shard t as DP fragments of the optimizer's states.
Status DeepSpeedReader::Place(Rank t, size_t i, const std::vector<FragmentSpan>& spans,
                              const std::vector<Index>& flat_offsets, const FlatGroup& group) {
  const Index n = ProductOf(tp_shapes_[i][static_cast<size_t>(t)]);
  RESHARD_ASSIGN_OR_RETURN(ParamMap dp_map, FragmentMap(n, c_.dp_, spans));
  for (DeepSpeedState s :
       {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq}) {
    DeepSpeedShardParts parts{dp_map, group.flat[Slot(s)]};
    for (size_t k = 0; k < spans.size(); ++k) {
      parts.fragments[static_cast<size_t>(spans[k].rank)].offset = flat_offsets[k];
    }
    params_[i].parts[static_cast<size_t>(t)][Slot(s)] = std::move(parts);
  }
  if (c_.stage_ != 3 && !spans.empty()) {
    const size_t first = static_cast<size_t>(spans.front().rank);
    params_[i].steps[static_cast<size_t>(t)] =
        DeepSpeedStep{group.flat[Slot(DeepSpeedState::kMaster)][first].file, group.step[first]};
  }
  return Status::Ok();
}

// ZeRO 1/2 (param_slice_mappings) and ZeRO 3 (ceil(n / DP) per rank, in order).
Status DeepSpeedReader::ReadPartitions() {
  size_t groups = 0;
  for (const size_t g : group_of_) {
    if (g != kNoGroup) groups = std::max(groups, g + 1);
  }
  for (size_t slice = 0; slice < optim_.size(); ++slice) {
    const Rank t = static_cast<Rank>(slice % static_cast<size_t>(c_.tp_));
    const Rank s = static_cast<Rank>(slice);  // the files' index
    auto here = [&](size_t i, size_t g) { return group_of_[i] == g && SliceOf(i, t) == slice; };
    for (size_t g = 0; g < groups; ++g) {
      // AutoEP's expert group is read by ReadExperts (and a stage may hold fewer groups).
      bool any = false;
      for (size_t i = 0; i < names_in_order_.size() && !any; ++i) any = here(i, g);
      if (!any) continue;
      RESHARD_ASSIGN_OR_RETURN(FlatGroup group, ReadFlatGroup(s, g));
      if (c_.stage_ != 3) RESHARD_RETURN_IF_ERROR(CheckSliceMappings(s, g, group));
      Index z3_offset = 0;  // ZeRO 3: where the next parameter starts in every rank's flat group
      for (size_t i = 0; i < names_in_order_.size(); ++i) {
        if (!here(i, g)) continue;
        std::vector<Index> flat_offsets;
        std::vector<FragmentSpan> spans;
        if (c_.stage_ == 3) {
          const Index n = ProductOf(tp_shapes_[i][static_cast<size_t>(t)]);
          const Index per_rank = (n + c_.dp_ - 1) / c_.dp_;
          for (int d = 0; d < c_.dp_; ++d) {
            const Index begin = std::min(n, d * per_rank);
            const Index end = std::min(n, (d + 1) * per_rank);
            if (end - begin > group.numel[static_cast<size_t>(d)] - z3_offset) {
              return InvalidArgumentError(fmt::format(
                  "\"{}\": fp32_flat_groups[{}] has {} elements, too few for parameter \"{}\" "
                  "at {} (files from different runs?)",
                  Where(optim_[slice][static_cast<size_t>(d)]), g,
                  group.numel[static_cast<size_t>(d)], names_in_order_[i], z3_offset));
            }
            spans.push_back({static_cast<Rank>(d), begin, end - begin});
            flat_offsets.push_back(z3_offset);
          }
          z3_offset += per_rank;
        } else {
          RESHARD_ASSIGN_OR_RETURN(spans, SliceMappings(s, g, i, group, flat_offsets));
        }
        RESHARD_RETURN_IF_ERROR(Place(t, i, spans, flat_offsets, group));
      }
    }
  }
  return Status::Ok();
}

// ZeRO 0 without optimizer files: the torch optimizer's state_dict in the model states (under
// "optimizer", or "optimizer.optimizer_state_dict" inside DeepSpeed's fp16/bf16 wrapper, whose
// fp32_groups[g][j] are the master weights); state[k] belongs to the parameter at position k
// of the groups' params lists.
Status DeepSpeedReader::ReadTorchOptimizer() {
  for (size_t slice = 0; slice < model_.size(); ++slice) {
    const Rank t = static_cast<Rank>(slice % static_cast<size_t>(c_.tp_));
    const TorchFile* f = model_[slice];
    std::vector<size_t> mine;  // the parameters of this file's stage, in order
    for (size_t i = 0; i < params_.size(); ++i) {
      if (SliceOf(i, t) == slice && params_[i].kind == DeepSpeedParamKind::kTrained)
        mine.push_back(i);
    }
    const PickleTree& tree = f->tree();
    const bool wrapped = !IsNone(tree, Walk(tree, tree.root(), "optimizer.optimizer_state_dict"));
    const std::string opt = wrapped ? "optimizer.optimizer_state_dict" : "optimizer";
    const PickleNodeId groups = Walk(tree, tree.root(), opt + ".param_groups");
    if (IsNone(tree, groups)) return Status::Ok();
    std::vector<std::pair<int64_t, std::string>> keys;  // state key, master weights' path
    const std::vector<PickleNodeId>& group_list = tree.node(groups).items;
    for (size_t g = 0; g < group_list.size(); ++g) {
      const PickleNodeId params = Get(tree, group_list[g], "params");
      if (params == kNoPickleNode) continue;
      const std::vector<PickleNodeId>& ids = tree.node(params).items;
      for (size_t j = 0; j < ids.size(); ++j) {
        keys.emplace_back(IntAt(tree, ids[j]).value_or(-1),
                          wrapped ? fmt::format("optimizer.fp32_groups.{}.{}", g, j) : "");
      }
    }
    if (keys.size() != mine.size()) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": the optimizer's param_groups list {} parameters but the module has {} (a "
          "frozen parameter, which no param group holds? ZeRO 0 records no param_shapes to "
          "tell one by)",
          Where(f), keys.size(), mine.size()));
    }
    for (size_t j = 0; j < mine.size(); ++j) {
      const size_t i = mine[j];
      const Index n = ProductOf(tp_shapes_[i][static_cast<size_t>(t)]);
      RESHARD_ASSIGN_OR_RETURN(ParamMap whole, FragmentMap(n, 1, {{0, 0, n}}));
      for (DeepSpeedState s :
           {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq}) {
        if (s == DeepSpeedState::kMaster && !wrapped) continue;  // the module's weights are
        const std::string path =
            s == DeepSpeedState::kMaster
                ? keys[j].second
                : fmt::format("{}.state.{}.{}", opt, keys[j].first, DeepSpeedStateName(s));
        const TorchTensor* tensor = f->TensorAt(Walk(tree, tree.root(), path));
        if (tensor == nullptr || tensor->numel() != n || tensor->dtype.dtype != DType::kF32) {
          return InvalidArgumentError(
              fmt::format("\"{}\": {} is not an F32 tensor of {} elements (parameter \"{}\")",
                          Where(f), path, n, params_[i].name));
        }
        params_[i].parts[static_cast<size_t>(t)][Slot(s)] =
            DeepSpeedShardParts{whole, {{f, tensor, 0}}};
      }
      params_[i].steps[static_cast<size_t>(t)] = DeepSpeedStep{
          f, Walk(tree, tree.root(), fmt::format("{}.state.{}.step", opt, keys[j].first))};
    }
  }
  c_.has_optimizer_ = true;
  c_.optimizer_file_ = model_[0];
  return Status::Ok();
}

// The module's weights: each TP rank's tensor, whole (ZeRO 0-2; under ZeRO 3 they are empty
// and the module state is read from the master weights).
Status DeepSpeedReader::ReadModuleFragments() {
  if (!layer_files_.empty()) return ReadLayerWeights();
  const bool zero3 = c_.stage_ == 3;
  if (zero3) {
    const PickleTree& tree = model_[0]->tree();
    const PickleNodeId cfg = Get(tree, tree.root(), "ds_config");
    auto enabled = [&](const char* key) {
      const PickleNodeId e = Walk(tree, cfg, std::string(key) + ".enabled");
      return e != kNoPickleNode && tree.node(e).kind == PickleKind::kBool &&
             tree.node(e).bool_value;
    };
    c_.module_dtype_ = enabled("bf16") ? DType::kBF16 : enabled("fp16") ? DType::kF16 : DType::kF32;
  }
  bool first = true;
  for (Rank t = 0; t < c_.tp_; ++t) {
    const TorchFile* f = model_[static_cast<size_t>(t)];
    std::map<std::string, const TorchTensor*> by_name;
    for (const TorchTensor& tensor : f->tensors()) by_name.emplace(tensor.name, &tensor);
    for (size_t i = 0; i < params_.size(); ++i) {
      const bool trained = params_[i].kind == DeepSpeedParamKind::kTrained;
      if (zero3 && trained) continue;  // empty: the module state is the masters, rounded
      const std::string key = "module." + params_[i].name;
      auto it = by_name.find(key);
      const Shape& shape = tp_shapes_[i][static_cast<size_t>(t)];
      if (it == by_name.end() || it->second->shape != shape || !it->second->dtype.dtype) {
        return InvalidArgumentError(
            fmt::format("\"{}\": {} is missing or is not a tensor of shape {}", Where(f), key,
                        FormatShape(shape)));
      }
      const DType dtype = *it->second->dtype.dtype;
      if (trained && first) c_.module_dtype_ = dtype;
      if (trained) first = false;
      const DType want = trained ? c_.module_dtype_ : params_[i].own_dtype.value_or(dtype);
      if (dtype != want) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": {} is {}, but {} {}", Where(f), key, DTypeName(dtype),
            trained ? "the module's first weight is" : "TP rank 0 holds it as", DTypeName(want)));
      }
      const Index n = ProductOf(shape);
      RESHARD_ASSIGN_OR_RETURN(ParamMap whole, FragmentMap(n, 1, {{0, 0, n}}));
      DeepSpeedShardParts parts{whole, {{f, it->second, 0}}};
      auto& slots = params_[i].parts[static_cast<size_t>(t)];
      // Without a separate master copy (fp32 ZeRO 0), the module's weights are the master.
      if (trained && c_.module_dtype_ == DType::kF32 && !slots[Slot(DeepSpeedState::kMaster)])
        slots[Slot(DeepSpeedState::kMaster)] = parts;
      slots[Slot(DeepSpeedState::kModule)] = std::move(parts);
    }
  }
  return Status::Ok();
}

// ---- pipeline layer files --------------------------------------------------------------

Result<const TorchFile*> DeepSpeedReader::LayerFile(int layer, Rank t) {
  const std::string name = layer_files_name_tp_
                               ? fmt::format("layer_{:02d}-model_{:02d}-model_states.pt", layer, t)
                               : fmt::format("layer_{:02d}-model_states.pt", layer);
  if (auto it = opened_layers_.find(name); it != opened_layers_.end()) return it->second;
  RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, OpenFile(name));
  opened_layers_.emplace(name, f);
  return f;
}

namespace {

// "tied_modules.<key>.<name>" -> (key, name); nullopt for other names.
std::optional<std::pair<std::string, std::string>> TiedName(const std::string& name) {
  constexpr std::string_view kPrefix = "tied_modules.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const size_t dot = name.find('.', kPrefix.size());
  if (dot == std::string::npos || dot == kPrefix.size() || dot + 1 == name.size())
    return std::nullopt;
  return std::make_pair(name.substr(kPrefix.size(), dot - kPrefix.size()), name.substr(dot + 1));
}

// "<layer index>.<name>" -> (index, name); nullopt for other names.
std::optional<std::pair<int, std::string>> LayerName(const std::string& name) {
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 6 || dot + 1 == name.size())
    return std::nullopt;
  int layer = 0;
  for (size_t k = 0; k < dot; ++k) {
    if (name[k] < '0' || name[k] > '9') return std::nullopt;
    layer = layer * 10 + (name[k] - '0');
  }
  return std::make_pair(layer, name.substr(dot + 1));
}

const TorchTensor* TensorNamed(const TorchFile& f, const std::string& name) {
  for (const TorchTensor& t : f.tensors()) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

}  // namespace

// Which layer owns each tied module: the checkpoint names no owner, so the layer files of
// layers no stage lists parameters of are matched by their tensors (names and shapes) against
// the tied modules' parameters. The lowest such layer is taken (a tied module saved by two
// layers is saved twice, the same). {tied key: layer index}.
Result<std::map<std::string, int>> DeepSpeedReader::TiedModuleKeys() {
  std::set<int> listed;
  std::map<std::string, std::map<std::string, Shape>> tied;  // key -> name -> TP rank 0 shape
  for (size_t i = 0; i < names_in_order_.size(); ++i) {
    if (auto l = LayerName(names_in_order_[i])) listed.insert(l->first);
    if (auto k = TiedName(names_in_order_[i])) tied[k->first][k->second] = tp_shapes_[i].front();
  }
  std::map<std::string, int> owner;
  if (tied.empty()) return owner;
  static const std::regex kLayerFile(R"(layer_(\d+)-(model_(\d+)-)?model_states\.pt)");
  std::set<int> candidates;
  for (const std::string& name : layer_files_) {
    std::smatch m;
    if (std::regex_match(name, m, kLayerFile) && m[1].length() <= 6 &&
        !listed.contains(std::stoi(m[1].str())))
      candidates.insert(std::stoi(m[1].str()));
  }
  for (const int layer : candidates) {
    RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, LayerFile(layer, 0));
    std::vector<std::string> matched;
    for (const auto& [key, names] : tied) {
      const bool all = std::all_of(names.begin(), names.end(), [&](const auto& entry) {
        const TorchTensor* t = TensorNamed(*f, entry.first);
        return t != nullptr && t->shape == entry.second;
      });
      if (all) matched.push_back(key);
    }
    if (matched.size() > 1) {
      return UnimplementedError(fmt::format(
          "\"{}\" could hold tied module \"{}\" or \"{}\" (the checkpoint does not say which "
          "layer owns which)",
          Where(f), matched[0], matched[1]));
    }
    if (matched.size() == 1) {
      auto [it, fresh] = owner.emplace(matched[0], layer);
      if (!fresh) {
        RESHARD_ASSIGN_OR_RETURN(const TorchFile* first, LayerFile(it->second, 0));
        return InvalidArgumentError(fmt::format(
            "\"{}\" and \"{}\" could both hold tied module \"{}\" (the checkpoint does not say "
            "which layer owns it; a stray copy?)",
            Where(first), Where(f), matched[0]));
      }
    }
  }
  return owner;
}

// A PipelineModule's layer files hold, beside the parameters its stages list, the persistent
// buffers (buffer_names lists them as "<layer>.<name>") and the frozen parameters (no param
// group holds them; the pipeline engine records no frozen_param_shapes) of their layers. Each
// is read as a tensor of the stage whose parameters its layer holds, from the module alone, in
// its own dtype. What a tied module's file or a layer no stage lists holds beside that is left
// to CheckLayerFilesRead.
Status DeepSpeedReader::AppendLayerModuleOnly() {
  std::set<std::string> buffers;
  for (const TorchFile* f : model_) {
    const PickleTree& t = f->tree();
    const PickleNodeId b = Get(t, t.root(), "buffer_names");
    if (IsNone(t, b)) continue;
    for (PickleNodeId c : t.node(b).items) buffers.insert(t.node(c).text);
  }
  const std::set<std::string> listed(names_in_order_.begin(), names_in_order_.end());
  std::map<int, int> stage_of_layer;
  for (size_t i = 0; i < names_in_order_.size(); ++i) {
    if (auto l = LayerName(names_in_order_[i])) stage_of_layer.emplace(l->first, stage_of_[i]);
  }
  for (const auto& [layer, stage] : stage_of_layer) {
    const size_t begin = names_in_order_.size();
    const TorchFile* first = nullptr;
    for (Rank t = 0; t < c_.tp_; ++t) {
      RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, LayerFile(layer, t));
      size_t k = begin;
      for (const TorchTensor& tensor : f->tensors()) {
        std::string name = fmt::format("{}.{}", layer, tensor.name);
        if (listed.contains(name)) continue;
        if (!tensor.dtype.dtype) {
          return InvalidArgumentError(
              fmt::format("\"{}\": \"{}\" has no dtype reshard reads", Where(f), tensor.name));
        }
        if (t == 0) {
          const bool buffer = buffers.contains(name);
          AddParam(std::move(name), kNoGroup, stage,
                   {buffer ? DeepSpeedParamKind::kBuffer : DeepSpeedParamKind::kFrozen,
                    tensor.dtype.dtype});
        } else if (k >= names_in_order_.size() || names_in_order_[k] != name) {
          return InvalidArgumentError(fmt::format(
              "\"{}\" holds \"{}\" beside its stage's parameters, which \"{}\" does not hold "
              "there",
              Where(f), tensor.name, Where(first)));
        }
        tp_shapes_[k++].push_back(tensor.shape);
      }
      if (t == 0) first = f;
      if (k != names_in_order_.size()) {
        return InvalidArgumentError(
            fmt::format("\"{}\" lacks \"{}\", which \"{}\" holds beside its stage's parameters",
                        Where(f), LayerName(names_in_order_[k])->second, Where(first)));
      }
    }
  }
  return Status::Ok();
}

// Pipeline stages: each parameter's module weights from its layer's file (TiedModuleKeys for
// the tied modules'), in the module's dtype, which every layer shares.
Status DeepSpeedReader::ReadLayerWeights() {
  RESHARD_ASSIGN_OR_RETURN(const auto owner, TiedModuleKeys());
  c_.tied_owners_ = owner;
  c_.stage_params_.assign(static_cast<size_t>(c_.pp_), {});
  for (size_t i = 0; i < names_in_order_.size(); ++i)
    c_.stage_params_[static_cast<size_t>(stage_of_[i])].push_back(names_in_order_[i]);
  bool first = true;
  std::map<const TorchFile*, std::set<std::string>> read;  // the tensors read of each file
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& param = params_[i].name;
    std::optional<std::pair<int, std::string>> at = LayerName(param);
    if (auto tied = TiedName(param)) {
      auto it = owner.find(tied->first);
      if (it == owner.end()) {
        return NotFoundError(
            fmt::format("\"{}\": no layer file holds tied module \"{}\" (parameter \"{}\")",
                        c_.tag_dir_, tied->first, param));
      }
      at = std::make_pair(it->second, tied->second);
    }
    if (!at) {
      return InvalidArgumentError(
          fmt::format("\"{}\": parameter \"{}\" is named neither <layer>.<name> nor "
                      "tied_modules.<key>.<name>, so no layer file holds it",
                      Where(model_[SliceOf(i, 0)]), param));
    }
    for (Rank t = 0; t < c_.tp_; ++t) {
      RESHARD_ASSIGN_OR_RETURN(const TorchFile* f, LayerFile(at->first, t));
      const TorchTensor* tensor = TensorNamed(*f, at->second);
      read[f].insert(at->second);
      const Shape& shape = tp_shapes_[i][static_cast<size_t>(t)];
      if (tensor == nullptr || tensor->shape != shape || !tensor->dtype.dtype) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": \"{}\" (parameter \"{}\") is missing or is not a tensor of shape {}", Where(f),
            at->second, param, FormatShape(shape)));
      }
      const bool trained = params_[i].kind == DeepSpeedParamKind::kTrained;
      if (first && trained) c_.module_dtype_ = *tensor->dtype.dtype;
      if (trained) first = false;
      const DType want = trained ? c_.module_dtype_ : params_[i].own_dtype.value_or(DType::kF32);
      if (*tensor->dtype.dtype != want) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": \"{}\" is {}, but {} {}", Where(f), at->second,
            DTypeName(*tensor->dtype.dtype),
            trained ? "the module's first weight is" : "TP rank 0 holds it as", DTypeName(want)));
      }
      const Index n = ProductOf(shape);
      RESHARD_ASSIGN_OR_RETURN(ParamMap whole, FragmentMap(n, 1, {{0, 0, n}}));
      DeepSpeedShardParts parts{whole, {{f, tensor, 0}}};
      auto& slots = params_[i].parts[static_cast<size_t>(t)];
      if (trained && c_.module_dtype_ == DType::kF32 && !slots[Slot(DeepSpeedState::kMaster)])
        slots[Slot(DeepSpeedState::kMaster)] = parts;
      slots[Slot(DeepSpeedState::kModule)] = std::move(parts);
    }
  }
  return CheckLayerFilesRead(read);
}

// Every layer file is one a parameter was read from, and every tensor in it a parameter read
// (DeepSpeed's loader globs layer_XX-*model_states.pt, so a stray file is not harmless):
// files of a TP rank the checkpoint does not have, or named with and without TP ranks, are
// refused; so are a file of a layer no stage lists and no tied module owns that holds
// tensors, and a tied module's tensors that are not parameters of the optimizer's (persistent
// buffers, which buffer_names lists, and frozen parameters), which are not read yet: refused
// rather than dropped from every output. (Other layers' are read: AppendLayerModuleOnly.)
Status DeepSpeedReader::CheckLayerFilesRead(
    const std::map<const TorchFile*, std::set<std::string>>& read) {
  static const std::regex kLayerFile(R"(layer_(\d+)-(model_(\d+)-)?model_states\.pt)");
  std::set<std::string> buffers;
  for (const TorchFile* f : model_) {
    const PickleTree& t = f->tree();
    const PickleNodeId b = Get(t, t.root(), "buffer_names");
    if (IsNone(t, b)) continue;
    for (PickleNodeId c : t.node(b).items) buffers.insert(t.node(c).text);
  }
  for (const std::string& name : layer_files_) {
    std::smatch m;
    if (!std::regex_match(name, m, kLayerFile)) continue;  // layer_files_ holds only matches
    const std::string path = (fs::path(c_.tag_dir_) / name).string();
    if (m[2].matched != layer_files_name_tp_ ||
        (m[2].matched && (m[3].length() > 6 || std::stoi(m[3].str()) >= c_.tp_))) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" is no layer file of a checkpoint of {} TP ranks whose layer files are named "
          "{} (a stray file? DeepSpeed's loader would read it)",
          path, c_.tp_,
          layer_files_name_tp_ ? "layer_XX-model_YY-model_states.pt" : "layer_XX-model_states.pt"));
    }
    auto opened = opened_layers_.find(name);
    const TorchFile* f = nullptr;
    if (opened != opened_layers_.end()) {
      f = opened->second;
    } else {
      RESHARD_ASSIGN_OR_RETURN(f, OpenFile(name));
      opened_layers_.emplace(name, f);
    }
    auto it = read.find(f);
    for (const TorchTensor& tensor : f->tensors()) {
      if (it != read.end() && it->second.contains(tensor.name)) continue;
      if (it == read.end()) {
        return InvalidArgumentError(fmt::format(
            "\"{}\" holds \"{}\", but its layer is none a stage lists parameters of and holds no "
            "tied module (a stray file? DeepSpeed's loader would read it; or a layer, or a tied "
            "module, all of whose tensors are frozen parameters or buffers: which stage holds "
            "it is not recorded, and it is not read)",
            path, tensor.name));
      }
      std::string layer = m[1].str();  // the engine's name: "<layer index>.<name>"
      layer.erase(0, std::min(layer.find_first_not_of('0'), layer.size() - 1));
      layer += "." + tensor.name;
      return UnimplementedError(fmt::format(
          "\"{}\" holds \"{}\", which is no parameter of its stage's optimizer: {}; a tied "
          "module's buffers and frozen parameters are not read yet, and are refused rather than "
          "dropped",
          path, tensor.name,
          buffers.contains(layer)
              ? fmt::format("a module buffer (buffer_names lists \"{}\")", layer)
              : "a frozen parameter (one no param group holds) or a buffer"));
    }
  }
  return Status::Ok();
}

// ---- what ties the files together ---------------------------------------------------------

namespace {

// A node as text, for comparing what two files record: plain data, records by class,
// arguments and state, tensors by dtype, shape and (up to 64 bytes) their bytes. `budget`
// bounds the nodes visited, a node shared through the memo counting at each use.
void AppendCanon(const TorchFile& f, PickleNodeId id, int depth, size_t& budget, std::string& out) {
  if (id == kNoPickleNode) {
    out += "(absent)";
    return;
  }
  if (budget == 0 || depth > 64) {
    out += "...";
    return;
  }
  --budget;
  if (const TorchTensor* t = f.TensorAt(id)) {
    out += fmt::format("tensor({}, {}", t->dtype.name, FormatShape(t->shape));
    const TorchStorage& s = f.storages()[t->storage];
    const uint64_t begin = static_cast<uint64_t>(t->storage_offset) * t->dtype.size;
    if (t->is_contiguous() && t->num_bytes() <= 64 && begin + t->num_bytes() <= s.bytes.size()) {
      for (Index k = 0; k < t->numel(); ++k) {
        const std::byte* e = s.bytes.data() + begin + static_cast<uint64_t>(k) * t->dtype.size;
        if (t->dtype.dtype) {
          out += ", " + FormatElement(*t->dtype.dtype, e);
        } else {
          out += ", 0x";
          for (size_t b = 0; b < t->dtype.size; ++b)
            out += fmt::format("{:02x}", static_cast<unsigned>(e[b]));
        }
      }
    }
    out += ")";
    return;
  }
  const PickleTree& tree = f.tree();
  const PickleNode& n = tree.node(id);
  auto list = [&](const std::vector<PickleNodeId>& items, const char* open, const char* close) {
    out += open;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += ", ";
      AppendCanon(f, items[i], depth + 1, budget, out);
    }
    out += close;
  };
  switch (n.kind) {
    case PickleKind::kNone:
      out += "None";
      break;
    case PickleKind::kBool:
      out += n.bool_value ? "True" : "False";
      break;
    case PickleKind::kInt:
      out += std::to_string(n.int_value);
      break;
    case PickleKind::kFloat:
      out += fmt::format("{}", n.float_value);
      break;
    case PickleKind::kStr:
      out += fmt::format("\"{}\"", n.text);
      break;
    case PickleKind::kBigInt:
    case PickleKind::kBytes:
      out += "b'";
      for (char c : n.text) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
      out += "'";
      break;
    case PickleKind::kList:
      list(n.items, "[", "]");
      break;
    case PickleKind::kTuple:
    case PickleKind::kPersistentId:
      list(n.items, "(", ")");
      break;
    case PickleKind::kSet:
      list(n.items, "{", "}");
      break;
    case PickleKind::kGlobal:
      out += n.text;
      break;
    case PickleKind::kDict:
      out += "{";
      for (size_t i = 0; i < n.entries.size(); ++i) {
        if (i > 0) out += ", ";
        AppendCanon(f, n.entries[i].first, depth + 1, budget, out);
        out += ": ";
        AppendCanon(f, n.entries[i].second, depth + 1, budget, out);
      }
      out += "}";
      if (n.state != kNoPickleNode) AppendCanon(f, n.state, depth + 1, budget, out);
      break;
    case PickleKind::kRecord:
      out += n.text;
      AppendCanon(f, n.args, depth + 1, budget, out);
      if (n.state != kNoPickleNode) {
        out += ".state=";
        AppendCanon(f, n.state, depth + 1, budget, out);
      }
      break;
  }
}

std::string Canon(const TorchFile& f, PickleNodeId id) {
  size_t budget = size_t{1} << 16;
  std::string out;
  AppendCanon(f, id, 0, budget, out);
  return out;
}

std::string Shortened(const std::string& s) {
  return s.size() <= 120 ? s : s.substr(0, 117) + "...";
}

// Where two renderings of a dict first differ, as a dotted key path of `key` (ds_config's
// keys), for a message; `key` itself when they are not both plain data.
std::string FirstDifference(const TorchFile& a, const TorchFile& b, std::string_view key) {
  const Value va = ToJson(a.tree(), Walk(a.tree(), a.tree().root(), key));
  const Value vb = ToJson(b.tree(), Walk(b.tree(), b.tree().root(), key));
  if (!va.is_object() || !vb.is_object()) return std::string(key);
  const Value patch = Value::diff(va, vb);
  if (patch.empty() || !patch[0].contains("path")) return std::string(key);
  std::string path = patch[0]["path"].get<std::string>();
  std::replace(path.begin(), path.end(), '/', '.');
  return std::string(key) + path;
}

// Element k (row-major, of the tensor's own shape) of a tensor: its bytes in the mapped
// storage, or null when it lies outside.
const std::byte* ElementOf(const TorchFile& f, const TorchTensor& t, Index k) {
  Index offset = t.storage_offset;
  for (size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] == 0) return nullptr;
    offset += (k % t.shape[d]) * t.strides[d];
    k /= t.shape[d];
  }
  const TorchStorage& s = f.storages()[t.storage];
  const uint64_t begin = static_cast<uint64_t>(offset) * t.dtype.size;
  if (offset < 0 || begin + t.dtype.size > s.bytes.size()) return nullptr;
  return s.bytes.data() + begin;
}

// Where the elements of a TP shard (flattened) lie in its DP fragments: element k's DP rank
// and bytes, found by a binary search over the fragments' ranges.
class ShardElements {
 public:
  explicit ShardElements(const DeepSpeedShardParts& parts) : parts_(parts) {
    for (Rank d = 0; d < parts.dp_map.world_size(); ++d) {
      for (const Piece& piece : parts.dp_map.rank(d).pieces)
        ranges_.push_back({piece.source.offset, piece.num_elements(), d, piece.dest.offset});
    }
    std::sort(ranges_.begin(), ranges_.end(),
              [](const Range& a, const Range& b) { return a.start < b.start; });
  }
  // The DP rank holding element k and its bytes (null: no fragment holds it).
  std::pair<Rank, const std::byte*> At(Index k) const {
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), k,
                               [](Index v, const Range& r) { return v < r.start; });
    if (it == ranges_.begin()) return {-1, nullptr};
    --it;
    if (k >= it->start + it->length) return {-1, nullptr};
    const DeepSpeedFragment& f = parts_.fragments[static_cast<size_t>(it->rank)];
    return {it->rank, ElementOf(*f.file, *f.tensor, f.offset + it->dest + (k - it->start))};
  }

 private:
  struct Range {
    Index start, length;
    Rank rank;
    Index dest;
  };
  const DeepSpeedShardParts& parts_;
  std::vector<Range> ranges_;
};

// The elements of a TP shard a check compares: the first and the last few of every DP
// fragment, where a fragment from elsewhere or a misplaced boundary shows, and only those (a
// bounded sample: a few pages of each file).
constexpr Index kSampleEnds = 16;

std::vector<Index> SamplePositions(const DeepSpeedShardParts& parts) {
  std::vector<Index> out;
  for (Rank d = 0; d < parts.dp_map.world_size(); ++d) {
    for (const Piece& piece : parts.dp_map.rank(d).pieces) {
      const Index start = piece.source.offset, n = piece.num_elements();
      for (Index k = 0; k < std::min(n, kSampleEnds); ++k) out.push_back(start + k);
      for (Index k = std::max(kSampleEnds, n - kSampleEnds); k < n; ++k) out.push_back(start + k);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Whether TP rank r holds parameter `map` whole, as every other rank does (a replica of all of
// F, element k of the flattened shard being element k of F).
bool HeldWholeByEveryRank(const ParamMap& map) {
  if (map.world_size() < 2) return false;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& s = map.rank(r);
    if (s.pieces.size() != 1) return false;
    const Piece& p = s.pieces.front();
    if (p.num_elements() != map.num_elements() ||
        p.locations.size() != static_cast<size_t>(map.world_size()) || p.scale != 1.0 ||
        p.source != p.dest || p.source.offset != 0 || s.shard_shape != map.logical_shape()) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool IsMasterRounded(DType dtype, const std::byte* module, const std::byte* master) {
  float m;
  std::memcpy(&m, master, sizeof m);
  if (dtype == DType::kF32) {
    float w;
    std::memcpy(&w, module, sizeof w);
    return std::bit_cast<uint32_t>(w) == std::bit_cast<uint32_t>(m) ||
           (std::isnan(w) && std::isnan(m));
  }
  uint16_t w;
  std::memcpy(&w, module, sizeof w);
  const bool bf16 = dtype == DType::kBF16;
  if ((bf16 ? FloatToBFloat16(m) : FloatToHalf(m)) == w) return true;
  return std::isnan(m) && std::isnan(bf16 ? BFloat16ToFloat(w) : HalfToFloat(w));
}

// Every file records the DeepSpeed version and the configuration, every model-states file the
// step it was saved at and the topology, every optimizer file the ZeRO stage, the partition
// count, the loss scaler, the parameter groups and each group's step: all must agree with the
// first file's.
Status DeepSpeedReader::CheckMetadataAgrees() const {
  const TorchFile* first = all_model_.front();
  auto compare = [&](const TorchFile* base, const TorchFile* f, std::string_view key) -> Status {
    const std::string want = Canon(*base, Walk(base->tree(), base->tree().root(), key));
    const std::string got = Canon(*f, Walk(f->tree(), f->tree().root(), key));
    if (got == want) return Status::Ok();
    const std::string where =
        key == "ds_config" ? FirstDifference(*base, *f, key) : std::string(key);
    return InvalidArgumentError(fmt::format(
        "\"{}\" does not belong with \"{}\": {} is {} there but {} here (a file from another run "
        "or another step? every file of a checkpoint records the same)",
        Where(f), Where(base), where, Shortened(want), Shortened(got)));
  };
  for (size_t k = 1; k < all_model_.size(); ++k) {
    for (const char* key :
         {"ds_version", "mp_world_size", "dp_world_size", "global_steps", "global_samples",
          "skipped_steps", "checkpoint_parallel_dimensions", "ds_config"}) {
      RESHARD_RETURN_IF_ERROR(compare(first, all_model_[k], key));
    }
  }
  if (optim_.empty()) return Status::Ok();
  const bool z3 = c_.stage_ == 3;
  const std::string opt = z3 ? "optimizer_state_dict.optimizer_state_dict"
                             : "optimizer_state_dict.base_optimizer_state";
  const TorchFile* o0 = optim_[0][0];
  // Each group's step, by the group's key in the optimizer's state.
  auto steps = [&](const TorchFile* f) {
    const PickleTree& t = f->tree();
    std::string out;
    const PickleNodeId groups = Walk(t, t.root(), opt + ".param_groups");
    for (size_t g = 0; groups != kNoPickleNode && g < t.node(groups).items.size(); ++g) {
      const std::optional<int64_t> key =
          IntAt(t, Walk(t, t.root(), fmt::format("{}.param_groups.{}.params.0", opt, g)));
      const PickleNodeId step =
          Walk(t, t.root(), fmt::format("{}.state.{}.step", opt, key.value_or(-1)));
      const TorchTensor* tensor = f->TensorAt(step);
      std::string value = Canon(*f, step);
      if (tensor != nullptr && tensor->numel() == 1 && tensor->dtype.dtype) {
        if (const std::byte* e = ElementOf(*f, *tensor, 0))
          value = FormatElement(*tensor->dtype.dtype, e);
      }
      out += fmt::format("{}group {}: {}", g == 0 ? "" : ", ", g, value);
    }
    return out;
  };
  const std::string want_steps = steps(o0);
  for (const auto& by_dp : optim_) {
    for (const TorchFile* f : by_dp) {
      RESHARD_RETURN_IF_ERROR(compare(first, f, "ds_version"));
      RESHARD_RETURN_IF_ERROR(compare(first, f, "ds_config"));
      if (f == o0) continue;
      for (const std::string& key :
           {std::string("optimizer_state_dict.zero_stage"),
            std::string("optimizer_state_dict.partition_count"),
            std::string("optimizer_state_dict.loss_scaler"),
            std::string("optimizer_state_dict.dynamic_loss_scale"),
            std::string("optimizer_state_dict.overflow"),
            std::string("optimizer_state_dict.clip_grad"), opt + ".param_groups"}) {
        RESHARD_RETURN_IF_ERROR(compare(o0, f, key));
      }
      const std::string got_steps = steps(f);
      if (got_steps != want_steps) {
        return InvalidArgumentError(fmt::format(
            "\"{}\" does not belong with \"{}\": the optimizer's step is {} there but {} here (a "
            "file from another run or another step?)",
            Where(f), Where(o0), Shortened(want_steps), Shortened(got_steps)));
      }
    }
  }
  return Status::Ok();
}

// Where the module's weights and the fp32 master weights are kept apart (ZeRO 1/2 in the
// optimizer files, ZeRO 0 with DeepSpeed's fp16/bf16 wrapper in the model states), DeepSpeed
// copies the masters into the module after each step: each module element is its master
// rounded to the module's dtype (to nearest even). A sample of every DP fragment is compared;
// the file blamed is the DP rank's optimizer file when the others agree with the module, else
// the model-states file.
Status DeepSpeedReader::CheckModuleIsMasterRounded() const {
  const DType dtype = c_.module_dtype_;
  // A tied module's copies on later pipeline stages are compared with the first stage's
  // (CheckTiedCopies), not with the module.
  std::map<std::string, size_t> first_of;
  for (size_t i = 0; i < params_.size(); ++i) first_of.emplace(params_[i].name, i);
  for (size_t slice = 0; slice < model_.size(); ++slice) {
    const Rank t = static_cast<Rank>(slice % static_cast<size_t>(c_.tp_));
    // By the module file (the model states; pipeline stages: each layer's file): DP rank ->
    // what disagrees there first, and the DP ranks that hold some compared fragment.
    std::map<const TorchFile*, std::map<Rank, std::string>> bad_in;
    std::map<const TorchFile*, std::set<Rank>> holding_in;
    const TorchFile* model = nullptr;  // the first module file that disagrees
    for (size_t i = 0; i < params_.size(); ++i) {
      const DeepSpeedParam& p = params_[i];
      if (SliceOf(i, t) != slice || first_of.at(p.name) != i) continue;
      const auto& slots = p.parts[static_cast<size_t>(t)];
      const auto& module = slots[Slot(DeepSpeedState::kModule)];
      const auto& master = slots[Slot(DeepSpeedState::kMaster)];
      if (!module || !master || module->fragments.size() != 1) continue;
      const DeepSpeedFragment& mf = module->fragments.front();
      auto& bad = bad_in[mf.file];
      auto& holding = holding_in[mf.file];
      if (master->fragments.size() == 1 && master->fragments.front().tensor == mf.tensor) continue;
      const ShardElements masters(*master);
      for (const Index k : SamplePositions(*master)) {
        const auto [d, master_bytes] = masters.At(k);
        const std::byte* module_bytes = ElementOf(*mf.file, *mf.tensor, k);
        if (master_bytes == nullptr || module_bytes == nullptr) continue;
        holding.insert(d);
        if (bad.contains(d) || IsMasterRounded(dtype, module_bytes, master_bytes)) continue;
        float m;
        std::memcpy(&m, master_bytes, sizeof m);
        const uint16_t rounded = dtype == DType::kBF16 ? FloatToBFloat16(m) : FloatToHalf(m);
        const std::byte* rounded_bytes =
            dtype == DType::kF32 ? master_bytes : reinterpret_cast<const std::byte*>(&rounded);
        const std::string master_is =
            dtype == DType::kF32
                ? FormatElement(DType::kF32, master_bytes)
                : fmt::format("{} (rounded to {}: {})", FormatElement(DType::kF32, master_bytes),
                              DTypeName(dtype), FormatElement(dtype, rounded_bytes));
        if (model == nullptr) model = mf.file;
        bad[d] =
            fmt::format("parameter \"{}\", element {}: the master weight is {}, the module's {}",
                        p.name, k, master_is, FormatElement(dtype, module_bytes));
      }
    }
    if (model == nullptr) continue;
    const auto& bad = bad_in[model];
    const auto& holding = holding_in[model];
    const auto& [d, what] = *bad.begin();
    const TorchFile* optim = optim_.empty() ? model : optim_[slice][static_cast<size_t>(d)];
    if (optim != model && bad.size() < holding.size()) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" does not belong with \"{}\": its fp32 master weights are not the module's "
          "weights there ({}), while the other DP ranks' are (a file from another run or "
          "step?)",
          Where(optim), Where(model), what));
    }
    return InvalidArgumentError(fmt::format(
        "\"{}\": the module's weights are not the fp32 master weights {} rounded to {} ({}): the "
        "file (or the optimizer state beside it) is from another run or step",
        Where(model),
        optim == model ? "kept in the same file" : fmt::format("of \"{}\"", Where(optim)),
        DTypeName(dtype), what));
  }
  return Status::Ok();
}

// A parameter every TP rank holds whole (a norm, a replicated bias) is the same on every TP
// rank in each state: DeepSpeed updates the replicas alike. A sample of every DP fragment of
// every rank is compared with TP rank 0's (with three or more TP ranks, the odd one is named).
Status DeepSpeedReader::CheckTpReplicasAgree() const {
  for (const DeepSpeedParam& p : params_) {
    if (!HeldWholeByEveryRank(p.tp_map)) continue;
    for (int s = 0; s < kNumDeepSpeedStates; ++s) {
      const DeepSpeedState state = static_cast<DeepSpeedState>(s);
      std::vector<const DeepSpeedShardParts*> ranks;
      for (Rank t = 0; t < c_.tp_; ++t) {
        const auto& slot = p.parts[static_cast<size_t>(t)][static_cast<size_t>(s)];
        if (slot) ranks.push_back(&*slot);
      }
      if (ranks.size() != static_cast<size_t>(c_.tp_)) continue;
      std::vector<ShardElements> elements;
      std::vector<Index> positions;
      for (const DeepSpeedShardParts* r : ranks) {
        elements.emplace_back(*r);
        const std::vector<Index> mine = SamplePositions(*r);
        positions.insert(positions.end(), mine.begin(), mine.end());
      }
      std::sort(positions.begin(), positions.end());
      positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
      const DType dtype =
          state == DeepSpeedState::kModule && p.own_dtype ? *p.own_dtype : c_.StateDType(state);
      const size_t size = DTypeSize(dtype);
      for (const Index k : positions) {
        std::vector<std::pair<Rank, const std::byte*>> at;
        for (const ShardElements& r : elements) at.push_back(r.At(k));
        if (std::any_of(at.begin(), at.end(), [](const auto& e) { return e.second == nullptr; }))
          continue;
        auto same = [&](size_t a, size_t b) {
          return std::memcmp(at[a].second, at[b].second, size) == 0;
        };
        size_t odd = 0;
        for (size_t r = 1; r < at.size() && odd == 0; ++r) {
          if (!same(0, r)) odd = r;
        }
        if (odd == 0) continue;
        // With three or more ranks, the one that disagrees with the others is named alone.
        size_t agree_with_odd = 0;
        for (size_t r = 0; r < at.size(); ++r) agree_with_odd += same(odd, r) ? 1 : 0;
        const size_t other = agree_with_odd * 2 > at.size() ? 0 : odd;
        const size_t blamed = at.size() >= 3 ? other : odd;
        const size_t witness = blamed == 0 ? odd : 0;
        auto file = [&](size_t r) {
          const DeepSpeedFragment& f = ranks[r]->fragments[static_cast<size_t>(at[r].first)];
          return Where(f.file);
        };
        const char* what = state == DeepSpeedState::kModule   ? "module weight"
                           : state == DeepSpeedState::kMaster ? "fp32 master weight"
                           : state == DeepSpeedState::kExpAvg ? "exp_avg"
                                                              : "exp_avg_sq";
        const std::string values =
            fmt::format("element {} of its {} is {} on TP rank {} but {} on TP rank {}", k, what,
                        FormatElement(dtype, at[blamed].second), blamed,
                        FormatElement(dtype, at[witness].second), witness);
        if (at.size() >= 3) {
          return InvalidArgumentError(fmt::format(
              "\"{}\" does not belong with the other TP ranks' files: parameter \"{}\" is held "
              "whole by every TP rank, and {} (a file from another run or step?)",
              file(blamed), p.name, values));
        }
        return InvalidArgumentError(fmt::format(
            "\"{}\" and \"{}\" do not belong together: parameter \"{}\" is held whole by every "
            "TP rank, but {} (one of them is from another run or step)",
            file(witness), file(blamed), p.name, values));
      }
    }
  }
  return Status::Ok();
}

// A tied module's parameter is listed by every stage that uses it, each with its own
// optimizer partitions: DeepSpeed reduces the copies' gradients together, so every state of
// every copy is the first stage's, element for element. Checked whole, then the copies after
// the first are dropped (ds_to_universal keeps the first stage's too).
Status DeepSpeedReader::CheckTiedCopies() {
  std::vector<DeepSpeedParam>& params = *c_.params_;
  std::map<std::string, size_t> first;
  std::vector<bool> drop(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    auto [it, fresh] = first.emplace(params[i].name, i);
    if (fresh) continue;
    const size_t j = it->second;
    drop[i] = true;
    for (Rank t = 0; t < c_.tp_; ++t) {
      for (int s = 0; s < kNumDeepSpeedStates; ++s) {
        const auto& mine = params[i].parts[static_cast<size_t>(t)][static_cast<size_t>(s)];
        const auto& theirs = params[j].parts[static_cast<size_t>(t)][static_cast<size_t>(s)];
        if (!mine || !theirs) continue;
        const DeepSpeedState state = static_cast<DeepSpeedState>(s);
        const Index n = params[j].tp_map.shard_num_elements(t);
        const size_t size = DTypeSize(c_.ParamDType(j, state));
        std::vector<std::byte> a(static_cast<size_t>(n) * size), b(a.size());
        RESHARD_RETURN_IF_ERROR(c_.ReadTpShard(j, state, t, {a.data(), n}));
        RESHARD_RETURN_IF_ERROR(c_.ReadTpShard(i, state, t, {b.data(), n}));
        if (a == b) continue;
        Index k = 0;
        while (std::memcmp(a.data() + k * size, b.data() + k * size, size) == 0) ++k;
        const auto [dj, _j] = ShardElements(*theirs).At(k);
        const auto [di, _i] = ShardElements(*mine).At(k);
        return InvalidArgumentError(fmt::format(
            "\"{}\" and \"{}\" do not belong together: parameter \"{}\" is tied across "
            "pipeline stages {} and {}, but element {} of its {} is {} on the first and {} on "
            "the other (a file from another run or step?)",
            Where(theirs->fragments[static_cast<size_t>(dj)].file),
            Where(mine->fragments[static_cast<size_t>(di)].file), params[i].name, stage_of_[j],
            stage_of_[i], k, DeepSpeedStateName(state),
            FormatElement(c_.ParamDType(j, state), a.data() + k * size),
            FormatElement(c_.ParamDType(j, state), b.data() + k * size)));
      }
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (drop[i]) continue;
    if (kept != i) params[kept] = std::move(params[i]);
    ++kept;
  }
  params.erase(params.begin() + static_cast<std::ptrdiff_t>(kept), params.end());
  return Status::Ok();
}

Status DeepSpeedReader::Read(const std::string& path) {
  RESHARD_RETURN_IF_ERROR(ResolveTag(path));
  RESHARD_RETURN_IF_ERROR(ReadTopology());
  // Pipeline stages list different parameters: a stage from another run or PP degree is
  // told by what its files record before their parameters are compared.
  if (c_.pp_ > 1) RESHARD_RETURN_IF_ERROR(CheckMetadataAgrees());
  RESHARD_RETURN_IF_ERROR(ReadParams());
  if (!optim_.empty()) {
    RESHARD_RETURN_IF_ERROR(ReadPartitions());
    c_.has_optimizer_ = true;
  } else {
    RESHARD_RETURN_IF_ERROR(ReadTorchOptimizer());
  }
  RESHARD_RETURN_IF_ERROR(ReadModuleFragments());
  // What ties the files together: the metadata each records, then the values that two files
  // hold of one parameter.
  RESHARD_RETURN_IF_ERROR(CheckMetadataAgrees());
  RESHARD_RETURN_IF_ERROR(CheckModuleIsMasterRounded());
  RESHARD_RETURN_IF_ERROR(CheckTpReplicasAgree());
  c_.params_ = std::make_shared<std::vector<DeepSpeedParam>>(std::move(params_));
  return CheckTiedCopies();
}

Result<DeepSpeedCheckpoint> DeepSpeedCheckpoint::Open(const std::string& path) {
  DeepSpeedCheckpoint c;
  DeepSpeedReader reader(c);
  RESHARD_RETURN_IF_ERROR(reader.Read(path));
  return c;
}

std::vector<std::string> DeepSpeedCheckpoint::file_paths() const { return paths_; }

const TorchFile* DeepSpeedCheckpoint::FileAt(const std::string& path) const {
  for (size_t i = 0; i < paths_.size(); ++i) {
    if (paths_[i] == path) return files_[i].get();
  }
  return nullptr;
}

std::vector<std::string> DeepSpeedCheckpoint::model_states_paths() const {
  std::vector<std::string> out;
  for (const std::string& p : paths_) {
    if (p.ends_with("_model_states.pt")) out.push_back(p);
  }
  return out;
}

DType DeepSpeedCheckpoint::StateDType(DeepSpeedState state) const {
  return state == DeepSpeedState::kModule ? module_dtype_ : DType::kF32;
}

DType DeepSpeedCheckpoint::ParamDType(size_t i, DeepSpeedState state) const {
  const DeepSpeedParam& p = (*params_)[i];
  return state == DeepSpeedState::kModule && p.own_dtype ? *p.own_dtype : StateDType(state);
}

bool DeepSpeedCheckpoint::Holds(size_t i, DeepSpeedState state) const {
  if (state == DeepSpeedState::kModule) return true;
  return has_optimizer_ && (*params_)[i].kind == DeepSpeedParamKind::kTrained;
}

bool IsDeepSpeedCheckpoint(const std::string& path) {
  std::error_code ec;
  const fs::path dir(path);
  if (fs::is_regular_file(dir / "latest", ec)) return true;
  return fs::exists(dir / "mp_rank_00_model_states.pt", ec) ||
         fs::exists(dir / "zero_pp_rank_0_mp_rank_00_model_states.pt", ec);
}

Status DeepSpeedCheckpoint::ReadTpShard(size_t i, DeepSpeedState state, Rank tp_rank,
                                        MutableBuffer out) const {
  const DeepSpeedParam& p = (*params_)[i];
  const auto& slots = p.parts[static_cast<size_t>(tp_rank)];
  const DeepSpeedShardParts* parts = slots[Slot(state)] ? &*slots[Slot(state)] : nullptr;
  // ZeRO 3 keeps no module weights: DeepSpeed's are its master weights, rounded.
  const bool rounded = parts == nullptr && state == DeepSpeedState::kModule &&
                       slots[Slot(DeepSpeedState::kMaster)].has_value();
  if (rounded) parts = &*slots[Slot(DeepSpeedState::kMaster)];
  if (parts == nullptr) {
    return NotFoundError(fmt::format("the checkpoint holds no {} for parameter \"{}\"",
                                     DeepSpeedStateName(state), p.name));
  }
  const DType dtype = rounded ? DType::kF32 : ParamDType(i, state);
  const size_t size = DTypeSize(dtype);
  std::vector<std::byte> temp;
  MutableBuffer dest = out;
  if (rounded && module_dtype_ != DType::kF32) {
    temp.resize(static_cast<size_t>(out.num_elements) * size);
    dest = {temp.data(), out.num_elements};
  }
  std::vector<ConstBuffer> shards;
  for (const DeepSpeedFragment& f : parts->fragments) {
    const TorchTensor& t = *f.tensor;
    if (!t.is_contiguous()) {  // a module weight stored as a view with other strides
      if (parts->fragments.size() != 1 ||
          t.num_bytes() != static_cast<uint64_t>(dest.num_elements) * size)
        return InternalError(fmt::format("parameter \"{}\": a strided fragment", p.name));
      RESHARD_RETURN_IF_ERROR(f.file->CopyTo(t, {dest.data, t.num_bytes()}));
      shards.clear();
      break;
    }
    const std::byte* base = f.file->storages()[t.storage].bytes.data();
    shards.push_back({base + static_cast<size_t>(t.storage_offset + f.offset) * size,
                      parts->dp_map.shard_num_elements(static_cast<Rank>(shards.size()))});
  }
  if (!shards.empty()) {
    ExecOptions o;
    o.num_threads = 1;
    RESHARD_RETURN_IF_ERROR(Rebuild(parts->dp_map, dtype, shards, dest, o));
  }
  if (dest.data != out.data) {
    const auto* in = reinterpret_cast<const float*>(temp.data());
    auto* o = reinterpret_cast<uint16_t*>(out.data);
    for (Index k = 0; k < out.num_elements; ++k) {
      o[k] = module_dtype_ == DType::kBF16 ? FloatToBFloat16(in[k]) : FloatToHalf(in[k]);
    }
  }
  return Status::Ok();
}

std::optional<ConstBuffer> DeepSpeedCheckpoint::TpShardView(size_t i, DeepSpeedState state,
                                                            Rank tp_rank) const {
  const DeepSpeedParam& p = (*params_)[i];
  const auto& slot = p.parts[static_cast<size_t>(tp_rank)][Slot(state)];
  if (!slot) return std::nullopt;
  const Index n = p.tp_map.shard_num_elements(tp_rank);
  for (Rank d = 0; d < slot->dp_map.world_size(); ++d) {
    if (slot->dp_map.shard_num_elements(d) == 0) continue;
    const auto& pieces = slot->dp_map.rank(d).pieces;
    if (slot->dp_map.shard_num_elements(d) != n || pieces.size() != 1 ||
        pieces[0].source.offset != 0) {
      return std::nullopt;  // the shard is cut between fragments
    }
    const DeepSpeedFragment& f = slot->fragments[static_cast<size_t>(d)];
    const TorchTensor& t = *f.tensor;
    if (!t.is_contiguous()) return std::nullopt;
    const std::byte* base = f.file->storages()[t.storage].bytes.data();
    const size_t size = DTypeSize(ParamDType(i, state));
    return ConstBuffer{base + static_cast<size_t>(t.storage_offset + f.offset) * size, n};
  }
  return std::nullopt;
}

Status DeepSpeedCheckpoint::ReadTpShardRange(size_t i, DeepSpeedState state, Rank tp_rank,
                                             Index begin, MutableBuffer out) const {
  const DeepSpeedParam& p = (*params_)[i];
  const auto& slot = p.parts[static_cast<size_t>(tp_rank)][Slot(state)];
  const Index n = p.tp_map.shard_num_elements(tp_rank);
  const Index end = begin + out.num_elements;
  if (begin < 0 || end > n) {
    return InternalError(
        fmt::format("parameter \"{}\": elements [{}, {}) of a shard of {}", p.name, begin, end, n));
  }
  const size_t size = DTypeSize(ParamDType(i, state));
  // The fragments as FragmentMap lays them out: rank d holds elements [start, start + length)
  // of the flat shard in one contiguous piece. Anything else is read whole.
  bool direct = slot.has_value();
  for (Rank d = 0; direct && d < slot->dp_map.world_size(); ++d) {
    const auto& pieces = slot->dp_map.rank(d).pieces;
    const TorchTensor& t = *slot->fragments[static_cast<size_t>(d)].tensor;
    direct = pieces.empty() ||
             (pieces.size() == 1 && pieces[0].shape.size() == 1 &&
              pieces[0].source.strides == Shape{1} && pieces[0].dest.offset == 0 &&
              pieces[0].dest.strides == Shape{1} && pieces[0].scale == 1.0 && t.is_contiguous());
  }
  if (!direct) {
    std::vector<std::byte> whole(static_cast<size_t>(n) * size);
    RESHARD_RETURN_IF_ERROR(ReadTpShard(i, state, tp_rank, {whole.data(), n}));
    std::memcpy(out.data, whole.data() + static_cast<size_t>(begin) * size,
                static_cast<size_t>(out.num_elements) * size);
    return Status::Ok();
  }
  for (Rank d = 0; d < slot->dp_map.world_size(); ++d) {
    const auto& pieces = slot->dp_map.rank(d).pieces;
    if (pieces.empty()) continue;
    const Index start = pieces[0].source.offset;
    const Index lo = std::max(begin, start), hi = std::min(end, start + pieces[0].shape[0]);
    if (lo >= hi) continue;
    const DeepSpeedFragment& f = slot->fragments[static_cast<size_t>(d)];
    const TorchTensor& t = *f.tensor;
    const std::byte* base = f.file->storages()[t.storage].bytes.data();
    std::memcpy(out.data + static_cast<size_t>(lo - begin) * size,
                base + static_cast<size_t>(t.storage_offset + f.offset + (lo - start)) * size,
                static_cast<size_t>(hi - lo) * size);
  }
  return Status::Ok();
}

// ---- as a shard source ------------------------------------------------------------------

namespace {

// The TP shards of a checkpoint's parameters, each assembled from its DP fragments when first
// acquired and kept while some caller holds it.
class DeepSpeedShardSource : public ShardSource {
 public:
  DeepSpeedShardSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt,
                       std::vector<DeepSpeedState> states)
      : ckpt_(std::move(ckpt)) {
    manifest_.world_size = ckpt_->tp();
    for (DeepSpeedState s : states) {
      for (size_t i = 0; i < ckpt_->params().size(); ++i) {
        const DeepSpeedParam& p = ckpt_->params()[i];
        const bool first = s == states.front();
        // A frozen parameter or a buffer has its module tensor alone: that is its tensor in a
        // gather of the masters, and it has no optimizer state to convert.
        DeepSpeedState held = s;
        if (!ckpt_->Holds(i, s)) {
          if (!first) continue;
          held = DeepSpeedState::kModule;
        }
        const std::string name =
            first ? p.name : fmt::format("{}.{}", p.name, DeepSpeedStateName(s));
        manifest_.params.push_back(ShardedParam{name, ckpt_->ParamDType(i, held), p.tp_map,
                                                p.layout, DeepSpeedScalePower(held)});
        which_.emplace_back(i, held);
      }
    }
  }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {ckpt_->tag_dir()};
    for (const std::string& p : ckpt_->file_paths()) inputs.push_back(p);
    return inputs;
  }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const ParamMap& map = manifest_.params[i].map;
    const size_t size = DTypeSize(manifest_.params[i].dtype);
    return cache_.Acquire(i, map, [&](std::vector<std::vector<std::byte>>& data) {
      for (Rank r = 0; r < map.world_size(); ++r) {
        auto& bytes = data[static_cast<size_t>(r)];
        bytes.resize(static_cast<size_t>(map.shard_num_elements(r)) * size);
        RESHARD_RETURN_IF_ERROR(ckpt_->ReadTpShard(which_[i].first, which_[i].second, r,
                                                   {bytes.data(), map.shard_num_elements(r)}));
      }
      return Status::Ok();
    });
  }
  void ReleaseShards(size_t i) override { cache_.Release(i); }

 private:
  std::shared_ptr<const DeepSpeedCheckpoint> ckpt_;
  Manifest manifest_;
  std::vector<std::pair<size_t, DeepSpeedState>> which_;
  ShardCache cache_;  // per TP rank
};

// The states a conversion writes, refused when the checkpoint lacks them.
Result<std::vector<DeepSpeedState>> StatesToWrite(const DeepSpeedCheckpoint& c,
                                                  std::vector<DeepSpeedState> states) {
  for (DeepSpeedState s : states) {
    if (s != DeepSpeedState::kModule && !c.has_optimizer_state()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" holds no optimizer state, so it has no {} to read", c.tag_dir(),
          s == DeepSpeedState::kMaster ? "fp32 master weights" : DeepSpeedStateName(s)));
    }
  }
  return states;
}

}  // namespace

std::unique_ptr<ShardSource> DeepSpeedSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt,
                                             std::vector<DeepSpeedState> states) {
  return std::make_unique<DeepSpeedShardSource>(std::move(ckpt), std::move(states));
}

Result<OpenedCheckpoint> OpenDeepSpeed(const std::string& ckpt_dir, const SourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(DeepSpeedCheckpoint opened, DeepSpeedCheckpoint::Open(ckpt_dir));
  auto ckpt = std::make_shared<const DeepSpeedCheckpoint>(std::move(opened));
  std::vector<DeepSpeedState> states;
  if (options.use == SourceUse::kGather) {
    states = {options.master_weights ? DeepSpeedState::kMaster : DeepSpeedState::kModule};
  } else {
    states = {DeepSpeedState::kModule};
    if (!options.weights_only) {
      states.insert(states.end(),
                    {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq});
    }
  }
  RESHARD_ASSIGN_OR_RETURN(states, StatesToWrite(*ckpt, std::move(states)));
  OpenedCheckpoint out;
  out.format = "deepspeed";
  out.run = DeepSpeedRunOf(*ckpt);
  if (options.use == SourceUse::kGather && !ckpt->config_path().empty()) {
    RESHARD_ASSIGN_OR_RETURN(std::string config, ReadFileToString(ckpt->config_path()));
    out.extra_files.push_back({"config.json", std::move(config)});
  }
  if (ckpt->experts() != nullptr) {
    const DeepSpeedState state = states.front();
    out.gather = [ckpt, state](const std::string& out_dir, const CheckpointOptions& o) {
      return GatherAutoEp(ckpt, state, out_dir, o);
    };
    out.not_convertible = fmt::format(
        "\"{}\" is an AutoEP checkpoint: convert writes its experts only as DeepSpeed's "
        "universal checkpoint; gather writes the model",
        ckpt->tag_dir());
    return out;
  }
  out.source = DeepSpeedSource(ckpt, std::move(states));
  return out;
}

// ---- layouts for a universal checkpoint ---------------------------------------------------

Result<std::vector<std::optional<LayoutDescriptor>>> DeepSpeedLayoutsOf(
    const TorchFile& file, const std::vector<std::pair<std::string, Shape>>& params) {
  RESHARD_ASSIGN_OR_RETURN(const UcInfo uc, ReadUcInfo(file.tree(), file.tree().root()));
  std::vector<std::optional<LayoutDescriptor>> out;
  for (const auto& [name, shape] : params) {
    RESHARD_ASSIGN_OR_RETURN(const std::optional<ParamMap> map, AffineMapOf(uc, name));
    if (map) {
      out.push_back(Recognise(*map));
      continue;
    }
    // The full shape stands for the one shard: the category decides the rule, not the sizes.
    RESHARD_ASSIGN_OR_RETURN(std::optional<Value> meta, PatternMeta(uc, name, {shape}));
    if (!meta) {
      out.emplace_back();
      continue;
    }
    Result<LoweredDeepSpeedMeta> lowered = LowerDeepSpeedMeta(meta->dump());
    if (!lowered.ok()) {
      return lowered.status().Annotate(fmt::format("universal_checkpoint_info, \"{}\"", name));
    }
    out.emplace_back(lowered->descriptor);
  }
  return out;
}

// ---- summaries --------------------------------------------------------------------------

namespace {

std::string ZeroName(const DeepSpeedCheckpoint& c) { return fmt::format("ZeRO {}", c.stage()); }

}  // namespace

std::string DeepSpeedSummaryJson(const DeepSpeedCheckpoint& c) {
  nlohmann::ordered_json doc = {{"format", "deepspeed"},
                                {"tag_dir", c.tag_dir()},
                                {"zero_stage", c.stage()},
                                {"pp", c.pp()},
                                {"tp", c.tp()},
                                {"dp", c.dp()},
                                {"dtype", std::string(DTypeName(c.module_dtype()))},
                                {"optimizer_state", c.has_optimizer_state()}};
  if (!c.config_path().empty()) doc["config"] = c.config_path();
  nlohmann::ordered_json params = nlohmann::ordered_json::array();
  for (const DeepSpeedParam& p : c.params()) {
    nlohmann::ordered_json entry = {
        {"name", p.name}, {"shape", p.tp_map.valid_shape()}, {"layout_source", p.layout_source}};
    entry["layout"] = p.layout ? nlohmann::ordered_json::parse(LayoutToJson(*p.layout))
                               : nlohmann::ordered_json(nullptr);
    nlohmann::ordered_json shards = nlohmann::ordered_json::array();
    for (Rank r = 0; r < c.tp(); ++r) shards.push_back(p.tp_map.rank(r).shard_shape);
    entry["tp_shard_shapes"] = shards;
    entry["kind"] = std::string(DeepSpeedParamKindName(p.kind));
    if (p.own_dtype) entry["dtype"] = std::string(DTypeName(*p.own_dtype));
    params.push_back(entry);
  }
  doc["params"] = params;
  if (c.experts() != nullptr)
    doc["autoep"] = nlohmann::ordered_json::parse(AutoEpSummaryJson(*c.experts()));
  return doc.dump(1) + "\n";
}

std::string DeepSpeedSummaryText(const DeepSpeedCheckpoint& c) {
  size_t frozen = 0, buffers = 0;
  for (const DeepSpeedParam& p : c.params()) {
    frozen += p.kind == DeepSpeedParamKind::kFrozen ? 1 : 0;
    buffers += p.kind == DeepSpeedParamKind::kBuffer ? 1 : 0;
  }
  std::string counts = fmt::format("{} parameters", c.params().size() - buffers);
  if (frozen > 0) counts += fmt::format(" ({} frozen)", frozen);
  if (buffers > 0) counts += fmt::format(" and {} buffer{}", buffers, buffers == 1 ? "" : "s");
  std::string out = fmt::format(
      "DeepSpeed checkpoint \"{}\": {}, {}TP {} x DP {}, {} module weights, {}; {}\n", c.tag_dir(),
      ZeroName(c), c.pp() > 1 ? fmt::format("PP {} x ", c.pp()) : "", c.tp(), c.dp(),
      DTypeName(c.module_dtype()),
      c.has_optimizer_state() ? "fp32 master weights and Adam moments" : "no optimizer state",
      counts);
  for (const DeepSpeedParam& p : c.params()) {
    // A frozen parameter or a buffer says so, with its dtype: it has no optimizer state.
    const std::string kind = p.kind == DeepSpeedParamKind::kTrained
                                 ? ""
                                 : fmt::format("  ({}, {})", DeepSpeedParamKindName(p.kind),
                                               DTypeName(p.own_dtype.value_or(c.module_dtype())));
    out += fmt::format("  {}  {}  {}{}{}\n", p.name, FormatShape(p.tp_map.valid_shape()),
                       p.layout ? LayoutToJson(*p.layout) : std::string("(no layout rule)"),
                       fmt::format("  [{}]", p.layout_source), kind);
  }
  if (c.experts() != nullptr) out += AutoEpSummaryText(*c.experts());
  return out;
}

}  // namespace reshard
