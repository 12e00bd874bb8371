// DeepSpeed PipelineModule checkpoint -> the same at other PP x TP x DP degrees
// (ConvertDeepSpeedToPipeline, pipeline_writer.h).
//
// The plan: the layers that hold state (each a file per TP rank), the stage boundaries, each
// new stage's parameters in the order DeepSpeed's engine lists them (its tied modules first,
// by first use, then its layers' parameters by layer), and every parameter's map at the new
// TP degree. Each output file is one job: a layer file or a ZeRO partition takes each TP
// shard it needs from the source's shards (moved by the parameter's composed plan when the TP
// degree changes, reading only the source shards it overlaps), and the metadata is the
// source's with the stage's own entries.
#include "reshard/checkpoint/deepspeed/pipeline_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/exec/executor.h"
#include "reshard/io/torch_writer.h"
#include "reshard/ir/compose.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kTiedPrefix = "tied_modules.";

// "tied_modules.<key>.<name>" -> key; empty for other names.
std::string TiedKey(const std::string& name) {
  if (!name.starts_with(kTiedPrefix)) return {};
  const size_t dot = name.find('.', kTiedPrefix.size());
  if (dot == std::string::npos) return {};
  return name.substr(kTiedPrefix.size(), dot - kTiedPrefix.size());
}

// "<layer>.<name>" -> layer; nullopt for other names.
std::optional<int> LayerOf(const std::string& name) {
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 6) return std::nullopt;
  int layer = 0;
  for (size_t k = 0; k < dot; ++k) {
    if (name[k] < '0' || name[k] > '9') return std::nullopt;
    layer = layer * 10 + (name[k] - '0');
  }
  return layer;
}

// A layer that holds state: its parameters (indices into params()) and their names in its file.
struct LayerUnit {
  std::vector<size_t> params;
  std::vector<std::string> local;
};

struct PipelinePlan {
  std::string tag;
  int tp = 1;
  int dp = 1;
  std::vector<int> parts;                   // pp + 1 layer indices
  std::map<int, LayerUnit> layers;          // by layer index
  std::vector<std::vector<size_t>> stage;   // [stage]: parameters, in the engine's order
  std::vector<ParamMap> maps;               // [param]: at the new TP degree
  std::string optim_prefix;                 // "bf16_" or ""
  const TorchFile* model_states = nullptr;  // the source's stage 0, TP rank 0
};

// DeepSpeed's partition_uniform: `n` layers over `parts` stages, the first n % parts one more.
std::vector<int> UniformParts(int n, int parts) {
  std::vector<int> out(static_cast<size_t>(parts) + 1, 0);
  const int chunk = n / parts, residual = n % parts;
  for (int p = 1; p <= parts; ++p) out[static_cast<size_t>(p)] = p * chunk + std::min(p, residual);
  return out;
}

