// Private to the .cc files of layouts/ (it pulls in nlohmann): a strict, non-throwing walk
// over a parsed JSON object that names the JSON path of the first thing it refuses.
#ifndef RESHARD_LAYOUTS_JSON_READER_H_
#define RESHARD_LAYOUTS_JSON_READER_H_

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard::layouts_internal {

using Json = nlohmann::json;

/// Parses `text` without exceptions; refuses duplicate keys, deep nesting and trailing text.
Result<Json> ParseStrictJson(std::string_view text);

/// "path.key", "path[3]".
std::string Member(std::string_view path, std::string_view key);
std::string Element(std::string_view path, size_t index);

/// InvalidArgument "path: message" (or just the message at the root).
Status ErrorAt(std::string_view path, std::string message);
/// "path: expected <what>, got <value>".
Status TypeError(std::string_view path, std::string_view expected, const Json& got);

/// Reads a JSON integer in [min, 2^62] (a float, even 4.0, is refused).
Result<Index> ReadInt(const Json& j, std::string_view path, Index min);
Result<bool> ReadBool(const Json& j, std::string_view path);
Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, Index min);

/// An object's keys that are not in `allowed`: InvalidArgument naming the first, and the
/// keys allowed (`what` says whose keys they are).
Status CheckKeys(const Json& object, std::string_view path, const std::vector<std::string>& allowed,
                 std::string_view what);

}  // namespace reshard::layouts_internal

#endif  // RESHARD_LAYOUTS_JSON_READER_H_
