// DeepSpeed AutoEP (mixture-of-experts) checkpoints: what DeepSpeed 0.19.8 saves when
// "expert_parallel": {"enabled": true, "autoep_size": EP} replaces a model's MoE layers by its
// own (deepspeed/module_inject/auto_ep*.py), read as maps.
//
// AutoEP replaces each MoE block at `module_path` (transformers' `model.layers.L.mlp`) by a
// layer holding `router.gate.weight` and the experts of EP rank k stacked by slot:
// `experts.w1` [E_k, I, H] (the gate rows of transformers' gate_up_proj), `experts.w3`
// [E_k, I, H] (the up rows) and `experts.w2` [E_k, H, I] (down_proj). The world's DP ranks hold
// the EP ranks (DP rank d is EP rank d mod EP, expert-DP rank d div EP; with
// use_data_before_expert_parallelism, d div EDP and d mod EDP). `engine.save_checkpoint` writes
//   mp_rank_00_model_states.pt       the dense module; param_shapes (the expert parameters in
//                                    a group of their own, with EP rank 0's shapes);
//                                    ds_autoep_layers: per layer moe_layer_id, module_path,
//                                    expert_key_prefix, num_experts, num_local_experts, ep_size,
//                                    expert_placement (a placement descriptor, layouts/experts.h)
//                                    and affine_maps {"version": 1, "params": {name: map}}: the
//                                    map of each [E, ...] expert tensor over the EP ranks
//   layer_{L}_expert_{f}_mp_rank_00_model_states.pt   {"<prefix>.w1.<f>": [I, H], w2, w3}:
//                                    slot f mod E_k of EP rank f div E_k (DeepSpeed numbers
//                                    the files so, whatever the placement, and reads them back
//                                    so)
//   zero_pp_rank_{d}_..._optim_states.pt   ZeRO 1/2: the expert group's flat partitions are
//                                    EP rank k's [E_k, ...] tensors cut over its expert-DP ranks
//
// In map terms an expert parameter is F = [E, ...] (the experts in id order, as ds_to_universal
// consolidates it) with DeepSpeed's affine map to the EP ranks, and each EP rank's shard is
// the concatenation of its expert-DP fragments (optimizer states) or of its expert files
// (module weights).
#ifndef RESHARD_CHECKPOINT_DEEPSPEED_MOE_H_
#define RESHARD_CHECKPOINT_DEEPSPEED_MOE_H_

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/io/torch_file.h"
#include "reshard/io/torch_writer.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/experts.h"

