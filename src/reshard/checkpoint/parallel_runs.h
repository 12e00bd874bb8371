// Each checkpoint format's description of the run that wrote it (layouts/parallel_run.h): what
// its files record of the ranks' coordinates and the optimizer's sharding, and what they do not
// (ParallelRun::unknown). The openers fill OpenedCheckpoint::run with these; `reshard inspect`
// prints them.
#ifndef RESHARD_CHECKPOINT_PARALLEL_RUNS_H_
#define RESHARD_CHECKPOINT_PARALLEL_RUNS_H_

#include "reshard/checkpoint/checkpoint.h"
#include "reshard/layouts/parallel_run.h"

namespace reshard {

class DeepSpeedCheckpoint;  // deepspeed/deepspeed.h
class DcpCheckpoint;        // dcp/dcp.h

/// A reshard sharded checkpoint (and vLLM's sharded-state files, which it writes): a rank per
/// tensor-parallel rank, model-rank-{tp}-part-{p}.safetensors; its optimizer state, when it
/// holds one (states with scale powers), tensors laid out as their parameters.
ParallelRun ShardedRunOf(const Manifest& m);

/// A Hugging Face checkpoint: whole tensors, one rank.
ParallelRun HuggingFaceRun();

/// DeepSpeed's universal checkpoint: whole tensors, one file per parameter and state.
ParallelRun UniversalRun(bool optimizer_state);

/// A DeepSpeed checkpoint: pp × dp × tp on DeepSpeed's grid (pp 1 without a PipelineModule), the
/// ZeRO stage, AutoEP's experts inside dp.
ParallelRun DeepSpeedRunOf(const DeepSpeedCheckpoint& ckpt);

/// A PyTorch Distributed Checkpoint: a flat world of the ranks that wrote it (the trainer's
/// device mesh is not recorded).
ParallelRun DcpRunOf(const DcpCheckpoint& ckpt);

/// A Megatron-Core torch_dist checkpoint, which records global tensors' boxes and the ranks that
/// wrote them (each box once), not its grid: tp from the embedding's vocabulary chunks; pp, vpp
/// and the ranks per stage (dp, cp's ranks counted in it) from the ranks that wrote each layer;
/// ep and expert tp from the first MoE layer's experts. cp is not recorded, nor dp with one
/// stage; writers that read no other way give a flat world of the ranks that wrote it.
ParallelRun MegatronRunOf(const DcpCheckpoint& ckpt);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_PARALLEL_RUNS_H_