// Which parameters each layer holds, in the source's order, and how many layers the model has
// (see pipeline_writer.h): the last layer that holds state, plus one when a tied module is
// used again by the last layer.
Result<int> ReadLayers(const DeepSpeedCheckpoint& c, const std::map<std::string, size_t>& index,
                       std::map<int, LayerUnit>& layers, std::map<std::string, int>& reused) {
  const auto& stages = c.stage_params();
  std::set<std::string> seen;
  std::map<std::string, std::vector<int>> tied_stages;  // key -> source stages listing it
  for (size_t s = 0; s < stages.size(); ++s) {
    for (const std::string& name : stages[s]) {
      if (const std::string key = TiedKey(name); !key.empty()) {
        auto& listed = tied_stages[key];
        if (listed.empty() || listed.back() != static_cast<int>(s))
          listed.push_back(static_cast<int>(s));
      }
      if (!seen.insert(name).second) continue;
      const size_t i = index.at(name);
      if (const std::string key = TiedKey(name); !key.empty()) {
        auto owner = c.tied_owners().find(key);
        if (owner == c.tied_owners().end())
          return InvalidArgumentError(
              fmt::format("\"{}\": no layer file holds tied module \"{}\"", c.tag_dir(), key));
        LayerUnit& unit = layers[owner->second];
        unit.params.push_back(i);
        unit.local.push_back(name.substr(kTiedPrefix.size() + key.size() + 1));
        continue;
      }
      const std::optional<int> layer = LayerOf(name);
      if (!layer) {
        return InvalidArgumentError(
            fmt::format("\"{}\": parameter \"{}\" is named neither <layer>.<name> nor "
                        "tied_modules.<key>.<name>",
                        c.tag_dir(), name));
      }
      LayerUnit& unit = layers[*layer];
      unit.params.push_back(i);
      unit.local.push_back(name.substr(name.find('.') + 1));
    }
  }
  if (layers.empty())
    return InvalidArgumentError(fmt::format("\"{}\" holds no layer's parameters", c.tag_dir()));
  int count = layers.rbegin()->first + 1;
  const int last = static_cast<int>(stages.size()) - 1;
  for (const auto& [key, listed] : tied_stages) {
    // Listed by the last stage (which a GPT pipeline's output projection is on), and by at most
    // one other (the owner's): a second use at the last layer.
    if (listed.size() > 2 || (listed.size() == 2 && listed.back() != last)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": tied module \"{}\" is used by pipeline stages other than its owner's and the "
          "last, whose layers the checkpoint does not record",
          c.tag_dir(), key));
    }
    if (listed.back() == last) {
      reused[key] = count;  // placed below, once the count is known
    }
  }
  if (!reused.empty()) ++count;
  for (auto& [key, at] : reused) at = count - 1;
  return count;
}

Result<std::vector<int>> StageParts(const DeepSpeedPipelineTarget& target, int layers) {
  if (target.pp > layers) {
    return InvalidArgumentError(
        fmt::format("{} pipeline stages for a model of {} layers: each stage needs a layer",
                    target.pp, layers));
  }
  if (target.stage_layers.empty()) return UniformParts(layers, target.pp);
  if (static_cast<int>(target.stage_layers.size()) != target.pp) {
    return InvalidArgumentError(fmt::format("the stage list gives {} stages, not {}",
                                            target.stage_layers.size(), target.pp));
  }
  std::vector<int> parts = {0};
  for (const int n : target.stage_layers) {
    if (n < 1)
      return InvalidArgumentError("the stage list gives a stage no layer (each needs at least 1)");
    parts.push_back(parts.back() + n);
  }
  if (parts.back() != layers) {
    return InvalidArgumentError(fmt::format(
        "the stage list sums to {} layers, but the model has {} (the layers up to the last that "
        "holds state, and one more where a tied module is used again by the last layer)",
        parts.back(), layers));
  }
  return parts;
}

// Each parameter's map at the new TP degree: the source's at its own, else its layout's.
Result<std::vector<ParamMap>> TargetMaps(const DeepSpeedCheckpoint& c, int tp) {
  std::vector<ParamMap> maps;
  for (const DeepSpeedParam& p : c.params()) {
    if (tp == c.tp()) {
      maps.push_back(p.tp_map);
      continue;
    }
    if (!p.layout) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": parameter \"{}\" has no known layout at another TP degree (its checkpoint's "
          "universal_checkpoint_info gives none)",
          c.tag_dir(), p.name));
    }
    Result<ParamMap> map = BuildMap(*p.layout, p.tp_map.valid_shape(), tp);
    if (!map.ok()) return map.status().Annotate(fmt::format("parameter \"{}\"", p.name));
    if (map->logical_shape() != p.tp_map.logical_shape()) {
      return InvalidArgumentError(
          fmt::format("parameter \"{}\": its layout pads it differently at TP {}", p.name, tp));
    }
    maps.push_back(*std::move(map));
  }
  return maps;
}

