// Writing `.pt` files as torch.save writes them: any object tree the reader (torch_file.h)
// produces, or one built here, with its tensors and their storages.
//
// The layout is torch.save's (PyTorch 2.x), described byte by byte in torch_file.h and
// docs/formats.md: a zip of stored entries `<root>/data.pkl`, `<root>/.format_version` ("1"),
// `<root>/.storage_alignment` ("64"), `<root>/byteorder` ("little"), one `<root>/data/<i>` per
// tensor, `<root>/version` ("3\n"); each entry's data starts at a multiple of 64 bytes (padding
// in an "FB" extra field of the local header), CRC-32 and sizes follow the data in a data
// descriptor (flag bit 3) and are repeated in the central directory; ZIP64 records appear when
// an entry, an offset or the entry count needs them. The pickle is protocol 2, written by
// SerializePickle (pickle.h). A tensor made here is `torch._utils._rebuild_tensor_v2((
// "storage", torch.<T>Storage, "<key>", "cpu", numel), storage_offset, size, stride,
// requires_grad, OrderedDict())`, or `_rebuild_tensor_v3(..., torch.<dtype>)` over a
// `torch.storage.UntypedStorage` (numel in bytes) for the dtypes without a typed storage class
// (U16, U32, U64, F8_E4M3, F8_E5M2), as torch does.
//
// A tree holding only tensors and plain data (dicts, OrderedDicts, lists, tuples, sets,
// scalars, str, bytes, torch.Size, dtypes, devices) loads with weights_only=True. Inert
// records (DeepSpeed's loss scalers, ZeroStageEnum, fragment_address, argparse.Namespace) are
// written back as their class applied to their arguments (REDUCE or NEWOBJ, as read) and
// BUILD of their state: `torch.load(weights_only=False)` rebuilds the same objects, which is
// what DeepSpeed itself loads its files with.
#ifndef RESHARD_IO_TORCH_WRITER_H_
#define RESHARD_IO_TORCH_WRITER_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/io/file.h"
#include "reshard/io/pickle.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_file.h"

