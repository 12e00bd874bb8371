// reshard layout (DESCRIPTOR.json --shape D0,D1,... | --from-deepspeed META.json) --world N
//                [-o MAP.json] [--force]
// reshard layout EXPERTS.json --world N [-o MAPS.json] [--force]   (stacked experts: a document)
// reshard layout --placement PLACEMENT.json [--world EP] [-o OUT.json] [--force]
#include <fmt/format.h>

#include <charconv>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/deepspeed_meta.h"
#include "reshard/layouts/descriptor.h"
#include "reshard/layouts/experts_json.h"

namespace reshard::cli {

namespace {

struct LayoutArgs {
  std::string descriptor;
  std::string deepspeed_meta;
  std::string placement;
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
  const int inputs =
      !args.descriptor.empty() + !args.deepspeed_meta.empty() + !args.placement.empty();
  if (inputs != 1) {
    return InvalidArgumentError(
        "give a DESCRIPTOR.json, --from-deepspeed META.json or --placement PLACEMENT.json (one "
        "of them)");
  }
  // With a descriptor, CheckShapeFlag decides once it is read (stacked experts take no --shape).
  if (!args.shape.empty() && args.descriptor.empty()) {
    return InvalidArgumentError(
        !args.placement.empty()
            ? "--shape goes with a descriptor, not with --placement"
            : "--shape goes with a descriptor; DeepSpeed's metadata records the shape");
  }
  // --placement with an explicit (AutoEP) placement may leave --world out (0).
  if (args.world == 0 && args.placement.empty()) {
    return InvalidArgumentError("--world N is required (the number of ranks)");
  }
  if (args.world < 0) {
    return InvalidArgumentError(
        fmt::format("--world {}: expected a positive number of ranks", args.world));
  }
  return Status::Ok();
}

// The descriptor's kind decides whether --shape belongs.
Status CheckShapeFlag(const LayoutArgs& args, bool stacked_experts) {
  if (args.descriptor.empty()) return Status::Ok();
  if (stacked_experts && !args.shape.empty()) {
    return InvalidArgumentError(
        "--shape goes with a single-parameter descriptor; a stacked_experts descriptor gives "
        "each member's shape");
  }
  if (!stacked_experts && args.shape.empty()) {
    return InvalidArgumentError("a descriptor needs --shape D0,D1,... (the parameter's shape)");
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

// --placement: the DeepSpeed AutoEP placement descriptor of a family at --world EP ranks, or
// an AutoEP descriptor checked (and, with --world, checked to have that EP size) and written
// back in reshard's form.
Result<std::string> LayOutPlacement(const LayoutArgs& args, const std::string& text) {
  Result<ExpertPlacementSpec> spec = ParseExpertPlacementSpecJson(text);
  if (!spec.ok()) {
    return spec.status().Annotate(fmt::format("error reading \"{}\"", args.placement));
  }
  int ep = args.world;
  if (ep == 0) {
    if (!spec->explicit_placement) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": the placement family \"{}\" needs --world EP (the number of EP ranks)",
          args.placement, spec->family));
    }
    ep = spec->explicit_placement->ep_size();
  }
  Result<ExpertPlacement> placement = spec->At(ep);
  if (!placement.ok()) return placement.status().Annotate(fmt::format("\"{}\"", args.placement));
  return ExpertPlacementToJson(*placement);
}

Result<std::string> LayOutStackedExperts(const LayoutArgs& args, const std::string& text) {
  Result<std::vector<StackedExpertsDescriptor>> ds = ParseStackedExpertsJson(text);
  if (!ds.ok()) {
    return ds.status().Annotate(fmt::format("error reading \"{}\"", args.descriptor));
  }
  Result<MapDocument> doc = BuildStackedExpertsDocument(*ds, args.world);
  if (!doc.ok()) return doc.status().Annotate(fmt::format("\"{}\"", args.descriptor));
  return MapDocumentToJson(*doc);
}

Status RunLayout(const LayoutArgs& args) {
  const std::string& path = !args.descriptor.empty()       ? args.descriptor
                            : !args.deepspeed_meta.empty() ? args.deepspeed_meta
                                                           : args.placement;
  RESHARD_RETURN_IF_ERROR(CheckLayoutArgs(args));
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  const bool stacked = !args.descriptor.empty() && IsStackedExpertsJson(text);
  RESHARD_RETURN_IF_ERROR(CheckShapeFlag(args, stacked));
  const std::string inputs[] = {path};
  std::string out;
  if (!args.placement.empty()) {
    RESHARD_ASSIGN_OR_RETURN(out, LayOutPlacement(args, text));
  } else if (stacked) {
    RESHARD_ASSIGN_OR_RETURN(out, LayOutStackedExperts(args, text));
  } else {
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, LayOut(args, path, text));
    out = ParamMapToJson(map);
  }
  return PrintOrWrite(args.output, out, args.force, inputs);
}

void AddLayoutOptions(CLI::App* cmd, LayoutArgs* args) {
  cmd->add_option("DESCRIPTOR", args->descriptor,
                  "layout descriptor (JSON); a stacked_experts descriptor (or an array of them) "
                  "gives a map document of per-expert tensors in stacked buffers");
  cmd->add_option("--from-deepspeed", args->deepspeed_meta,
                  "DeepSpeed per-parameter metadata (JSON) instead of a descriptor");
  cmd->add_option("--shape", args->shape, "the parameter's shape, D0,D1,... (with a descriptor)");
  cmd->add_option("--placement", args->placement,
                  "expert placement (a family or a DeepSpeed AutoEP descriptor, JSON): print it "
                  "as an AutoEP placement descriptor at --world EP ranks");
  cmd->add_option("--world", args->world,
                  "number of ranks (EP x expert TP x expert DP for stacked experts; the EP size "
                  "with --placement, optional for an AutoEP descriptor)")
      ->check(IntegerIn(1, 1 << 20));
  AddOutputOptions(cmd, args->output, args->force,
                   "write the map here (atomically) instead of stdout");
}

}  // namespace

CommandBody LayoutCommand() { return {AddLayoutOptions, RunLayout}; }

}  // namespace reshard::cli
