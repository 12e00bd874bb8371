// Param maps of a whole checkpoint at a tensor-parallel degree, from the model's plan.
//
// Tensors are matched to plan entries the way transformers matches them: a layer index
// between dots becomes `*` (`model.layers.3.self_attn.q_proj.weight` -> `...layers.*...`),
// and an entry names either the parameter or its module. Plan patterns are relative to the
// (sub-)model that owns them, so the longest matching suffix of the parameter name counts
// (`model.`, `model.language_model.` and other prefixes fall away).
//
// Styles become layout descriptors (docs/layouts.md), split exactly:
//   colwise family       weight split on its output dim (ndim-2), a 1-D bias on dim 0
//   rowwise family       weight split on its input dim (ndim-1), bias replicated
//   packed_colwise/_rowwise   the fused gate/up weight: two equal parts, each split
//   embedding_rowwise    rows (the vocabulary); embedding_colwise: columns
//   grouped_gemm, ep_router   the expert dim (0)
//   everything else, and tensors no entry covers: replicated
#ifndef RESHARD_HF_MODEL_MAPS_H_
#define RESHARD_HF_MODEL_MAPS_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/hf/degree.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

/// Parameter name with layer indices replaced by `*`, as transformers does.
std::string WildcardLayerNumbers(std::string_view name);

/// The plan entry covering `tensor_name`, or nullptr.
const ResolvedEntry* MatchPlanEntry(const ModelPlan& plan, std::string_view tensor_name);

/// The layout of one tensor under `entry` (nullptr: replicated). InvalidArgument when the
/// tensor's shape disagrees with the count the config gives the entry (e.g. a q_proj whose
/// split dim is not a multiple of the attention heads).
Result<LayoutDescriptor> TensorLayout(const ResolvedEntry* entry, std::string_view tensor_name,
                                      const Shape& shape);

/// Every tensor's param map at degree `tp`, in the given order.
/// \error FailedPrecondition  the plan is refused (no plan, an unregistered style: the same
///        refusals as the degree planner, through the same style registry) or `tp` breaks a
///        constraint (the message names it).
/// \error InvalidArgument  a tensor's shape disagrees with the config.
/// \error Unimplemented  the vLLM engine (its layouts are not transformers').
Result<MapDocument> ModelMaps(const ModelPlan& plan, int tp,
                              const std::vector<std::pair<std::string, Shape>>& tensors);

}  // namespace reshard

#endif  // RESHARD_HF_MODEL_MAPS_H_
