// Reader and writer for the JSON form of param maps and map documents (see map_json.h).
//
// Text is parsed by the library's strict reader (base/json_reader.h: duplicate keys, deep
// nesting and trailing bytes refused; top-level keys kept in file order); this file is the
// typed walk over the DOM that builds the maps.
#include "reshard/ir/map_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "reshard/base/json_reader.h"
#include "reshard/base/json_writer.h"
#include "reshard/ir/map_json_value.h"

namespace reshard {
namespace {

using json::Element;
using json::ErrorAt;
using json::Find;
using json::Json;
using json::Member;
using json::Quote;
using json::QuoteShort;
using json::ReadInt;
using json::ReadIntArray;
using json::Require;
using json::TypeError;

// `[offset, [strides...]]`
Result<StridedView> ReadView(const Json& j, std::string_view path) {
  if (!j.is_array() || j.size() != 2) return TypeError(path, "[offset, [strides...]]", j);
  StridedView view;
  RESHARD_ASSIGN_OR_RETURN(view.offset, ReadInt(j[0], Element(path, 0)));
  RESHARD_ASSIGN_OR_RETURN(view.strides, ReadIntArray(j[1], Element(path, 1)));
  return view;
}

Result<std::vector<Rank>> ReadLocations(const Json& j, std::string_view path) {
  if (!j.is_array()) return TypeError(path, "an array of ranks", j);
  std::vector<Rank> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = Element(path, i);
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(j[i], at));
    if (v < std::numeric_limits<Rank>::min() || v > std::numeric_limits<Rank>::max()) {
      return ErrorAt(at, fmt::format("rank {} is outside the range of int32", v));
    }
    out.push_back(static_cast<Rank>(v));
  }
  return out;
}

Result<Piece> ReadPiece(const Json& j, std::string_view path) {
  if (!j.is_object()) return TypeError(path, "a piece (an object)", j);
  Piece piece;
  RESHARD_ASSIGN_OR_RETURN(const Json* shape, Require(j, path, "shape"));
  RESHARD_ASSIGN_OR_RETURN(piece.shape, ReadIntArray(*shape, Member(path, "shape")));
  RESHARD_ASSIGN_OR_RETURN(const Json* source, Require(j, path, "source"));
  RESHARD_ASSIGN_OR_RETURN(piece.source, ReadView(*source, Member(path, "source")));
  RESHARD_ASSIGN_OR_RETURN(const Json* dest, Require(j, path, "dest"));
  RESHARD_ASSIGN_OR_RETURN(piece.dest, ReadView(*dest, Member(path, "dest")));
  RESHARD_ASSIGN_OR_RETURN(const Json* locations, Require(j, path, "locations"));
  RESHARD_ASSIGN_OR_RETURN(piece.locations, ReadLocations(*locations, Member(path, "locations")));
  if (const Json* scale = Find(j, "scale")) {
    RESHARD_ASSIGN_OR_RETURN(piece.scale, json::ReadNumber(*scale, Member(path, "scale")));
  }
  return piece;
}

// A canonical decimal rank key: "0", or digits without a leading zero, below 2^31.
std::optional<Rank> ParseRankKey(std::string_view key) {
  if (key.empty() || key.size() > 10 || (key.size() > 1 && key[0] == '0')) return std::nullopt;
  int64_t v = 0;
  for (char c : key) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v > std::numeric_limits<Rank>::max()) return std::nullopt;
  return static_cast<Rank>(v);
}

