// The degree planner's block rules for block-quantized checkpoints (degree_blocks.cc).
#ifndef RESHARD_HF_DEGREE_BLOCKS_H_
#define RESHARD_HF_DEGREE_BLOCKS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "reshard/hf/degree.h"
#include "reshard/hf/model_config.h"

namespace reshard {

/// Adds to `plan` one entry per split weight whose FP8 blocks (config.fp8_block) constrain the
/// degree under the plan's engine: its count is the number of blocks the split dimension holds
/// (1 when it holds a partial block, so that only degree 1 keeps blocks whole).
void AddBlockEntries(const ModelConfig& config, ModelPlan& plan);

/// vLLM's own rules for gpt-oss on the entries it splits (degree.cc adds them): its attention
/// takes num_key_value_heads // N key/value heads a rank (no replication: above the count a
/// rank gets none and the layer cannot be built), and its MLP block asserts that the world
/// size divides intermediate_size. With MXFP4 experts (config.mxfp4) the plan records their
/// intermediate size, so that PlanDegree says where vLLM pads them.
void ApplyVllmGptOssRules(const ModelConfig& config, ModelPlan& plan);

/// vLLM's split of I MXFP4 intermediate features at `degree` (which must divide I).
VllmMxfp4Split VllmMxfp4SplitAt(int64_t intermediate, int64_t degree);

/// The split and vLLM's padding in words, for a note; nullopt when no vLLM backend pads (each
/// rank holds whole groups and I / N is a multiple of every kernel alignment).
std::optional<std::string> VllmMxfp4Note(const std::string& module, const VllmMxfp4Split& split);

}  // namespace reshard

#endif  // RESHARD_HF_DEGREE_BLOCKS_H_
