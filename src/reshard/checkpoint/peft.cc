#include "reshard/checkpoint/peft.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

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

// A config key that is a list of module names or one regular expression (then in `regex`).
Status NamesOrRegex(const Json& doc, const char* key, std::vector<std::string>& names,
                    std::string& regex) {
  if (auto it = doc.find(key); it != doc.end() && it->is_string()) {
    regex = it->get<std::string>();
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(names, StringList(doc, key));
  return Status::Ok();
}

// Whether `key` is one of `names` or ends with one after a dot (PEFT's match of a list).
bool NamedIn(const std::vector<std::string>& names, std::string_view key) {
  return std::any_of(names.begin(), names.end(), [&](const std::string& n) {
    return key == n ||
           (key.size() > n.size() && EndsWith(key, n) && key[key.size() - n.size() - 1] == '.');
  });
}

// Python's re.fullmatch (`whole`) or re.match of `pattern` (of config key `key`) against
// `text`, read as ECMAScript; the first group's text, when it has one, in `group`. std::regex
// reports a pattern it cannot read, or one too costly to match, only by throwing: caught here.
Result<bool> RegexMatches(const std::string& pattern, const std::string& text, bool whole,
                          std::string_view key, std::string* group = nullptr) {
  try {
    const std::regex re(pattern, std::regex::ECMAScript);
    std::smatch m;
    const bool found = whole
                           ? std::regex_match(text, m, re)
                           : std::regex_search(text, m, re, std::regex_constants::match_continuous);
    if (found && group != nullptr && m.size() > 1) *group = m[1].str();
    return found;
  } catch (const std::regex_error& e) {
    return FailedPreconditionError(
        fmt::format("{}: the regular expression \"{}\" cannot be read as ECMAScript ({}), so "
                    "which modules the adapter adapts is not known",
                    key, pattern, e.what()));
  }
}

bool Flag(const Json& doc, const char* key) {
  auto it = doc.find(key);
  return it != doc.end() && it->is_boolean() && it->get<bool>();
}

bool NonEmptyObject(const Json& doc, const char* key) {
  auto it = doc.find(key);
  return it != doc.end() && it->is_object() && !it->empty();
}

// A piece of a 2-D weight as a box: F's rows [f[0], f[0] + n[0]) and columns [f[1], f[1] + n[1])
// at rows [e[0], ...) and columns [e[1], ...) of a 2-D rank tensor.
struct PieceBox {
  std::array<Index, 2> f{};
  std::array<Index, 2> n{1, 1};
  std::array<Index, 2> e{};
};

std::optional<PieceBox> BoxOf(const Piece& p, const Shape& logical, const Shape& dest) {
  const Index f_cols = logical[1];
  const Index d_cols = dest[1];
  if (f_cols == 0 || d_cols == 0) return std::nullopt;
  PieceBox b;
  b.f = {p.source.offset / f_cols, p.source.offset % f_cols};
  b.e = {p.dest.offset / d_cols, p.dest.offset % d_cols};
  // The piece's dimensions (extent, source stride, dest stride); a contiguous run of whole rows
  // in both (a flattened row block) as rows and columns.
  std::vector<std::array<Index, 3>> dims;
  for (size_t k = 0; k < p.shape.size(); ++k) {
    const Index n = p.shape[k];
    if (n == 1) continue;
    if (p.source.strides[k] == 1 && p.dest.strides[k] == 1 && n > f_cols - b.f[1] && b.f[1] == 0 &&
        b.e[1] == 0 && f_cols == d_cols && n % f_cols == 0) {
      dims.push_back({n / f_cols, f_cols, d_cols});
      dims.push_back({f_cols, 1, 1});
    } else {
      dims.push_back({n, p.source.strides[k], p.dest.strides[k]});
    }
  }
  std::array<bool, 2> seen = {false, false};
  for (const auto& [extent, src_stride, dst_stride] : dims) {
    int dim = 0;
    if (src_stride == f_cols && dst_stride == d_cols) {
      dim = 0;
    } else if (src_stride == 1 && dst_stride == 1) {
      dim = 1;
    } else {
      return std::nullopt;
    }
    if (seen[static_cast<size_t>(dim)]) return std::nullopt;
    seen[static_cast<size_t>(dim)] = true;
    b.n[static_cast<size_t>(dim)] = extent;
  }
  if (b.f[1] + b.n[1] > f_cols || b.e[1] + b.n[1] > d_cols) return std::nullopt;
  return b;
}

std::string_view LoraSuffix(LoraPart part) {
  switch (part) {
    case LoraPart::kA:
      return ".lora_A.weight";
    case LoraPart::kB:
      return ".lora_B.weight";
    case LoraPart::kEmbeddingA:
      return ".lora_embedding_A";
    case LoraPart::kEmbeddingB:
      return ".lora_embedding_B";
    case LoraPart::kBaseCopy:
      break;
  }
  return "";
}

// The adapter buffer beside the base's buffer `buffer` ("M.qkv_proj.weight"): its pair part's
// ("base_model.model.M.qkv_proj.lora_B.weight"), or a whole copy's.
std::string AdapterBufferName(const std::string& buffer, LoraPart part) {
  if (part == LoraPart::kBaseCopy) return std::string(kPrefix) + buffer;
  std::string_view module = buffer;
  if (EndsWith(module, ".weight")) module.remove_suffix(std::string_view(".weight").size());
  return fmt::format("{}{}{}", kPrefix, module, LoraSuffix(part));
}

// An adapter buffer of A or B being laid out: per rank, its shape and the spans along the
// shared dimension (start, length) that tensors fill.
struct LoraBuffer {
  DType dtype = DType::kF32;
  int shared_dim = 0;
  Index r = 0;
  std::vector<Shape> shapes;
  std::vector<std::vector<std::pair<Index, Index>>> filled;
};

// Per rank, the spans of W's pieces along its dimension `dim`: (start in F, length, start in the
// rank tensor), each once.
using Spans = std::set<std::array<Index, 3>>;

Result<std::vector<Spans>> SpansAlong(const std::string& name, const std::string& base_name,
                                      const ParamMap& w, size_t dim) {
  std::vector<Spans> spans(static_cast<size_t>(w.world_size()));
  for (Rank j = 0; j < w.world_size(); ++j) {
    const RankShard& shard = w.rank(j);
    if (shard.shard_shape.size() != 2) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\": rank {} holds its base weight \"{}\" in a tensor of {} dims "
          "(stacked experts), along which an adapter is not laid out",
          name, j, base_name, shard.shard_shape.size()));
    }
    for (size_t k = 0; k < shard.pieces.size(); ++k) {
      const Piece& p = shard.pieces[k];
      if (p.num_elements() == 0) continue;
      const std::optional<PieceBox> box = BoxOf(p, w.logical_shape(), shard.shard_shape);
      if (!box) {
        return FailedPreconditionError(fmt::format(
            "adapter tensor \"{}\": piece {} of rank {} of its base weight \"{}\" is not a block "
            "of rows and columns placed as one in its rank tensor, which an adapter's layout "
            "does not follow",
            name, k, j, base_name));
      }
      spans[static_cast<size_t>(j)].insert({box->f[dim], box->n[dim], box->e[dim]});
    }
  }
  return spans;
}

