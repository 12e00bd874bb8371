#include "reshard/layouts/descriptor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "reshard/base/json_reader.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/map_json_value.h"
#include "reshard/layouts/basic.h"
#include "reshard/layouts/descriptor_json.h"

namespace reshard {

using json::Json;

namespace {

// A world this large is a typo, and every family allocates per rank.
constexpr int kMaxWorldSize = 1 << 16;
// Counts of equal parts or blocks a map holds one piece per (block_gather, codegen_qkv,
// fused): beyond this the map is a typo that would not fit in memory.
constexpr Index kMaxBlocks = Index{1} << 20;
constexpr json::IntRange kBlockCount{1, kMaxBlocks};

struct FamilyInfo {
  LayoutFamily family;
  std::string_view name;
  std::vector<std::string> keys;
};

const std::vector<FamilyInfo>& Families() {
  static const std::vector<FamilyInfo> families = {
      {LayoutFamily::kReplicated, "replicated", {"family", "pre_divided"}},
      {LayoutFamily::kSplit, "split", {"family", "dim", "remainder", "heads", "grain", "sizes"}},
      {LayoutFamily::kFused, "fused", {"family", "dim", "remainder", "heads", "grain", "parts"}},
      {LayoutFamily::kSegmented,
       "segmented",
       {"family", "dim", "remainder", "heads", "grain", "parts"}},
      {LayoutFamily::kBlockGather,
       "block_gather",
       {"family", "dim", "pairing", "heads", "blocks", "rank_blocks"}},
      {LayoutFamily::kCodegenQkv, "codegen_qkv", {"family", "dim", "mp_num", "heads"}},
      {LayoutFamily::kPaddedVocab,
       "padded_vocab",
       {"family", "dim", "padded_size", "pad_multiple"}},
  };
  return families;
}

constexpr std::pair<Remainder, std::string_view> kRemainders[] = {
    {Remainder::kFront, "front"},
    {Remainder::kBack, "back"},
    {Remainder::kCeil, "ceil"},
    {Remainder::kExact, "exact"},
};

std::string NamesOf(auto&& range) {
  std::string out;
  for (const auto& [value, name] : range)
    out += fmt::format("{}\"{}\"", out.empty() ? "" : ", ", name);
  return out;
}

Result<std::optional<Index>> OptionalInt(const Json& object, std::string_view path,
                                         std::string_view key, json::IntRange range) {
  auto it = object.find(std::string(key));
  if (it == object.end()) return std::optional<Index>();
  RESHARD_ASSIGN_OR_RETURN(Index v, json::ReadInt(*it, json::Member(path, key), range));
  return std::optional<Index>(v);
}

Status ReadRule(const Json& object, std::string_view path, SplitRule& rule) {
  if (auto it = object.find("remainder"); it != object.end()) {
    const std::string p = json::Member(path, "remainder");
    if (!it->is_string()) return json::TypeError(p, "a string", *it);
    const auto& name = *it->get_ptr<const Json::string_t*>();
    auto found = std::find_if(std::begin(kRemainders), std::end(kRemainders),
                              [&](const auto& e) { return e.second == name; });
    if (found == std::end(kRemainders)) {
      return json::TypeError(p, fmt::format("one of {}", NamesOf(kRemainders)), *it);
    }
    rule.remainder = found->first;
  }
  RESHARD_ASSIGN_OR_RETURN(rule.heads, OptionalInt(object, path, "heads", json::kPositive));
  RESHARD_ASSIGN_OR_RETURN(rule.grain, OptionalInt(object, path, "grain", json::kPositive));
  if (rule.heads && rule.grain) {
    return json::ErrorAt(path,
                         "give \"heads\" or \"grain\", not both (heads align to whole heads, "
                         "grain to multiples of the grain)");
  }
  return Status::Ok();
}

Status ReadParts(const Json& object, std::string_view path, LayoutDescriptor& d) {
  auto it = object.find("parts");
  const std::string p = json::Member(path, "parts");
  if (it == object.end()) return json::ErrorAt(path, "missing key \"parts\"");
  if (it->is_number()) {
    RESHARD_ASSIGN_OR_RETURN(Index n, json::ReadInt(*it, p, kBlockCount));
    d.equal_parts = n;
    return Status::Ok();
  }
  if (!it->is_array() || it->empty()) {
    return json::TypeError(p, "a number of equal parts or a non-empty array of parts", *it);
  }
  for (size_t k = 0; k < it->size(); ++k) {
    const Json& j = (*it)[k];
    const std::string pp = json::Element(p, k);
    if (!j.is_object()) return json::TypeError(pp, "an object", j);
    std::vector<std::string> keys = {"size", "heads", "grain", "widths"};
    if (d.family == LayoutFamily::kSegmented) keys.push_back("replicated");
    RESHARD_RETURN_IF_ERROR(
        json::CheckKeys(j, pp, keys, fmt::format("a {} part", LayoutFamilyName(d.family))));
    LayoutPart part;
    auto size = j.find("size");
    if (size == j.end()) return json::ErrorAt(pp, "missing key \"size\"");
    RESHARD_ASSIGN_OR_RETURN(part.size, json::ReadInt(*size, json::Member(pp, "size"), 0));
    if (auto r = j.find("replicated"); r != j.end()) {
      RESHARD_ASSIGN_OR_RETURN(part.replicated, json::ReadBool(*r, json::Member(pp, "replicated")));
    }
    RESHARD_ASSIGN_OR_RETURN(part.heads, OptionalInt(j, pp, "heads", json::kPositive));
    RESHARD_ASSIGN_OR_RETURN(part.grain, OptionalInt(j, pp, "grain", json::kPositive));
    if (auto w = j.find("widths"); w != j.end()) {
      RESHARD_ASSIGN_OR_RETURN(part.widths, json::ReadIntArray(*w, json::Member(pp, "widths"), 0));
      if (part.widths.empty())
        return json::ErrorAt(json::Member(pp, "widths"), "expected one width per rank, got none");
    }
    const int rules = (part.heads ? 1 : 0) + (part.grain ? 1 : 0) + (part.widths.empty() ? 0 : 1);
    if (rules > 1)
      return json::ErrorAt(pp, "give at most one of \"heads\", \"grain\" and \"widths\"");
    if (part.replicated && rules > 0) {
      return json::ErrorAt(
          pp, "a replicated part is held whole by every rank: it takes no heads, grain or widths");
    }
    d.parts.push_back(std::move(part));
  }
  return Status::Ok();
}

Result<LayoutDescriptor> ParseDescriptor(const Json& root) {
  if (!root.is_object()) return json::TypeError("", "a layout descriptor object", root);
  auto fam = root.find("family");
  if (fam == root.end()) return json::ErrorAt("", "missing key \"family\"");
  std::string families;
  for (const FamilyInfo& f : Families())
    families += fmt::format("{}\"{}\"", families.empty() ? "" : ", ", f.name);
  if (!fam->is_string()) return json::TypeError("family", fmt::format("one of {}", families), *fam);
  const auto& name = *fam->get_ptr<const Json::string_t*>();
  auto info = std::find_if(Families().begin(), Families().end(),
                           [&](const FamilyInfo& f) { return f.name == name; });
  if (info == Families().end())
    return json::TypeError("family", fmt::format("one of {}", families), *fam);
  RESHARD_RETURN_IF_ERROR(
      json::CheckKeys(root, "", info->keys, fmt::format("family \"{}\"", name)));

  LayoutDescriptor d;
  d.family = info->family;
  if (auto it = root.find("dim"); it != root.end()) {
    RESHARD_ASSIGN_OR_RETURN(Index dim, json::ReadInt(*it, "dim", 0));
    if (dim > 64)
      return json::ErrorAt("dim", fmt::format("dimension {} is beyond any tensor's rank", dim));
    d.dim = static_cast<int>(dim);
  }
  switch (d.family) {
    case LayoutFamily::kReplicated: {
      if (auto it = root.find("pre_divided"); it != root.end()) {
        RESHARD_ASSIGN_OR_RETURN(d.pre_divided, json::ReadBool(*it, "pre_divided"));
      }
      break;
    }
    case LayoutFamily::kSplit: {
      RESHARD_RETURN_IF_ERROR(ReadRule(root, "", d.rule));
      if (auto it = root.find("sizes"); it != root.end()) {
        if (root.contains("remainder") || d.rule.heads || d.rule.grain) {
          return json::ErrorAt("sizes",
                               "explicit sizes take no \"remainder\", \"heads\" or \"grain\"");
        }
        RESHARD_ASSIGN_OR_RETURN(d.rule.sizes, json::ReadIntArray(*it, "sizes", 0));
        if (d.rule.sizes.empty())
          return json::ErrorAt("sizes", "expected one size per rank, got none");
      }
      break;
    }
    case LayoutFamily::kFused:
    case LayoutFamily::kSegmented: {
      RESHARD_RETURN_IF_ERROR(ReadRule(root, "", d.rule));
      RESHARD_RETURN_IF_ERROR(ReadParts(root, "", d));
      break;
    }
    case LayoutFamily::kBlockGather: {
      RESHARD_ASSIGN_OR_RETURN(d.rule.heads, OptionalInt(root, "", "heads", json::kPositive));
      RESHARD_ASSIGN_OR_RETURN(d.num_blocks, OptionalInt(root, "", "blocks", kBlockCount));
      auto pairing = root.find("pairing");
      auto ranks = root.find("rank_blocks");
      if ((pairing == root.end()) == (ranks == root.end())) {
        return json::ErrorAt("",
                             "give either \"pairing\": \"shared_qk\" with \"heads\", or \"blocks\" "
                             "with \"rank_blocks\"");
      }
      if (pairing != root.end()) {
        if (!pairing->is_string() || *pairing->get_ptr<const Json::string_t*>() != "shared_qk") {
          return json::TypeError("pairing", "\"shared_qk\"", *pairing);
        }
        if (!d.rule.heads) return json::ErrorAt("", "the shared_qk pairing needs \"heads\"");
        if (d.num_blocks)
          return json::ErrorAt("blocks", "the shared_qk pairing has one block per head");
        d.shared_qk = true;
      } else {
        if (!d.num_blocks)
          return json::ErrorAt("", "\"rank_blocks\" needs \"blocks\" (how many equal blocks)");
        if (d.rule.heads)
          return json::ErrorAt("heads", "\"heads\" belongs to the shared_qk pairing");
        if (!ranks->is_array() || ranks->empty()) {
          return json::TypeError("rank_blocks", "an array with one list of block ids per rank",
                                 *ranks);
        }
        for (size_t r = 0; r < ranks->size(); ++r) {
          RESHARD_ASSIGN_OR_RETURN(
              std::vector<Index> ids,
              json::ReadIntArray((*ranks)[r], json::Element("rank_blocks", r), 0));
          d.rank_blocks.push_back(std::move(ids));
        }
      }
      break;
    }
    case LayoutFamily::kCodegenQkv: {
      RESHARD_ASSIGN_OR_RETURN(d.rule.heads, OptionalInt(root, "", "heads", json::kPositive));
      if (auto it = root.find("mp_num"); it != root.end()) {
        RESHARD_ASSIGN_OR_RETURN(d.mp_num, json::ReadInt(*it, "mp_num", kBlockCount));
      }
      break;
    }
    case LayoutFamily::kPaddedVocab: {
      RESHARD_ASSIGN_OR_RETURN(d.padded_size, OptionalInt(root, "", "padded_size", json::kCount));
      if (auto it = root.find("pad_multiple"); it != root.end()) {
        if (d.padded_size)
          return json::ErrorAt("pad_multiple",
                               "give \"padded_size\" or \"pad_multiple\", not both");
        RESHARD_ASSIGN_OR_RETURN(d.pad_multiple, json::ReadInt(*it, "pad_multiple", 1));
      }
      break;
    }
  }
  return d;
}

// ---------------------------------------------------------------------------------------
// Building maps.

std::string UnitsName(Index n, const SplitRule& rule) {
  if (rule.heads) return fmt::format("{} head{}", n, n == 1 ? "" : "s");
  if (rule.grain && *rule.grain > 1) return fmt::format("{} grains of {}", n, *rule.grain);
  return fmt::format("{} ind{}", n, n == 1 ? "ex" : "ices");
}

// a * b for counts the descriptor multiplies; FailedPrecondition naming both when the product
// leaves the 2^62 range.
Result<Index> Product(Index a, Index b, std::string_view what) {
  std::optional<Index> product = CheckedMul(a, b);
  if (!product) {
    return FailedPreconditionError(fmt::format("{}: {} x {} is more than 2^62", what, a, b));
  }
  return *product;
}

// The sum of `values`; FailedPrecondition when it leaves the 2^62 range.
Result<Index> Sum(const std::vector<Index>& values, std::string_view what) {
  Index sum = 0;
  for (Index v : values) {
    std::optional<Index> next = CheckedAdd(sum, v);
    if (!next) {
      return FailedPreconditionError(
          fmt::format("{} [{}] sum to more than 2^62", what, fmt::join(values, ", ")));
    }
    sum = *next;
  }
  return sum;
}

// The `rule` of a part: the layout's, overridden by what the part says.
SplitRule PartRule(const SplitRule& layout, const LayoutPart& part) {
  SplitRule rule;
  rule.remainder = layout.remainder;
  if (!part.widths.empty()) {
    rule.sizes = part.widths;
  } else if (part.heads) {
    rule.heads = part.heads;
  } else if (part.grain) {
    rule.grain = part.grain;
  } else {
    rule.heads = layout.heads;
    rule.grain = layout.grain;
  }
  return rule;
}

Status CheckDim(const Shape& shape, int dim) {
  if (dim < 0 || static_cast<size_t>(dim) >= shape.size()) {
    return InvalidArgumentError(
        fmt::format("dimension {} is outside shape {}", dim, FormatShape(shape)));
  }
  return Status::Ok();
}

Result<std::vector<Segment>> PartSegments(const LayoutDescriptor& d, const Shape& shape,
                                          int world) {
  const Index extent = shape[static_cast<size_t>(d.dim)];
  std::vector<LayoutPart> parts = d.parts;
  if (d.equal_parts) {
    if (extent % *d.equal_parts != 0) {
      return InvalidArgumentError(fmt::format("dimension {} of {} indices is not {} equal parts",
                                              d.dim, extent, *d.equal_parts));
    }
    LayoutPart equal;
    equal.size = extent / *d.equal_parts;
    parts.assign(static_cast<size_t>(*d.equal_parts), equal);
  }
  std::vector<Index> sizes;
  for (const LayoutPart& p : parts) sizes.push_back(p.size);
  RESHARD_ASSIGN_OR_RETURN(const Index total, Sum(sizes, "the part sizes"));
  if (total != extent) {
    return InvalidArgumentError(
        fmt::format("the parts ({}) cover {} indices but dimension {} has {}",
                    fmt::join(sizes, " + "), total, d.dim, extent));
  }
  Index replicated = 0;
  for (const LayoutPart& p : parts) replicated += p.replicated ? 1 : 0;
  RESHARD_RETURN_IF_ERROR(CheckSegmentCount(static_cast<Index>(parts.size()), replicated, world));
  std::vector<Segment> segments;
  for (size_t k = 0; k < parts.size(); ++k) {
    Segment seg{parts[k].size, parts[k].replicated, {}};
    if (!seg.replicated) {
      Result<std::vector<Index>> widths = SplitSizes(seg.size, world, PartRule(d.rule, parts[k]));
      if (!widths.ok()) return widths.status().Annotate(fmt::format("part {}", k));
      seg.widths = *std::move(widths);
    }
    segments.push_back(std::move(seg));
  }
  return segments;
}

// Yuan's shared-QK attention: rank r's query heads are r*H/w .. (r+1)*H/w - 1, and it takes
// the value head q/2 for every second query head q, then the same heads shifted by H/2.
Result<std::vector<std::vector<Index>>> SharedQkBlocks(Index heads, int world) {
  if (heads > kMaxBlocks) {
    return FailedPreconditionError(fmt::format(
        "{} heads are more than the {} blocks a block_gather layout may have", heads, kMaxBlocks));
  }
  if (heads % world != 0) {
    return FailedPreconditionError(fmt::format(
        "{} heads cannot be split over {} ranks: the shared-QK pairing gives every rank the same "
        "number of query heads; use a world size that divides {}",
        heads, world, heads));
  }
  if (world > heads / 2) {
    return FailedPreconditionError(fmt::format(
        "{} heads allow at most {} ranks under the shared-QK pairing (each rank pairs at least two "
        "query heads), not {}",
        heads, heads / 2, world));
  }
  const Index per_rank = heads / world;
  std::vector<std::vector<Index>> ids(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    std::vector<Index>& v = ids[static_cast<size_t>(r)];
    for (Index q = r * per_rank, k = 0; k < per_rank; q += 2, k += 2) v.push_back(q / 2);
    const size_t first = v.size();
    for (size_t k = 0; k < first; ++k) v.push_back(v[k] + heads / 2);
    std::vector<Index> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      return FailedPreconditionError(fmt::format(
          "{} heads over {} ranks: the shared-QK pairing would give rank {} the same value head "
          "twice ({}); use a head count and world size with an even number of heads per rank",
          heads, world, r, fmt::join(v, ", ")));
    }
  }
  return ids;
}

// CodeGen's fused QKV: F's rows are mp_num blocks of (q, k, v), each third cut into `world`
// equal blocks. Shard-order entry e of rank r is c = r * mp_num + e, i.e. mp block c / world
// and sub-block c % world, and it holds q, k, v of that sub-block in turn.
Result<std::vector<std::vector<Index>>> CodegenBlocks(Index rows, const LayoutDescriptor& d,
                                                      int world, Index& num_blocks) {
  const Index mp = d.mp_num;
  RESHARD_ASSIGN_OR_RETURN(const Index mp_blocks, Product(mp, world, "mp_num x world size"));
  if (d.rule.heads && *d.rule.heads % mp_blocks != 0) {
    return FailedPreconditionError(
        fmt::format("CodeGen's fused QKV needs the head count to be a multiple of {} x the world "
                    "size: {} heads "
                    "do not split over {} ranks; use a world size w with {} divisible by {}w",
                    mp, *d.rule.heads, world, *d.rule.heads, mp));
  }
  RESHARD_ASSIGN_OR_RETURN(num_blocks, Product(3, mp_blocks, "3 x mp_num x world size"));
  if (num_blocks > kMaxBlocks) {
    return FailedPreconditionError(
        fmt::format("CodeGen's fused QKV at {} ranks would be cut into 3 x {} x {} = {} blocks, "
                    "more than {}",
                    world, mp, world, num_blocks, kMaxBlocks));
  }
  if (rows % num_blocks != 0) {
    return FailedPreconditionError(fmt::format(
        "CodeGen's fused QKV of {} rows cannot be cut into 3 x {} x {} equal blocks at {} ranks",
        rows, mp, world, world));
  }
  std::vector<std::vector<Index>> ids(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (Index e = 0; e < mp; ++e) {
      const Index c = r * mp + e;
      const Index mp_block = c / world;
      const Index within = c % world;
      for (Index third = 0; third < 3; ++third) {
        ids[static_cast<size_t>(r)].push_back((mp_block * 3 + third) * world + within);
      }
    }
  }
  return ids;
}

Result<ParamMap> BuildUncanonical(const LayoutDescriptor& d, const Shape& shape, int world) {
  if (d.family == LayoutFamily::kReplicated) {
    return ReplicatedMap(shape, world, d.pre_divided ? 1.0 / world : 1.0);
  }
  RESHARD_RETURN_IF_ERROR(CheckDim(shape, d.dim));
  const Index extent = shape[static_cast<size_t>(d.dim)];
  switch (d.family) {
    case LayoutFamily::kReplicated:
      break;
    case LayoutFamily::kSplit: {
      RESHARD_ASSIGN_OR_RETURN(std::vector<Index> sizes, SplitSizes(extent, world, d.rule));
      return SplitMap(shape, d.dim, sizes);
    }
    case LayoutFamily::kFused:
    case LayoutFamily::kSegmented: {
      RESHARD_ASSIGN_OR_RETURN(std::vector<Segment> segments, PartSegments(d, shape, world));
      return SegmentedMap(shape, d.dim, segments, world);
    }
    case LayoutFamily::kBlockGather: {
      if (d.shared_qk) {
        const Index heads = *d.rule.heads;
        if (extent % heads != 0) {
          return InvalidArgumentError(
              fmt::format("dimension {} of {} indices is not a whole number of {} heads", d.dim,
                          extent, heads));
        }
        RESHARD_ASSIGN_OR_RETURN(auto ids, SharedQkBlocks(heads, world));
        return BlockGatherMap(shape, d.dim, heads, ids);
      }
      if (d.rank_blocks.size() != static_cast<size_t>(world)) {
        return FailedPreconditionError(
            fmt::format("the descriptor lists the blocks of {} ranks, not {}: explicit rank_blocks "
                        "fix the world size",
                        d.rank_blocks.size(), world));
      }
      return BlockGatherMap(shape, d.dim, *d.num_blocks, d.rank_blocks);
    }
    case LayoutFamily::kCodegenQkv: {
      Index num_blocks = 0;
      RESHARD_ASSIGN_OR_RETURN(auto ids, CodegenBlocks(extent, d, world, num_blocks));
      return BlockGatherMap(shape, d.dim, num_blocks, ids);
    }
    case LayoutFamily::kPaddedVocab: {
      Index padded = 0;
      if (d.padded_size) {
        padded = *d.padded_size;
        if (padded < extent) {
          return InvalidArgumentError(
              fmt::format("the padded size {} is smaller than the {} real indices of dimension {}",
                          padded, extent, d.dim));
        }
        if (padded % world != 0) {
          return FailedPreconditionError(fmt::format(
              "a vocabulary padded to {} does not split evenly over {} ranks; use a world size "
              "that "
              "divides {}, or give \"pad_multiple\" so the padding follows the world size",
              padded, world, padded));
        }
      } else {
        RESHARD_ASSIGN_OR_RETURN(const Index multiple,
                                 Product(d.pad_multiple, world, "pad_multiple x world size"));
        RESHARD_ASSIGN_OR_RETURN(
            padded, Product((extent + multiple - 1) / multiple, multiple,
                            "the padded size, a multiple of pad_multiple x world size"));
      }
      Shape padded_shape = shape;
      padded_shape[static_cast<size_t>(d.dim)] = padded;
      RESHARD_ASSIGN_OR_RETURN(
          ParamMap map, SplitMap(padded_shape, d.dim,
                                 std::vector<Index>(static_cast<size_t>(world), padded / world)));
      ParamMapBuilder b(map);
      b.set_valid_shape(padded == extent ? std::nullopt : std::optional<Shape>(shape));
      return b.Finalize();
    }
  }
  return InternalError("unknown layout family");
}

}  // namespace

