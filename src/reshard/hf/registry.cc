#include "reshard/hf/registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <regex>

namespace reshard {

class LoadRename::Compiled {
 public:
  explicit Compiled(const std::string& pattern) : regex_(pattern, std::regex::ECMAScript) {}
  const std::regex& regex() const { return regex_; }

 private:
  std::regex regex_;
};

namespace {

using Json = nlohmann::ordered_json;

// The compiled-in registry: adjacent raw string literals generated from tp_plans.json.
constexpr char kBuiltinJsonText[] =
#include "tp_plans_json.inc"
    ;

Result<Plan> ParsePlan(const Json& j, std::string_view path) {
  if (!j.is_object()) return InvalidArgumentError(fmt::format("{}: expected an object", path));
  Plan plan;
  for (const auto& [pattern, style] : j.items()) {
    if (!style.is_string())
      return InvalidArgumentError(fmt::format("{}[\"{}\"]: expected a style name", path, pattern));
    plan.push_back({pattern, style.get<std::string>()});
  }
  return plan;
}

Result<std::vector<std::string>> ParseStrings(const Json& j, std::string_view path) {
  if (!j.is_array()) return InvalidArgumentError(fmt::format("{}: expected an array", path));
  std::vector<std::string> out;
  for (const Json& s : j) {
    if (!s.is_string())
      return InvalidArgumentError(fmt::format("{}: expected an array of strings", path));
    out.push_back(s.get<std::string>());
  }
  return out;
}

Result<LoadConversion> ParseConversion(const Json& j, const std::string& path) {
  if (!j.is_object() || !j.contains("sources") || !j.contains("target") ||
      !j["target"].is_string() || !j.contains("operations")) {
    return InvalidArgumentError(
        fmt::format("{}: expected {{\"sources\", \"target\", \"operations\"}}", path));
  }
  LoadConversion c;
  RESHARD_ASSIGN_OR_RETURN(c.sources, ParseStrings(j["sources"], path + ".sources"));
  RESHARD_ASSIGN_OR_RETURN(c.operations, ParseStrings(j["operations"], path + ".operations"));
  c.target = j["target"].get<std::string>();
  return c;
}

Result<LoadRename> ParseRename(const Json& j, const std::string& path) {
  if (!j.is_object() || !j.contains("pattern") || !j["pattern"].is_string() ||
      !j.contains("replacement") || !j["replacement"].is_string()) {
    return InvalidArgumentError(fmt::format("{}: expected {{\"pattern\", \"replacement\"}}", path));
  }
  LoadRename r;
  r.pattern = j["pattern"].get<std::string>();
  r.replacement = j["replacement"].get<std::string>();
  // std::regex reports a malformed pattern only by throwing: caught here, the one place.
  try {
    r.compiled = std::make_shared<const LoadRename::Compiled>(r.pattern);
  } catch (const std::regex_error& e) {
    return InvalidArgumentError(fmt::format("{}.pattern: {} is not a regular expression ({})", path,
                                            j["pattern"].dump(), e.what()));
  }
  return r;
}

Result<InputEmbeddingRule> ParseInputEmbedding(const Json& j) {
  const std::string path = "plan registry: input_embedding";
  if (!j.is_object() || !j.contains("module") || !j["module"].is_string() || !j.contains("style") ||
      !j["style"].is_string() || !j.contains("applies") || !j["applies"].is_string()) {
    return InvalidArgumentError(
        fmt::format("{}: expected {{\"module\", \"style\", \"applies\"}}", path));
  }
  InputEmbeddingRule rule;
  rule.module = j["module"].get<std::string>();
  rule.style = j["style"].get<std::string>();
  const std::string applies = j["applies"].get<std::string>();
  if (applies != "always" && applies != "tied")
    return InvalidArgumentError(fmt::format("{}.applies: expected \"always\" or \"tied\"", path));
  rule.tied_only = applies == "tied";
  return rule;
}

Result<ModelTypeInfo> ParseModelType(const Json& j, const std::string& path) {
  if (!j.is_object()) return InvalidArgumentError(fmt::format("{}: expected an object", path));
  ModelTypeInfo info;
  for (const auto& [key, value] : j.items()) {
    const std::string at = fmt::format("{}.{}", path, key);
    if (key == "tp_plan") {
      RESHARD_ASSIGN_OR_RETURN(info.tp_plan, ParsePlan(value, at));
    } else if (key == "ep_plan") {
      RESHARD_ASSIGN_OR_RETURN(info.ep_plan, ParsePlan(value, at));
    } else if (key == "head_plan") {
      RESHARD_ASSIGN_OR_RETURN(info.head_plan, ParsePlan(value, at));
    } else if (key == "attribute_map") {
      RESHARD_ASSIGN_OR_RETURN(Plan aliases, ParsePlan(value, at));
      for (PlanEntry& e : aliases) info.attribute_map[e.pattern] = e.style;
    } else if (key == "defaults") {
      if (!value.is_object())
        return InvalidArgumentError(fmt::format("{}: expected an object", at));
      for (const auto& [name, v] : value.items()) {
        if (v.is_null()) {
          info.defaults[name] = std::nullopt;
        } else if (v.is_boolean()) {
          info.defaults[name] = v.get<bool>() ? 1 : 0;
        } else if (v.is_number_integer()) {
          info.defaults[name] = v.get<int64_t>();
        } else {
          return InvalidArgumentError(
              fmt::format("{}.{}: expected an integer, a boolean or null", at, name));
        }
      }
    } else if (key == "text_config") {
      if (!value.is_object() || !value.contains("key") || !value["key"].is_string() ||
          !value.contains("model_type") || !value["model_type"].is_string()) {
        return InvalidArgumentError(
            fmt::format("{}: expected {{\"key\": ..., \"model_type\": ...}}", at));
      }
      info.text_config_key = value["key"].get<std::string>();
      info.text_model_type = value["model_type"].get<std::string>();
    } else if (key == "embed_tokens") {
      if (!value.is_boolean())
        return InvalidArgumentError(fmt::format("{}: expected true or false", at));
      info.embed_tokens = value.get<bool>();
    } else if (key == "load_renames") {
      if (!value.is_array()) return InvalidArgumentError(fmt::format("{}: expected an array", at));
      for (size_t i = 0; i < value.size(); ++i) {
        RESHARD_ASSIGN_OR_RETURN(LoadRename r, ParseRename(value[i], fmt::format("{}[{}]", at, i)));
        info.load_renames.push_back(std::move(r));
      }
    } else if (key == "load_conversions") {
      if (!value.is_array()) return InvalidArgumentError(fmt::format("{}: expected an array", at));
      for (size_t i = 0; i < value.size(); ++i) {
        RESHARD_ASSIGN_OR_RETURN(LoadConversion c,
                                 ParseConversion(value[i], fmt::format("{}[{}]", at, i)));
        info.load_conversions.push_back(std::move(c));
      }
    } else {
      return InvalidArgumentError(fmt::format("{}: unknown key", at));
    }
  }
  return info;
}

}  // namespace

std::string ApplyLoadRenames(const std::vector<LoadRename>& renames, std::string_view name) {
  std::string out(name);
  for (const LoadRename& r : renames) {
    if (!r.compiled) continue;
    out = std::regex_replace(out, r.compiled->regex(), r.replacement,
                             std::regex_constants::format_first_only);
  }
  return out;
}

bool MatchesConversionSource(std::string_view pattern, std::string_view name) {
  // Anywhere in the name: try every start. `*` is any run; `\x` is x; other characters are
  // literal (transformers' patterns use `.` for the dot between name components).
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  const bool boundary = !pattern.empty() && word(pattern.back());
  // match(p, n): does pattern[p..] match a prefix of name[n..] ending at a boundary?
  auto match = [&](auto&& self, size_t p, size_t n) -> bool {
    if (p == pattern.size()) return !boundary || n == name.size() || !word(name[n]);
    if (pattern[p] == '*') {
      for (size_t k = n; k <= name.size(); ++k) {
        if (self(self, p + 1, k)) return true;
      }
      return false;
    }
    size_t q = p;
    if (pattern[q] == '\\' && q + 1 < pattern.size()) ++q;
    return n < name.size() && name[n] == pattern[q] && self(self, q + 1, n + 1);
  };
  for (size_t start = 0; start <= name.size(); ++start) {
    if (match(match, 0, start)) return true;
  }
  return false;
}

const ModelTypeInfo* TpRegistry::Find(std::string_view model_type) const {
  auto it = model_types.find(model_type);
  return it == model_types.end() ? nullptr : &it->second;
}

bool TpRegistry::IsRegistered(std::string_view style) const {
  return std::binary_search(styles.begin(), styles.end(), style);
}

Result<TpRegistry> ParseTpRegistryJson(std::string_view text) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("plan registry: not valid JSON");
  if (!j.is_object()) return InvalidArgumentError("plan registry: expected an object");
  TpRegistry reg;
  if (!j.contains("transformers_version") || !j["transformers_version"].is_string())
    return InvalidArgumentError("plan registry: transformers_version: expected a string");
  reg.transformers_version = j["transformers_version"].get<std::string>();
  if (j.contains("load_renames")) {
    if (!j["load_renames"].is_array())
      return InvalidArgumentError("plan registry: load_renames: expected an array");
    for (size_t i = 0; i < j["load_renames"].size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(
          LoadRename r,
          ParseRename(j["load_renames"][i], fmt::format("plan registry: load_renames[{}]", i)));
      reg.load_renames.push_back(std::move(r));
    }
  }
  if (j.contains("input_embedding")) {
    RESHARD_ASSIGN_OR_RETURN(reg.input_embedding, ParseInputEmbedding(j["input_embedding"]));
  }
  if (!j.contains("styles")) return InvalidArgumentError("plan registry: styles: missing");
  RESHARD_ASSIGN_OR_RETURN(reg.styles, ParseStrings(j["styles"], "plan registry: styles"));
  std::sort(reg.styles.begin(), reg.styles.end());
  if (j.contains("distributed_config_keys")) {
    RESHARD_ASSIGN_OR_RETURN(
        reg.distributed_config_keys,
        ParseStrings(j["distributed_config_keys"], "plan registry: distributed_config_keys"));
  }
  if (!j.contains("model_types") || !j["model_types"].is_object())
    return InvalidArgumentError("plan registry: model_types: expected an object");
  for (const auto& [model_type, entry] : j["model_types"].items()) {
    RESHARD_ASSIGN_OR_RETURN(
        ModelTypeInfo info,
        ParseModelType(entry, fmt::format("plan registry: model_types[\"{}\"]", model_type)));
    reg.model_types.emplace(model_type, std::move(info));
  }
  return reg;
}

