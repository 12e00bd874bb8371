// PyTorch Distributed Checkpoints (torch.distributed.checkpoint, "DCP"), read without running
// code: what FSDP2, TorchTitan and Megatron-Core's torch_dist save.
//
// A DCP directory holds
//   .metadata              a pickle of torch's `Metadata` dataclass (or, when every rank saved
//                          on its own, one `__{r}.metadata` per rank, each listing its items)
//   __{r}_{n}.distcp       the data rank r wrote (file n of its writer threads)
// `Metadata.state_dict_metadata` maps each key (the flattened state-dict path, dotted) to a
// `TensorStorageMetadata` (dtype in `TensorProperties`, the global `size`, and `chunks`: boxes
// `offsets` + `sizes` of the global tensor) or a `BytesStorageMetadata` (any other object,
// torch.save'd). `Metadata.storage_data` maps a `MetadataIndex(fqn, offset)` (offset: the chunk's
// offsets; none for bytes) to a `_StorageInfo(relative_path, offset, length,
// transform_descriptors?)`: the item is the bytes [offset, offset + length) of that file, a
// whole torch.save archive of the chunk's tensor (zip offsets relative to the item), or the
// object's bytes; `transform_descriptors` ["stream.zstd/1"] says the item is a zstd stream of
// those bytes. `planner_data` maps each key to its path in the original nested state dict.
//
// The pickle is read by the inert pickle machine (io/pickle.h) with an allowlist of DCP's own
// records (DcpPickleClasses); anything else refuses the file.
//
// The Hugging Face storage variant (torch's HuggingFaceStorageWriter with save_distributed):
// `shard-{r+1:05}-model-{i:05}-of-{n:05}.safetensors` files (in the directory or in its
// `sharded/` folder), each tensor a chunk of the fqn it is named by, its offsets in the
// `DCP_SHARDING_INFO` metadata entry (JSON: {fqn: {"saved_offsets": [...]}}).
//
// Chunks are boxes of the global tensor: each is one piece of a param map (ChunksToMap), held
// by the rank that wrote it; a rank's shard is its chunks, in order, each row-major.
#ifndef RESHARD_CHECKPOINT_DCP_DCP_H_
#define RESHARD_CHECKPOINT_DCP_DCP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/source.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

/// Where an item's bytes are: [offset, offset + length) of file `file` (an index into
/// DcpCheckpoint::files()).
struct DcpItemLocation {
  size_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  /// The stream transforms, in the order they were applied ("stream.zstd/1"); empty: none.
  std::vector<std::string> transforms;
};

/// One box of a tensor: `sizes` elements along each dim from `offsets` (both of the tensor's
/// rank; a 0-d tensor's one chunk has empty offsets and sizes).
struct DcpChunk {
  Shape offsets;
  Shape sizes;
  Rank rank = 0;  // the writing rank (from the file's name `__{r}_*`)
  DcpItemLocation location;
};

struct DcpTensor {
  std::string fqn;
  /// The key's path in the nested state dict (planner_data), as text: str keys as they are,
  /// ints in decimal. The key's dotted parts when the checkpoint does not record one.
  std::vector<std::string> path;
  /// Parallel to `path`: which elements are ints in planner_data (list indices).
  std::vector<bool> path_is_index;
  /// Whether planner_data records the path (of str and int elements only).
  bool path_recorded = false;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<DcpChunk> chunks;  // in metadata order
  /// Under the optimizer's key (see IsDcpOptimizerState).
  bool optimizer_state = false;
};

/// A non-tensor value: the bytes of a torch.save'd object (shown inert, never loaded).
struct DcpBytesItem {
  std::string fqn;
  std::vector<std::string> path;    // as DcpTensor's
  std::vector<bool> path_is_index;  // as DcpTensor's
  bool path_recorded = false;       // as DcpTensor's
  Rank rank = 0;
  DcpItemLocation location;
};

/// The metadata of a DCP checkpoint as read from one `.metadata` pickle.
struct DcpMetadata {
  std::string version;  // Metadata.version ("1.0.0"; empty in older files)
  std::string save_id;  // Metadata.storage_meta.save_id ("" when none)
  std::vector<DcpTensor> tensors;
  std::vector<DcpBytesItem> bytes_items;
  /// The files the items name (relative paths, in first-use order); locations index it.
  std::vector<std::string> files;
};