std::string_view LayoutFamilyName(LayoutFamily family) {
  for (const FamilyInfo& f : Families()) {
    if (f.family == family) return f.name;
  }
  return "?";
}

std::string_view RemainderName(Remainder remainder) {
  for (const auto& [value, name] : kRemainders) {
    if (value == remainder) return name;
  }
  return "?";
}

Result<LayoutDescriptor> ParseLayoutJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json root, json::ParseJson(text));
  return ParseDescriptor(root);
}

Result<LayoutDescriptor> LayoutFromJson(const json::Json& value) { return ParseDescriptor(value); }

json::OrderedJson LayoutToJsonValue(const LayoutDescriptor& d) {
  nlohmann::ordered_json j;
  j["family"] = std::string(LayoutFamilyName(d.family));
  if (d.family != LayoutFamily::kReplicated) j["dim"] = d.dim;
  auto put_rule = [&](const SplitRule& rule) {
    if (!rule.sizes.empty()) {
      j["sizes"] = rule.sizes;
      return;
    }
    j["remainder"] = std::string(RemainderName(rule.remainder));
    if (rule.heads) j["heads"] = *rule.heads;
    if (rule.grain) j["grain"] = *rule.grain;
  };
  switch (d.family) {
    case LayoutFamily::kReplicated:
      if (d.pre_divided) j["pre_divided"] = true;
      break;
    case LayoutFamily::kSplit:
      put_rule(d.rule);
      break;
    case LayoutFamily::kFused:
    case LayoutFamily::kSegmented:
      put_rule(d.rule);
      if (d.equal_parts) {
        j["parts"] = *d.equal_parts;
      } else {
        nlohmann::ordered_json parts = nlohmann::ordered_json::array();
        for (const LayoutPart& p : d.parts) {
          nlohmann::ordered_json part;
          part["size"] = p.size;
          if (p.replicated) part["replicated"] = true;
          if (p.heads) part["heads"] = *p.heads;
          if (p.grain) part["grain"] = *p.grain;
          if (!p.widths.empty()) part["widths"] = p.widths;
          parts.push_back(std::move(part));
        }
        j["parts"] = std::move(parts);
      }
      break;
    case LayoutFamily::kBlockGather:
      if (d.shared_qk) {
        j["pairing"] = "shared_qk";
        j["heads"] = *d.rule.heads;
      } else {
        j["blocks"] = *d.num_blocks;
        j["rank_blocks"] = d.rank_blocks;
      }
      break;
    case LayoutFamily::kCodegenQkv:
      j["mp_num"] = d.mp_num;
      if (d.rule.heads) j["heads"] = *d.rule.heads;
      break;
    case LayoutFamily::kPaddedVocab:
      if (d.padded_size) {
        j["padded_size"] = *d.padded_size;
      } else {
        j["pad_multiple"] = d.pad_multiple;
      }
      break;
  }
  return j;
}

