// The degree planner (DESIGN.md 8): the largest tensor-parallel degree a model supports,
// decided from its config.json and the plan registry before any weight is loaded.
//
// Every split entry of a model's plan contributes a count the degree must divide: attention
// projections their head counts, the MLP its intermediate size (the expert or shared-expert
// size inside a mixture of experts), the LM head and a vocabulary-parallel embedding the
// vocabulary, expert-parallel entries the expert count. Replicated and communication-only
// styles contribute nothing. The working degrees are the divisors of the counts' gcd that pass
// every constraint; the answer is the largest.
//
// Which entries apply:
//  - the model type's base_model_tp_plan, or with expert parallelism its base_model_ep_plan
//    (the TP entries under an EP module give way to it);
//  - a composite model's own entries plus its text sub-config's, each counted from its own
//    config;
//  - from transformers 5.15 on, the LM-head class's entry (`lm_head`: colwise_gather_output)
//    and `embed_tokens`: embedding_rowwise for every (sub-)model that holds an embedding of
//    that name and has a plan (for tied word embeddings only before 5.24; the registry records
//    the rule of its release);
//  - the distributed config's `tp_plan` / `ep_plan` overrides, merged as transformers does.
// Missing config keys take the config class's defaults from the registry.
//
// Mixture of experts under transformers (docs/moe.md): with expert parallelism the
// distributed config must be one transformers accepts at the requested degree N (ep_size a
// multiple of tp_size dividing fsdp_size x tp_size, where tp_size is N when given or when a
// tp_plan is, else 1; a non-empty TP plan at tp_size > 1), and the experts must divide N.
// Expert tensor parallelism (the packed [E, 2I, H] experts run by grouped_mm) needs each
// rank's expert rows 16-byte aligned: the count is I x element size / 16 when the config
// names its dtype, else I; it always binds (no uneven split).
//
// `Engine::kVllm` answers for vLLM: its layers split heads and the intermediate size alike,
// but key/value heads are replicated when the degree exceeds them (so the degree must be a
// multiple of them, or divide them) and the vocabulary is padded to a multiple of 64.
#ifndef RESHARD_HF_DEGREE_H_
#define RESHARD_HF_DEGREE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/hf/model_config.h"
#include "reshard/hf/registry.h"
#include "reshard/layouts/degree_constraints.h"

