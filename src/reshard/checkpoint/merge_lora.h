// reshard merge-lora: a Hugging Face checkpoint with a PEFT LoRA adapter merged into it
// (checkpoint/peft.h), W + scaling * B @ A per weight, one tensor in memory at a time.
#ifndef RESHARD_CHECKPOINT_MERGE_LORA_H_
#define RESHARD_CHECKPOINT_MERGE_LORA_H_

#include <string>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"

namespace reshard {

struct MergeLoraReport {
  int merged = 0;    // base weights that took an adapter's B @ A
  int replaced = 0;  // base weights the adapter holds whole (modules_to_save)
};

/// Writes into `out_dir` the Hugging Face checkpoint at `base_dir` (model.safetensors or an
/// index; its config.json and tokenizer files copied) with the LoRA adapter at `adapter_dir`
/// merged: every targeted weight W becomes W + scaling * B @ A (transposed for an embedding and
/// with fan_in_fan_out) in the arithmetic of PEFT's merge on the CPU (float32 products rounded to
/// the adapter's dtype, added to W in float32, rounded to W's dtype: float32, bfloat16 or
/// float16); the adapter's whole copies of base weights replace
/// them. Every other tensor is copied as it is, into one model.safetensors.
/// \error FailedPrecondition  what CheckLoraTensors refuses, a target the base lacks or whose
///        shape disagrees with A and B, a weight not of a float dtype (naming the tensor);
///        DataLoss  an adapter whose tensors disagree with its config.
Result<MergeLoraReport> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::string& out_dir, const CheckpointOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_MERGE_LORA_H_
