#include "reshard/io/torch_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "reshard/io/file.h"
#include "reshard/io/pickle.h"
#include "reshard/io/zip.h"

namespace reshard {
namespace {

constexpr uint64_t kAlignment = 64;  // torch.save's storage alignment

// `bytes` little-endian bytes of `v`; bytes past the eighth are zero (a run of zero fields).
void Put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(i < 8 ? static_cast<char>(v >> (8 * i)) : '\0');
}

std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// A zip of stored entries appended to an output that cannot seek: sizes and CRC-32 follow
// each entry's data in a data descriptor, as torch's writer does.
class ZipStreamWriter {
 public:
  // Where the bytes go: a file being written, or memory.
  using Sink = std::function<Status(std::span<const std::byte>)>;
  explicit ZipStreamWriter(Sink out) : out_(std::move(out)) {}

  Status Add(const std::string& name, std::span<const std::byte> data) {
    Entry e{name, pos_, data.size(), Crc32(data)};
    const bool zip64 = e.size >= zip::kOverflow32;
    std::string header;
    Put(header, zip::kLocalHeaderSig, 4);
    Put(header, zip64 ? zip::kVersionZip64 : zip::kVersionStored, 2);
    Put(header, zip::kFlagDataDescriptor | zip::kFlagUtf8Name, 2);
    Put(header, 0, 2);   // stored
    Put(header, 0, 4);   // time, date
    Put(header, 0, 12);  // CRC-32 and sizes: in the descriptor
    // The bytes up to the FB padding: the header, the name, the ZIP64 extra, the FB extra's head.
    const uint64_t fixed = zip::kLocalHeaderBytes + name.size() + (zip64 ? 20 : 0) + 4;
    const uint64_t pad = (kAlignment - (pos_ + fixed) % kAlignment) % kAlignment;
    Put(header, name.size(), 2);
    Put(header, (zip64 ? 20 : 0) + 4 + pad, 2);
    header += name;
    if (zip64) {  // ZIP64 extra: sizes deferred to the descriptor
      Put(header, zip::kZip64ExtraId, 2);
      Put(header, 16, 2);
      Put(header, 0, 16);
    }
    Put(header, 0x4246, 2);  // "FB": padding to the alignment
    Put(header, pad, 2);
    header.append(pad, 'Z');
    RESHARD_RETURN_IF_ERROR(Append(header));
    RESHARD_RETURN_IF_ERROR(out_(data));
    pos_ += data.size();
    std::string descriptor;
    Put(descriptor, zip::kDataDescriptorSig, 4);
    Put(descriptor, e.crc, 4);
    Put(descriptor, e.size, zip64 ? 8 : 4);
    Put(descriptor, e.size, zip64 ? 8 : 4);
    RESHARD_RETURN_IF_ERROR(Append(descriptor));
    entries_.push_back(std::move(e));
    return Status::Ok();
  }