Result<ParamMapBuilder> ReadParamMap(const Json& j) {
  if (!j.is_object()) return TypeError("", "a param map (an object)", j);
  ParamMapBuilder builder;
  RESHARD_ASSIGN_OR_RETURN(const Json* logical, Require(j, "", "logical_shape"));
  RESHARD_ASSIGN_OR_RETURN(Shape logical_shape, ReadIntArray(*logical, "logical_shape"));
  builder.set_logical_shape(std::move(logical_shape));
  // null is read as absent, as a writer with an optional field may spell it.
  if (const Json* valid = Find(j, "valid_shape"); valid != nullptr && !valid->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(Shape valid_shape, ReadIntArray(*valid, "valid_shape"));
    builder.set_valid_shape(std::move(valid_shape));
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* ranks, Require(j, "", "ranks"));
  if (!ranks->is_object())
    return TypeError("ranks", "an object keyed by rank (\"0\", ...)", *ranks);
  const size_t world = ranks->size();
  if (world > static_cast<size_t>(std::numeric_limits<Rank>::max())) {
    return ErrorAt("ranks", fmt::format("{} ranks are more than int32 can count", world));
  }
  // Rank keys: canonical decimal, exactly "0".."world-1" (duplicates were refused by the
  // parser, so `world` distinct keys below `world` are all of them).
  std::vector<const Json*> by_rank(world, nullptr);
  std::optional<std::string> out_of_range_key;
  for (const auto& [key, value] : ranks->items()) {
    std::optional<Rank> r = ParseRankKey(key);
    if (!r) {
      return ErrorAt("ranks", fmt::format("key {} is not a rank; rank keys are decimal integers "
                                          "\"0\"..\"N-1\" without signs or leading zeros",
                                          QuoteShort(key)));
    }
    if (static_cast<size_t>(*r) >= world) {
      if (!out_of_range_key) out_of_range_key = key;
      continue;
    }
    by_rank[static_cast<size_t>(*r)] = &value;
  }
  for (size_t r = 0; r < world; ++r) {
    if (by_rank[r] != nullptr) continue;
    return ErrorAt("ranks",
                   fmt::format("missing key \"{}\"; {} ranks need keys \"0\"..\"{}\" but {} is "
                               "among them",
                               r, world, world - 1, Quote(out_of_range_key.value_or(""))));
  }
  builder.set_world_size(static_cast<int>(world));
  for (size_t r = 0; r < world; ++r) {
    const Rank rank = static_cast<Rank>(r);
    const std::string path = RankPath(rank);
    const Json& shard = *by_rank[r];
    if (!shard.is_object()) return TypeError(path, "a shard (an object)", shard);
    RESHARD_ASSIGN_OR_RETURN(const Json* shard_shape, Require(shard, path, "shard_shape"));
    RESHARD_ASSIGN_OR_RETURN(Shape shape, ReadIntArray(*shard_shape, path + ".shard_shape"));
    builder.set_shard_shape(rank, std::move(shape));
    if (const Json* buffer = Find(shard, "buffer"); buffer != nullptr && !buffer->is_null()) {
      if (!buffer->is_string() || buffer->get_ref<const std::string&>().empty()) {
        return TypeError(path + ".buffer", "a buffer name (a non-empty string)", *buffer);
      }
      builder.set_buffer(rank, buffer->get<std::string>());
    }
    RESHARD_ASSIGN_OR_RETURN(const Json* pieces, Require(shard, path, "pieces"));
    const std::string pieces_path = path + ".pieces";
    if (!pieces->is_array()) return TypeError(pieces_path, "an array of pieces", *pieces);
    for (size_t i = 0; i < pieces->size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(Piece piece, ReadPiece((*pieces)[i], Element(pieces_path, i)));
      builder.add_piece(rank, std::move(piece));
    }
  }
  return builder;
}

// Context for errors inside one parameter of a document; none for the unnamed one.
Status AnnotateParam(Status status, std::string_view name) {
  if (name.empty()) return status;
  return std::move(status).Annotate(fmt::format("parameter {}", QuoteShort(name)));
}

// ---------------------------------------------------------------------------------------
// Writer.

// Characters Python's re.escape (3.7+) escapes; the reader accepts them escaped.
constexpr std::string_view kRegexEscaped = "()[]{}?*+-|^$\\.&~# \t\n\r\v\f";
// Characters that must not appear unescaped in an exact-match pattern.
constexpr std::string_view kRegexMeta = ".^$*+?{}[]\\|()";

json::OrderedJson ViewToJson(const StridedView& view) {
  return json::OrderedJson::array({view.offset, view.strides});
}

json::OrderedJson PieceToJson(const Piece& piece) {
  json::OrderedJson j;
  j["shape"] = piece.shape;
  j["source"] = ViewToJson(piece.source);
  j["dest"] = ViewToJson(piece.dest);
  j["locations"] = piece.locations;
  if (piece.scale != 1.0) j["scale"] = piece.scale;
  return j;
}

}  // namespace

