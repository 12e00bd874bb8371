#include "reshard/io/torch_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

namespace reshard {
namespace {

struct DTypeRow {
  std::string_view global;  // storage class or dtype object, "module.name"
  std::string_view name;    // safetensors spelling
  size_t size;
  std::optional<DType> dtype;
};

// clang-format off
constexpr DTypeRow kDTypes[] = {
    {"torch.DoubleStorage", "F64", 8, DType::kF64},     {"torch.float64", "F64", 8, DType::kF64},
    {"torch.FloatStorage", "F32", 4, DType::kF32},      {"torch.float32", "F32", 4, DType::kF32},
    {"torch.HalfStorage", "F16", 2, DType::kF16},       {"torch.float16", "F16", 2, DType::kF16},
    {"torch.BFloat16Storage", "BF16", 2, DType::kBF16}, {"torch.bfloat16", "BF16", 2, DType::kBF16},
    {"torch.LongStorage", "I64", 8, DType::kI64},       {"torch.int64", "I64", 8, DType::kI64},
    {"torch.IntStorage", "I32", 4, DType::kI32},        {"torch.int32", "I32", 4, DType::kI32},
    {"torch.ShortStorage", "I16", 2, DType::kI16},      {"torch.int16", "I16", 2, DType::kI16},
    {"torch.CharStorage", "I8", 1, DType::kI8},         {"torch.int8", "I8", 1, DType::kI8},
    {"torch.ByteStorage", "U8", 1, DType::kU8},         {"torch.uint8", "U8", 1, DType::kU8},
    {"torch.BoolStorage", "BOOL", 1, DType::kBool},     {"torch.bool", "BOOL", 1, DType::kBool},
    {"torch.uint16", "U16", 2, DType::kU16},            {"torch.uint32", "U32", 4, DType::kU32},
    {"torch.uint64", "U64", 8, DType::kU64},
    {"torch.float8_e4m3fn", "F8_E4M3", 1, DType::kF8E4M3},
    {"torch.float8_e5m2", "F8_E5M2", 1, DType::kF8E5M2},
    {"torch.float8_e8m0fnu", "F8_E8M0", 1, std::nullopt},
    {"torch.ComplexFloatStorage", "C64", 8, std::nullopt},
    {"torch.complex64", "C64", 8, std::nullopt},
    {"torch.ComplexDoubleStorage", "C128", 16, std::nullopt},
    {"torch.complex128", "C128", 16, std::nullopt},
    // Untyped storages count bytes; the tensor's dtype comes from _rebuild_tensor_v3.
    {"torch.storage.UntypedStorage", "U8", 1, DType::kU8},
};
// clang-format on

constexpr std::string_view kRebuildV2 = "torch._utils._rebuild_tensor_v2";
constexpr std::string_view kRebuildV3 = "torch._utils._rebuild_tensor_v3";
constexpr std::string_view kRebuildParameter = "torch._utils._rebuild_parameter";
constexpr std::string_view kRebuildFromType = "torch._tensor._rebuild_from_type_v2";
constexpr std::string_view kTensorType = "torch.Tensor";
constexpr std::string_view kParameterType = "torch.nn.parameter.Parameter";
constexpr std::string_view kRebuildParameterWithState =
    "torch._utils._rebuild_parameter_with_state";

std::string Quote(std::string_view s) { return fmt::format("\"{}\"", s); }

// The pickle magic number torch.save wrote before 1.6 (an int, 0x1950a86a20f9469cfc6c).
constexpr unsigned char kLegacyMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                          0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};

bool IsLegacy(std::span<const std::byte> b) {
  if (b.size() >= sizeof(kLegacyMagic) &&
      std::memcmp(b.data(), kLegacyMagic, sizeof(kLegacyMagic)) == 0) {
    return true;
  }
  return b.size() >= 262 && std::memcmp(b.data() + 257, "ustar", 5) == 0;  // a tar archive
}

// The root directory: the one `<root>/data.pkl` entry with no other '/' in it.
Result<std::string> FindRoot(const ZipArchive& zip) {
  std::string root;
  for (const ZipEntry& e : zip.entries()) {
    const size_t slash = e.name.find('/');
    if (slash == std::string::npos || e.name.substr(slash) != "/data.pkl") continue;
    if (!root.empty()) {
      return DataLossError("two object trees in one archive: " + Quote(root + "/data.pkl") +
                           " and " + Quote(e.name));
    }
    root = e.name.substr(0, slash);
  }
  if (root.empty()) {
    return DataLossError("a zip archive without a <root>/data.pkl entry: not a torch.save file (" +
                         std::to_string(zip.entries().size()) + " entries)");
  }
  return root;
}

}  // namespace