// The value under str key `key` of dict node `id`, or kNoPickleNode.
PickleNodeId DictGet(const PickleTree& t, PickleNodeId id, std::string_view key) {
  if (id == kNoPickleNode || t.node(id).kind != PickleKind::kDict) return kNoPickleNode;
  for (const auto& [k, v] : t.node(id).entries) {
    if (t.node(k).kind == PickleKind::kStr && t.node(k).text == key) return v;
  }
  return kNoPickleNode;
}

Result<PipelinePlan> Plan(const DeepSpeedCheckpoint& c, const DeepSpeedPipelineTarget& target) {
  if (c.stage_params().empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is not a PipelineModule checkpoint (it has no layer files)", c.tag_dir()));
  }
  if (!c.has_optimizer_state() || c.stage() < 1 || c.stage() > 2 || c.optimizer_file() == nullptr) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds no ZeRO 1/2 optimizer partitions, which a pipeline checkpoint is written "
        "with",
        c.tag_dir()));
  }
  if (target.pp < 1 || target.dp < 1 || target.tp < 0)
    return InvalidArgumentError("pipeline degrees must be positive");
  if (target.dp > kMaxPipelineDp) {
    return InvalidArgumentError(
        fmt::format("a DP degree of {} is more than {}, the most a DeepSpeed checkpoint's "
                    "dp_world_size is read with",
                    target.dp, kMaxPipelineDp));
  }
  PipelinePlan plan;
  plan.tag = fs::path(c.tag_dir()).filename().string();
  plan.tp = target.tp == 0 ? c.tp() : target.tp;
  plan.dp = target.dp;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < c.params().size(); ++i) index.emplace(c.params()[i].name, i);
  std::map<std::string, int> reused;
  RESHARD_ASSIGN_OR_RETURN(const int count, ReadLayers(c, index, plan.layers, reused));
  RESHARD_ASSIGN_OR_RETURN(plan.parts, StageParts(target, count));
  // Tied modules by their uses: the owner's layer and the reused one.
  std::map<std::string, std::vector<int>> uses;
  for (const auto& [key, layer] : c.tied_owners()) uses[key].push_back(layer);
  for (const auto& [key, layer] : reused) uses[key].push_back(layer);
  for (int s = 0; s < target.pp; ++s) {
    const int begin = plan.parts[static_cast<size_t>(s)],
              end = plan.parts[static_cast<size_t>(s) + 1];
    std::vector<std::pair<int, std::string>> tied;  // (first use here, key)
    for (const auto& [key, at] : uses) {
      std::optional<int> first;
      for (const int layer : at) {
        if (layer >= begin && layer < end && (!first || layer < *first)) first = layer;
      }
      if (first) tied.emplace_back(*first, key);
    }
    std::sort(tied.begin(), tied.end());
    // The optimizer's parameters: a layer's frozen parameters and buffers are in its file only.
    std::vector<size_t> params;
    auto add = [&](const LayerUnit& unit) {
      for (const size_t i : unit.params) {
        if (c.params()[i].kind == DeepSpeedParamKind::kTrained) params.push_back(i);
      }
    };
    for (const auto& [first, key] : tied) add(plan.layers.at(c.tied_owners().at(key)));
    for (auto it = plan.layers.lower_bound(begin); it != plan.layers.end() && it->first < end;
         ++it) {
      if (!TiedKey(c.params()[it->second.params.front()].name).empty()) continue;  // above
      add(it->second);
    }
    if (params.empty()) {
      return InvalidArgumentError(fmt::format(
          "pipeline stage {} (layers {} to {}) would hold no parameter, which DeepSpeed's ZeRO "
          "optimizer does not take",
          s, begin, end - 1));
    }
    plan.stage.push_back(std::move(params));
  }
  RESHARD_ASSIGN_OR_RETURN(plan.maps, TargetMaps(c, plan.tp));
  for (const std::string& path : c.file_paths()) {
    const TorchFile* f = c.FileAt(path);
    if (f == c.optimizer_file() && fs::path(path).filename().string().starts_with("bf16_"))
      plan.optim_prefix = "bf16_";
    if (plan.model_states == nullptr && fs::path(path).filename() == "mp_rank_00_model_states.pt")
      plan.model_states = f;
  }
  if (plan.model_states == nullptr)
    return InvalidArgumentError(
        fmt::format("\"{}\": mp_rank_00_model_states.pt is missing", c.tag_dir()));
  // One parameter group: the stages' parameters are laid out as one flat group each.
  const PickleTree& mt = plan.model_states->tree();
  const PickleNodeId shapes = DictGet(mt, mt.root(), "param_shapes");
  const PickleTree& ot = c.optimizer_file()->tree();
  const PickleNodeId states = DictGet(
      ot, DictGet(ot, DictGet(ot, ot.root(), "optimizer_state_dict"), "base_optimizer_state"),
      "state");
  if (shapes == kNoPickleNode || mt.node(shapes).items.size() != 1 || states == kNoPickleNode ||
      ot.node(states).entries.size() != 1) {
    return UnimplementedError(fmt::format(
        "\"{}\": the optimizer has several parameter groups; a pipeline checkpoint is written "
        "with one",
        c.tag_dir()));
  }
  return plan;
}

