// The library's one strict JSON reader: internal to the .cc files of reshard (it pulls in
// nlohmann/json, which public headers do not).
//
// Every JSON file reshard reads is untrusted, so reading is two passes:
//   1. `ParseJson` builds a DOM from text, in time linear in the text. It refuses malformed
//      JSON (with the parser's line and column), duplicate keys (the DOM would keep only the
//      last one), nesting deeper than `kMaxJsonDepth` (checked before parsing, so no step grows
//      with it) and any byte after the value but whitespace (a NUL would otherwise end the text
//      early). It can record the order of the top-level keys, which the DOM sorts.
//   2. A typed walk over the DOM with the functions below. None throws: every value's type is
//      checked before it is read, and each error names the JSON path of the value it refuses,
//      outer to inner: `ranks["3"].pieces[1].source[1][0]: expected an integer, got 2.5`.
#ifndef RESHARD_BASE_JSON_READER_H_
#define RESHARD_BASE_JSON_READER_H_

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard::json {

using Json = nlohmann::json;

/// Deeper nesting is refused. A param map nests 8 levels, a manifest 11.
inline constexpr int kMaxJsonDepth = 128;

/// Parses `text`: InvalidArgument for malformed JSON, a duplicate key (with its path), nesting
/// deeper than kMaxJsonDepth, or bytes after the value. When `top_level_keys` is given and the
/// value is an object, it receives the object's keys in file order.
Result<Json> ParseJson(std::string_view text, std::vector<std::string>* top_level_keys = nullptr);

/// A JSON string literal for `s` (escaped; invalid UTF-8 replaced).
std::string Quote(std::string_view s);
/// Quote(s), cut at a UTF-8 boundary after 48 bytes and marked "...".
std::string QuoteShort(std::string_view s);
/// What a value is, for "expected X, got Y": its text, or "an object", "an array of 3 elements".
std::string Describe(const Json& j);

/// `path` extended by an object member (`ranks`, `a.pieces`, `ranks["3"]`) or an array element.
std::string Member(std::string_view path, std::string_view key);
std::string Element(std::string_view path, size_t index);

/// InvalidArgument "path: message", or just the message at the root (empty path).
Status ErrorAt(std::string_view path, std::string message);
/// "path: expected <expected>, got <Describe(got)>".
Status TypeError(std::string_view path, std::string_view expected, const Json& got);

/// The member `key` of `object` (which must be an object), or nullptr.
const Json* Find(const Json& object, std::string_view key);
/// The member `key`, or InvalidArgument "path: missing key "key"".
Result<const Json*> Require(const Json& object, std::string_view path, std::string_view key);

/// Bounds for an integer; a value outside them is refused naming both.
struct IntRange {
  Index min = std::numeric_limits<Index>::min();
  Index max = std::numeric_limits<Index>::max();
};
/// Non-negative integers up to kMaxIndex (2^62): counts, sizes, extents.
inline constexpr IntRange kCount{0, kMaxIndex};
/// Positive integers up to kMaxIndex.
inline constexpr IntRange kPositive{1, kMaxIndex};

/// A JSON integer within `range` (a float, even 4.0, is refused; so is one beyond int64).
Result<Index> ReadInt(const Json& j, std::string_view path, IntRange range = {});
/// An array of integers, each within `range`.
Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, IntRange range = {});
/// ReadInt / ReadIntArray within [min, kMaxIndex].
Result<Index> ReadInt(const Json& j, std::string_view path, Index min);
Result<std::vector<Index>> ReadIntArray(const Json& j, std::string_view path, Index min);
Result<bool> ReadBool(const Json& j, std::string_view path);
Result<std::string> ReadString(const Json& j, std::string_view path);
/// Any JSON number, as a double.
Result<double> ReadNumber(const Json& j, std::string_view path);

/// InvalidArgument naming the first key of `object` not in `allowed`, and the keys allowed
/// (`what` says whose keys they are: "family \"split\"").
Status CheckKeys(const Json& object, std::string_view path, const std::vector<std::string>& allowed,
                 std::string_view what);

}  // namespace reshard::json

#endif  // RESHARD_BASE_JSON_READER_H_
