#include "reshard/hf/degree.h"

#include <fmt/format.h>

#include <algorithm>

#include "reshard/hf/degree_blocks.h"

namespace reshard {

namespace {

using Values = std::map<std::string, std::optional<int64_t>>;

std::optional<int64_t> Get(const Values& values, std::string_view key) {
  return ConfigValue(values, key);
}

bool Gathered(const ResolvedEntry& e, Engine engine) {
  return engine == Engine::kTransformers &&
         (e.style == "colwise_gather_output" || e.style == "colwise_rep" ||
          e.style == "rowwise_split_input" || e.style == "rowwise_rep");
}

bool In(std::string_view s, std::initializer_list<std::string_view> set) {
  return std::find(set.begin(), set.end(), s) != set.end();
}

int64_t PaddedVocab(int64_t vocab) { return (vocab + 63) / 64 * 64; }

// An MLP's intermediate width from the config, and what its features are: the routed
// experts', the shared experts' or a dense MLP's.
std::optional<int64_t> MlpWidth(const Values& v, bool experts, bool shared_experts,
                                std::string& what) {
  std::optional<int64_t> size;
  if (experts) {
    size = Get(v, "moe_intermediate_size");
    if (!size) size = Get(v, "intermediate_size");
    what = "expert intermediate features";
  } else if (shared_experts) {
    // The shared experts' width, under the key each config class uses (Qwen, Nemotron-H),
    // or the expert width times their count (DeepSeek / GLM, HY-V3 / AFMoE, ERNIE).
    size = Get(v, "shared_expert_intermediate_size");
    if (!size) size = Get(v, "moe_shared_expert_intermediate_size");
    const std::optional<int64_t> moe = Get(v, "moe_intermediate_size");
    std::optional<int64_t> shared = Get(v, "n_shared_experts");
    if (!shared) shared = Get(v, "num_shared_experts");
    if (!shared) shared = Get(v, "moe_num_shared_experts");
    if (!size && moe && shared) size = *moe * *shared;
    if (!size) size = Get(v, "intermediate_size");
    what = "shared-expert intermediate features";
  } else {
    size = Get(v, "intermediate_size_mlp");
    if (!size) size = Get(v, "intermediate_size");
    if (!size && Get(v, "hidden_size")) size = 4 * *Get(v, "hidden_size");
    what = "intermediate features";
  }
  return size;
}

// Sets e.count and e.meaning from the pattern's module names and the config; returns false
// when a split entry's count cannot be derived.
// `uneven`: the engine splits vocabulary and MLP widths in ceil chunks, so those counts need
// not divide the degree (transformers 5.24's DTensor shards).
bool Classify(ResolvedEntry& e, const Values& v, Engine engine, bool uneven) {
  if (e.effect == StyleEffect::kNone) return true;
  std::vector<std::string_view> parts;
  std::string_view rest = e.pattern;
  while (!rest.empty()) {
    const size_t dot = std::min(rest.find('.'), rest.size());
    if (rest.substr(0, dot) != "*") parts.push_back(rest.substr(0, dot));
    rest = dot == rest.size() ? std::string_view() : rest.substr(dot + 1);
  }
  if (parts.empty()) return false;
  const std::string_view last = parts.back();
  auto has = [&](std::initializer_list<std::string_view> names) {
    return std::any_of(parts.begin(), parts.end(),
                       [&](std::string_view p) { return In(p, names); });
  };
  auto set = [&](std::optional<int64_t> count, std::string meaning) {
    if (!count || *count <= 0) return false;
    e.count = count;
    e.meaning = std::move(meaning);
    return true;
  };
  const std::optional<int64_t> vocab = Get(v, "vocab_size");
  auto vocab_count = [&]() {
    if (engine == Engine::kVllm && vocab) {
      return set(PaddedVocab(*vocab),
                 fmt::format("vocabulary entries (padded to a multiple of 64 from {})", *vocab));
    }
    e.uneven = uneven;
    return set(vocab, "vocabulary entries");
  };
  if (e.effect == StyleEffect::kExperts) {
    std::optional<int64_t> experts = Get(v, "num_local_experts");
    if (!experts) experts = Get(v, "num_experts");
    if (!experts) experts = Get(v, "n_routed_experts");
    return set(experts, "experts");
  }
  if (e.effect == StyleEffect::kEmbeddingVocab) return vocab_count();
  if (e.effect == StyleEffect::kEmbeddingHidden) return false;
  if (last == "lm_head") return vocab_count();

  const std::optional<int64_t> heads = Get(v, "num_attention_heads");
  std::optional<int64_t> kv = Get(v, "num_key_value_heads");
  if (!kv) kv = heads;
  std::optional<int64_t> head_dim = Get(v, "head_dim");
  if (!head_dim && heads && *heads > 0 && Get(v, "hidden_size"))
    head_dim = *Get(v, "hidden_size") / *heads;
  const bool gathered = Gathered(e, engine);

  if (has({"self_attn", "attn", "attention", "self_attention"})) {
    if (In(last, {"k_proj", "v_proj"})) {
      if (gathered) {
        if (!kv || !head_dim) return false;
        return set(*kv * *head_dim,
                   fmt::format("output features ({} key/value heads x {})", *kv, *head_dim));
      }
      e.replicate_above = engine == Engine::kVllm;
      return set(kv, "key/value heads");
    }
    if (In(last, {"qkv_proj", "query_key_value", "c_attn", "Wqkv"})) {
      if (gathered) {
        if (!heads || !kv || !head_dim) return false;
        return set((*heads + 2 * *kv) * *head_dim,
                   fmt::format("output features ({} + 2 x {} heads x {})", *heads, *kv, *head_dim));
      }
      return set(heads, "attention heads");
    }
    if (In(last, {"q_proj", "o_proj", "q_b_proj", "kv_b_proj", "sinks", "gate_proj", "g_proj",
                  "q_gate_proj", "gate_bias", "dense", "out_proj", "proj", "c_proj"})) {
      if (gathered) {
        if (!heads || !head_dim) return false;
        return set(*heads * *head_dim,
                   fmt::format("features ({} attention heads x {})", *heads, *head_dim));
      }
      return set(heads, "attention heads");
    }
    return false;
  }
  if (In(last, {"gate_proj", "up_proj", "down_proj", "fc1", "fc2", "fc_in", "fc_out", "c_fc",
                "c_proj", "dense_h_to_4h", "dense_4h_to_h", "gate_up_proj", "w1", "w2", "w3"})) {
    std::string what;
    const std::optional<int64_t> size =
        MlpWidth(v, has({"experts"}), has({"shared_expert", "shared_experts"}), what);
    e.uneven = uneven && !Gathered(e, engine);
    if (has({"experts"}) && engine == Engine::kTransformers && size) {
      // The packed experts are not measured split unevenly; grouped_mm (the [E, 2I, H]
      // layout's kernel) needs each rank's rows 16-byte aligned (docs/moe.md).
      e.uneven = false;
      const bool grouped_mm =
          e.style == "packed_colwise" || (last == "down_proj" && e.effect == StyleEffect::kSplitIn);
      const std::optional<int64_t> bytes = Get(v, "dtype_bytes");
      if (grouped_mm && bytes && *size * *bytes % 16 == 0) {
        return set(*size * *bytes / 16,
                   fmt::format("16-byte groups of expert intermediate features ({} x {} bytes; "
                               "grouped_mm needs each rank's expert rows 16-byte aligned)",
                               *size, *bytes));
      }
    }
    if (last == "gate_up_proj" && e.effect == StyleEffect::kSplitOut && size)
      return set(2 * *size, fmt::format("output features (gate and up, 2 x {})", *size));
    return set(size, what);
  }
  return false;
}

bool CoveredBy(std::string_view pattern, const Plan& plan) {
  for (const PlanEntry& e : plan) {
    if (pattern == e.pattern) return true;
    if (pattern.size() > e.pattern.size() && pattern.starts_with(e.pattern) &&
        pattern[e.pattern.size()] == '.')
      return true;
  }
  return false;
}

Plan Merge(Plan base, const Plan& override_plan) {
  for (const PlanEntry& o : override_plan) {
    auto it = std::find_if(base.begin(), base.end(),
                           [&](const PlanEntry& e) { return e.pattern == o.pattern; });
    if (it != base.end()) {
      it->style = o.style;
    } else {
      base.push_back(o);
    }
  }
  return base;
}

}  // namespace

bool ResolvedEntry::degree_ok(int64_t degree) const {
  const std::optional<DegreeConstraint> c = constraint();
  return !c || c->Allows(degree);
}

std::optional<DegreeConstraint> ResolvedEntry::constraint() const {
  if (!count || uneven) return std::nullopt;
  return DegreeConstraint{pattern, style, *count, meaning, replicate_above};
}

std::vector<DegreeConstraint> DegreeConstraints(const ModelPlan& plan) {
  std::vector<DegreeConstraint> out;
  for (const ResolvedEntry& e : plan.entries) {
    if (std::optional<DegreeConstraint> c = e.constraint()) out.push_back(*std::move(c));
  }
  if (!out.empty()) return out;
  // Only counts split in uneven chunks: they bind after all, so that one degree answers.
  for (const ResolvedEntry& e : plan.entries) {
    if (e.count) out.push_back({e.pattern, e.style, *e.count, e.meaning, e.replicate_above});
  }
  return out;
}

namespace {

// One (sub-)model whose plan applies: the composite's own, then its text model's.
struct Scope {
  std::string model_type;
  const ModelTypeInfo* info;
  const Values* values;
  bool has_tp = false;  // its tensor-parallel plan is not empty after overrides
};

// A plan entry and the scope it belongs to.
struct ScopedEntry {
  PlanEntry entry;
  size_t scope;
};

PlanRefusal NoPlanRefusal(std::string why) {
  return PlanRefusal{
      "no_tp_plan",
      fmt::format("{}. Asked for tensor parallelism, transformers would not split it: it would "
                  "load a full copy of the model on every rank, silently, at N times the "
                  "memory. Spread it another way (pipeline parallelism or FSDP), or pass a "
                  "tp_plan in the distributed config.",
                  std::move(why))};
}

std::vector<Scope> Scopes(const ModelConfig& config) {
  std::vector<Scope> scopes = {{config.model_type, config.info, &config.values}};
  if (config.text_info != nullptr)
    scopes.push_back({config.text_model_type, config.text_info, &config.text_values});
  return scopes;
}

// The entries of every scope's plans after the distributed config's overrides; the TP entries
// under an expert-parallel module give way to it.
std::vector<ScopedEntry> PlanEntries(std::vector<Scope>& scopes, const PlanOptions& options) {
  const DistributedConfig& dist = options.distributed;
  const bool expert_parallel = options.engine == Engine::kTransformers && dist.expert_parallel();
  // Overrides name the modules of the model that carries the layers: the text model.
  const size_t main_scope = scopes.size() - 1;
  std::vector<ScopedEntry> entries;
  for (size_t s = 0; s < scopes.size(); ++s) {
    Plan tp = scopes[s].info->tp_plan;
    Plan ep = scopes[s].info->ep_plan;
    if (s == main_scope && options.engine == Engine::kTransformers) {
      if (dist.tp_plan) tp = dist.tp_plan->empty() ? Plan{} : Merge(tp, *dist.tp_plan);
      if (dist.ep_plan) ep = Merge(ep, *dist.ep_plan);
      // The deprecated flag alone means "experts only": tp_plan={} across tp_size ranks.
      if (dist.enable_expert_parallel && !dist.ep_size && !dist.tp_plan_given) tp.clear();
    }
    // Before the EP rules take their modules: transformers asks whether the model has a TP
    // plan (and adds the input embedding to it) on the whole plan.
    scopes[s].has_tp = !tp.empty();
    if (expert_parallel) {
      std::erase_if(tp, [&](const PlanEntry& e) { return CoveredBy(e.pattern, ep); });
      for (const PlanEntry& e : ep) entries.push_back({e, s});
    }
    for (const PlanEntry& e : tp) entries.push_back({e, s});
  }
  return entries;
}

bool HasPattern(const std::vector<ScopedEntry>& entries, std::string_view pattern, size_t scope) {
  return std::any_of(entries.begin(), entries.end(), [&](const ScopedEntry& e) {
    return e.scope == scope && e.entry.pattern == pattern;
  });
}

// transformers adds the input embedding to the plan of every base model that holds one and
// has a plan: for tied word embeddings only from 5.15, for every model by the registry's
// release (kInputEmbeddingAlwaysVersion on; docs/degree.md).
void AddInputEmbeddingEntries(const TpRegistry& registry, const ModelConfig& config,
                              const std::vector<Scope>& scopes, Version version,
                              Version registry_version, std::vector<ScopedEntry>& entries) {
  if (version < kHeadPlanVersion) return;
  const InputEmbeddingRule rule = registry.input_embedding.value_or(InputEmbeddingRule{});
  bool tied_only = true;
  if (version >= registry_version) {
    if (!registry.input_embedding) return;
    tied_only = rule.tied_only;
  } else if (version >= kInputEmbeddingAlwaysVersion) {
    tied_only = false;
  }
  for (size_t s = 0; s < scopes.size(); ++s) {
    if (!scopes[s].has_tp || !scopes[s].info->embed_tokens) continue;
    std::optional<int64_t> tied = Get(*scopes[s].values, "tie_word_embeddings");
    if (!tied) tied = Get(config.values, "tie_word_embeddings");
    if (tied_only && tied.value_or(0) == 0) continue;
    if (HasPattern(entries, rule.module, s)) continue;
    entries.insert(entries.begin(), {{rule.module, rule.style}, s});
  }
}

void AddHeadEntries(const ModelConfig& config, size_t main_scope,
                    std::vector<ScopedEntry>& entries) {
  const Plan* head = &config.info->head_plan;
  if (head->empty() && config.text_info != nullptr) head = &config.text_info->head_plan;
  for (const PlanEntry& e : *head) {
    if (!HasPattern(entries, e.pattern, main_scope)) entries.push_back({e, main_scope});
  }
}

// vLLM always splits the vocabulary: VocabParallelEmbedding and ParallelLMHead.
void AddVllmVocabularyEntries(size_t main_scope, std::vector<ScopedEntry>& entries) {
  const bool embedding = std::any_of(entries.begin(), entries.end(), [](const ScopedEntry& e) {
    return e.entry.style == "embedding_rowwise";
  });
  if (!embedding)
    entries.insert(entries.begin(), {{"embed_tokens", "embedding_rowwise"}, main_scope});
  if (!HasPattern(entries, "lm_head", main_scope))
    entries.push_back({{"lm_head", "colwise_gather_output"}, main_scope});
}

// vLLM's gpt-oss splits what transformers' gpt_oss plan (the embedding alone) leaves whole:
// attention by heads (QKVParallelLinear, RowParallelLinear, the sinks) and the fused experts by
// their intermediate size (FusedMoE).
void AddVllmGptOssEntries(size_t main_scope, std::vector<ScopedEntry>& entries) {
  static constexpr std::pair<std::string_view, std::string_view> kSplit[] = {
      {"layers.*.self_attn.q_proj", "colwise"},
      {"layers.*.self_attn.k_proj", "colwise"},
      {"layers.*.self_attn.v_proj", "colwise"},
      {"layers.*.self_attn.o_proj", "rowwise"},
      {"layers.*.mlp.experts.gate_up_proj", "packed_colwise"},
      {"layers.*.mlp.experts.down_proj", "rowwise"}};
  for (const auto& [pattern, style] : kSplit) {
    if (!HasPattern(entries, pattern, main_scope))
      entries.push_back({{std::string(pattern), std::string(style)}, main_scope});
  }
}

// Each entry through the style registry and the config's counts; false with plan.refusal set
// when a style is not registered.
bool ClassifyEntries(const TpRegistry& registry, const std::vector<ScopedEntry>& entries,
                     const std::vector<Scope>& scopes, Engine engine, bool uneven,
                     ModelPlan& plan) {
  for (const auto& [entry, s] : entries) {
    ResolvedEntry r;
    r.pattern = entry.pattern;
    r.style = entry.style;
    Result<StyleEffect> effect = ResolveStyle(registry, entry.style);
    if (!effect.ok()) {
      plan.refusal = PlanRefusal{
          "unregistered_style",
          fmt::format("{} ({}): {}. transformers would fail when it applies the plan at load, "
                      "after the weights were fetched. Map the entry to a registered style in "
                      "the distributed config's tp_plan, or use a transformers release that "
                      "registers it.",
                      entry.pattern, entry.style, effect.status().message())};
      plan.entries.clear();
      return false;
    }
    r.effect = *effect;
    if (!Classify(r, *scopes[s].values, engine, uneven)) {
      plan.notes.push_back(fmt::format(
          "{} ({}) is split, but reshard cannot tell from the config what it counts; it is not "
          "checked",
          entry.pattern, entry.style));
    }
    plan.entries.push_back(std::move(r));
  }
  return true;
}

}  // namespace

ModelPlan ResolvePlan(const TpRegistry& registry, const ModelConfig& config,
                      const PlanOptions& options) {
  ModelPlan plan;
  plan.registry = &registry;
  plan.engine = options.engine;
  const Result<Version> parsed_version = ParseVersion(registry.transformers_version);
  const Version registry_version = parsed_version.ok() ? *parsed_version : Version{999, 0, 0};
  const Version version = options.transformers_version.value_or(registry_version);
  const DistributedConfig& dist = options.distributed;
  if (config.info == nullptr) {
    plan.refusal = NoPlanRefusal(
        fmt::format("model type \"{}\" has no tensor-parallel plan in transformers {} (and no text "
                    "sub-config with one)",
                    config.model_type, registry.transformers_version));
    return plan;
  }
  std::vector<Scope> scopes = Scopes(config);
  const size_t main_scope = scopes.size() - 1;
  for (const Scope& s : scopes) {
    for (const LoadConversion& c : s.info->load_conversions)
      plan.load_conversions.push_back({s.model_type, c});
    plan.load_renames.insert(plan.load_renames.end(), s.info->load_renames.begin(),
                             s.info->load_renames.end());
  }
  plan.load_renames.insert(plan.load_renames.end(), registry.load_renames.begin(),
                           registry.load_renames.end());
  for (const char* key : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    if (plan.experts) break;
    plan.experts = Get(*scopes[main_scope].values, key);
  }
  std::vector<ScopedEntry> entries = PlanEntries(scopes, options);
  const bool any_ep_plan = std::any_of(scopes.begin(), scopes.end(),
                                       [](const Scope& s) { return !s.info->ep_plan.empty(); });
  if (options.engine == Engine::kTransformers && dist.expert_parallel() && !any_ep_plan &&
      !dist.ep_plan) {
    plan.refusal = PlanRefusal{
        "no_ep_plan",
        fmt::format("model type \"{}\" has no expert-parallel plan in transformers {}: asked for "
                    "expert parallelism, transformers refuses to load it. Drop "
                    "enable_expert_parallel/ep_size, or pass an ep_plan.",
                    config.model_type, registry.transformers_version)};
    return plan;
  }
  if (entries.empty()) {
    plan.refusal = NoPlanRefusal(fmt::format(
        "model type \"{}\" has no tensor-parallel plan in transformers {}{}", config.model_type,
        registry.transformers_version,
        dist.tp_plan && dist.tp_plan->empty() ? " (the distributed config's tp_plan is empty)"
                                              : ""));
    return plan;
  }
  const bool any_tp =
      std::any_of(scopes.begin(), scopes.end(), [](const Scope& s) { return s.has_tp; });
  plan.distributed = dist;
  plan.tp_plan_empty = !any_tp;
  if (options.engine == Engine::kVllm) {
    AddVllmVocabularyEntries(main_scope, entries);
    if (config.model_type == "gpt_oss") AddVllmGptOssEntries(main_scope, entries);
  } else if (version >= kHeadPlanVersion && any_tp) {
    AddInputEmbeddingEntries(registry, config, scopes, version, registry_version, entries);
    AddHeadEntries(config, main_scope, entries);
  }
  const bool uneven = options.engine == Engine::kTransformers && version >= kUnevenSplitVersion;
  ClassifyEntries(registry, entries, scopes, options.engine, uneven, plan);
  AddBlockEntries(config, plan);
  if (options.engine == Engine::kVllm && config.model_type == "gpt_oss")
    ApplyVllmGptOssRules(config, plan);
  return plan;
}

std::optional<std::string> BrokenConstraint(const ModelPlan& plan, int64_t degree) {
  return FirstBrokenConstraint(DegreeConstraints(plan), degree);
}

Result<std::optional<int64_t>> RequestedDegree(std::optional<int64_t> tp,
                                               const DistributedConfig& distributed) {
  if (tp && distributed.tp_size && *tp != *distributed.tp_size) {
    return InvalidArgumentError(
        fmt::format("tp {} and the distributed config's tp_size {} disagree: give one", *tp,
                    *distributed.tp_size));
  }
  return tp ? tp : distributed.tp_size;
}

namespace {

// What transformers' DistributedConfig and plan resolution refuse for N processes under the
// plan's distributed config (configuration_utils.py, mixin.py), or nullopt.
std::optional<PlanRefusal> DistributedRefusal(const ModelPlan& plan, int64_t n) {
  const DistributedConfig& d = plan.distributed;
  if (plan.engine != Engine::kTransformers || !d.expert_parallel()) return std::nullopt;
  const bool derived = !d.tp_size && !d.tp_plan_given;  // transformers takes tp_size = 1
  const int64_t tp = d.tp_size ? *d.tp_size : (derived ? 1 : n);
  const int64_t ep = d.ep_size ? *d.ep_size : tp;  // the deprecated flag: ep_size = tp_size
  const int64_t fsdp = d.fsdp_size.value_or(1);
  auto refuse = [&](std::string message) {
    return PlanRefusal{"distributed_config", std::move(message)};
  };
  const std::string sizes = fmt::format(
      "tp_size {}{}, ep_size {}", tp,
      derived ? " (neither tp_size nor tp_plan is given, so transformers takes 1)" : "", ep);
  if (ep > 1 && ep % tp != 0) {
    return refuse(fmt::format(
        "transformers refuses the distributed config at load: \"`ep_size` must be a multiple of "
        "`tp_size`.\" ({}). Give ep_size equal to tp_size.",
        sizes));
  }
  if (ep > 1 && (fsdp * tp) % ep != 0) {
    return refuse(fmt::format(
        "transformers refuses the distributed config at load: \"`ep_size` must divide "
        "`fsdp_size * tp_size`.\" ({}, fsdp_size {}). For expert parallelism over {} processes "
        "give {{\"tp_plan\": \"auto\", \"ep_size\": {}}}.",
        sizes, fsdp, n, n));
  }
  if (tp > 1 && plan.tp_plan_empty) {
    return refuse(fmt::format(
        "transformers refuses the distributed config at load: \"`tp_size={}` was requested, but "
        "the model has no `tp_plan`\" ({}). The deprecated enable_expert_parallel without "
        "ep_size sets tp_plan = {{}}; give {{\"tp_plan\": \"auto\", \"ep_size\": {}}} to "
        "split the experts by expert and the rest by the TP plan.",
        tp,
        d.enable_expert_parallel && !d.ep_size ? "enable_expert_parallel sets tp_plan = {}"
                                               : "the tp_plan is empty",
        tp));
  }
  return std::nullopt;
}

// What transformers does at degree n when `broken` fails, in its own words where it has them.
std::string BrokenDegreeConsequence(const ModelPlan& plan, const DegreeConstraint& broken,
                                    int64_t n) {
  if (broken.meaning.starts_with("FP8 blocks")) {
    return plan.engine == Engine::kVllm
               ? fmt::format(
                     "At tp {} vLLM refuses the layer when it creates its weights, or "
                     "for a merged layer loads scales that are wrong for some rows.",
                     n)
               : fmt::format(
                     "At tp {} transformers' load of the FP8 weights fails "
                     "(ZeroDivisionError in Fp8Dequantize): a rank without a whole "
                     "block has no scale row for it.",
                     n);
  }
  if (plan.engine == Engine::kVllm && broken.meaning.find("MLPBlock") != std::string::npos) {
    return fmt::format(
        "At tp {} vLLM stops while it builds the model: `assert config.intermediate_size % "
        "self.world_size == 0` fails (AssertionError, gpt-oss's MLPBlock).",
        n);
  }
  if (plan.engine == Engine::kVllm && broken.meaning.find("no replication") != std::string::npos) {
    return fmt::format(
        "At tp {} vLLM's gpt-oss attention would get {} // {} = 0 key/value heads a rank and "
        "cannot be built.",
        n, broken.count, n);
  }
  if (plan.engine == Engine::kVllm) return fmt::format("vLLM would refuse the model at tp {}.", n);
  if (broken.meaning == "experts") {
    return fmt::format(
        "transformers refuses it when it applies the expert-parallel plan, before loading: "
        "\"Cannot evenly shard {} experts across {} expert-parallel ranks.\"",
        broken.count, n);
  }
  if (broken.meaning.find("grouped_mm") != std::string::npos) {
    return fmt::format(
        "At tp {} transformers would load the weights and then fail in the first forward with "
        "\"strides should be multiple of 16 bytes\" (grouped_mm, the experts' kernel). Expert "
        "parallelism keeps the experts whole.",
        n);
  }
  return TransformersBrokenDegreeConsequence(n);
}

// Where vLLM splits MXFP4 experts into whole groups and where it pads (degree_blocks.h).
void DescribeVllmMxfp4(const ModelPlan& plan, DegreeAnswer& answer) {
  const int64_t intermediate = *plan.vllm_mxfp4_intermediate;
  VllmMxfp4Degrees d;
  d.module = "layers.*.mlp.experts";
  for (int64_t n : answer.degrees) {
    (VllmMxfp4SplitAt(intermediate, n).whole_groups() ? d.whole_groups : d.padded).push_back(n);
  }
  if (answer.requested && !BrokenConstraint(plan, *answer.requested)) {
    const VllmMxfp4Split split = VllmMxfp4SplitAt(intermediate, *answer.requested);
    if (std::optional<std::string> note = VllmMxfp4Note(d.module, split))
      answer.notes.push_back(*std::move(note));
    d.requested = split;
  }
  answer.vllm_mxfp4 = std::move(d);
}

}  // namespace

DegreeCombinations Combinations(const TpRegistry& registry, const ModelConfig& config,
                                const PlanOptions& options) {
  DegreeCombinations out;
  PlanOptions tp = options;
  tp.distributed.tp_size.reset();
  tp.distributed.ep_size.reset();
  tp.distributed.fsdp_size.reset();
  tp.distributed.enable_expert_parallel = false;
  const DegreeAnswer tp_answer = PlanDegree(ResolvePlan(registry, config, tp), std::nullopt);
  out.tp = tp_answer.degrees;
  if (options.engine != Engine::kTransformers) return out;
  PlanOptions ep = tp;
  ep.distributed.ep_size = 2;  // any size > 1: the EP plan over the TP ranks
  ep.distributed.tp_plan_given = true;
  const ModelPlan ep_plan = ResolvePlan(registry, config, ep);
  if (ep_plan.refusal) return out;
  out.tp_ep = PlanDegree(ep_plan, std::nullopt).degrees;
  return out;
}

DegreeAnswer PlanDegree(const ModelPlan& plan, std::optional<int64_t> requested) {
  DegreeAnswer answer;
  answer.requested = requested;
  answer.notes = plan.notes;
  if (plan.refusal) {
    answer.refusal = plan.refusal;
    return answer;
  }
  if (requested) {
    if (std::optional<PlanRefusal> r = DistributedRefusal(plan, *requested)) {
      answer.refusal = std::move(r);
      return answer;
    }
  }
  const std::vector<DegreeConstraint> constraints = DegreeConstraints(plan);
  for (const ResolvedEntry& e : plan.entries) {
    const bool binding = std::any_of(
        constraints.begin(), constraints.end(),
        [&](const DegreeConstraint& c) { return c.module == e.pattern && c.style == e.style; });
    if (e.count && binding) answer.constraints.push_back(e);
  }
  if (answer.constraints.empty()) {
    answer.refusal = PlanRefusal{
        "nothing_split", "the plan splits no weight reshard can count: it cannot answer for it"};
    return answer;
  }
  answer.degrees = WorkingDegrees(constraints);
  answer.max_tp_degree = answer.degrees.back();
  if (plan.vllm_mxfp4_intermediate) DescribeVllmMxfp4(plan, answer);
  if (requested) {
    const int64_t n = *requested;
    if (FirstBrokenConstraint(constraints, n)) {
      for (int64_t d : answer.degrees) {
        if (d >= n) {
          answer.chosen = d;
          break;
        }
      }
      const auto broken = std::find_if(constraints.begin(), constraints.end(),
                                       [&](const DegreeConstraint& c) { return !c.Allows(n); });
      const std::string consequence = BrokenDegreeConsequence(plan, *broken, n);
      answer.refusal =
          PlanRefusal{"degree_does_not_divide", DegreeRefusalMessage(constraints, n, consequence)};
    } else {
      answer.chosen = n;
    }
  } else if (*answer.max_tp_degree == 1) {
    std::vector<std::string> counts;
    for (const ResolvedEntry& e : answer.constraints) {
      std::string c = fmt::format("{} {}", *e.count, e.meaning);
      if (std::find(counts.begin(), counts.end(), c) == counts.end()) counts.push_back(c);
    }
    answer.refusal = PlanRefusal{
        "indivisible",
        fmt::format("no degree above 1 divides every count ({}): the model cannot be split by "
                    "tensor parallelism; spread it another way (pipeline or expert parallelism)",
                    fmt::join(counts, ", "))};
  }
  return answer;
}

}  // namespace reshard
