#include "reshard/io/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "reshard/io/file.h"

namespace reshard {
namespace {

using nlohmann::json;

// Containers nest at most three deep in a valid header (root, entry, shape); values of unknown
// keys inside an entry are skipped, but only this deep, so a hostile header cannot exhaust
// the stack or the heap with brackets.
constexpr size_t kMaxJsonDepth = 64;

constexpr std::string_view kMetadataKey = "__metadata__";

uint64_t LoadU64LittleEndian(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

// Offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing past U+10FFFF), or nullopt.
std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
    }
    i += len;
  }
  return std::nullopt;
}

// A tensor entry as the header spells it, before the checks that need all entries.
struct RawTensor {
  std::string name;
  std::optional<DType> dtype;
  Shape shape;
  std::vector<uint64_t> offsets;
  std::unordered_set<std::string> keys;
};

// SAX handler for the header. It reads the one shape a header may have and stops at the
// first departure from it, so no document tree is built and duplicate keys (which a
// tree would silently collapse) are seen.
class HeaderHandler {
 public:
  std::vector<RawTensor> tensors;
  std::map<std::string, std::string> metadata;
  Status error;

  bool null() { return Scalar("null"); }
  bool boolean(bool) { return Scalar("a boolean"); }
  bool number_integer(json::number_integer_t v) {
    return Number(v >= 0 ? std::optional<uint64_t>(static_cast<uint64_t>(v)) : std::nullopt,
                  std::to_string(v));
  }
  bool number_unsigned(json::number_unsigned_t v) { return Number(v, std::to_string(v)); }
  bool number_float(json::number_float_t, const json::string_t& raw) {
    return Number(std::nullopt, raw);
  }
  bool string(json::string_t& s) {
    if (!stack_.empty() && stack_.back() == Frame::kSkip) return true;
    if (pending_ == Pending::kMetadataValue) {
      metadata.emplace(std::move(key_), std::move(s));
      pending_ = Pending::kNone;
      return true;
    }
    if (pending_ == Pending::kDType) {
      pending_ = Pending::kNone;
      std::optional<DType> dtype = DTypeFromName(s);
      if (!dtype) return Fail(fmt::format("{}: unknown dtype \"{}\"", Tensor(), s));
      tensors.back().dtype = dtype;
      return true;
    }
    return Scalar("a string");
  }
  bool binary(json::binary_t&) { return Fail("header holds binary data"); }

  bool start_object(std::size_t) { return Open(Frame::kObject); }
  bool start_array(std::size_t) { return Open(Frame::kArray); }

  bool key(json::string_t& k) {
    switch (stack_.back()) {
      case Frame::kTop:
        if (!top_keys_.insert(k).second) {
          return Fail(k == kMetadataKey ? std::string("duplicate key \"__metadata__\"")
                                        : fmt::format("duplicate tensor name \"{}\"", k));
        }
        if (k == kMetadataKey) {
          pending_ = Pending::kMetadata;
        } else {
          tensors.emplace_back().name = std::move(k);
          pending_ = Pending::kEntry;
        }
        return true;
      case Frame::kMetadata:
        if (metadata.contains(k)) {
          return Fail(fmt::format("__metadata__ has duplicate key \"{}\"", k));
        }
        key_ = std::move(k);
        pending_ = Pending::kMetadataValue;
        return true;
      case Frame::kEntry: {
        RawTensor& t = tensors.back();
        if (!t.keys.insert(k).second) {
          return Fail(fmt::format("{}: duplicate key \"{}\"", Tensor(), k));
        }
        if (k == "dtype") {
          pending_ = Pending::kDType;
        } else if (k == "shape") {
          pending_ = Pending::kShape;
        } else if (k == "data_offsets") {
          pending_ = Pending::kOffsets;
        } else {
          pending_ = Pending::kIgnored;  // unknown keys are ignored, as the reference does
        }
        return true;
      }
      default:
        return true;  // inside a skipped value
    }
  }

  bool end_object() {
    const Frame frame = stack_.back();
    stack_.pop_back();
    if (frame == Frame::kEntry) {
      const RawTensor& t = tensors.back();
      for (const char* field : {"dtype", "shape", "data_offsets"}) {
        if (!t.keys.contains(field)) return Fail(fmt::format("{}: no \"{}\"", Tensor(), field));
      }
    }
    return true;
  }

