// reshard merge-lora BASE ADAPTER -o OUT [--force]: a Hugging Face or reshard sharded checkpoint
// with a LoRA adapter merged into it (logic in src/reshard/checkpoint/merge_lora.h).
#include <fmt/format.h>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/merge_lora.h"

namespace reshard::cli {

namespace {

struct MergeLoraArgs {
  std::string base;
  std::string adapter;
  std::string output;
  bool force = false;
  bool no_sync = false;
};

Status RunMergeLora(const MergeLoraArgs& args) {
  CheckpointOptions options;
  options.overwrite = args.force;
  options.sync = !args.no_sync;
  Result<MergeLoraReport> report = MergeLora(args.base, args.adapter, args.output, options);
  RESHARD_RETURN_IF_ERROR(WithForceHint(report.status(), args.force));
  fmt::print("merged \"{}\" into \"{}\" in \"{}\": {} weights took B @ A, {} replaced whole{}\n",
             args.adapter, args.base, args.output, report->merged, report->replaced,
             report->world_size > 0
                 ? fmt::format(", shard by shard at {} ranks", report->world_size)
                 : std::string());
  return Status::Ok();
}

void AddMergeLoraOptions(CLI::App* cmd, MergeLoraArgs* args) {
  cmd->add_option("BASE", args->base,
                  "the base model: a Hugging Face checkpoint directory, or a reshard sharded "
                  "checkpoint (merged shard by shard)")
      ->required();
  cmd->add_option("ADAPTER", args->adapter,
                  "a PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors), or "
                  "one scattered at the sharded BASE's world size")
      ->required();
  cmd->add_option("-o,--output", args->output,
                  "the merged checkpoint directory, of BASE's format and layout")
      ->required();
  cmd->add_flag("--force", args->force, "replace an existing output reshard wrote");
  cmd->add_flag("--no-sync", args->no_sync,
                "do not flush the output to disk (it still appears by one rename)");
}

}  // namespace

CommandBody MergeLoraCommand() { return {AddMergeLoraOptions, RunMergeLora}; }

}  // namespace reshard::cli