std::string_view BuiltinTpRegistryJson() {
  return std::string_view(kBuiltinJsonText, sizeof(kBuiltinJsonText) - 1);
}

const TpRegistry& BuiltinTpRegistry() {
  static const TpRegistry* registry = [] {
    Result<TpRegistry> parsed = ParseTpRegistryJson(BuiltinTpRegistryJson());
    // The file is generated and checked by tests; a broken one is a build defect.
    if (!parsed.ok()) {
      fmt::print(stderr, "reshard: the built-in plan registry is corrupt: {}\n",
                 parsed.status().message());
      std::abort();
    }
    return new TpRegistry(std::move(*parsed));
  }();
  return *registry;
}

Result<StyleEffect> ResolveStyle(const TpRegistry& registry, std::string_view style) {
  if (!registry.IsRegistered(style)) {
    return FailedPreconditionError(
        fmt::format("style \"{}\" is not registered in transformers {} (registered: {})", style,
                    registry.transformers_version, fmt::join(registry.styles, ", ")));
  }
  static const std::map<std::string_view, StyleEffect, std::less<>> kEffects = {
      {"colwise", StyleEffect::kSplitOut},
      {"colwise_gather_output", StyleEffect::kSplitOut},
      {"colwise_rep", StyleEffect::kSplitOut},
      {"rowwise", StyleEffect::kSplitIn},
      {"rowwise_split_input", StyleEffect::kSplitIn},
      {"rowwise_rep", StyleEffect::kSplitIn},
      {"packed_colwise", StyleEffect::kPackedOut},
      {"packed_rowwise", StyleEffect::kPackedIn},
      {"embedding_rowwise", StyleEffect::kEmbeddingVocab},
      {"embedding_colwise", StyleEffect::kEmbeddingHidden},
      {"grouped_gemm", StyleEffect::kExperts},
      {"ep_router", StyleEffect::kExperts},
      {"replicate", StyleEffect::kNone},
      {"replicated_with_grad_allreduce", StyleEffect::kNone},
      {"sequence_parallel", StyleEffect::kNone},
      {"all_reduce", StyleEffect::kNone},
      {"moe_tp_experts", StyleEffect::kNone},
      {"moe_identity_expert", StyleEffect::kNone},
      {"ep_dispatch_experts", StyleEffect::kNone},
      {"local_params", StyleEffect::kNone},
      {"mla_kv_a_proj", StyleEffect::kNone},
  };
  auto it = kEffects.find(style);
  if (it == kEffects.end()) {
    return FailedPreconditionError(fmt::format(
        "style \"{}\" is registered in transformers {} but reshard does not know how it lays "
        "out weights; add it to ResolveStyle (src/reshard/hf/registry.cc)",
        style, registry.transformers_version));
  }
  return it->second;
}

}  // namespace reshard