  bool end_array() {
    const Frame frame = stack_.back();
    stack_.pop_back();
    if (frame == Frame::kOffsets && tensors.back().offsets.size() != 2) {
      return Fail(fmt::format("{}: data_offsets [{}] is not a [begin, end] pair", Tensor(),
                              fmt::join(tensors.back().offsets, ", ")));
    }
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const json::exception& ex) {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 7: ...".
    std::string_view what = ex.what();
    if (const size_t close = what.find("] "); close != std::string_view::npos) {
      what.remove_prefix(close + 2);
    }
    return Fail(fmt::format("header is not valid JSON: {}", what));
  }

  bool done() const { return seen_root_ && stack_.empty(); }

 private:
  enum class Frame { kTop, kMetadata, kEntry, kShape, kOffsets, kSkip, kObject, kArray };
  // What the next value is, as set by the key before it.
  enum class Pending {
    kNone,
    kMetadata,
    kEntry,
    kMetadataValue,
    kDType,
    kShape,
    kOffsets,
    kIgnored
  };

  bool Fail(std::string message) {
    if (error.ok()) error = DataLossError(std::move(message));
    return false;
  }

  std::string Tensor() const { return fmt::format("tensor \"{}\"", tensors.back().name); }

  static const char* Kind(Frame f) { return f == Frame::kObject ? "an object" : "an array"; }

  // A container starts: `open` is kObject or kArray; decide what it is from where it sits.
  bool Open(Frame open) {
    if (stack_.size() >= kMaxJsonDepth) {
      return Fail(fmt::format("header nests deeper than {} levels", kMaxJsonDepth));
    }
    if (!seen_root_) {
      seen_root_ = true;
      if (open != Frame::kObject) return Fail("header is an array, not a JSON object");
      stack_.push_back(Frame::kTop);
      return true;
    }
    if (stack_.empty()) return Fail("header holds more than one JSON value");
    const Frame in = stack_.back();
    if (in == Frame::kSkip) {
      stack_.push_back(Frame::kSkip);
      return true;
    }
    if (in == Frame::kShape || in == Frame::kOffsets) {
      return Element(Kind(open), std::nullopt);
    }
    const Pending pending = std::exchange(pending_, Pending::kNone);
    switch (pending) {
      case Pending::kMetadata:
        if (open != Frame::kObject) return BadMetadata(Kind(open));
        stack_.push_back(Frame::kMetadata);
        return true;
      case Pending::kEntry:
        if (open != Frame::kObject) {
          return Fail(fmt::format("{}: entry is {}, not an object", Tensor(), Kind(open)));
        }
        stack_.push_back(Frame::kEntry);
        return true;
      case Pending::kMetadataValue:
        return Fail(fmt::format("__metadata__[\"{}\"] is {}, not a string", key_, Kind(open)));
      case Pending::kDType:
        return Fail(fmt::format("{}: dtype is {}, not a string", Tensor(), Kind(open)));
      case Pending::kShape:
      case Pending::kOffsets: {
        const bool shape = pending == Pending::kShape;
        if (open != Frame::kArray) {
          return Fail(fmt::format("{}: {} is {}, not an array", Tensor(),
                                  shape ? "shape" : "data_offsets", Kind(open)));
        }
        stack_.push_back(shape ? Frame::kShape : Frame::kOffsets);
        return true;
      }
      case Pending::kIgnored:
      case Pending::kNone:
        stack_.push_back(Frame::kSkip);
        return true;
    }
    return true;
  }

  // A scalar other than a number or string (or a string in the wrong place).
  bool Scalar(const char* kind) {
    if (!seen_root_) {
      seen_root_ = true;
      return Fail(fmt::format("header is {}, not a JSON object", kind));
    }
    if (stack_.empty()) return Fail("header holds more than one JSON value");
    const Frame in = stack_.back();
    if (in == Frame::kSkip) return true;
    if (in == Frame::kShape || in == Frame::kOffsets) return Element(kind, std::nullopt);
    const Pending pending = std::exchange(pending_, Pending::kNone);
    switch (pending) {
      case Pending::kMetadata:
        if (std::string_view(kind) == "null") return true;  // the reference reads it as absent
        return BadMetadata(kind);
      case Pending::kEntry:
        return Fail(fmt::format("{}: entry is {}, not an object", Tensor(), kind));
      case Pending::kMetadataValue:
        return Fail(fmt::format("__metadata__[\"{}\"] is {}, not a string", key_, kind));
      case Pending::kDType:
        return Fail(fmt::format("{}: dtype is {}, not a string", Tensor(), kind));
      case Pending::kShape:
        return Fail(fmt::format("{}: shape is {}, not an array", Tensor(), kind));
      case Pending::kOffsets:
        return Fail(fmt::format("{}: data_offsets is {}, not an array", Tensor(), kind));
      case Pending::kIgnored:
      case Pending::kNone:
        return true;
    }
    return true;
  }

