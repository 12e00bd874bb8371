#include "reshard/layouts/layouts_document.h"

#include <fmt/format.h>

#include <vector>

#include "reshard/base/json_reader.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_json_value.h"
#include "reshard/layouts/descriptor_json.h"

namespace reshard {

const LayoutDescriptor* LayoutsDocument::Find(std::string_view name) const {
  auto it = layouts.find(std::string(name));
  if (it == layouts.end()) it = layouts.find(std::string(kDefaultLayoutKey));
  return it == layouts.end() ? nullptr : &it->second;
}

Result<LayoutsDocument> ParseLayoutsDocumentJson(std::string_view text) {
  std::vector<std::string> keys;
  RESHARD_ASSIGN_OR_RETURN(json::Json root, json::ParseJson(text, &keys));
  if (!root.is_object()) {
    return json::TypeError("", "a layouts document {\"version\": 1, \"<name>\": <layout>, ...}",
                           root);
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* version, json::Require(root, "", "version"));
  RESHARD_RETURN_IF_ERROR(CheckDocumentVersion(*version).status());
  RESHARD_ASSIGN_OR_RETURN(auto named, DecodeDocumentKeys(root, keys, "the layout of"));
  LayoutsDocument doc;
  for (const auto& [name, value] : named) {
    Result<LayoutDescriptor> layout = LayoutFromJson(*value);
    if (!layout.ok()) return layout.status().Annotate(fmt::format("[{}]", json::QuoteShort(name)));
    doc.layouts.emplace(name, *std::move(layout));
  }
  return doc;
}

std::string LayoutsDocumentToJson(const LayoutsDocument& document) {
  std::string out = fmt::format("{{\n  \"version\": {}", kLayoutsDocumentVersion);
  for (const auto& [name, layout] : document.layouts) {
    const std::string key = name == kDefaultLayoutKey ? name : EncodeParamKey(name);
    out += fmt::format(",\n  {}: {}", json::Quote(key), LayoutToJson(layout));
  }
  out += "\n}\n";
  return out;
}

}  // namespace reshard
