// reshard inspect FILE_OR_DIR [--json]: the tensors and object tree of a .pt or .safetensors file,
// or of every such file in a directory (a DeepSpeed save dir through its `latest` tag). The
// report is the library's (reshard/checkpoint/inspect.h), as reshard.checkpoint.inspect gives it.
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/inspect.h"
#include "reshard/hf/checkpoint_maps.h"

namespace reshard::cli {

namespace {

struct InspectArgs {
  std::string path;
  bool json = false;
};

Status RunInspect(const InspectArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(
      const std::string report,
      Inspect(args.path, args.json ? InspectFormat::kJson : InspectFormat::kText,
              BlockScalesOfDir));
  fmt::print("{}", report);
  return Status::Ok();
}

void AddInspectOptions(CLI::App* cmd, InspectArgs* args) {
  cmd->add_option("FILE_OR_DIR", args->path,
                  "a .pt (torch.save) or .safetensors file, or a directory of them")
      ->required();
  AddJsonFlag(cmd, args->json, "machine-readable output");
}

}  // namespace

CommandBody InspectCommand() { return {AddInspectOptions, RunInspect}; }

}  // namespace reshard::cli