  bool Number(std::optional<uint64_t> value, const std::string& text) {
    if (!stack_.empty()) {
      const Frame in = stack_.back();
      if (in == Frame::kShape || in == Frame::kOffsets) return Element(text, value);
    }
    return Scalar("a number");
  }

  // An element of shape or data_offsets: `value` is set for a non-negative integer.
  bool Element(const std::string& what, std::optional<uint64_t> value) {
    RawTensor& t = tensors.back();
    if (stack_.back() == Frame::kShape) {
      const size_t i = t.shape.size();
      if (!value) {
        return Fail(
            fmt::format("{}: shape[{}] is {}, not a non-negative integer", Tensor(), i, what));
      }
      if (*value > static_cast<uint64_t>(kMaxIndex)) {
        return Fail(fmt::format("{}: shape[{}] is {}, over the 2^62 limit", Tensor(), i, what));
      }
      t.shape.push_back(static_cast<Index>(*value));
      return true;
    }
    const size_t i = t.offsets.size();
    if (i == 2) {
      return Fail(fmt::format("{}: data_offsets has more than 2 values, not a [begin, end] pair",
                              Tensor()));
    }
    if (!value) {
      return Fail(
          fmt::format("{}: data_offsets[{}] is {}, not a non-negative integer", Tensor(), i, what));
    }
    t.offsets.push_back(*value);
    return true;
  }

  bool BadMetadata(const char* kind) {
    return Fail(fmt::format("__metadata__ is {}, not a string-to-string map", kind));
  }

  std::vector<Frame> stack_;
  Pending pending_ = Pending::kNone;
  bool seen_root_ = false;
  std::string key_;  // the __metadata__ key whose value comes next
  std::unordered_set<std::string> top_keys_;
};

// The checks that need every entry: sizes agree with shapes, offsets tile the data section.
Result<SafetensorsHeader> Validate(std::vector<RawTensor> raw,
                                   std::map<std::string, std::string> metadata,
                                   uint64_t header_length, uint64_t file_size) {
  SafetensorsHeader header;
  header.metadata = std::move(metadata);
  header.data_offset = 8 + header_length;
  header.tensors.reserve(raw.size());
  for (RawTensor& r : raw) {
    TensorInfo t{.name = std::move(r.name),
                 .dtype = *r.dtype,
                 .shape = std::move(r.shape),
                 .data_begin = r.offsets[0],
                 .data_end = r.offsets[1]};
    if (t.data_end < t.data_begin) {
      return DataLossError(fmt::format("tensor \"{}\": data_offsets [{}, {}] end before they begin",
                                       t.name, t.data_begin, t.data_end));
    }
    Result<Index> numel = CheckedProduct(t.shape);
    std::optional<Index> bytes;
    if (numel.ok()) bytes = CheckedMul(*numel, static_cast<Index>(DTypeSize(t.dtype)));
    if (!bytes) {
      return DataLossError(fmt::format("tensor \"{}\": shape {} of {} is more than 2^62 bytes",
                                       t.name, FormatShape(t.shape), DTypeName(t.dtype)));
    }
    if (static_cast<uint64_t>(*bytes) != t.num_bytes()) {
      return DataLossError(
          fmt::format("tensor \"{}\": shape {} of {} is {} bytes but data_offsets [{}, {}] span {}",
                      t.name, FormatShape(t.shape), DTypeName(t.dtype), *bytes, t.data_begin,
                      t.data_end, t.num_bytes()));
    }
    header.tensors.push_back(std::move(t));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return std::tie(a.data_begin, a.data_end, a.name) <
                     std::tie(b.data_begin, b.data_end, b.name);
            });
  uint64_t end = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : header.tensors) {
    if (t.data_begin > end) {
      if (previous == nullptr) {
        return DataLossError(
            fmt::format("data_offsets do not start at 0: the first tensor \"{}\" begins at {}",
                        t.name, t.data_begin));
      }
      return DataLossError(fmt::format(
          "gap in the data section: bytes [{}, {}) belong to no tensor", end, t.data_begin));
    }
    if (t.data_begin < end) {
      return DataLossError(fmt::format("tensors \"{}\" [{}, {}) and \"{}\" [{}, {}) overlap",
                                       previous->name, previous->data_begin, previous->data_end,
                                       t.name, t.data_begin, t.data_end));
    }
    end = t.data_end;
    previous = &t;
  }
  header.data_size = end;
  const uint64_t available = file_size - header.data_offset;
  if (available < end) {
    return DataLossError(
        fmt::format("file is truncated: the header declares {} data bytes but only {} follow it",
                    end, available));
  }
  if (available > end) {
    if (header.tensors.empty()) {
      return DataLossError(
          fmt::format("data section has {} bytes but the header declares no tensors", available));
    }
    return DataLossError(
        fmt::format("data section has {} trailing bytes after the last tensor", available - end));
  }
  return header;
}

