// The table of commands: what `reshard --help` lists, in its order, and each command's help.
#include "commands.h"

namespace reshard::cli {

namespace {

struct CommandEntry {
  const char* name;
  const char* help;
  CommandBody (*body)();
};

constexpr CommandEntry kCommands[] = {
    {"verify",
     "Validate a param map or map document: bounds, exact shards, coverage, homogeneity.\n"
     "Exit 0 when every parameter is valid, 1 naming the first violation per parameter, 2 "
     "when the file is unreadable or malformed.",
     VerifyCommand},
    {"show",
     "Summarise a param map, a map document or a sharded checkpoint (its reshard.json or its "
     "directory): pieces per rank, bytes held, replicated and scaled bytes, and a picture of "
     "which rank holds which part of F.",
     ShowCommand},
    {"infer",
     "Derive the canonical param map from index maps: for each rank, the flat offset in F of "
     "every shard element (obtained by running a framework's partition function on "
     "arange(F.numel())). Prints the map, or writes it with -o.",
     InferCommand},
    {"layout",
     "Lay out a layout descriptor (docs/layouts.md) for a parameter shape at a world size, or "
     "lower DeepSpeed's per-parameter universal-checkpoint metadata, and print the canonical "
     "param map (or write it with -o). Exit 1 when the layout cannot be laid out at that world "
     "size, 2 for a malformed descriptor or inconsistent metadata.",
     LayoutCommand},
    {"compose",
     "Compose two map documents of the same parameters into a transfer plan: the moves that "
     "take shards laid out by --from to shards laid out by --to, without the full tensor. "
     "Prints the plan, or writes it with -o; --json prints a summary with move counts.",
     ComposeCommand},
    {"sync-plan",
     "Plan a weight sync from a trainer into many inference engines on a cluster: each byte "
     "leaves the trainer once and engines relay it along a tree chosen by a cost model of the "
     "links (--topology). Prints bytes out of the trainer, the busiest link, the lower bound "
     "(its bytes over its bandwidth) and the time a simulation of the schedule predicts; "
     "--json the full report. Exit 1 when the layouts cannot be split as asked, 2 for bad input "
     "(a topology naming a host it lacks, more processes than GPUs).",
     SyncPlanCommand},
    {"scatter",
     "Split a full checkpoint (model.safetensors, or an index and parts) into a sharded one: "
     "reshard.json plus model-rank-{r}-part-{p}.safetensors per rank, by map documents or "
     "layout descriptors. Tensors named <param>.exp_avg / <param>.exp_avg_sq take <param>'s "
     "map with scale power -1 / -2.",
     ScatterCommand},
    {"gather",
     "Rebuild a full checkpoint from a sharded one, checking that replicas agree (exit 1 "
     "naming the ranks and element where they differ) and dropping padding. The input may be "
     "a DeepSpeed checkpoint (a save dir with `latest`, or a tag dir): its module weights "
     "(or with --fp32 its master weights) become Hugging Face safetensors, with the save "
     "dir's config.json.",
     GatherCommand},
    {"convert",
     "Re-shard a sharded checkpoint to another world size through transfer plans, without "
     "building any full tensor. Target maps come from --target-maps or from the layout "
     "descriptors in the manifest. The input may be a DeepSpeed checkpoint: its module "
     "weights, fp32 master weights (<param>.fp32) and Adam moments (<param>.exp_avg, "
     "<param>.exp_avg_sq) become a sharded checkpoint at --tp.",
     ConvertCommand},
    {"merge-lora",
     "Merge a PEFT LoRA adapter into a Hugging Face checkpoint, or into a reshard sharded one "
     "shard by shard (the output has its layout; no full tensor is built): every targeted "
     "weight W becomes W + scaling * B @ A (in PEFT's arithmetic: bit for bit its "
     "merge_and_unload()), the adapter's whole copies of base weights replace them. "
     "Exit 1 for an adapter that cannot be merged as asked (DoRA, a target the base lacks), 2 "
     "for an unreadable or inconsistent one; each names the tensor.",
     MergeLoraCommand},
    {"diff",
     "Compare two checkpoints tensor by tensor, in any formats reshard reads and any layouts "
     "(a Hugging Face directory against a reshard sharded checkpoint at TP 8, a DeepSpeed or DCP "
     "checkpoint against either), without building any full tensor. Exit 0 when every tensor is "
     "bit-identical, 1 listing each tensor that differs (missing from B, extra in B, dtype, "
     "shape, or its first differing element in row-major order: the index in the full tensor "
     "and both values), 2 when an input cannot be read. --atol/--rtol compare values instead "
     "(bf16 against fp32); --dequantize reads block-quantized tensors as numbers.",
     DiffCommand},
    {"degree",
     "The largest tensor-parallel degree a model supports, from its config.json and "
     "transformers' plans (docs/degree.md). With --tp N, confirm N (exit 0) or refuse it "
     "naming the constraint that breaks (exit 1). Exit 1 also for a model that cannot be split.",
     DegreeCommand},
    {"inspect",
     "List the tensors (dotted name, dtype, shape, strides, storage offset) and the object tree "
     "of a PyTorch .pt file, read without running its pickle, or the tensors of a .safetensors "
     "file; the kind of file is told by its first bytes. Given a directory, every .pt, .pth, "
     ".bin and .safetensors file in it (a DeepSpeed save dir is read through its latest tag).",
     InspectCommand},
    {"export",
     "Write every tensor of a PyTorch .pt file to a .safetensors file under its dotted name "
     "(module.layers.0.weight), bit for bit, without running the file's pickle; a view is "
     "written as its own contiguous tensor. To an output named .pt, .pth or .bin, write the "
     "whole object tree back instead (records such as DeepSpeed's loss scalers kept, views "
     "and shared storages kept). Given a .safetensors file, write its tensors as the state "
     "dict torch.save would write (torch.load(weights_only=True) reads it). The kind of "
     "input is told by its first bytes; the output appears atomically.",
     ExportCommand},
    {"demo",
     "Run the embedded example: generate a small multi-layer checkpoint with one parameter per "
     "layout family in every layer (splits, fused and multi-query QKV, Yuan's shared-QK heads, "
     "CodeGen's QKV, a pre-divided bias, a padded vocabulary), scatter it to TP 4, convert to "
     "TP 2 and TP 3, gather, and prove bit-exactness. Outputs go to DIR (kept) or to a "
     "temporary directory (removed).",
     DemoCommand},
};

}  // namespace

void AddCommands(CLI::App& app, int& exit_status) {
  for (const CommandEntry& entry : kCommands) {
    entry.body().Install(app.add_subcommand(entry.name, entry.help), exit_status);
  }
}

}  // namespace reshard::cli
