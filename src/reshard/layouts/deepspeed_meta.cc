#include "reshard/layouts/deepspeed_meta.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "reshard/base/json_reader.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_json_value.h"

namespace reshard {

using json::CheckKeys;
using json::Element;
using json::ErrorAt;
using json::Json;
using json::Member;
using json::ReadBool;
using json::ReadInt;
using json::ReadIntArray;
using json::TypeError;

namespace {

const std::vector<std::string> kKeys = {
    // AutoTP restore metadata (deepspeed/module_inject/layers.py)
    "universal_checkpoint_version", "partition_type", "partition_dim", "logical_shape",
    "output_shape", "sub_param_shape", "sub_param_sizes", "sub_param_shard_widths",
    "partition_sizes", "target_partition_shape", "original_shape", "is_bias", "replicated",
    "unsupported_reason", "conversion",
    // universal checkpoint per-parameter keys and model-level vocabulary sizes
    "cat_dim", "param_n_sub_params", "vocab_tensor", "original_vocab_size", "padded_vocab_size",
    // the parameter_to_average_patterns category; a name for messages
    "average", "name"};

// A JSON value that is absent or null.
const Json* Get(const Json& object, std::string_view key) {
  auto it = object.find(std::string(key));
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

Result<std::optional<Index>> OptInt(const Json& object, std::string_view key, Index min) {
  const Json* j = Get(object, key);
  if (j == nullptr) return std::optional<Index>();
  RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(*j, key, min));
  return std::optional<Index>(v);
}

Result<bool> OptBool(const Json& object, std::string_view key) {
  const Json* j = Get(object, key);
  if (j == nullptr) return false;
  return ReadBool(*j, key);
}

Result<std::optional<Shape>> OptShape(const Json& object, std::string_view key) {
  const Json* j = Get(object, key);
  if (j == nullptr) return std::optional<Shape>();
  RESHARD_ASSIGN_OR_RETURN(Shape s, ReadIntArray(*j, key, 0));
  return std::optional<Shape>(std::move(s));
}

// DeepSpeed's sub_param_shape: a view spec whose partition_dim entry is a list of
// sub-parameter sizes or a count of equal ones, other entries positive or -1 (inferred);
// or the universal checkpoint's SubparamShape form {"shape": [...], "partition_dim": d}.
struct SubParamShape {
  std::vector<std::optional<Index>> dims;  // nullopt: -1
  std::vector<Index> sizes;                // at partition_dim, when given as sizes
  std::optional<Index> count;              // at partition_dim, when given as a count
  std::optional<Index> partition_dim;      // from the SubparamShape form
};

Result<SubParamShape> ReadSubParamShape(const Json& j, std::string_view path,
                                        std::optional<Index> dim) {
  SubParamShape out;
  const Json* spec = &j;
  std::string spec_path(path);
  if (j.is_object()) {
    RESHARD_RETURN_IF_ERROR(
        CheckKeys(j, path, {"shape", "partition_dim", "patterns"}, "a SubparamShape"));
    const Json* pd = Get(j, "partition_dim");
    if (pd == nullptr) return ErrorAt(path, "missing key \"partition_dim\"");
    RESHARD_ASSIGN_OR_RETURN(Index d, ReadInt(*pd, Member(path, "partition_dim"), 0));
    out.partition_dim = d;
    dim = d;
    spec = Get(j, "shape");
    spec_path = Member(path, "shape");
    if (spec == nullptr) return ErrorAt(path, "missing key \"shape\"");
  }
  if (!spec->is_array()) return TypeError(spec_path, "an array (a view spec)", *spec);
  if (!dim) return ErrorAt(path, "a sub_param_shape needs \"partition_dim\"");
  if (*dim >= static_cast<Index>(spec->size())) {
    return ErrorAt(path, fmt::format("partition_dim {} is outside a spec of {} dimensions", *dim,
                                     spec->size()));
  }
  for (size_t k = 0; k < spec->size(); ++k) {
    const Json& e = (*spec)[k];
    const std::string p = Element(spec_path, k);
    if (static_cast<Index>(k) == *dim && e.is_array()) {
      RESHARD_ASSIGN_OR_RETURN(out.sizes, ReadIntArray(e, p, 1));
      if (out.sizes.empty()) return ErrorAt(p, "expected at least one sub-parameter size");
      out.dims.push_back(std::accumulate(out.sizes.begin(), out.sizes.end(), Index{0}));
      continue;
    }
    if (e.is_number_integer() && e.get_ptr<const Json::number_integer_t*>() != nullptr &&
        *e.get_ptr<const Json::number_integer_t*>() == -1) {
      out.dims.push_back(std::nullopt);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(e, p, 1));
    if (static_cast<Index>(k) == *dim) {
      out.count = v;
      out.dims.push_back(std::nullopt);
    } else {
      out.dims.push_back(v);
    }
  }
  return out;
}

Result<std::vector<std::vector<Index>>> ReadWidths(const Json& j, std::string_view path) {
  if (!j.is_array() || j.empty())
    return TypeError(path, "one array of per-rank widths per sub-parameter", j);
  std::vector<std::vector<Index>> out;
  for (size_t k = 0; k < j.size(); ++k) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Index> w, ReadIntArray(j[k], Element(path, k), 0));
    if (w.empty() || (!out.empty() && w.size() != out[0].size())) {
      return ErrorAt(Element(path, k),
                     fmt::format("has widths for {} ranks, but {} has {}", w.size(),
                                 Element(path, 0), out.empty() ? 0 : out[0].size()));
    }
    out.push_back(std::move(w));
  }
  return out;
}

