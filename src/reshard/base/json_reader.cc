// The strict JSON reader (see json_reader.h).
#include "reshard/base/json_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <list>
#include <optional>

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

// Builds the DOM from the parser's events, refusing duplicate keys. Each event costs time in
// proportion to its own size, never to its siblings' (nlohmann's callback parser rescans the
// parent container at every object's end, quadratic in the number of objects).
class DomBuilder : public nlohmann::json_sax<Json> {
 public:
  DomBuilder(Json& root, std::vector<std::string>* top_level_keys)
      : root_(root), top_level_keys_(top_level_keys) {}

  bool null() override { return Add(nullptr); }
  bool boolean(bool v) override { return Add(v); }
  bool number_integer(number_integer_t v) override { return Add(v); }
  bool number_unsigned(number_unsigned_t v) override { return Add(v); }
  // A literal a double cannot hold (1e400, 1e-400) is refused rather than read as inf or 0.
  bool number_float(number_float_t v, const string_t& text) override {
    // The literal as written, cut short (a number may be a megabyte of digits).
    const std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
    if (!error_ && !std::isfinite(v)) {
      error_ =
          ErrorAt(PathOfValue(), fmt::format("number {} is out of the range of a double", shown));
    }
    const std::string_view mantissa = std::string_view(text).substr(0, text.find_first_of("eE"));
    if (!error_ && v == 0 && mantissa.find_first_of("123456789") != std::string_view::npos) {
      error_ =
          ErrorAt(PathOfValue(),
                  fmt::format("number {} is too small for a double (it would read as 0)", shown));
    }
    return Add(v);
  }
  bool string(string_t& v) override { return Add(std::move(v)); }
  bool binary(binary_t& v) override { return Add(Json::binary(std::move(v))); }
  bool start_object(std::size_t) override { return Open(Json::object()); }
  bool start_array(std::size_t) override { return Open(Json::array()); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }

  bool key(string_t& k) override {
    Frame& top = stack_.back();
    Json::object_t& object = *top.value->get_ptr<Json::object_t*>();
    if (stack_.size() == 1 && top_level_keys_ != nullptr) top_level_keys_->push_back(k);
    auto [it, inserted] = object.try_emplace(k);
    if (!inserted && !error_) {
      error_ = ErrorAt(PathOfTop(), fmt::format("duplicate key {}", QuoteShort(k)));
    }
    // A duplicate's value goes to a scratch slot of its own (a duplicate nested in a
    // duplicate's value must not overwrite the container the stack still points into): the
    // first value stays, the error says so.
    if (!inserted) scratch_.emplace_back();
    slot_ = inserted ? &it->second : &scratch_.back();
    top.key = std::move(k);
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 4: ..." -> from "parse
    // error" on, cut to a readable length.
    std::string_view what = e.what();
    if (const size_t start = what.find("] "); start != std::string_view::npos) {
      what.remove_prefix(start + 2);
    }
    if (what.size() > 200) what = what.substr(0, 200);
    syntax_error_ = fmt::format("malformed JSON: {}", what);
    return false;
  }

  const std::optional<std::string>& syntax_error() const { return syntax_error_; }
  const std::optional<Status>& error() const { return error_; }

 private:
  struct Frame {
    Json* value = nullptr;
    std::string key;  // the current member's key, for objects
  };

  // Where the next value goes: the root, the end of the open array, or the member just keyed.
  Json* Place(Json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json* parent = stack_.back().value;
    if (Json::array_t* array = parent->get_ptr<Json::array_t*>()) {
      array->push_back(std::move(value));
      return &array->back();
    }
    *slot_ = std::move(value);
    return slot_;
  }
  bool Add(Json value) {
    Place(std::move(value));
    return true;
  }
  bool Open(Json empty) {
    Json* placed = Place(std::move(empty));
    stack_.push_back(Frame{placed, {}});
    return true;
  }
  bool Close() {
    stack_.pop_back();
    return true;
  }
  // The JSON path of the open container (for a duplicate key's message).
  std::string PathOfTop() const {
    std::string path;
    for (size_t i = 0; i + 1 < stack_.size(); ++i) {
      const Json& v = *stack_[i].value;
      path = v.is_object() ? Member(path, stack_[i].key) : Element(path, v.size() - 1);
    }
    return path;
  }

  // The JSON path of the value being added (the member just keyed, or the open array's next
  // element).
  std::string PathOfValue() const {
    if (stack_.empty()) return "";
    const Json& top = *stack_.back().value;
    return top.is_object() ? Member(PathOfTop(), stack_.back().key)
                           : Element(PathOfTop(), top.size());
  }

  Json& root_;
  std::vector<std::string>* top_level_keys_;
  std::vector<Frame> stack_;
  Json* slot_ = nullptr;
  std::list<Json> scratch_;  // stable addresses
  std::optional<std::string> syntax_error_;
  std::optional<Status> error_;
};

// Parses text that holds no NUL byte (nlohmann's lexer reads a NUL as the end of the input).
Result<Json> ParseWithoutNul(std::string_view text, std::vector<std::string>* top_level_keys) {
  RESHARD_RETURN_IF_ERROR(CheckNesting(text));
  Json root;
  std::vector<std::string> keys_in_order;
  DomBuilder builder(root, &keys_in_order);
  const bool parsed = Json::sax_parse(text.begin(), text.end(), &builder);
  if (!parsed || builder.syntax_error()) {
    return InvalidArgumentError(builder.syntax_error().value_or("malformed JSON"));
  }
  if (builder.error()) return *builder.error();
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