// The map of A or B (`t`, part `part`) from its base weight's map `w`; the adapter buffers it
// fills are recorded in `buffers`.
Result<ParamMap> LoraPairMap(const LoraTensorToLay& t, LoraPart part, bool fan_in_fan_out,
                             const std::string& base_name, const ParamMap& w,
                             std::map<std::string, LoraBuffer>& buffers) {
  if (w.logical_shape().size() != 2 || t.shape.size() != 2) {
    return FailedPreconditionError(
        fmt::format("adapter tensor \"{}\": its base weight \"{}\" is of {} dims, not 2", t.name,
                    base_name, w.logical_shape().size()));
  }
  int w_s = 0;  // the dimension of W that t runs along, and t's
  int t_s = 0;
  for (int d = 0; d < 2; ++d) {
    if (std::optional<int> along = LoraDimAlong(part, d, fan_in_fan_out)) {
      w_s = d;
      t_s = *along;
    }
  }
  const auto ws = static_cast<size_t>(w_s);
  const auto ts = static_cast<size_t>(t_s);
  const size_t tr = 1 - ts;
  const Index r = t.shape[tr];
  if (t.shape[ts] != w.valid_shape()[ws]) {
    return FailedPreconditionError(
        fmt::format("adapter tensor \"{}\" [{}] does not fit its base weight \"{}\" [{}]", t.name,
                    fmt::join(t.shape, ", "), base_name, fmt::join(w.valid_shape(), ", ")));
  }
  Shape logical(2);
  logical[ts] = w.logical_shape()[ws];
  logical[tr] = r;
  const int world = w.world_size();
  RESHARD_ASSIGN_OR_RETURN(const std::vector<Spans> spans, SpansAlong(t.name, base_name, w, ws));
  ParamMapBuilder b;
  b.set_logical_shape(logical);
  if (logical != t.shape) b.set_valid_shape(t.shape);
  b.set_world_size(world);
  for (Rank j = 0; j < world; ++j) {
    const RankShard& shard = w.rank(j);
    const Index extent = shard.shard_shape[ws];
    Shape dest(2);
    dest[ts] = extent;
    dest[tr] = r;
    b.set_shard_shape(j, dest);
    Index filled = 0;
    for (const auto& s : spans[static_cast<size_t>(j)]) filled += s[1];
    // Part of a buffer along the shared dimension: the adapter's buffer beside it.
    if (shard.is_buffered() && filled < extent) {
      const std::string name = AdapterBufferName(shard.buffer, part);
      LoraBuffer& buf = buffers[name];
      if (buf.shapes.empty()) {
        buf = {t.dtype, t_s, r, std::vector<Shape>(static_cast<size_t>(world)),
               std::vector<std::vector<std::pair<Index, Index>>>(static_cast<size_t>(world))};
      }
      if (buf.shared_dim != t_s || buf.r != r || buf.dtype != t.dtype ||
          (!buf.shapes[static_cast<size_t>(j)].empty() &&
           buf.shapes[static_cast<size_t>(j)] != dest)) {
        return FailedPreconditionError(fmt::format(
            "adapter tensor \"{}\" ({} [{}]) goes into the adapter buffer \"{}\" beside its base "
            "weight's, which another adapter tensor of another dtype, rank or orientation fills",
            t.name, DTypeName(t.dtype), fmt::join(t.shape, ", "), name));
      }
      buf.shapes[static_cast<size_t>(j)] = dest;
      for (const auto& s : spans[static_cast<size_t>(j)]) {
        buf.filled[static_cast<size_t>(j)].emplace_back(s[2], s[1]);
      }
      b.set_buffer(j, name);
    }
    for (const std::array<Index, 3>& span : spans[static_cast<size_t>(j)]) {
      const Index f0 = span[0];
      const Index n = span[1];
      const Index e0 = span[2];
      Piece p;
      p.shape = t_s == 0 ? Shape{n, r} : Shape{r, n};
      p.source = {t_s == 0 ? f0 * logical[1] : f0, {logical[1], 1}};
      p.dest = {t_s == 0 ? e0 * dest[1] : e0, {dest[1], 1}};
      for (Rank i = 0; i < world; ++i) {
        const auto& other = spans[static_cast<size_t>(i)];
        if (std::any_of(other.begin(), other.end(),
                        [&](const auto& o) { return o[0] == f0 && o[1] == n; })) {
          p.locations.push_back(i);
        }
      }
      b.add_piece(j, std::move(p));
    }
  }
  Result<ParamMap> map = b.Finalize();
  if (!map.ok()) {
    return FailedPreconditionError(
        fmt::format("adapter tensor \"{}\", laid out from the map of \"{}\": {}", t.name, base_name,
                    map.status().message()));
  }
  return map;
}

