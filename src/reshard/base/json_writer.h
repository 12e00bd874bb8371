// The library's one JSON writer for documents (param maps, map documents, the sharded
// checkpoint's manifest): internal to the library's .cc files, like json_reader.h.
//
// Documents are built as JSON values (nlohmann::ordered_json: members keep the order they were
// added in) and written deterministically, so the same value is always the same bytes:
//   - a container nested at most `inline_depth` levels deep is written on one line, with ", "
//     and ": " separators: {"shape": [8, 8], "source": [0, [8, 1]], "locations": [0]};
//   - a deeper one, and the outermost one (the document), is written one member per line,
//     indented by two spaces per level;
//   - strings through json::Quote (invalid UTF-8 replaced); integers in decimal; floats as the
//     shortest text that reads back to exactly the same double, always with a fraction or an
//     exponent so every reader sees a float.
#ifndef RESHARD_BASE_JSON_WRITER_H_
#define RESHARD_BASE_JSON_WRITER_H_

#include <nlohmann/json.hpp>
#include <string>

namespace reshard::json {

using OrderedJson = nlohmann::ordered_json;

/// Depth of a param map's piece: {"source": [offset, [strides]]} is three levels.
inline constexpr int kInlineDepth = 3;

/// Appends the member `key` to `object` (an object, or null: it becomes one) in constant time.
/// `key` must not be a member yet. ordered_json's operator[] searches the members first, so
/// filling an object of n members with it costs n^2 key comparisons.
void AppendMember(OrderedJson& object, std::string key, OrderedJson value);

/// `value` as text, ending without a newline (see the header comment for the layout).
std::string WriteJson(const OrderedJson& value, int inline_depth = kInlineDepth);

}  // namespace reshard::json

#endif  // RESHARD_BASE_JSON_WRITER_H_
