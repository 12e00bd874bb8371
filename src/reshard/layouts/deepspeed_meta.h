// DeepSpeed's per-parameter universal-checkpoint metadata, lowered to layout descriptors.
//
// The input is one JSON object: the keys of the AutoTP restore metadata DeepSpeed attaches
// to a parameter (`ds_autotp_universal_checkpoint_meta`), the per-parameter keys its
// universal checkpoint stores beside the tensor (`cat_dim`, `param_n_sub_params`,
// `sub_param_shape`, `vocab_tensor`), the model-level vocabulary sizes, and `average`
// (the parameter matches `parameter_to_average_patterns`). Tuples are JSON arrays.
//
//   replicated, partition_dim, logical_shape | original_shape, partition_sizes,
//   sub_param_sizes, sub_param_shape, sub_param_shard_widths, universal_checkpoint_version,
//   cat_dim, param_n_sub_params, vocab_tensor, original_vocab_size, padded_vocab_size,
//   average, unsupported_reason, conversion {unsupported_reason, affine_map, ...},
//   and informational keys (name, partition_type, is_bias, output_shape,
//   target_partition_shape), which are read but do not decide anything.
//
// Unknown keys are refused: a key this reader does not know might change the layout.
// The lowering order and its table are in docs/layouts.md.
//
// An averaged parameter has no image in the map language (DeepSpeed's converter averages
// the ranks' copies; no affine map can express a reduction). It is lowered to a replicated
// map: reading data through it checks that the replicas agree and refuses them if not, so
// nothing is ever averaged.
#ifndef RESHARD_LAYOUTS_DEEPSPEED_META_H_
#define RESHARD_LAYOUTS_DEEPSPEED_META_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

/// What one parameter's metadata lowers to: a descriptor and the shape to lay it out for.
struct LoweredDeepSpeedMeta {
  LayoutDescriptor descriptor;
  Shape shape;  // F's real shape (for padded_vocab, without the padding)
  /// The world size the metadata was recorded at, when it says (explicit sizes or widths).
  std::optional<int> recorded_world_size;
  /// Things a user should know, e.g. that an averaged parameter became a checked replica.
  std::vector<std::string> notes;
};

/// Lowers the metadata to a descriptor. InvalidArgument (with the JSON path) for malformed
/// or self-contradicting metadata (sizes that do not sum to the dimension, widths of
/// different lengths, a replicated parameter with a partition dim); FailedPrecondition for
/// a layout DeepSpeed itself says it cannot describe (`unsupported_reason`), or one it
/// describes only by a recorded affine map (no rule to re-derive it at another degree).
Result<LoweredDeepSpeedMeta> LowerDeepSpeedMeta(std::string_view meta_json);

/// The canonical param map of the metadata at `world_size`. A recorded affine map
/// (`conversion.affine_map`) is checked against the lowered layout when both exist at this
/// world size (InvalidArgument when they disagree), and is the answer when it is all the
/// metadata has and its world size is the one asked for. `notes` receives the lowering's.
Result<ParamMap> DeepSpeedMetaMap(std::string_view meta_json, int world_size,
                                  std::vector<std::string>* notes = nullptr);

/// A param map DeepSpeed recorded (`ParamAffineMap.to_dict()`, as in a checkpoint's
/// `universal_checkpoint_info.affine_map`), validated and canonicalised; a zero-element piece
/// (DeepSpeed gives one to a rank that holds nothing) is dropped.
Result<ParamMap> ReadDeepSpeedAffineMap(std::string_view map_json);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_DEEPSPEED_META_H_
