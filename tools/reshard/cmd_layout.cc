// reshard layout (DESCRIPTOR.json --shape D0,D1,... | --from-deepspeed META.json) --world N
//                [-o MAP.json] [--force]
#include <fmt/format.h>

#include <charconv>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/deepspeed_meta.h"
#include "reshard/layouts/descriptor.h"

namespace reshard::cli {

namespace {

struct LayoutArgs {
  std::string descriptor;
  std::string deepspeed_meta;
  std::string shape;
  int world = 0;
  std::string output;
  bool force = false;
};

Result<Shape> ParseShapeFlag(std::string_view text) {
  Shape shape;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    Index value = -1;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || value < 0 ||
        value > (Index{1} << 62)) {
      return InvalidArgumentError(fmt::format(
          "--shape \"{}\": expected non-negative integers separated by commas, e.g. 4096,1024",
          text));
    }
    shape.push_back(value);
    start = comma + 1;
  }
  return shape;
}

int RunLayout(const LayoutArgs& args) {
  if (args.descriptor.empty() == args.deepspeed_meta.empty()) {
    return Report(
        "layout",
        InvalidArgumentError("give a DESCRIPTOR.json or --from-deepspeed META.json (one of them)"),
        kExitUsage);
  }
  if (args.descriptor.empty() != args.shape.empty()) {
    return Report(
        "layout",
        InvalidArgumentError(
            args.shape.empty()
                ? "a descriptor needs --shape D0,D1,... (the parameter's shape)"
                : "--shape goes with a descriptor; DeepSpeed's metadata records the shape"),
        kExitUsage);
  }
  if (args.world < 1) {
    return Report("layout",
                  InvalidArgumentError(
                      fmt::format("--world {}: expected a positive number of ranks", args.world)),
                  kExitUsage);
  }
  const std::string& path = args.descriptor.empty() ? args.deepspeed_meta : args.descriptor;
  Result<std::string> text = ReadFileToString(path);
  if (!text.ok())
    return Report("layout", text.status(), ExitStatusFor(text.status(), Stage::kReading));

  Result<ParamMap> map = InternalError("unset");
  if (!args.descriptor.empty()) {
    Result<Shape> shape = ParseShapeFlag(args.shape);
    if (!shape.ok()) return Report("layout", shape.status(), kExitUsage);
    Result<LayoutDescriptor> descriptor = ParseLayoutJson(*text);
    if (!descriptor.ok()) {
      Status s = descriptor.status().Annotate(fmt::format("error reading \"{}\"", path));
      return Report("layout", s, ExitStatusFor(s, Stage::kReading));
    }
    map = BuildMap(*descriptor, *shape, args.world);
    if (!map.ok()) {
      Status s = map.status().Annotate(fmt::format("\"{}\"", path));
      return Report("layout", s, ExitStatusFor(s, Stage::kChecking));
    }
  } else {
    std::vector<std::string> notes;
    map = DeepSpeedMetaMap(*text, args.world, &notes);
    if (!map.ok()) {
      // Malformed or self-contradicting metadata is 2; a layout that cannot be derived, 1.
      Status s = map.status().Annotate(fmt::format("\"{}\"", path));
      return Report("layout", s, ExitStatusFor(s, Stage::kReading));
    }
    for (const std::string& note : notes) fmt::print(stderr, "reshard layout: note: {}\n", note);
  }
  return EmitText("layout", args.output, ParamMapToJson(*map), args.force);
}

}  // namespace

void RegisterLayout(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<LayoutArgs>();
  CLI::App* cmd = app.add_subcommand(
      "layout",
      "Lay out a layout descriptor (docs/layouts.md) for a parameter shape at a world size, or "
      "lower DeepSpeed's per-parameter universal-checkpoint metadata, and print the canonical "
      "param map (or write it with -o). Exit 1 when the layout cannot be laid out at that world "
      "size, 2 for a malformed descriptor or inconsistent metadata.");
  cmd->add_option("DESCRIPTOR", args->descriptor, "layout descriptor (JSON)");
  cmd->add_option("--from-deepspeed", args->deepspeed_meta,
                  "DeepSpeed per-parameter metadata (JSON) instead of a descriptor");
  cmd->add_option("--shape", args->shape, "the parameter's shape, D0,D1,... (with a descriptor)");
  cmd->add_option("--world", args->world, "number of ranks")->required();
  cmd->add_option("-o,--output", args->output, "write the map here (atomically) instead of stdout");
  cmd->add_flag("--force", args->force, "replace an existing output");
  cmd->callback([args, &exit_status] { exit_status = RunLayout(*args); });
}

}  // namespace reshard::cli
