// reshard export FILE.pt -o OUT.safetensors [--force]
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/torch_file.h"

namespace reshard::cli {

namespace {

struct ExportArgs {
  std::string path;
  std::string output;
  bool force = false;
};

Status RunExport(const ExportArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(const TorchFile f, TorchFile::Open(args.path));
  Status s = ExportToSafetensors(f, args.output, args.force);
  if (s.code() == StatusCode::kAlreadyExists) {
    return Status(s.code(), s.message() + " (use --force to replace it)");
  }
  RESHARD_RETURN_IF_ERROR(s);
  fmt::print("wrote {} tensors to \"{}\"\n", f.tensors().size(), args.output);
  return Status::Ok();
}

}  // namespace

void RegisterExport(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Write every tensor of a PyTorch .pt file to a .safetensors file under its dotted name "
      "(module.layers.0.weight), bit for bit, without running the file's pickle. A view is "
      "written as its own contiguous tensor. The output appears atomically.");
  cmd->add_option("FILE", args->path, "a .pt file (torch.save)")->required();
  cmd->add_option("-o,--output", args->output, "the .safetensors file to write")->required();
  cmd->add_flag("--force", args->force, "replace an existing output");
  cmd->callback([args, &exit_status] { exit_status = Finish("export", RunExport(*args)); });
}

}  // namespace reshard::cli
