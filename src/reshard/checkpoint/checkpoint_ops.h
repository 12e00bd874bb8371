// The checkpoint commands as library functions: scatter (full -> sharded), gather (sharded ->
// full) and convert (sharded -> sharded through transfer plans, never building F).
//
// All three stream: tensors are produced one at a time straight into the output file's write
// buffer, reading inputs through memory maps, so peak memory is set by the largest tensor (for
// gather, the largest full tensor; for scatter and convert, the largest shard), not by the
// checkpoint. Outputs appear atomically (OutputDirectory): a failure leaves nothing behind and
// an existing output is replaced only with `overwrite`. Inputs are opened read-only.
//
// Several processes may run one operation together (CheckpointOptions::communicator, see
// communicator.h): every process opens the input and plans the whole operation, then writes
// the output files it is given (balanced by bytes; a file is written by one process, which
// reads only the source data that file needs) into the temporary output directory process 0
// created; once every process has finished, process 0 writes the manifest (or index) and
// commits. The output is byte-identical to a one-process run. A failure in any process fails
// the operation in every process, and nothing is committed.
#ifndef RESHARD_CHECKPOINT_CHECKPOINT_OPS_H_
#define RESHARD_CHECKPOINT_CHECKPOINT_OPS_H_

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/communicator.h"
#include "reshard/exec/executor.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/degree_constraints.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

/// What one process of a checkpoint operation did.
struct ProcessStats {
  int rank = 0;
  /// The output files it wrote (the manifest or index, written by process 0, not included).
  std::vector<std::string> files;
  /// Tensor data bytes of those files.
  uint64_t bytes_written = 0;
  /// Source tensor bytes it read to produce them: the elements its copies move (convert: the
  /// plan's moves into its files; scatter: its shards' elements, or the whole tensor where
  /// padding is added; gather: each tensor's elements, read from one holder).
  uint64_t bytes_read = 0;
  /// Source tensor bytes it read to compare replicas: every copy of the replicated pieces of
  /// the parameters it compares (each parameter is compared by one process).
  uint64_t bytes_verified = 0;
  /// Of bytes_written, those the file system copied from an input file unchanged
  /// (CheckpointOptions::copy_file_ranges), never passing through this process's memory.
  uint64_t bytes_copied = 0;
};

/// What a checkpoint operation did: on process 0, every process's figures in rank order;
/// elsewhere this process's.
struct CheckpointStats {
  std::vector<ProcessStats> processes;
};

/// Dequantization on gather (DESIGN 20): every block-quantized tensor written as numbers of
/// `dtype`, its scales dropped.
struct DequantizeOptions {
  DType dtype = DType::kBF16;
  /// The scale tensors by name and their ties; empty: the ties the source's manifest records.
  std::map<std::string, BlockScales> ties;
};

