// Param maps of a whole checkpoint at a tensor-parallel degree, from the model's plan.
//
// Tensors are matched to plan entries the way transformers matches them: a layer index
// between dots becomes `*` (`model.layers.3.self_attn.q_proj.weight` -> `...layers.*...`),
// and an entry names either the parameter or its module. Plan patterns are relative to the
// (sub-)model that owns them, so the longest matching suffix of the parameter name counts
// (`model.`, `model.language_model.` and other prefixes fall away). Names are matched after
// the renamings transformers applies to checkpoint keys at load (the registry's load_renames);
// the maps keep the stored names. A tensor that transformers converts at load (per-expert MoE
// tensors stacked into experts.gate_up_proj) is refused by the per-tensor Map, naming the
// conversion; PlanCheckpointMaps, which sees the whole checkpoint, lays such tensors out as
// maps into the stacked buffers transformers holds (DESIGN 16, 17).
//
// Styles become layout descriptors (docs/layouts.md), split exactly where the entry's count
// binds the degree and in ceil chunks (transformers' DTensor shards) where it does not:
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
#include "reshard/layouts/experts.h"

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

/// One tensor's map at a degree, with the layout descriptor it was built from (recorded in a
/// sharded checkpoint's manifest so that it can be re-laid out at another degree).
struct TensorMap {
  ParamMap map;
  LayoutDescriptor layout;
};

/// The map of one tensor at degree `tp` under `plan` (nullptr entry: replicated).
/// \error FailedPrecondition  the tensor's shape disagrees with the config's counts.
Result<TensorMap> PlanTensorMap(const ModelPlan& plan, int tp, std::string_view tensor_name,
                                const Shape& shape);

/// Whether maps at `world` processes can follow the distributed config `d`: InvalidArgument for
/// a key the maps do not lay out (DistributedConfig::not_laid_out: FSDP, pipeline, sequence
/// parallelism) and a tp_size other than `world` (rather than either ignored).
Status CheckLaidOutDistributedConfig(const DistributedConfig& d, int world);

/// The one route from a model's config.json to the maps of its tensors at a degree: the
/// config is read against `registry`, the plan resolved with `options`, and the degree
/// checked against every constraint before any map is built. `scatter --config` and
/// `degree --emit-maps` both go through it.
class ConfigMaps {
 public:
  /// \error InvalidArgument  malformed config.json, a degree below 1, or a distributed config
  ///        the maps cannot follow (CheckLaidOutDistributedConfig). A model without a
  ///        tensor-parallel plan is laid out whole (replicated) at degree 1.
  /// \error FailedPrecondition  the plan is refused (no plan, an unregistered style) or `tp`
  ///        breaks a constraint: the degree planner's message.
  /// \error Unimplemented  the vLLM engine (its layouts are not transformers').
  static Result<ConfigMaps> FromConfigJson(const TpRegistry& registry, std::string_view config_json,
                                           int tp, const PlanOptions& options = {});
  /// From a plan already resolved; the same checks.
  static Result<ConfigMaps> FromPlan(ModelPlan plan, int tp);

  const ModelPlan& plan() const { return plan_; }
  int tp() const { return tp_; }
  /// The map of one tensor (PlanTensorMap at this degree).
  Result<TensorMap> Map(std::string_view tensor_name, const Shape& shape) const {
    return PlanTensorMap(plan_, tp_, tensor_name, shape);
  }

 private:
  ConfigMaps(ModelPlan plan, int tp) : plan_(std::move(plan)), tp_(tp) {}
  ModelPlan plan_;
  int tp_ = 1;
};

/// A tensor of a checkpoint as stored: name, dtype, shape (from its safetensors header).
struct StoredTensor {
  std::string name;
  DType dtype;
  Shape shape;
};

/// One tensor's map in a whole-checkpoint layout: with its layout descriptor when it is its own
/// rank tensor, without one when transformers stacks it into a buffer.
struct CheckpointTensorMap {
  std::string name;
  ParamMap map;
  std::optional<LayoutDescriptor> layout;
};

/// The maps of every tensor of a checkpoint and the buffers transformers fuses them into.
struct CheckpointMaps {
  std::vector<CheckpointTensorMap> tensors;  // in the given order
  BufferSetBuilder buffers;
};

/// The layout of a whole checkpoint as transformers holds it on each rank (DESIGN 17): tensors
/// that a load conversion of the model stacks (per-expert `experts.{e}.gate_proj` /
/// `up_proj` -> `experts.gate_up_proj` [E, 2I, H], gate rows then up rows per expert;
/// `down_proj` -> `experts.down_proj` [E, H, I]) become maps into one buffer per layer, named
/// as transformers names the stacked tensor (after its load renames), laid out by the plan
/// entry of that name: `packed_colwise` splits each expert's gate and up rows together,
/// `rowwise` the last dim, `grouped_gemm` (expert parallelism) gives each rank a contiguous
/// block of whole experts; no entry replicates it. Every other tensor is laid out as by Map.
/// \error FailedPrecondition  an expert missing from a stacked group, members of different
///        shapes or dtypes, a split the degree does not divide, or what Map refuses.
Result<CheckpointMaps> PlanCheckpointMaps(const ConfigMaps& maps,
                                          const std::vector<StoredTensor>& tensors);

/// Every tensor's param map at degree `tp`, in the given order (through ConfigMaps).
/// \error FailedPrecondition  the plan is refused (no plan, an unregistered style: the same
///        refusals as the degree planner, through the same style registry) or `tp` breaks a
///        constraint (the message names it).
/// \error FailedPrecondition  a tensor's shape disagrees with the config.
/// \error Unimplemented  the vLLM engine (its layouts are not transformers').
Result<MapDocument> ModelMaps(const ModelPlan& plan, int tp,
                              const std::vector<std::pair<std::string, Shape>>& tensors);

}  // namespace reshard

#endif  // RESHARD_HF_MODEL_MAPS_H_