/// The Metadata.version values torch writes: none (torch before 2.4, and writers that leave it
/// unset) and "1.0.0" (FileSystemWriter from torch 2.4 on).
inline constexpr std::string_view kDcpVersions[] = {"", "1.0.0"};

/// "module.name" of every class and function a DCP `.metadata` pickle may name beyond the
/// reader's built-in allowlist: torch.distributed.checkpoint's metadata, planner and filesystem
/// records, older torch's `_shard` metadata, pathlib paths, torch layouts and memory formats,
/// and Megatron-Core's planner records. Read as inert records only.
const std::vector<std::string>& DcpPickleClasses();

/// Reads a `.metadata` pickle (`bytes`), with up to 2^25 objects and memo entries (a large
/// job's metadata lists millions of chunks). `name` names the file in errors. Ranks come from the
/// item files' names (`__{r}_{n}.distcp`; a file named otherwise gets a rank of its own after
/// the highest). InvalidArgument for a global outside the allowlist; DataLoss for a malformed
/// pickle, records that are not what torch writes (naming the key and field), a version torch
/// does not write (kDcpVersions) or an item file that is not a plain name (a "/", a NUL). Chunks
/// are not yet checked against each other (ChunksToMap does).
Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, std::string_view name);

/// Whether a key is optimizer state: its first path element up to a dot (the top-level
/// state-dict key, also where a writer records flat keys as one-element paths) is
/// "optim", "optimizer" or "optimizers" (FSDP2's get_state_dict saved as {"model", "optim"},
/// TorchTitan's "optimizer", Megatron's "optimizer"), or Megatron's "chained_{i}.optimizer."
/// (a chain of optimizers).
bool IsDcpOptimizerState(std::span<const std::string> path);

/// The param map of a tensor of shape `shape` from its chunks, at `world_size` ranks: chunk c
/// is a piece of rank chunks[c].rank (source: the box in the global tensor, row-major; dest: the
/// next elements of the rank's 1-D shard). The same box written by several ranks (a replicated
/// tensor saved without DCP's deduplication, as per-rank saves do) is one piece they hold
/// together (locations: those ranks). Empty chunks are skipped; a rank without chunks has an
/// empty shard. InvalidArgument (naming `what`, the chunk and its box) for a chunk of the wrong
/// rank, outside the tensor, repeated on one rank, overlapping another box, or a tensor not
/// exactly covered.
Result<ParamMap> ChunksToMap(std::string_view what, const Shape& shape,
                             std::span<const DcpChunk> chunks, int world_size);

/// A DCP checkpoint directory opened read-only: its metadata read and checked (every item's
/// file present and the item inside it, every tensor's chunks cover it exactly once), its data
/// files mapped. Items are read when asked (ReadChunk), so opening costs the metadata only.
class DcpCheckpoint {
 public:
  /// `dir`: a DCP directory (`.metadata` or `__{r}.metadata`), or the HF-storage variant.
  /// Errors name the file, the key and the chunk.
  static Result<std::shared_ptr<const DcpCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  /// "torch_save" (.distcp items) or "safetensors" (the HF-storage variant).
  std::string_view storage() const { return storage_; }
  const DcpMetadata& metadata() const { return metadata_; }
  const std::vector<DcpTensor>& tensors() const { return metadata_.tensors; }
  const std::vector<DcpBytesItem>& bytes_items() const { return metadata_.bytes_items; }
  /// The writing ranks: one more than the highest rank of any item.
  int world_size() const { return world_size_; }
  /// The param map of tensors()[i] at world_size() (validated at Open).
  const ParamMap& map(size_t i) const { return maps_[i]; }
  /// Absolute paths of the files it reads (metadata and data).
  std::vector<std::string> file_paths() const;

