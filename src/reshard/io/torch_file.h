// PyTorch checkpoint files (`torch.save`, PyTorch 1.6 and later), read without running code.
//
// A `.pt` file is a zip archive of stored entries (io/zip.h) under one root directory:
//   <root>/data.pkl             the object tree, a pickle (io/pickle.h)
//   <root>/data/<key>           one raw storage per key, elements packed, no header
//   <root>/byteorder            "little" or "big" (absent in old files: little)
//   <root>/version, <root>/.format_version, <root>/.storage_alignment  (text numbers)
//   <root>/.data/serialization_id, ...  (ignored)
// torch.save aligns every entry's data to 64 bytes with padding in the local header's extra
// field, so storages can be used in place from a memory map.
//
// In the pickle a tensor is `torch._utils._rebuild_tensor_v2(storage, storage_offset, size,
// stride, requires_grad, backward_hooks[, metadata])`, or `_rebuild_tensor_v3(..., dtype[,
// metadata])` for dtypes without a typed storage class (fp8, uint16-64), possibly wrapped in
// `_rebuild_parameter(tensor, requires_grad, hooks)`. Its storage is a persistent id
//   ("storage", <storage type>, key, location, numel)
// whose type is `torch.FloatStorage` & co (numel in elements) or `torch.storage.
// UntypedStorage` (numel in bytes; the dtype is v3's argument). Offsets, sizes and strides
// are in elements.
//
// A tensor is named by the dotted path of dict keys and list/tuple indices from the root
// (`model.layers.0.mlp.up_proj.weight`, `optimizer.state.0.exp_avg`): str keys as they are,
// int keys in decimal, bool/None keys as Python prints them; a record (a DeepSpeed loss
// scaler, argparse.Namespace) is entered through its BUILD state and its arguments. A tensor
// reached twice (the same object under two keys) is listed under each name, as a view of the
// same storage. Naming walks a shared object once per path to it, but only the parts of the
// tree that hold tensors, and at most PickleLimits::max_expanded objects (2^22) and 64 times as
// many bytes of paths: a file whose shared objects make more paths than that (l = (l, l) nested
// 60 deep over a tensor names it 2^60 times) is refused (DataLoss). A view's size in bytes is
// at most 2^62, as its element count is (DataLoss past it).
#ifndef RESHARD_IO_TORCH_FILE_H_
#define RESHARD_IO_TORCH_FILE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/pickle.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/zip.h"

namespace reshard {

/// A tensor element type as torch names it, spelled as safetensors does ("F32", "BF16",
/// "F8_E4M3", "C64"); `dtype` is set for those base/dtype.h knows (all but complex).
struct TorchDType {
  std::string_view name;
  size_t size = 0;  // bytes per element
  std::optional<DType> dtype;
};

struct TorchStorage {
  std::string key;                   // the `<root>/data/<key>` entry
  TorchDType dtype;                  // as the persistent id (or v3's dtype) declares it
  Index numel = 0;                   // elements
  std::span<const std::byte> bytes;  // the entry's data, in place (numel * dtype.size bytes)
};

struct TorchTensor {
  std::string name;    // dotted path from the root (see above)
  size_t storage = 0;  // index into TorchFile::storages()
  TorchDType dtype;
  Shape shape;
  Shape strides;             // elements
  Index storage_offset = 0;  // elements
  bool requires_grad = false;
  bool parameter = false;             // rebuilt through _rebuild_parameter
  PickleNodeId node = kNoPickleNode;  // the rebuild record in the tree
  Index numel() const { return ProductOf(shape); }
  uint64_t num_bytes() const { return static_cast<uint64_t>(numel()) * dtype.size; }
  /// Row-major dense: copying it is one memcpy of num_bytes() from the storage offset.
  bool is_contiguous() const;
};

/// A `.pt` file: its object tree, storages and tensors (views over the storages).
class TorchFile {
 public:
  /// Maps `path` read-only and reads it. Errors name the file; a legacy (pre-1.6) file is
  /// Unimplemented with a message saying how to resave it.
  static Result<TorchFile> Open(const std::string& path, const PickleOptions& options = {});
  /// Reads a file held in memory by the caller (it must outlive the TorchFile).
  static Result<TorchFile> Parse(std::span<const std::byte> bytes,
                                 const PickleOptions& options = {});

