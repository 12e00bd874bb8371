// reshard export FILE.pt -o OUT.safetensors [--force]
// reshard export FILE.safetensors -o OUT.pt [--force]
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_file.h"
#include "reshard/io/torch_writer.h"

namespace reshard::cli {

namespace {

struct ExportArgs {
  std::string path;
  std::string output;
  bool force = false;
};

// A safetensors file as a torch.save state dict, tensors in the file's data order.
Result<size_t> SafetensorsToTorch(const ExportArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(const SafetensorsFile in, SafetensorsFile::Open(args.path));
  std::vector<TensorToWrite> tensors;
  for (const TensorInfo& t : in.header().tensors) {
    tensors.push_back({.name = t.name,
                       .dtype = t.dtype,
                       .shape = t.shape,
                       .fill = [&in, &t](std::span<std::byte> out) {
                         const std::span<const std::byte> data = in.data(t);
                         std::copy(data.begin(), data.end(), out.begin());
                         return Status::Ok();
                       }});
  }
  RESHARD_RETURN_IF_ERROR(
      WriteTorchStateDict(args.output, std::move(tensors), {.overwrite = args.force}));
  return in.header().tensors.size();
}

Result<size_t> TorchToSafetensors(const ExportArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(const TorchFile f, TorchFile::Open(args.path));
  RESHARD_RETURN_IF_ERROR(ExportToSafetensors(f, args.output, args.force));
  return f.tensors().size();
}

Status RunExport(const ExportArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(const MappedFile mapped, MappedFile::Open(args.path));
  Result<size_t> written =
      LooksLikeTorchFile(mapped.bytes()) ? TorchToSafetensors(args) : SafetensorsToTorch(args);
  if (written.status().code() == StatusCode::kAlreadyExists) {
    return Status(StatusCode::kAlreadyExists,
                  written.status().message() + " (use --force to replace it)");
  }
  RESHARD_RETURN_IF_ERROR(written.status());
  fmt::print("wrote {} tensors to \"{}\"\n", *written, args.output);
  return Status::Ok();
}

void AddExportOptions(CLI::App* cmd, ExportArgs* args) {
  cmd->add_option("FILE", args->path, "a .pt file (torch.save) or a .safetensors file")->required();
  cmd->add_option("-o,--output", args->output, "the .safetensors (or, from safetensors, .pt) file")
      ->required();
  cmd->add_flag("--force", args->force, "replace an existing output");
}

}  // namespace

CommandBody ExportCommand() { return {AddExportOptions, RunExport}; }

}  // namespace reshard::cli
