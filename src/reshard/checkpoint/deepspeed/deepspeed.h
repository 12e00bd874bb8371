// DeepSpeed training checkpoints (what `engine.save_checkpoint(dir, tag)` writes), read without
// running their pickles, with every parameter expressed as maps.
//
// A save dir holds `latest` (the tag's name, one line) and one directory per tag:
//   mp_rank_{t:02d}_model_states.pt           ZeRO 0, 1, 2: one per TP rank t
//     module                  {name: TP rank t's shard} (bf16/fp16/fp32: the module's dtype)
//     param_shapes            [{name: TP shard shape}, ...] one dict per parameter group
//     buffer_names, frozen_param_shapes, dp_world_size, mp_world_size, ds_config, ...
//     optimizer               ZeRO 0: the torch optimizer's state_dict (state[i].exp_avg is
//                             parameter i's, in the order of param_groups[*].params)
//     universal_checkpoint_info (AutoTP): pattern lists (tp_replicated_parameter_patterns,
//                             parameter_with_row_parallelism_patterns, ...) and
//                             affine_map {"version": 1, "params": {REGEX: param map}}
//   [bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt   ZeRO 1, 2: per DP rank d
//     optimizer_state_dict.single_partition_of_fp32_groups[g]  rank d's part of group g's
//                             flat fp32 vector (the groups' parameters concatenated, then cut
//                             into partition_count equal partitions; group_paddings[g] zeros
//                             end the last)
//     optimizer_state_dict.base_optimizer_state.state[g].{exp_avg,exp_avg_sq}  the same
//     optimizer_state_dict.param_slice_mappings[g] {name: fragment_address(numel, start)}:
//                             the part of the parameter that lies in this partition, at
//                             `start`; a parameter's parts, in DP rank order, are its flat TP
//                             shard
//   zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt           ZeRO 3: per DP rank (module
//                             tensors are empty; param_shapes as above)
//   zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt           ZeRO 3
//     optimizer_state_dict.fp32_flat_groups[g]   every parameter of group g, in order, split
//                             into ceil(n / DP) elements per rank (the last ranks' parts padded
//                             or empty)
//     optimizer_state_dict.optimizer_state_dict.state[g].{exp_avg,exp_avg_sq}  the same
//
// A PipelineModule's checkpoint (PP stages, each of TP x DP ranks) numbers its files by slice
// s = stage * TP + t: mp_rank_{s:02d}_model_states.pt (module None, param_shapes: that stage's
// parameters, named "<layer index>.<name in the layer>" and "tied_modules.<key>.<name>";
// checkpoint_parallel_dimensions gives pp_degree and tp_degree) and
// zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt (ZeRO 1: that stage's DP partitions). The
// module's weights are in layer files, one per layer that has a state_dict, written by DP rank
// 0 of its stage: layer_{L:02d}[-model_{t:02d}]-model_states.pt ({name in the layer: tensor};
// "-model_{t:02d}" only with a "model" axis in the topology). A tied module (TiedLayerSpec) is
// saved by the layer that owns it (the one without forward_fn), as that layer's file, and is
// a parameter of every stage that uses it: the copies are one parameter, checked equal on
// read (the first stage's is read).
//
// In map terms: a parameter's TP map (F -> TP shards) comes from the affine map (its regex
// keys matched against the name as Python's re.match does: anchored at the start; at most one
// may match), else from the pattern lists (lowered as layouts/deepspeed_meta.h lowers
// DeepSpeed's metadata), else the parameter is whole (one TP rank). Each TP shard, flattened,
// is the logical tensor of a DP map whose ranks are the DP fragments: one piece per fragment,
// from a contiguous range of the shard to the fragment's place in a flat vector. The full
// parameter is the composition of the two; every stage only builds its DP map (ZeRO 0 and
// module weights: one whole fragment), and one copy path reads them all.
#ifndef RESHARD_CHECKPOINT_DEEPSPEED_H_
#define RESHARD_CHECKPOINT_DEEPSPEED_H_

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/source.h"
#include "reshard/exec/executor.h"
#include "reshard/io/torch_file.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

