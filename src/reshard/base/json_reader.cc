// The strict JSON reader (see json_reader.h).
#include "reshard/base/json_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <unordered_set>

namespace reshard::json {
namespace {

// A string quoted in an error message is cut to this many bytes.
constexpr size_t kMaxQuotedBytes = 48;

bool IsIdentifier(std::string_view key) {
  if (key.empty() || (key[0] >= '0' && key[0] <= '9')) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// Refuses nesting deeper than kMaxJsonDepth. Tracks strings so brackets inside them do not
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
      if (++depth > kMaxJsonDepth) {
        return InvalidArgumentError(
            fmt::format("JSON nests deeper than {} levels (at byte {})", kMaxJsonDepth, i));
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

// Parses text that holds no NUL byte (nlohmann's lexer reads a NUL as the end of the input).
Result<Json> ParseWithoutNul(std::string_view text, std::vector<std::string>* top_level_keys) {
  RESHARD_RETURN_IF_ERROR(CheckNesting(text));
  struct Frame {
    bool is_object = false;
    size_t count = 0;  // completed elements, for arrays
    std::string key;   // current key, for objects
    std::unordered_set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::optional<Status> error;
  std::vector<std::string> keys_in_order;
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
        if (stack.size() == 1 && top_level_keys != nullptr) keys_in_order.push_back(top.key);
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
  Json root = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (root.is_discarded()) return InvalidArgumentError(DescribeSyntaxError(text));
  if (error) return *error;
  if (top_level_keys != nullptr) {
    *top_level_keys = root.is_object() ? std::move(keys_in_order) : std::vector<std::string>{};
  }
  return root;
}

std::string DescribeRange(IntRange range) {
  auto bound = [](Index v) {
    if (v == kMaxIndex) return std::string("2^62");
    if (v == -kMaxIndex) return std::string("-2^62");
    return fmt::format("{}", v);
  };
  return fmt::format("{}..{}", bound(range.min), bound(range.max));
}

}  // namespace

Result<Json> ParseJson(std::string_view text, std::vector<std::string>* top_level_keys) {
  const size_t nul = text.find('\0');
  if (nul == std::string_view::npos) return ParseWithoutNul(text, top_level_keys);
  // A NUL is never part of JSON text. Say whether it follows a complete value.
  if (ParseWithoutNul(text.substr(0, nul), nullptr).ok()) {
    return InvalidArgumentError(
        fmt::format("malformed JSON: {} byte{} after the JSON value, from byte {} (a NUL)",
                    text.size() - nul, text.size() - nul == 1 ? "" : "s", nul));
  }
  return InvalidArgumentError(fmt::format("malformed JSON: a NUL byte at byte {}", nul));
}

std::string Quote(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string QuoteShort(std::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return Quote(s);
  size_t cut = kMaxQuotedBytes;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  std::string quoted = Quote(s.substr(0, cut));
  quoted.insert(quoted.size() - 1, "...");
  return quoted;
}

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

std::string Member(std::string_view path, std::string_view key) {
  if (IsIdentifier(key)) return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
  return fmt::format("{}[{}]", path, QuoteShort(key));
}

std::string Element(std::string_view path, size_t index) {
  return fmt::format("{}[{}]", path, index);
}

Status ErrorAt(std::string_view path, std::string message) {
  if (path.empty()) return InvalidArgumentError(std::move(message));
  return InvalidArgumentError(fmt::format("{}: {}", path, message));
}

Status TypeError(std::string_view path, std::string_view expected, const Json& got) {
  return ErrorAt(path, fmt::format("expected {}, got {}", expected, Describe(got)));
}

const Json* Find(const Json& object, std::string_view key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(std::string(key));
  return it == object.end() ? nullptr : &*it;
}

Result<const Json*> Require(const Json& object, std::string_view path, std::string_view key) {
  const Json* found = Find(object, key);
  if (found == nullptr) return ErrorAt(path, fmt::format("missing key {}", Quote(key)));
  return found;
}

Result<Index> ReadInt(const Json& j, std::string_view path, IntRange range) {
  Index value = 0;
  if (const auto* u = j.get_ptr<const Json::number_unsigned_t*>()) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<Index>::max())) {
      return ErrorAt(path, fmt::format("integer {} is outside the range of int64", *u));
    }
    value = static_cast<Index>(*u);
  } else if (const auto* i = j.get_ptr<const Json::number_integer_t*>()) {
    value = Index{*i};
  } else {
    return TypeError(path,
                     range.min == 0   ? "a non-negative integer"
                     : range.min == 1 ? "a positive integer"
                                      : "an integer",
                     j);
  }
  if (value < range.min || value > range.max) {
    return ErrorAt(path, fmt::format("{} is outside {}", value, DescribeRange(range)));
  }
  return value;
}

Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, IntRange range) {
  if (!j.is_array()) return TypeError(path, "an array of integers", j);
  std::vector<Index> out;
  out.reserve(j.size());
  for (size_t k = 0; k < j.size(); ++k) {
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(j[k], Element(path, k), range));
    out.push_back(v);
  }
  return out;
}

Result<Index> ReadInt(const Json& j, std::string_view path, Index min) {
  return ReadInt(j, path, IntRange{min, kMaxIndex});
}

Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, Index min) {
  return ReadIntArray(j, path, IntRange{min, kMaxIndex});
}

Result<bool> ReadBool(const Json& j, std::string_view path) {
  if (!j.is_boolean()) return TypeError(path, "true or false", j);
  return *j.get_ptr<const Json::boolean_t*>();
}

Result<std::string> ReadString(const Json& j, std::string_view path) {
  if (!j.is_string()) return TypeError(path, "a string", j);
  return *j.get_ptr<const Json::string_t*>();
}

Result<double> ReadNumber(const Json& j, std::string_view path) {
  if (const auto* f = j.get_ptr<const Json::number_float_t*>()) return *f;
  if (const auto* u = j.get_ptr<const Json::number_unsigned_t*>()) return static_cast<double>(*u);
  if (const auto* i = j.get_ptr<const Json::number_integer_t*>()) return static_cast<double>(*i);
  return TypeError(path, "a number", j);
}

Status CheckKeys(const Json& object, std::string_view path, const std::vector<std::string>& allowed,
                 std::string_view what) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
      std::string list;
      for (const std::string& k : allowed) list += (list.empty() ? "" : ", ") + k;
      return ErrorAt(Member(path, it.key()),
                     fmt::format("unknown key for {} (allowed: {})", what, list));
    }
  }
  return Status::Ok();
}

}  // namespace reshard::json