namespace reshard {

struct TorchWriteOptions {
  /// The archive's root directory (torch.load accepts any).
  std::string root = "archive";
  /// Replace an existing file. Without it an existing `path` is AlreadyExists.
  bool overwrite = false;
  /// Flush to disk before the rename (see WriteOptions::sync).
  bool sync = true;
  /// See WriteOptions::start_writeback.
  bool start_writeback = false;
  /// See WriteOptions::in_fresh_directory (an output directory's temporary: no earlier run's
  /// temporaries are looked for, which would list the directory once per file written).
  bool in_fresh_directory = false;
};

/// Writes `tensors` (in the given order, each its own storage, dense row-major) as the state
/// dict torch.save would write, atomically. Each `fill` is called once, in order, on one
/// reused buffer as large as the largest tensor. InvalidArgument for duplicate or non-UTF-8
/// names, a bad shape or a missing fill (checked before anything is written); AlreadyExists,
/// ResourceExhausted and a failing fill's Status as for WriteSafetensors. Nothing is left
/// behind on failure.
Status WriteTorchStateDict(const std::string& path, std::vector<TensorToWrite> tensors,
                           const TorchWriteOptions& options = {});

/// One storage of a file to write: the entry `<root>/data/<key>` of `num_bytes` bytes.
struct TorchStorageToWrite {
  std::string key;
  uint64_t num_bytes = 0;
  /// The bytes in place (e.g. in a mapped file) when not empty; written as they are.
  std::span<const std::byte> bytes;
  /// Otherwise fills `out` (exactly num_bytes) with them.
  std::function<Status(std::span<std::byte> out)> fill;
};

/// Writes the tree under `root` of `tree` and `storages` (in the given order) as a torch.save
/// file, atomically. Every persistent id of the tree must be a torch storage id ("storage",
/// <storage type>, key, location, numel) whose key is one of `storages`, holding numel
/// elements of that type (numel bytes for an untyped storage). InvalidArgument, naming the
/// path of the object from the root, for a tree SerializePickle refuses, a persistent id of
/// another shape, an unknown key, a size that disagrees or a duplicate key (all checked
/// before anything is written); the errors of WriteTorchStateDict otherwise.
Status WriteTorchTree(const std::string& path, const PickleTree& tree, PickleNodeId root,
                      const std::vector<TorchStorageToWrite>& storages,
                      const TorchWriteOptions& options = {});

/// Appends the torch.save archive of the tree under `root` to `out`, as torch.save writes one
/// into a stream at its current position (a DCP item): the archive's offsets and alignment
/// count from its first byte, so its bytes are those WriteTorchTree writes as a file of its
/// own (root directory `archive_root`). Returns its length in bytes. The errors of
/// WriteTorchTree (checked before anything is appended; a failure after that leaves `out`
/// holding part of the archive, for the caller to abandon).
Result<uint64_t> AppendTorchTree(AtomicFileWriter& out, const PickleTree& tree, PickleNodeId root,
                                 const std::vector<TorchStorageToWrite>& storages,
                                 const std::string& archive_root = "archive");

/// The bytes AppendTorchTree appends, in memory (a small object's archive: a DCP bytes item).
Result<std::string> TorchTreeArchive(const PickleTree& tree, PickleNodeId root,
                                     const std::vector<TorchStorageToWrite>& storages,
                                     const std::string& archive_root = "archive");

/// Writes `file` (read by TorchFile) back: the same object tree, the same storages bit for
/// bit, shared objects and views of one storage kept so. `torch.load` of the result gives an
/// object equal to what it gives for `file`. Options' root is used as given.
Status RewriteTorchFile(const TorchFile& file, const std::string& path,
                        const TorchWriteOptions& options = {});

/// Builds an object tree with tensors to write as a torch.save file: the values of Python
/// (None, bool, int, float, str, bytes, list, tuple, set, dict, OrderedDict), torch's
/// (torch.Size, dtypes, devices, tensors and views of their storages) and inert records, and
/// parts of files read by TorchFile copied in. Every method returns the new node's id, to use
/// as a child of later nodes; a node may be used in several places (it is then one shared
/// object when loaded). Nothing is checked until Write.
///
///   TorchTreeBuilder b;
///   const PickleNodeId w = b.Tensor(DType::kF32, {4, 8}, fill);
///   const PickleNodeId root = b.Dict({{b.Str("param"), w}, {b.Str("cat_dim"), b.Int(0)}});
///   RESHARD_RETURN_IF_ERROR(b.Write("fp32.pt", root));
class TorchTreeBuilder {
 public:
  using Fill = std::function<Status(std::span<std::byte> out)>;

  PickleNodeId None();
  PickleNodeId Bool(bool value);
  PickleNodeId Int(int64_t value);
  PickleNodeId Float(double value);
  PickleNodeId Str(std::string value);
  PickleNodeId Bytes(std::string value);
  PickleNodeId List(std::vector<PickleNodeId> items = {});
  PickleNodeId Tuple(std::vector<PickleNodeId> items = {});
  PickleNodeId Set(std::vector<PickleNodeId> items = {});
  /// A dict, or with `ordered` a collections.OrderedDict, of (key, value) in order.
  PickleNodeId Dict(std::vector<std::pair<PickleNodeId, PickleNodeId>> entries = {},
                    bool ordered = false);
  /// Appends to a list made by List, or sets `key` of a dict made by Dict (keys are not
  /// compared: setting a key twice writes it twice, and the last value wins on load).
  void Append(PickleNodeId list, PickleNodeId item);
  void Insert(PickleNodeId dict, PickleNodeId key, PickleNodeId value);
  /// torch.Size(dims).
  PickleNodeId Size(const Shape& dims);
  /// A global used as a value, "module.name" (a dtype: "torch.bfloat16").
  PickleNodeId Global(std::string name);
  /// The dtype object of `dtype` (torch.float32 for F32, ...).
  PickleNodeId DTypeObject(DType dtype);
  /// torch.device(type) ("cpu").
  PickleNodeId Device(std::string type);
  /// An inert record: `class_name` ("module.name") applied to `args` (REDUCE, or NEWOBJ:
  /// cls.__new__(cls, *args)), then BUILD with `state` if it is not kNoPickleNode.
  PickleNodeId Record(std::string class_name, std::vector<PickleNodeId> args,
                      PickleNodeId state = kNoPickleNode, bool newobj = false);
  /// An instance of a plain class as pickle writes one: NEWOBJ of the class with no
  /// arguments, then BUILD with its attribute dict `state` (argparse.Namespace, DeepSpeed's
  /// loss scalers and its fragment_address dataclass).
  PickleNodeId Object(std::string class_name, PickleNodeId state);
  /// A member of an Enum class: REDUCE of the class with (value,) (ZeroStageEnum).
  PickleNodeId Enum(std::string class_name, PickleNodeId value);

