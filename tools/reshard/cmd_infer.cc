// reshard infer INDEX_MAPS.json [-o MAP.json] [--force] [--allow-uncovered]
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"

namespace reshard::cli {

namespace {

struct InferArgs {
  std::string path;
  std::string output;
  bool force = false;
  bool allow_uncovered = false;
};

Status RunInfer(const InferArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(args.path));
  Result<IndexMaps> observed = ParseIndexMapsJson(text);
  if (!observed.ok()) {
    return observed.status().Annotate(fmt::format("error reading \"{}\"", args.path));
  }
  Result<ParamMap> map = Infer(*observed, {.allow_uncovered = args.allow_uncovered});
  if (!map.ok()) {
    Status failed = CheckFailed(map.status().Annotate(fmt::format("\"{}\"", args.path)));
    if (map.status().message().find("is held by no rank") == std::string::npos) return failed;
    return Status(failed.code(), failed.message() +
                                     "; pass --allow-uncovered if the observation is deliberately "
                                     "partial");
  }
  const std::string inputs[] = {args.path};
  return PrintOrWrite(args.output, ParamMapToJson(*map), args.force, inputs);
}

void AddInferOptions(CLI::App* cmd, InferArgs* args) {
  cmd->add_option("INDEX_MAPS", args->path, "index maps (JSON, DESIGN 6.3)")->required();
  AddOutputOptions(cmd, args->output, args->force,
                   "write the map here (atomically) instead of stdout");
  cmd->add_flag("--allow-uncovered", args->allow_uncovered,
                "accept elements of F that no rank holds (a deliberately partial observation)");
}

}  // namespace

CommandBody InferCommand() { return {AddInferOptions, RunInfer}; }

}  // namespace reshard::cli