// Ranks dtypes as the reference writer orders tensors: by descending rank, then by name.
// (Its dtype enumeration, which is what it sorts by, grows by size with ties in this order.)
int WriterRank(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return 0;
    case DType::kU8:
      return 1;
    case DType::kI8:
      return 2;
    case DType::kF8E5M2:
      return 3;
    case DType::kF8E4M3:
      return 4;
    case DType::kI16:
      return 5;
    case DType::kU16:
      return 6;
    case DType::kF16:
      return 7;
    case DType::kBF16:
      return 8;
    case DType::kI32:
      return 9;
    case DType::kU32:
      return 10;
    case DType::kF32:
      return 11;
    case DType::kF64:
      return 12;
    case DType::kI64:
      return 13;
    case DType::kU64:
      return 14;
  }
  return -1;
}

// A JSON string literal as the reference writer spells it: only '"', '\\' and control
// characters are escaped (the short forms where JSON has them, else \u00xx in lower case);
// everything else, non-ASCII included, is copied as UTF-8.
void AppendJsonString(std::string& out, std::string_view s) {
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
}

std::string ReadingContext(const std::string& path) { return fmt::format("reading \"{}\"", path); }

}  // namespace

const TensorInfo* SafetensorsHeader::Find(std::string_view name) const {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> prefix,
                                                 uint64_t file_size) {
  if (prefix.size() > file_size) {
    return InvalidArgumentError(
        fmt::format("{} bytes given as the start of a {}-byte file", prefix.size(), file_size));
  }
  if (file_size < 8) {
    return DataLossError(
        fmt::format("file is {} bytes, too short to hold the 8-byte header length", file_size));
  }
  if (prefix.size() < 8) {
    return InvalidArgumentError(
        fmt::format("only {} bytes given; the header length needs 8", prefix.size()));
  }
  const uint64_t n = LoadU64LittleEndian(prefix.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return DataLossError(fmt::format("header length {} exceeds the 100 MB limit", n));
  }
  if (n > file_size - 8) {
    return DataLossError(fmt::format(
        "header length {} runs past the end of the file: 8 + {} > {} bytes", n, n, file_size));
  }
  if (prefix.size() < 8 + n) {
    return InvalidArgumentError(
        fmt::format("only {} bytes given; the header needs the first {}", prefix.size(), 8 + n));
  }
  const std::string_view text(reinterpret_cast<const char*>(prefix.data()) + 8,
                              static_cast<size_t>(n));
  if (std::optional<size_t> bad = FirstInvalidUtf8(text)) {
    return DataLossError(fmt::format("header is not valid UTF-8: byte 0x{:02x} at offset {}",
                                     static_cast<unsigned char>(text[*bad]), 8 + *bad));
  }
  // The JSON reader takes a NUL byte for the end of its input, so whatever follows one would
  // go unread: the header is parsed up to the first NUL, and a NUL is then refused.
  const size_t nul = text.find('\0');
  const std::string_view json_text = text.substr(0, nul);
  HeaderHandler handler;
  const bool parsed = json::sax_parse(json_text.begin(), json_text.end(), &handler,
                                      json::input_format_t::json, /*strict=*/true,
                                      /*ignore_comments=*/false);
  if (nul != std::string_view::npos) {
    if (parsed && handler.error.ok() && handler.done()) {
      return DataLossError(fmt::format(
          "header has {} bytes after its JSON object, from a NUL byte at offset {}; only "
          "whitespace may follow the object",
          n - nul, 8 + nul));
    }
    return DataLossError(fmt::format("header is not valid JSON: a NUL byte at offset {}", 8 + nul));
  }
  if (!handler.error.ok()) return handler.error;
  if (!parsed || !handler.done()) return DataLossError("header is not valid JSON");
  return Validate(std::move(handler.tensors), std::move(handler.metadata), n, file_size);
}

Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(const FileHandle fd, FileHandle::OpenForReading(path));
  const uint64_t file_size = fd.size();
  std::vector<std::byte> prefix(static_cast<size_t>(std::min<uint64_t>(file_size, 8)));
  RESHARD_RETURN_IF_ERROR(ReadAt(fd, prefix.data(), prefix.size(), 0, path));
  if (prefix.size() == 8) {
    // Read as much of the header as the file holds (the parser names what is wrong with it).
    const uint64_t n = LoadU64LittleEndian(prefix.data());
    if (n <= kMaxSafetensorsHeaderBytes && n <= file_size - 8) {
      prefix.resize(static_cast<size_t>(8 + n));
      RESHARD_RETURN_IF_ERROR(ReadAt(fd, prefix.data() + 8, n, 8, path));
    }
  }
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(prefix, file_size);
  if (!header.ok()) return header.status().Annotate(ReadingContext(path));
  return header;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  file.AdviseSequential();
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(file.bytes(), file.bytes().size());
  if (!header.ok()) return header.status().Annotate(ReadingContext(path));
  return SafetensorsFile(std::move(file), std::move(header).value());
}

