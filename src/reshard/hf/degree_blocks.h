// The degree planner's block rules for block-quantized checkpoints (degree_blocks.cc).
#ifndef RESHARD_HF_DEGREE_BLOCKS_H_
#define RESHARD_HF_DEGREE_BLOCKS_H_

#include "reshard/hf/degree.h"
#include "reshard/hf/model_config.h"

namespace reshard {

/// Adds to `plan` one entry per split weight whose FP8 blocks (config.fp8_block) constrain the
/// degree under the plan's engine: its count is the number of blocks the split dimension holds
/// (1 when it holds a partial block, so that only degree 1 keeps blocks whole).
void AddBlockEntries(const ModelConfig& config, ModelPlan& plan);

}  // namespace reshard

#endif  // RESHARD_HF_DEGREE_BLOCKS_H_
