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

// DeepSpeed's own verdict that it cannot describe the layout, at the top level or under
// "conversion".
Status CheckSupported(const Json& meta) {
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
  return Status::Ok();
}

// The metadata's fields, type-checked; how they combine is decided by the Lower* steps.
struct MetaFields {
  std::optional<Shape> shape;  // logical_shape, else original_shape, else the spec's
  std::string shape_key;       // which key gave it
  bool average = false;
  bool replicated = false;
  bool vocab = false;
  std::optional<Index> partition_dim;
  std::optional<Shape> partition_sizes;
  std::optional<Shape> sub_sizes;
  std::optional<Index> cat_dim;
  std::optional<Index> n_sub;
  std::optional<Index> original_vocab;
  std::optional<Index> padded_vocab;
  double uc_version = 0.0;
  std::optional<SubParamShape> sub_shape;
  std::optional<std::vector<std::vector<Index>>> widths;

  // AutoTP's restore metadata, rather than the universal checkpoint's legacy categories.
  bool autotp() const {
    return partition_dim || partition_sizes || sub_sizes || sub_shape || widths;
  }
};

Status ReadShapes(const Json& meta, MetaFields& f) {
  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> logical, OptShape(meta, "logical_shape"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Shape> original, OptShape(meta, "original_shape"));
  if (logical && original && ProductOf(*logical) != ProductOf(*original)) {
    return ErrorAt("original_shape", fmt::format("{} has {} elements but logical_shape {} has {}",
                                                 FormatShape(*original), ProductOf(*original),
                                                 FormatShape(*logical), ProductOf(*logical)));
  }
  f.shape = logical ? logical : original;
  f.shape_key = logical ? "logical_shape" : "original_shape";
  return Status::Ok();
}

Status ReadSubParams(const Json& meta, MetaFields& f) {
  if (const Json* s = Get(meta, "sub_param_shape")) {
    RESHARD_ASSIGN_OR_RETURN(SubParamShape parsed,
                             ReadSubParamShape(*s, "sub_param_shape", f.partition_dim));
    if (parsed.partition_dim) {
      if (f.partition_dim && *f.partition_dim != *parsed.partition_dim) {
        return ErrorAt("sub_param_shape.partition_dim",
                       fmt::format("{} disagrees with partition_dim {}", *parsed.partition_dim,
                                   *f.partition_dim));
      }
      f.partition_dim = parsed.partition_dim;
    }
    f.sub_shape = std::move(parsed);
  }
  if (const Json* w = Get(meta, "sub_param_shard_widths")) {
    RESHARD_ASSIGN_OR_RETURN(f.widths, ReadWidths(*w, "sub_param_shard_widths"));
  }
  return Status::Ok();
}

// The shape from the sub-parameter spec when nothing else gives it.
Status ResolveShape(MetaFields& f) {
  if (!f.shape && f.sub_shape) {
    Shape s;
    for (size_t k = 0; k < f.sub_shape->dims.size(); ++k) {
      if (!f.sub_shape->dims[k]) {
        return ErrorAt("sub_param_shape",
                       fmt::format("dimension {} is inferred (-1 or a count), so the "
                                   "metadata needs \"logical_shape\"",
                                   k));
      }
      s.push_back(*f.sub_shape->dims[k]);
    }
    f.shape = s;
  }
  if (!f.shape) {
    return ErrorAt("",
                   "missing key \"logical_shape\" (or \"original_shape\"): the parameter's shape");
  }
  return Status::Ok();
}