namespace reshard {

enum class Engine { kTransformers, kVllm };

/// The first release whose plans include the LM head and the tied-embedding entry.
inline constexpr Version kHeadPlanVersion{5, 15, 0};
/// From this release on, the input-embedding entry applies to every base model that holds an
/// `embed_tokens` embedding, tied or not (5.24 does so; the release that began it is not known
/// to reshard, so earlier releases keep the tied-only rule of 5.15).
inline constexpr Version kInputEmbeddingAlwaysVersion{5, 24, 0};
/// From this release on (5.24 measured; the first such release is not known to reshard),
/// transformers splits the vocabulary and MLP widths in ceil chunks (torch's chunk rule, a short
/// or empty last rank) and its forward is exact: only head counts (and gathered widths) bind.
inline constexpr Version kUnevenSplitVersion{5, 24, 0};

struct PlanOptions {
  Engine engine = Engine::kTransformers;
  /// The rules of this release; the registry's own when unset.
  std::optional<Version> transformers_version;
  DistributedConfig distributed;
};

/// One entry of the plan that applies, with the count it contributes (if any).
struct ResolvedEntry {
  std::string pattern;  // relative to the (sub-)model the plan belongs to
  std::string style;
  StyleEffect effect = StyleEffect::kNone;
  std::optional<int64_t> count;
  std::string meaning;           // "attention heads", "vocabulary entries", ...
  bool replicate_above = false;  // vLLM's key/value heads: a multiple of count works too
  /// Split in ceil chunks (a short or empty last rank), so the count need not divide the
  /// degree: the vocabulary and MLP widths under transformers from kUnevenSplitVersion.
  bool uneven = false;
  bool degree_ok(int64_t degree) const;
  /// The constraint the entry puts on the degree (nullopt when it contributes no count).
  std::optional<DegreeConstraint> constraint() const;
};

struct PlanRefusal {
  std::string reason;  // no_tp_plan, unregistered_style, degree_does_not_divide, ...
  std::string message;
};

/// How vLLM splits gpt-oss's MXFP4 experts at a degree N that divides their intermediate size
/// I (vLLM 0.32, GptOssModel._load_weights_mxfp4 and mxfp4_round_up_hidden_size_and_
/// intermediate_size): I is G = I / 32 groups; every rank takes ceil(G / N) groups from the
/// start, the last ranks fewer or none, and its parameters hold I / N features rounded up to
/// the MoE kernel's alignment, zeros past what it took. Whole groups a rank exactly when N
/// divides G; otherwise vLLM pads.
struct VllmMxfp4Split {
  int64_t degree = 1;
  int64_t intermediate = 0;   // I, in features
  int64_t groups = 0;         // G = I / 32
  int64_t rows_per_rank = 0;  // ceil(G / N) x 32 features: what every rank but the last takes
  int64_t holding_ranks = 0;  // ranks that take any feature
  int64_t last_rows = 0;      // what the last of them takes
  bool whole_groups() const { return groups % degree == 0; }
  /// A rank's parameter size in features when the kernel aligns it to `alignment`:
  /// I / N rounded up (32 on vLLM's CPU backend, where it equals rows_per_rank).
  int64_t ParameterRows(int64_t alignment) const;
};

/// vLLM's MXFP4 experts over a model's working degrees.
struct VllmMxfp4Degrees {
  std::string module;                 // "layers.*.mlp.experts"
  std::vector<int64_t> whole_groups;  // working degrees dividing G
  std::vector<int64_t> padded;        // working degrees where ranks take ceil(G / N) groups
  /// At the requested degree, when it works.
  std::optional<VllmMxfp4Split> requested;
};

/// The plan that applies to a model, or why there is none.
struct ModelPlan {
  const TpRegistry* registry = nullptr;
  Engine engine = Engine::kTransformers;
  std::vector<ResolvedEntry> entries;
  std::vector<std::string> notes;      // split entries whose count reshard cannot derive
  std::optional<PlanRefusal> refusal;  // no_tp_plan or unregistered_style
  /// The checkpoint conversions transformers applies at load, with the model type they are
  /// registered for: a checkpoint tensor they consume is not what transformers splits.
  std::vector<std::pair<std::string, LoadConversion>> load_conversions;
  /// The renamings transformers applies to checkpoint names before it matches the plan.
  std::vector<LoadRename> load_renames;
  /// The model's experts per MoE layer (num_local_experts, num_experts or n_routed_experts of
  /// the config that carries the layers); nullopt when the config gives none.
  std::optional<int64_t> experts;
  /// The distributed config the plan was resolved for, and whether its TP plan came out empty
  /// (the deprecated enable_expert_parallel flag, or tp_plan {}): PlanDegree refuses what
  /// transformers' DistributedConfig and plan resolution refuse at the requested degree.
  DistributedConfig distributed;
  bool tp_plan_empty = false;
  /// vLLM engine, gpt-oss with MXFP4 experts: their intermediate size (PlanDegree says where
  /// vLLM pads them).
  std::optional<int64_t> vllm_mxfp4_intermediate;
};

ModelPlan ResolvePlan(const TpRegistry& registry, const ModelConfig& config,
                      const PlanOptions& options);

/// The degree question's answer (the fields of `reshard degree --json`).
struct DegreeAnswer {
  std::optional<int64_t> max_tp_degree;
  std::vector<int64_t> degrees;
  std::optional<int64_t> requested;
  std::optional<int64_t> chosen;           // the smallest working degree >= requested
  std::vector<ResolvedEntry> constraints;  // entries that contribute a count
  std::optional<PlanRefusal> refusal;
  std::vector<std::string> notes;
  std::optional<VllmMxfp4Degrees> vllm_mxfp4;
};

/// The degree asked for: `tp`, else the distributed config's `tp_size`, else none.
/// InvalidArgument naming both when both are given and differ.
Result<std::optional<int64_t>> RequestedDegree(std::optional<int64_t> tp,
                                               const DistributedConfig& distributed);

/// The degrees `plan` supports and the verdict on `requested` (when given). A refusal means
/// the model cannot be split as asked (exit 1): no plan, an unregistered style, a requested
/// degree that fails a constraint, or counts that share no factor.
DegreeAnswer PlanDegree(const ModelPlan& plan, std::optional<int64_t> requested);

/// Which degrees work in each way of splitting the model over N processes (no FSDP): tensor
/// parallelism alone (tp = N), and expert parallelism over the TP ranks (tp = ep = N, the
/// only combination transformers allows without FSDP). `tp_ep` is nullopt when the model has
/// no expert-parallel plan (or the engine is not transformers). The distributed config's plan
/// overrides apply to both; its sizes and flags are replaced.
struct DegreeCombinations {
  std::vector<int64_t> tp;
  std::optional<std::vector<int64_t>> tp_ep;
};
DegreeCombinations Combinations(const TpRegistry& registry, const ModelConfig& config,
                                const PlanOptions& options);

/// The constraints of every entry that contributes a count, in plan order.
std::vector<DegreeConstraint> DegreeConstraints(const ModelPlan& plan);

/// The first constraint `degree` breaks, phrased for a person:
/// "layers.*.self_attn.q_proj (colwise) splits 9 attention heads; 2 does not divide 9".
std::optional<std::string> BrokenConstraint(const ModelPlan& plan, int64_t degree);

}  // namespace reshard

#endif  // RESHARD_HF_DEGREE_H_