// Writes the files of a plan (one file per call, any thread).
class PipelineWriter {
 public:
  PipelineWriter(const DeepSpeedCheckpoint& c, const PipelinePlan& plan,
                 const CheckpointOptions& options)
      : c_(c),
        plan_(plan),
        options_(options),
        plans_(plan.maps.size()),
        verified_(plan.maps.size() * kNumDeepSpeedStates) {}

  Status WriteLayer(int layer, Rank t, const std::string& path, const TorchWriteOptions& o) const;
  Status WriteModelStates(int stage, Rank t, const std::string& path,
                          const TorchWriteOptions& o) const;
  Status WriteOptimizer(int stage, Rank t, int d, const std::string& path,
                        const TorchWriteOptions& o) const;
  // The flat partition's sizes of a stage at TP rank t: (unpadded n, partition P).
  std::pair<Index, Index> Partition(int stage, Rank t) const;

 private:
  Status FillShard(size_t i, DeepSpeedState state, Rank t, std::span<std::byte> out) const;
  Status FillPartition(int stage, Rank t, int d, DeepSpeedState state,
                       std::span<std::byte> out) const;
  Result<ParamPlan> MovesInto(size_t i, Rank t) const;
  Status ReadSourceShards(size_t i, DeepSpeedState state, const std::vector<bool>* reads,
                          std::vector<std::vector<std::byte>>& data,
                          std::vector<ConstBuffer>& views) const;

  // A parameter's plan from the source's TP degree to the new one, composed by the first file
  // that needs it (files are written on several threads).
  struct ComposedOnce {
    std::once_flag once;
    ParamPlan plan;
    Status status;
  };
  // Whether a parameter's replicas in one state agree, checked once.
  struct VerifiedOnce {
    std::once_flag once;
    Status status;
  };

  const DeepSpeedCheckpoint& c_;
  const PipelinePlan& plan_;
  const CheckpointOptions& options_;
  mutable std::vector<ComposedOnce> plans_;
  mutable std::vector<VerifiedOnce> verified_;
};

std::pair<Index, Index> PipelineWriter::Partition(int stage, Rank t) const {
  Index n = 0;
  for (const size_t i : plan_.stage[static_cast<size_t>(stage)])
    n += plan_.maps[i].shard_num_elements(t);
  const Index align = 2 * static_cast<Index>(plan_.dp);  // DeepSpeed's nccl_start_alignment_factor
  const Index padded = (n + align - 1) / align * align;
  return {n, padded / plan_.dp};
}