struct DeepSpeedExperts;  // deepspeed/moe.h

/// The tensors a DeepSpeed checkpoint holds per parameter.
enum class DeepSpeedState {
  kModule,    // the module's weights, in the module's dtype
  kMaster,    // the optimizer's fp32 master weights
  kExpAvg,    // Adam's first moment (fp32, scale power -1)
  kExpAvgSq,  // Adam's second moment (fp32, scale power -2)
};
inline constexpr int kNumDeepSpeedStates = 4;

/// "module", "fp32", "exp_avg", "exp_avg_sq".
std::string_view DeepSpeedStateName(DeepSpeedState state);

/// The scale power of a state's tensors under a re-shard (ShardedParam::scale_power): -1 for
/// the first moment, -2 for the second, 1 for weights.
inline int DeepSpeedScalePower(DeepSpeedState state) {
  return state == DeepSpeedState::kExpAvg ? -1 : state == DeepSpeedState::kExpAvgSq ? -2 : 1;
}

/// Where one DP fragment of a TP shard lives: a flat tensor of one file, from an element.
struct DeepSpeedFragment {
  const TorchFile* file = nullptr;
  const TorchTensor* tensor = nullptr;
  Index offset = 0;  // elements into `tensor`
};

/// Whether a module element (`dtype`) is the fp32 master weight `master` rounded to that
/// dtype, to nearest even (NaN matches NaN): what DeepSpeed's copy of the masters into the
/// module after each step leaves.
bool IsMasterRounded(DType dtype, const std::byte* module, const std::byte* master);

/// One TP shard of one state as DeepSpeed keeps it: a DP map (the flattened shard -> its
/// fragments) and where each of that map's ranks keeps its fragment.
struct DeepSpeedShardParts {
  ParamMap dp_map;
  std::vector<DeepSpeedFragment> fragments;  // one per rank of dp_map
};

/// A parameter_with_sub_params entry of universal_checkpoint_info ({"patterns", "shape",
/// "partition_dim"}), which ds_to_universal writes beside the tensor as a SubparamShape.
struct DeepSpeedSubParamShape {
  const TorchFile* file = nullptr;     // the model-states file holding it
  PickleNodeId entry = kNoPickleNode;  // its dict in that file's tree
  /// Before universal-checkpoint version 0.4 the shape may give, at partition_dim, the number
  /// of equal sub-parameters rather than their sizes: ds_to_universal then writes the sizes,
  /// each this many (and the shape as a tuple). 0: the shape is written as it is.
  Index legacy_size = 0;
};

/// What DeepSpeed's universal converter records beside a parameter's full tensor, from the
/// pattern lists of universal_checkpoint_info (none of it when an affine map gives the layout,
/// but vocab_tensor).
struct DeepSpeedUniversalKeys {
  std::optional<int> cat_dim;                // the dimension the TP shards were concatenated along
  std::optional<int> n_sub_params;           // parameter_with_2_sub_params_cat_dim_0: 2
  bool vocab_tensor = false;                 // matches vocabulary_parameter_patterns
  std::optional<Index> original_vocab_size;  // rows kept of a vocabulary tensor
  std::optional<DeepSpeedSubParamShape> sub_param_shape;  // matches parameter_with_sub_params
};

/// The optimizer's step count for a parameter as one file pickles it (a node of its tree).
struct DeepSpeedStep {
  const TorchFile* file = nullptr;
  PickleNodeId node = kNoPickleNode;
};

/// What the optimizer holds of a module tensor.
enum class DeepSpeedParamKind {
  kTrained,  // a parameter of a param group: module weights, fp32 master, Adam's moments
  kFrozen,   // a parameter no param group holds (requires_grad False): module weights only
  kBuffer,   // a persistent buffer (buffer_names): module tensor only, in its own dtype
};

/// "trained", "frozen", "buffer".
std::string_view DeepSpeedParamKindName(DeepSpeedParamKind kind);

