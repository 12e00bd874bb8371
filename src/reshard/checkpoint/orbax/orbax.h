// Orbax checkpoints (orbax.checkpoint's PyTreeCheckpointHandler), read without JAX: what JAX
// trainers (MaxText, Tunix, Levanter, Gemma) save.
//
// A checkpoint root holds step directories (`<step>/`, each with `_CHECKPOINT_METADATA`); a step
// holds items (`default/`, `items/`, `model_params/`, `state/`...), each an item directory:
//   _METADATA            JSON: "tree_metadata" maps each leaf (its key tuple as text) to
//                        "key_metadata" (the path: [{"key", "key_type": 1 sequence, 2 dict}])
//                        and "value_metadata" ({"value_type": "jax.Array" | "np.ndarray" |
//                        "scalar" | ..., "write_shape"}); "use_ocdbt", "use_zarr3"
//   _sharding            JSON: base64(param name) -> the JSON text of the leaf's sharding:
//                        {"sharding_type": "NamedSharding", "shape" (the mesh's), "axis_names",
//                        "partition_spec" (per dimension null, an axis, or a list of axes),
//                        "device_mesh": {"mesh": nested lists of {"id": device id}}}
//   array_metadatas/process_<i>  JSON: {"array_metadatas": [{"array_metadata": {"param_name",
//                        "write_shape", "chunk_shape"}}]}
//   the arrays           zarr arrays named by the param name (the leaf's path joined with
//                        "."): keys `<name>/.zarray`, `<name>/0.0` (zarr v2) or
//                        `<name>/zarr.json`, `<name>/c/0/0` (zarr v3) of an OCDBT database
//                        (`manifest.ocdbt` + `d/`, merged from `ocdbt.process_<i>/`, or only
//                        those per-process databases when the merge was skipped), or files of
//                        those names in the item directory without OCDBT.
//
// Each device of a NamedSharding holds one box of the array: along each dimension split over
// mesh axes (a, b, ...), shard index = the device's coordinates on them (a major), shard size =
// ceil(extent / shards), the last shards short or empty. Devices with the same box hold it
// together. Ranks are the devices, numbered in the order of their ids.
#ifndef RESHARD_CHECKPOINT_ORBAX_ORBAX_H_
#define RESHARD_CHECKPOINT_ORBAX_ORBAX_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/orbax/ocdbt.h"
#include "reshard/checkpoint/orbax/zarr.h"
#include "reshard/checkpoint/source.h"
#include "reshard/ir/param_map.h"
#include "reshard/layouts/parallel_run.h"

namespace reshard {

/// A leaf's NamedSharding.
struct OrbaxSharding {
  std::string type;  // "NamedSharding", or another type recorded (held whole by one device)
  Shape mesh_shape;
  std::vector<std::string> axis_names;
  /// Per array dimension, the mesh axes it is split over (empty: not split).
  std::vector<std::vector<std::string>> spec;
  /// The device ids, row-major over mesh_shape.
  std::vector<int64_t> device_ids;
};

/// One array of the pytree.
struct OrbaxArray {
  /// Its path joined with "." (Orbax's param name): the name gather writes.
  std::string name;
  std::vector<std::string> path;
  std::vector<bool> path_is_index;  // parallel to path: a sequence index
  std::string value_type;
  Shape write_shape;  // as _METADATA records it; empty when it does not
  ZarrArray zarr;
  std::optional<OrbaxSharding> sharding;
  /// Under an optimizer's key ("opt_state", "optimizer", "optimizer_state", "opt").
  bool optimizer_state = false;
};

/// An Orbax checkpoint opened read-only: its metadata read and checked, every array's chunks
/// found, its maps built. Chunks are read when asked.
class OrbaxCheckpoint {
 public:
  /// `path`: a checkpoint root (its newest step is read), a step directory (all of its items;
  /// their names prefix the arrays' when there are several) or an item directory. Errors name
  /// the file and the leaf: DataLoss for malformed metadata or storage, NotFound for a missing
  /// file, FailedPrecondition for a valid checkpoint reshard does not read (a codec it lacks).
  static Result<std::shared_ptr<const OrbaxCheckpoint>> Open(const std::string& path);