Result<MetaFields> ReadMetaFields(const Json& meta) {
  MetaFields f;
  RESHARD_RETURN_IF_ERROR(ReadShapes(meta, f));
  RESHARD_ASSIGN_OR_RETURN(f.average, OptBool(meta, "average"));
  RESHARD_ASSIGN_OR_RETURN(f.replicated, OptBool(meta, "replicated"));
  RESHARD_ASSIGN_OR_RETURN(f.partition_dim, OptInt(meta, "partition_dim", 0));
  RESHARD_ASSIGN_OR_RETURN(f.partition_sizes, OptShape(meta, "partition_sizes"));
  RESHARD_ASSIGN_OR_RETURN(f.sub_sizes, OptShape(meta, "sub_param_sizes"));
  RESHARD_ASSIGN_OR_RETURN(f.cat_dim, OptInt(meta, "cat_dim", 0));
  RESHARD_ASSIGN_OR_RETURN(f.n_sub, OptInt(meta, "param_n_sub_params", 1));
  RESHARD_ASSIGN_OR_RETURN(f.vocab, OptBool(meta, "vocab_tensor"));
  RESHARD_ASSIGN_OR_RETURN(f.original_vocab, OptInt(meta, "original_vocab_size", 1));
  RESHARD_ASSIGN_OR_RETURN(f.padded_vocab, OptInt(meta, "padded_vocab_size", 1));
  for (const char* key : {"is_bias"}) RESHARD_RETURN_IF_ERROR(OptBool(meta, key).status());
  for (const char* key : {"output_shape", "target_partition_shape"}) {
    RESHARD_RETURN_IF_ERROR(OptShape(meta, key).status());
  }
  if (const Json* v = Get(meta, "universal_checkpoint_version")) {
    if (!v->is_number()) return TypeError("universal_checkpoint_version", "a number", *v);
    f.uc_version = v->get<double>();
  }
  RESHARD_RETURN_IF_ERROR(ReadSubParams(meta, f));
  RESHARD_RETURN_IF_ERROR(ResolveShape(f));
  return f;
}

// Sub-parameter sizes: sub_param_sizes, else the spec's sizes, else its count, else the
// widths' sums; nullopt when the metadata has no sub-parameters.
Result<std::optional<std::vector<Index>>> SubParamSizes(const MetaFields& f, Index extent) {
  std::optional<std::vector<Index>> sizes = f.sub_sizes;
  if (!sizes && f.sub_shape && !f.sub_shape->sizes.empty()) sizes = f.sub_shape->sizes;
  if (!sizes && f.sub_shape && f.sub_shape->count) {
    if (extent % *f.sub_shape->count != 0) {
      return ErrorAt("sub_param_shape", fmt::format("{} indices are not {} equal sub-parameters",
                                                    extent, *f.sub_shape->count));
    }
    sizes =
        std::vector<Index>(static_cast<size_t>(*f.sub_shape->count), extent / *f.sub_shape->count);
  }
  if (!sizes && f.widths) {
    sizes.emplace();
    for (const auto& w : *f.widths) sizes->push_back(std::accumulate(w.begin(), w.end(), Index{0}));
  }
  if (sizes) {
    const Index sum = std::accumulate(sizes->begin(), sizes->end(), Index{0});
    if (sum != extent) {
      return ErrorAt(
          f.sub_sizes ? "sub_param_sizes" : "sub_param_shape",
          fmt::format("sub-parameter sizes [{}] sum to {}, but dimension {} of {} has {}",
                      fmt::join(*sizes, ", "), sum, *f.partition_dim, FormatShape(*f.shape),
                      extent));
    }
  }
  return sizes;
}

// Sub-parameters of `sizes`: fused, each part with its recorded widths, or (before
// universal checkpoint 0.4, which has none) split evenly.
Status LowerSubParams(const MetaFields& f, const std::vector<Index>& sizes,
                      LoweredDeepSpeedMeta& out) {
  out.descriptor.family = LayoutFamily::kFused;
  if (!f.widths) {
    if (f.uc_version >= 0.4) {
      return ErrorAt("",
                     fmt::format("universal checkpoint version {} records sub-parameters without "
                                 "\"sub_param_shard_widths\"; their per-rank widths are unknown",
                                 f.uc_version));
    }
    out.descriptor.rule.remainder = Remainder::kExact;
    for (Index s : sizes) {
      LayoutPart part;
      part.size = s;
      out.descriptor.parts.push_back(std::move(part));
    }
    return Status::Ok();
  }
  if (f.widths->size() != sizes.size()) {
    return ErrorAt("sub_param_shard_widths", fmt::format("has {} entries for {} sub-parameters",
                                                         f.widths->size(), sizes.size()));
  }
  for (size_t k = 0; k < sizes.size(); ++k) {
    const auto& w = (*f.widths)[k];
    const Index wsum = std::accumulate(w.begin(), w.end(), Index{0});
    if (wsum != sizes[k]) {
      return ErrorAt(Element("sub_param_shard_widths", k),
                     fmt::format("widths [{}] sum to {}, but sub-parameter {} has {}",
                                 fmt::join(w, ", "), wsum, k, sizes[k]));
    }
    LayoutPart part;
    part.size = sizes[k];
    part.widths = w;
    out.descriptor.parts.push_back(std::move(part));
  }
  out.recorded_world_size = static_cast<int>((*f.widths)[0].size());
  return Status::Ok();
}

