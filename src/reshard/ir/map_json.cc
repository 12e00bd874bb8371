// Reader and writer for the JSON form of param maps and map documents (see map_json.h).
//
// The reader works in two passes over untrusted text:
//   1. nlohmann's parser builds a DOM, with a callback that refuses duplicate keys (the DOM
//      would keep only the last one) and records the order of the top-level keys (the DOM
//      sorts them; a document keeps its parameters in file order). Nesting depth is bounded
//      by a scan before parsing so that no step - parser, callback, DOM - grows with it.
//   2. A typed walk over the DOM that names the JSON path of the first thing it refuses. It
//      never calls a throwing accessor: every value's type is checked before it is read.
#include "reshard/ir/map_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <unordered_set>

namespace reshard {
namespace {

using Json = nlohmann::json;

// Deeper nesting is refused before parsing. Valid maps nest 8 levels; the rest is room for
// unknown keys, which are ignored but still parsed.
constexpr int kMaxDepth = 128;
// A string quoted in an error message is cut to this many bytes.
constexpr size_t kMaxQuotedBytes = 48;

// A JSON string literal for `s` (escaped; invalid UTF-8 is replaced, never thrown on).
std::string Quote(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

// Quotes `s` for a message, cut at a UTF-8 boundary when long.
std::string QuoteShort(std::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return Quote(s);
  size_t cut = kMaxQuotedBytes;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  std::string quoted = Quote(s.substr(0, cut));
  quoted.insert(quoted.size() - 1, "...");
  return quoted;
}

// What a value is, for "expected X, got Y". Containers are not printed.
std::string Describe(const Json& j) {
  switch (j.type()) {
    case Json::value_t::string:
      return QuoteShort(*j.get_ptr<const Json::string_t*>());
    case Json::value_t::array:
      return j.empty()
                 ? "an empty array"
                 : fmt::format("an array of {} element{}", j.size(), j.size() == 1 ? "" : "s");
    case Json::value_t::object:
      return "an object";
    default:
      return j.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
}

bool IsIdentifier(std::string_view key) {
  if (key.empty() || (key[0] >= '0' && key[0] <= '9')) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// `path` extended by an object member: `ranks`, `.pieces`, `["3"]`.
std::string Member(std::string_view path, std::string_view key) {
  if (IsIdentifier(key)) return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
  return fmt::format("{}[{}]", path, QuoteShort(key));
}

std::string Element(std::string_view path, size_t index) {
  return fmt::format("{}[{}]", path, index);
}

// "path: message", or just the message at the root.
Status ErrorAt(std::string_view path, std::string message) {
  if (path.empty()) return InvalidArgumentError(std::move(message));
  return InvalidArgumentError(fmt::format("{}: {}", path, message));
}

Status TypeError(std::string_view path, std::string_view expected, const Json& got) {
  return ErrorAt(path, fmt::format("expected {}, got {}", expected, Describe(got)));
}

// ---------------------------------------------------------------------------------------
// Pass 1: text -> DOM.

// Refuses nesting deeper than kMaxDepth. Tracks strings so brackets inside them do not
// count; malformed text is left for the parser to describe.
Status CheckNesting(std::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) {
        return InvalidArgumentError(
            fmt::format("JSON nests deeper than {} levels (at byte {})", kMaxDepth, i));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return Status::Ok();
}

// The parser's own account of why `text` is not JSON. The DOM parser does not report it
// without throwing, so a second pass with a SAX handler that only records the error gets it.
std::string DescribeSyntaxError(std::string_view text) {
  struct ErrorSax : nlohmann::json_sax<Json> {
    std::string message = "malformed JSON";
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override { return true; }
    bool key(string_t&) override { return true; }
    bool end_object() override { return true; }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t, const std::string&,
                     const nlohmann::detail::exception& e) override {
      // "[json.exception.parse_error.101] parse error at line 1, column 4: ..." -> from "parse
      // error" on, cut to a readable length.
      std::string_view what = e.what();
      if (const size_t start = what.find("] "); start != std::string_view::npos) {
        what.remove_prefix(start + 2);
      }
      if (what.size() > 200) what = what.substr(0, 200);
      message = fmt::format("malformed JSON: {}", what);
      return false;
    }
  };
  ErrorSax sax;
  Json::sax_parse(text.begin(), text.end(), &sax);
  return sax.message;
}

struct ParsedJson {
  Json root;
  // Keys of the root object in file order (empty when the root is not an object).
  std::vector<std::string> root_keys;
};

Result<ParsedJson> ParseJsonText(std::string_view text) {
  RESHARD_RETURN_IF_ERROR(CheckNesting(text));
  struct Frame {
    bool is_object = false;
    size_t count = 0;  // completed elements, for arrays
    std::string key;   // current key, for objects
    std::unordered_set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::optional<Status> error;
  ParsedJson parsed;
  auto path_of_top = [&] {
    std::string path;
    for (size_t i = 0; i + 1 < stack.size(); ++i) {
      path = stack[i].is_object ? Member(path, stack[i].key) : Element(path, stack[i].count);
    }
    return path;
  };
  auto element_done = [&] {
    if (!stack.empty() && !stack.back().is_object) ++stack.back().count;
  };
  Json::parser_callback_t callback = [&](int /*depth*/, Json::parse_event_t event,
                                         Json& value) -> bool {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        stack.emplace_back();
        stack.back().is_object = event == Json::parse_event_t::object_start;
        break;
      case Json::parse_event_t::key: {
        if (stack.empty() || !value.is_string()) break;
        Frame& top = stack.back();
        top.key = *value.get_ptr<const Json::string_t*>();
        if (!top.keys.insert(top.key).second && !error) {
          error = ErrorAt(path_of_top(), fmt::format("duplicate key {}", QuoteShort(top.key)));
        }
        if (stack.size() == 1) parsed.root_keys.push_back(top.key);
        break;
      }
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        element_done();
        break;
      case Json::parse_event_t::value:
        element_done();
        break;
    }
    return true;
  };
  parsed.root = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (parsed.root.is_discarded()) return InvalidArgumentError(DescribeSyntaxError(text));
  if (error) return *error;
  if (!parsed.root.is_object()) parsed.root_keys.clear();
  return parsed;
}

// ---------------------------------------------------------------------------------------
// Pass 2: DOM -> builders.

const Json* Find(const Json& object, std::string_view key) {
  auto it = object.find(std::string(key));
  return it == object.end() ? nullptr : &*it;
}

Result<const Json*> Require(const Json& object, std::string_view path, std::string_view key) {
  const Json* found = Find(object, key);
  if (found == nullptr) return ErrorAt(path, fmt::format("missing key {}", Quote(key)));
  return found;
}

Result<Index> ReadIndex(const Json& j, std::string_view path) {
  if (const auto* u = j.get_ptr<const Json::number_unsigned_t*>()) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return ErrorAt(path, fmt::format("integer {} is outside the range of int64", *u));
    }
    return static_cast<Index>(*u);
  }
  if (const auto* i = j.get_ptr<const Json::number_integer_t*>()) return Index{*i};
  return TypeError(path, "an integer", j);
}

Result<Shape> ReadIndexArray(const Json& j, std::string_view path) {
  if (!j.is_array()) return TypeError(path, "an array of integers", j);
  Shape out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadIndex(j[i], Element(path, i)));
    out.push_back(v);
  }
  return out;
}

