// The checkpoint formats reshard reads, and the operations that take any of them.
//
// Each format is one row of a table (formats.cc): a cheap detector (file names only) and an
// opener returning an OpenedCheckpoint (checkpoint/source.h). Detection runs in table order;
// the first format that claims a path opens it. A new format adds its row, and the CLI and the
// Python package take it with no other change.
#ifndef RESHARD_CHECKPOINT_FORMATS_FORMATS_H_
#define RESHARD_CHECKPOINT_FORMATS_FORMATS_H_

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/diff.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/source.h"
#include "reshard/hf/model_maps.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/parallel_run.h"

namespace reshard {

struct CheckpointFormat {
  std::string_view name;
  /// "a DeepSpeed checkpoint": for messages.
  std::string_view description;
  /// Whether `path` is of this format, from the names of its files (it may still fail to
  /// open).
  bool (*detect)(const std::string& path);
  /// InvalidArgument for a SourceOptions field this format does not take.
  Status (*check)(const std::string& path, const SourceOptions& options);
  Result<OpenedCheckpoint> (*open)(const std::string& path, const SourceOptions& options);
};

/// Every format, in detection order.
std::span<const CheckpointFormat> CheckpointFormats();

/// The format of `path`: the first whose detector claims it, else the reshard sharded
/// checkpoint (whose opener then says what is missing).
const CheckpointFormat& DetectFormat(const std::string& path);

/// Whether `options` suit the format of `path` (CheckpointFormat::check).
Status CheckSourceOptions(const std::string& path, const SourceOptions& options);

/// Opens `path` in its format with `options` checked.
Result<OpenedCheckpoint> OpenCheckpoint(const std::string& path, const SourceOptions& options);

/// Any checkpoint -> full Hugging Face checkpoint (GatherFrom, or the format's own gather).
/// With several processes (options.communicator), every process opens the input and all
/// fail when one does.
Status GatherCheckpoint(const std::string& path, const SourceOptions& source,
                        const std::string& out_dir, const CheckpointOptions& options = {});

/// Any checkpoint -> reshard sharded checkpoint at `world_size` (ConvertFrom). Target maps:
/// `target_maps`, else the format's (OpenedCheckpoint::target_maps), else the recorded
/// layouts. With `options.dequantize`, through a DequantizedView (a reshard sharded or a Hugging
/// Face checkpoint): a checkpoint scattered from a config.json is laid out from that config
/// without quantization_config.
Status ConvertCheckpoint(const std::string& path, const SourceOptions& source, int world_size,
                         const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                         const CheckpointOptions& options = {});
/// The same into the run `target` describes (layouts/parallel_run.h): its world is the output's
/// (a reshard sharded checkpoint: a rank per rank of the target's grid). InvalidArgument for an
/// invalid target, or one whose axes the output cannot hold (a grid whose ranks do not all hold
/// different shards: a pipeline or an expert grid, which the format records no way to place).
Status ConvertCheckpoint(const std::string& path, const SourceOptions& source,
                         const ParallelRun& target, const std::optional<MapDocument>& target_maps,
                         const std::string& out_dir, const CheckpointOptions& options = {});

/// reshard diff: the checkpoints at `a` and `b` (any formats, any layouts) compared tensor by
/// tensor (DiffSources), each read as a weights-only convert reads it (a DeepSpeed or universal
/// checkpoint: the module's weights; a reshard sharded checkpoint: every tensor it holds). With
/// `dequantize`, a side with block-quantized tensors (recorded block scales, or a config.json
/// with a quantization_config) has them read as numbers of that dtype, as gather --dequantize
/// writes them; a side with none is read as it is.
/// `config_path` (a model's config.json, "" for none) is given to each side whose format takes
/// one (a Megatron-Core dist-ckpt needs it to name and split its tensors).
/// \error InvalidArgument  a format that cannot be read so (an AutoEP DeepSpeed checkpoint),
///        dequantizing a format it does not take, a config.json neither side takes
Result<DiffReport> DiffCheckpoints(const std::string& a, const std::string& b,
                                   const std::optional<DequantizeOptions>& dequantize,
                                   const DiffOptions& options = {},
                                   const std::string& config_path = "");

/// Any checkpoint -> Orbax checkpoint item on `target`'s mesh (WriteOrbax: its tensors as a
/// convert opens them, optimizer state included unless weights_only). One process.
Status WriteOrbaxCheckpoint(const std::string& path, const SourceOptions& source,
                            const OrbaxTarget& target, const std::string& out_dir,
                            const CheckpointOptions& options = {});

/// The target run of a reshard sharded checkpoint at `world_size` (a rank per tensor rank), and
/// of a DCP saved for `world_size` ranks (a flat world).
ParallelRun ShardedTargetRun(int world_size);
ParallelRun DcpTargetRun(int world_size);

/// A scatter's layout of given tensors: the maps, the buffers they fill and, from a model's
/// config.json, what the manifest records (the config, its plan's constraints).
struct ScatterLayout {
  MapProvider maps;
  BufferSetBuilder buffers;
  std::optional<std::string> model_config;
  std::optional<std::vector<DegreeConstraint>> constraints;
};
/// Lays out `tensors` (name, dtype, valid shape); `config` is the model's config.json without
/// quantization_config ("" when the checkpoint has none).
using ScatterLayoutOf = std::function<Result<ScatterLayout>(
    const std::vector<StoredTensor>& tensors, const std::string& config)>;

/// scatter --dequantize: the Hugging Face checkpoint at `full_dir` with its block-quantized
/// tensors as numbers of `options.dequantize->dtype` (DequantizedView; the ties from its
/// config.json's quantization_config), laid out by `layout` at the maps' world size, beside
/// config.json without quantization_config. Memory: the tensors being written.
Status ScatterDequantized(const std::string& full_dir, const ScatterLayoutOf& layout,
                          const std::string& out_dir, const CheckpointOptions& options);

/// Any checkpoint -> PyTorch Distributed Checkpoint saved for `world_size` ranks (WriteDcp:
/// its tensors as a convert opens them, optimizer state included unless weights_only).
Status WriteDcpCheckpoint(const std::string& path, const SourceOptions& source, int world_size,
                          const std::string& out_dir, const CheckpointOptions& options = {});
/// The same for the run `target` describes: saved for its world's ranks.
Status WriteDcpCheckpoint(const std::string& path, const SourceOptions& source,
                          const ParallelRun& target, const std::string& out_dir,
                          const CheckpointOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_FORMATS_FORMATS_H_
