// reshard show (MAP.json | DIR/reshard.json | DIR) [--dtype BF16] [--rows R] [--cols C] [--json]
//              [--svg FILE [--force]]
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
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
  std::string svg;
  bool force = false;
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

// What `show` draws: the parameters, the buffers their maps write into, and the ties of
// block-quantized tensors (scale tensor -> its data, block and format).
struct Shown {
  std::vector<ShownParam> params;
  BufferSet buffers;
  std::map<std::string, BlockScales> block_scales;
};

// The block grid of the data tensor `tie` scales: which rank holds each block's scale (the
// scales' map, one element a block).
BlockDrawing BlocksOf(const ShownParam& scales, const BlockScales& tie,
                      const std::vector<std::string>& picture) {
  return {fmt::format("blocks of \"{}\" ({} {}, grid {}): which rank holds each block's scale",
                      tie.data, tie.format, FormatShape(tie.block),
                      FormatShape(scales.map.valid_shape())),
          picture};
}

void PrintBlocks(const BlockDrawing& d) {
  fmt::print(
      "{}\n  (one character a block, sampled; digit = rank, + = several ranks: a block cut "
      "between them, * = all ranks)\n",
      d.title);
  for (const std::string& line : d.picture) fmt::print("    |{}|\n", line);
  fmt::print("\n");
}

// The parameters of a sharded checkpoint: its manifest (a file) or its directory.
Result<Shown> ReadManifestParams(const std::string& path, const std::string& text,
                                 std::optional<DType> dtype) {
  Result<Manifest> manifest = ParseManifestJson(text);
  if (!manifest.ok()) return manifest.status().Annotate(fmt::format("error reading \"{}\"", path));
  Shown out;
  for (ShardedParam& p : manifest->params) {
    out.params.push_back({std::move(p.name), std::move(p.map), dtype.value_or(p.dtype)});
  }
  out.buffers = std::move(manifest->buffers);
  out.block_scales = std::move(manifest->block_scales);
  return out;
}

// What `path` holds: a map document (invalid maps reported and skipped; `failure` is the
// worst of them), a manifest, or a sharded checkpoint directory.
Result<Shown> ReadShownParams(const std::string& path, std::optional<DType> dtype,
                              Status& failure) {
  if (std::filesystem::is_directory(path)) {
    const std::string manifest = (std::filesystem::path(path) / kManifestName).string();
    RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest));
    return ReadManifestParams(manifest, text, dtype);
  }
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  if (IsManifestJson(text)) return ReadManifestParams(path, text, dtype);
  Result<ValidatedMapDocument> doc = ValidateMapDocumentJson(text);
  if (!doc.ok()) return doc.status().Annotate(fmt::format("error reading \"{}\"", path));
  Shown out;
  for (ValidatedParam& p : doc->params) {
    if (!p.map.ok()) {
      const Status s = p.status().Annotate(fmt::format("\"{}\"", path));
      fmt::print(stderr, "reshard show: {}\n", s.message());
      if (ExitStatusFor(s) > ExitStatusFor(failure)) failure = Status(s.code(), "");
      continue;
    }
    out.params.push_back({std::move(p.name), *std::move(p.map), dtype.value_or(DType::kBF16)});
  }
  if (doc->buffers.ok()) {
    out.buffers = *std::move(doc->buffers);
  } else if (doc->num_invalid() == 0) {
    // Every map is valid but they do not fill their buffers exactly (as verify reports).
    const Status s = Status(StatusCode::kFailedPrecondition, doc->buffers.status().message())
                         .Annotate(fmt::format("\"{}\"", path));
    fmt::print(stderr, "reshard show: {}\n", s.message());
    if (ExitStatusFor(s) > ExitStatusFor(failure)) failure = Status(s.code(), "");
  }
  return out;
}

bool IsBuffered(const ParamMap& map) {
  return std::any_of(map.ranks().begin(), map.ranks().end(),
                     [](const RankShard& r) { return r.is_buffered(); });
}