struct DeepSpeedParam {
  std::string name;
  DeepSpeedParamKind kind = DeepSpeedParamKind::kTrained;
  /// A buffer's dtype (its module tensor's); unset for parameters, which are in the module's.
  std::optional<DType> own_dtype;
  ParamMap tp_map;  // F -> TP shards
  /// The rule that lays the parameter out at any TP degree, when one is known (lowered from
  /// the pattern lists, or recognised in the affine map).
  std::optional<LayoutDescriptor> layout;
  std::string layout_source;  // "affine map", "pattern lists", "whole"
  /// [TP rank][state]: how the checkpoint holds that TP shard (nullopt: it does not).
  std::vector<std::array<std::optional<DeepSpeedShardParts>, kNumDeepSpeedStates>> parts;
  DeepSpeedUniversalKeys universal;
  /// [TP rank]: the optimizer's step (ZeRO 0-2: of the lowest DP rank holding part of the
  /// parameter; ZeRO 3 keeps none per parameter).
  std::vector<DeepSpeedStep> steps;
};

/// A DeepSpeed checkpoint opened read-only: every file mapped and checked against the others
/// before any tensor is read. Errors name the file (and the key path inside it):
///   NotFound   a rank file that is missing, a `latest` naming no directory;
///   DataLoss   a corrupt or truncated file;
///   InvalidArgument  files that do not belong together (a DP rank's file from another run:
///              parameters, shapes or fragments that disagree), metadata that makes no sense.
class DeepSpeedCheckpoint {
 public:
  /// `path` is the save dir (its `latest` names the tag) or a tag dir.
  static Result<DeepSpeedCheckpoint> Open(const std::string& path);

  const std::string& tag_dir() const { return tag_dir_; }
  /// The save dir's config.json, when it has one (else empty).
  const std::string& config_path() const { return config_path_; }
  int stage() const { return stage_; }
  int tp() const { return tp_; }
  int dp() const { return dp_; }
  /// Pipeline stages (a PipelineModule's checkpoint: layer files beside the model states);
  /// 1 otherwise. TP and DP are then per stage.
  int pp() const { return pp_; }
  DType module_dtype() const { return module_dtype_; }
  /// A PipelineModule's checkpoint (layer files): each stage's parameters by name, in the
  /// order its param_shapes lists them (a tied module's in every stage that uses it); empty
  /// otherwise.
  const std::vector<std::vector<std::string>>& stage_params() const { return stage_params_; }
  /// The layer whose file holds each tied module, by the module's key.
  const std::map<std::string, int>& tied_owners() const { return tied_owners_; }
  bool has_optimizer_state() const { return has_optimizer_; }
  const std::vector<DeepSpeedParam>& params() const { return *params_; }
  /// The AutoEP experts (deepspeed/moe.h), which params() does not list; null without them.
  const DeepSpeedExperts* experts() const { return experts_.get(); }
  /// The opened file at `path` (one of file_paths()), or null.
  const TorchFile* FileAt(const std::string& path) const;
  /// Every file it reads.
  std::vector<std::string> file_paths() const;
  /// The model-states files (mp_rank_XX_model_states.pt; ZeRO 3: zero_pp_rank_D_mp_rank_XX_...).
  std::vector<std::string> model_states_paths() const;
  /// The file holding the optimizer's global state: TP rank 0, DP rank 0's optimizer file
  /// (ZeRO 0: TP rank 0's model states); null without optimizer state.
  const TorchFile* optimizer_file() const { return optimizer_file_; }