  /// A tensor over a storage of its own, dense row-major, whose bytes `fill` writes when the
  /// file is written.
  PickleNodeId Tensor(DType dtype, Shape shape, Fill fill, bool requires_grad = false);
  /// Another view of the storage of `tensor` (made by Tensor or View): offset, shape and
  /// strides in elements. InvalidArgument if `tensor` is not one, or the view reaches past
  /// the storage.
  Result<PickleNodeId> View(PickleNodeId tensor, Index storage_offset, Shape shape, Shape strides);
  /// Copies node `id` of `file`'s tree and everything under it (shared nodes stay shared;
  /// copying the same node twice gives the same copy); its storages are written from the
  /// file's bytes, which must outlive Write. Keys are kept unless taken by another storage.
  Result<PickleNodeId> Copy(const TorchFile& file, PickleNodeId id);

  const PickleTree& tree() const { return tree_; }
  PickleNode& mutable_node(PickleNodeId id) { return tree_.mutable_node(id); }

  /// Writes the tree under `root` (WriteTorchTree).
  Status Write(const std::string& path, PickleNodeId root,
               const TorchWriteOptions& options = {}) const;
  /// Appends the tree under `root` to `out` (AppendTorchTree); returns the archive's length.
  Result<uint64_t> AppendTo(AtomicFileWriter& out, PickleNodeId root,
                            const std::string& archive_root = "archive") const;
  /// The archive AppendTo appends, in memory (TorchTreeArchive).
  Result<std::string> Archive(PickleNodeId root, const std::string& archive_root = "archive") const;

 private:
  struct TensorInfo {
    PickleNodeId persistent_id;
    DType dtype;
    uint64_t storage_bytes;
  };
  PickleNodeId Add(PickleKind kind);
  PickleNodeId Text(PickleKind kind, std::string text);
  PickleNodeId Items(PickleKind kind, std::vector<PickleNodeId> items);
  PickleNodeId Call(std::string_view callee, std::vector<PickleNodeId> args);
  std::string NewKey(std::string wanted);
  PickleNodeId Rebuild(const TensorInfo& info, Index offset, const Shape& shape,
                       const Shape& strides, bool requires_grad);

  PickleTree tree_;
  std::vector<TorchStorageToWrite> storages_;
  std::unordered_set<std::string> keys_;
  std::unordered_map<PickleNodeId, TensorInfo> tensors_;  // rebuild record -> its storage
  // Per file copied from: its node -> our node, its storage key -> ours.
  std::unordered_map<const TorchFile*, std::unordered_map<PickleNodeId, PickleNodeId>> copied_;
  std::unordered_map<const TorchFile*, std::unordered_map<std::string, std::string>> copied_keys_;
};

}  // namespace reshard

#endif  // RESHARD_IO_TORCH_WRITER_H_
