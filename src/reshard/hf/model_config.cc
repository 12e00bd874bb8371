#include "reshard/hf/model_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/json_reader.h"
#include "reshard/hf/quantization.h"

namespace reshard {

namespace {

// The strict reader: duplicate keys and trailing bytes are refused. Its DOM sorts object keys,
// so a distributed config's plan overrides are merged in key order, not file order (order
// changes no count).
using Json = json::Json;
using Values = std::map<std::string, std::optional<int64_t>>;

// The config keys the counts are read from (scripts/gen_tp_plans.py records their defaults).
constexpr std::string_view kCountKeys[] = {
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "intermediate_size_mlp",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "tie_word_embeddings",
    "num_shared_experts",
    "moe_num_shared_experts",
    "moe_shared_expert_intermediate_size",
};

// Keys that only some config classes declare. A stray one in another model's config.json stays
// an attribute of its config, but that model's code never reads it (Mixtral's experts are
// intermediate_size wide whatever moe_intermediate_size says): for a known model type they are
// read only where the class declares them (scripts/gen_tp_plans.py records that as a default).
constexpr std::string_view kDeclaredOnlyKeys[] = {
    "intermediate_size_mlp",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "moe_shared_expert_intermediate_size",
};

// Counts a model cannot have zero of: a config saying 0 (or, for the first four, null) is
// refused rather than answered for. Null key/value heads and head_dim are derived by the config
// class (as many as the attention heads; hidden size / heads).
constexpr std::string_view kPositiveKeys[] = {
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size_mlp",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
};
constexpr size_t kNotNullKeys = 4;  // the first four of kPositiveKeys

// The largest count read: a count beyond it is no model's.
constexpr int64_t kMaxCount = int64_t{1} << 62;

// One count key's value: an integer (booleans 0/1) or null where the config derives it.
Result<std::optional<int64_t>> ReadCount(const Json& value, std::string_view key,
                                         std::string_view at) {
  const auto positive = std::find(std::begin(kPositiveKeys), std::end(kPositiveKeys), key);
  const bool must_be_positive = positive != std::end(kPositiveKeys);
  if (value.is_null()) {
    if (must_be_positive && positive - std::begin(kPositiveKeys) < std::ptrdiff_t{kNotNullKeys})
      return InvalidArgumentError(fmt::format("{}: expected a positive integer, got null", at));
    return std::optional<int64_t>();
  }
  if (value.is_boolean()) return std::optional<int64_t>(value.get<bool>() ? 1 : 0);
  if (!value.is_number_integer())
    return InvalidArgumentError(fmt::format("{}: expected an integer, got {}", at, value.dump()));
  if (value.is_number_unsigned() ? value.get<uint64_t>() > uint64_t{kMaxCount}
                                 : value.get<int64_t>() > kMaxCount) {
    return InvalidArgumentError(
        fmt::format("{}: {} is out of range (at most 2^62)", at, value.dump()));
  }
  const int64_t v = value.get<int64_t>();
  if (v < 0 || (v == 0 && must_be_positive)) {
    return InvalidArgumentError(fmt::format("{}: expected a {} integer, got {}", at,
                                            must_be_positive ? "positive" : "non-negative", v));
  }
  return std::optional<int64_t>(v);
}

Result<Values> ReadValues(const Json& object, const ModelTypeInfo* info, std::string_view path) {
  Values values;
  for (std::string_view key_view : kCountKeys) {
    const std::string key(key_view);
    if (info != nullptr && !info->defaults.contains(key) &&
        std::find(std::begin(kDeclaredOnlyKeys), std::end(kDeclaredOnlyKeys), key) !=
            std::end(kDeclaredOnlyKeys)) {
      continue;
    }
    std::string stored = key;
    if (info != nullptr) {
      if (auto it = info->attribute_map.find(key); it != info->attribute_map.end())
        stored = it->second;
    }
    const Json* found = nullptr;
    if (object.contains(stored)) {
      found = &object[stored];
    } else if (object.contains(key)) {
      found = &object[key];
    }
    if (found == nullptr) {
      if (info != nullptr) {
        if (auto it = info->defaults.find(key); it != info->defaults.end())
          values[key] = it->second;
      }
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(values[key],
                             ReadCount(*found, key, fmt::format("{}{}", path, stored)));
  }
  return values;
}

// One factor of a width the degree planner derives: its config key and value.
struct Factor {
  std::string_view key;
  int64_t value;
};

// The product of `factors` (each `multiple` times its value, summed) times `last`, refused
// when it is more than 2^62 elements: such a config describes no model, and the planner's
// arithmetic on it would overflow.
Status CheckWidth(std::string_view path, std::initializer_list<std::pair<int64_t, Factor>> terms,
                  std::optional<Factor> last) {
  Index sum = 0;
  std::vector<std::string> named;
  for (const auto& [multiple, f] : terms) {
    named.push_back(multiple == 1 ? fmt::format("{}{} ({})", path, f.key, f.value)
                                  : fmt::format("{} x {}{} ({})", multiple, path, f.key, f.value));
    const std::optional<Index> times = CheckedMul(multiple, f.value);
    const std::optional<Index> next = times ? CheckedAdd(sum, *times) : std::nullopt;
    sum = next.value_or(-1);
    if (!next) break;
  }
  std::string what = fmt::format("{}", fmt::join(named, " + "));
  std::optional<Index> total = sum < 0 ? std::nullopt : std::optional<Index>(sum);
  if (last) {
    what = fmt::format("{}{} ({}) x {}", path, last->key, last->value,
                       named.size() > 1 ? "(" + what + ")" : what);
    if (total) total = CheckedMul(*total, last->value);
  }
  if (total) return Status::Ok();
  return InvalidArgumentError(fmt::format(
      "{} is more than 2^62 features: the config's counts are out of range for any model", what));
}

// The widths the degree planner forms from the counts (degree.cc, degree_blocks.cc): attention
// heads times head_dim, the MLP widths times two (gate and up) and times the dtype's bytes,
// the shared experts' width times their count, four times the hidden size.
Status CheckDerivedWidths(const Values& v, std::string_view path) {
  const auto get = [&](std::string_view key) -> std::optional<Factor> {
    const std::optional<int64_t> value = ConfigValue(v, key);
    if (!value) return std::nullopt;
    return Factor{key, *value};
  };
  const std::optional<Factor> heads = get("num_attention_heads");
  const std::optional<Factor> kv = get("num_key_value_heads");
  std::optional<Factor> head_dim = get("head_dim");
  const std::optional<Factor> hidden = get("hidden_size");
  if (!head_dim && heads && heads->value > 0 && hidden) {
    head_dim = Factor{"hidden_size / num_attention_heads", hidden->value / heads->value};
  }
  if (heads && kv) {
    RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{1, *heads}, {2, *kv}}, head_dim));
  } else if (heads || kv) {
    RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{3, heads ? *heads : *kv}}, head_dim));
  }
  if (hidden) RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{4, *hidden}}, std::nullopt));
  const std::optional<Factor> bytes = get("dtype_bytes");
  for (std::string_view key :
       {"intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
        "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"}) {
    const std::optional<Factor> width = get(key);
    if (!width) continue;
    RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{2, *width}}, std::nullopt));
    if (bytes) RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{1, *width}}, bytes));
  }
  if (const std::optional<Factor> moe = get("moe_intermediate_size")) {
    for (std::string_view key :
         {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}) {
      if (const std::optional<Factor> count = get(key)) {
        RESHARD_RETURN_IF_ERROR(CheckWidth(path, {{1, *moe}}, count));
      }
    }
  }
  return Status::Ok();
}

