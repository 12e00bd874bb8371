// A layouts document: the layout descriptor of every parameter of a model, by name.
//
//   {"version": 1, "<name>": <layout descriptor>, ..., "*": <layout descriptor>}
//
// A key is a parameter name or an exact-match pattern `^<regex-escaped name>$` (read as in
// map documents, ir/map_json.h); "*", when present, is the layout of every parameter the
// document does not name. Two keys that name the same parameter ("w" and "^w$") are refused,
// as are duplicate keys, a version other than 1, and a malformed descriptor (with the key and
// the JSON path inside it).
#ifndef RESHARD_LAYOUTS_LAYOUTS_DOCUMENT_H_
#define RESHARD_LAYOUTS_LAYOUTS_DOCUMENT_H_

#include <map>
#include <string>
#include <string_view>

#include "reshard/base/result.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

inline constexpr int kLayoutsDocumentVersion = 1;
/// The key of the default layout.
inline constexpr std::string_view kDefaultLayoutKey = "*";

struct LayoutsDocument {
  /// Descriptors by parameter name, and the default under kDefaultLayoutKey.
  std::map<std::string, LayoutDescriptor> layouts;

  /// The layout of `name`: its own, else the default, else nullptr.
  const LayoutDescriptor* Find(std::string_view name) const;
};

/// Parses a layouts document. InvalidArgument (with the key and JSON path) for anything
/// malformed.
Result<LayoutsDocument> ParseLayoutsDocumentJson(std::string_view text);

/// Deterministic JSON, one layout per line, keys in name order ("*" sorts first); reads
/// back to an equal document. Ends with a newline.
std::string LayoutsDocumentToJson(const LayoutsDocument& document);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_LAYOUTS_DOCUMENT_H_