json::OrderedJson BufferSetToJsonValue(const BufferSet& set) {
  json::OrderedJson j = json::OrderedJson::object();
  for (const BufferDecl& b : set.buffers()) {
    json::OrderedJson ranks = json::OrderedJson::object();
    for (size_t r = 0; r < b.ranks.size(); ++r) {
      json::OrderedJson rank;
      rank["shape"] = b.ranks[r].shape;
      if (!b.ranks[r].padding.empty()) {
        json::OrderedJson pads = json::OrderedJson::array();
        for (const BufferBlock& pad : b.ranks[r].padding) {
          pads.push_back({{"shape", pad.shape}, {"view", ViewToJson(pad.view)}});
        }
        rank["padding"] = std::move(pads);
      }
      json::AppendMember(ranks, std::to_string(r), std::move(rank));
    }
    json::OrderedJson buffer = {{"dtype", std::string(DTypeName(b.dtype))}};
    if (b.fill != 0.0 || std::signbit(b.fill)) buffer["fill"] = b.fill;
    buffer["ranks"] = std::move(ranks);
    json::AppendMember(j, b.name, std::move(buffer));
  }
  return j;
}

Result<BufferSetBuilder> BufferSetFromJson(const json::Json& value, std::string_view path) {
  if (!value.is_object()) return TypeError(path, "an object of buffers by name", value);
  BufferSetBuilder builder;
  for (const auto& [name, j] : value.items()) {
    const std::string at = fmt::format("{}[{}]", path, Quote(name));
    if (!j.is_object()) return TypeError(at, "a buffer (an object)", j);
    BufferDecl decl;
    decl.name = name;
    RESHARD_ASSIGN_OR_RETURN(const Json* dtype, Require(j, at, "dtype"));
    if (!dtype->is_string()) return TypeError(at + ".dtype", "a dtype name", *dtype);
    const std::optional<DType> d = DTypeFromName(dtype->get<std::string>());
    if (!d) {
      return ErrorAt(at + ".dtype",
                     fmt::format("unknown dtype {}", QuoteShort(dtype->get<std::string>())));
    }
    decl.dtype = *d;
    if (const Json* fill = Find(j, "fill"); fill != nullptr) {  // null is no number either
      RESHARD_ASSIGN_OR_RETURN(decl.fill, json::ReadNumber(*fill, at + ".fill"));
    }
    RESHARD_ASSIGN_OR_RETURN(const Json* ranks, Require(j, at, "ranks"));
    if (!ranks->is_object()) return TypeError(at + ".ranks", "an object keyed by rank", *ranks);
    decl.ranks.resize(ranks->size());
    for (const auto& [key, rank] : ranks->items()) {
      const std::optional<Rank> r = ParseRankKey(key);
      if (!r || static_cast<size_t>(*r) >= ranks->size()) {
        return ErrorAt(at + ".ranks", fmt::format("key {} is not a rank \"0\"..\"{}\"",
                                                  QuoteShort(key), ranks->size() - 1));
      }
      const std::string rpath = fmt::format("{}.ranks[\"{}\"]", at, *r);
      if (!rank.is_object()) return TypeError(rpath, "a buffer rank (an object)", rank);
      BufferRank& br = decl.ranks[static_cast<size_t>(*r)];
      RESHARD_ASSIGN_OR_RETURN(const Json* shape, Require(rank, rpath, "shape"));
      RESHARD_ASSIGN_OR_RETURN(br.shape, ReadIntArray(*shape, rpath + ".shape"));
      if (const Json* pads = Find(rank, "padding"); pads != nullptr && !pads->is_null()) {
        if (!pads->is_array()) return TypeError(rpath + ".padding", "an array of blocks", *pads);
        for (size_t k = 0; k < pads->size(); ++k) {
          const std::string ppath = Element(rpath + ".padding", k);
          const Json& pj = (*pads)[k];
          if (!pj.is_object()) return TypeError(ppath, "a block (an object)", pj);
          BufferBlock block;
          RESHARD_ASSIGN_OR_RETURN(const Json* bshape, Require(pj, ppath, "shape"));
          RESHARD_ASSIGN_OR_RETURN(block.shape, ReadIntArray(*bshape, ppath + ".shape"));
          RESHARD_ASSIGN_OR_RETURN(const Json* view, Require(pj, ppath, "view"));
          RESHARD_ASSIGN_OR_RETURN(block.view, ReadView(*view, ppath + ".view"));
          br.padding.push_back(std::move(block));
        }
      }
    }
    builder.add(std::move(decl));
  }
  return builder;
}

