// Fuzz target for the map JSON reader (map_json.h) and the validator behind it.
//
// For any input: parsing and validation must return a Status, never crash, hang or read out
// of bounds. For an input that holds valid maps, the writer's output must read back to the
// same maps and write again to the same bytes; a mismatch aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reshard/ir/map_json.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "map_reader_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

void CheckRoundTrip(const reshard::ParamMap& map) {
  const std::string json = reshard::ParamMapToJson(map);
  reshard::Result<reshard::ParamMapBuilder> parsed = reshard::ParseParamMapJson(json);
  Require(parsed.ok(), "written map does not parse", parsed.status().ToString() + "\n" + json);
  reshard::Result<reshard::ParamMap> back = parsed->Finalize();
  Require(back.ok(), "written map does not validate", back.status().ToString() + "\n" + json);
  Require(*back == map, "written map reads back different", json);
  Require(reshard::ParamMapToJson(*back) == json, "written map writes different bytes", json);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  // The single-map reader, with and without the coverage requirement.
  if (reshard::Result<reshard::ParamMapBuilder> b = reshard::ParseParamMapJson(text); b.ok()) {
    reshard::ValidateOptions partial;
    partial.require_coverage = false;
    (void)b->Finalize(partial);
  }

  reshard::Result<reshard::MapDocumentBuilder> doc = reshard::ParseMapDocumentJson(text);
  if (!doc.ok()) return 0;
  reshard::MapDocument valid;
  for (const reshard::NamedMapBuilder& param : doc->params) {
    reshard::Result<reshard::ParamMap> map = param.builder.Finalize();
    if (!map.ok()) continue;
    CheckRoundTrip(*map);
    valid.params.emplace_back(param.name, std::move(map).value());
  }
  // Buffers (version 2): the valid maps with the document's declarations; a set that does not
  // check (some map was invalid, or the declarations do not fit) is not written back.
  if (!reshard::ValidateBuffers(valid, doc->buffers).ok()) return 0;
  const std::string json = reshard::MapDocumentToJson(valid);
  reshard::Result<reshard::MapDocument> back = reshard::ReadMapDocumentJson(json);
  Require(back.ok(), "written document does not read", back.status().ToString() + "\n" + json);
  Require(back->params == valid.params, "written document reads back different", json);
  Require(reshard::MapDocumentToJson(*back) == json, "written document writes different bytes",
          json);
  return 0;
}
