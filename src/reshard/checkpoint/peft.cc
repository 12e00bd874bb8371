#include "reshard/checkpoint/peft.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

namespace reshard {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kPrefix = "base_model.model.";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

Result<std::vector<std::string>> StringList(const Json& doc, const char* key) {
  std::vector<std::string> out;
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return out;
  if (!it->is_array()) {
    return InvalidArgumentError(fmt::format("{}: expected a list of module names", key));
  }
  for (const Json& v : *it) {
    if (!v.is_string()) {
      return InvalidArgumentError(fmt::format("{}: expected a list of module names", key));
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

bool Flag(const Json& doc, const char* key) {
  auto it = doc.find(key);
  return it != doc.end() && it->is_boolean() && it->get<bool>();
}

bool NonEmptyObject(const Json& doc, const char* key) {
  auto it = doc.find(key);
  return it != doc.end() && it->is_object() && !it->empty();
}

}  // namespace

double LoraConfig::Scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

std::string_view LoraConfig::ScalingRule() const {
  return use_rslora ? "alpha/sqrt(r)" : "alpha/r";
}

Result<LoraConfig> ParseLoraConfigJson(std::string_view text) {
  const Json doc = Json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    return InvalidArgumentError(fmt::format("{} is not a JSON object", kAdapterConfigName));
  }
  auto type = doc.find("peft_type");
  if (type == doc.end() || !type->is_string() || type->get<std::string>() != "LORA") {
    return InvalidArgumentError(
        fmt::format("{}: peft_type is {}, not \"LORA\": only LoRA adapters are read",
                    kAdapterConfigName, type == doc.end() ? std::string("missing") : type->dump()));
  }
  LoraConfig c;
  auto r = doc.find("r");
  if (r == doc.end() || !r->is_number_integer() || r->get<int64_t>() < 1) {
    return InvalidArgumentError(
        fmt::format("{}: r must be a positive integer", kAdapterConfigName));
  }
  c.r = r->get<int64_t>();
  auto alpha = doc.find("lora_alpha");
  if (alpha == doc.end() || !alpha->is_number() || !(alpha->get<double>() > 0) ||
      !std::isfinite(alpha->get<double>())) {
    return InvalidArgumentError(
        fmt::format("{}: lora_alpha must be a positive number", kAdapterConfigName));
  }
  c.alpha = alpha->get<double>();
  c.use_rslora = Flag(doc, "use_rslora");
  c.use_dora = Flag(doc, "use_dora");
  c.lora_bias = Flag(doc, "lora_bias");
  c.fan_in_fan_out = Flag(doc, "fan_in_fan_out");
  c.has_patterns = NonEmptyObject(doc, "rank_pattern") || NonEmptyObject(doc, "alpha_pattern");
  if (auto t = doc.find("target_modules"); t != doc.end() && t->is_string()) {
    c.target_regex = t->get<std::string>();
  } else {
    RESHARD_ASSIGN_OR_RETURN(c.target_modules, StringList(doc, "target_modules"));
  }
  RESHARD_ASSIGN_OR_RETURN(c.modules_to_save, StringList(doc, "modules_to_save"));
  return c;
}

bool IsPeftAdapterDir(const std::string& dir) {
  std::error_code ec;
  const std::filesystem::path d(dir);
  return std::filesystem::is_regular_file(d / kAdapterConfigName, ec) &&
         std::filesystem::is_regular_file(d / kAdapterWeightsName, ec);
}

std::optional<LoraTensorName> ParseLoraTensorName(std::string_view name) {
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  const std::string_view rest = name.substr(kPrefix.size());
  static constexpr std::pair<std::string_view, LoraPart> kSuffixes[] = {
      {".lora_A.weight", LoraPart::kA},
      {".lora_B.weight", LoraPart::kB},
      {".lora_embedding_A", LoraPart::kEmbeddingA},
      {".lora_embedding_B", LoraPart::kEmbeddingB},
      {".base_layer.weight", LoraPart::kBaseCopy},
  };
  for (const auto& [suffix, part] : kSuffixes) {
    if (!EndsWith(rest, suffix) || rest.size() == suffix.size()) continue;
    std::string module(rest.substr(0, rest.size() - suffix.size()));
    return LoraTensorName{module, module + ".weight", part};
  }
  // A module saved whole (modules_to_save): its own tensors under their base names.
  if (rest.find(".lora_") != std::string_view::npos) return std::nullopt;
  const size_t dot = rest.rfind('.');
  if (dot == std::string_view::npos || dot == 0) return std::nullopt;
  return LoraTensorName{std::string(rest.substr(0, dot)), std::string(rest), LoraPart::kBaseCopy};
}

std::optional<int> LoraDimAlong(LoraPart part, int base_dim, bool fan_in_fan_out) {
  // The base weight's (output, input) dims: [out, in] for a Linear; [in, out] for a Conv1D
  // (fan_in_fan_out) and an Embedding ([vocab, dim]: B @ A is its transpose).
  const bool transposed =
      fan_in_fan_out || part == LoraPart::kEmbeddingA || part == LoraPart::kEmbeddingB;
  const int out_dim = transposed ? 1 : 0;
  const int in_dim = transposed ? 0 : 1;
  switch (part) {
    case LoraPart::kA:
    case LoraPart::kEmbeddingA:  // [r, in]
      if (base_dim == in_dim) return 1;
      return std::nullopt;
    case LoraPart::kB:
    case LoraPart::kEmbeddingB:  // [out, r]
      if (base_dim == out_dim) return 0;
      return std::nullopt;
    case LoraPart::kBaseCopy:
      return base_dim;
  }
  return std::nullopt;
}

Shape LoraBaseShape(LoraPart a_part, const Shape& a_shape, const Shape& b_shape,
                    bool fan_in_fan_out) {
  if (fan_in_fan_out || a_part == LoraPart::kEmbeddingA) return {a_shape[1], b_shape[0]};
  return {b_shape[0], a_shape[1]};
}

Status CheckLoraTensors(const LoraConfig& config,
                        const std::vector<std::pair<std::string, Shape>>& tensors) {
  if (config.use_dora) {
    return FailedPreconditionError(
        "the adapter uses DoRA (use_dora): its magnitude vector scales the merged weight's "
        "columns, which reshard does not lay out");
  }
  if (config.lora_bias) {
    return FailedPreconditionError(
        "the adapter has LoRA biases (lora_bias), which reshard does not lay out");
  }
  if (config.has_patterns) {
    return FailedPreconditionError(
        "the adapter gives some modules their own r or alpha (rank_pattern, alpha_pattern), "
        "which reshard does not read");
  }
  // Per module: the A and the B seen, by tensor name.
  std::map<std::string,
           std::pair<const std::pair<std::string, Shape>*, const std::pair<std::string, Shape>*>>
      pairs;
  for (const auto& t : tensors) {
    const std::optional<LoraTensorName> n = ParseLoraTensorName(t.first);
    if (!n) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\" is not a LoRA A or B, nor a base module's weight under {}: "
          "reshard does not lay it out",
          t.first, kPrefix));
    }
    if (n->part == LoraPart::kBaseCopy) continue;
    if (t.second.size() != 2) {
      return DataLossError(
          fmt::format("adapter tensor \"{}\" has {} dims, not 2", t.first, t.second.size()));
    }
    const bool is_a = n->part == LoraPart::kA || n->part == LoraPart::kEmbeddingA;
    const Index r = is_a ? t.second[0] : t.second[1];
    if (r != config.r) {
      return DataLossError(
          fmt::format("adapter tensor \"{}\" has rank {} (shape [{}]), but {} says r = {}", t.first,
                      r, fmt::join(t.second, ", "), kAdapterConfigName, config.r));
    }
    auto& pair = pairs[n->module];
    (is_a ? pair.first : pair.second) = &t;
  }
  for (const auto& [module, pair] : pairs) {
    if (pair.first == nullptr || pair.second == nullptr) {
      return DataLossError(fmt::format("adapter tensor \"{}\" has no {} beside it",
                                       (pair.first ? pair.first : pair.second)->first,
                                       pair.first ? "B" : "A"));
    }
  }
  return Status::Ok();
}

}  // namespace reshard
