// A DeepSpeed PipelineModule checkpoint written from another one at other PP x TP x DP degrees
// (`reshard convert DS_PIPE --pp P`): what DeepSpeed's own save would have written had it
// trained at those degrees, which its load_checkpoint reads back (no universal checkpoint).
//
//   OUT/latest                                  the source's tag
//   OUT/<tag>/layer_{L:02d}[-model_{t:02d}]-model_states.pt   one per layer holding state and
//       TP rank ("-model_{t:02d}" with TP > 1): {name in the layer: module weight}, each
//       tensor its own storage, in the module's dtype
//   OUT/<tag>/mp_rank_{s:02d}_model_states.pt   one per slice s = stage * TP + t: the source's
//       stage 0 model states with that stage's param_shapes, dp_world_size, mp_world_size and
//       checkpoint_parallel_dimensions
//   OUT/<tag>/[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt   ZeRO 1/2: the stage's
//       parameters (TP shards at t) flattened, padded to a multiple of 2 x DP and cut into DP
//       partitions, as DeepSpeed's ZeRO optimizer cuts them
//
// Layers are numbered as the source's (a PipelineModule's layer specs); a stage list gives
// how many layers each stage holds (DeepSpeed's `parts`). The checkpoint does not record the
// layers after the last one that holds state: a tied module listed by the source's last stage
// without being held by it is taken to be used again by the model's last layer, one past the
// last layer that holds state (as GPT pipelines tie the output projection to the embedding).
#ifndef RESHARD_CHECKPOINT_DEEPSPEED_PIPELINE_WRITER_H_
#define RESHARD_CHECKPOINT_DEEPSPEED_PIPELINE_WRITER_H_

#include <string>
#include <vector>

#include "reshard/base/status.h"
#include "reshard/checkpoint/checkpoint_ops.h"

namespace reshard {

/// The most DP ranks a pipeline output takes (what DeepSpeedCheckpoint::Open reads back).
inline constexpr int kMaxPipelineDp = 65536;

struct DeepSpeedPipelineTarget {
  int pp = 1;
  int tp = 0;  // 0: the source's
  int dp = 1;  // data-parallel ranks per stage (ZeRO partitions)
  /// Layers per stage (pp entries, summing to the model's layer count); empty: DeepSpeed's
  /// "uniform" partition of the layers.
  std::vector<int> stage_layers;
};

/// DeepSpeed PipelineModule checkpoint -> the same at `target`'s degrees, into `out_dir`
/// (atomically; nothing is written on error), in time proportional to the output. InvalidArgument
/// for a DP degree above kMaxPipelineDp, for a source that is not a
/// PipelineModule checkpoint with ZeRO 1/2 optimizer partitions, for a stage list that is not
/// pp long, does not sum to the layer count or gives a stage no layer, for more stages than
/// layers, for a stage that would hold no parameter, for a tied module used by stages other
/// than its owner's and the last, and for a parameter whose layout at another TP degree is
/// unknown; Unimplemented for several parameter groups; what DeepSpeedCheckpoint::Open
/// refuses (among it, a layer file with a tensor that is no parameter of its stage: a
/// persistent buffer or a frozen parameter, which the output would not hold).
Status ConvertDeepSpeedToPipeline(const std::string& ckpt_dir,
                                  const DeepSpeedPipelineTarget& target, const std::string& out_dir,
                                  const CheckpointOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DEEPSPEED_PIPELINE_WRITER_H_
