// Checkpoint directories (DESIGN.md 6.5).
//
// Full (what Hugging Face transformers, vLLM and friends load):
//   model.safetensors
//   or model-00001-of-0000N.safetensors ... plus model.safetensors.index.json:
//     {"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {name: file}}
//
// Sharded (reshard's own):
//   reshard.json                              the manifest
//   model-rank-{r}-part-{p}.safetensors       rank r's shards (the naming vLLM's
//                                             sharded-state loader uses)
//   reshard.json: {"format": "reshard", "version": 1, "world_size": N,
//                  "files": {"<rank>": [file, ...]},
//                  "constraints": [{"module": "layers.*.self_attn.k_proj", "style": "colwise",
//                                   "count": 2, "meaning": "key/value heads"}, ...]?,
//                  "params": {"<name>": {"dtype": "BF16", "map": <param map>,
//                                        "layout": <layout descriptor>?, "scale_power": -1?}}}
//   Each rank's files hold one tensor per parameter, named like the parameter, of the map's
//   shard shape (a rank with nothing stores a zero-element tensor).
//   Version 2 adds buffers (DESIGN.md 16): "buffers": {"<name>": {"dtype", "ranks": {"<r>":
//   {"shape", "padding"?}}}} as in a map document (ir/map_json.h). A parameter whose map puts
//   rank r's pieces in buffer B has no tensor of its own in rank r's files; rank r's files
//   hold B (named B, of its shape on r), which the pieces of every map over it fill exactly.
//   A buffer may not share its name with a parameter that has a tensor of its own.
//   "model_config": {<config.json>}? is the model's config, kept by scatter --config. `scale_power`
//   (default 1) says how the map's scales apply to the tensor: the shard holds F * scale^p (weights
//   1, Adam's first moment -1, second moment -2). `layout` lets the checkpoint be re-laid out at
//   another world size. `constraints` (from the model's tensor-parallel plan, when the
//   checkpoint was scattered from a config.json) are the counts every world size must divide;
//   a conversion refuses a world size that breaks one.
#ifndef RESHARD_CHECKPOINT_CHECKPOINT_H_
#define RESHARD_CHECKPOINT_CHECKPOINT_H_

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/result.h"
#include "reshard/io/safetensors.h"
#include "reshard/ir/block_grid.h"
#include "reshard/ir/buffer_set.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/degree_constraints.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

inline constexpr char kManifestName[] = "reshard.json";
inline constexpr int kManifestVersion = 1;
/// The version of manifests with buffers.
inline constexpr int kBufferedManifestVersion = 2;

/// One parameter of a sharded checkpoint.
struct ShardedParam {
  std::string name;
  DType dtype;
  ParamMap map;
  std::optional<LayoutDescriptor> layout;
  int scale_power = 1;
};

struct Manifest {
  int world_size = 0;
  std::vector<std::vector<std::string>> files;  // per rank
  std::vector<ShardedParam> params;             // in file order
  std::vector<DegreeConstraint> constraints;    // what the model's plan requires of world_size
  BufferSet buffers;                            // validated with the params' maps
  /// The model's config.json (JSON text, "" when unknown): recorded by scatter --config so
  /// that convert can lay the model out at another topology from its plans.
  std::string model_config;
  /// The scales of block-quantized tensors, by the scale parameter's name: the data they
  /// scale and the block (DESIGN 20). Their maps are the block images of the data's maps
  /// (checked when a manifest is read, CheckBlockTies).
  std::map<std::string, BlockScales> block_scales;
};

/// Checks every block tie of `m`: both parameters exist, and the scales' map is the block image
/// of the data's map. FailedPrecondition naming both tensors.
Status CheckBlockTies(const Manifest& m);

/// One tensor of a rank's files: a parameter's own shard, or a buffer that several
/// parameters' pieces fill.
struct RankTensor {
  std::string name;
  DType dtype;
  Shape shape;
  /// The parameters (indices into Manifest::params) whose pieces it holds, in manifest order.
  std::vector<size_t> params;
  /// The buffer's declaration; null for a parameter's own shard.
  const BufferDecl* buffer = nullptr;
};

/// The tensors of rank `rank`'s files, in manifest order (a buffer where its first parameter
/// is). Pointers into `m`.
std::vector<RankTensor> RankTensorsOf(const Manifest& m, Rank rank);

/// Bytes of parameter `p`'s data on rank `r`: its shard, or its pieces of a buffer.
uint64_t HeldBytes(const ShardedParam& p, Rank r);

/// The file name of part `part` of rank `rank`: "model-rank-{r}-part-{p}.safetensors".
std::string ShardFileName(Rank rank, int part);

/// Strict parse of reshard.json (InvalidArgument with the JSON path; maps validated, an
/// invalid one is FailedPrecondition).
Result<Manifest> ParseManifestJson(std::string_view text);
/// Whether `text` is meant as a manifest: a JSON object whose "format" is "reshard" (it may
/// still be a malformed one; ParseManifestJson says).
bool IsManifestJson(std::string_view text);
std::string ManifestToJson(const Manifest& manifest);
/// Checks `buffers` against the parameters' maps and dtypes (BufferSetBuilder::Finalize) and
/// stores the validated set in `m.buffers`; FailedPrecondition when they do not fit.
Status ValidateManifestBuffers(Manifest& m, const BufferSetBuilder& buffers);

/// A tensor of an opened checkpoint: its header entry and its (memory-mapped) bytes.
struct TensorRef {
  const TensorInfo* info = nullptr;
  std::span<const std::byte> data;
  size_t file = 0;      // the file holding it: an index into file_paths()
  uint64_t offset = 0;  // where `data` begins in that file
};

/// A full checkpoint opened read-only: single file or index + parts, headers validated, the
/// weight map checked against the files (every listed tensor present in its file, no tensor
/// twice, none unlisted).
class FullCheckpoint {
 public:
  static Result<FullCheckpoint> Open(const std::string& dir);
  const std::vector<TensorRef>& tensors() const { return tensors_; }
  const TensorRef* Find(const std::string& name) const;
  uint64_t total_bytes() const;
  /// The paths of the files it reads.
  std::vector<std::string> file_paths() const;

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t> by_name_;
};

/// A sharded checkpoint opened read-only: the manifest and every rank's shard of every
/// parameter, the files checked against the manifest before any data is read: each rank's
/// files hold exactly one tensor per parameter, of the manifest's dtype and the rank's shard
/// shape, and nothing else (a tensor the manifest does not list is refused, not skipped); no
/// file is listed twice or serves two ranks, by name or by identity (links). DataLoss naming
/// the file, the rank and the parameter otherwise.
class ShardedCheckpoint {
 public:
  static Result<ShardedCheckpoint> Open(const std::string& dir);
  const Manifest& manifest() const { return manifest_; }
  /// The bytes of rank `rank`'s shard of parameter `param` (an index into manifest().params):
  /// the whole buffer when the map puts that rank's pieces in one.
  std::span<const std::byte> shard(size_t param, Rank rank) const {
    return shards_[param][static_cast<size_t>(rank)];
  }
  uint64_t total_bytes() const;
  /// The paths of the files it reads (shard files; the manifest is read at Open).
  std::vector<std::string> file_paths() const;

 private:
  Manifest manifest_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::vector<std::vector<std::span<const std::byte>>> shards_;  // [param][rank]
};

/// Parses "5GB", "500MB", "1.5GiB", "1048576" into bytes (decimal units as transformers' and
/// safetensors' tools use them: 1 GB = 10^9 bytes; GiB = 2^30).
Result<uint64_t> ParseByteSize(std::string_view text);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_CHECKPOINT_H_
