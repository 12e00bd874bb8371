// Fuzz target for block images (ir/block_grid.h): a param map read from the input, and a block
// drawn from the input's first bytes.
//
// For any input: BlockImage returns a Status, never crashes, hangs or reads out of bounds. When
// it returns a map, that map is valid and canonical (canonicalising changes nothing) and
// CheckBlockTie accepts it as the image of the data; a mismatch aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reshard/ir/block_grid.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/map_json.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "block_image_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 4, size - 4);
  reshard::Result<reshard::ParamMapBuilder> b = reshard::ParseParamMapJson(text);
  if (!b.ok()) return 0;
  reshard::Result<reshard::ParamMap> map = b->Finalize();
  if (!map.ok()) return 0;
  const reshard::Shape& shape = map->logical_shape();
  reshard::Shape block;
  for (size_t j = 0; j < shape.size(); ++j) block.push_back(1 + data[j % 4] % 8);
  reshard::Result<reshard::Shape> grid = reshard::BlockGridShape(shape, block);
  if (!grid.ok()) return 0;
  reshard::Result<reshard::ParamMap> image = reshard::BlockImage(*map, block, *grid);
  if (!image.ok()) return 0;
  const std::string json = reshard::ParamMapToJson(*image);
  reshard::Result<reshard::ParamMap> canonical = reshard::Canonicalize(*image);
  Require(canonical.ok() && *canonical == *image, "the image is not canonical", json);
  const reshard::Status tied = reshard::CheckBlockTie(*map, *image, block);
  Require(tied.ok(), "CheckBlockTie refuses the image", tied.ToString() + "\n" + json);
  return 0;
}