Result<Plan> ParsePlanObject(const Json& j, std::string_view key) {
  Plan plan;
  for (const auto& [pattern, style] : j.items()) {
    if (!style.is_string()) {
      return InvalidArgumentError(
          fmt::format("distributed config: {}[\"{}\"]: expected a style name, got {}", key, pattern,
                      style.dump()));
    }
    plan.push_back({pattern, style.get<std::string>()});
  }
  return plan;
}

// The element size of a config's dtype ("float32", "bfloat16", "torch.float16", ...), or
// nullopt when it names none reshard knows.
std::optional<int64_t> DtypeBytes(const Json& object) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!object.contains(key) || !object[key].is_string()) continue;
    std::string name = object[key].get<std::string>();
    if (name.starts_with("torch.")) name = name.substr(6);
    if (name == "float32" || name == "float") return 4;
    if (name == "bfloat16" || name == "float16" || name == "half") return 2;
    if (name == "float64" || name == "double") return 8;
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> ConfigValue(const Values& values, std::string_view key) {
  auto it = values.find(std::string(key));
  if (it == values.end()) return std::nullopt;
  return it->second;
}

Result<Version> ParseVersion(std::string_view text) {
  Version v;
  int* fields[] = {&v.major, &v.minor, &v.patch};
  size_t i = 0;
  int n = 0;
  while (n < 3) {
    size_t start = i;
    int64_t value = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) &&
           value < 1'000'000) {
      value = value * 10 + (text[i] - '0');
      ++i;
    }
    if (i == start) break;
    *fields[n++] = static_cast<int>(value);
    if (i < text.size() && text[i] == '.' && i + 1 < text.size() &&
        std::isdigit(static_cast<unsigned char>(text[i + 1]))) {
      ++i;
    } else {
      break;
    }
  }
  if (n == 0) {
    return InvalidArgumentError(
        fmt::format("\"{}\" is not a release number (expected e.g. 5.15 or 4.57.1)", text));
  }
  return v;
}