std::span<const std::byte> SafetensorsFile::data(const TensorInfo& tensor) const {
  return file_.bytes().subspan(header_.data_offset + tensor.data_begin, tensor.num_bytes());
}

namespace {

// The bytes of one band when `t` is written by bands of rows (TensorToWrite::fill_rows), else 0.
uint64_t BandBytes(const TensorToWrite& t, const TensorCopy* copy, uint64_t size) {
  if (!t.fill_rows || t.band_rows <= 0 || t.shape.empty() || t.shape[0] <= t.band_rows ||
      (copy != nullptr && !copy->ranges.empty())) {
    return 0;
  }
  return size / static_cast<uint64_t>(t.shape[0]) * static_cast<uint64_t>(t.band_rows);
}

// Whether `t` can be filled in place (FillTensorInPlace): filled by rows, not copied.
bool InPlaceable(const TensorToWrite& t, const TensorCopy* copy, uint64_t size) {
  return t.fill_rows && t.band_rows > 0 && !t.shape.empty() && t.shape[0] > 0 && size > 0 &&
         (copy == nullptr || copy->ranges.empty());
}

// Fills and appends `t` band by band, two bands of `buffer` in turn: band b + 1 is filled on a
// thread of its own while band b is appended.
Status WriteTensorByBands(AtomicFileWriter& out, const TensorToWrite& t, uint64_t band_bytes,
                          std::span<std::byte> buffer) {
  const auto rows = t.shape[0];
  const uint64_t row_bytes = band_bytes / static_cast<uint64_t>(t.band_rows);
  auto band = [&](Index begin, int half) {
    const Index end = std::min(rows, begin + t.band_rows);
    return buffer.subspan(static_cast<size_t>(band_bytes) * static_cast<size_t>(half),
                          static_cast<size_t>(static_cast<uint64_t>(end - begin) * row_bytes));
  };
  auto fill = [&](Index begin, std::span<std::byte> into) {
    Status s = t.fill_rows(begin, std::min(rows, begin + t.band_rows), into);
    return s.ok() ? s : s.Annotate(fmt::format("tensor \"{}\"", t.name));
  };
  std::span<std::byte> current = band(0, 0);
  RESHARD_RETURN_IF_ERROR(fill(0, current));
  int half = 0;
  for (Index begin = 0; begin < rows; begin += t.band_rows) {
    const Index next = begin + t.band_rows;
    std::span<std::byte> following;
    Status filled = Status::Ok();
    std::thread filler;
    if (next < rows) {
      following = band(next, 1 - half);
      filler = std::thread([&] { filled = fill(next, following); });
    }
    Status appended = out.Append(current);
    if (filler.joinable()) filler.join();
    RESHARD_RETURN_IF_ERROR(appended);
    RESHARD_RETURN_IF_ERROR(filled);
    current = following;
    half = 1 - half;
  }
  return Status::Ok();
}

// Fills `t` band by band straight into the file's pages (AtomicFileWriter::AppendInPlace): no
// band in memory and no copy by write(); false where `t` is not filled by rows or the file
// system cannot (the caller then writes it otherwise).
Result<bool> FillTensorInPlace(AtomicFileWriter& out, const TensorToWrite& t,
                               const TensorCopy* copy, uint64_t size) {
  if (!InPlaceable(t, copy, size)) return false;
  const auto rows = static_cast<uint64_t>(t.shape[0]);
  const uint64_t row_bytes = size / rows;
  const uint64_t window = row_bytes * std::min(rows, static_cast<uint64_t>(t.band_rows));
  return out.AppendInPlace(size, window, [&](uint64_t at, std::span<std::byte> bytes) {
    const auto begin = static_cast<Index>(at / row_bytes);
    const auto end = static_cast<Index>((at + bytes.size()) / row_bytes);
    Status s = t.fill_rows(begin, end, bytes);
    return s.ok() ? s : s.Annotate(fmt::format("tensor \"{}\"", t.name));
  });
}

// Writes one tensor's bytes: its ranges copied file to file where the file system can, else
// its fill into `buffer`, then appended. `inputs` keeps the files of ranges open across tensors.
Status WriteTensorBytes(AtomicFileWriter& out, const TensorToWrite& t, const TensorCopy* copy,
                        std::span<std::byte> buffer, std::map<std::string, FileHandle>& inputs) {
  bool copied = copy != nullptr && !copy->ranges.empty();
  uint64_t done = 0;
  for (size_t k = 0; copied && k < copy->ranges.size(); ++k) {
    const FileRange& range = copy->ranges[k];
    auto it = inputs.find(range.path);
    if (it == inputs.end()) {
      Result<FileHandle> in = FileHandle::OpenForReading(range.path);
      if (!in.ok()) return in.status().Annotate(fmt::format("tensor \"{}\"", t.name));
      it = inputs.emplace(range.path, *std::move(in)).first;
    }
    RESHARD_ASSIGN_OR_RETURN(copied,
                             out.AppendCopyOf(it->second.get(), range.offset, range.length));
    if (copied) done += range.length;
  }
  if (copied) {
    if (copy->copied) copy->copied();
    return Status::Ok();
  }
  // The kernel copied the first ranges (`done` bytes); the buffer holds the whole tensor, so its
  // tail is appended from where the copies stopped.
  Status filled = t.fill(buffer);
  if (!filled.ok()) return filled.Annotate(fmt::format("tensor \"{}\"", t.name));
  return out.Append(buffer.subspan(static_cast<size_t>(done)));
}

}  // namespace