struct CheckpointOptions {
  /// Replace an existing output directory.
  bool overwrite = false;
  /// Split each output (a full checkpoint, or each rank's files) into parts of at most this
  /// many bytes (a tensor larger than that gets a part of its own). 0: one file.
  uint64_t max_shard_bytes = 0;
  /// gather and convert: compare every replica against the first holder's data (P2) before
  /// writing anything.
  bool verify_replicas = true;
  /// Move tensors of scale power != 1 through scaled pieces anyway (see ExecOptions).
  bool allow_scaled_optimizer_state = false;
  /// Apply scales even where a value does not survive the round trip (see ExecOptions).
  bool allow_lossy_scale = false;
  int num_threads = 0;
  /// gather from a source that reads regions (Orbax): each tensor is read and written in bands
  /// of about this many bytes (whole stored chunk rows; ShardSource::RegionRows), two in memory.
  uint64_t band_bytes = uint64_t{16} << 20;
  /// Flush every output file and directory to disk before the output appears (DESIGN 7). Off
  /// (`--no-sync`), the output still appears by one rename, but is in the page cache only: a
  /// crash of the machine soon after may leave it incomplete, as `cp` would.
  bool sync = true;
  /// Let the file system copy what an output holds unchanged from an input (whole tensors,
  /// whole experts, row blocks) with copy_file_range(2): reflinks where it has them, and no
  /// pass through this process's memory. Off: every byte is copied through memory; the output
  /// is the same byte for byte.
  bool copy_file_ranges = true;
  /// Called after each tensor with the bytes written so far and the total to write.
  std::function<void(uint64_t done, uint64_t total)> progress;
  /// With allow_lossy_scale, called once per parameter that is moved through a scale (or a
  /// ratio of scales) that is not a power of two: its values are rounded, so the round trip is
  /// not bit-exact.
  std::function<void(const std::string& parameter, const std::string& message)> warn;
  /// scatter: what the model's plan requires of the world size, recorded in the manifest;
  /// convert carries them over and, building target maps from the recorded layouts, refuses a
  /// world size that breaks one.
  std::vector<DegreeConstraint> degree_constraints;
  /// scatter: the model's config.json (JSON text) to record in the manifest; convert carries
  /// the source's over.
  std::string model_config;
  /// The processes running this operation together (all of them call it with the same
  /// arguments); null: this process alone. `progress` then reports, on process 0, the whole
  /// job's bytes written; other processes report nothing.
  Communicator* communicator = nullptr;
  /// When set, receives what the run did (also when it fails after writing began).
  CheckpointStats* stats = nullptr;
  /// gather: dequantize block-quantized tensors (DequantizeOptions); scatter and convert
  /// dequantize through DequantizedView.
  std::optional<DequantizeOptions> dequantize;
  /// scatter and convert: the config.json written beside the shards instead of a copy of the
  /// input's ("": copied), e.g. a dequantized model's, without quantization_config.
  std::string output_config;
  /// scatter: the scale tensors of block-quantized tensors and their ties, recorded in the
  /// manifest (Manifest::block_scales).
  std::map<std::string, BlockScales> block_scales;
  /// convert --to universal: tensors of the input to leave out, by the names the input gives
  /// them (a DCP key, a Megatron Hugging Face name), where the universal checkpoint cannot hold
  /// them (a buffer, a parameter's state it has no file for), which are refused otherwise. A
  /// name the input does not hold is refused.
  std::vector<std::string> drop;
};

/// A tensor's layout for scatter: its map at the target world size, and the descriptor it came
/// from (recorded in the manifest so the checkpoint can be converted later), if any.
struct ProvidedMap {
  ParamMap map;
  std::optional<LayoutDescriptor> layout;
  /// The provider names this tensor itself (a map document, a model's whole-checkpoint
  /// layout), rather than giving a default: ResolveMap then takes it as it is for an optimizer
  /// state too (whose map may differ from its parameter's, e.g. a buffer of its own).
  bool exact = false;
};

/// Gives scatter the map of a tensor (name, shape as stored in the full checkpoint).
/// NotFound when the tensor has no layout.
using MapProvider = std::function<Result<ProvidedMap>(const std::string& name, const Shape& shape)>;

/// The maps `maps` gives the parameters of `m` (by name and valid shape), with `buffers`, as one
/// document (convert's target maps for a scatter that reads through a view).
/// \error FailedPrecondition  a parameter with no map, or buffers that do not fit the maps
Result<MapDocument> DocumentOfMaps(const MapProvider& maps, const BufferSetBuilder& buffers,
                                   const Manifest& m);

/// A tensor's map for scatter and the scale power it is stored with.
struct ResolvedMap {
  ProvidedMap provided;
  int scale_power = 1;
  /// An optimizer state that took its parameter's map (scatter puts it in buffers of its own
  /// when that map is buffered: "<buffer>.exp_avg").
  bool inherited = false;
};

/// The optimizer-state convention, which holds however a provider matches names (a "*"
/// default included): a tensor named "<param>.exp_avg" or "<param>.exp_avg_sq" has scale power
/// -1 or -2, "<param>.fp32" (the optimizer's fp32 main weight) power 1, and each takes
/// <param>'s map (what `maps` gives for <param> at the tensor's shape),
/// unless the provider names the state itself (ProvidedMap::exact); only when `maps` has
/// nothing for <param> does it take its own. Any other tensor takes its own map at scale
/// power 1. NotFound when there is no map.
Result<ResolvedMap> ResolveMap(const MapProvider& maps, const std::string& name,
                               const Shape& shape);

/// Maps by name from a map document (exact names).
MapProvider MapsFromDocument(const MapDocument& doc);

