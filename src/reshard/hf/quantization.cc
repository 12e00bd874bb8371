#include "reshard/hf/quantization.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>
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

// compressed-tensors: the weights' scheme of its (one kind of) config groups.
Status ReadCompressedTensors(const Json& q, QuantScheme& scheme) {
  std::string format;
  if (const Json* f = json::Find(q, "format"); f != nullptr && !f->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(format, json::ReadString(*f, "quantization_config.format"));
  }
  if (format == "nvfp4-pack-quantized") {
    scheme.format = QuantFormat::kNvfp4;
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

// The block of the scale `scale` over the data `data` under `scheme`.
Result<Shape> BlockOf(const QuantScheme& scheme, const QuantTensor& data, const QuantTensor& scale,
                      bool per_tensor) {
  const Shape& L = data.shape;
  const size_t d = L.size();
  if (per_tensor || ProductOf(scale.shape) == 1) return L;
  if (d == 0) return InvalidArgumentError("a 0-d quantized tensor");
  Shape block(d, 1);
  switch (scheme.format) {
    case QuantFormat::kFp8Block:
      if (d < scheme.block.size()) return InvalidArgumentError("fewer dimensions than the block");
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
      block[d - 1] = 8;  // 16 FP4 values, two a byte
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
  std::map<std::string, size_t, std::less<>> block_scale_of;  // data -> its block scale tie
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
    if (dequantizes) block_scale_of.emplace(d.name, ties.size());
    ties.push_back(QuantTie{s.name, d.name, *block, scheme.format, dequantizes});
  }
  // Quantized data must come with its scales.
  for (const QuantTensor& t : tensors) {
    const bool quantized_dtype =
        (scheme.format == QuantFormat::kMxfp4 && t.name.ends_with("_blocks")) ||
        (scheme.format != QuantFormat::kMxfp4 && scheme.format != QuantFormat::kNvfp4 &&
         IsFp8(t.dtype) && t.shape.size() >= 2);
    if (quantized_dtype && !block_scale_of.contains(t.name)) {
      bool per_tensor_only = false;
      for (const QuantTie& tie : ties) per_tensor_only |= tie.data == t.name;
      if (per_tensor_only && scheme.format != QuantFormat::kMxfp4) continue;
      return FailedPreconditionError(fmt::format(
          "\"{}\" ({} {}) is quantized ({}) but the checkpoint holds no scales for it", t.name,
          DTypeName(t.dtype), FormatShape(t.shape), QuantFormatName(scheme.format)));
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
