#include "reshard/checkpoint/parallel_runs.h"

#include <fmt/format.h>

#include <algorithm>
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

// Stacked experts' linear_fc2 ([L, E, H, F], expert TP cutting F): expert tp is the parts of F,
// and ep the ranks that wrote the first stage's experts over it (one expert-data replica
// writes each box).
std::pair<int, int> ExpertParts(const DcpTensor& t) {
  std::set<Index> columns;
  std::set<Rank> writers;
  for (const DcpChunk& c : t.chunks) {
    if (c.offsets.size() != 4) return {0, 0};
    columns.insert(c.offsets[3]);
    if (c.offsets[0] == 0) writers.insert(c.rank);
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

ParallelRun MegatronRunOf(const DcpCheckpoint& c) {
  int tp = 0;
  int layer_parts = 0;
  bool experts = false;
  std::pair<int, int> expert_parts = {0, 0};  // ep, expert tp; 0: not from stacked experts
  bool states = false;
  for (const DcpTensor& t : c.tensors()) {
    if (t.optimizer_state) {
      states = true;
      continue;
    }
    if (t.fqn.find(".experts.") != std::string::npos) experts = true;
    if (StackedAt(t.fqn, "decoder.layers.") && StackedAt(t.fqn, ".experts.experts.") &&
        t.fqn.ends_with("linear_fc2.weight")) {
      expert_parts = ExpertParts(t);
    }
    if (t.fqn.ends_with("embedding.word_embeddings.weight")) tp = Dim0Parts(t);
    // Stacked layers ("decoder.layers.self_attention...", not "decoder.layers.3...."): dim 0 is
    // the layer, cut by pipeline stage.
    if (StackedAt(t.fqn, "decoder.layers.")) layer_parts = std::max(layer_parts, Dim0Parts(t));
  }
  const int64_t world = c.world_size();
  ParallelRun run;
  const bool ep_known = expert_parts.first > 0;
  Result<ParallelRun> grid =
      tp > 0 && layer_parts > 0
          ? MegatronRun(world, tp, layer_parts, 1, ep_known ? expert_parts.first : 1,
                        ep_known ? expert_parts.second : tp)
          : Result<ParallelRun>(InvalidArgumentError("not recorded"));
  const bool laid_out = grid.ok();
  if (laid_out) {
    run = *std::move(grid);
    run.convention = fmt::format(
        "Megatron tp-cp-ep-dp-pp; tp from the embedding's chunks, pp from the layers' chunks{}",
        ep_known ? ", ep and etp from the experts' chunks" : "");
    run.vpp.reset();
    run.unknown = {"cp", "vpp"};
  } else {
    run = FlatRun(world, ParallelDim::kRank, "Megatron torch_dist: global tensors' boxes");
    run.unknown = {"tp", "dp", "pp", "cp", "vpp"};
  }
  if (experts && !(laid_out && ep_known)) run.unknown.emplace_back("ep");
  run.optimizer = states ? OptimizerSharding::kDistributed : OptimizerSharding::kNone;
  run.files = "__{rank}_{n}.distcp (each chunk a box of a global tensor), metadata.json";
  return run;
}

}  // namespace reshard
