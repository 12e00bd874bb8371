// reshard show (MAP.json | DIR/reshard.json | DIR) [--dtype BF16] [--rows R] [--cols C] [--json]
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "exit_status.h"
#include "reshard/base/dtype.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"

namespace reshard::cli {

namespace {

struct ShowArgs {
  std::string path;
  std::string dtype;  // empty: the manifest's dtype, or BF16 for a map document
  int rows = 16;
  int cols = 64;
  bool json = false;
};

std::string HumanBytes(Index bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int u = 0;
  while (value >= 1024 && u < 4) {
    value /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, units[u]);
}

void PrintText(const std::string& name, const ParamMap& map, const MapSummary& s, size_t elem,
               std::string_view dtype, const std::vector<std::string>& picture) {
  fmt::print("{}{}F {}{}, {} elements; {} ranks, {} pieces\n",
             name.empty() ? "" : fmt::format("parameter \"{}\": ", name), "",
             FormatShape(map.logical_shape()),
             map.has_padding() ? fmt::format(" (valid {})", FormatShape(map.valid_shape())) : "",
             s.full_elements, map.world_size(), map.num_pieces());
  fmt::print("  {:>4}  {:>6}  {:>16}  {:>12}  {:>12}  {:>12}\n", "rank", "pieces", "shard shape",
             fmt::format("held ({})", dtype), "replicated", "scaled");
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankSummary& rs = s.ranks[static_cast<size_t>(r)];
    fmt::print("  {:>4}  {:>6}  {:>16}  {:>12}  {:>12}  {:>12}\n", r, rs.pieces,
               FormatShape(map.rank(r).shard_shape),
               HumanBytes(rs.elements * static_cast<Index>(elem)),
               HumanBytes(rs.replicated_elements * static_cast<Index>(elem)),
               HumanBytes(rs.scaled_elements * static_cast<Index>(elem)));
  }
  fmt::print("  total held {} for {} of F ({:.2f}x); replicated {}; scaled {}\n",
             HumanBytes(s.held_elements * static_cast<Index>(elem)),
             HumanBytes(s.valid_elements * static_cast<Index>(elem)),
             s.valid_elements
                 ? static_cast<double>(s.held_elements) / static_cast<double>(s.valid_elements)
                 : 0.0,
             HumanBytes(s.replicated_elements * static_cast<Index>(elem)),
             HumanBytes(s.scaled_elements * static_cast<Index>(elem)));
  if (!picture.empty()) {
    fmt::print(
        "  holders (rows x columns of F, sampled; digit = rank, * = all ranks, + = several, . = "
        "padding):\n");
    for (const std::string& line : picture) fmt::print("    |{}|\n", line);
  }
}

// One parameter to show, with the element type its bytes are counted in.
struct ShownParam {
  std::string name;
  ParamMap map;
  DType dtype;
};

nlohmann::ordered_json SummaryJson(const ShownParam& p, const MapSummary& s,
                                   const Result<std::vector<std::string>>& picture) {
  const Index elem = static_cast<Index>(DTypeSize(p.dtype));
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (Rank r = 0; r < p.map.world_size(); ++r) {
    const RankSummary& rs = s.ranks[static_cast<size_t>(r)];
    ranks.push_back({{"rank", r},
                     {"pieces", rs.pieces},
                     {"shard_shape", p.map.rank(r).shard_shape},
                     {"elements", rs.elements},
                     {"bytes", rs.elements * elem},
                     {"replicated_bytes", rs.replicated_elements * elem},
                     {"scaled_bytes", rs.scaled_elements * elem}});
  }
  nlohmann::ordered_json entry = {{"name", p.name},
                                  {"logical_shape", p.map.logical_shape()},
                                  {"valid_shape", p.map.valid_shape()},
                                  {"world_size", p.map.world_size()},
                                  {"pieces", p.map.num_pieces()},
                                  {"dtype", std::string(DTypeName(p.dtype))},
                                  {"held_bytes", s.held_elements * elem},
                                  {"replicated_bytes", s.replicated_elements * elem},
                                  {"scaled_bytes", s.scaled_elements * elem},
                                  {"ranks", std::move(ranks)}};
  if (picture.ok()) entry["picture"] = *picture;
  return entry;
}

// The parameters of a sharded checkpoint: its manifest (a file) or its directory.
Result<std::vector<ShownParam>> ReadManifestParams(const std::string& path, std::string text,
                                                   std::optional<DType> dtype) {
  Result<Manifest> manifest = ParseManifestJson(text);
  if (!manifest.ok()) return manifest.status().Annotate(fmt::format("error reading \"{}\"", path));
  std::vector<ShownParam> out;
  for (ShardedParam& p : manifest->params) {
    out.push_back({std::move(p.name), std::move(p.map), dtype.value_or(p.dtype)});
  }
  return out;
}

// What `path` holds: a map document (invalid maps reported and skipped; `failure` is the
// worst of them), a manifest, or a sharded checkpoint directory.
Result<std::vector<ShownParam>> ReadShownParams(const std::string& path, std::optional<DType> dtype,
                                                Status& failure) {
  if (std::filesystem::is_directory(path)) {
    const std::string manifest = (std::filesystem::path(path) / kManifestName).string();
    RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest));
    return ReadManifestParams(manifest, std::move(text), dtype);
  }
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  if (IsManifestJson(text)) return ReadManifestParams(path, std::move(text), dtype);
  Result<ValidatedMapDocument> doc = ValidateMapDocumentJson(text);
  if (!doc.ok()) return doc.status().Annotate(fmt::format("error reading \"{}\"", path));
  std::vector<ShownParam> out;
  for (ValidatedParam& p : doc->params) {
    if (!p.map.ok()) {
      const Status s = p.status().Annotate(fmt::format("\"{}\"", path));
      fmt::print(stderr, "reshard show: {}\n", s.message());
      if (ExitStatusFor(s) > ExitStatusFor(failure)) failure = Status(s.code(), "");
      continue;
    }
    out.push_back({std::move(p.name), *std::move(p.map), dtype.value_or(DType::kBF16)});
  }
  return out;
}