std::string LayoutToJson(const LayoutDescriptor& d) { return LayoutToJsonValue(d).dump(); }

Result<std::vector<Index>> SplitSizes(Index extent, int world, const SplitRule& rule) {
  if (world < 1) return InvalidArgumentError("world size must be at least 1");
  if (!rule.sizes.empty()) {
    if (rule.sizes.size() != static_cast<size_t>(world)) {
      return FailedPreconditionError(fmt::format(
          "explicit sizes [{}] are for {} ranks, not {}: explicit sizes fix the world size",
          fmt::join(rule.sizes, ", "), rule.sizes.size(), world));
    }
    RESHARD_ASSIGN_OR_RETURN(const Index sum, Sum(rule.sizes, "sizes"));
    if (sum != extent) {
      return InvalidArgumentError(fmt::format("sizes [{}] sum to {}, but the dimension has {}",
                                              fmt::join(rule.sizes, ", "), sum, extent));
    }
    return rule.sizes;
  }
  Index units = extent;
  Index unit = 1;
  Index tail = 0;
  if (rule.heads) {
    if (extent % *rule.heads != 0) {
      return InvalidArgumentError(
          fmt::format("{} indices are not a whole number of {} heads", extent, *rule.heads));
    }
    units = *rule.heads;
    unit = extent / units;
  } else if (rule.grain && extent >= *rule.grain) {
    unit = *rule.grain;
    units = extent / unit;
    tail = extent % unit;
  }
  std::vector<Index> sizes(static_cast<size_t>(world), 0);
  const Index base = units / world;
  const Index extra = units % world;
  for (Index r = 0; r < world; ++r) {
    Index n = base;
    switch (rule.remainder) {
      case Remainder::kFront:
        n += r < extra ? 1 : 0;
        break;
      case Remainder::kBack:
        n += r >= world - extra ? 1 : 0;
        break;
      case Remainder::kCeil: {
        const Index c = (units + world - 1) / world;
        n = std::clamp<Index>(units - r * c, 0, c);
        break;
      }
      case Remainder::kExact:
        if (extra != 0) {
          return FailedPreconditionError(fmt::format(
              "{} cannot be split evenly over {} ranks; use a world size that divides {}",
              UnitsName(units, rule), world, units));
        }
        break;
    }
    sizes[static_cast<size_t>(r)] = n * unit;
  }
  sizes.back() += tail;
  return sizes;
}

Result<ParamMap> BuildMap(const LayoutDescriptor& descriptor, const Shape& shape, int world_size) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return InvalidArgumentError(
        fmt::format("world size {} is outside 1..{}", world_size, kMaxWorldSize));
  }
  for (Index e : shape) {
    if (e < 0)
      return InvalidArgumentError(
          fmt::format("shape {} has a negative extent", FormatShape(shape)));
  }
  RESHARD_RETURN_IF_ERROR(CheckedProduct(shape).status());
  Result<ParamMap> map = BuildUncanonical(descriptor, shape, world_size);
  if (!map.ok()) {
    // Whatever does not fit (the shape or the world size) is one kind of failure.
    return AsFailedCheck(map.status())
        .Annotate(fmt::format("{} layout of {} at {} rank{}", LayoutFamilyName(descriptor.family),
                              FormatShape(shape), world_size, world_size == 1 ? "" : "s"));
  }
  return Canonicalize(*map);
}

}  // namespace reshard
