// DeepSpeed's universal checkpoint, written from a DeepSpeed checkpoint or a PyTorch Distributed
// Checkpoint (`reshard convert --to universal`).
#ifndef RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_H_
#define RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_H_

#include <string>

#include "reshard/base/result.h"
#include "reshard/base/status.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/source.h"

namespace reshard {

/// DeepSpeed checkpoint -> universal checkpoint, as `python -m
/// deepspeed.checkpoint.ds_to_universal --output_folder OUT/<tag>_universal` writes it, with
/// `OUT/latest_universal` naming that folder: OUT is a save dir DeepSpeed loads with
/// "load_universal". In the folder, zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt hold the full
/// fp32 tensors ({"param": tensor} and the keys of DeepSpeedUniversalKeys; bare flat tensors
/// for ZeRO 3 at TP 1, as DeepSpeed writes them), step.pt the optimizer's step (ZeRO 0-2),
/// zero/optimizer_state.pt its global state, and the model-states files are copied. Each
/// file is written by one thread from one parameter's fragments (with options.communicator,
/// each process writes its share of the files); the output appears atomically. Checkpoints
/// DeepSpeed's converter refuses are converted too: ZeRO 0 (the optimizer of the model
/// states) and TP 1 without universal_checkpoint_info (as its inject_missing_state option
/// would). FailedPrecondition without optimizer state.
Status ConvertDeepSpeedToUniversal(const std::string& ckpt_dir, const std::string& out_dir,
                                   const CheckpointOptions& options = {});

/// PyTorch Distributed Checkpoint (FSDP2, TorchTitan: a model's tensors and Adam's state as
/// get_state_dict saves them) -> the universal checkpoint's per-parameter files, laid out as
/// ConvertDeepSpeedToUniversal lays them out: OUT/latest_universal naming
/// "<dcp dir name>_universal", in it zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt
/// ({"param": the full tensor}) and step.pt (the step tensor), and zero/optimizer_state.pt
/// ({"param_groups": [...]}: bytes items copied as pickled, tensor items as tensors, deeper keys
/// nested back), max_exp_avg_sq.pt where AdamW(amsgrad=True) keeps one. A parameter is a name P
/// with optimizer state "<optim>.state.P.<state>" and a model tensor "model.P" or "P"; a model
/// tensor without state that a param group lists (a frozen parameter) has fp32.pt alone; no
/// model-states files (DCP has none). FailedPrecondition (naming the key) without optimizer
/// state, for state without its model tensor or without both moments, a state of another
/// shape, a step on some parameters only, param groups that repeat, invent or leave out a
/// parameter, a tensor that is not fp32, and for a model tensor no group lists (a buffer) or a
/// state the folder has no file for, unless options.drop names its key; InvalidArgument for a
/// dropped key the checkpoint does not hold.
Status ConvertDcpToUniversal(const std::string& dcp_dir, const std::string& out_dir,
                             const CheckpointOptions& options = {});

/// Megatron-Core dist-ckpt (torch_dist, with the distributed optimizer's state saved in its
/// fully_reshardable sharding type) -> the universal checkpoint's per-parameter files, named
/// by the Hugging Face tensors the model's config.json gives (`config_path`, as
/// OpenMegatronSource reads them): OUT/latest_universal naming "<checkpoint dir name>_universal",
/// in it zero/<hf name>/fp32.pt (the fp32 main weight), exp_avg.pt and exp_avg_sq.pt
/// ({"param": the full fp32 tensor}; a parameter without any state while the others have
/// theirs, a frozen one: fp32.pt alone, its weight widened to fp32), and from Megatron's pickled
/// common state (common.pt, read by reshard's pickle reader, no pickle code run) step.pt (the step
/// of its param groups, a 0-d fp32 tensor) and zero/optimizer_state.pt ({"param_groups": its param
/// groups copied as pickled, "ds_version": the DeepSpeed release whose layout the folder follows},
/// what DeepSpeed's universal loader reads); neither without a common.pt (a checkpoint that keeps
/// its common state elsewhere). FailedPrecondition for a checkpoint without the optimizer's
/// state; InvalidArgument, naming common.pt, for one without param groups or whose groups
/// disagree on the step; what OpenMegatronSource refuses.
Status ConvertMegatronToUniversal(const std::string& path, const std::string& config_path,
                                  const std::string& out_dir,
                                  const CheckpointOptions& options = {});

/// An Orbax checkpoint with Adam's moments (optax's mu and nu) -> DeepSpeed's universal
/// checkpoint, laid out as ConvertDcpToUniversal lays it out (universal.h): OUT/latest_universal
/// naming "<name of `path`>_universal", in it per model array P with both moments
/// zero/P/fp32.pt, exp_avg.pt and exp_avg_sq.pt ({"param": the full fp32 tensor; bf16 and f16
/// widened exactly}) and step.pt (the count beside its mu, a 0-d fp32 tensor), per float model
/// array without moments (a frozen parameter) fp32.pt alone, and zero/optimizer_state.pt
/// ({"param_groups": [{"params": the parameters' names}], "ds_version"}: optax's state holds no
/// hyperparameters). Each file is rebuilt from the chunks straight into the writer's buffer.
/// FailedPrecondition, naming the leaf, for a checkpoint without moments, a parameter with one
/// moment, and a leaf a universal checkpoint has no file for (a non-float model array, an
/// optimizer leaf other than the moments and their counts) unless options.drop names it;
/// InvalidArgument for a dropped name the checkpoint does not hold.
Status ConvertOrbaxToUniversal(const std::string& path, const std::string& out_dir,
                               const CheckpointOptions& options = {});

/// Whether `path` looks like a universal checkpoint: a dir with latest_universal (but no
/// `latest`: a DeepSpeed save dir with a universal folder beside its tags stays a DeepSpeed
/// checkpoint), or the folder itself (zero/optimizer_state.pt); it may still fail to open.
bool IsUniversalCheckpoint(const std::string& path);

/// A universal checkpoint (`path`: the dir whose latest_universal names the folder, or the
/// folder) opened as DeepSpeed checkpoints are (OpenDeepSpeed), at one rank: each
/// zero/<param>/fp32.pt's tensor whole. For a gather, the module's weights (the fp32 master
/// weights rounded to the module's dtype, which the model-states copy's module weights give; fp32
/// without a copy, as from a DCP source) or, with `master_weights`, the masters; for a convert,
/// the module's weights and, unless `weights_only`, "<param>.fp32", "<param>.exp_avg" and
/// "<param>.exp_avg_sq" from fp32.pt, exp_avg.pt and exp_avg_sq.pt (and "<param>.max_exp_avg_sq"
/// where there is one; a folder with fp32.pt alone, a frozen parameter, has no states). Each
/// parameter's layout at another TP degree is the one the model-states copy's
/// universal_checkpoint_info gives it (DeepSpeedLayoutsOf); none without it. For a trainer's state
/// dict (options. trainer_state_dict, a DCP output; not weights_only), what get_state_dict gives an
/// FSDP2 model and torch's AdamW, as `state_dict`: the fp32 masters as "<param>" at
/// "model.<param>", the moments (and max_exp_avg_sq) at "optim.state.<param>.<state>", each
/// step.pt's step as a 0-d fp32
/// "<param>.step" at "optim.state.<param>.step", and zero/optimizer_state.pt's param_groups as
/// the bytes items "optim.param_groups.<g>.<key>" (values copied as pickled; "params" the
/// parameters' names: kept when the file names them, else the model-states copy's
/// param_shapes groups, else every parameter for a single group, else left out). NotFound for
/// latest_universal naming no folder and for a parameter folder without a file it needs;
/// InvalidArgument, naming the file, for a file whose tensor is not at "param" or not fp32,
/// for moments whose shape differs from the fp32 weight's, and for a step.pt or
/// optimizer_state.pt that holds no step or param_groups.
Result<OpenedCheckpoint> OpenUniversal(const std::string& path, const SourceOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_H_