// The declaration of an adapter buffer of A or B: what no tensor fills is padding.
BufferDecl LoraBufferDecl(const std::string& name, const LoraBuffer& buf) {
  BufferDecl decl{name, buf.dtype, {}, 0.0};
  for (size_t j = 0; j < buf.shapes.size(); ++j) {
    BufferRank rank;
    rank.shape = buf.shapes[j].empty() ? Shape{0, 0} : buf.shapes[j];
    if (!buf.shapes[j].empty()) {
      const auto ts = static_cast<size_t>(buf.shared_dim);
      const Index extent = rank.shape[ts];
      const Index cols = rank.shape[1];
      std::vector<std::pair<Index, Index>> filled = buf.filled[j];
      std::sort(filled.begin(), filled.end());
      Index at = 0;
      auto pad = [&](Index start, Index length) {
        if (length <= 0) return;
        rank.padding.push_back({buf.shared_dim == 0 ? Shape{length, buf.r} : Shape{buf.r, length},
                                {buf.shared_dim == 0 ? start * cols : start, {cols, 1}}});
      };
      for (const auto& [start, length] : filled) {
        pad(at, start - at);
        at = std::max(at, start + length);
      }
      pad(at, extent - at);
    }
    decl.ranks.push_back(std::move(rank));
  }
  return decl;
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
  auto targets = doc.find("target_modules");
  c.has_targets = targets != doc.end() && !targets->is_null();
  RESHARD_RETURN_IF_ERROR(NamesOrRegex(doc, "target_modules", c.target_modules, c.target_regex));
  RESHARD_RETURN_IF_ERROR(NamesOrRegex(doc, "exclude_modules", c.exclude_modules, c.exclude_regex));
  if (auto layers = doc.find("layers_to_transform"); layers != doc.end() && !layers->is_null()) {
    const Json list = layers->is_array() ? *layers : Json::array({*layers});
    for (const Json& v : list) {
      if (!v.is_number_integer()) {
        return InvalidArgumentError(
            fmt::format("{}: layers_to_transform must be a layer index or a list of them, not {}",
                        kAdapterConfigName, layers->dump()));
      }
      c.layers_to_transform.push_back(v.get<int64_t>());
    }
  }
  if (auto pattern = doc.find("layers_pattern"); pattern != doc.end() && pattern->is_string()) {
    if (!pattern->get<std::string>().empty()) c.layers_pattern = {pattern->get<std::string>()};
  } else {
    RESHARD_ASSIGN_OR_RETURN(c.layers_pattern, StringList(doc, "layers_pattern"));
  }
  RESHARD_ASSIGN_OR_RETURN(c.modules_to_save, StringList(doc, "modules_to_save"));
  return c;
}