// The moves of parameter i from the source's TP shards into the new degree's TP rank t,
// composed once per parameter (Compose: no full tensor) and kept for every file that needs one.
Result<ParamPlan> PipelineWriter::MovesInto(size_t i, Rank t) const {
  std::call_once(plans_[i].once, [&] {
    Result<ParamPlan> composed = Compose(plan_.maps[i], c_.params()[i].tp_map);
    if (composed.ok()) {
      plans_[i].plan = *std::move(composed);
    } else {
      plans_[i].status = composed.status().Annotate(c_.params()[i].name);
    }
  });
  RESHARD_RETURN_IF_ERROR(plans_[i].status);
  const ParamPlan& all = plans_[i].plan;
  ParamPlan mine;
  mine.source_world = all.source_world;
  mine.target_world = all.target_world;
  for (const Move& m : all.moves) {
    if (m.dst_rank == t) mine.moves.push_back(m);
  }
  for (const UnwrittenBlock& u : all.unwritten) {
    if (u.dst_rank == t) mine.unwritten.push_back(u);
  }
  return mine;
}

// The source's TP shards of parameter i in `state` that `reads` names (all of them when null),
// read into `data`; the others are empty.
Status PipelineWriter::ReadSourceShards(size_t i, DeepSpeedState state,
                                        const std::vector<bool>* reads,
                                        std::vector<std::vector<std::byte>>& data,
                                        std::vector<ConstBuffer>& views) const {
  const ParamMap& source = c_.params()[i].tp_map;
  const size_t size = DTypeSize(c_.ParamDType(i, state));
  data.assign(static_cast<size_t>(source.world_size()), {});
  views.assign(static_cast<size_t>(source.world_size()), {});
  for (Rank r = 0; r < source.world_size(); ++r) {
    if (reads != nullptr && !(*reads)[static_cast<size_t>(r)]) continue;
    const Index n = source.shard_num_elements(r);
    data[static_cast<size_t>(r)].resize(static_cast<size_t>(n) * size);
    RESHARD_RETURN_IF_ERROR(c_.ReadTpShard(i, state, r, {data[static_cast<size_t>(r)].data(), n}));
    views[static_cast<size_t>(r)] = {data[static_cast<size_t>(r)].data(), n};
  }
  return Status::Ok();
}

// TP rank t's shard of parameter i at the new degree, in the state's dtype: the source's shard
// where the degree is the same, else moved from the source shards it overlaps by the composed
// plan (only those are read). With verify_replicas, the replicas of each parameter and state are
// compared once (P2), by the first file to need them.
Status PipelineWriter::FillShard(size_t i, DeepSpeedState state, Rank t,
                                 std::span<std::byte> out) const {
  const DType dtype = c_.ParamDType(i, state);
  const Index shard = plan_.maps[i].shard_num_elements(t);
  if (plan_.tp == c_.tp()) return c_.ReadTpShard(i, state, t, {out.data(), shard});
  ExecOptions o;
  o.num_threads = 1;
  o.scale_power = DeepSpeedScalePower(state);
  o.allow_scaled_optimizer_state = true;
  o.allow_lossy_scale = options_.allow_lossy_scale;
  std::vector<std::vector<std::byte>> data;
  std::vector<ConstBuffer> views;
  if (options_.verify_replicas) {
    VerifiedOnce& v = verified_[i * kNumDeepSpeedStates + static_cast<size_t>(state)];
    std::call_once(v.once, [&] {
      v.status = ReadSourceShards(i, state, nullptr, data, views);
      if (v.status.ok()) v.status = VerifyReplicas(c_.params()[i].tp_map, dtype, views, o);
      if (!v.status.ok()) v.status = v.status.Annotate(c_.params()[i].name);
    });
    RESHARD_RETURN_IF_ERROR(v.status);
  }
  RESHARD_ASSIGN_OR_RETURN(const ParamPlan mine, MovesInto(i, t));
  std::vector<bool> reads(static_cast<size_t>(mine.source_world), false);
  for (const Move& m : mine.moves) reads[static_cast<size_t>(m.src_rank)] = true;
  if (views.empty()) RESHARD_RETURN_IF_ERROR(ReadSourceShards(i, state, &reads, data, views));
  std::vector<MutableBuffer> targets(static_cast<size_t>(mine.target_world));
  targets[static_cast<size_t>(t)] = {out.data(), shard};
  return ExecutePlan(mine, dtype, views, targets, o);
}

