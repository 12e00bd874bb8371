#include "reshard/checkpoint/parallel_runs.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/deepspeed/moe.h"

namespace reshard {

namespace {

OptimizerSharding ZeroSharding(const DeepSpeedCheckpoint& c) {
  if (!c.has_optimizer_state()) return OptimizerSharding::kNone;
  switch (c.stage()) {
    case 1:
      return OptimizerSharding::kZero1;
    case 2:
      return OptimizerSharding::kZero2;
    case 3:
      return OptimizerSharding::kZero3;
    default:
      return OptimizerSharding::kReplicated;
  }
}

// The distinct dim-0 offsets of a tensor's chunks: how many parts its first dimension is cut
// into.
int Dim0Parts(const DcpTensor& t) {
  std::set<Index> offsets;
  for (const DcpChunk& c : t.chunks) {
    if (!c.offsets.empty()) offsets.insert(c.offsets[0]);
  }
  return static_cast<int>(std::max<size_t>(offsets.size(), 1));
}

// The experts' linear_fc2 of one layer ([E, H, F], or [L, E, H, F] stacked, of which layer 0),
// expert TP cutting F: expert tp is the parts of F, and ep the ranks that wrote the layer's
// experts over it (one expert-data replica writes each box).
std::pair<int, int> ExpertParts(const DcpTensor& t, bool stacked) {
  std::set<Index> columns;
  std::set<Rank> writers;
  for (const DcpChunk& c : t.chunks) {
    if (c.offsets.size() != (stacked ? 4U : 3U)) return {0, 0};
    columns.insert(c.offsets.back());
    if (!stacked || c.offsets[0] == 0) writers.insert(c.rank);
  }
  const auto etp = static_cast<int>(std::max<size_t>(columns.size(), 1));
  if (writers.empty() || writers.size() % columns.size() != 0) return {0, 0};
  return {static_cast<int>(writers.size()) / etp, etp};
}

bool StackedAt(const std::string& fqn, std::string_view prefix) {
  const size_t at = fqn.find(prefix);
  if (at == std::string::npos) return false;
  const size_t next = at + prefix.size();
  return next < fqn.size() && (fqn[next] < '0' || fqn[next] > '9');
}

// The layer of a per-layer key "decoder.layers.{l}.<leaf>"; -1 for any other.
Index LayerOfKey(const std::string& fqn) {
  constexpr std::string_view kPrefix = "decoder.layers.";
  const size_t at = fqn.find(kPrefix);
  if (at == std::string::npos) return -1;
  Index layer = 0;
  size_t i = at + kPrefix.size();
  const size_t first = i;
  for (; i < fqn.size() && fqn[i] >= '0' && fqn[i] <= '9' && i - first < 9; ++i)
    layer = layer * 10 + (fqn[i] - '0');
  return i > first && i < fqn.size() && fqn[i] == '.' ? layer : -1;
}

}  // namespace

ParallelRun ShardedRunOf(const Manifest& m) {
  ParallelRun run = FlatRun(m.world_size, ParallelDim::kTp, "reshard: a rank per tensor rank");
  const bool states = std::any_of(m.params.begin(), m.params.end(),
                                  [](const ShardedParam& p) { return p.scale_power != 1; });
  run.optimizer = states ? OptimizerSharding::kAsTensors : OptimizerSharding::kNone;
  run.files = "model-rank-{tp}-part-{p}.safetensors";
  return run;
}

ParallelRun HuggingFaceRun() {
  ParallelRun run;
  run.convention = "Hugging Face: whole tensors";
  run.optimizer = OptimizerSharding::kNone;
  run.files = "model.safetensors, or model-{i:05d}-of-{n:05d}.safetensors by its index";
  return run;
}

ParallelRun UniversalRun(bool optimizer_state) {
  ParallelRun run;
  run.convention = "DeepSpeed universal: whole tensors";
  run.optimizer = optimizer_state ? OptimizerSharding::kWhole : OptimizerSharding::kNone;
  run.files = "zero/{param}/{fp32,exp_avg,exp_avg_sq,step}.pt";
  return run;
}

ParallelRun DeepSpeedRunOf(const DeepSpeedCheckpoint& c) {
  const DeepSpeedExperts* experts = c.experts();
  const int ep = experts != nullptr ? experts->ep_size : 1;
  Result<ParallelRun> made = DeepSpeedRun(c.pp(), c.tp(), c.dp(), ZeroSharding(c), ep,
                                          experts != nullptr && experts->data_before_expert);
  // The reader checked ep against dp; a run it could not describe is shown flat.
  ParallelRun run =
      made.ok() ? *std::move(made)
                : FlatRun(int64_t{c.pp()} * c.tp() * c.dp(), ParallelDim::kRank, "DeepSpeed");
  const std::string slice = c.pp() > 1 ? "{pp*TP+tp:02d}" : "{tp:02d}";
  if (c.pp() > 1) run.files = "layer_{L:02d}[-model_{tp:02d}]-model_states.pt, ";
  run.files += c.stage() == 3 ? "zero_pp_rank_{dp}_mp_rank_" + slice + "_model_states.pt"
                              : "mp_rank_" + slice + "_model_states.pt";
  if (c.has_optimizer_state() && c.stage() > 0)
    run.files += ", [bf16_]zero_pp_rank_{dp}_mp_rank_" + slice + "_optim_states.pt";
  if (experts != nullptr) run.files += ", layer_{L}_expert_{e}_mp_rank_00_model_states.pt";
  return run;
}

ParallelRun DcpRunOf(const DcpCheckpoint& c) {
  ParallelRun run = FlatRun(c.world_size(), ParallelDim::kRank, "DCP flat world");
  const bool states = std::any_of(c.tensors().begin(), c.tensors().end(),
                                  [](const DcpTensor& t) { return t.optimizer_state; });
  run.optimizer = states ? OptimizerSharding::kAsTensors : OptimizerSharding::kNone;
  run.unknown = {"tp", "dp", "pp"};
  run.files = "__{rank}_{n}.distcp (each chunk a box of a global tensor)";
  return run;
}

namespace {

// What a torch_dist checkpoint's boxes and their writers say of Megatron's grid.
struct MegatronFindings {
  int tp = 0;                                 // the embedding's vocabulary chunks; 0: none
  std::pair<int, int> expert_parts = {0, 0};  // ep, expert tp; 0: no stacked experts
  bool experts = false;
  bool states = false;
  std::map<Index, std::set<Rank>> layer_writers;  // stacked layers: layer -> writing ranks
};

MegatronFindings FindMegatronGrid(const DcpCheckpoint& c) {
  MegatronFindings f;
  Index expert_layer = std::numeric_limits<Index>::max();
  for (const DcpTensor& t : c.tensors()) {
    if (t.optimizer_state) {
      f.states = true;
      continue;
    }
    if (t.fqn.find(".experts.") != std::string::npos) f.experts = true;
    if (t.fqn.ends_with("embedding.word_embeddings.weight")) f.tp = Dim0Parts(t);
    const bool stacked = StackedAt(t.fqn, "decoder.layers.");
    const Index layer = LayerOfKey(t.fqn);
    // The first MoE layer's experts, stacked over their experts (not one key per expert).
    if ((stacked || layer >= 0) && StackedAt(t.fqn, ".experts.experts.") &&
        t.fqn.ends_with("linear_fc2.weight") && (stacked || layer < expert_layer)) {
      f.expert_parts = ExpertParts(t, stacked);
      if (!stacked) expert_layer = layer;
    }
    // Stacked layers ("decoder.layers.self_attention...") have the layer as dim 0, each layer a
    // box of its own; per-layer keys ("decoder.layers.3.self_attention...") in their names.
    // Either way a layer's boxes are written by ranks of its stage.
    for (const DcpChunk& ch : t.chunks) {
      if (stacked && !ch.offsets.empty()) f.layer_writers[ch.offsets[0]].insert(ch.rank);
      if (layer >= 0) f.layer_writers[layer].insert(ch.rank);
    }
  }
  return f;
}

// The stages, the ranks per stage and the model chunks per stage from the layers' writers, as
// Megatron's default save leaves them (each box written by its first replica: the stage's
// data-parallel rank 0). Runs of layers with the same writers are model chunks; with virtual
// stages they cycle over the stages (stage k's chunks every pp-th run). Stage k's writers lie
// in [k S, (k + 1) S) from k S. pp 0 when the writers do not read so; S 0 with one stage (its
// data-parallel ranks wrote nothing and are not recorded).
struct Stages {
  int pp = 0;
  int64_t span = 0;
  int vpp = 1;
};

Stages StagesOf(const std::map<Index, std::set<Rank>>& writers) {
  std::vector<std::set<Rank>> runs;
  for (const auto& [layer, ranks] : writers) {
    if (runs.empty() || runs.back() != ranks) runs.push_back(ranks);
  }
  std::vector<std::set<Rank>> stages;
  for (const std::set<Rank>& r : runs) {
    if (std::find(stages.begin(), stages.end(), r) == stages.end()) stages.push_back(r);
  }
  if (stages.empty() || runs.size() % stages.size() != 0) return {};
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i] != stages[i % stages.size()]) return {};
  }
  const int vpp = static_cast<int>(runs.size() / stages.size());
  if (stages.size() == 1) return {1, 0, vpp};
  const int64_t span = *stages[1].begin();
  if (span < 1) return {};
  for (size_t k = 0; k < stages.size(); ++k) {
    const auto lo = static_cast<int64_t>(k) * span;
    if (*stages[k].begin() != lo || *stages[k].rbegin() >= lo + span) return {};
  }
  return {static_cast<int>(stages.size()), span, vpp};
}

}  // namespace