/// Maps from layout descriptors by name at `world_size`; the key "*", when present, is the
/// descriptor of every tensor not named.
MapProvider MapsFromLayouts(std::map<std::string, LayoutDescriptor> layouts, int world_size);

/// Sharded parameters as gather and convert read them, from any directory format: a reshard
/// sharded checkpoint, or a framework's checkpoint whose shards are assembled on demand.
class ShardSource {
 public:
  virtual ~ShardSource() = default;
  /// The parameters, each with its map, dtype, layout and scale power, and the world size and
  /// degree constraints (`files` is empty).
  virtual const Manifest& manifest() const = 0;
  /// Every rank's shard of manifest().params[i] (world_size dense buffers, each of the map's
  /// shard size), valid until the matching ReleaseShards(i). Thread-safe; calls nest (each
  /// Acquire is matched by one Release).
  virtual Result<std::vector<ConstBuffer>> AcquireShards(size_t i) = 0;
  virtual void ReleaseShards(size_t i) = 0;
  /// The paths it reads, which an output may not be, contain or lie inside.
  virtual std::vector<std::string> inputs() const = 0;
  /// Whether ReadRegion reads its parameters: a source whose stored chunks are read straight
  /// into any box of a full tensor (Orbax's zarr chunks), so that a consumer needing one box (a
  /// gather's tensor, a DCP chunk, a universal file, a convert's target shard that is a box)
  /// holds that box and one stored chunk rather than every shard. Its shards hold no replicas
  /// to compare and no scaled pieces.
  virtual bool ReadsRegions() const { return false; }
  /// The box [offsets, offsets + sizes) of parameter i's full tensor (valid shape, elements)
  /// into `out` (product(sizes) elements of its dtype, row-major): the values a Rebuild of
  /// its shards gives there, read on up to `threads` threads (this one among them).
  /// Unimplemented unless ReadsRegions().
  virtual Status ReadRegion(size_t i, const Shape& offsets, const Shape& sizes,
                            std::span<std::byte> out, int threads) {
    (void)i, (void)offsets, (void)sizes, (void)out, (void)threads;
    return UnimplementedError("this source reads whole shards, not regions");
  }
  /// How many rows (first dimension) of parameter i a consumer reading it by bands of about
  /// `band_bytes` should read together so that each stored chunk is decoded once: whole chunk
  /// rows, as many as fit in band_bytes (at least one chunk row); 0: no preference.
  virtual Index RegionRows(size_t i, uint64_t band_bytes) const {
    (void)i, (void)band_bytes;
    return 0;
  }
  /// The boxes (offsets, sizes) of parameter i's stored chunks, which tile its full tensor:
  /// each read by one ReadRegion decodes that chunk alone. Empty: not known (or not stored
  /// in chunks).
  virtual std::vector<std::pair<Shape, Shape>> StoredChunks(size_t i) const {
    (void)i;
    return {};
  }
};

/// Acquires parameter i's shards from a source and releases them when it goes out of scope
/// (status() says whether the acquire succeeded).
class AcquiredShards {
 public:
  AcquiredShards(ShardSource& source, size_t i) : source_(source), i_(i) {
    Result<std::vector<ConstBuffer>> shards = source.AcquireShards(i);
    if (shards.ok()) {
      shards_ = *std::move(shards);
    } else {
      status_ = shards.status();
    }
  }
  ~AcquiredShards() {
    if (status_.ok()) source_.ReleaseShards(i_);
  }
  AcquiredShards(const AcquiredShards&) = delete;
  AcquiredShards& operator=(const AcquiredShards&) = delete;
  const Status& status() const { return status_; }
  const std::vector<ConstBuffer>& shards() const { return shards_; }

 private:
  ShardSource& source_;
  size_t i_;
  Status status_;
  std::vector<ConstBuffer> shards_;
};

/// The shards of a ShardSource that reads them into memory of its own: each parameter's read
/// once, on its first Acquire, and kept until its last Release (thread-safe).
class ShardCache {
 public:
  /// Fills `data`, one byte vector per rank of the parameter's map (given sized to its world,
  /// each empty); an error leaves nothing cached. Runs under the cache's lock.
  using Reader = std::function<Status(std::vector<std::vector<std::byte>>& data)>;

