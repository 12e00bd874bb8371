#include "reshard/hf/quantization.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/base/status.h"
#include "reshard/ir/block_grid.h"

namespace reshard {

namespace {

using json::Json;

// The module patterns a quantization_config leaves unquantized, under any of its names.
Status ReadNotConverted(const Json& q, QuantScheme& scheme) {
  for (std::string_view key : {"modules_to_not_convert", "ignore", "exclude_modules"}) {
    const Json* list = json::Find(q, key);
    if (list == nullptr || list->is_null()) continue;
    const std::string path = json::Member("quantization_config", key);
    if (!list->is_array()) return json::TypeError(path, "an array of module names", *list);
    for (size_t i = 0; i < list->size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(std::string m, json::ReadString((*list)[i], json::Element(path, i)));
      scheme.not_converted.push_back(std::move(m));
    }
  }
  return Status::Ok();
}

// An NVFP4 group size (FP4 values one scale covers) at `path`, when the config gives one: a
// positive even integer (two values a byte), 16 in every NVFP4 checkpoint known.
Status ReadNvfp4GroupSize(const Json* g, const std::string& path, QuantScheme& scheme) {
  if (g == nullptr || g->is_null()) return Status::Ok();
  RESHARD_ASSIGN_OR_RETURN(const Index group, json::ReadInt(*g, path, json::kPositive));
  if (group % 2 != 0) {
    return json::ErrorAt(path, fmt::format("{} is odd: NVFP4 packs two FP4 values a byte, so a "
                                           "group of values is a whole number of bytes",
                                           group));
  }
  if (scheme.block.empty()) {
    scheme.block = {group};
  } else if (scheme.block[0] != group) {
    return json::ErrorAt(
        path, fmt::format("group size {}, where another group says {}", group, scheme.block[0]));
  }
  return Status::Ok();
}

// compressed-tensors: the weights' scheme of its (one kind of) config groups.
Status ReadCompressedTensors(const Json& q, QuantScheme& scheme) {
  std::string format;
  if (const Json* f = json::Find(q, "format"); f != nullptr && !f->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(format, json::ReadString(*f, "quantization_config.format"));
  }
  if (format == "nvfp4-pack-quantized") {
    scheme.format = QuantFormat::kNvfp4;
    if (const Json* groups = json::Find(q, "config_groups");
        groups != nullptr && groups->is_object()) {
      for (const auto& [name, group] : groups->items()) {
        const Json* w = group.is_object() ? json::Find(group, "weights") : nullptr;
        if (w == nullptr || !w->is_object()) continue;
        RESHARD_RETURN_IF_ERROR(ReadNvfp4GroupSize(
            json::Find(*w, "group_size"),
            json::Member("quantization_config.config_groups", name) + ".weights.group_size",
            scheme));
      }
    }
    if (scheme.block.empty()) scheme.block = {16};
    return Status::Ok();
  }
  if (format != "float-quantized" && format != "naive-quantized") {
    return InvalidArgumentError(fmt::format(
        "quantization_config.format {}: reshard reads compressed-tensors' float-quantized (FP8) "
        "and nvfp4-pack-quantized checkpoints",
        json::Quote(format)));
  }
  const Json* groups = json::Find(q, "config_groups");
  if (groups == nullptr || !groups->is_object() || groups->empty()) {
    return InvalidArgumentError("quantization_config.config_groups: expected an object of groups");
  }
  std::optional<QuantFormat> found;
  for (const auto& [name, group] : groups->items()) {
    const std::string path = json::Member("quantization_config.config_groups", name);
    const Json* w = group.is_object() ? json::Find(group, "weights") : nullptr;
    if (w == nullptr || !w->is_object()) return json::ErrorAt(path, "expected \"weights\"");
    std::string strategy = "tensor";
    if (const Json* s = json::Find(*w, "strategy"); s != nullptr && !s->is_null()) {
      RESHARD_ASSIGN_OR_RETURN(strategy, json::ReadString(*s, path + ".weights.strategy"));
    }
    QuantFormat f;
    if (strategy == "tensor") {
      f = QuantFormat::kFp8Tensor;
    } else if (strategy == "channel") {
      f = QuantFormat::kFp8Channel;
    } else if (strategy == "block") {
      f = QuantFormat::kFp8Block;
      const Json* b = json::Find(*w, "block_structure");
      if (b == nullptr)
        return json::ErrorAt(path + ".weights", "block strategy without block_structure");
      RESHARD_ASSIGN_OR_RETURN(scheme.block,
                               json::ReadIntArray(*b, path + ".weights.block_structure", 1));
    } else {
      return json::ErrorAt(path + ".weights.strategy",
                           fmt::format("{}: reshard reads tensor, channel and block strategies",
                                       json::Quote(strategy)));
    }
    if (found && *found != f) {
      return json::ErrorAt(path, "config groups of different weight strategies");
    }
    found = f;
  }
  scheme.format = *found;
  return Status::Ok();
}

// The known suffixes of per-tensor scales beside a quantized module's weight.
constexpr std::string_view kPerTensorSuffixes[] = {".weight_scale_2", ".weight_global_scale",
                                                   ".input_scale", ".input_global_scale",
                                                   ".activation_scale"};

bool IsFp8(DType d) { return d == DType::kF8E4M3 || d == DType::kF8E5M2; }

struct Candidate {
  std::string data;
  bool per_tensor = false;
};

// The data tensor a scale tensor's name points at under `scheme` (nullopt: not a scale).
std::optional<Candidate> DataOfScale(const QuantScheme& scheme, std::string_view name,
                                     const std::map<std::string, size_t, std::less<>>& index) {
  auto strip = [&](std::string_view suffix) -> std::optional<std::string> {
    if (name.size() <= suffix.size() || !name.ends_with(suffix)) return std::nullopt;
    return std::string(name.substr(0, name.size() - suffix.size()));
  };
  auto weight_of = [&](const std::string& module) -> std::string {
    for (std::string_view w : {".weight", ".weight_packed"}) {
      if (index.contains(module + std::string(w))) return module + std::string(w);
    }
    return module + ".weight";
  };
  if (scheme.format == QuantFormat::kMxfp4) {
    if (auto base = strip("_scales")) return Candidate{*base + "_blocks", false};
    return std::nullopt;
  }
  for (std::string_view s : kPerTensorSuffixes) {
    if (auto module = strip(s)) return Candidate{weight_of(*module), true};
  }
  if (auto module = strip(".weight_scale_inv")) return Candidate{*module + ".weight", false};
  if (auto module = strip(".weight_scale")) return Candidate{weight_of(*module), false};
  return std::nullopt;
}

// "X" of "X.weight" / "X.weight_packed" (the name itself otherwise).
std::string ModuleOf(std::string_view data) {
  for (std::string_view w : {".weight_packed", ".weight"}) {
    if (data.size() > w.size() && data.ends_with(w)) {
      return std::string(data.substr(0, data.size() - w.size()));
    }
  }
  return std::string(data);
}

// The block scale quantized data `data` needs under `scheme`, by name (for messages).
std::string ExpectedScaleName(const QuantScheme& scheme, std::string_view data) {
  if (scheme.format == QuantFormat::kMxfp4 && data.ends_with("_blocks")) {
    return std::string(data.substr(0, data.size() - 7)) + "_scales";
  }
  if (scheme.format == QuantFormat::kFp8Block) return std::string(data) + "_scale_inv";
  if (data.ends_with(".weight") || data.ends_with(".weight_packed")) {
    return ModuleOf(data) + ".weight_scale";
  }
  return std::string(data) + "_scale";
}

// Whether `t` is quantized data under `scheme`, by its dtype (and MXFP4's name).
bool IsQuantizedData(const QuantScheme& scheme, const QuantTensor& t) {
  switch (scheme.format) {
    case QuantFormat::kMxfp4:
      return t.name.ends_with("_blocks");
    case QuantFormat::kNvfp4:
      return t.dtype == DType::kU8 &&
             (t.name.ends_with(".weight") || t.name.ends_with(".weight_packed"));
    default:
      return IsFp8(t.dtype);
  }
}

// The block of the scale `scale` over the data `data` under `scheme`.
Result<Shape> BlockOf(const QuantScheme& scheme, const QuantTensor& data, const QuantTensor& scale,
                      bool per_tensor) {
  const Shape& L = data.shape;
  const size_t d = L.size();
  if (per_tensor || ProductOf(scale.shape) == 1) return L;
  if (d == 0) {
    return InvalidArgumentError(
        fmt::format("\"{}\" is 0-d, so \"{}\" (shape {}) cannot be one scale per block of it",
                    data.name, scale.name, FormatShape(scale.shape)));
  }
  Shape block(d, 1);
  switch (scheme.format) {
    case QuantFormat::kFp8Block:
      if (d < scheme.block.size()) {
        return InvalidArgumentError(fmt::format(
            "\"{}\" has shape {}, fewer dimensions than the block {}, so \"{}\" (shape {}) "
            "cannot be its block scales",
            data.name, FormatShape(L), FormatShape(scheme.block), scale.name,
            FormatShape(scale.shape)));
      }
      for (size_t i = 0; i < scheme.block.size(); ++i)
        block[d - scheme.block.size() + i] = scheme.block[i];
      return block;
    case QuantFormat::kFp8Tensor:
      return InvalidArgumentError(
          fmt::format("quantization_config says one scale per tensor, but \"{}\" has shape {}",
                      scale.name, FormatShape(scale.shape)));
    case QuantFormat::kFp8Channel:
      block[d - 1] = L[d - 1];
      return block;
    case QuantFormat::kMxfp4:
      if (data.dtype != DType::kU8 || L[d - 1] != 16) {
        return InvalidArgumentError(
            fmt::format("MXFP4 blocks \"{}\" are {} {}, not U8 [..., groups, 16]", data.name,
                        DTypeName(data.dtype), FormatShape(L)));
      }
      block[d - 1] = 16;
      return block;
    case QuantFormat::kNvfp4:
      if (data.dtype != DType::kU8) {
        return InvalidArgumentError(fmt::format("NVFP4 data \"{}\" is {}, not packed U8", data.name,
                                                DTypeName(data.dtype)));
      }
      block[d - 1] = (scheme.block.empty() ? 16 : scheme.block[0]) / 2;  // two values a byte
      return block;
  }
  return InvalidArgumentError("unknown format");
}

}  // namespace

std::string_view QuantFormatName(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFp8Block:
      return "fp8-block";
    case QuantFormat::kFp8Tensor:
      return "fp8-tensor";
    case QuantFormat::kFp8Channel:
      return "fp8-channel";
    case QuantFormat::kMxfp4:
      return "mxfp4";
    case QuantFormat::kNvfp4:
      return "nvfp4";
  }
  return "?";
}