ParallelRun MegatronRunOf(const DcpCheckpoint& c) {
  const MegatronFindings f = FindMegatronGrid(c);
  const Stages stages = StagesOf(f.layer_writers);
  const int pp = stages.pp;
  const int64_t span = stages.span;
  const bool ep_known = f.expert_parts.first > 0;
  ParallelRun run;
  std::string how = "tp from the embedding's chunks, pp and vpp from the layers' writers";
  if (ep_known) how += ", ep and etp from the experts' chunks and writers";
  if (f.tp > 0 && pp > 0 && span > 0 && span % f.tp == 0) {
    // Every axis but cp apart: dp here counts cp's ranks too.
    Result<ParallelRun> grid =
        MegatronRun(pp * span, f.tp, pp, 1, ep_known ? f.expert_parts.first : 1,
                    ep_known ? f.expert_parts.second : 0);
    if (grid.ok()) {
      run = *std::move(grid);
      run.unknown = {"cp"};
    }
  }
  if (run.grid.axes.empty() && f.tp > 0 && pp > 0) {
    // One stage (or writers that leave the ranks per stage open): the data-parallel replicas
    // wrote nothing, so neither dp nor the world is recorded.
    run.grid.axes = {{ParallelDim::kTp, f.tp}, {ParallelDim::kPp, pp}};
    if (ep_known && int64_t{f.expert_parts.first} * f.expert_parts.second == f.tp) {
      run.experts = RankGrid{{{ParallelDim::kEtp, f.expert_parts.second},
                              {ParallelDim::kEp, f.expert_parts.first},
                              {ParallelDim::kPp, pp}}};
    }
    run.unknown = {"dp", "cp"};
  }
  if (run.grid.axes.empty()) {
    run = FlatRun(c.world_size(), ParallelDim::kRank, "");
    run.unknown = {"tp", "dp", "pp", "cp", "vpp"};
    how = "the ranks that wrote it";
  }
  run.convention = "Megatron tp-cp-ep-dp-pp; " + how;
  if (pp > 0) {
    run.vpp = stages.vpp;
  } else {
    run.vpp.reset();
  }
  if (f.experts && !run.experts) run.unknown.emplace_back("ep");
  run.optimizer = f.states ? OptimizerSharding::kDistributed : OptimizerSharding::kNone;
  run.files = "__{rank}_{n}.distcp (each chunk a box of a global tensor), metadata.json";
  return run;
}

}  // namespace reshard