  Status Finish() {
    const uint64_t directory = pos_;
    std::string d;
    for (const Entry& e : entries_) {
      const bool big_size = e.size >= zip::kOverflow32, big_offset = e.offset >= zip::kOverflow32;
      std::string extra;
      if (big_size || big_offset) {
        Put(extra, zip::kZip64ExtraId, 2);
        Put(extra, (big_size ? 16 : 0) + (big_offset ? 8 : 0), 2);
        if (big_size) Put(extra, e.size, 8), Put(extra, e.size, 8);
        if (big_offset) Put(extra, e.offset, 8);
      }
      const uint16_t version = extra.empty() ? zip::kVersionStored : zip::kVersionZip64;
      Put(d, zip::kCentralHeaderSig, 4);
      Put(d, version, 2);  // made by
      Put(d, version, 2);  // needed
      Put(d, zip::kFlagDataDescriptor | zip::kFlagUtf8Name, 2);
      Put(d, 0, 2);
      Put(d, 0, 4);
      Put(d, e.crc, 4);
      Put(d, big_size ? zip::kOverflow32 : e.size, 4);
      Put(d, big_size ? zip::kOverflow32 : e.size, 4);
      Put(d, e.name.size(), 2);
      Put(d, extra.size(), 2);
      Put(d, 0, 6);  // comment length, disk, internal attributes
      Put(d, 0, 4);  // external attributes
      Put(d, big_offset ? zip::kOverflow32 : e.offset, 4);
      d += e.name;
      d += extra;
    }
    const uint64_t size = d.size(), count = entries_.size();
    const bool zip64 =
        count >= zip::kOverflow16 || directory >= zip::kOverflow32 || size >= zip::kOverflow32;
    if (zip64) {
      const uint64_t record = directory + size;
      Put(d, zip::kZip64EndSig, 4);
      Put(d, zip::kZip64EndBytes - 12, 8);  // the size of the record after this field
      Put(d, zip::kVersionZip64, 2);
      Put(d, zip::kVersionZip64, 2);
      Put(d, 0, 8);  // disk numbers
      Put(d, count, 8);
      Put(d, count, 8);
      Put(d, size, 8);
      Put(d, directory, 8);
      Put(d, zip::kZip64LocatorSig, 4);
      Put(d, 0, 4);
      Put(d, record, 8);
      Put(d, 1, 4);
    }
    Put(d, zip::kEndSig, 4);
    Put(d, 0, 4);
    Put(d, zip64 ? zip::kOverflow16 : count, 2);
    Put(d, zip64 ? zip::kOverflow16 : count, 2);
    Put(d, zip64 ? zip::kOverflow32 : size, 4);
    Put(d, zip64 ? zip::kOverflow32 : directory, 4);
    Put(d, 0, 2);
    return Append(d);
  }

  /// The bytes appended so far.
  uint64_t size() const { return pos_; }

 private:
  struct Entry {
    std::string name;
    uint64_t offset;
    uint64_t size;
    uint32_t crc;
  };
  Status Append(std::string_view bytes) {
    pos_ += bytes.size();
    return out_(AsBytes(bytes));
  }