Status PipelineWriter::WriteLayer(int layer, Rank t, const std::string& path,
                                  const TorchWriteOptions& o) const {
  const LayerUnit& unit = plan_.layers.at(layer);
  TorchTreeBuilder b;
  const PickleNodeId root = b.Dict({}, /*ordered=*/true);
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const size_t i = unit.params[k];
    b.Insert(root, b.Str(unit.local[k]),
             b.Tensor(c_.ParamDType(i, DeepSpeedState::kModule), plan_.maps[i].rank(t).shard_shape,
                      [this, i, t](std::span<std::byte> out) {
                        return FillShard(i, DeepSpeedState::kModule, t, out);
                      }));
  }
  return b.Write(path, root, o);
}

// The source's stage-0 model states with the stage's param_shapes (TP rank t's shapes) and the
// new degrees.
Status PipelineWriter::WriteModelStates(int stage, Rank t, const std::string& path,
                                        const TorchWriteOptions& o) const {
  const TorchFile& f = *plan_.model_states;
  const PickleTree& tree = f.tree();
  const int pp = static_cast<int>(plan_.stage.size());
  TorchTreeBuilder b;
  const PickleNodeId root = b.Dict();
  for (const auto& [k, v] : tree.node(tree.root()).entries) {
    const std::string& key = tree.node(k).text;
    PickleNodeId value = kNoPickleNode;
    if (key == "param_shapes") {
      const PickleNodeId shapes = b.Dict({}, /*ordered=*/true);
      for (const size_t i : plan_.stage[static_cast<size_t>(stage)])
        b.Insert(shapes, b.Str(c_.params()[i].name), b.Size(plan_.maps[i].rank(t).shard_shape));
      value = b.List({shapes});
    } else if (key == "buffer_names" && tree.node(v).kind == PickleKind::kList) {
      // The persistent buffers of the stage's layers ("<layer>.<name>").
      std::vector<PickleNodeId> names;
      const int begin = plan_.parts[static_cast<size_t>(stage)];
      const int end = plan_.parts[static_cast<size_t>(stage) + 1];
      for (auto it = plan_.layers.lower_bound(begin); it != plan_.layers.end() && it->first < end;
           ++it) {
        for (const size_t i : it->second.params) {
          if (c_.params()[i].kind == DeepSpeedParamKind::kBuffer)
            names.push_back(b.Str(c_.params()[i].name));
        }
      }
      value = b.List(std::move(names));
    } else if (key == "dp_world_size") {
      value = b.Int(plan_.dp);
    } else if (key == "mp_world_size") {
      value = b.Int(static_cast<int64_t>(pp) * plan_.tp);
    } else if (key == "checkpoint_parallel_dimensions") {
      value = b.Dict({{b.Str("pp_degree"), b.Int(pp)}, {b.Str("tp_degree"), b.Int(plan_.tp)}});
    } else {
      RESHARD_ASSIGN_OR_RETURN(value, b.Copy(f, v));
    }
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId key_copy, b.Copy(f, k));
    b.Insert(root, key_copy, value);
  }
  return b.Write(path, root, o);
}

// Elements [d P, (d + 1) P) of the stage's flat vector at TP rank t (zeros past its end).
Status PipelineWriter::FillPartition(int stage, Rank t, int d, DeepSpeedState state,
                                     std::span<std::byte> out) const {
  std::memset(out.data(), 0, out.size());
  const Index part = Partition(stage, t).second;
  const Index begin = part * d, end = begin + static_cast<Index>(out.size() / 4);
  Index offset = 0;
  for (const size_t i : plan_.stage[static_cast<size_t>(stage)]) {
    const Index n = plan_.maps[i].shard_num_elements(t);
    const Index lo = std::max(offset, begin), hi = std::min(offset + n, end);
    if (lo < hi && plan_.tp == c_.tp()) {  // only the part in this partition is read
      RESHARD_RETURN_IF_ERROR(
          c_.ReadTpShardRange(i, state, t, lo - offset, {out.data() + (lo - begin) * 4, hi - lo}));
    } else if (lo < hi) {
      std::vector<std::byte> shard(static_cast<size_t>(n) * 4);
      RESHARD_RETURN_IF_ERROR(FillShard(i, state, t, shard));
      std::memcpy(out.data() + (lo - begin) * 4, shard.data() + (lo - offset) * 4,
                  static_cast<size_t>(hi - lo) * 4);
    }
    offset += n;
  }
  return Status::Ok();
}