namespace reshard {

// ---- AutoEP affine maps ------------------------------------------------------------------

/// The affine map DeepSpeed records for an expert parameter of `logical_shape` ([E, ...], the
/// expert dimension first) placed by `placement`, as its autoep_placement_to_affine_map
/// writes it (ParamAffineMap.to_dict() as JSON): EP rank k's shard is [len(experts[k]), ...]
/// in slot order; a piece per run of consecutive expert ids held by that rank alone, and a
/// piece of its own for an expert on several ranks, whose locations are all its holders.
/// InvalidArgument for an invalid placement or a shape whose first dimension is not E.
Result<std::string> AutoEpAffineMapJson(const ExpertPlacement& placement,
                                        const Shape& logical_shape);
/// The same map, read (ReadDeepSpeedAffineMap: validated and canonicalised).
Result<ParamMap> AutoEpAffineMap(const ExpertPlacement& placement, const Shape& logical_shape);
/// The other way: the placement a map over [E, ...] says, when it is one AutoEP would record
/// (every shard whole experts in slot order, each expert taken whole from F). InvalidArgument
/// naming the rank and slot otherwise.
Result<ExpertPlacement> AutoEpPlacementOfMap(const ParamMap& map);

// ---- the checkpoint's experts ------------------------------------------------------------

/// Where a contiguous run of an EP rank's flattened shard lies in one file's flat tensor.
struct AutoEpSpan {
  Index start = 0;  // in the EP rank's flattened shard
  Index length = 0;
  DeepSpeedFragment where;
};

/// One expert parameter of an AutoEP layer ("<module_path>.experts.w1").
struct AutoEpParam {
  std::string name;
  std::string weight;  // "w1", "w2" or "w3"
  size_t layer = 0;    // index into DeepSpeedExperts::layers
  ParamMap ep_map;     // F [E, ...] -> the EP ranks' [E_k, ...]
  /// [EP rank][state]: the spans that make that rank's shard, in order (module: one per
  /// expert file; optimizer states: one per expert-DP fragment). Empty without that state.
  std::vector<std::array<std::vector<AutoEpSpan>, kNumDeepSpeedStates>> spans;
  /// The optimizer's step, from the first file holding a fragment (ZeRO 1/2).
  DeepSpeedStep step;
};

struct AutoEpLayer {
  int moe_layer_id = 0;
  std::string module_path;  // "model.layers.0.mlp"
  std::string prefix;       // expert_key_prefix: "model.layers.0.mlp.experts"
  ExpertPlacement placement;
  PickleNodeId entry = kNoPickleNode;  // its ds_autoep_layers dict in the model states
};

struct DeepSpeedExperts {
  int ep_size = 1;
  /// use_data_before_expert_parallelism: DP rank d is EP rank d div EDP (else d mod EP).
  bool data_before_expert = false;
  DType module_dtype = DType::kF32;
  std::vector<AutoEpLayer> layers;
  std::vector<AutoEpParam> params;  // layer by layer, w1 w2 w3
};

/// What the AutoEP reader needs of the dense reader's findings.
struct AutoEpInput {
  const TorchFile* model_states = nullptr;  // mp_rank_00_model_states.pt
  std::vector<const TorchFile*> optim;      // ZeRO 1/2: per DP rank; else empty
  int stage = 0;
  int tp = 1;
  int dp = 1;
  /// param_shapes of TP rank 0, in order: name, group, shape.
  std::vector<std::string> names;
  std::vector<size_t> groups;
  std::vector<Shape> shapes;
  /// The names of the files in the tag dir (an expert file no layer names is refused).
  std::vector<std::string> files;
  /// Opens a file of the tag dir (NotFound when missing).
  std::function<Result<const TorchFile*>(const std::string& name)> open;
  std::function<std::string(const TorchFile*)> where;
};

/// The checkpoint's AutoEP experts, or nullopt when its model states have no
/// ds_autoep_layers. The expert parameters are then the dense reader's to skip (ClaimsName).
/// Every file is checked before any tensor is read: the placement against the recorded
/// affine maps (as DeepSpeed checks them), the expert files' tensors against the shapes, the
/// fragments against the expert-DP ranks. Unimplemented for what DeepSpeed itself does not
/// convert (ZeRO 3's partition-native experts, folded AutoEP+AutoTP at TP > 1) and for ZeRO 0
/// and uneven placements.
Result<std::optional<DeepSpeedExperts>> ReadAutoEpExperts(const AutoEpInput& in);

/// Whether `name` is one of `experts`' parameters.
bool ClaimsName(const DeepSpeedExperts& experts, const std::string& name);

/// EP rank `ep_rank`'s shard of `state` of expert parameter `i`, elements [begin, begin +
/// out.num_elements) of it flattened, into `out` (the state's dtype).
Status ReadAutoEpShard(const DeepSpeedExperts& experts, size_t i, DeepSpeedState state,
                       Rank ep_rank, Index begin, MutableBuffer out);
/// The whole [E, ...] tensor of `state` of expert parameter `i` (experts in id order).
Status ReadAutoEpFull(const DeepSpeedExperts& experts, size_t i, DeepSpeedState state,
                      MutableBuffer out, const CheckpointOptions& options = {});

// ---- operations --------------------------------------------------------------------------

/// Gather of an AutoEP checkpoint: the model as transformers saves it (save_pretrained): the
/// dense weights under the names the model's checkpoint uses and every expert's tensors on
/// their own (Mixtral: `model.layers.L.block_sparse_moe.experts.{e}.w1.weight`, w2, w3 and
/// `block_sparse_moe.gate.weight`; Qwen3-MoE, Qwen2-MoE without shared experts:
/// `mlp.experts.{e}.{gate,up,down}_proj.weight`). The model type is config.json's: without
/// one, or for another type, Unimplemented saying what is known.
Status GatherAutoEp(const std::shared_ptr<const DeepSpeedCheckpoint>& ckpt, DeepSpeedState state,
                    const std::string& out_dir, const CheckpointOptions& options);

/// One file of a universal checkpoint that the AutoEP experts add or change.
struct AutoEpUniversalFile {
  std::string name;  // relative to the output directory
  uint64_t bytes = 0;
  std::function<Status(const std::string& path, const TorchWriteOptions& options)> write;
};
/// What ds_to_universal writes for the experts under `folder`: zero/<name>/{fp32,exp_avg,
/// exp_avg_sq}.pt ({"param": [E, ...] fp32, "cat_dim": 0, "is_expert_param": True,
/// "ep_num_experts": E}), zero/<name>/step.pt, and the model-states files, whose
/// universal_checkpoint_info gets expert_parameter_patterns ["\.experts\.w[123]$"] and
/// ds_autoep_layers of the six fields DeepSpeed keeps (moe_layer_id, module_path,
/// expert_key_prefix, num_experts, num_local_experts, ep_size); these replace the copies.
std::vector<AutoEpUniversalFile> AutoEpUniversalFiles(
    std::shared_ptr<const DeepSpeedCheckpoint> ckpt, const std::string& folder,
    const CheckpointOptions& options);

/// Lines for `inspect`: the EP size, each layer's placement and its expert parameters.
std::string AutoEpSummaryText(const DeepSpeedExperts& experts);
/// {"ep_size", "layers": [{"module_path", "num_experts", "placement": descriptor,
///  "params": [{"name", "shape", "ep_shard_shapes", "affine_map"}]}]}, as JSON text.
std::string AutoEpSummaryJson(const DeepSpeedExperts& experts);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DEEPSPEED_MOE_H_