  Sink out_;
  uint64_t pos_ = 0;
  std::vector<Entry> entries_;
};

std::string Quote(std::string_view s) { return fmt::format("\"{}\"", s); }

// The persistent ids under `id` with their dotted paths (dict keys and indices, as the
// reader names tensors), each node once. The tree is known to be acyclic and shallow.
void FindPersistentIds(const PickleTree& tree, PickleNodeId id, const std::string& path,
                       std::unordered_set<PickleNodeId>& seen,
                       std::vector<std::pair<PickleNodeId, std::string>>& out) {
  if (!seen.insert(id).second) return;
  const PickleNode& n = tree.node(id);
  const auto join = [&](const std::string& c) { return path.empty() ? c : path + "." + c; };
  if (n.kind == PickleKind::kPersistentId) out.emplace_back(id, path);
  for (size_t i = 0; i < n.items.size(); ++i) {
    FindPersistentIds(tree, n.items[i], join(std::to_string(i)), seen, out);
  }
  for (size_t i = 0; i < n.entries.size(); ++i) {
    const std::string label = PickleKeyName(tree, n.entries[i].first, i);
    FindPersistentIds(tree, n.entries[i].second, join(label), seen, out);
  }
  if (n.args != kNoPickleNode) {  // a tensor is named by its rebuild record's path
    for (PickleNodeId a : tree.node(n.args).items) FindPersistentIds(tree, a, path, seen, out);
  }
  if (n.state != kNoPickleNode) FindPersistentIds(tree, n.state, path, seen, out);
}

// Every persistent id is ("storage", <type>, key, location, numel) of a storage to write,
// of the size it declares.
Status CheckPersistentIds(const PickleTree& tree, PickleNodeId root,
                          const std::unordered_map<std::string, uint64_t>& sizes) {
  std::unordered_set<PickleNodeId> seen;
  std::vector<std::pair<PickleNodeId, std::string>> ids;
  FindPersistentIds(tree, root, "", seen, ids);
  for (const auto& entry : ids) {
    // Named, not a structured binding: clang 14 cannot capture one in a lambda.
    const PickleNodeId id = entry.first;
    const std::string& path = entry.second;
    const auto error = [&](const std::string& message) {
      return InvalidArgumentError("object " + Quote(path) + ": " + message);
    };
    const PickleNode& pid = tree.node(tree.node(id).items[0]);
    const auto is = [&](size_t i, PickleKind kind) {
      return i < pid.items.size() && tree.node(pid.items[i]).kind == kind;
    };
    if (pid.kind != PickleKind::kTuple || pid.items.size() != 5 || !is(0, PickleKind::kStr) ||
        tree.node(pid.items[0]).text != "storage" || !is(1, PickleKind::kGlobal) ||
        !is(2, PickleKind::kStr) || !is(4, PickleKind::kInt)) {
      return error("persistent id is not (\"storage\", type, key, location, numel)");
    }
    const std::string& type = tree.node(pid.items[1]).text;
    const std::string& key = tree.node(pid.items[2]).text;
    const int64_t numel = tree.node(pid.items[4]).int_value;
    const std::optional<TorchDType> dtype = TorchDTypeOf(type);
    if (!dtype || type.find("Storage") == std::string::npos) {
      return error("storage type " + type + " is not a storage class written here");
    }
    const auto it = sizes.find(key);
    if (it == sizes.end()) return error("storage " + Quote(key) + " is not among the storages");
    const std::optional<Index> bytes = CheckedMul(numel, static_cast<Index>(dtype->size));
    if (numel < 0 || !bytes || static_cast<uint64_t>(*bytes) != it->second) {
      return error("storage " + Quote(key) + " declares " + std::to_string(numel) +
                   " elements of " + std::string(dtype->name) + " but has " +
                   std::to_string(it->second) + " bytes");
    }
  }
  return Status::Ok();
}

Status CheckTensors(const std::vector<TensorToWrite>& tensors) {
  std::unordered_set<std::string_view> names;
  for (const TensorToWrite& t : tensors) {
    if (!names.insert(t.name).second) {
      return InvalidArgumentError("duplicate tensor name \"" + t.name + "\"");
    }
    if (!IsValidPickleString(t.name)) {
      return InvalidArgumentError("tensor name \"" + t.name + "\" is not valid UTF-8");
    }
    const Result<Index> numel = CheckedProduct(t.shape);
    if (!numel.ok()) return numel.status().Annotate("tensor \"" + t.name + "\"");
    if (!t.fill) return InvalidArgumentError("tensor \"" + t.name + "\" has no fill function");
  }
  return Status::Ok();
}

}  // namespace

Status WriteTorchStateDict(const std::string& path, std::vector<TensorToWrite> tensors,
                           const TorchWriteOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckTensors(tensors));
  TorchTreeBuilder b;
  const PickleNodeId root = b.Dict({}, /*ordered=*/true);
  for (TensorToWrite& t : tensors) {
    auto fill = [fill = std::move(t.fill), name = t.name](std::span<std::byte> out) {
      return fill(out).Annotate("tensor " + Quote(name));
    };
    b.Insert(root, b.Str(t.name), b.Tensor(t.dtype, t.shape, std::move(fill)));
  }
  return b.Write(path, root, options);
}

