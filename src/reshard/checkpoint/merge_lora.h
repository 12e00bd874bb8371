// reshard merge-lora: a checkpoint with a PEFT LoRA adapter merged into it (checkpoint/peft.h),
// W + scaling * B @ A per weight, without building a full tensor that was not one already.
//
// The base is a Hugging Face directory (merged one tensor at a time) or a reshard sharded
// checkpoint (merged shard by shard, DESIGN 23). For a sharded base, rank j's shard of W is
// merged from the elements of B and A that its pieces need: each element (p, q) of F that a
// piece holds takes row p of B and column q of A (row q and column p when B @ A is the
// weight's transpose). A column-parallel shard so needs its rows of B and all of A, a
// row-parallel one all of B and its columns of A; a fused buffer (vLLM's qkv_proj) needs the
// rows of each of its weights. The adapter is a PEFT directory (every rank reads what it needs
// of the whole tensors) or an adapter scattered at the base's world size, whose rank j must
// hold what rank j of the base needs (it does when both were laid out from one plan).
#ifndef RESHARD_CHECKPOINT_MERGE_LORA_H_
#define RESHARD_CHECKPOINT_MERGE_LORA_H_

#include <string>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"

namespace reshard {

struct MergeLoraReport {
  int merged = 0;      // base weights that took an adapter's B @ A
  int replaced = 0;    // base weights the adapter holds whole (modules_to_save)
  int world_size = 0;  // of a sharded base; 0 for a Hugging Face one
};

/// Writes into `out_dir` the checkpoint at `base_dir` with the LoRA adapter at `adapter_dir`
/// merged: every targeted weight W becomes W + scaling * B @ A (transposed for an embedding and
/// with fan_in_fan_out) in the arithmetic of PEFT's merge on the CPU (float32 products rounded
/// to the adapter's dtype, added to W in float32, rounded to W's dtype: float32, bfloat16 or
/// float16); the adapter's whole copies of base weights replace them. Every other tensor is
/// copied as it is.
///
/// A Hugging Face base (model.safetensors or an index; its config.json and tokenizer files
/// copied) gives one model.safetensors; the adapter must then be a PEFT directory. A reshard
/// sharded base gives a sharded checkpoint of the same manifest and files, each rank's shard
/// merged on its own (the header comment above): equal, byte for byte, to the Hugging Face
/// merge scattered by the base's maps.
/// \error FailedPrecondition  what CheckLoraTensors refuses, a target the base lacks or whose
///        shape disagrees with A and B, a weight not of a float dtype, a scaled shard, an
///        adapter scattered at another world size or whose rank lacks what the base's rank
///        needs (naming the tensor and the rank); DataLoss  an adapter whose tensors disagree
///        with its config; InvalidArgument  neither input of a kind merge takes.
Result<MergeLoraReport> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::string& out_dir, const CheckpointOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_MERGE_LORA_H_
