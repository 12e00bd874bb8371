// The tensor-parallel plan registry: transformers' plans and parallel styles, as data.
//
// `scripts/gen_tp_plans.py` reads the installed transformers package and writes
// `tp_plans.json` beside this header; the build compiles that file into the library, so the
// planner answers without Python. Its JSON form:
//
//   {"transformers_version": "5.24.0",
//    "input_embedding": {"module": "embed_tokens", "style": "embedding_rowwise",
//                        "applies": "always"}?,       added to a base model's plan ("tied":
//                                                     only for tied word embeddings)
//    "load_renames": [{"pattern", "replacement"}]?,   renamings applied to every model at load
//    "styles": ["colwise", "rowwise", ...],           every style transformers registers
//    "distributed_config_keys": ["tp_size", ...],     DistributedConfig's fields
//    "model_types": {"llama": {
//        "tp_plan": {"layers.*.self_attn.q_proj": "colwise", ...},   base_model_tp_plan
//        "ep_plan": {...}?,                                          base_model_ep_plan
//        "head_plan": {"lm_head": "colwise_gather_output"}?,         the LM-head class's plan
//        "attribute_map": {"num_attention_heads": "n_head"}?,        config.json aliases
//        "defaults": {"vocab_size": 32000, "num_key_value_heads": null, ...},
//        "text_config": {"key": "text_config", "model_type": "llama4_text"}?,
//        "embed_tokens": true?,                     the base model has an nn.Embedding of
//                                                   that name
//        "load_renames": [{"pattern": "^transformer\\.h\\.", "replacement": "model.layers."}]?,
//        "load_conversions": [{"sources": ["mlp.experts.*.gate_proj.weight", ...],
//                              "target": "mlp.experts.gate_up_proj",
//                              "operations": ["MergeModulelist", "Concatenate"]}]?}}}
//
// Plans keep their order (transformers applies them as dicts, in insertion order).
//
// One registry of styles serves the degree planner and the model-map generator: both call
// `ResolveStyle`, so they accept and refuse exactly the same style names.
#ifndef RESHARD_HF_REGISTRY_H_
#define RESHARD_HF_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// One entry of a plan: a module or parameter pattern (`*` for a layer index) and its style.
struct PlanEntry {
  std::string pattern;
  std::string style;
  friend bool operator==(const PlanEntry&, const PlanEntry&) = default;
};
using Plan = std::vector<PlanEntry>;

/// A conversion transformers applies to checkpoint tensors when it loads them: the tensors
/// matching `sources` become `target` through `operations` (stacking experts, concatenating,
/// splitting, permuting). Patterns are matched as transformers matches them: anywhere in the
/// name, `*` standing for any run of characters, ending at a name boundary.
struct LoadConversion {
  std::vector<std::string> sources;
  std::string target;
  std::vector<std::string> operations;
};

/// A renaming transformers applies to checkpoint tensor names when it loads them (before it
/// matches its plan): the first match of `pattern` (an ECMAScript regular expression) becomes
/// `replacement` (`$1` for the first group).
struct LoadRename {
  class Compiled;
  std::string pattern;
  std::string replacement;
  std::shared_ptr<const Compiled> compiled;  // set by the registry reader
};

/// `name` after each renaming in turn, as transformers renames checkpoint keys at load.
std::string ApplyLoadRenames(const std::vector<LoadRename>& renames, std::string_view name);

/// Whether `name` matches a load-conversion source pattern.
bool MatchesConversionSource(std::string_view pattern, std::string_view name);

/// The entry transformers adds to a base model's plan for its input embedding.
struct InputEmbeddingRule {
  std::string module = "embed_tokens";
  std::string style = "embedding_rowwise";
  bool tied_only = false;  // "applies": "tied" (else "always")
};

struct ModelTypeInfo {
  Plan tp_plan;
  Plan ep_plan;
  Plan head_plan;
  /// Standard key -> the key config.json stores it under.
  std::map<std::string, std::string> attribute_map;
  /// The config class's defaults (booleans as 0/1); nullopt for a default of None, which the
  /// config class derives (key/value heads = attention heads, head_dim = hidden / heads).
  std::map<std::string, std::optional<int64_t>> defaults;
  std::string text_config_key;  // composite models: the sub-config holding the text model
  std::string text_model_type;
  /// The base model holds an nn.Embedding named like InputEmbeddingRule::module.
  bool embed_tokens = false;
  std::vector<LoadRename> load_renames;
  std::vector<LoadConversion> load_conversions;
};

struct TpRegistry {
  std::string transformers_version;
  std::optional<InputEmbeddingRule> input_embedding;
  /// Renamings transformers applies to every model's checkpoint after the model type's own.
  std::vector<LoadRename> load_renames;
  std::vector<std::string> styles;  // sorted
  std::vector<std::string> distributed_config_keys;
  std::map<std::string, ModelTypeInfo, std::less<>> model_types;

  const ModelTypeInfo* Find(std::string_view model_type) const;
  bool IsRegistered(std::string_view style) const;
};

/// Parses the registry JSON; InvalidArgument with the JSON path for anything malformed.
Result<TpRegistry> ParseTpRegistryJson(std::string_view text);

/// The registry compiled into the binary (src/reshard/hf/tp_plans.json).
const TpRegistry& BuiltinTpRegistry();
std::string_view BuiltinTpRegistryJson();

/// What a style does to the weights of the module it names.
enum class StyleEffect {
  kNone,             // replicated, or communication only: contributes no count
  kSplitOut,         // Linear weight split on its output dim (ndim-2), bias split too
  kSplitIn,          // Linear weight split on its input dim (ndim-1), bias replicated
  kPackedOut,        // fused gate/up weight: each half split on the output dim
  kPackedIn,         // fused weight: each half split on the input dim
  kEmbeddingVocab,   // embedding rows (the vocabulary) split
  kEmbeddingHidden,  // embedding columns (the hidden size) split
  kExperts,          // the expert dimension (dim 0) split
};

/// The effect of `style` under `registry`. FailedPrecondition when transformers does not
/// register the style (it would fail at load), or when reshard does not know the effect of a
/// registered style. The one gate the planner and the map generator share.
Result<StyleEffect> ResolveStyle(const TpRegistry& registry, std::string_view style);

}  // namespace reshard

#endif  // RESHARD_HF_REGISTRY_H_