namespace {

// The checks of WriteTorchTree, before anything is written: the pickle of the tree, and the
// size of the largest storage to be filled.
struct CheckedTree {
  std::string pickle;
  uint64_t largest_fill = 0;
};

Result<CheckedTree> CheckTree(const PickleTree& tree, PickleNodeId root,
                              const std::vector<TorchStorageToWrite>& storages) {
  CheckedTree out;
  RESHARD_ASSIGN_OR_RETURN(out.pickle, SerializePickle(tree, root));
  std::unordered_map<std::string, uint64_t> sizes;
  for (const TorchStorageToWrite& s : storages) {
    if (!sizes.emplace(s.key, s.num_bytes).second) {
      return InvalidArgumentError("two storages with key " + Quote(s.key));
    }
    if (s.bytes.empty() && s.num_bytes > 0 && !s.fill) {
      return InvalidArgumentError("storage " + Quote(s.key) + " has neither bytes nor a fill");
    }
    if (!s.bytes.empty() && s.bytes.size() != s.num_bytes) {
      return InvalidArgumentError("storage " + Quote(s.key) + " of " + std::to_string(s.num_bytes) +
                                  " bytes is given " + std::to_string(s.bytes.size()));
    }
    if (s.bytes.empty()) out.largest_fill = std::max(out.largest_fill, s.num_bytes);
  }
  RESHARD_RETURN_IF_ERROR(CheckPersistentIds(tree, root, sizes));
  return out;
}

// A buffer of `bytes` for the fills (null for 0), or ResourceExhausted naming `what`.
Result<std::unique_ptr<std::byte[]>> FillBuffer(uint64_t bytes, const std::string& what) {
  std::unique_ptr<std::byte[]> buffer;
  if (bytes == 0) return buffer;
  buffer.reset(bytes <= SIZE_MAX ? new (std::nothrow) std::byte[static_cast<size_t>(bytes)]
                                 : nullptr);
  if (buffer == nullptr) {
    return ResourceExhaustedError("cannot allocate a buffer of " + std::to_string(bytes) +
                                  " bytes for the largest storage to write to " + what);
  }
  return buffer;
}

// Appends the archive to `out`; returns its length.
Result<uint64_t> AppendArchive(ZipStreamWriter::Sink out, const std::string& pickle,
                               const std::vector<TorchStorageToWrite>& storages,
                               const std::string& r, std::byte* buffer) {
  ZipStreamWriter zip(std::move(out));
  RESHARD_RETURN_IF_ERROR(zip.Add(r + "/data.pkl", AsBytes(pickle)));
  RESHARD_RETURN_IF_ERROR(zip.Add(r + "/.format_version", AsBytes("1")));
  RESHARD_RETURN_IF_ERROR(zip.Add(r + "/.storage_alignment", AsBytes("64")));
  RESHARD_RETURN_IF_ERROR(zip.Add(r + "/byteorder", AsBytes("little")));
  for (const TorchStorageToWrite& s : storages) {
    std::span<const std::byte> bytes = s.bytes;
    if (bytes.empty() && s.num_bytes > 0) {
      const std::span<std::byte> filled(buffer, s.num_bytes);
      RESHARD_RETURN_IF_ERROR(s.fill(filled).Annotate("storage " + Quote(s.key)));
      bytes = filled;
    }
    RESHARD_RETURN_IF_ERROR(zip.Add(r + "/data/" + s.key, bytes));
  }
  RESHARD_RETURN_IF_ERROR(zip.Add(r + "/version", AsBytes("3\n")));
  RESHARD_RETURN_IF_ERROR(zip.Finish());
  return zip.size();
}

ZipStreamWriter::Sink SinkOf(AtomicFileWriter& out) {
  return [&out](std::span<const std::byte> bytes) { return out.Append(bytes); };
}

}  // namespace

Status WriteTorchTree(const std::string& path, const PickleTree& tree, PickleNodeId root,
                      const std::vector<TorchStorageToWrite>& storages,
                      const TorchWriteOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(const CheckedTree checked, CheckTree(tree, root, storages));
  // One buffer, as large as the largest filled storage, serves every fill in turn; made before
  // the output, so that a size memory cannot hold leaves nothing behind.
  RESHARD_ASSIGN_OR_RETURN(const std::unique_ptr<std::byte[]> buffer,
                           FillBuffer(checked.largest_fill, Quote(path)));
  RESHARD_ASSIGN_OR_RETURN(
      AtomicFileWriter out,
      AtomicFileWriter::Create(path, {.overwrite = options.overwrite,
                                      .sync = options.sync,
                                      .start_writeback = options.start_writeback,
                                      .in_fresh_directory = options.in_fresh_directory}));
  RESHARD_RETURN_IF_ERROR(
      AppendArchive(SinkOf(out), checked.pickle, storages, options.root, buffer.get()).status());
  return out.Commit();
}

Result<uint64_t> AppendTorchTree(AtomicFileWriter& out, const PickleTree& tree, PickleNodeId root,
                                 const std::vector<TorchStorageToWrite>& storages,
                                 const std::string& archive_root) {
  RESHARD_ASSIGN_OR_RETURN(const CheckedTree checked, CheckTree(tree, root, storages));
  RESHARD_ASSIGN_OR_RETURN(const std::unique_ptr<std::byte[]> buffer,
                           FillBuffer(checked.largest_fill, "an archive"));
  return AppendArchive(SinkOf(out), checked.pickle, storages, archive_root, buffer.get());
}

