// Fuzz target for the index-map reader and inference (reshard infer).
//
// For any input: parsing and inference return a Status, never crash, hang or exhaust memory.
// When inference succeeds, the map must expand back to exactly the observed index maps and be
// a fixed point of canonicalisation; a mismatch aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reshard/ir/canonicalize.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "index_maps_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

// Expanding a map costs one step per shard element; inputs are small enough.
constexpr reshard::Index kMaxCheckedElements = 1 << 16;

void Check(const reshard::IndexMaps& observed, const reshard::ParamMap& map) {
  reshard::Index elements = 0;
  for (const auto& r : map.ranks()) elements += reshard::ProductOf(r.shard_shape);
  if (elements > kMaxCheckedElements) return;
  const std::string json = reshard::ParamMapToJson(map);
  const reshard::IndexMaps back = reshard::ToIndexMaps(map);
  for (const reshard::ObservedShard& want : observed.ranks) {
    const reshard::ObservedShard& got = back.ranks[static_cast<size_t>(want.rank)];
    Require(got.index_map == want.index_map, "inferred map moves elements", json);
  }
  reshard::Result<reshard::ParamMap> again = reshard::Canonicalize(map);
  Require(again.ok(), "canonicalising the inferred map fails", again.status().ToString());
  Require(reshard::ParamMapToJson(*again) == json, "inferred map is not canonical",
          json + "\n" + reshard::ParamMapToJson(*again));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  reshard::Result<reshard::IndexMaps> observed = reshard::ParseIndexMapsJson(text);
  if (!observed.ok()) return 0;
  for (bool partial : {false, true}) {
    reshard::Result<reshard::ParamMap> map =
        reshard::Infer(*observed, {.allow_uncovered = partial});
    if (map.ok()) Check(*observed, *map);
  }
  return 0;
}