Result<bool> LoraTargetsModule(const LoraConfig& config, const std::string& module) {
  if (!config.exclude_regex.empty()) {
    RESHARD_ASSIGN_OR_RETURN(const bool excluded,
                             RegexMatches(config.exclude_regex, module, true, "exclude_modules"));
    if (excluded) return false;
  } else if (NamedIn(config.exclude_modules, module)) {
    return false;
  }
  // PEFT never adapts a module it saves whole.
  for (const std::string& saved : config.modules_to_save) {
    RESHARD_ASSIGN_OR_RETURN(
        const bool is_saved,
        RegexMatches(fmt::format("(^|.*\\.){}($|\\..*)", saved), module, false, "modules_to_save"));
    if (is_saved) return false;
  }
  if (!config.has_targets) return true;
  if (!config.target_regex.empty()) {
    // "all-linear": PEFT's shorthand for every linear layer, read as it was saved.
    std::string lower = config.target_regex;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (lower == "all-linear") return true;
    return RegexMatches(config.target_regex, module, true, "target_modules");
  }
  const auto& targets = config.target_modules;
  if (std::find(targets.begin(), targets.end(), module) != targets.end()) return true;
  if (!NamedIn(targets, module)) return false;
  if (config.layers_to_transform.empty()) return true;
  // The module's layer: the first number after a layers_pattern (any name without one) that
  // another name follows, as PEFT finds it.
  std::string index;
  if (config.layers_pattern.empty()) {
    RESHARD_RETURN_IF_ERROR(
        RegexMatches(R"(.*?\.[^.]*\.(\d+)\.)", module, false, "layers_pattern", &index).status());
  } else {
    for (const std::string& pattern : config.layers_pattern) {
      RESHARD_ASSIGN_OR_RETURN(
          const bool found, RegexMatches(fmt::format(R"((?:^|.*?\.){}\.(\d+)\.)", pattern), module,
                                         false, "layers_pattern", &index));
      if (found) break;
    }
  }
  int64_t layer = 0;
  const auto [end, ec] = std::from_chars(index.data(), index.data() + index.size(), layer);
  if (index.empty() || ec != std::errc() || end != index.data() + index.size()) return false;
  return std::find(config.layers_to_transform.begin(), config.layers_to_transform.end(), layer) !=
         config.layers_to_transform.end();
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
  // Per module: the A and the B seen; per base weight, its whole copy.
  using Tensor = std::pair<std::string, Shape>;
  std::map<std::string, std::pair<const Tensor*, const Tensor*>> pairs;
  std::map<std::string, const Tensor*> copies;
  for (const auto& t : tensors) {
    const std::optional<LoraTensorName> n = ParseLoraTensorName(t.first);
    if (!n) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\" is not a LoRA A or B, nor a base module's weight under {}: "
          "reshard does not lay it out",
          t.first, kPrefix));
    }
    if (n->part == LoraPart::kBaseCopy) {
      auto [it, added] = copies.emplace(n->base, &t);
      if (!added) {
        return DataLossError(
            fmt::format("adapter tensors \"{}\" and \"{}\" are both a whole copy of \"{}\"",
                        it->second->first, t.first, n->base));
      }
      continue;
    }
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
    const Tensor*& slot = is_a ? pair.first : pair.second;
    if (slot != nullptr) {
      return DataLossError(
          fmt::format("adapter tensors \"{}\" and \"{}\" are both the {} of \"{}\"", slot->first,
                      t.first, is_a ? "A" : "B", n->module));
    }
    slot = &t;
    RESHARD_ASSIGN_OR_RETURN(const bool targeted, LoraTargetsModule(config, n->module));
    if (!targeted) {
      return DataLossError(fmt::format(
          "adapter tensor \"{}\" is of the module \"{}\", which {} does not adapt "
          "(target_modules, exclude_modules, layers_to_transform, modules_to_save): PEFT "
          "would not load it",
          t.first, n->module, kAdapterConfigName));
    }
  }
  for (const auto& [module, pair] : pairs) {
    if (pair.first == nullptr || pair.second == nullptr) {
      return DataLossError(fmt::format("adapter tensor \"{}\" has no {} beside it",
                                       (pair.first ? pair.first : pair.second)->first,
                                       pair.first ? "B" : "A"));
    }
    const bool a_embedding = ParseLoraTensorName(pair.first->first)->part == LoraPart::kEmbeddingA;
    const bool b_embedding = ParseLoraTensorName(pair.second->first)->part == LoraPart::kEmbeddingB;
    if (a_embedding != b_embedding) {
      return DataLossError(fmt::format(
          "adapter tensors \"{}\" and \"{}\" pair an embedding's LoRA tensor with a linear "
          "layer's",
          pair.first->first, pair.second->first));
    }
    // The module's own weight, where PEFT adapts it, is its base layer's.
    const std::string weight = module + ".weight";
    if (auto copy = copies.find(weight);
        copy != copies.end() && !EndsWith(copy->second->first, ".base_layer.weight")) {
      return DataLossError(fmt::format(
          "adapter tensor \"{}\" is a whole copy of \"{}\", the weight of a module the adapter "
          "adapts, which PEFT saves as \"{}{}.base_layer.weight\": PEFT would not load it",
          copy->second->first, weight, kPrefix, module));
    }
  }
  return Status::Ok();
}