Result<std::string> TorchTreeArchive(const PickleTree& tree, PickleNodeId root,
                                     const std::vector<TorchStorageToWrite>& storages,
                                     const std::string& archive_root) {
  RESHARD_ASSIGN_OR_RETURN(const CheckedTree checked, CheckTree(tree, root, storages));
  RESHARD_ASSIGN_OR_RETURN(const std::unique_ptr<std::byte[]> buffer,
                           FillBuffer(checked.largest_fill, "an archive"));
  std::string out;
  const auto sink = [&out](std::span<const std::byte> bytes) {
    out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return Status::Ok();
  };
  RESHARD_RETURN_IF_ERROR(
      AppendArchive(sink, checked.pickle, storages, archive_root, buffer.get()).status());
  return out;
}

Status RewriteTorchFile(const TorchFile& file, const std::string& path,
                        const TorchWriteOptions& options) {
  TorchTreeBuilder b;
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId root, b.Copy(file, file.tree().root()));
  return b.Write(path, root, options);
}

// --- TorchTreeBuilder --------------------------------------------------------------------

PickleNodeId TorchTreeBuilder::Add(PickleKind kind) {
  PickleNode n;
  n.kind = kind;
  return tree_.Add(std::move(n));
}

PickleNodeId TorchTreeBuilder::None() { return Add(PickleKind::kNone); }

PickleNodeId TorchTreeBuilder::Bool(bool value) {
  const PickleNodeId id = Add(PickleKind::kBool);
  tree_.mutable_node(id).bool_value = value;
  return id;
}

PickleNodeId TorchTreeBuilder::Int(int64_t value) {
  const PickleNodeId id = Add(PickleKind::kInt);
  tree_.mutable_node(id).int_value = value;
  return id;
}

PickleNodeId TorchTreeBuilder::Float(double value) {
  const PickleNodeId id = Add(PickleKind::kFloat);
  tree_.mutable_node(id).float_value = value;
  return id;
}

PickleNodeId TorchTreeBuilder::Str(std::string value) {
  return Text(PickleKind::kStr, std::move(value));
}

PickleNodeId TorchTreeBuilder::Bytes(std::string value) {
  return Text(PickleKind::kBytes, std::move(value));
}

PickleNodeId TorchTreeBuilder::Text(PickleKind kind, std::string text) {
  const PickleNodeId id = Add(kind);
  tree_.mutable_node(id).text = std::move(text);
  return id;
}

PickleNodeId TorchTreeBuilder::Items(PickleKind kind, std::vector<PickleNodeId> items) {
  const PickleNodeId id = Add(kind);
  tree_.mutable_node(id).items = std::move(items);
  return id;
}

PickleNodeId TorchTreeBuilder::List(std::vector<PickleNodeId> items) {
  return Items(PickleKind::kList, std::move(items));
}

PickleNodeId TorchTreeBuilder::Tuple(std::vector<PickleNodeId> items) {
  return Items(PickleKind::kTuple, std::move(items));
}

PickleNodeId TorchTreeBuilder::Set(std::vector<PickleNodeId> items) {
  return Items(PickleKind::kSet, std::move(items));
}

PickleNodeId TorchTreeBuilder::Dict(std::vector<std::pair<PickleNodeId, PickleNodeId>> entries,
                                    bool ordered) {
  const PickleNodeId id = Add(PickleKind::kDict);
  tree_.mutable_node(id).entries = std::move(entries);
  tree_.mutable_node(id).ordered = ordered;
  return id;
}

void TorchTreeBuilder::Append(PickleNodeId list, PickleNodeId item) {
  tree_.mutable_node(list).items.push_back(item);
}

void TorchTreeBuilder::Insert(PickleNodeId dict, PickleNodeId key, PickleNodeId value) {
  tree_.mutable_node(dict).entries.emplace_back(key, value);
}

