#include "reshard/io/torch_writer.h"

#include <algorithm>
#include <cstring>
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
  explicit ZipStreamWriter(AtomicFileWriter& out) : out_(out) {}

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
    RESHARD_RETURN_IF_ERROR(out_.Append(data));
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

 private:
  struct Entry {
    std::string name;
    uint64_t offset;
    uint64_t size;
    uint32_t crc;
  };
  Status Append(std::string_view bytes) {
    pos_ += bytes.size();
    return out_.Append(bytes);
  }

  AtomicFileWriter& out_;
  uint64_t pos_ = 0;
  std::vector<Entry> entries_;
};

// Pickle opcodes for the values a state dict needs.
struct PickleOut {
  std::string b = "\x80\x02";
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      b += 'K';
      Put(b, static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      b += 'M';
      Put(b, static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      b += 'J';
      Put(b, static_cast<uint64_t>(v), 4);
    } else {
      b += "\x8a\x08";
      Put(b, static_cast<uint64_t>(v), 8);
    }
  }
  void Str(std::string_view s) {
    b += 'X';
    Put(b, s.size(), 4);
    b += s;
  }
  void Global(std::string_view module, std::string_view name) {
    b += 'c';
    b += module;
    b += '\n';
    b += name;
    b += '\n';
  }
  void IntTuple(std::span<const Index> values) {
    if (values.empty()) {
      b += ')';
      return;
    }
    if (values.size() > 3) b += '(';
    for (Index v : values) Int(v);
    b += values.size() > 3 ? 't' : static_cast<char>(0x84 + values.size());
  }
  void EmptyOrderedDict() {
    Global("collections", "OrderedDict");
    b += ")R";
  }
};

// torch's storage class for a dtype, or "" where torch writes an untyped storage and v3.
std::string_view StorageClass(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return "DoubleStorage";
    case DType::kF32:
      return "FloatStorage";
    case DType::kF16:
      return "HalfStorage";
    case DType::kBF16:
      return "BFloat16Storage";
    case DType::kI64:
      return "LongStorage";
    case DType::kI32:
      return "IntStorage";
    case DType::kI16:
      return "ShortStorage";
    case DType::kI8:
      return "CharStorage";
    case DType::kU8:
      return "ByteStorage";
    case DType::kBool:
      return "BoolStorage";
    default:
      return "";
  }
}

std::string_view DTypeObject(DType dtype) {
  switch (dtype) {
    case DType::kU16:
      return "uint16";
    case DType::kU32:
      return "uint32";
    case DType::kU64:
      return "uint64";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
    case DType::kF8E5M2:
      return "float8_e5m2";
    default:
      return "";
  }
}

// The pickle of OrderedDict(name -> tensor over storage "<i>"), as torch.save writes it.
std::string StateDictPickle(const std::vector<TensorToWrite>& tensors) {
  PickleOut p;
  p.EmptyOrderedDict();
  if (!tensors.empty()) p.b += '(';
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    const std::string_view storage = StorageClass(t.dtype);
    const Index numel = ProductOf(t.shape);
    p.Str(t.name);
    p.Global("torch._utils", storage.empty() ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
    p.b += "((";  // the arguments; the persistent id
    p.Str("storage");
    if (storage.empty()) {
      p.Global("torch.storage", "UntypedStorage");
    } else {
      p.Global("torch", storage);
    }
    p.Str(std::to_string(i));
    p.Str("cpu");
    p.Int(storage.empty() ? numel * static_cast<Index>(DTypeSize(t.dtype)) : numel);
    p.b += "tQ";
    p.Int(0);
    p.IntTuple(t.shape);
    p.IntTuple(RowMajorStrides(t.shape));
    p.b += '\x89';  // requires_grad False
    p.EmptyOrderedDict();
    if (storage.empty()) p.Global("torch", DTypeObject(t.dtype));
    p.b += "tR";
  }
  if (!tensors.empty()) p.b += 'u';
  p.b += '.';
  return p.b;
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
  size_t largest = 0;
  for (const TensorToWrite& t : tensors) {
    largest = std::max(largest, static_cast<size_t>(ProductOf(t.shape)) * DTypeSize(t.dtype));
  }
  RESHARD_ASSIGN_OR_RETURN(AtomicFileWriter out,
                           AtomicFileWriter::Create(path, {.overwrite = options.overwrite}));
  ZipStreamWriter zip(out);
  const std::string& root = options.root;
  RESHARD_RETURN_IF_ERROR(zip.Add(root + "/data.pkl", AsBytes(StateDictPickle(tensors))));
  RESHARD_RETURN_IF_ERROR(zip.Add(root + "/.format_version", AsBytes("1")));
  RESHARD_RETURN_IF_ERROR(zip.Add(root + "/.storage_alignment", AsBytes("64")));
  RESHARD_RETURN_IF_ERROR(zip.Add(root + "/byteorder", AsBytes("little")));
  std::vector<std::byte> buffer(largest);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    const std::span<std::byte> bytes(buffer.data(),
                                     static_cast<size_t>(ProductOf(t.shape)) * DTypeSize(t.dtype));
    RESHARD_RETURN_IF_ERROR(t.fill(bytes).Annotate("tensor \"" + t.name + "\""));
    RESHARD_RETURN_IF_ERROR(zip.Add(root + "/data/" + std::to_string(i), bytes));
  }
  RESHARD_RETURN_IF_ERROR(zip.Add(root + "/version", AsBytes("3\n")));
  RESHARD_RETURN_IF_ERROR(zip.Finish());
  return out.Commit();
}

}  // namespace reshard
