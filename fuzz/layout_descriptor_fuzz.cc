// Fuzz target for layout descriptors laid out at a world size (reshard layout, scatter
// --layouts).
//
// Input: a first line "WORLD D0,D1,..." (the world size and the parameter's shape), then a
// descriptor's JSON. For any input: parsing and laying out return a Status, never crash,
// overflow, hang or exhaust memory. A descriptor that parses must write back to JSON that
// reads to an equal descriptor; a map that is built must be canonical.
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "reshard/ir/canonicalize.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/descriptor.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "layout_descriptor_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

// A replicated map lists every rank in each rank's piece (world^2 entries): the world is kept
// small enough for that, and BuildMap's own limit is covered by the unit tests.
constexpr int64_t kMaxFuzzWorld = 512;

std::optional<int64_t> ParseNumber(std::string_view text) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// "WORLD D0,D1,...": nullopt unless both parse (a shape may be empty: "4 ").
std::optional<std::pair<int64_t, reshard::Shape>> ParseHeader(std::string_view line) {
  const size_t space = line.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  std::optional<int64_t> world = ParseNumber(line.substr(0, space));
  if (!world) return std::nullopt;
  reshard::Shape shape;
  std::string_view rest = line.substr(space + 1);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::optional<int64_t> extent = ParseNumber(rest.substr(0, comma));
    if (!extent) return std::nullopt;
    shape.push_back(*extent);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  return std::make_pair(*world, std::move(shape));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t newline = input.find('\n');
  if (newline == std::string_view::npos) return 0;
  std::optional<std::pair<int64_t, reshard::Shape>> header = ParseHeader(input.substr(0, newline));
  if (!header || header->first > kMaxFuzzWorld || header->first < -kMaxFuzzWorld) return 0;
  const int world = static_cast<int>(header->first);
  const reshard::Shape& shape = header->second;

  reshard::Result<reshard::LayoutDescriptor> descriptor =
      reshard::ParseLayoutJson(input.substr(newline + 1));
  if (!descriptor.ok()) return 0;
  const std::string json = reshard::LayoutToJson(*descriptor);
  reshard::Result<reshard::LayoutDescriptor> back = reshard::ParseLayoutJson(json);
  Require(back.ok(), "a written descriptor does not read back",
          json + "\n" + back.status().ToString());
  Require(*back == *descriptor, "a written descriptor reads back different", json);

  reshard::Result<reshard::ParamMap> map = reshard::BuildMap(*descriptor, shape, world);
  if (!map.ok()) return 0;
  const std::string map_json = reshard::ParamMapToJson(*map);
  reshard::Result<reshard::ParamMap> again = reshard::Canonicalize(*map);
  Require(again.ok(), "canonicalising a built map fails", again.status().ToString());
  Require(reshard::ParamMapToJson(*again) == map_json, "a built map is not canonical", map_json);
  return 0;
}
