// Whole-checkpoint layouts with block-quantized tensors (DESIGN 20): the data tensors laid out
// by the model's plan, their scales as the block images of the data's maps, never by hand.
#ifndef RESHARD_HF_QUANTIZED_MAPS_H_
#define RESHARD_HF_QUANTIZED_MAPS_H_

#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/hf/model_maps.h"
#include "reshard/hf/quantization.h"

namespace reshard {

/// A checkpoint's layout and the scale ties it holds.
struct ModelCheckpointMaps {
  CheckpointMaps maps;
  std::vector<QuantTie> ties;
};

/// PlanCheckpointMaps, block-quantized tensors included, under the quantization_config of
/// `config_json` (none: PlanCheckpointMaps unchanged). Each data tensor is laid out under the
/// name the plan knows it by (PlanNameOfData: MXFP4's `X_blocks` as `X`); each scale tensor is
/// the block image of its data tensor's map (BlockImage), in a scale buffer beside a data
/// buffer (`experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`, as transformers' FP8
/// experts hold them).
/// \error FailedPrecondition  what PlanCheckpointMaps and TieQuantizedTensors refuse, and a
///        split that would cut a block so that one local block takes elements of two blocks
///        or of two tensors (the message names the tensors, the block and the degrees that keep
///        blocks whole).
Result<ModelCheckpointMaps> PlanModelCheckpointMaps(const ConfigMaps& maps,
                                                    std::string_view config_json,
                                                    const std::vector<StoredTensor>& tensors);

}  // namespace reshard

#endif  // RESHARD_HF_QUANTIZED_MAPS_H_