bool LooksLikeTorchFile(std::span<const std::byte> bytes) {
  return (bytes.size() >= 4 && std::memcmp(bytes.data(), "PK\x03\x04", 4) == 0) || IsLegacy(bytes);
}

std::optional<TorchDType> TorchDTypeOf(std::string_view global) {
  for (const DTypeRow& row : kDTypes) {
    if (row.global == global) return TorchDType{row.name, row.size, row.dtype};
  }
  return std::nullopt;
}

TorchDTypeGlobals TorchGlobalsOf(DType dtype) {
  constexpr std::string_view kTorch = "torch.";
  TorchDTypeGlobals globals;
  for (const DTypeRow& row : kDTypes) {
    if (row.dtype != dtype || !row.global.starts_with(kTorch)) continue;
    const std::string_view name = row.global.substr(kTorch.size());
    if (name.find('.') != std::string_view::npos) continue;  // torch.storage.UntypedStorage
    (name.ends_with("Storage") ? globals.storage_class : globals.dtype_object) = name;
  }
  return globals;
}

bool TorchTensor::is_contiguous() const {
  Index expected = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] != 1 && strides[k] != expected) return numel() == 0;
    expected *= shape[k];
  }
  return true;
}

// Walks the object tree, naming tensors by their path and checking each against its storage.
//
// A shared object (recalled from the pickle's memo) is walked once per path to it, since each
// path names its tensors; parts of the tree that hold no tensor are not entered, and the walk
// is bounded (PickleLimits::max_expanded objects, 64 times as many bytes of paths), so that a
// DAG of shared objects costs what the file holds or is refused.
class TorchTreeReader {
 public:
  TorchTreeReader(TorchFile& file, const PickleLimits& limits)
      : f_(file),
        limits_(limits),
        holds_tensor_(file.tree_.size(), kUnknown),
        walk_cost_(file.tree_.size(), 0) {}
  /// Walks the whole tree from its root, refusing first a walk past the bound.
  Status WalkRoot();

 private:
  enum : int8_t { kUnknown = -1, kNo = 0, kYes = 1 };
  Status Walk(PickleNodeId id, const std::string& path);
  // Whether the walk below `id` can meet a tensor, and how many objects Walk(id) visits
  // (saturating); each computed once per node.
  bool HoldsTensor(PickleNodeId id);
  uint64_t WalkCost(PickleNodeId id);
  Status TooMuch(PickleNodeId id, const std::string& path) const;
  Status Count(PickleNodeId id, const std::string& path);
  const PickleNode& N(PickleNodeId id) const { return f_.tree_.node(id); }
  Status Error(const std::string& path, const std::string& message) const {
    return DataLossError("tensor " + Quote(path) + ": " + message);
  }
  Result<Index> Int(PickleNodeId id, const std::string& path, const char* what) const;
  Result<Shape> Ints(PickleNodeId id, const std::string& path, const char* what) const;
  Result<size_t> Storage(PickleNodeId pid, const std::string& path);
  Status AddTensor(PickleNodeId node, std::string_view rebuild, PickleNodeId args,
                   const std::string& path, bool parameter, PickleNodeId requires_grad);
  Status AddTensorOfType(PickleNodeId id, const std::string& path);
  Status CheckBounds(const TorchTensor& t) const;

  TorchFile& f_;
  const PickleLimits& limits_;
  std::vector<int8_t> holds_tensor_;
  std::vector<uint64_t> walk_cost_;  // 0: not known yet
  uint64_t path_bytes_ = 0;
  std::unordered_map<std::string, size_t> storage_by_key_;
};

bool IsTensorRecord(const std::string& name) {
  return name == kRebuildV2 || name == kRebuildV3 || name == kRebuildParameter ||
         name == kRebuildParameterWithState || name == kRebuildFromType;
}

