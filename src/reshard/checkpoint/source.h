// One interface for every checkpoint format reshard reads (docs/development.md, "A new
// directory format"): a format opens a path into its tensors, their maps and buffers (a
// ShardSource), the files a gather writes beside them, and how convert lays it out at another
// world size when given no target maps. scatter / gather / convert and the Python package
// take any format through it (formats/formats.h: the table and the operations), with no branch
// per format.
#ifndef RESHARD_CHECKPOINT_SOURCE_H_
#define RESHARD_CHECKPOINT_SOURCE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/parallel_run.h"

namespace reshard {

/// What a checkpoint is opened for.
enum class SourceUse {
  kGather,   // full tensors for a Hugging Face checkpoint: the model's weights
  kConvert,  // a sharded checkpoint at another world size: weights and optimizer state
};

/// What the caller asks of a source. A format refuses (InvalidArgument) what it cannot give.
struct SourceOptions {
  SourceUse use = SourceUse::kGather;
  /// The fp32 master weights instead of the module's (DeepSpeed).
  bool master_weights = false;
  /// Leave optimizer state out of a convert.
  bool weights_only = false;
  /// Write the optimizer's state beside the weights in a gather, by its keys (DCP).
  bool optimizer_state = false;
  /// A Hugging Face config.json, for a format whose tensors need one to be named and split
  /// (Megatron); "" when none was given.
  std::string config_path;
  /// Whose names and layouts an Orbax checkpoint's arrays have: "" their own (the pytree
  /// paths), "maxtext" MaxText's, read as the Hugging Face tensors they hold (with the model's
  /// config.json at config_path; checkpoint/orbax/maxtext.h).
  std::string names;
  /// A distributed config (JSON text, "" for none) for the target layout of a checkpoint
  /// whose layout comes from a model's config.json.
  std::string distributed_config;
  /// A gather that dequantizes (a Hugging Face directory is then a source too).
  bool dequantize = false;
  /// A convert into a trainer's state dict (DCP): a format that can give the structure a
  /// trainer's state dict would have (OpenedCheckpoint::state_dict) gives it and the tensors
  /// it holds (a universal checkpoint: the fp32 masters as the model's, the optimizer's step).
  bool trainer_state_dict = false;
};

/// Where a value sits in a trainer's nested state dict (DCP's planner_data): one element per
/// level, a dict key, or a list index where a list was traversed (`param_groups`' 0).
struct StateDictPath {
  std::vector<std::string> keys;  // an index in decimal
  std::vector<bool> is_index;     // parallel to keys
  friend bool operator==(const StateDictPath&, const StateDictPath&) = default;
};

/// A value of a trainer's state dict that is no tensor (an optimizer's param_groups or step, a
/// learning-rate scheduler's or a data loader's state), as its checkpoint stores it.
struct StateDictObject {
  std::string key;  // its flattened key ("optim.param_groups.0.lr")
  StateDictPath path;
  /// The stream transforms its stored bytes went through ("stream.zstd/1"; empty: none).
  std::vector<std::string> transforms;
  uint64_t stored_bytes = 0;  // how many bytes `read` gives
  /// Its stored bytes (for DCP a torch.save archive of the object, transformed as said), valid
  /// while the opened checkpoint lives.
  std::function<Result<std::span<const std::byte>>()> read;
};

/// What a checkpoint of a trainer's state dict holds beyond its tensors: where each tensor sits
/// in the nested state dict, and every other value. A writer of the same kind keeps both, so
/// the trainer loads its whole state dict back.
struct StateDictStructure {
  std::map<std::string, StateDictPath> tensor_paths;  // by the manifest's parameter name
  std::vector<StateDictObject> objects;
};

/// An opened checkpoint.
struct OpenedCheckpoint {
  /// The format's name in the table ("reshard", "hf", "deepspeed", ...).
  std::string format;
  /// Its tensors, maps and buffers. Null when the checkpoint can only be gathered (`gather`).
  std::shared_ptr<ShardSource> source;
  /// Files a gather writes beside the tensors (the model's config.json).
  std::vector<ExtraFile> extra_files;
  /// convert's target maps at a world size when none are given; unset, or nullopt returned:
  /// the layouts recorded in source->manifest().
  std::function<Result<std::optional<MapDocument>>(int world_size)> target_maps;
  /// A gather of the format's own, used instead of GatherFrom(source) when set.
  std::function<Status(const std::string& out_dir, const CheckpointOptions& options)> gather;
  /// Why convert cannot take this checkpoint (with `source` null).
  std::string not_convertible;
  /// A trainer's state dict's structure, for a convert into the same kind of checkpoint (DCP);
  /// null when the format records none.
  std::shared_ptr<const StateDictStructure> state_dict;
  /// The run that wrote it: its ranks' coordinates, the optimizer's sharding, how its files map
  /// onto the ranks, and what the format does not record (checkpoint/parallel_runs.h).
  ParallelRun run;
};

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_SOURCE_H_