// `[offset, [strides...]]`
Result<StridedView> ReadView(const Json& j, std::string_view path) {
  if (!j.is_array() || j.size() != 2) return TypeError(path, "[offset, [strides...]]", j);
  StridedView view;
  RESHARD_ASSIGN_OR_RETURN(view.offset, ReadIndex(j[0], Element(path, 0)));
  RESHARD_ASSIGN_OR_RETURN(view.strides, ReadIndexArray(j[1], Element(path, 1)));
  return view;
}

Result<std::vector<Rank>> ReadLocations(const Json& j, std::string_view path) {
  if (!j.is_array()) return TypeError(path, "an array of ranks", j);
  std::vector<Rank> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = Element(path, i);
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadIndex(j[i], at));
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
  RESHARD_ASSIGN_OR_RETURN(piece.shape, ReadIndexArray(*shape, Member(path, "shape")));
  RESHARD_ASSIGN_OR_RETURN(const Json* source, Require(j, path, "source"));
  RESHARD_ASSIGN_OR_RETURN(piece.source, ReadView(*source, Member(path, "source")));
  RESHARD_ASSIGN_OR_RETURN(const Json* dest, Require(j, path, "dest"));
  RESHARD_ASSIGN_OR_RETURN(piece.dest, ReadView(*dest, Member(path, "dest")));
  RESHARD_ASSIGN_OR_RETURN(const Json* locations, Require(j, path, "locations"));
  RESHARD_ASSIGN_OR_RETURN(piece.locations, ReadLocations(*locations, Member(path, "locations")));
  if (const Json* scale = Find(j, "scale")) {
    if (!scale->is_number()) return TypeError(Member(path, "scale"), "a number", *scale);
    if (const auto* f = scale->get_ptr<const Json::number_float_t*>()) {
      piece.scale = *f;
    } else if (const auto* u = scale->get_ptr<const Json::number_unsigned_t*>()) {
      piece.scale = static_cast<double>(*u);
    } else {
      piece.scale = static_cast<double>(*scale->get_ptr<const Json::number_integer_t*>());
    }
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
  RESHARD_ASSIGN_OR_RETURN(Shape logical_shape, ReadIndexArray(*logical, "logical_shape"));
  builder.set_logical_shape(std::move(logical_shape));
  // null is read as absent, as a writer with an optional field may spell it.
  if (const Json* valid = Find(j, "valid_shape"); valid != nullptr && !valid->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(Shape valid_shape, ReadIndexArray(*valid, "valid_shape"));
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
    RESHARD_ASSIGN_OR_RETURN(Shape shape, ReadIndexArray(*shard_shape, path + ".shard_shape"));
    builder.set_shard_shape(rank, std::move(shape));
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

// The document key for `name`: the name itself unless it would read as something else.
std::string EncodeParamKey(std::string_view name) {
  if (!name.starts_with('^') && name != "version") return std::string(name);
  std::string key = "^";
  for (char c : name) {
    if (kRegexEscaped.find(c) != std::string_view::npos) key += '\\';
    key += c;
  }
  key += '$';
  return key;
}

void AppendIndices(std::string& out, std::span<const Index> values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{}", values[i]);
  }
  out += ']';
}

void AppendView(std::string& out, const StridedView& view) {
  out += fmt::format("[{}, ", view.offset);
  AppendIndices(out, view.strides);
  out += ']';
}

// Shortest text that reads back to exactly `value` (fmt's default), always with a fraction
// or an exponent so that every reader sees a float.
std::string FormatDouble(double value) {
  std::string s = fmt::format("{}", value);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

void AppendPiece(std::string& out, const Piece& piece) {
  out += "{\"shape\": ";
  AppendIndices(out, piece.shape);
  out += ", \"source\": ";
  AppendView(out, piece.source);
  out += ", \"dest\": ";
  AppendView(out, piece.dest);
  out += ", \"locations\": [";
  for (size_t i = 0; i < piece.locations.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{}", piece.locations[i]);
  }
  out += ']';
  if (piece.scale != 1.0) out += ", \"scale\": " + FormatDouble(piece.scale);
  out += '}';
}

// The map as an object whose closing brace is indented by `indent` spaces (the opening
// brace is not indented: it follows a key or starts the text).
void AppendParamMap(std::string& out, const ParamMap& map, size_t indent) {
  const std::string i1(indent + 2, ' ');
  const std::string i2(indent + 4, ' ');
  const std::string i3(indent + 6, ' ');
  const std::string i4(indent + 8, ' ');
  out += "{\n" + i1 + "\"logical_shape\": ";
  AppendIndices(out, map.logical_shape());
  if (map.has_padding()) {
    out += ",\n" + i1 + "\"valid_shape\": ";
    AppendIndices(out, map.valid_shape());
  }
  out += ",\n" + i1 + "\"ranks\": {";
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& shard = map.rank(r);
    out += r == 0 ? "\n" : ",\n";
    out += fmt::format("{}\"{}\": {{\n{}\"shard_shape\": ", i2, r, i3);
    AppendIndices(out, shard.shard_shape);
    out += ",\n" + i3 + "\"pieces\": [";
    for (size_t p = 0; p < shard.pieces.size(); ++p) {
      out += p == 0 ? "\n" : ",\n";
      out += i4;
      AppendPiece(out, shard.pieces[p]);
    }
    if (!shard.pieces.empty()) out += "\n" + i3;
    out += "]\n" + i2 + "}";
  }
  out += "\n" + i1 + "}\n" + std::string(indent, ' ') + "}";
}

}  // namespace

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