  /// The elements of chunk `c` of tensors()[t], row-major: a view into the mapped file when
  /// the item holds them contiguously, else copied (a strided view, a zstd item) into `owned`,
  /// which the result then points into. DataLoss (naming the file, the key and the chunk) for
  /// an item that is not a torch.save archive of one tensor of the chunk's dtype and sizes.
  Result<std::span<const std::byte>> ReadChunk(size_t t, size_t c,
                                               std::vector<std::byte>& owned) const;
  /// The raw bytes of bytes_items()[i] (decompressed into `owned` when transformed).
  Result<std::span<const std::byte>> ReadBytesItem(size_t i, std::vector<std::byte>& owned) const;
  /// The bytes of bytes_items()[i] as stored (its transforms not undone): a view into the
  /// mapped file.
  std::span<const std::byte> StoredBytesItem(size_t i) const;
  /// Drops the mapped pages of chunk `c` of tensors()[t] (streaming keeps memory flat).
  void ReleaseChunk(size_t t, size_t c) const;

 private:
  DcpCheckpoint() = default;
  Result<std::span<const std::byte>> ItemBytes(const DcpItemLocation& loc, std::string_view what,
                                               uint64_t max_bytes,
                                               std::vector<std::byte>& owned) const;
  std::string dir_;
  std::string storage_;
  std::vector<std::string> metadata_files_;
  DcpMetadata metadata_;
  int world_size_ = 0;
  std::vector<ParamMap> maps_;
  struct File;
  std::vector<std::shared_ptr<File>> files_;  // parallel to metadata_.files
};

/// Whether `path` is a directory that looks like a DCP checkpoint (by file names only:
/// `.metadata`, `__0.metadata`, or `shard-*-model-*-of-*.safetensors` in it or in `sharded/`).
bool IsDcpCheckpoint(const std::string& path);

/// What Open found, for `reshard inspect`: every tensor (dtype, global shape, its chunks: box,
/// rank, file and bytes, and whether it is optimizer state) and every bytes item, shown inert
/// (its object's plain value when the item is a torch.save archive of plain data, else what it
/// is). Text for a person; JSON as docs/formats.md describes ("dcp" of `inspect --json`).
std::string DcpSummaryText(const DcpCheckpoint& c);
std::string DcpSummaryJson(const DcpCheckpoint& c);

struct DcpSourceOptions {
  /// Leave out the optimizer state (IsDcpOptimizerState).
  bool weights_only = false;
};

/// The layout a DCP tensor takes at another world size when nothing else says (convert's
/// default): rows split along dim 0 as DTensor's Shard(0) does (torch.chunk: ceil(rows / N) per
/// rank, a short or empty last rank); a 0-d tensor replicated.
LayoutDescriptor DcpDefaultLayout(const Shape& shape);

/// The checkpoint's tensors as a ShardSource for GatherFrom / ConvertFrom: one parameter per
/// tensor (named by its fqn, the map of ChunksToMap, layout DcpDefaultLayout), world size = the
/// writing ranks. A rank's shard is a view into the file when it is one contiguous chunk, else is
/// assembled per acquire (memory: the tensors being worked on).
std::unique_ptr<ShardSource> DcpSource(std::shared_ptr<const DcpCheckpoint> ckpt,
                                       const DcpSourceOptions& options = {});

/// The options a DCP checkpoint takes (the table of formats' check): InvalidArgument for the
/// master weights (DeepSpeed's), a config.json or a distributed config (DCP names and shapes
/// its tensors itself), and weights_only on a gather (which writes the model's tensors only).
Status CheckDcpOptions(const std::string& path, const SourceOptions& options);

/// The state dict's structure of `ckpt` (DcpStateDict), for a DCP output: each tensor's path
/// (planner_data, else its key alone) and every bytes item, its stored bytes as they are (a key
/// stored by several ranks, as per-rank saves store it: the lowest rank's copy); with
/// `weights_only`, neither of the optimizer's (IsDcpOptimizerState).
std::shared_ptr<const StateDictStructure> DcpStateDict(
    const std::shared_ptr<const DcpCheckpoint>& ckpt, bool weights_only);

/// A DCP checkpoint opened for `options.use` (the table of formats' opener): a gather takes the
/// model's tensors (IsDcpOptimizerState's keys left out of the Hugging Face files); a convert
/// takes every tensor, optimizer state included unless `weights_only`, each with its
/// DcpDefaultLayout recorded so that convert needs no target maps, and the state dict's
/// structure (DcpStateDict) for a DCP output.
Result<OpenedCheckpoint> OpenDcp(const std::string& path, const SourceOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DCP_DCP_H_