Result<std::string> DecodeParamKey(std::string_view key) {
  if (!key.starts_with('^')) return std::string(key);
  auto refuse = [&](std::string why) -> Status {
    return InvalidArgumentError(
        fmt::format("key {}: {}; only exact-match patterns ^<re.escape(name)>$ are supported",
                    QuoteShort(key), why));
  };
  if (key.size() < 2 || !key.ends_with('$'))
    return refuse("starts with \"^\" but does not end with \"$\"");
  const std::string_view body = key.substr(1, key.size() - 2);
  std::string name;
  name.reserve(body.size());
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c == '\\') {
      if (i + 1 == body.size()) return refuse("the final \"$\" is escaped, so it does not anchor");
      const char next = body[++i];
      const bool alnum = (next >= 'a' && next <= 'z') || (next >= 'A' && next <= 'Z') ||
                         (next >= '0' && next <= '9');
      if (alnum) {
        return refuse(
            fmt::format("\"\\{}\" at position {} is a regex escape, not a literal", next, i));
      }
      name += next;
    } else if (kRegexMeta.find(c) != std::string_view::npos) {
      return refuse(
          fmt::format("unescaped \"{}\" at position {} is a regex metacharacter", c, i + 1));
    } else {
      name += c;
    }
  }
  return name;
}

std::string EncodeParamKey(std::string_view name) {
  if (!name.starts_with('^') && name != "version" && name != "buffers") return std::string(name);
  std::string key = "^";
  for (char c : name) {
    if (kRegexEscaped.find(c) != std::string_view::npos) key += '\\';
    key += c;
  }
  key += '$';
  return key;
}

Result<ParamMapBuilder> ParseParamMapJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json root, json::ParseJson(text));
  return ReadParamMap(root);
}

Result<ParamMapBuilder> ParamMapFromJson(const json::Json& value) { return ReadParamMap(value); }

Result<MapDocumentBuilder> ParseMapDocumentJson(std::string_view text) {
  std::vector<std::string> keys_in_order;
  RESHARD_ASSIGN_OR_RETURN(Json root, json::ParseJson(text, &keys_in_order));
  if (!root.is_object()) return TypeError("", "a map document or a param map (an object)", root);
  MapDocumentBuilder doc;
  const Json* version = Find(root, "version");
  if (version == nullptr) {
    if (Find(root, "ranks") != nullptr && Find(root, "logical_shape") != nullptr) {
      RESHARD_ASSIGN_OR_RETURN(ParamMapBuilder builder, ReadParamMap(root));
      doc.params.push_back({"", std::move(builder)});
      return doc;
    }
    return InvalidArgumentError(
        "missing key \"version\"; a map document is {\"version\": 1, \"<name>\": <param map>, "
        "...} and a bare param map has \"logical_shape\" and \"ranks\"");
  }
  RESHARD_ASSIGN_OR_RETURN(const int v, CheckDocumentVersion(*version, true));
  const bool buffered = v == kBufferedMapDocumentVersion;
  if (buffered) {
    RESHARD_ASSIGN_OR_RETURN(const Json* buffers, Require(root, "", "buffers"));
    RESHARD_ASSIGN_OR_RETURN(doc.buffers, BufferSetFromJson(*buffers, "buffers"));
  }
  // Names first, so that a key error is reported before any parameter's content.
  RESHARD_ASSIGN_OR_RETURN(auto named,
                           DecodeDocumentKeys(root, keys_in_order, "parameter", buffered));
  for (auto& [name, value] : named) {
    Result<ParamMapBuilder> builder = ReadParamMap(*value);
    if (!builder.ok()) return AnnotateParam(builder.status(), name);
    doc.params.push_back({std::move(name), std::move(builder).value()});
  }
  return doc;
}

Result<int> CheckDocumentVersion(const json::Json& version, bool allow_buffers) {
  RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(version, "version"));
  if (v == kMapDocumentVersion || (allow_buffers && v == kBufferedMapDocumentVersion)) {
    return static_cast<int>(v);
  }
  if (allow_buffers) {
    return InvalidArgumentError(
        fmt::format("version {} is not supported; this reader knows versions {} and {} (with "
                    "buffers)",
                    v, kMapDocumentVersion, kBufferedMapDocumentVersion));
  }
  return InvalidArgumentError(fmt::format(
      "version {} is not supported; this reader knows version {}", v, kMapDocumentVersion));
}

Result<std::vector<std::pair<std::string, const json::Json*>>> DecodeDocumentKeys(
    const json::Json& root, const std::vector<std::string>& keys, std::string_view what,
    bool skip_buffers) {
  std::vector<std::pair<std::string, const Json*>> named;
  std::unordered_map<std::string, std::string> key_of_name;
  for (const std::string& key : keys) {
    if (key == "version" || (skip_buffers && key == "buffers")) continue;
    RESHARD_ASSIGN_OR_RETURN(std::string name, DecodeParamKey(key));
    auto [it, inserted] = key_of_name.emplace(name, key);
    if (!inserted) {
      return InvalidArgumentError(fmt::format("keys {} and {} both name {} {}",
                                              QuoteShort(it->second), QuoteShort(key), what,
                                              QuoteShort(name)));
    }
    named.emplace_back(std::move(name), Find(root, key));
  }
  return named;
}