  /// Parameter i's shards under `map` (each rank's `shard_num_elements`), read by `read` unless
  /// an earlier Acquire still holds them.
  Result<std::vector<ConstBuffer>> Acquire(size_t i, const ParamMap& map, const Reader& read);
  void Release(size_t i);

 private:
  struct Entry {
    int users = 0;
    std::vector<std::vector<std::byte>> data;  // per rank
  };
  std::mutex mu_;
  std::map<size_t, Entry> cache_;
};

/// A reshard sharded checkpoint as a source (its shards: views of its mapped files).
std::unique_ptr<ShardSource> SourceOfShardedDir(std::string dir,
                                                std::shared_ptr<const ShardedCheckpoint> ckpt);

/// A full (Hugging Face) checkpoint as a source at world size 1: each tensor is one rank's
/// whole shard, with no recorded layout (converting it takes target maps).
Result<std::unique_ptr<ShardSource>> SourceOfFullDir(std::string dir,
                                                     std::shared_ptr<const FullCheckpoint> ckpt);

/// What a dequantized view records in its manifest instead of its source's (nullopt: the
/// source's): the model's config.json without quantization_config, and that plan's constraints.
struct DequantizedManifest {
  std::optional<std::string> model_config;
  std::optional<std::vector<DegreeConstraint>> constraints;
};

/// `inner` with its block-quantized tensors read as numbers (DESIGN 20), for a scatter or a
/// convert that dequantizes: the ties of `options.dequantize` (else those `inner`'s manifest
/// records) say which; each quantized tensor becomes one of `options.dequantize->dtype`, held
/// whole by rank 0 (the others hold none of it), under its data tensor's name (gpt-oss's
/// `X_blocks` becomes `X` [E, G * 32, R]) and layout, its scales dropped. A dequantized tensor is
/// made at its first acquire and freed at its last release. `inner` must outlive the view.
/// \error FailedPrecondition  a tie that names a tensor the source lacks, or a format it does
///        not store (as gather --dequantize says)
Result<std::unique_ptr<ShardSource>> DequantizedView(ShardSource& inner,
                                                     const CheckpointOptions& options,
                                                     const DequantizedManifest& recorded = {});

/// A file to place in a gathered checkpoint beside the tensors (e.g. the model's config.json).
struct ExtraFile {
  std::string name;      // in the output directory
  std::string contents;  // bytes
};

/// Gather from any source: the full tensors (valid region) as model.safetensors, or parts and
/// an index, plus `extra_files`. With several processes, every process passes a source of
/// the same input.
Status GatherFrom(ShardSource& source, const std::string& out_dir,
                  const CheckpointOptions& options = {},
                  const std::vector<ExtraFile>& extra_files = {});

/// Convert from any source (see Convert).
Status ConvertFrom(ShardSource& source, int world_size,
                   const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                   const CheckpointOptions& options = {});

/// Full checkpoint -> sharded checkpoint at the maps' world size. Padding (a padded
/// vocabulary) is filled with zeros. FailedPrecondition when a map does not fit its tensor.
Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const std::string& out_dir, const CheckpointOptions& options = {});
/// Scatter into buffers (DESIGN.md 16): the maps may put ranks' pieces in the buffers
/// declared here, which each rank's files then hold; FailedPrecondition when the buffers and
/// maps do not fit (BufferSetBuilder::Finalize).
Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const BufferSetBuilder& buffers, const std::string& out_dir,
               const CheckpointOptions& options = {});

/// Sharded checkpoint -> full checkpoint (model.safetensors, or parts and an index with
/// max_shard_bytes), verifying replicas unless told not to, dropping padding.
Status Gather(const std::string& sharded_dir, const std::string& out_dir,
              const CheckpointOptions& options = {});

/// Sharded checkpoint -> sharded checkpoint at `world_size`, through transfer plans. Target
/// maps come from `target_maps` (by parameter name) or, when absent, from the layout
/// descriptors recorded in the manifest.
Status Convert(const std::string& sharded_dir, int world_size,
               const std::optional<MapDocument>& target_maps, const std::string& out_dir,
               const CheckpointOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_CHECKPOINT_OPS_H_