  /// The archive's root directory ("archive" for torch.save to a path named anything).
  const std::string& root() const { return root_; }
  const PickleTree& tree() const { return tree_; }
  const std::vector<TorchStorage>& storages() const { return storages_; }
  /// In the order the tree lists them (dict insertion order, depth first).
  const std::vector<TorchTensor>& tensors() const { return tensors_; }
  /// The tensor made by rebuild record `node`, or nullptr.
  const TorchTensor* TensorAt(PickleNodeId node) const;
  /// The entries of the archive (byteorder, version, ...), for listing.
  const ZipArchive& archive() const { return zip_; }
  /// How many objects of the tree were visited to name the tensors (the work of reading it
  /// beyond parsing; at most PickleLimits::max_expanded).
  uint64_t objects_walked() const { return objects_walked_; }

  /// Copies `tensor`'s elements in row-major order into `out` (exactly num_bytes()).
  Status CopyTo(const TorchTensor& tensor, std::span<std::byte> out) const;
  /// Drops the mapped pages of `tensor`'s storage from this process (they are read again
  /// from the file if touched later), so that streaming every tensor keeps memory flat.
  void ReleasePages(const TorchTensor& tensor) const;

 private:
  TorchFile() = default;
  Status Load(std::span<const std::byte> bytes, const PickleOptions& options);

  std::optional<MappedFile> file_;
  ZipArchive zip_;
  std::string root_;
  PickleTree tree_;
  std::vector<TorchStorage> storages_;
  std::vector<TorchTensor> tensors_;
  std::unordered_map<PickleNodeId, size_t> tensor_by_node_;  // first tensor of each record
  uint64_t objects_walked_ = 0;
  friend class TorchTreeReader;
};

/// Whether `bytes` (a file's first bytes, or all of it) look like a torch.save file of any
/// age: a zip archive, the pickle magic of pre-1.6 files, or a tar archive.
bool LooksLikeTorchFile(std::span<const std::byte> bytes);

/// Writes every tensor of `file` to a safetensors file at `path` (atomically, io/safetensors.h)
/// under its dotted name, bit for bit; a view is written as its own contiguous tensor, and a
/// tensor reached under two names is written under each. Metadata {"format": "pt"}, as
/// Hugging Face writes it. What is written dense may exceed the file's storages by at most
/// their own size or 1 GiB, whichever is more (a view with stride 0, as expand() makes, or a
/// tensor under several names repeats storage bytes): past that InvalidArgument, naming the
/// tensor, before anything is allocated or written (RewriteTorchFile keeps such views as
/// views). Unimplemented for a dtype safetensors files here cannot hold
/// (complex, F8_E8M0); InvalidArgument for two tensors whose dotted names collide; errors of
/// the writer (AlreadyExists unless `overwrite`, ResourceExhausted for a full disk).
Status ExportToSafetensors(const TorchFile& file, const std::string& path, bool overwrite);

/// The dtype of a storage class ("torch.BFloat16Storage") or a dtype global ("torch.bfloat16"),
/// or nullopt (quantized and sub-byte types).
std::optional<TorchDType> TorchDTypeOf(std::string_view global);

/// The globals torch.save writes for `dtype`, as names in module `torch`: its typed storage
/// class ("BFloat16Storage"; empty where torch has none and writes an untyped storage: U16,
/// U32, U64, F8) and its dtype object ("bfloat16"). From the table TorchDTypeOf reads.
struct TorchDTypeGlobals {
  std::string_view storage_class;
  std::string_view dtype_object;
};
TorchDTypeGlobals TorchGlobalsOf(DType dtype);

}  // namespace reshard

#endif  // RESHARD_IO_TORCH_FILE_H_
