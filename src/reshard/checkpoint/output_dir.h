// Output directories: built under a temporary name, renamed into place in one step, and the
// rule for what an existing output may be replaced by.
//
// Replacing (`overwrite`) is allowed only for
//   - an empty directory;
//   - a sharded checkpoint that reshard wrote: reshard.json (a manifest that parses) and
//     exactly the files its "files" lists, and the model's side files (ModelSideFiles()),
//     nothing else;
//   - a full checkpoint that reshard wrote: model.safetensors, or model-NNNNN-of-NNNNN
//     parts and model.safetensors.index.json, and the model's side files, nothing else, each
//     safetensors file marked in its header's __metadata__ with "producer": "reshard"
//     (kProducerMetadata; every safetensors file the checkpoint operations write carries it);
//   - a universal checkpoint: latest_universal naming the one folder beside it, which holds
//     only *_model_states.pt files and zero/, which holds only optimizer_state.pt and folders
//     of {fp32,exp_avg,exp_avg_sq,step}.pt (DeepSpeed's format: its files carry no mark);
//   - a DeepSpeed pipeline checkpoint (convert --pp): latest naming the one folder beside it,
//     which holds only layer_*, mp_rank_*_model_states.pt and [bf16_]zero_pp_rank_*_optim_states
//     files (a save dir DeepSpeed wrote also holds zero_to_fp32.py, and is not replaced);
//   - a DCP checkpoint that reshard wrote: a .metadata that reads as DCP metadata and carries
//     reshard's StorageMeta.save_id (kDcpSaveId; torch records a uuid4 there), and exactly the
//     data files it names and empty __{r}_0.distcp files (ranks without rows), nothing else;
//   - an Orbax checkpoint that reshard wrote (convert --to orbax): _CHECKPOINT_METADATA whose
//     custom_metadata has "producer": "reshard" (kOrbaxProducerKey), _METADATA, _sharding,
//     array_metadatas/process_*, and its OCDBT databases (manifest.ocdbt, d/, and
//     ocdbt.process_*/ holding only manifest.ocdbt and d/) or, stored plain, zarr array
//     directories, nothing else.
// Anything else (a file, a symbolic link, a directory holding a file reshard did not write)
// is refused with AlreadyExists naming what is in the way; nothing is ever removed but the
// replaced output.
//
// Whether replacing or not, the output may not be, contain or lie inside any input (real
// paths: symbolic links resolved), nor be or contain the current directory; a symbolic link
// as the output is refused (InvalidArgument), all before any work is done.
//
// An output that is one file (export, infer/layout/compose -o, degree --emit-maps) may replace
// (`overwrite`) only a regular file that is not an input (the same path, or the same file
// through another name); a symbolic link, a directory, a device, a FIFO or a socket in its
// place is refused, with or without `overwrite`.
#ifndef RESHARD_CHECKPOINT_OUTPUT_DIR_H_
#define RESHARD_CHECKPOINT_OUTPUT_DIR_H_

#include <map>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// The __metadata__ of every safetensors file reshard's checkpoint operations write:
/// {"format": "pt", "producer": "reshard"} ("format": "pt" is what transformers expects).
const std::map<std::string, std::string>& ProducerMetadata();

/// The files beside a model's weights that loaders read from the same directory (vLLM's
/// sharded-state loader among them: an output must stand for the model), which the checkpoint
/// commands copy (or, config.json, write) beside the tensors they write: config.json,
/// tokenizer files, chat templates. An output holding them is still reshard's to replace.
std::span<const char* const> ModelSideFiles();

/// The file of an Orbax checkpoint's step metadata, and the key of its custom_metadata (a field
/// Orbax keeps for its users) that convert --to orbax sets to "reshard": --force replaces an
/// Orbax checkpoint only with that mark.
inline constexpr char kOrbaxCheckpointMetadata[] = "_CHECKPOINT_METADATA";
inline constexpr char kOrbaxProducerKey[] = "producer";

/// OK when the existing `path` may be replaced (rules above); AlreadyExists otherwise, naming
/// the first entry reshard did not write. OK when `path` does not exist.
Status CheckReplaceable(const std::string& path);

/// OK when output `path` is not, does not contain and does not lie inside any of `inputs`,
/// nor is or contains the current directory, and is not a symbolic link; InvalidArgument
/// naming the conflict otherwise.
Status CheckOutputAgainstInputs(const std::string& path, std::span<const std::string> inputs);

/// The rule for an output that is one file (above): OK when `path` does not exist, or exists as
/// a regular file that is none of `inputs` and `overwrite` is set; AlreadyExists for an existing
/// regular file without `overwrite`; InvalidArgument naming what is there (a symbolic link, a
/// directory, a device, a FIFO, a socket) or the input it is, otherwise.
Status CheckOutputFile(const std::string& path, bool overwrite,
                       std::span<const std::string> inputs = {});

/// An output directory that appears atomically: files are written into a temporary sibling
/// directory (io/temporaries.h: removed if the run is interrupted, and by a later run if the
/// process died), and `Commit` swaps it into place in one rename (the old output, when
/// replaced, is then removed). If it is destroyed without a successful Commit, the temporary
/// directory is removed: a failed run leaves nothing that looks like a result.
class OutputDirectory {
 public:
  /// Checks `path` against `inputs` and, when it exists, that `overwrite` is given and it is
  /// replaceable (AlreadyExists otherwise); removes stale temporaries of `path`; creates the
  /// temporary directory. The checks are made again at Commit.
  /// `temp`, when given, is the temporary's name (from io/temporaries.h's TemporaryPathFor,
  /// chosen beforehand so that other processes can Join it before it exists).
  static Result<OutputDirectory> Create(const std::string& path, bool overwrite,
                                        std::span<const std::string> inputs = {},
                                        const std::string& temp = {});
  /// Joins the temporary directory `temp` of output `path` that another process of the same
  /// operation created and will commit (communicator.h): files are written into it as into
  /// one's own, and it is removed if this process is interrupted (or ends through
  /// RemoveTemporariesAndHold, as when the processes can no longer agree) before `Leave`, even
  /// after this object is gone; it is never committed nor otherwise removed through this
  /// object. It need not exist yet: joining
  /// before the other process creates it leaves no moment at which that process could die
  /// without a survivor knowing what to remove.
  static Result<OutputDirectory> Join(const std::string& path, const std::string& temp);
  OutputDirectory(OutputDirectory&& other) noexcept;
  OutputDirectory& operator=(OutputDirectory&&) = delete;
  ~OutputDirectory();

  /// Where to write file `name` before the commit.
  std::string FilePath(const std::string& name) const;
  /// The temporary directory.
  const std::string& temporary() const { return temp_; }
  /// Renames the temporary into place; with `sync`, then flushes the parent directory to disk
  /// (the files themselves are their writers' to sync).
  Status Commit(bool sync = true);
  /// For a joined directory: from now on an interruption of this process leaves it alone (the
  /// process that created it alone decides its fate).
  void Leave();

 private:
  OutputDirectory() = default;
  Status CheckTarget() const;
  std::string path_;
  std::string temp_;
  std::vector<std::string> inputs_;
  bool overwrite_ = false;
  bool committed_ = false;
  bool owner_ = true;    // created the temporary, commits it
  bool joined_ = false;  // not the owner, and still removes it on interruption
};

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_OUTPUT_DIR_H_