bool TorchTreeReader::HoldsTensor(PickleNodeId id) {
  if (holds_tensor_[id] != kUnknown) return holds_tensor_[id] == kYes;
  const PickleNode& n = N(id);
  bool holds = false;
  switch (n.kind) {
    case PickleKind::kDict:
      for (const auto& [k, v] : n.entries) holds = holds || HoldsTensor(v);
      break;
    case PickleKind::kList:
    case PickleKind::kTuple:
      for (PickleNodeId c : n.items) holds = holds || HoldsTensor(c);
      break;
    case PickleKind::kRecord:
      holds = IsTensorRecord(n.text) || (n.state != kNoPickleNode && HoldsTensor(n.state));
      for (PickleNodeId c : N(n.args).items) holds = holds || HoldsTensor(c);
      break;
    default:
      break;
  }
  holds_tensor_[id] = holds ? kYes : kNo;
  return holds;
}

// Mirrors Walk: one for `id`, and what its walk enters.
uint64_t TorchTreeReader::WalkCost(PickleNodeId id) {
  if (walk_cost_[id] != 0) return walk_cost_[id];
  const auto add = [](uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; };
  uint64_t cost = 1;
  const PickleNode& n = N(id);
  if (HoldsTensor(id)) {
    switch (n.kind) {
      case PickleKind::kDict:
        for (const auto& [k, v] : n.entries) cost = add(cost, WalkCost(v));
        break;
      case PickleKind::kList:
      case PickleKind::kTuple:
        for (PickleNodeId c : n.items) cost = add(cost, WalkCost(c));
        break;
      case PickleKind::kRecord: {
        const std::vector<PickleNodeId>& a = N(n.args).items;
        if (n.text == kRebuildFromType) {
          if (a.size() == 4) cost = add(cost, WalkCost(a[3]));
        } else if (!IsTensorRecord(n.text)) {
          if (n.state != kNoPickleNode) cost = add(cost, WalkCost(n.state));
          for (PickleNodeId c : a) cost = add(cost, WalkCost(c));
        }
        break;
      }
      default:
        break;
    }
  }
  walk_cost_[id] = cost;
  return cost;
}

Status TorchTreeReader::WalkRoot() {
  const PickleNodeId root = f_.tree_.root();
  if (WalkCost(root) > limits_.max_expanded) return TooMuch(root, "");
  return Walk(root, "");
}

Status TorchTreeReader::Count(PickleNodeId id, const std::string& path) {
  path_bytes_ += path.size();
  if (++f_.objects_walked_ <= limits_.max_expanded && path_bytes_ <= 64 * limits_.max_expanded) {
    return Status::Ok();
  }
  return TooMuch(id, path);
}

Status TorchTreeReader::TooMuch(PickleNodeId id, const std::string& path) const {
  const uint64_t expanded = f_.tree_.expanded_size(f_.tree_.root());
  return DataLossError(
      "naming the tensors by their paths from the root would walk more than " +
      std::to_string(limits_.max_expanded) + " objects or " +
      std::to_string(64 * limits_.max_expanded) + " bytes of paths (PickleLimits::max_expanded)" +
      (path.empty() ? std::string() : ", at " + Quote(path)) + " (pickle byte " +
      std::to_string(N(id).offset) +
      "): objects shared through the pickle's memo are reached by too many paths (the tree, "
      "each shared object copied, would hold " +
      (expanded == UINT64_MAX ? std::string("2^64 or more") : std::to_string(expanded)) +
      " objects)");
}

Result<Index> TorchTreeReader::Int(PickleNodeId id, const std::string& path,
                                   const char* what) const {
  if (N(id).kind != PickleKind::kInt) {
    return Error(path, std::string(what) + " is a " + std::string(PickleKindName(N(id).kind)) +
                           ", not an int");
  }
  return N(id).int_value;
}

Result<Shape> TorchTreeReader::Ints(PickleNodeId id, const std::string& path,
                                    const char* what) const {
  if (N(id).kind != PickleKind::kTuple) {
    return Error(path, std::string(what) + " is a " + std::string(PickleKindName(N(id).kind)) +
                           ", not a tuple");
  }
  Shape out;
  for (PickleNodeId item : N(id).items) {
    RESHARD_ASSIGN_OR_RETURN(const Index v, Int(item, path, what));
    if (v < 0 || v > kMaxIndex) {
      return Error(path, std::string(what) + " holds " + std::to_string(v) +
                             ", not an integer in [0, 2^62]");
    }
    out.push_back(v);
  }
  return out;
}