Status RunShow(const ShowArgs& args) {
  std::optional<DType> dtype;
  if (!args.dtype.empty()) {
    dtype = DTypeFromName(args.dtype);
    if (!dtype) {
      return InvalidArgumentError(fmt::format(
          "unknown dtype \"{}\"; use a safetensors name such as BF16, F16, F32", args.dtype));
    }
  }
  Status failure;
  RESHARD_ASSIGN_OR_RETURN(std::vector<ShownParam> params,
                           ReadShownParams(args.path, dtype, failure));
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const ShownParam& p : params) {
    MapSummary s = Summarize(p.map);
    Result<std::vector<std::string>> picture = HolderPicture(p.map, args.rows, args.cols);
    if (args.json) {
      out.push_back(SummaryJson(p, s, picture));
    } else {
      PrintText(p.name, p.map, s, DTypeSize(p.dtype), DTypeName(p.dtype),
                picture.ok() ? *picture : std::vector<std::string>{});
      fmt::print("\n");
    }
  }
  if (args.json) fmt::print("{}\n", out.dump(2));
  return failure;
}

void AddShowOptions(CLI::App* cmd, ShowArgs* args) {
  cmd->add_option("MAP", args->path,
                  "param map or map document (JSON), a sharded checkpoint's reshard.json, or "
                  "its directory")
      ->required();
  cmd->add_option("--dtype", args->dtype,
                  "element type used to count bytes (safetensors name; default: the "
                  "checkpoint's, or BF16 for a map document)");
  cmd->add_option("--rows", args->rows, "picture height in characters")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--cols", args->cols, "picture width in characters")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  AddJsonFlag(cmd, args->json, "print a machine-readable summary on stdout");
}

}  // namespace

CommandBody ShowCommand() { return {AddShowOptions, RunShow}; }

}  // namespace reshard::cli