  /// TP rank `tp_rank`'s shard of `state` of parameter `i`, dense, into `out` (the TP map's
  /// shard size, in the state's dtype): the DP fragments rebuilt through the DP map. The
  /// module state of a ZeRO 3 checkpoint (whose module tensors are empty) is the master
  /// weights rounded to the module's dtype (to nearest even, as DeepSpeed copies them).
  Status ReadTpShard(size_t i, DeepSpeedState state, Rank tp_rank, MutableBuffer out) const;
  /// The same shard where it lies in its mapped file, when one DP fragment holds all of it,
  /// dense and in order (ZeRO 1/2: every parameter but the one a DP boundary cuts), so that
  /// reading it needs no copy; nullopt otherwise (read it with ReadTpShard).
  std::optional<ConstBuffer> TpShardView(size_t i, DeepSpeedState state, Rank tp_rank) const;
  /// Elements [begin, begin + out.num_elements) of the flattened shard ReadTpShard reads, read
  /// from the DP fragments that hold them alone (a partition of a flat vector takes a part of
  /// a parameter in time proportional to that part, not to the parameter).
  Status ReadTpShardRange(size_t i, DeepSpeedState state, Rank tp_rank, Index begin,
                          MutableBuffer out) const;
  DType StateDType(DeepSpeedState state) const;
  /// The dtype of parameter i's tensors in `state` (a buffer's own for its module state).
  DType ParamDType(size_t i, DeepSpeedState state) const;
  /// Whether the checkpoint holds `state` of parameter i: every state of a trained parameter
  /// (with optimizer state), the module's alone of a frozen parameter or a buffer.
  bool Holds(size_t i, DeepSpeedState state) const;

 private:
  friend class DeepSpeedReader;
  std::string tag_dir_;
  std::string config_path_;
  int stage_ = 0;
  int tp_ = 1;
  int dp_ = 1;
  int pp_ = 1;
  DType module_dtype_ = DType::kF32;
  bool has_optimizer_ = false;
  std::vector<std::vector<std::string>> stage_params_;
  std::map<std::string, int> tied_owners_;
  const TorchFile* optimizer_file_ = nullptr;
  std::vector<std::unique_ptr<TorchFile>> files_;
  std::vector<std::string> paths_;
  std::shared_ptr<std::vector<DeepSpeedParam>> params_;
  std::shared_ptr<const DeepSpeedExperts> experts_;
};

/// Whether `path` looks like a DeepSpeed checkpoint (a save dir with `latest`, or a dir with
/// model-states files); it may still fail to open.
bool IsDeepSpeedCheckpoint(const std::string& path);

/// The tensors of a DeepSpeed checkpoint as a shard source at its TP degree, named
/// "<param>" for the first of `states` and "<param>.<state name>" for the others (the
/// moments with scale powers -1 and -2).
std::unique_ptr<ShardSource> DeepSpeedSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt,
                                             std::vector<DeepSpeedState> states);

/// A DeepSpeed checkpoint opened for `options.use`: for a gather, the module's weights (the
/// fp32 master weights with `master_weights`) and the save dir's config.json to copy; for a
/// convert, the module's weights and, unless `weights_only`, the fp32 master weights and
/// Adam's moments as "<param>.fp32", "<param>.exp_avg" and "<param>.exp_avg_sq", each
/// parameter with its layout. An AutoEP checkpoint is gathered by its own gather and not
/// converted (its experts go to the universal checkpoint only).
Result<OpenedCheckpoint> OpenDeepSpeed(const std::string& ckpt_dir, const SourceOptions& options);

/// What a model-states file (`file`, one of mp_rank_XX_model_states.pt, as a universal checkpoint
/// keeps a copy) says of its parameters: for each of `params` (name, full shape), the layout its
/// universal_checkpoint_info gives it at any TP degree (its affine map when that is a split or
/// a replica, else its pattern lists, as ds_to_universal's loader splits the full tensor);
/// nullopt where the file has no such info or the map is no rule reshard recognises.
Result<std::vector<std::optional<LayoutDescriptor>>> DeepSpeedLayoutsOf(
    const TorchFile& file, const std::vector<std::pair<std::string, Shape>>& params);

/// A human summary (text) and a machine one (JSON) of what Open found: stage, TP x DP, dtype,
/// parameters with their shapes and where their layouts come from.
std::string DeepSpeedSummaryText(const DeepSpeedCheckpoint& ckpt);
std::string DeepSpeedSummaryJson(const DeepSpeedCheckpoint& ckpt);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DEEPSPEED_H_