// ("storage", <type>, key, location, numel) -> index into storages_, checked against the entry.
Result<size_t> TorchTreeReader::Storage(PickleNodeId pid_node, const std::string& path) {
  if (N(pid_node).kind != PickleKind::kPersistentId) {
    return Error(path, "the storage argument is a " +
                           std::string(PickleKindName(N(pid_node).kind)) + ", not a persistent id");
  }
  const PickleNode& pid = N(N(pid_node).items[0]);
  if (pid.kind != PickleKind::kTuple || pid.items.size() != 5 ||
      N(pid.items[0]).kind != PickleKind::kStr || N(pid.items[0]).text != "storage" ||
      N(pid.items[1]).kind != PickleKind::kGlobal || N(pid.items[2]).kind != PickleKind::kStr) {
    return Error(path, "persistent id is not (\"storage\", type, key, location, numel)");
  }
  const std::string& type = N(pid.items[1]).text;
  const std::optional<TorchDType> dtype = TorchDTypeOf(type);
  if (!dtype || type.find("Storage") == std::string::npos) {
    return UnimplementedError("tensor " + Quote(path) + ": storage type " + type +
                              " is not read (quantized or unknown)");
  }
  RESHARD_ASSIGN_OR_RETURN(const Index numel, Int(pid.items[4], path, "storage numel"));
  const std::string& key = N(pid.items[2]).text;
  const auto it = storage_by_key_.find(key);
  if (it != storage_by_key_.end()) {
    const TorchStorage& s = f_.storages_[it->second];
    if (s.dtype.name != dtype->name || s.numel != numel) {
      return Error(path, "storage " + Quote(key) + " declared as " + std::to_string(numel) +
                             " elements of " + std::string(dtype->name) + " and elsewhere as " +
                             std::to_string(s.numel) + " of " + std::string(s.dtype.name));
    }
    return it->second;
  }
  const std::string entry_name = f_.root_ + "/data/" + key;
  const ZipEntry* entry = f_.zip_.Find(entry_name);
  if (entry == nullptr) {
    return Error(path, "storage " + Quote(key) + " has no entry " + Quote(entry_name));
  }
  const std::optional<Index> bytes = CheckedMul(numel, static_cast<Index>(dtype->size));
  if (numel < 0 || !bytes || static_cast<uint64_t>(*bytes) != entry->size) {
    return Error(path, "storage " + Quote(key) + " declares " + std::to_string(numel) +
                           " elements of " + std::string(dtype->name) + " but " +
                           Quote(entry_name) + " holds " + std::to_string(entry->size) + " bytes");
  }
  f_.storages_.push_back(TorchStorage{key, *dtype, numel, f_.zip_.data(*entry)});
  storage_by_key_.emplace(key, f_.storages_.size() - 1);
  return f_.storages_.size() - 1;
}

Status TorchTreeReader::CheckBounds(const TorchTensor& t) const {
  if (t.shape.size() != t.strides.size()) {
    return Error(t.name, "size " + FormatShape(t.shape) + " and stride " + FormatShape(t.strides) +
                             " differ in length");
  }
  const Result<Index> numel = CheckedProduct(t.shape);
  if (!numel.ok())
    return Error(t.name, "size " + FormatShape(t.shape) + " has more than 2^62 elements");
  const std::optional<Index> bytes = CheckedMul(*numel, static_cast<Index>(t.dtype.size));
  if (!bytes || *bytes > kMaxIndex) {
    return Error(t.name, "size " + FormatShape(t.shape) + " of " + std::string(t.dtype.name) +
                             " has more than 2^62 bytes");
  }
  const TorchStorage& s = f_.storages_[t.storage];
  const uint64_t storage_bytes = s.bytes.size();
  if (*numel == 0) return Status::Ok();
  const std::optional<Index> last = LastOffset(t.storage_offset, t.shape, t.strides);
  const std::optional<Index> end_elements = last ? CheckedAdd(*last, 1) : std::nullopt;
  const std::optional<Index> end_bytes =
      end_elements ? CheckedMul(*end_elements, static_cast<Index>(t.dtype.size)) : std::nullopt;
  if (!end_bytes || static_cast<uint64_t>(*end_bytes) > storage_bytes) {
    return Error(t.name, "view (offset " + std::to_string(t.storage_offset) + ", size " +
                             FormatShape(t.shape) + ", stride " + FormatShape(t.strides) + ") of " +
                             std::string(t.dtype.name) + " reaches past storage " + Quote(s.key) +
                             " of " + std::to_string(storage_bytes) + " bytes");
  }
  return Status::Ok();
}