  /// The item directories read (one per item).
  const std::vector<std::string>& items() const { return items_; }
  const std::string& path() const { return path_; }
  /// "ocdbt+zarr2", "ocdbt+zarr3", "zarr2", "zarr3" (per item; the first item's).
  const std::string& storage() const { return storage_; }
  const std::vector<OrbaxArray>& arrays() const { return arrays_; }
  /// Leaves that are not arrays (strings, None...), by name and value type: left out.
  const std::vector<std::pair<std::string, std::string>>& others() const { return others_; }
  /// The devices (ids, ascending): rank r is device device_ids()[r].
  const std::vector<int64_t>& device_ids() const { return device_ids_; }
  int world_size() const { return static_cast<int>(std::max<size_t>(device_ids_.size(), 1)); }
  /// The param map of arrays()[i] at world_size().
  const ParamMap& map(size_t i) const { return maps_[i]; }
  /// The box of rank `rank`'s shard of arrays()[i] (offsets, sizes); sizes empty (0-d) or all
  /// zero for a rank without one.
  std::pair<Shape, Shape> Box(size_t i, Rank rank) const;
  /// The files it reads.
  std::vector<std::string> inputs() const;

  /// Reads the box (offsets, sizes) of arrays()[i] into `out` (its elements row-major): from
  /// every chunk it overlaps, decoded on up to `threads` threads (this one among them), each
  /// holding one decoded chunk. DataLoss for a chunk that does not decode.
  Status ReadBox(size_t i, const Shape& offsets, const Shape& sizes, std::span<std::byte> out,
                 int threads = 1) const;