namespace {

// One buffer of `largest` bytes (the largest fill), which serves every fill in turn (its pages
// touched only by the fills that use it); InvalidArgument naming the largest tensor when the
// process cannot have it.
Result<std::unique_ptr<std::byte[]>> FillBuffer(uint64_t largest,
                                                const std::vector<TensorToWrite>& tensors,
                                                const std::vector<uint64_t>& sizes) {
  if (largest == 0) return std::unique_ptr<std::byte[]>();
  try {
    return std::make_unique_for_overwrite<std::byte[]>(largest);
  } catch (const std::bad_alloc&) {
    const auto i =
        static_cast<size_t>(std::max_element(sizes.begin(), sizes.end()) - sizes.begin());
    return InvalidArgumentError(fmt::format(
        "tensor \"{}\" of shape [{}] needs {} bytes, more memory than this process can have "
        "(is the shape its input declares real?)",
        tensors[i].name, fmt::join(tensors[i].shape, ", "), largest));
  }
}

}  // namespace

Status WriteSafetensors(const std::string& path, std::vector<TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata,
                        const WriteOptions& options, std::vector<TensorCopy> copies) {
  // Check everything before touching the disk.
  if (!copies.empty() && copies.size() != tensors.size()) {
    return InvalidArgumentError(
        fmt::format("{} copies given for {} tensors", copies.size(), tensors.size()));
  }
  std::vector<uint64_t> sizes(tensors.size());
  std::unordered_set<std::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    if (FirstInvalidUtf8(t.name)) {
      return InvalidArgumentError(fmt::format("tensor name \"{}\" is not valid UTF-8", t.name));
    }
    if (t.name == kMetadataKey) {
      return InvalidArgumentError("\"__metadata__\" is reserved and cannot name a tensor");
    }
    if (!names.insert(t.name).second) {
      return InvalidArgumentError(fmt::format("duplicate tensor name \"{}\"", t.name));
    }
    Result<Index> numel = CheckedProduct(t.shape);
    if (!numel.ok()) return numel.status().Annotate(fmt::format("tensor \"{}\"", t.name));
    std::optional<Index> bytes = CheckedMul(*numel, static_cast<Index>(DTypeSize(t.dtype)));
    if (!bytes) {
      return InvalidArgumentError(fmt::format("tensor \"{}\": shape {} of {} is too large", t.name,
                                              FormatShape(t.shape), DTypeName(t.dtype)));
    }
    if (!t.fill) return InvalidArgumentError(fmt::format("tensor \"{}\" has no fill", t.name));
    sizes[i] = static_cast<uint64_t>(*bytes);
    uint64_t in_ranges = 0;
    const std::vector<FileRange> no_ranges;
    const std::vector<FileRange>& ranges = copies.empty() ? no_ranges : copies[i].ranges;
    for (const FileRange& r : ranges) in_ranges += r.length;
    if (!ranges.empty() && in_ranges != sizes[i]) {
      return InvalidArgumentError(fmt::format(
          "tensor \"{}\": its file ranges hold {} bytes, not {}", t.name, in_ranges, sizes[i]));
    }
  }
  for (const auto& [key, value] : metadata) {
    if (FirstInvalidUtf8(key) || FirstInvalidUtf8(value)) {
      return InvalidArgumentError(fmt::format("__metadata__ entry \"{}\" is not valid UTF-8", key));
    }
  }

  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int ra = WriterRank(tensors[a].dtype), rb = WriterRank(tensors[b].dtype);
    if (ra != rb) return ra > rb;
    return tensors[a].name < tensors[b].name;
  });

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header.push_back(',');
      first = false;
      AppendJsonString(header, key);
      header.push_back(':');
      AppendJsonString(header, value);
    }
    header.push_back('}');
  }
  uint64_t offset = 0;
  uint64_t largest = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorToWrite& t = tensors[order[k]];
    if (k > 0 || !metadata.empty()) header.push_back(',');
    AppendJsonString(header, t.name);
    header +=
        fmt::format(R"(:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})", DTypeName(t.dtype),
                    fmt::join(t.shape, ","), offset, offset + sizes[order[k]]);
    offset += sizes[order[k]];
    const uint64_t band =
        BandBytes(t, copies.empty() ? nullptr : &copies[order[k]], sizes[order[k]]);
    largest = std::max(largest, band > 0 ? std::min(2 * band, sizes[order[k]]) : sizes[order[k]]);
  }
  header.push_back('}');
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxSafetensorsHeaderBytes) {
    return ResourceExhaustedError(fmt::format(
        "header of {} bytes exceeds the 100 MB limit ({} tensors)", header.size(), tensors.size()));
  }

  RESHARD_ASSIGN_OR_RETURN(AtomicFileWriter out, AtomicFileWriter::Create(path, options));
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>(header.size() >> (8 * i));
  RESHARD_RETURN_IF_ERROR(out.Append(length));
  RESHARD_RETURN_IF_ERROR(out.Append(header));
  RESHARD_ASSIGN_OR_RETURN(const std::unique_ptr<std::byte[]> buffer,
                           FillBuffer(largest, tensors, sizes));
  std::map<std::string, FileHandle> inputs;
  for (const size_t i : order) {
    const TensorCopy* copy = copies.empty() ? nullptr : &copies[i];
    RESHARD_ASSIGN_OR_RETURN(const bool in_place,
                             FillTensorInPlace(out, tensors[i], copy, sizes[i]));
    if (in_place) continue;
    if (const uint64_t band = BandBytes(tensors[i], copy, sizes[i]); band > 0) {
      const std::span<std::byte> bands(buffer.get(), std::min(2 * band, sizes[i]));
      RESHARD_RETURN_IF_ERROR(WriteTensorByBands(out, tensors[i], band, bands));
      continue;
    }
    const std::span<std::byte> bytes(buffer.get(), static_cast<size_t>(sizes[i]));
    RESHARD_RETURN_IF_ERROR(WriteTensorBytes(out, tensors[i], copy, bytes, inputs));
  }
  return out.Commit();
}

}  // namespace reshard