// `node` is the tree's value for the tensor; `rebuild` (_rebuild_tensor_v2 or _v3) is applied to
// `args`: (storage, storage_offset, size, stride, requires_grad, hooks[, dtype (v3)][, metadata])
Status TorchTreeReader::AddTensor(PickleNodeId node, std::string_view rebuild, PickleNodeId args,
                                  const std::string& path, bool parameter,
                                  PickleNodeId requires_grad) {
  const bool v3 = rebuild == kRebuildV3;
  if (N(args).kind != PickleKind::kTuple)
    return Error(path, std::string(rebuild) + " of a non-tuple");
  const std::vector<PickleNodeId>& a = N(args).items;
  if (a.size() < (v3 ? 7u : 5u)) {
    return Error(path, std::string(rebuild) + " with " + std::to_string(a.size()) + " arguments");
  }
  TorchTensor t;
  t.name = path;
  t.node = node;
  t.parameter = parameter;
  RESHARD_ASSIGN_OR_RETURN(t.storage, Storage(a[0], path));
  RESHARD_ASSIGN_OR_RETURN(t.storage_offset, Int(a[1], path, "storage_offset"));
  if (t.storage_offset < 0 || t.storage_offset > kMaxIndex) {
    return Error(path,
                 "storage_offset " + std::to_string(t.storage_offset) + " is negative or huge");
  }
  RESHARD_ASSIGN_OR_RETURN(t.shape, Ints(a[2], path, "size"));
  RESHARD_ASSIGN_OR_RETURN(t.strides, Ints(a[3], path, "stride"));
  const PickleNodeId grad = requires_grad != kNoPickleNode ? requires_grad : a[4];
  t.requires_grad = N(grad).kind == PickleKind::kBool && N(grad).bool_value;
  const TorchStorage& s = f_.storages_[t.storage];
  t.dtype = s.dtype;
  if (v3) {
    const PickleNode& d = N(a[6]);
    const std::optional<TorchDType> dtype =
        d.kind == PickleKind::kGlobal ? TorchDTypeOf(d.text) : std::nullopt;
    if (!dtype) {
      return UnimplementedError("tensor " + Quote(path) + ": dtype " +
                                (d.kind == PickleKind::kGlobal ? d.text : "argument") +
                                " is not read");
    }
    t.dtype = *dtype;
  }
  if (s.dtype.name != t.dtype.name && s.dtype.name != "U8") {
    return Error(path, "a " + std::string(t.dtype.name) + " tensor over a " +
                           std::string(s.dtype.name) + " storage");
  }
  RESHARD_RETURN_IF_ERROR(CheckBounds(t));
  f_.tensors_.push_back(std::move(t));
  return Status::Ok();
}

// A tensor that carries Python attributes (DeepSpeed's ZeRO-3 flat groups have a ds_id), saved
// as _rebuild_from_type_v2(func, type, args, state): func(*args) made into `type` with the
// attributes `state`. The attributes stay in the tree; the tensor is func's.
Status TorchTreeReader::AddTensorOfType(PickleNodeId id, const std::string& path) {
  const PickleNode& n = N(id);
  const std::vector<PickleNodeId>& a = N(n.args).items;
  if (a.size() != 4 || N(a[0]).kind != PickleKind::kGlobal ||
      (N(a[0]).text != kRebuildV2 && N(a[0]).text != kRebuildV3)) {
    return Error(
        path, n.text + " of something other than a tensor rebuilt by " + std::string(kRebuildV2));
  }
  if (N(a[1]).kind != PickleKind::kGlobal ||
      (N(a[1]).text != kTensorType && N(a[1]).text != kParameterType)) {
    return Error(path, n.text + " into a type other than " + std::string(kTensorType) + " or " +
                           std::string(kParameterType));
  }
  RESHARD_RETURN_IF_ERROR(
      AddTensor(id, N(a[0]).text, a[2], path, N(a[1]).text == kParameterType, kNoPickleNode));
  return Walk(a[3], path);
}