// The source's optimizer file (stage 0, TP rank 0, DP rank 0) with this partition's tensors,
// slice mappings, paddings and partition count.
Status PipelineWriter::WriteOptimizer(int stage, Rank t, int d, const std::string& path,
                                      const TorchWriteOptions& o) const {
  const TorchFile& f = *c_.optimizer_file();
  const PickleTree& tree = f.tree();
  const PickleNodeId sd = DictGet(tree, tree.root(), "optimizer_state_dict");
  const PickleNodeId base = DictGet(tree, sd, "base_optimizer_state");
  const PickleNodeId groups = DictGet(tree, base, "param_groups");
  const PickleNodeId states = DictGet(tree, base, "state");
  if (groups == kNoPickleNode || states == kNoPickleNode || tree.node(states).entries.size() != 1)
    return InvalidArgumentError(
        fmt::format("\"{}\": the optimizer state is not one parameter group's", c_.tag_dir()));
  const PickleNodeId step = DictGet(tree, tree.node(states).entries.front().second, "step");
  const auto [n, part] = Partition(stage, t);
  const Index begin = part * d;
  const Index master_n = std::clamp<Index>(n - begin, 0, part);
  TorchTreeBuilder b;
  // The fp32 partition is the optimizer's parameter: saved with requires_grad, as DeepSpeed's.
  auto flat = [&](DeepSpeedState state, Index len) {
    return b.Tensor(
        DType::kF32, {len},
        [this, stage, t, d, state](std::span<std::byte> out) {
          return FillPartition(stage, t, d, state, out);
        },
        state == DeepSpeedState::kMaster);
  };
  const std::vector<size_t>& params = plan_.stage[static_cast<size_t>(stage)];
  const PickleNodeId out_sd = b.Dict();
  for (const auto& [k, v] : tree.node(sd).entries) {
    const std::string& key = tree.node(k).text;
    PickleNodeId value = kNoPickleNode;
    if (key == "base_optimizer_state") {
      const PickleNodeId moments = b.Dict();
      if (step != kNoPickleNode) {
        RESHARD_ASSIGN_OR_RETURN(const PickleNodeId s, b.Copy(f, step));
        b.Insert(moments, b.Str("step"), s);
      }
      b.Insert(moments, b.Str("exp_avg"), flat(DeepSpeedState::kExpAvg, part));
      b.Insert(moments, b.Str("exp_avg_sq"), flat(DeepSpeedState::kExpAvgSq, part));
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId g, b.Copy(f, groups));
      value = b.Dict({{b.Str("state"), b.Dict({{b.Int(0), moments}})}, {b.Str("param_groups"), g}});
    } else if (key == "single_partition_of_fp32_groups") {
      value = b.List({flat(DeepSpeedState::kMaster, master_n)});
    } else if (key == "group_paddings") {
      value = b.List({b.Int(d == plan_.dp - 1 ? part * plan_.dp - n : 0)});
    } else if (key == "param_alignment_paddings") {
      std::vector<PickleNodeId> zeros;
      for (size_t k2 = 0; k2 < params.size(); ++k2) zeros.push_back(b.Int(0));
      value = b.List({b.List(std::move(zeros))});
    } else if (key == "partition_count") {
      value = b.List({b.Int(plan_.dp)});
    } else if (key == "param_slice_mappings") {
      const PickleNodeId mappings = b.Dict({}, /*ordered=*/true);
      Index offset = 0;
      for (const size_t i : params) {
        const Index numel = plan_.maps[i].shard_num_elements(t);
        const Index lo = std::max(offset, begin), hi = std::min(offset + numel, begin + part);
        if (lo < hi) {
          const PickleNodeId address =
              b.Dict({{b.Str("numel"), b.Int(hi - lo)}, {b.Str("start"), b.Int(lo - begin)}});
          b.Insert(mappings, b.Str(c_.params()[i].name),
                   b.Object("deepspeed.utils.tensor_fragment.fragment_address", address));
        }
        offset += numel;
      }
      value = b.List({mappings});
    } else {
      RESHARD_ASSIGN_OR_RETURN(value, b.Copy(f, v));
    }
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId key_copy, b.Copy(f, k));
    b.Insert(out_sd, key_copy, value);
  }
  const PickleNodeId root = b.Dict();
  for (const auto& [k, v] : tree.node(tree.root()).entries) {
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId key_copy, b.Copy(f, k));
    if (k != kNoPickleNode && tree.node(k).text == "optimizer_state_dict") {
      b.Insert(root, key_copy, out_sd);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, b.Copy(f, v));
    b.Insert(root, key_copy, value);
  }
  return b.Write(path, root, o);
}

}  // namespace