PickleNodeId TorchTreeBuilder::Size(const Shape& dims) {
  std::vector<PickleNodeId> items;
  for (Index d : dims) items.push_back(Int(d));
  const PickleNodeId id = Tuple(std::move(items));
  tree_.mutable_node(id).torch_size = true;
  return id;
}

PickleNodeId TorchTreeBuilder::Global(std::string name) {
  return Text(PickleKind::kGlobal, std::move(name));
}

PickleNodeId TorchTreeBuilder::DTypeObject(DType dtype) {
  return Global("torch." + std::string(TorchGlobalsOf(dtype).dtype_object));
}

PickleNodeId TorchTreeBuilder::Device(std::string type) {
  return Record("torch.device", {Str(std::move(type))});
}

PickleNodeId TorchTreeBuilder::Record(std::string class_name, std::vector<PickleNodeId> args,
                                      PickleNodeId state, bool newobj) {
  const PickleNodeId arg_tuple = Tuple(std::move(args));
  const PickleNodeId id = Add(PickleKind::kRecord);
  PickleNode& n = tree_.mutable_node(id);
  n.text = std::move(class_name);
  n.args = arg_tuple;
  n.state = state;
  n.newobj = newobj;
  return id;
}

PickleNodeId TorchTreeBuilder::Object(std::string class_name, PickleNodeId state) {
  return Record(std::move(class_name), {}, state, /*newobj=*/true);
}

PickleNodeId TorchTreeBuilder::Enum(std::string class_name, PickleNodeId value) {
  return Record(std::move(class_name), {value});
}

std::string TorchTreeBuilder::NewKey(std::string wanted) {
  for (size_t n = storages_.size(); !keys_.insert(wanted).second; ++n) wanted = std::to_string(n);
  return wanted;
}

PickleNodeId TorchTreeBuilder::Rebuild(const TensorInfo& info, Index offset, const Shape& shape,
                                       const Shape& strides, bool requires_grad) {
  const bool typed = !TorchGlobalsOf(info.dtype).storage_class.empty();
  std::vector<PickleNodeId> shape_items, stride_items;
  for (Index d : shape) shape_items.push_back(Int(d));
  for (Index s : strides) stride_items.push_back(Int(s));
  std::vector<PickleNodeId> args = {info.persistent_id,
                                    Int(offset),
                                    Tuple(std::move(shape_items)),
                                    Tuple(std::move(stride_items)),
                                    Bool(requires_grad),
                                    Dict({}, /*ordered=*/true)};
  if (!typed) args.push_back(DTypeObject(info.dtype));
  const PickleNodeId id =
      Record(typed ? "torch._utils._rebuild_tensor_v2" : "torch._utils._rebuild_tensor_v3", args);
  tensors_.emplace(id, info);
  return id;
}

PickleNodeId TorchTreeBuilder::Tensor(DType dtype, Shape shape, Fill fill, bool requires_grad) {
  const std::string_view storage = TorchGlobalsOf(dtype).storage_class;
  const Index numel = ProductOf(shape);
  const uint64_t bytes = static_cast<uint64_t>(numel) * DTypeSize(dtype);
  const std::string key = NewKey(std::to_string(storages_.size()));
  storages_.push_back({.key = key, .num_bytes = bytes, .bytes = {}, .fill = std::move(fill)});
  const PickleNodeId pid_tuple = Tuple(
      {Str("storage"),
       Global(storage.empty() ? "torch.storage.UntypedStorage" : "torch." + std::string(storage)),
       Str(key), Str("cpu"), Int(storage.empty() ? static_cast<Index>(bytes) : numel)});
  const PickleNodeId pid = Add(PickleKind::kPersistentId);
  tree_.mutable_node(pid).items = {pid_tuple};
  const Shape strides = RowMajorStrides(shape);
  return Rebuild({pid, dtype, bytes}, 0, shape, strides, requires_grad);
}

