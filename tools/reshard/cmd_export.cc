// reshard export FILE.pt -o OUT.safetensors [--force]
// reshard export FILE.pt -o OUT.pt [--force]           (the whole object tree, written back)
// reshard export FILE.safetensors -o OUT.pt [--force]
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/output_dir.h"
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

bool IsTorchFileName(std::string_view path) {
  return path.ends_with(".pt") || path.ends_with(".pth") || path.ends_with(".bin");
}

// To a .pt name: the object tree and its storages as they are; otherwise safetensors.
Result<size_t> TorchToOutput(const ExportArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(const TorchFile f, TorchFile::Open(args.path));
  if (IsTorchFileName(args.output)) {
    RESHARD_RETURN_IF_ERROR(
        RewriteTorchFile(f, args.output, {.root = f.root(), .overwrite = args.force}));
  } else {
    RESHARD_RETURN_IF_ERROR(ExportToSafetensors(f, args.output, args.force));
  }
  return f.tensors().size();
}

Status RunExport(const ExportArgs& args) {
  // What may be in the output's place (a regular file that is not the input, with --force),
  // checked before the input is even opened.
  const std::string inputs[] = {args.path};
  RESHARD_RETURN_IF_ERROR(
      WithForceHint(CheckOutputFile(args.output, args.force, inputs), args.force));
  RESHARD_ASSIGN_OR_RETURN(const MappedFile mapped, MappedFile::Open(args.path));
  const bool from_torch = LooksLikeTorchFile(mapped.bytes());
  if (!from_torch && args.output.ends_with(".safetensors")) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is a safetensors file, and export writes it as a torch.save file, which the "
        "name \"{}\" would misdescribe; name the output .pt, .pth or .bin",
        args.path, args.output));
  }
  Result<size_t> written = from_torch ? TorchToOutput(args) : SafetensorsToTorch(args);
  RESHARD_RETURN_IF_ERROR(WithForceHint(written.status(), args.force));
  fmt::print("wrote {} tensors to \"{}\"\n", *written, args.output);
  return Status::Ok();
}

void AddExportOptions(CLI::App* cmd, ExportArgs* args) {
  cmd->add_option("FILE", args->path, "a .pt file (torch.save) or a .safetensors file")->required();
  cmd->add_option(
         "-o,--output", args->output,
         "the .safetensors file, or a .pt/.pth/.bin file (the .pt written back whole; from "
         "safetensors, its state dict)")
      ->required();
  cmd->add_flag("--force", args->force, "replace an existing output");
}

}  // namespace

CommandBody ExportCommand() { return {AddExportOptions, RunExport}; }

}  // namespace reshard::cli