Result<MapDocument> LoraMapsFromBase(const std::vector<LoraTensorToLay>& tensors,
                                     bool fan_in_fan_out, const MapDocument& base) {
  std::map<std::string, const ParamMap*> base_maps;
  for (const auto& [name, map] : base.params) base_maps.emplace(name, &map);
  std::map<std::string, LoraBuffer> lora_buffers;
  std::map<std::string, BufferDecl> copy_buffers;
  MapDocument doc;
  std::vector<DType> dtypes;
  for (const LoraTensorToLay& t : tensors) {
    const std::optional<LoraTensorName> n = ParseLoraTensorName(t.name);
    if (!n) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\" is not a LoRA A or B, nor a base module's weight", t.name));
    }
    auto it = base_maps.find(n->base);
    if (it == base_maps.end()) {
      return FailedPreconditionError(
          fmt::format("adapter tensor \"{}\": the base's maps have none for its base weight \"{}\"",
                      t.name, n->base));
    }
    const ParamMap& w = *it->second;
    if (n->part != LoraPart::kBaseCopy) {
      RESHARD_ASSIGN_OR_RETURN(ParamMap map,
                               LoraPairMap(t, n->part, fan_in_fan_out, n->base, w, lora_buffers));
      doc.params.emplace_back(t.name, std::move(map));
      dtypes.push_back(t.dtype);
      continue;
    }
    // A whole copy: the base weight's map, its buffers renamed as the adapter's.
    if (t.shape != w.valid_shape()) {
      return FailedPreconditionError(
          fmt::format("adapter tensor \"{}\" [{}] is a copy of \"{}\", which is [{}]", t.name,
                      fmt::join(t.shape, ", "), n->base, fmt::join(w.valid_shape(), ", ")));
    }
    ParamMapBuilder b(w);
    for (Rank j = 0; j < w.world_size(); ++j) {
      if (!w.rank(j).is_buffered()) continue;
      const std::string name = AdapterBufferName(w.buffer(j), LoraPart::kBaseCopy);
      b.set_buffer(j, name);
      const BufferDecl* decl = base.buffers.Find(w.buffer(j));
      if (decl != nullptr && !copy_buffers.contains(name)) {
        BufferDecl copy = *decl;
        copy.name = name;
        copy.dtype = t.dtype;
        copy_buffers.emplace(name, std::move(copy));
      }
    }
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, b.Finalize());
    doc.params.emplace_back(t.name, std::move(map));
    dtypes.push_back(t.dtype);
  }
  BufferSetBuilder buffers;
  for (const auto& [name, buf] : lora_buffers) buffers.add(LoraBufferDecl(name, buf));
  for (auto& [name, decl] : copy_buffers) buffers.add(std::move(decl));
  std::vector<NamedMapRef> refs;
  for (const auto& [name, map] : doc.params) refs.push_back({name, &map});
  Result<BufferSet> set = buffers.Finalize(refs, dtypes);
  if (!set.ok()) {
    return FailedPreconditionError(
        fmt::format("the adapter's buffers beside the base's do not come out exact: {}",
                    set.status().message()));
  }
  doc.buffers = *std::move(set);
  return doc;
}

}  // namespace reshard