Result<std::optional<QuantScheme>> ReadQuantScheme(std::string_view config_json) {
  RESHARD_ASSIGN_OR_RETURN(const Json config, json::ParseJson(config_json));
  if (!config.is_object()) return json::TypeError("", "an object", config);
  const Json* q = json::Find(config, "quantization_config");
  if (q == nullptr || q->is_null()) return std::optional<QuantScheme>();
  if (!q->is_object()) return json::TypeError("quantization_config", "an object", *q);
  RESHARD_ASSIGN_OR_RETURN(const Json* m, json::Require(*q, "quantization_config", "quant_method"));
  QuantScheme scheme;
  RESHARD_ASSIGN_OR_RETURN(scheme.method, json::ReadString(*m, "quantization_config.quant_method"));
  RESHARD_RETURN_IF_ERROR(ReadNotConverted(*q, scheme));
  if (scheme.method == "fp8") {
    scheme.format = QuantFormat::kFp8Block;
    scheme.block = {128, 128};
    if (const Json* b = json::Find(*q, "weight_block_size"); b != nullptr && !b->is_null()) {
      RESHARD_ASSIGN_OR_RETURN(scheme.block,
                               json::ReadIntArray(*b, "quantization_config.weight_block_size", 1));
      if (scheme.block.size() != 2) {
        return InvalidArgumentError(
            fmt::format("quantization_config.weight_block_size: expected [rows, columns], got {}",
                        FormatShape(scheme.block)));
      }
    } else if (b != nullptr) {
      scheme.format = QuantFormat::kFp8Tensor;
    }
  } else if (scheme.method == "mxfp4") {
    scheme.format = QuantFormat::kMxfp4;
  } else if (scheme.method == "compressed-tensors") {
    RESHARD_RETURN_IF_ERROR(ReadCompressedTensors(*q, scheme));
  } else if (scheme.method == "modelopt") {
    std::string algo;
    if (const Json* a = json::Find(*q, "quant_algo"); a != nullptr) {
      RESHARD_ASSIGN_OR_RETURN(algo, json::ReadString(*a, "quantization_config.quant_algo"));
    }
    if (algo == "FP8") {
      scheme.format = QuantFormat::kFp8Tensor;
    } else if (algo == "NVFP4") {
      scheme.format = QuantFormat::kNvfp4;
      RESHARD_RETURN_IF_ERROR(ReadNvfp4GroupSize(json::Find(*q, "group_size"),
                                                 "quantization_config.group_size", scheme));
      if (scheme.block.empty()) scheme.block = {16};
    } else {
      return InvalidArgumentError(
          fmt::format("quantization_config.quant_algo {}: reshard reads ModelOpt's FP8 and NVFP4",
                      json::Quote(algo)));
    }
  } else {
    return InvalidArgumentError(
        fmt::format("quantization_config.quant_method {}: reshard moves the block formats fp8, "
                    "compressed-tensors (FP8, NVFP4), modelopt (FP8, NVFP4) and mxfp4",
                    json::Quote(scheme.method)));
  }
  return std::optional<QuantScheme>(std::move(scheme));
}