Status CheckSubParamShape(const MetaFields& f) {
  if (!f.sub_shape || f.sub_shape->dims.size() != f.shape->size()) return Status::Ok();
  for (size_t k = 0; k < f.sub_shape->dims.size(); ++k) {
    if (f.sub_shape->dims[k] && *f.sub_shape->dims[k] != (*f.shape)[k]) {
      return ErrorAt("sub_param_shape",
                     fmt::format("dimension {} is {} but {} {} has {}", k, *f.sub_shape->dims[k],
                                 f.shape_key, FormatShape(*f.shape), (*f.shape)[k]));
    }
  }
  return Status::Ok();
}

// AutoTP's metadata: a split along partition_dim, by sub-parameters or recorded sizes.
Status LowerAutoTp(const MetaFields& f, LoweredDeepSpeedMeta& out) {
  const Shape& shape = *f.shape;
  if (f.original_vocab && *f.original_vocab != shape[0]) {
    return ErrorAt("original_vocab_size",
                   fmt::format("{} disagrees with the {} rows of {} {}", *f.original_vocab,
                               shape[0], f.shape_key, FormatShape(shape)));
  }
  if (!f.partition_dim)
    return ErrorAt("", "partition sizes or sub-parameters need \"partition_dim\"");
  RESHARD_RETURN_IF_ERROR(CheckDimInShape(*f.partition_dim, shape, "partition_dim"));
  const Index extent = shape[static_cast<size_t>(*f.partition_dim)];
  out.descriptor.dim = static_cast<int>(*f.partition_dim);
  RESHARD_RETURN_IF_ERROR(CheckSubParamShape(f));
  RESHARD_ASSIGN_OR_RETURN(std::optional<std::vector<Index>> sizes, SubParamSizes(f, extent));
  if (sizes) return LowerSubParams(f, *sizes, out);
  out.descriptor.family = LayoutFamily::kSplit;
  if (!f.partition_sizes) {
    out.descriptor.rule.remainder = Remainder::kExact;  // DeepSpeed's restore chunks evenly
    return Status::Ok();
  }
  const Index sum = std::accumulate(f.partition_sizes->begin(), f.partition_sizes->end(), Index{0});
  if (f.partition_sizes->empty() || sum != extent) {
    return ErrorAt("partition_sizes", fmt::format("[{}] sum to {}, but dimension {} of {} has {}",
                                                  fmt::join(*f.partition_sizes, ", "), sum,
                                                  *f.partition_dim, FormatShape(shape), extent));
  }
  out.descriptor.rule.sizes = *f.partition_sizes;
  out.recorded_world_size = static_cast<int>(f.partition_sizes->size());
  return Status::Ok();
}

// A vocabulary tensor: padded to padded_vocab_size (or the rows of a shape larger than the
// vocabulary) and split along dimension 0.
Status LowerVocab(const MetaFields& f, Index dim, LoweredDeepSpeedMeta& out) {
  if (dim != 0)
    return ErrorAt("cat_dim", "a vocabulary tensor is padded and split along dimension 0");
  const Index rows = (*f.shape)[0];
  std::optional<Index> padded_vocab = f.padded_vocab;
  if (f.original_vocab) {
    if (*f.original_vocab > rows) {
      return ErrorAt("original_vocab_size",
                     fmt::format("{} is more than the {} rows of {} {}", *f.original_vocab, rows,
                                 f.shape_key, FormatShape(*f.shape)));
    }
    // A shape with more rows than the vocabulary is the padded one.
    if (rows > *f.original_vocab) {
      if (padded_vocab && *padded_vocab != rows) {
        return ErrorAt("padded_vocab_size", fmt::format("{} disagrees with the {} rows of {}",
                                                        *padded_vocab, rows, f.shape_key));
      }
      padded_vocab = rows;
    }
    out.shape[0] = *f.original_vocab;
  }
  if (padded_vocab && *padded_vocab < out.shape[0]) {
    return ErrorAt("padded_vocab_size", fmt::format("{} is less than the {} rows of the vocabulary",
                                                    *padded_vocab, out.shape[0]));
  }
  out.descriptor.family = LayoutFamily::kPaddedVocab;
  out.descriptor.rule = {};
  out.descriptor.padded_size = padded_vocab;
  return Status::Ok();
}

