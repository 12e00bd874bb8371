// The layout table: which Hugging Face tensor each MaxText parameter holds, and how its elements
// lie (data, not code per model). Internal to checkpoint/orbax.
#ifndef RESHARD_CHECKPOINT_ORBAX_MAXTEXT_NAMES_H_
#define RESHARD_CHECKPOINT_ORBAX_MAXTEXT_NAMES_H_

#include <span>
#include <string_view>

namespace reshard::maxtext {

/// Where a parameter lies: the whole model (`token_embedder.embedding`), or a decoder layer
/// (`decoder.layers.<leaf>` stacked on the scan axis, or `decoder.layers_{l}.<leaf>`).
enum class Scope { kModel, kLayer };

/// When a rule applies.
enum class When {
  kAlways,
  kUntied,  // only when config.json's tie_word_embeddings is false (MaxText's logits_dense)
};

struct LayoutRule {
  /// config.json model_type values it applies to, space-separated.
  std::string_view families;
  Scope scope;
  /// MaxText's leaf: its path after the model tree's root (model scope) or after the layer's
  /// prefix (layer scope), joined with ".".
  std::string_view maxtext;
  /// The MaxText array's shape (one layer's, without the scan axis) and the Hugging Face
  /// tensor's: dimensions separated by ",", each a row-major product of factors joined by "*".
  /// Every factor appears once on each side; the element at factor coordinates x lies at the
  /// same x on both sides. Factors, from config.json: H hidden_size, N num_attention_heads,
  /// K num_key_value_heads, D head_dim, P head_dim / 2 and R 2 (a rotary pair: MaxText's
  /// interleaved d = 2p + r is Hugging Face's half-split d = r * D/2 + p), F intermediate_size,
  /// V vocab_size.
  std::string_view maxtext_dims;
  std::string_view hf_dims;
  /// The Hugging Face name: within `model.layers.{l}.` for layer scope.
  std::string_view hf;
  /// MaxText holds the Hugging Face value times this factor: "" (1), or "1/sqrt(D)" (the query
  /// kernel, which carries attention's 1/sqrt(head_dim) in MaxText's Llama).
  std::string_view scale;
  When when = When::kAlways;
};

/// Every rule, in the order the Hugging Face tensors are listed (within a layer).
std::span<const LayoutRule> LayoutRules();

/// The model_type values some rule applies to, space-separated, for messages.
std::string_view KnownFamilies();

}  // namespace reshard::maxtext

#endif  // RESHARD_CHECKPOINT_ORBAX_MAXTEXT_NAMES_H_