Result<std::vector<QuantTie>> TieQuantizedTensors(const QuantScheme& scheme,
                                                  const std::vector<QuantTensor>& tensors) {
  std::map<std::string, size_t, std::less<>> index;
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  std::vector<QuantTie> ties;
  std::set<std::string, std::less<>> scales;               // every tensor tied as a scale
  std::set<std::string, std::less<>> block_scaled;         // data with its block scale
  std::set<std::string, std::less<>> second_level_scaled;  // data with a weight_scale_2
  for (const QuantTensor& s : tensors) {
    std::optional<Candidate> c = DataOfScale(scheme, s.name, index);
    if (!c) continue;
    auto data = index.find(c->data);
    if (data == index.end()) {
      // Scalars with no weight beside them (an attention's k_scale) are no block scales.
      if (c->per_tensor) continue;
      return FailedPreconditionError(
          fmt::format("\"{}\" looks like the scales of \"{}\", which the checkpoint does not hold",
                      s.name, c->data));
    }
    const QuantTensor& d = tensors[data->second];
    Result<Shape> block = BlockOf(scheme, d, s, c->per_tensor);
    if (!block.ok()) return FailedPreconditionError(block.status().message());
    RESHARD_ASSIGN_OR_RETURN(const Shape grid, BlockGridShape(d.shape, *block));
    if (!MatchesGrid(s.shape, grid)) {
      return FailedPreconditionError(fmt::format(
          "scales \"{}\" (shape {}) are not the block grid {} of \"{}\" (shape {}) in blocks of "
          "{} ({}, quantization_config {})",
          s.name, FormatShape(s.shape), FormatShape(grid), d.name, FormatShape(d.shape),
          FormatShape(*block), QuantFormatName(scheme.format), scheme.method));
    }
    const bool dequantizes = !c->per_tensor;
    if (dequantizes) {
      RESHARD_RETURN_IF_ERROR(
          CheckBlockScaleDType(QuantFormatName(scheme.format), s.name, d.name, s.dtype));
      block_scaled.insert(d.name);
    } else if (s.name.ends_with(".weight_scale_2")) {
      second_level_scaled.insert(d.name);
    }
    scales.insert(s.name);
    ties.push_back(QuantTie{s.name, d.name, *block, scheme.format, dequantizes});
  }
  // Quantized data must come with its scales: per-tensor activation scalars beside it are no
  // block scale, and a "dequantized" copy of data without one would be its raw numbers.
  for (const QuantTensor& t : tensors) {
    if (scales.contains(t.name) || !IsQuantizedData(scheme, t)) continue;
    if (t.name.ends_with(".weight_packed")) {
      const std::string plain = t.name.substr(0, t.name.size() - 7);
      if (index.contains(plain)) {
        return FailedPreconditionError(fmt::format(
            "\"{}\" and \"{}\" are both the data of module \"{}\" ({}): one of them is "
            "not what its scales scale",
            plain, t.name, plain.substr(0, plain.size() - 7), QuantFormatName(scheme.format)));
      }
    }
    if (!block_scaled.contains(t.name)) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" ({} {}) is quantized ({}, quantization_config {}) but the checkpoint holds no "
          "\"{}\", its block scales: its numbers are unknown",
          t.name, DTypeName(t.dtype), FormatShape(t.shape), QuantFormatName(scheme.format),
          scheme.method, ExpectedScaleName(scheme, t.name)));
    }
    if (scheme.format == QuantFormat::kNvfp4 && scheme.method == "modelopt" &&
        !second_level_scaled.contains(t.name)) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" ({} {}) is ModelOpt NVFP4, whose values are the FP4 value times its per-16 "
          "scale times \"{}\", which the checkpoint does not hold",
          t.name, DTypeName(t.dtype), FormatShape(t.shape), ModuleOf(t.name) + ".weight_scale_2"));
    }
  }
  return ties;
}

std::string PlanNameOfData(const QuantTie& tie) {
  const std::string& n = tie.data;
  if (tie.format == QuantFormat::kMxfp4 && n.ends_with("_blocks")) return n.substr(0, n.size() - 7);
  if (n.ends_with(".weight_packed")) return n.substr(0, n.size() - 7);
  return n;
}

Result<std::string> WithoutQuantizationConfig(std::string_view config_json) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(config_json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError("a config.json is a JSON object; this one is not");
  }
  j.erase("quantization_config");
  return j.dump(2) + "\n";
}

}  // namespace reshard
