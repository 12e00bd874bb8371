#include "reshard/layouts/json_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <unordered_set>

namespace reshard::layouts_internal {

namespace {

constexpr int kMaxDepth = 64;
constexpr Index kMaxInt = Index{1} << 62;

std::string Quote(std::string_view s) {
  std::string cut(s.substr(0, 48));
  if (s.size() > 48) cut += "...";
  return Json(cut).dump(-1, ' ', false, Json::error_handler_t::replace);
}

bool IsIdentifier(std::string_view key) {
  if (key.empty() || (key[0] >= '0' && key[0] <= '9')) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string Describe(const Json& j) {
  if (j.is_string()) return Quote(*j.get_ptr<const Json::string_t*>());
  if (j.is_array()) return j.empty() ? "an empty array" : fmt::format("an array of {}", j.size());
  if (j.is_object()) return "an object";
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

std::string Member(std::string_view path, std::string_view key) {
  if (IsIdentifier(key)) return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
  return fmt::format("{}[{}]", path, Quote(key));
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

Result<Json> ParseStrictJson(std::string_view text) {
  // Nesting is bounded before parsing so no step grows with it; brackets in strings skipped.
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
    } else if ((c == '[' || c == '{') && ++depth > kMaxDepth) {
      return InvalidArgumentError(fmt::format("JSON nests deeper than {} levels", kMaxDepth));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  // The DOM keeps the last of duplicate keys; a callback sees every key and refuses repeats.
  std::vector<std::unordered_set<std::string>> keys;
  std::optional<std::string> duplicate;
  Json::parser_callback_t callback = [&](int, Json::parse_event_t event, Json& value) -> bool {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.empty() && value.is_string() &&
            !keys.back().insert(*value.get_ptr<const Json::string_t*>()).second && !duplicate) {
          duplicate = *value.get_ptr<const Json::string_t*>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json root = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (root.is_discarded()) return InvalidArgumentError("malformed JSON");
  if (duplicate) return InvalidArgumentError(fmt::format("duplicate key {}", Quote(*duplicate)));
  return root;
}

Result<Index> ReadInt(const Json& j, std::string_view path, Index min) {
  std::optional<Index> value;
  if (const auto* u = j.get_ptr<const Json::number_unsigned_t*>()) {
    if (*u <= static_cast<uint64_t>(kMaxInt)) value = static_cast<Index>(*u);
  } else if (const auto* i = j.get_ptr<const Json::number_integer_t*>()) {
    if (*i <= kMaxInt && *i >= -kMaxInt) value = Index{*i};
  } else {
    return TypeError(
        path,
        min >= 0 ? (min == 0 ? "a non-negative integer" : "a positive integer") : "an integer", j);
  }
  if (!value || *value < min || *value > kMaxInt) {
    return ErrorAt(path, fmt::format("{} is outside {}..2^62", Describe(j), min));
  }
  return *value;
}

Result<bool> ReadBool(const Json& j, std::string_view path) {
  if (!j.is_boolean()) return TypeError(path, "true or false", j);
  return *j.get_ptr<const Json::boolean_t*>();
}

Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, Index min) {
  if (!j.is_array()) return TypeError(path, "an array of integers", j);
  std::vector<Index> out;
  out.reserve(j.size());
  for (size_t k = 0; k < j.size(); ++k) {
    RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(j[k], Element(path, k), min));
    out.push_back(v);
  }
  return out;
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

}  // namespace reshard::layouts_internal