Status AsFailedCheck(Status status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kDataLoss:
      return Status(StatusCode::kFailedPrecondition, status.message());
    default:
      return status;
  }
}

size_t ValidatedMapDocument::num_invalid() const {
  return static_cast<size_t>(std::count_if(params.begin(), params.end(),
                                           [](const ValidatedParam& p) { return !p.map.ok(); }));
}

Status ValidatedParam::status() const {
  if (map.ok()) return Status::Ok();
  return AsFailedCheck(AnnotateParam(map.status(), name));
}

Status ValidatedMapDocument::status() const {
  for (const ValidatedParam& p : params) {
    if (!p.map.ok()) return p.status();
  }
  if (!buffers.ok()) return AsFailedCheck(buffers.status());
  return Status::Ok();
}

Result<MapDocument> ValidatedMapDocument::ToDocument() && {
  RESHARD_RETURN_IF_ERROR(status());
  MapDocument doc;
  doc.params.reserve(params.size());
  for (ValidatedParam& p : params) doc.params.emplace_back(std::move(p.name), *std::move(p.map));
  doc.buffers = *std::move(buffers);
  return doc;
}

Status ValidateBuffers(MapDocument& doc, const BufferSetBuilder& buffers) {
  std::vector<NamedMapRef> refs;
  refs.reserve(doc.params.size());
  for (const auto& [name, map] : doc.params) refs.push_back({name, &map});
  RESHARD_ASSIGN_OR_RETURN(doc.buffers, buffers.Finalize(refs));
  return Status::Ok();
}

Result<ValidatedMapDocument> ValidateMapDocumentJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(MapDocumentBuilder builders, ParseMapDocumentJson(text));
  ValidatedMapDocument doc;
  doc.params.reserve(builders.params.size());
  for (NamedMapBuilder& named : builders.params) {
    doc.params.push_back({std::move(named.name), named.builder.Finalize()});
  }
  if (doc.num_invalid() == 0) {
    std::vector<NamedMapRef> refs;
    refs.reserve(doc.params.size());
    for (const ValidatedParam& p : doc.params) refs.push_back({p.name, &*p.map});
    doc.buffers = builders.buffers.Finalize(refs);
  }
  return doc;
}

Result<MapDocument> ReadMapDocumentJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(ValidatedMapDocument doc, ValidateMapDocumentJson(text));
  return std::move(doc).ToDocument();
}

json::OrderedJson ParamMapToJsonValue(const ParamMap& map) {
  json::OrderedJson j;
  j["logical_shape"] = map.logical_shape();
  if (map.has_padding()) j["valid_shape"] = map.valid_shape();
  json::OrderedJson& ranks = j["ranks"] = json::OrderedJson::object();
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& shard = map.rank(r);
    json::OrderedJson pieces = json::OrderedJson::array();
    for (const Piece& piece : shard.pieces) pieces.push_back(PieceToJson(piece));
    json::OrderedJson entry;
    if (shard.is_buffered()) entry["buffer"] = shard.buffer;
    entry["shard_shape"] = shard.shard_shape;
    entry["pieces"] = std::move(pieces);
    json::AppendMember(ranks, std::to_string(r), std::move(entry));
  }
  return j;
}

std::string ParamMapToJson(const ParamMap& map) {
  return json::WriteJson(ParamMapToJsonValue(map)) + "\n";
}

Result<BufferSetBuilder> ParseBufferSetJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json root, json::ParseJson(text));
  return BufferSetFromJson(root, "buffers");
}

std::string BufferSetToJson(const BufferSet& set) {
  return json::WriteJson(BufferSetToJsonValue(set)) + "\n";
}

std::string MapDocumentToJson(const MapDocument& doc) {
  json::OrderedJson j;
  j["version"] = doc.buffers.empty() ? kMapDocumentVersion : kBufferedMapDocumentVersion;
  if (!doc.buffers.empty()) j["buffers"] = BufferSetToJsonValue(doc.buffers);
  for (const auto& [name, map] : doc.params) {
    json::AppendMember(j, EncodeParamKey(name), ParamMapToJsonValue(map));
  }
  return json::WriteJson(j) + "\n";
}

}  // namespace reshard