Result<DistributedConfig> ParseDistributedConfigJson(const TpRegistry& registry,
                                                     std::string_view text) {
  Result<Json> parsed = json::ParseJson(text);
  if (!parsed.ok()) return parsed.status().Annotate("distributed config");
  const Json& j = *parsed;
  if (!j.is_object()) {
    return InvalidArgumentError(
        "distributed config: expected a JSON object, e.g. {\"tp_size\": 4}");
  }
  std::vector<std::string> unknown;
  for (const auto& [key, value] : j.items()) {
    if (std::find(registry.distributed_config_keys.begin(), registry.distributed_config_keys.end(),
                  key) == registry.distributed_config_keys.end())
      unknown.push_back(key);
  }
  if (!unknown.empty()) {
    return InvalidArgumentError(fmt::format(
        "distributed config: unknown key(s) \"{}\"; transformers {}'s DistributedConfig accepts "
        "{} (its from_dict would drop the others silently, and the model would be split in a "
        "way you did not ask for). Fix the spelling or remove them.",
        fmt::join(unknown, "\", \""), registry.transformers_version,
        fmt::join(registry.distributed_config_keys, ", ")));
  }
  DistributedConfig config;
  for (const auto& [key, value] : j.items()) {
    if (key == "tp_size" || key == "ep_size" || key == "pp_size" || key == "fsdp_size" ||
        key == "dp_replicate_size") {
      if (value.is_null()) continue;
      if (!value.is_number_integer() || value.get<int64_t>() < 1) {
        return InvalidArgumentError(fmt::format(
            "distributed config: {}: expected a positive integer, got {}", key, value.dump()));
      }
      if (key == "tp_size") config.tp_size = value.get<int64_t>();
      if (key != "tp_size" && key != "ep_size" && value.get<int64_t>() != 1) {
        config.not_laid_out.push_back(fmt::format("{} {}", key, value.get<int64_t>()));
      }
      if (key == "ep_size") config.ep_size = value.get<int64_t>();
      if (key == "fsdp_size") config.fsdp_size = value.get<int64_t>();
    } else if (key == "enable_expert_parallel" || key == "enable_sequence_parallel" ||
               key == "fsdp_cpu_offload" || key == "fsdp_mixed_precision") {
      if (!value.is_boolean()) {
        return InvalidArgumentError(fmt::format(
            "distributed config: {}: expected true or false, got {}", key, value.dump()));
      }
      if (key == "enable_expert_parallel") config.enable_expert_parallel = value.get<bool>();
      if (key != "enable_expert_parallel" && value.get<bool>()) {
        config.not_laid_out.push_back(key + " true");
      }
    } else if (key == "tp_plan" || key == "ep_plan") {
      if (value.is_null()) continue;
      if (key == "tp_plan") config.tp_plan_given = true;
      if (key == "tp_plan" && value == "auto") continue;
      if (!value.is_object()) {
        return InvalidArgumentError(
            fmt::format("distributed config: {}: expected an object of module -> style{}, got {}",
                        key, key == "tp_plan" ? ", \"auto\" or null" : " or null", value.dump()));
      }
      RESHARD_ASSIGN_OR_RETURN(Plan plan, ParsePlanObject(value, key));
      (key == "tp_plan" ? config.tp_plan : config.ep_plan) = std::move(plan);
    } else if (key == "fsdp_plan" && !value.is_null()) {
      config.not_laid_out.push_back(key);
    }
  }
  return config;
}

Result<ModelConfig> ReadModelConfigJson(const TpRegistry& registry, std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(const Json j, json::ParseJson(text));
  if (!j.is_object()) return InvalidArgumentError("expected a JSON object (a config.json)");
  if (!j.contains("model_type") || !j["model_type"].is_string()) {
    return InvalidArgumentError(
        "model_type: missing or not a string (a transformers config.json names its model type)");
  }
  ModelConfig config;
  config.model_type = j["model_type"].get<std::string>();
  config.info = registry.Find(config.model_type);
  RESHARD_ASSIGN_OR_RETURN(config.values, ReadValues(j, config.info, ""));
  const std::optional<int64_t> dtype_bytes = DtypeBytes(j);
  if (dtype_bytes) config.values["dtype_bytes"] = dtype_bytes;
  RESHARD_RETURN_IF_ERROR(CheckDerivedWidths(config.values, ""));
  // Block rules (degree_blocks.cc) apply to the FP8 block formats; other quantization
  // configs are the checkpoint readers' to refuse.
  if (Result<std::optional<QuantScheme>> q = ReadQuantScheme(text); q.ok() && *q) {
    if ((*q)->format == QuantFormat::kFp8Block) config.fp8_block = (*q)->block;
    config.mxfp4 = (*q)->format == QuantFormat::kMxfp4;
  }
  if (config.info != nullptr && !config.info->text_config_key.empty()) {
    const std::string& key = config.info->text_config_key;
    Json sub = j.contains(key) && j[key].is_object() ? j[key] : Json::object();
    config.text_model_type = sub.contains("model_type") && sub["model_type"].is_string()
                                 ? sub["model_type"].get<std::string>()
                                 : config.info->text_model_type;
    config.text_info = registry.Find(config.text_model_type);
    RESHARD_ASSIGN_OR_RETURN(config.text_values, ReadValues(sub, config.text_info, key + "."));
    const std::optional<int64_t> sub_bytes = DtypeBytes(sub);
    if (sub_bytes || dtype_bytes)
      config.text_values["dtype_bytes"] = sub_bytes ? sub_bytes : dtype_bytes;
    RESHARD_RETURN_IF_ERROR(CheckDerivedWidths(config.text_values, key + "."));
  }
  return config;
}

}  // namespace reshard