nlohmann::ordered_json BufferJson(const BufferSummary& s) {
  const Index elem = static_cast<Index>(DTypeSize(s.dtype));
  const bool experts = s.expert_columns();
  nlohmann::ordered_json columns = nlohmann::ordered_json::array();
  for (const BufferColumn& c : s.columns) {
    nlohmann::ordered_json j;
    if (experts) {
      j["expert"] = c.expert;
    } else {
      j["tensor"] = c.label;
    }
    j["tensors"] = c.tensors;
    j["holders"] = c.holders;
    Index held = 0;
    for (const auto& row : s.cells)
      held += row[static_cast<size_t>(&c - s.columns.data())].elements;
    j["copies"] = c.elements > 0 ? static_cast<double>(held) / static_cast<double>(c.elements) : 0;
    columns.push_back(std::move(j));
  }
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (int r = 0; r < s.world_size(); ++r) {
    nlohmann::ordered_json held = nlohmann::ordered_json::array();
    const auto& row = s.cells[static_cast<size_t>(r)];
    for (size_t c = 0; c < row.size(); ++c) {
      if (row[c].elements == 0) continue;
      nlohmann::ordered_json h;
      if (experts) {
        h["expert"] = s.columns[c].expert;
      } else {
        h["tensor"] = s.columns[c].label;
      }
      if (experts) h["slots"] = row[c].slots;
      h["elements"] = row[c].elements;
      h["fraction"] =
          static_cast<double>(row[c].elements) / static_cast<double>(s.columns[c].elements);
      h["replicated"] = row[c].replicated;
      held.push_back(std::move(h));
    }
    const Shape& shape = s.rank_shapes[static_cast<size_t>(r)];
    ranks.push_back({{"rank", r},
                     {"shape", shape},
                     {"bytes", ProductOf(shape) * elem},
                     {"padding_elements", s.padding_elements[static_cast<size_t>(r)]},
                     {"held", std::move(held)}});
  }
  nlohmann::ordered_json entry = {{"buffer", s.name},
                                  {"dtype", std::string(DTypeName(s.dtype))},
                                  {"world_size", s.world_size()},
                                  {"columns", experts ? "experts" : "tensors"}};
  if (experts) entry["members"] = s.members;
  entry[experts ? "experts" : "tensors"] = std::move(columns);
  entry["ranks"] = std::move(ranks);
  return entry;
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
  RESHARD_ASSIGN_OR_RETURN(Shown shown, ReadShownParams(args.path, dtype, failure));
  std::vector<NamedMapRef> refs;
  for (const ShownParam& p : shown.params) refs.push_back({p.name, &p.map});
  RESHARD_ASSIGN_OR_RETURN(std::vector<BufferSummary> buffers,
                           SummarizeBuffers(shown.buffers, refs));
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  size_t buffered = 0;
  std::vector<BlockDrawing> blocks;
  for (const ShownParam& p : shown.params) {
    const auto tie = shown.block_scales.find(p.name);
    if (tie != shown.block_scales.end()) {
      RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> picture,
                               HolderPicture(p.map, args.rows, args.cols));
      blocks.push_back(BlocksOf(p, tie->second, picture));
    }
    if (!args.json && IsBuffered(p.map)) {
      ++buffered;  // summarised with its buffer
      if (tie != shown.block_scales.end()) PrintBlocks(blocks.back());
      continue;
    }
    MapSummary s = Summarize(p.map);
    Result<std::vector<std::string>> picture = HolderPicture(p.map, args.rows, args.cols);
    if (args.json) {
      nlohmann::ordered_json entry = SummaryJson(p, s, picture);
      for (Rank r = 0; r < p.map.world_size(); ++r) {
        const std::string& b = p.map.rank(r).buffer;
        if (!b.empty()) entry["ranks"][static_cast<size_t>(r)]["buffer"] = b;
      }
      if (tie != shown.block_scales.end()) {
        entry["block_scales"] = {{"of", tie->second.data},
                                 {"block", tie->second.block},
                                 {"format", tie->second.format},
                                 {"holders", blocks.back().picture}};
      }
      out.push_back(std::move(entry));
    } else {
      PrintText(p.name, p.map, s, DTypeSize(p.dtype), DTypeName(p.dtype),
                picture.ok() ? *picture : std::vector<std::string>{});
      fmt::print("\n");
      if (tie != shown.block_scales.end()) PrintBlocks(blocks.back());
    }
  }
  // Text and picture draw each layout once (a model's layers alike); --json lists every buffer.
  const std::vector<BufferSummary> drawn = MergeSameLayouts(buffers);
  if (args.json) {
    for (const BufferSummary& b : buffers) out.push_back(BufferJson(b));
  } else {
    for (const BufferSummary& b : drawn) {
      for (const std::string& line : BufferTable(b, args.cols)) fmt::print("{}\n", line);
      fmt::print("\n");
    }
  }
  if (!args.json && buffered > 0) {
    fmt::print("{} tensor(s) write into the {} buffer(s) above (--json lists each)\n", buffered,
               buffers.size());
  }
  if (args.json) fmt::print("{}\n", out.dump(2));
  if (!args.svg.empty()) {
    if (buffers.empty() && blocks.empty()) {
      return FailedPreconditionError(
          fmt::format("--svg draws buffers (which rank holds which experts) or quantization "
                      "blocks (which rank holds which block), and \"{}\" has neither",
                      args.path));
    }
    const std::string inputs[] = {args.path};
    RESHARD_RETURN_IF_ERROR(WriteOutputFile(
        args.svg, blocks.empty() ? BuffersSvg(drawn) : BlocksSvg(blocks), args.force, inputs));
  }
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
  cmd->add_option("--svg", args->svg,
                  "write a picture (SVG) of which rank holds which block of each quantized "
                  "tensor, or else which experts of each buffer");
  cmd->add_flag("--force", args->force, "replace an existing --svg file");
}

}  // namespace

CommandBody ShowCommand() { return {AddShowOptions, RunShow}; }

}  // namespace reshard::cli