Status CheckDimInShape(Index dim, const Shape& shape, std::string_view key) {
  if (dim >= static_cast<Index>(shape.size())) {
    return ErrorAt(key,
                   fmt::format("dimension {} is outside the shape {}", dim, FormatShape(shape)));
  }
  return Status::Ok();
}

Result<LoweredDeepSpeedMeta> Lower(const Json& meta) {
  if (!meta.is_object()) return TypeError("", "a metadata object", meta);
  RESHARD_RETURN_IF_ERROR(CheckKeys(meta, "", kKeys, "DeepSpeed parameter metadata"));
  LoweredDeepSpeedMeta out;

  // DeepSpeed's own verdict that it cannot describe the layout.
  const Json* conversion = Get(meta, "conversion");
  if (conversion != nullptr && !conversion->is_object())
    return TypeError("conversion", "an object", *conversion);
  for (const Json* where : {&meta, conversion}) {
    if (where == nullptr) continue;
    if (const Json* reason = Get(*where, "unsupported_reason")) {
      const std::string p = where == &meta ? "unsupported_reason" : "conversion.unsupported_reason";
      if (!reason->is_string()) return TypeError(p, "a string", *reason);
      return FailedPreconditionError(
          fmt::format("DeepSpeed recorded that it cannot describe this parameter's layout ({}: "
                      "{}); no map can be "
                      "derived from its metadata",
                      p, *reason->get_ptr<const Json::string_t*>()));
    }
  }

  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> logical, OptShape(meta, "logical_shape"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> original, OptShape(meta, "original_shape"));
  if (logical && original && ProductOf(*logical) != ProductOf(*original)) {
    return ErrorAt("original_shape", fmt::format("{} has {} elements but logical_shape {} has {}",
                                                 FormatShape(*original), ProductOf(*original),
                                                 FormatShape(*logical), ProductOf(*logical)));
  }
  std::optional<Shape> shape = logical ? logical : original;
  const std::string shape_key = logical ? "logical_shape" : "original_shape";

  RESHARD_ASSIGN_OR_RETURN(bool average, OptBool(meta, "average"));
  RESHARD_ASSIGN_OR_RETURN(bool replicated, OptBool(meta, "replicated"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> partition_dim, OptInt(meta, "partition_dim", 0));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> partition_sizes, OptShape(meta, "partition_sizes"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> sub_sizes, OptShape(meta, "sub_param_sizes"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> cat_dim, OptInt(meta, "cat_dim", 0));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> n_sub, OptInt(meta, "param_n_sub_params", 1));
  RESHARD_ASSIGN_OR_RETURN(bool vocab, OptBool(meta, "vocab_tensor"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> original_vocab,
                           OptInt(meta, "original_vocab_size", 1));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> padded_vocab, OptInt(meta, "padded_vocab_size", 1));
  for (const char* key : {"is_bias"}) RESHARD_RETURN_IF_ERROR(OptBool(meta, key).status());
  for (const char* key : {"output_shape", "target_partition_shape"}) {
    RESHARD_RETURN_IF_ERROR(OptShape(meta, key).status());
  }
  double uc_version = 0.0;
  if (const Json* v = Get(meta, "universal_checkpoint_version")) {
    if (!v->is_number()) return TypeError("universal_checkpoint_version", "a number", *v);
    uc_version = v->get<double>();
  }
  std::optional<SubParamShape> sub_shape;
  if (const Json* s = Get(meta, "sub_param_shape")) {
    RESHARD_ASSIGN_OR_RETURN(SubParamShape parsed,
                             ReadSubParamShape(*s, "sub_param_shape", partition_dim));
    if (parsed.partition_dim) {
      if (partition_dim && *partition_dim != *parsed.partition_dim) {
        return ErrorAt("sub_param_shape.partition_dim",
                       fmt::format("{} disagrees with partition_dim {}", *parsed.partition_dim,
                                   *partition_dim));
      }
      partition_dim = parsed.partition_dim;
    }
    sub_shape = std::move(parsed);
  }
  std::optional<std::vector<std::vector<Index>>> widths;
  if (const Json* w = Get(meta, "sub_param_shard_widths")) {
    RESHARD_ASSIGN_OR_RETURN(widths, ReadWidths(*w, "sub_param_shard_widths"));
  }
  const bool autotp = partition_dim || partition_sizes || sub_sizes || sub_shape || widths;

  // The shape, resolved from the sub-parameter spec when nothing else gives it.
  if (!shape && sub_shape) {
    Shape s;
    for (size_t k = 0; k < sub_shape->dims.size(); ++k) {
      if (!sub_shape->dims[k]) {
        return ErrorAt("sub_param_shape",
                       fmt::format("dimension {} is inferred (-1 or a count), so the "
                                   "metadata needs \"logical_shape\"",
                                   k));
      }
      s.push_back(*sub_shape->dims[k]);
    }
    shape = s;
  }
  if (!shape) {
    return ErrorAt("",
                   "missing key \"logical_shape\" (or \"original_shape\"): the parameter's shape");
  }
  out.shape = *shape;

  if (average) {
    if (autotp || cat_dim || n_sub || vocab) {
      return ErrorAt("average",
                     "an averaged parameter is held whole by every rank; it cannot also be "
                     "partitioned");
    }
    out.descriptor.family = LayoutFamily::kReplicated;
    out.notes.push_back(
        "DeepSpeed's converter averages this parameter across ranks, which no map can express; it "
        "is "
        "lowered to a replicated map, so reading its shards checks that the replicas agree (and "
        "refuses them if they differ) instead of averaging");
    return out;
  }
  if (replicated) {
    if (partition_dim || partition_sizes || widths) {
      return ErrorAt("replicated",
                     "a replicated parameter has no partition_dim, partition_sizes or "
                     "sub_param_shard_widths");
    }
    out.descriptor.family = LayoutFamily::kReplicated;
    return out;
  }

  if (autotp) {
    if (original_vocab && *original_vocab != (*shape)[0]) {
      return ErrorAt("original_vocab_size",
                     fmt::format("{} disagrees with the {} rows of {} {}", *original_vocab,
                                 (*shape)[0], shape_key, FormatShape(*shape)));
    }
    if (!partition_dim)
      return ErrorAt("", "partition sizes or sub-parameters need \"partition_dim\"");
    RESHARD_RETURN_IF_ERROR(CheckDimInShape(*partition_dim, *shape, "partition_dim"));
    const Index extent = (*shape)[static_cast<size_t>(*partition_dim)];
    out.descriptor.dim = static_cast<int>(*partition_dim);
    if (sub_shape) {
      for (size_t k = 0; k < sub_shape->dims.size() && sub_shape->dims.size() == shape->size();
           ++k) {
        if (sub_shape->dims[k] && *sub_shape->dims[k] != (*shape)[k]) {
          return ErrorAt("sub_param_shape",
                         fmt::format("dimension {} is {} but {} {} has {}", k, *sub_shape->dims[k],
                                     shape_key, FormatShape(*shape), (*shape)[k]));
        }
      }
    }
    // Sub-parameter sizes: sub_param_sizes, else the spec's sizes, else its count, else the widths.
    std::optional<std::vector<Index>> sizes = sub_sizes;
    if (!sizes && sub_shape && !sub_shape->sizes.empty()) sizes = sub_shape->sizes;
    if (!sizes && sub_shape && sub_shape->count) {
      if (extent % *sub_shape->count != 0) {
        return ErrorAt("sub_param_shape", fmt::format("{} indices are not {} equal sub-parameters",
                                                      extent, *sub_shape->count));
      }
      sizes =
          std::vector<Index>(static_cast<size_t>(*sub_shape->count), extent / *sub_shape->count);
    }
    if (!sizes && widths) {
      sizes.emplace();
      for (const auto& w : *widths) sizes->push_back(std::accumulate(w.begin(), w.end(), Index{0}));
    }
    if (sizes) {
      const Index sum = std::accumulate(sizes->begin(), sizes->end(), Index{0});
      if (sum != extent) {
        return ErrorAt(
            sub_sizes ? "sub_param_sizes" : "sub_param_shape",
            fmt::format("sub-parameter sizes [{}] sum to {}, but dimension {} of {} has {}",
                        fmt::join(*sizes, ", "), sum, *partition_dim, FormatShape(*shape), extent));
      }
      out.descriptor.family = LayoutFamily::kFused;
      if (widths) {
        if (widths->size() != sizes->size()) {
          return ErrorAt(
              "sub_param_shard_widths",
              fmt::format("has {} entries for {} sub-parameters", widths->size(), sizes->size()));
        }
        for (size_t k = 0; k < sizes->size(); ++k) {
          const auto& w = (*widths)[k];
          const Index wsum = std::accumulate(w.begin(), w.end(), Index{0});
          if (wsum != (*sizes)[k]) {
            return ErrorAt(Element("sub_param_shard_widths", k),
                           fmt::format("widths [{}] sum to {}, but sub-parameter {} has {}",
                                       fmt::join(w, ", "), wsum, k, (*sizes)[k]));
          }
          LayoutPart part;
          part.size = (*sizes)[k];
          part.widths = w;
          out.descriptor.parts.push_back(std::move(part));
        }
        out.recorded_world_size = static_cast<int>((*widths)[0].size());
      } else {
        if (uc_version >= 0.4) {
          return ErrorAt(
              "", fmt::format("universal checkpoint version {} records sub-parameters without "
                              "\"sub_param_shard_widths\"; their per-rank widths are unknown",
                              uc_version));
        }
        // Before 0.4 sub-parameters could only be split evenly.
        out.descriptor.rule.remainder = Remainder::kExact;
        for (Index s : *sizes) {
          LayoutPart part;
          part.size = s;
          out.descriptor.parts.push_back(std::move(part));
        }
      }
      return out;
    }
    out.descriptor.family = LayoutFamily::kSplit;
    if (partition_sizes) {
      const Index sum = std::accumulate(partition_sizes->begin(), partition_sizes->end(), Index{0});
      if (partition_sizes->empty() || sum != extent) {
        return ErrorAt("partition_sizes",
                       fmt::format("[{}] sum to {}, but dimension {} of {} has {}",
                                   fmt::join(*partition_sizes, ", "), sum, *partition_dim,
                                   FormatShape(*shape), extent));
      }
      out.descriptor.rule.sizes = *partition_sizes;
      out.recorded_world_size = static_cast<int>(partition_sizes->size());
    } else {
      out.descriptor.rule.remainder = Remainder::kExact;  // DeepSpeed's restore chunks evenly
    }
    return out;
  }

  // Legacy universal-checkpoint categories: concatenated along cat_dim, restored by chunking.
  const Index dim = cat_dim.value_or(0);
  RESHARD_RETURN_IF_ERROR(CheckDimInShape(dim, *shape, cat_dim ? "cat_dim" : "logical_shape"));
  out.descriptor.dim = static_cast<int>(dim);
  out.descriptor.rule.remainder = Remainder::kExact;
  if (vocab) {
    if (dim != 0)
      return ErrorAt("cat_dim", "a vocabulary tensor is padded and split along dimension 0");
    Index rows = (*shape)[0];
    if (original_vocab) {
      if (*original_vocab > rows) {
        return ErrorAt("original_vocab_size",
                       fmt::format("{} is more than the {} rows of {} {}", *original_vocab, rows,
                                   shape_key, FormatShape(*shape)));
      }
      // A shape with more rows than the vocabulary is the padded one.
      if (rows > *original_vocab) {
        if (padded_vocab && *padded_vocab != rows) {
          return ErrorAt("padded_vocab_size", fmt::format("{} disagrees with the {} rows of {}",
                                                          *padded_vocab, rows, shape_key));
        }
        padded_vocab = rows;
      }
      out.shape[0] = *original_vocab;
    }
    if (padded_vocab && *padded_vocab < out.shape[0]) {
      return ErrorAt("padded_vocab_size",
                     fmt::format("{} is less than the {} rows of the vocabulary", *padded_vocab,
                                 out.shape[0]));
    }
    out.descriptor.family = LayoutFamily::kPaddedVocab;
    out.descriptor.rule = {};
    out.descriptor.padded_size = padded_vocab;
    return out;
  }
  if (original_vocab || padded_vocab) {
    return ErrorAt(original_vocab ? "original_vocab_size" : "padded_vocab_size",
                   "vocabulary sizes apply only to a tensor with \"vocab_tensor\": true");
  }
  if (n_sub && *n_sub > 1) {
    out.descriptor.family = LayoutFamily::kFused;
    out.descriptor.equal_parts = *n_sub;
    if ((*shape)[static_cast<size_t>(dim)] % *n_sub != 0) {
      return ErrorAt("param_n_sub_params", fmt::format("{} indices are not {} equal sub-parameters",
                                                       (*shape)[static_cast<size_t>(dim)], *n_sub));
    }
    return out;
  }
  if (cat_dim) {
    out.descriptor.family = LayoutFamily::kSplit;
    return out;
  }
  return ErrorAt(
      "",
      "the metadata does not say how the parameter is laid out: expected \"replicated\", "
      "\"average\", \"partition_dim\" (with partition_sizes or sub-parameters), \"cat_dim\" "
      "or \"vocab_tensor\"");
}

}  // namespace