Status ConvertDeepSpeedToPipeline(const std::string& ckpt_dir,
                                  const DeepSpeedPipelineTarget& target, const std::string& out_dir,
                                  const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<DeepSpeedCheckpoint> opened = DeepSpeedCheckpoint::Open(ckpt_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  const DeepSpeedCheckpoint& c = *opened;
  // Every process reads the same files, so the plan agrees without a word.
  RESHARD_ASSIGN_OR_RETURN(const PipelinePlan plan, Plan(c, target));
  const PipelineWriter writer(c, plan, options);
  std::vector<UniversalFile> files;
  const std::string dir = plan.tag + "/";
  for (const auto& [index, unit] : plan.layers) {
    const int layer = index;  // a lambda captures no structured binding before C++20's clang 16
    for (Rank t = 0; t < plan.tp; ++t) {
      uint64_t bytes = 0;
      for (const size_t i : unit.params) {
        bytes += static_cast<uint64_t>(plan.maps[i].shard_num_elements(t)) *
                 DTypeSize(c.ParamDType(i, DeepSpeedState::kModule));
      }
      const std::string name =
          plan.tp > 1 ? fmt::format("layer_{:02d}-model_{:02d}-model_states.pt", layer, t)
                      : fmt::format("layer_{:02d}-model_states.pt", layer);
      files.push_back({dir + name, bytes,
                       [&writer, layer, t](const std::string& path, const TorchWriteOptions& o) {
                         return writer.WriteLayer(layer, t, path, o);
                       }});
    }
  }
  for (int s = 0; s < static_cast<int>(plan.stage.size()); ++s) {
    for (Rank t = 0; t < plan.tp; ++t) {
      const int slice = s * plan.tp + t;
      files.push_back({dir + fmt::format("mp_rank_{:02d}_model_states.pt", slice), 0,
                       [&writer, s, t](const std::string& path, const TorchWriteOptions& o) {
                         return writer.WriteModelStates(s, t, path, o);
                       }});
      const uint64_t bytes = static_cast<uint64_t>(writer.Partition(s, t).second) * 12;
      for (int d = 0; d < plan.dp; ++d) {
        files.push_back({dir + fmt::format("{}zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt",
                                           plan.optim_prefix, d, slice),
                         bytes,
                         [&writer, s, t, d](const std::string& path, const TorchWriteOptions& o) {
                           return writer.WriteOptimizer(s, t, d, path, o);
                         }});
      }
    }
  }
  std::stable_sort(files.begin(), files.end(), [](const UniversalFile& a, const UniversalFile& b) {
    return a.bytes > b.bytes;
  });
  std::vector<std::string> inputs = {c.tag_dir()};
  for (const std::string& p : c.file_paths()) inputs.push_back(p);
  return WriteUniversalFiles(comm, out_dir, options, inputs, plan.tag, files, "latest");
}

}  // namespace reshard