Status TorchTreeReader::Walk(PickleNodeId id, const std::string& path) {
  RESHARD_RETURN_IF_ERROR(Count(id, path));
  if (!HoldsTensor(id)) return Status::Ok();
  const auto join = [&](const std::string& c) { return path.empty() ? c : path + "." + c; };
  const PickleNode& n = N(id);
  switch (n.kind) {
    case PickleKind::kDict:
      for (size_t i = 0; i < n.entries.size(); ++i) {
        RESHARD_RETURN_IF_ERROR(
            Walk(n.entries[i].second, join(PickleKeyName(f_.tree_, n.entries[i].first, i))));
      }
      return Status::Ok();
    case PickleKind::kList:
    case PickleKind::kTuple:
      for (size_t i = 0; i < n.items.size(); ++i) {
        RESHARD_RETURN_IF_ERROR(Walk(n.items[i], join(std::to_string(i))));
      }
      return Status::Ok();
    case PickleKind::kRecord: {
      if (n.text == kRebuildV2 || n.text == kRebuildV3) {
        return AddTensor(id, n.text, n.args, path, false, kNoPickleNode);
      }
      if (n.text == kRebuildFromType) return AddTensorOfType(id, path);
      const std::vector<PickleNodeId>& a = N(n.args).items;
      if (n.text == kRebuildParameter || n.text == kRebuildParameterWithState) {
        if (a.size() < 2 || N(a[0]).kind != PickleKind::kRecord ||
            (N(a[0]).text != kRebuildV2 && N(a[0]).text != kRebuildV3)) {
          return Error(path, n.text + " of something other than a tensor");
        }
        return AddTensor(a[0], N(a[0]).text, N(a[0]).args, path, true, a[1]);
      }
      if (n.state != kNoPickleNode) RESHARD_RETURN_IF_ERROR(Walk(n.state, path));
      for (size_t i = 0; i < a.size(); ++i) {
        RESHARD_RETURN_IF_ERROR(Walk(a[i], join(std::to_string(i))));
      }
      return Status::Ok();
    }
    default:
      return Status::Ok();
  }
}

Status TorchFile::Load(std::span<const std::byte> bytes, const PickleOptions& options) {
  Result<ZipArchive> zip = ZipArchive::Parse(bytes);
  if (!zip.ok()) {
    if (IsLegacy(bytes)) {
      return UnimplementedError(
          "a legacy torch.save file (PyTorch before 1.6: a pickle stream or a tar archive, not "
          "a zip); resave it with a current PyTorch, e.g. torch.save(torch.load(path, "
          "weights_only=True), new_path)");
    }
    return zip.status();
  }
  zip_ = std::move(zip).value();
  RESHARD_ASSIGN_OR_RETURN(root_, FindRoot(zip_));
  if (const ZipEntry* order = zip_.Find(root_ + "/byteorder")) {
    const auto b = zip_.data(*order);
    const std::string_view value(reinterpret_cast<const char*>(b.data()), b.size());
    if (value == "big") {
      return UnimplementedError("storages are big-endian (" + root_ +
                                "/byteorder); only little-endian files are read");
    }
    if (value != "little") {
      return DataLossError(root_ + "/byteorder is " + Quote(value) + ", not little or big");
    }
  }
  const ZipEntry* pkl = zip_.Find(root_ + "/data.pkl");
  Result<PickleTree> tree = ParsePickle(zip_.data(*pkl), options);
  if (!tree.ok()) return tree.status().Annotate(root_ + "/data.pkl");
  tree_ = std::move(tree).value();
  TorchTreeReader reader(*this, options.limits);
  RESHARD_RETURN_IF_ERROR(reader.WalkRoot().Annotate(root_ + "/data.pkl"));
  for (size_t i = 0; i < tensors_.size(); ++i) tensor_by_node_.emplace(tensors_[i].node, i);
  return Status::Ok();
}

Result<TorchFile> TorchFile::Parse(std::span<const std::byte> bytes, const PickleOptions& options) {
  TorchFile file;
  RESHARD_RETURN_IF_ERROR(file.Load(bytes, options));
  return file;
}

Result<TorchFile> TorchFile::Open(const std::string& path, const PickleOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  TorchFile file;
  file.file_.emplace(std::move(mapped));
  RESHARD_RETURN_IF_ERROR(
      file.Load(file.file_->bytes(), options).Annotate("reading " + Quote(path)));
  return file;
}

const TorchTensor* TorchFile::TensorAt(PickleNodeId node) const {
  const auto it = tensor_by_node_.find(node);
  return it == tensor_by_node_.end() ? nullptr : &tensors_[it->second];
}