 private:
  OrbaxCheckpoint() = default;
  struct Item;
  Status OpenItem(const std::string& dir, const std::string& prefix);
  Status BuildMaps();
  std::string path_;
  std::string storage_;
  std::vector<std::string> items_;
  std::vector<OrbaxArray> arrays_;
  std::vector<size_t> item_of_;  // per array, an index into items_data_
  std::vector<std::shared_ptr<Item>> items_data_;
  std::vector<std::pair<std::string, std::string>> others_;
  std::vector<int64_t> device_ids_;
  std::vector<ParamMap> maps_;
  std::vector<std::vector<std::pair<Shape, Shape>>> boxes_;  // per array, per rank
};

/// Whether `path` looks like an Orbax checkpoint root, step or item (by file names only:
/// `_METADATA` or `_CHECKPOINT_METADATA` in it, or in a directory inside it, or in one inside
/// that).
bool IsOrbaxCheckpoint(const std::string& path);

/// What Open found, for `reshard inspect`: the tree (each array's path, dtype, shape, mesh,
/// partition spec, write and chunk shapes, storage), and the leaves left out. Text for a
/// person; JSON as docs/formats.md describes ("orbax" of `inspect --json`).
std::string OrbaxSummaryText(const OrbaxCheckpoint& c);
std::string OrbaxSummaryJson(const OrbaxCheckpoint& c);

/// Adam's moments in an optimizer's state, matched to the model's arrays they belong to: optax's
/// ScaleByAdamState (what adam, adamw, lamb... keep) is saved as `<state path>.mu.<param path>`
/// and `<state path>.nu.<param path>` beside `<state path>.count`, where `<param path>` is the
/// path of the parameter inside the tree the optimizer was given (`params.decoder.kernel`'s
/// moment: `opt_state.0.mu.decoder.kernel` when the optimizer holds `params`' subtree,
/// `opt_state.0.mu.params.decoder.kernel` when it holds the tree with its `params` key). A moment
/// is matched to the model array (one outside the optimizer's state) whose path ends with its
/// `<param path>` and whose shape is its own; where several do, to the one under the prefix
/// most moments share (the tree given to the optimizer). A state of a model array that two
/// moments claim (two Adam states over one tree, as two chains keep) is matched to neither.
struct OrbaxMoments {
  /// Per moment (an index of arrays()): its model array's index and its name as a state of that
  /// parameter, "exp_avg" (mu) or "exp_avg_sq" (nu).
  std::map<size_t, std::pair<size_t, std::string>> moments;
  /// Per model array with a moment: the `count` beside its mu (a 0-d integer array), the
  /// optimizer's step, when there is one.
  std::map<size_t, size_t> counts;
};
OrbaxMoments FindOrbaxMoments(const OrbaxCheckpoint& c);

/// The checkpoint's arrays as a ShardSource: one parameter per array (its name, the map of its
/// devices' boxes, layout DcpDefaultLayout), world size = the devices; with `weights_only`,
/// optimizer state left out. Adam's moments (FindOrbaxMoments), where a parameter has both, are
/// named as reshard names a parameter's optimizer state, "<param>.exp_avg" and
/// "<param>.exp_avg_sq" (unless a model array has that name), so that a DCP output holds them as
/// the optimizer's state of the parameter and a universal one as its exp_avg.pt and exp_avg_sq.pt;
/// every other leaf keeps its own name. Memory: ReadRegion reads a box from the stored chunks it
/// overlaps, one chunk at a time (ReadsRegions); AcquireShards holds the array's devices' boxes,
/// each read once for all the devices that hold it.
std::unique_ptr<ShardSource> OrbaxSource(std::shared_ptr<const OrbaxCheckpoint> ckpt,
                                         bool weights_only);

/// The options an Orbax checkpoint takes: InvalidArgument for the master weights, a config.json
/// or a distributed config.
Status CheckOrbaxOptions(const std::string& path, const SourceOptions& options);

/// An Orbax checkpoint opened for `options.use` (the table of formats' opener): a gather takes
/// the model's arrays (optimizer state left out unless `optimizer_state`); a convert takes every
/// array unless `weights_only`.
Result<OpenedCheckpoint> OpenOrbax(const std::string& path, const SourceOptions& options);

/// The run that saved it: a flat world of its devices.
ParallelRun OrbaxRunOf(const OrbaxCheckpoint& c);

/// How an Orbax checkpoint's arrays are stored (Orbax's `use_ocdbt` and `use_zarr3`).
enum class OrbaxStorage {
  kZarr3,  // an OCDBT database of zarr v3 arrays (MaxText's choice): use_ocdbt, use_zarr3
  kZarr2,  // an OCDBT database of zarr v2 arrays (Orbax's default): use_ocdbt
  kPlain,  // a zarr v2 directory per array, no OCDBT
};

/// "zarr3", "zarr2" or "plain"; InvalidArgument naming the choices otherwise.
Result<OrbaxStorage> ParseOrbaxStorage(std::string_view name);

/// The mesh and partition specs an Orbax checkpoint is written for: the devices are ids 0..N-1,
/// row-major over mesh_shape.
struct OrbaxTarget {
  Shape mesh_shape;
  std::vector<std::string> axis_names;
  /// Array name patterns ("*": any run of characters) and their specs (per dimension the mesh
  /// axes it is split over), the first match wins; an array no pattern matches is replicated.
  std::vector<std::pair<std::string, std::vector<std::vector<std::string>>>> specs;
  /// The tree written: "" the source's tensor names as its paths; "maxtext" MaxText's tree of the
  /// Hugging Face model the source holds (checkpoint/orbax/maxtext.h; the specs then match
  /// MaxText's names).
  std::string names;
  OrbaxStorage storage = OrbaxStorage::kZarr3;
};

/// `mesh` "fsdp=2,tensor=4"; `specs_json` ("" for none) a JSON object of name patterns -> a
/// partition spec ([null | "axis" | ["a", "b"], ...] or null). InvalidArgument naming what is
/// malformed: a mesh that is not axis=size pairs, an axis given twice, a spec naming an axis
/// the mesh lacks or one axis twice.
Result<OrbaxTarget> ParseOrbaxTarget(std::string_view mesh, std::string_view specs_json);

/// Writes the tensors of `source` as an Orbax checkpoint item (PyTreeCheckpointHandler's, as one
/// process saves it) on `target`: `_CHECKPOINT_METADATA`, `_METADATA` (each name's dot-separated
/// parts as dict keys; use_ocdbt and use_zarr3 as `target.storage` says), `_sharding`,
/// `array_metadatas/process_0`, and per array its zarr metadata and one zstd chunk per device
/// box (zarr.h's ZarrMetadataText): with OCDBT, keys `<name>/zarr.json` and `<name>/c/i/j`
/// (zarr3) or `<name>/.zarray` and `<name>/i.j` (zarr2) of the database `ocdbt.process_0/`
/// (OcdbtWriter) and the item's merged `manifest.ocdbt` over it; plain, files of those names
/// (zarr v2). Memory: one chunk (one device box) and the OCDBT keys; each chunk is read from the
/// source's stored chunks (ReadsRegions) or moved from its shards, and written before the next.
/// InvalidArgument for a name that cannot be a pytree path (empty parts, quotes, "/", or a
/// prefix of another) or a spec longer than its array's rank; FailedPrecondition for a split
/// that does not divide a dimension (JAX refuses uneven NamedShardings). A failure leaves no
/// output (OutputDirectory).
Status WriteOrbax(ShardSource& source, const OrbaxTarget& target, const std::string& out_dir,
                  const CheckpointOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_ORBAX_ORBAX_H_