Result<PickleNodeId> TorchTreeBuilder::View(PickleNodeId tensor, Index storage_offset, Shape shape,
                                            Shape strides) {
  const auto it = tensors_.find(tensor);
  if (it == tensors_.end()) {
    return InvalidArgumentError("node " + std::to_string(tensor) + " is not a tensor made here");
  }
  const TensorInfo info = it->second;
  const std::string what = "view (offset " + std::to_string(storage_offset) + ", size " +
                           FormatShape(shape) + ", stride " + FormatShape(strides) + ")";
  if (shape.size() != strides.size() || storage_offset < 0 ||
      std::any_of(shape.begin(), shape.end(), [](Index d) { return d < 0; }) ||
      std::any_of(strides.begin(), strides.end(), [](Index s) { return s < 0; })) {
    return InvalidArgumentError(what + " is not a view: negative or of two ranks");
  }
  RESHARD_ASSIGN_OR_RETURN(const Index numel, CheckedProduct(shape));
  if (numel > 0) {
    const std::optional<Index> last = LastOffset(storage_offset, shape, strides);
    const uint64_t elements = info.storage_bytes / DTypeSize(info.dtype);
    if (!last || static_cast<uint64_t>(*last) >= elements) {
      return InvalidArgumentError(what + " reaches past its storage of " +
                                  std::to_string(elements) + " elements");
    }
  }
  return Rebuild(info, storage_offset, shape, strides, /*requires_grad=*/false);
}

Result<PickleNodeId> TorchTreeBuilder::Copy(const TorchFile& file, PickleNodeId id) {
  auto& done = copied_[&file];
  if (const auto it = done.find(id); it != done.end()) return it->second;
  PickleNode n = file.tree().node(id);
  for (PickleNodeId& c : n.items) {
    RESHARD_ASSIGN_OR_RETURN(c, Copy(file, c));
  }
  for (auto& [k, v] : n.entries) {
    RESHARD_ASSIGN_OR_RETURN(k, Copy(file, k));
    RESHARD_ASSIGN_OR_RETURN(v, Copy(file, v));
  }
  if (n.args != kNoPickleNode) {
    RESHARD_ASSIGN_OR_RETURN(n.args, Copy(file, n.args));
  }
  if (n.state != kNoPickleNode) {
    RESHARD_ASSIGN_OR_RETURN(n.state, Copy(file, n.state));
  }
  if (n.kind == PickleKind::kPersistentId) {
    // ("storage", type, key, location, numel): the storage comes along under a key of ours.
    const PickleNode& pid = tree_.node(n.items[0]);
    if (pid.kind == PickleKind::kTuple && pid.items.size() == 5 &&
        tree_.node(pid.items[2]).kind == PickleKind::kStr) {
      const std::string key = tree_.node(pid.items[2]).text;
      auto& keys = copied_keys_[&file];
      auto it = keys.find(key);
      if (it == keys.end()) {
        const std::string entry_name = file.root() + "/data/" + key;
        const ZipEntry* entry = file.archive().Find(entry_name);
        if (entry == nullptr) {
          return DataLossError("storage " + Quote(key) + " has no entry " + Quote(entry_name));
        }
        const std::string ours = NewKey(key);
        storages_.push_back({.key = ours,
                             .num_bytes = entry->size,
                             .bytes = file.archive().data(*entry),
                             .fill = [](std::span<std::byte>) { return Status::Ok(); }});
        it = keys.emplace(key, ours).first;
      }
      if (it->second != key) {
        std::vector<PickleNodeId> items = tree_.node(n.items[0]).items;
        items[2] = Str(it->second);
        n.items[0] = Tuple(std::move(items));
      }
    }
  }
  const PickleNodeId ours = tree_.Add(std::move(n));
  done.emplace(id, ours);
  return ours;
}

Status TorchTreeBuilder::Write(const std::string& path, PickleNodeId root,
                               const TorchWriteOptions& options) const {
  return WriteTorchTree(path, tree_, root, storages_, options);
}

Result<uint64_t> TorchTreeBuilder::AppendTo(AtomicFileWriter& out, PickleNodeId root,
                                            const std::string& archive_root) const {
  return AppendTorchTree(out, tree_, root, storages_, archive_root);
}

Result<std::string> TorchTreeBuilder::Archive(PickleNodeId root,
                                              const std::string& archive_root) const {
  return TorchTreeArchive(tree_, root, storages_, archive_root);
}

}  // namespace reshard