Status TorchFile::CopyTo(const TorchTensor& t, std::span<std::byte> out) const {
  if (out.size() != t.num_bytes()) {
    return InvalidArgumentError("tensor " + Quote(t.name) + " has " +
                                std::to_string(t.num_bytes()) + " bytes, the buffer " +
                                std::to_string(out.size()));
  }
  if (out.empty()) return Status::Ok();
  const std::byte* base = storages_[t.storage].bytes.data();
  const size_t es = t.dtype.size;
  if (t.is_contiguous()) {
    std::memcpy(out.data(), base + static_cast<size_t>(t.storage_offset) * es, out.size());
    return Status::Ok();
  }
  // Odometer over all but the last dimension; the last is a run (one memcpy when its stride
  // is 1).
  const size_t rank = t.shape.size();
  const Index inner = t.shape[rank - 1], inner_stride = t.strides[rank - 1];
  Shape index(rank - 1, 0);
  std::byte* dst = out.data();
  for (;;) {
    Index offset = t.storage_offset;
    for (size_t k = 0; k + 1 < rank; ++k) offset += index[k] * t.strides[k];
    if (inner_stride == 1) {
      std::memcpy(dst, base + static_cast<size_t>(offset) * es, static_cast<size_t>(inner) * es);
      dst += static_cast<size_t>(inner) * es;
    } else {
      for (Index i = 0; i < inner; ++i, dst += es) {
        std::memcpy(dst, base + static_cast<size_t>(offset + i * inner_stride) * es, es);
      }
    }
    size_t k = rank - 1;
    for (;;) {
      if (k == 0) return Status::Ok();
      --k;
      if (++index[k] < t.shape[k]) break;
      index[k] = 0;
    }
  }
}

void TorchFile::ReleasePages(const TorchTensor& tensor) const {
  if (!file_) return;  // bytes owned by the caller
  ReleaseMappedPages(storages_[tensor.storage].bytes);
}

Status ExportToSafetensors(const TorchFile& file, const std::string& path, bool overwrite) {
  std::vector<TensorToWrite> tensors;
  std::unordered_map<std::string_view, const TorchTensor*> names;
  // What is written dense may add to the storages at most their own size or 1 GiB.
  uint64_t storage_bytes = 0;
  for (const TorchStorage& s : file.storages()) storage_bytes += s.bytes.size();
  const uint64_t allowed = storage_bytes + std::max<uint64_t>(storage_bytes, uint64_t{1} << 30);
  uint64_t dense_bytes = 0;
  for (const TorchTensor& t : file.tensors()) {
    dense_bytes += t.num_bytes();  // each at most 2^62 (TorchFile), so this cannot wrap
    if (dense_bytes <= allowed) continue;
    return InvalidArgumentError(
        "tensor " + Quote(t.name) + " (" + std::string(t.dtype.name) + ", size " +
        FormatShape(t.shape) + ", stride " + FormatShape(t.strides) + ") is " +
        std::to_string(t.num_bytes()) +
        " bytes written dense, which brings the tensors to write to " +
        std::to_string(dense_bytes) + " bytes for the " + std::to_string(storage_bytes) +
        " bytes of storages in the file. safetensors holds dense tensors only; what repeats "
        "the storages (views with stride 0, as expand() makes; a tensor under several names) "
        "may add at most the storages' own size or 1 GiB. Export to a .pt file instead (it "
        "keeps storages and strides as torch.save does), or save the tensors you need with "
        ".contiguous()");
  }
  for (const TorchTensor& t : file.tensors()) {
    if (!t.dtype.dtype) {
      return UnimplementedError("tensor " + Quote(t.name) + " is " + std::string(t.dtype.name) +
                                ", which safetensors files written here cannot hold");
    }
    if (!names.emplace(t.name, &t).second) {
      return InvalidArgumentError("two tensors are both named " + Quote(t.name) +
                                  " (dotted paths collide)");
    }
    tensors.push_back(TensorToWrite{.name = t.name,
                                    .dtype = *t.dtype.dtype,
                                    .shape = t.shape,
                                    .fill = [&file, &t](std::span<std::byte> out) {
                                      RESHARD_RETURN_IF_ERROR(file.CopyTo(t, out));
                                      file.ReleasePages(t);
                                      return Status::Ok();
                                    }});
  }
  return WriteSafetensors(path, std::move(tensors), {{"format", "pt"}}, {.overwrite = overwrite});
}

}  // namespace reshard
