// reshard show MAP.json [--dtype BF16] [--rows R] [--cols C] [--json]
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_status.h"
#include "reshard/base/dtype.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"

namespace reshard::cli {

namespace {

struct ShowArgs {
  std::string path;
  std::string dtype = "BF16";
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

int RunShow(const ShowArgs& args) {
  std::optional<DType> dtype = DTypeFromName(args.dtype);
  if (!dtype) {
    return Report(
        "show",
        InvalidArgumentError(fmt::format(
            "unknown dtype \"{}\"; use a safetensors name such as BF16, F16, F32", args.dtype)),
        kExitUsage);
  }
  Result<std::string> text = ReadFileToString(args.path);
  if (!text.ok())
    return Report("show", text.status(), ExitStatusFor(text.status(), Stage::kReading));
  Result<MapDocumentBuilder> doc = ParseMapDocumentJson(*text);
  if (!doc.ok()) {
    Status s = doc.status().Annotate(fmt::format("error reading \"{}\"", args.path));
    return Report("show", s, ExitStatusFor(s, Stage::kReading));
  }
  const size_t elem = DTypeSize(*dtype);
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  int status = kExitOk;
  for (const NamedMapBuilder& p : doc->params) {
    Result<ParamMap> map = p.builder.Finalize();
    if (!map.ok()) {
      const int code = ExitStatusFor(map.status(), Stage::kChecking);
      status = std::max(status, code);
      Report("show",
             map.status().Annotate(fmt::format("\"{}\": parameter \"{}\"", args.path, p.name)),
             code);
      continue;
    }
    MapSummary s = Summarize(*map);
    Result<std::vector<std::string>> picture = HolderPicture(*map, args.rows, args.cols);
    if (args.json) {
      nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
      for (Rank r = 0; r < map->world_size(); ++r) {
        const RankSummary& rs = s.ranks[static_cast<size_t>(r)];
        ranks.push_back({{"rank", r},
                         {"pieces", rs.pieces},
                         {"shard_shape", map->rank(r).shard_shape},
                         {"elements", rs.elements},
                         {"bytes", rs.elements * static_cast<Index>(elem)},
                         {"replicated_bytes", rs.replicated_elements * static_cast<Index>(elem)},
                         {"scaled_bytes", rs.scaled_elements * static_cast<Index>(elem)}});
      }
      nlohmann::ordered_json entry = {
          {"name", p.name},
          {"logical_shape", map->logical_shape()},
          {"valid_shape", map->valid_shape()},
          {"world_size", map->world_size()},
          {"pieces", map->num_pieces()},
          {"dtype", args.dtype},
          {"held_bytes", s.held_elements * static_cast<Index>(elem)},
          {"replicated_bytes", s.replicated_elements * static_cast<Index>(elem)},
          {"scaled_bytes", s.scaled_elements * static_cast<Index>(elem)},
          {"ranks", std::move(ranks)}};
      if (picture.ok()) entry["picture"] = *picture;
      out.push_back(std::move(entry));
    } else {
      PrintText(p.name, *map, s, elem, args.dtype,
                picture.ok() ? *picture : std::vector<std::string>{});
      fmt::print("\n");
    }
  }
  if (args.json) fmt::print("{}\n", out.dump(2));
  return status;
}

}  // namespace

void RegisterShow(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<ShowArgs>();
  CLI::App* cmd = app.add_subcommand(
      "show",
      "Summarise a param map or map document: pieces per rank, bytes held, replicated and "
      "scaled bytes, and a picture of which rank holds which part of F.");
  cmd->add_option("MAP", args->path, "param map or map document (JSON)")->required();
  cmd->add_option("--dtype", args->dtype, "element type used to count bytes (safetensors name)")
      ->capture_default_str();
  cmd->add_option("--rows", args->rows, "picture height in characters")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--cols", args->cols, "picture width in characters")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--json", args->json, "print a machine-readable summary on stdout");
  cmd->callback([args, &exit_status] { exit_status = RunShow(*args); });
}

}  // namespace reshard::cli