Result<LoweredDeepSpeedMeta> LowerDeepSpeedMeta(std::string_view meta_json) {
  RESHARD_ASSIGN_OR_RETURN(Json meta, json::ParseJson(meta_json));
  return Lower(meta);
}

Result<ParamMap> DeepSpeedMetaMap(std::string_view meta_json, int world_size,
                                  std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(Json meta, json::ParseJson(meta_json));
  std::optional<ParamMap> recorded;
  if (meta.is_object()) {
    auto conversion = meta.find("conversion");
    if (conversion != meta.end() && conversion->is_object()) {
      auto map = conversion->find("affine_map");
      if (map != conversion->end() && !map->is_null()) {
        // DeepSpeed's builders give a rank that holds nothing a zero-element piece whose shard
        // strides can repeat an index (shard [12, 0] has strides [0, 1]); it holds nothing
        // either way, so it is dropped before validation.
        Json cleaned = *map;
        if (auto ranks = cleaned.find("ranks"); ranks != cleaned.end() && ranks->is_object()) {
          for (auto& rank : *ranks) {
            auto pieces = rank.is_object() ? rank.find("pieces") : rank.end();
            if (pieces == rank.end() || !pieces->is_array()) continue;
            Json kept = Json::array();
            for (const Json& piece : *pieces) {
              auto shape = piece.is_object() ? piece.find("shape") : piece.end();
              const bool empty = shape != piece.end() && shape->is_array() &&
                                 std::any_of(shape->begin(), shape->end(), [](const Json& e) {
                                   return e.is_number_integer() && e == 0;
                                 });
              if (!empty) kept.push_back(piece);
            }
            *pieces = std::move(kept);
          }
        }
        Result<ParamMapBuilder> b = ParamMapFromJson(cleaned);
        if (!b.ok()) return b.status().Annotate("conversion.affine_map");
        Result<ParamMap> m = b->Finalize();
        if (!m.ok()) return m.status().Annotate("conversion.affine_map");
        RESHARD_ASSIGN_OR_RETURN(ParamMap canonical, Canonicalize(*m));
        recorded = std::move(canonical);
      }
    }
  }
  Result<LoweredDeepSpeedMeta> lowered = Lower(meta);
  if (!lowered.ok()) {
    // Layouts DeepSpeed describes only by their map (Yuan, CodeGen) carry a partition_dim
    // and nothing else; the lowering reads them as an even split, which the map overrides.
    if (recorded && recorded->world_size() == world_size) return *recorded;
    return lowered.status();
  }
  const bool has_rule =
      lowered->descriptor.family != LayoutFamily::kSplit || !lowered->descriptor.rule.sizes.empty();
  if (recorded && !has_rule) {
    if (recorded->world_size() == world_size) return *recorded;
    return FailedPreconditionError(fmt::format(
        "DeepSpeed describes this parameter only by an affine map for {} ranks, with no rule to "
        "lay it "
        "out at {}; write a layout descriptor for it (docs/layouts.md) and use `reshard layout "
        "DESCRIPTOR.json`",
        recorded->world_size(), world_size));
  }
  if (notes != nullptr) *notes = lowered->notes;
  RESHARD_ASSIGN_OR_RETURN(ParamMap map, BuildMap(lowered->descriptor, lowered->shape, world_size));
  if (recorded && recorded->world_size() == world_size &&
      ParamMapToJson(*recorded) != ParamMapToJson(map)) {
    return InvalidArgumentError(
        "the metadata's fields and its recorded conversion.affine_map describe different layouts");
  }
  return map;
}

}  // namespace reshard
