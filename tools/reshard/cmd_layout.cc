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

Status CheckLayoutArgs(const LayoutArgs& args) {
  if (args.descriptor.empty() == args.deepspeed_meta.empty()) {
    return InvalidArgumentError(
        "give a DESCRIPTOR.json or --from-deepspeed META.json (one of them)");
  }
  if (args.descriptor.empty() != args.shape.empty()) {
    return InvalidArgumentError(
        args.shape.empty()
            ? "a descriptor needs --shape D0,D1,... (the parameter's shape)"
            : "--shape goes with a descriptor; DeepSpeed's metadata records the shape");
  }
  if (args.world < 1) {
    return InvalidArgumentError(
        fmt::format("--world {}: expected a positive number of ranks", args.world));
  }
  return Status::Ok();
}

// A layout that does not fit the shape or the world size is FailedPrecondition (exit 1);
// a malformed descriptor or inconsistent metadata, InvalidArgument (exit 2).
Result<ParamMap> LayOut(const LayoutArgs& args, const std::string& path, const std::string& text) {
  if (!args.descriptor.empty()) {
    RESHARD_ASSIGN_OR_RETURN(Shape shape, ParseShapeFlag(args.shape));
    Result<LayoutDescriptor> descriptor = ParseLayoutJson(text);
    if (!descriptor.ok()) {
      return descriptor.status().Annotate(fmt::format("error reading \"{}\"", path));
    }
    Result<ParamMap> map = BuildMap(*descriptor, shape, args.world);
    if (!map.ok()) return map.status().Annotate(fmt::format("\"{}\"", path));
    return map;
  }
  std::vector<std::string> notes;
  Result<ParamMap> map = DeepSpeedMetaMap(text, args.world, &notes);
  if (!map.ok()) return map.status().Annotate(fmt::format("\"{}\"", path));
  for (const std::string& note : notes) fmt::print(stderr, "reshard layout: note: {}\n", note);
  return map;
}

Status RunLayout(const LayoutArgs& args) {
  RESHARD_RETURN_IF_ERROR(CheckLayoutArgs(args));
  const std::string& path = args.descriptor.empty() ? args.deepspeed_meta : args.descriptor;
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  RESHARD_ASSIGN_OR_RETURN(ParamMap map, LayOut(args, path, text));
  const std::string inputs[] = {path};
  return PrintOrWrite(args.output, ParamMapToJson(map), args.force, inputs);
}

void AddLayoutOptions(CLI::App* cmd, LayoutArgs* args) {
  cmd->add_option("DESCRIPTOR", args->descriptor, "layout descriptor (JSON)");
  cmd->add_option("--from-deepspeed", args->deepspeed_meta,
                  "DeepSpeed per-parameter metadata (JSON) instead of a descriptor");
  cmd->add_option("--shape", args->shape, "the parameter's shape, D0,D1,... (with a descriptor)");
  cmd->add_option("--world", args->world, "number of ranks")->required();
  AddOutputOptions(cmd, args->output, args->force,
                   "write the map here (atomically) instead of stdout");
}

}  // namespace

CommandBody LayoutCommand() { return {AddLayoutOptions, RunLayout}; }

}  // namespace reshard::cli
