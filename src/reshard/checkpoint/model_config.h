// Internal to the checkpoint readers' .cc files (it takes nlohmann/json through
// base/json_reader.h): what the readers that lay a framework's tensors out from a Hugging Face
// config.json (Megatron, MaxText) share in reading it.
#ifndef RESHARD_CHECKPOINT_MODEL_CONFIG_H_
#define RESHARD_CHECKPOINT_MODEL_CONFIG_H_

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>

#include "reshard/base/index.h"
#include "reshard/base/json_reader.h"
#include "reshard/base/result.h"

namespace reshard::internal {

/// Whether a space-separated list of words holds `word` ("llama mistral qwen3", "qwen3").
inline bool WordListHolds(std::string_view list, std::string_view word) {
  while (!list.empty()) {
    const size_t space = list.find(' ');
    if (list.substr(0, space) == word) return true;
    if (space == std::string_view::npos) break;
    list.remove_prefix(space + 1);
  }
  return false;
}

/// The attention's shape in a config.json: query and key/value head counts and the width of a
/// head.
struct AttentionHeads {
  Index heads = 0;
  Index kv_heads = 0;
  Index head_dim = 0;
};

/// The positive integers of a config.json object `j` (read from `what`) that a layout (named
/// in messages: "the Megatron layout") is built from.
class ConfigInts {
 public:
  ConfigInts(const json::Json& j, std::string_view what, std::string_view layout)
      : j_(j), what_(what), layout_(layout) {}

  /// The key's value; nullopt when it is absent or null; InvalidArgument when it is there but
  /// no positive integer.
  Result<std::optional<Index>> Optional(std::string_view key) const {
    const json::Json* v = json::Find(j_, key);
    if (v == nullptr || v->is_null()) return std::optional<Index>();
    RESHARD_ASSIGN_OR_RETURN(Index n, json::ReadInt(*v, json::Member(what_, key), json::kPositive));
    return std::optional<Index>(n);
  }

  /// As Optional, and InvalidArgument naming the layout when the key is absent.
  Result<Index> Required(std::string_view key) const {
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> n, Optional(key));
    if (!n) {
      return InvalidArgumentError(
          fmt::format("{}: \"{}\" is missing ({} needs it)", what_, key, layout_));
    }
    return *n;
  }

  /// num_attention_heads; num_key_value_heads (num_attention_heads when absent); head_dim
  /// (hidden / num_attention_heads when absent, which must then divide).
  Result<AttentionHeads> Heads(Index hidden) const {
    AttentionHeads h;
    RESHARD_ASSIGN_OR_RETURN(h.heads, Required("num_attention_heads"));
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> kv, Optional("num_key_value_heads"));
    h.kv_heads = kv.value_or(h.heads);
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> head_dim, Optional("head_dim"));
    if (!head_dim && hidden % h.heads != 0) {
      return InvalidArgumentError(fmt::format(
          "{}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given",
          what_, hidden, h.heads));
    }
    h.head_dim = head_dim.value_or(hidden / h.heads);
    return h;
  }

 private:
  const json::Json& j_;
  std::string what_;
  std::string layout_;
};

}  // namespace reshard::internal

#endif  // RESHARD_CHECKPOINT_MODEL_CONFIG_H_