Result<ParamMapBuilder> ParseParamMapJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(ParsedJson parsed, ParseJsonText(text));
  return ReadParamMap(parsed.root);
}

Result<MapDocumentBuilder> ParseMapDocumentJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(ParsedJson parsed, ParseJsonText(text));
  const Json& root = parsed.root;
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
  RESHARD_ASSIGN_OR_RETURN(Index v, ReadIndex(*version, "version"));
  if (v != kMapDocumentVersion) {
    return InvalidArgumentError(fmt::format(
        "version {} is not supported; this reader knows version {}", v, kMapDocumentVersion));
  }
  // Names first, so that a key error is reported before any parameter's content.
  std::vector<std::pair<std::string, const Json*>> named;
  std::unordered_map<std::string, std::string> key_of_name;
  for (const std::string& key : parsed.root_keys) {
    if (key == "version") continue;
    RESHARD_ASSIGN_OR_RETURN(std::string name, DecodeParamKey(key));
    auto [it, inserted] = key_of_name.emplace(name, key);
    if (!inserted) {
      return InvalidArgumentError(fmt::format("keys {} and {} both name parameter {}",
                                              QuoteShort(it->second), QuoteShort(key),
                                              QuoteShort(name)));
    }
    named.emplace_back(std::move(name), Find(root, key));
  }
  for (auto& [name, value] : named) {
    Result<ParamMapBuilder> builder = ReadParamMap(*value);
    if (!builder.ok()) return AnnotateParam(builder.status(), name);
    doc.params.push_back({std::move(name), std::move(builder).value()});
  }
  return doc;
}

Result<MapDocument> ReadMapDocumentJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(MapDocumentBuilder builders, ParseMapDocumentJson(text));
  MapDocument doc;
  doc.params.reserve(builders.params.size());
  for (NamedMapBuilder& named : builders.params) {
    Result<ParamMap> map = named.builder.Finalize();
    if (!map.ok()) return AnnotateParam(map.status(), named.name);
    doc.params.emplace_back(std::move(named.name), std::move(map).value());
  }
  return doc;
}

std::string ParamMapToJson(const ParamMap& map) {
  std::string out;
  AppendParamMap(out, map, 0);
  out += '\n';
  return out;
}

std::string MapDocumentToJson(const MapDocument& doc) {
  std::string out = fmt::format("{{\n  \"version\": {}", kMapDocumentVersion);
  for (const auto& [name, map] : doc.params) {
    out += ",\n  " + Quote(EncodeParamKey(name)) + ": ";
    AppendParamMap(out, map, 2);
  }
  out += "\n}\n";
  return out;
}

}  // namespace reshard
