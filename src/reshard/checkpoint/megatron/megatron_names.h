// The name table: which Hugging Face tensor each Megatron-Core dist-ckpt key holds (data, not
// code per model). Internal to checkpoint/megatron.
#ifndef RESHARD_CHECKPOINT_MEGATRON_MEGATRON_NAMES_H_
#define RESHARD_CHECKPOINT_MEGATRON_MEGATRON_NAMES_H_

#include <span>
#include <string_view>

namespace reshard::megatron {

/// Which part of a Megatron tensor a Hugging Face tensor is. Fused parts split dim 0 (of the
/// tensor without its stacked layer and expert dims).
enum class Part {
  kWhole,
  kQ,      // linear_qkv: the query heads of every group
  kK,      // the key head of every group
  kV,      // the value head of every group
  kGate,   // linear_fc1 of a gated MLP: the first half of the rows
  kUp,     // the second half
  kVocab,  // the first vocab_size rows (the rest is padding)
};

/// Where a key lies: the whole model, a layer (`decoder.layers.[{l}.]`), or an expert of a
/// layer (`decoder.layers.[{l}.]mlp.experts.experts.[{e}.]`).
enum class Scope { kModel, kLayer, kExpert };

struct NameRule {
  Scope scope;
  /// The key after its scope's prefix.
  std::string_view leaf;
  Part part;
  /// The Megatron tensor's shape (without stacked dims), comma-separated symbols from the
  /// config: H hidden_size, D head_dim, A heads * head_dim, QKV (heads + 2 * key/value heads) *
  /// head_dim, F intermediate_size, I the experts' intermediate size, S the shared experts', a
  /// leading 2 for two of them (2F), E experts, V the vocabulary (padded: any size >= vocab_size),
  /// R a LoRA adapter's rank, 1. Several rules of one leaf with part kWhole are copies: each
  /// Hugging Face tensor holds the whole Megatron tensor.
  std::string_view shape;
  /// The Hugging Face name: within `model.layers.{l}.` for layer scope, within
  /// `model.layers.{l}.{moe}.experts.{e}.` for expert scope; {moe}, {w1}, {w3}, {w2}, {shared}
  /// are the family's (NameFamily).
  std::string_view hf;
};

/// Every rule, in the order the HF tensors are listed.
std::span<const NameRule> NameRules();

/// How a family names its MoE tensors.
struct NameFamily {
  std::string_view model_types;  // space-separated config.json model_type values; "" default
  std::string_view moe;          // the MoE block: "mlp" or "block_sparse_moe"
  std::string_view w1, w3, w2;   // an expert's gate, up and down projections
  std::string_view shared;       // the shared experts' module
};

/// The family of a config.json model_type (the default family for any other).
const NameFamily& FamilyOf(std::string_view model_type);

}  // namespace reshard::megatron

#endif  // RESHARD_CHECKPOINT_MEGATRON_MEGATRON_NAMES_H_