// The universal checkpoint's legacy categories: concatenated along cat_dim, restored by
// chunking.
Status LowerLegacy(const MetaFields& f, LoweredDeepSpeedMeta& out) {
  const Shape& shape = *f.shape;
  const Index dim = f.cat_dim.value_or(0);
  RESHARD_RETURN_IF_ERROR(CheckDimInShape(dim, shape, f.cat_dim ? "cat_dim" : "logical_shape"));
  out.descriptor.dim = static_cast<int>(dim);
  out.descriptor.rule.remainder = Remainder::kExact;
  if (f.vocab) return LowerVocab(f, dim, out);
  if (f.original_vocab || f.padded_vocab) {
    return ErrorAt(f.original_vocab ? "original_vocab_size" : "padded_vocab_size",
                   "vocabulary sizes apply only to a tensor with \"vocab_tensor\": true");
  }
  if (f.n_sub && *f.n_sub > 1) {
    out.descriptor.family = LayoutFamily::kFused;
    out.descriptor.equal_parts = *f.n_sub;
    if (shape[static_cast<size_t>(dim)] % *f.n_sub != 0) {
      return ErrorAt("param_n_sub_params", fmt::format("{} indices are not {} equal sub-parameters",
                                                       shape[static_cast<size_t>(dim)], *f.n_sub));
    }
    return Status::Ok();
  }
  if (f.cat_dim) {
    out.descriptor.family = LayoutFamily::kSplit;
    return Status::Ok();
  }
  return ErrorAt(
      "",
      "the metadata does not say how the parameter is laid out: expected \"replicated\", "
      "\"average\", \"partition_dim\" (with partition_sizes or sub-parameters), \"cat_dim\" "
      "or \"vocab_tensor\"");
}

Result<LoweredDeepSpeedMeta> Lower(const Json& meta) {
  if (!meta.is_object()) return TypeError("", "a metadata object", meta);
  RESHARD_RETURN_IF_ERROR(CheckKeys(meta, "", kKeys, "DeepSpeed parameter metadata"));
  RESHARD_RETURN_IF_ERROR(CheckSupported(meta));
  RESHARD_ASSIGN_OR_RETURN(const MetaFields f, ReadMetaFields(meta));
  LoweredDeepSpeedMeta out;
  out.shape = *f.shape;
  if (f.average) {
    if (f.autotp() || f.cat_dim || f.n_sub || f.vocab) {
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
  if (f.replicated) {
    if (f.partition_dim || f.partition_sizes || f.widths) {
      return ErrorAt("replicated",
                     "a replicated parameter has no partition_dim, partition_sizes or "
                     "sub_param_shard_widths");
    }
    out.descriptor.family = LayoutFamily::kReplicated;
    return out;
  }
  RESHARD_RETURN_IF_ERROR(f.autotp() ? LowerAutoTp(f, out) : LowerLegacy(f, out));
  return out;
}

}  // namespace

Result<LoweredDeepSpeedMeta> LowerDeepSpeedMeta(std::string_view meta_json) {
  RESHARD_ASSIGN_OR_RETURN(Json meta, json::ParseJson(meta_json));
  return Lower(meta);
}

namespace {

// A map DeepSpeed recorded (ParamAffineMap.to_dict()), canonicalised. DeepSpeed's builders give
// a rank that holds nothing a zero-element piece whose shard strides can repeat an index
// (shard [12, 0] has strides [0, 1]); it holds nothing either way, so it is dropped before
// validation.
Result<ParamMap> RecordedAffineMap(const Json& map) {
  Json cleaned = map;
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
  RESHARD_ASSIGN_OR_RETURN(ParamMapBuilder b, ParamMapFromJson(cleaned));
  RESHARD_ASSIGN_OR_RETURN(ParamMap m, b.Finalize());
  return Canonicalize(m);
}

}  // namespace

Result<ParamMap> ReadDeepSpeedAffineMap(std::string_view map_json) {
  RESHARD_ASSIGN_OR_RETURN(Json j, json::ParseJson(map_json));
  return RecordedAffineMap(j);
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
        Result<ParamMap> canonical = RecordedAffineMap(*map);
        if (!canonical.ok()) return canonical.status().Annotate("conversion.affine_map");
        recorded = *std::move(canonical);
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
