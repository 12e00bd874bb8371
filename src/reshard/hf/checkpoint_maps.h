// Checkpoint layouts from a model's config.json: the glue between the plans (hf/) and the
// checkpoint formats (checkpoint/), shared by the CLI and the Python package.
//
// - scatter --config: every tensor of a full checkpoint laid out as transformers holds it at a
//   number of processes and a distributed config (PlanCheckpointMaps: per-expert MoE tensors
//   into the stacked buffers transformers fuses them into);
// - convert of a sharded checkpoint scattered that way: the target layout from the config.json
//   its manifest keeps, at another topology (TP <-> EP);
// - convert of a DeepSpeed checkpoint whose parameters record no layout: maps from the save
//   dir's config.json.
#ifndef RESHARD_HF_CHECKPOINT_MAPS_H_
#define RESHARD_HF_CHECKPOINT_MAPS_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/hf/model_maps.h"
#include "reshard/ir/buffer_set.h"
#include "reshard/ir/map_json.h"

namespace reshard {

/// What scatter needs to lay a full checkpoint out from a model's config.json.
struct ConfigScatter {
  MapProvider maps;
  BufferSetBuilder buffers;
  /// The plan's divisibility constraints, and the config (JSON text) for the manifest.
  std::vector<DegreeConstraint> constraints;
  std::string model_config;
  /// The scale tensors of block-quantized tensors and their ties (for the manifest).
  std::map<std::string, BlockScales> block_scales;
};

/// The layout of the full checkpoint in `full_dir` (its safetensors headers; no data read) at
/// `world` processes under `options.distributed`.
/// \error InvalidArgument  malformed config.json; FailedPrecondition  what the degree planner
///        refuses, or a tensor that does not fit the config (PlanCheckpointMaps).
Result<ConfigScatter> ConfigScatterMaps(const std::string& full_dir, std::string_view config_json,
                                        int world, const PlanOptions& options = {});

/// ConfigScatterMaps of `tensors` (name, dtype, valid shape) rather than a directory's (a
/// scatter through a dequantized view).
Result<ConfigScatter> ConfigScatterMaps(const std::vector<StoredTensor>& tensors,
                                        std::string_view config_json, int world,
                                        const PlanOptions& options = {});

/// The block-quantized pairs of the Hugging Face checkpoint in `full_dir` (its safetensors
/// headers and config.json's quantization_config): the ties by scale tensor; empty without a
/// quantization_config. \error InvalidArgument  a quantization_config reshard cannot read;
/// FailedPrecondition  tensors that do not pair (TieQuantizedTensors)
Result<std::map<std::string, BlockScales>> BlockScalesOfDir(const std::string& full_dir);

/// Scales that follow their data wherever a map is made (DESIGN 20): when `full_dir`'s
/// config.json has a quantization_config, `maps` is wrapped so that each scale tensor gets the
/// block image of its data tensor's map (a map `maps` names for a scale tensor itself must be
/// that image: FailedPrecondition naming both otherwise). Returns the ties for the manifest
/// (empty, `maps` unchanged, without such a config).
Result<std::map<std::string, BlockScales>> FollowBlockScales(const std::string& full_dir,
                                                             MapProvider& maps);

/// The maps of the PEFT adapter in `adapter_dir` from `base`, the maps of the base model's
/// tensors (a map document such as vLLM's layout): each adapter tensor laid out as its base
/// weight is, B stacked in buffers beside fused ones (LoraMapsFromBase, checkpoint/peft.h).
/// \error what CheckLoraTensors and LoraMapsFromBase refuse, naming the tensor.
Result<MapDocument> AdapterMapsFromDocument(const std::string& adapter_dir,
                                            const MapDocument& base);

/// The target maps of a sharded checkpoint scattered with --config (its manifest keeps the
/// model's config.json) at `world` processes under `options.distributed`; nullopt for a
/// checkpoint that kept none (its recorded layout descriptors serve) unless `require` is set,
/// which makes that InvalidArgument.
Result<std::optional<MapDocument>> RecordedConfigMaps(const std::string& sharded_dir, int world,
                                                      const PlanOptions& options, bool require);

/// The maps of `tensors` (name, dtype, valid shape) laid out from a model's config.json (JSON
/// text) at `world` processes under `options.distributed`: per-expert MoE tensors into the stacked
/// buffers transformers fuses them into (PlanCheckpointMaps), buffers validated.
/// \error InvalidArgument  malformed config; FailedPrecondition  what the planner refuses.
Result<MapDocument> ConfigTargetMaps(std::string_view config_json,
                                     const std::vector<StoredTensor>& tensors, int world,
                                     const PlanOptions& options = {});

/// The target maps of a DeepSpeed checkpoint whose parameters record no layout, from the save
/// dir's config.json (with the optimizer states' names unless `weights_only`); nullopt when
/// every parameter has a layout or there is no config.json.
Result<std::optional<MapDocument>> DeepSpeedConfigMaps(const std::string& dir, int world,
                                                       bool weights_only);

}  // namespace reshard

#endif  // RESHARD_HF_CHECKPOINT_MAPS_H_
