// OCDBT databases: the byte layout is in ocdbt.h.
#include "reshard/checkpoint/orbax/ocdbt.h"

#include <fmt/format.h>
#include <zstd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/io/mapped_file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kManifestMagic = kOcdbtManifestMagic;
constexpr uint32_t kBtreeMagic = kOcdbtBtreeMagic;
// A B+tree deeper than this is refused (tensorstore's trees are a few levels deep).
constexpr int kMaxHeight = 32;
// The most keys a database may list (each a chunk or a metadata file).
constexpr size_t kMaxKeys = size_t{1} << 26;

constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// Reads the fields of one structure, each checked against the bytes left.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, std::string_view what) : bytes_(bytes), what_(what) {}
  size_t pos() const { return pos_; }
  size_t left() const { return bytes_.size() - pos_; }

  Status Error(std::string_view message) const {
    return DataLossError(
        fmt::format("{}: {} (at byte {} of {})", what_, message, pos_, bytes_.size()));
  }
  Status Varint(uint64_t& out, std::string_view field) {
    out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) return Error(fmt::format("{} ends early", field));
      const auto b = static_cast<uint8_t>(bytes_[pos_++]);
      if (shift == 63 && b > 1) return Error(fmt::format("{} overflows 64 bits", field));
      out |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return Status::Ok();
    }
    return Error(fmt::format("{} overflows 64 bits", field));
  }
  // A varint that counts entries of at least one byte each: no more than the bytes left.
  Status Count(uint64_t& out, std::string_view field) {
    RESHARD_RETURN_IF_ERROR(Varint(out, field));
    if (out > left()) {
      return Error(fmt::format("{} is {}, more than the {} bytes left", field, out, left()));
    }
    return Status::Ok();
  }
  Status Byte(uint8_t& out, std::string_view field) {
    if (left() < 1) return Error(fmt::format("{} ends early", field));
    out = static_cast<uint8_t>(bytes_[pos_++]);
    return Status::Ok();
  }
  Status Bytes(size_t n, std::span<const std::byte>& out, std::string_view field) {
    if (n > left()) {
      return Error(fmt::format("{} of {} bytes runs past the end", field, n));
    }
    out = bytes_.subspan(pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  Status Fixed(size_t n, uint64_t& out, std::string_view field) {  // little-endian
    std::span<const std::byte> b;
    RESHARD_RETURN_IF_ERROR(Bytes(n, b, field));
    out = 0;
    for (size_t i = 0; i < n; ++i) out |= static_cast<uint64_t>(b[i]) << (8 * i);
    return Status::Ok();
  }

 private:
  std::span<const std::byte> bytes_;
  std::string_view what_;
  size_t pos_ = 0;
};

std::string AsString(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// Decompresses a zstd body, growing with what the stream gives up to kMaxOcdbtNodeBytes.
Status InflateZstd(std::span<const std::byte> in, std::string_view what,
                   std::vector<std::byte>& out) {
  ZSTD_DCtx* ctx = ZSTD_createDCtx();
  if (ctx == nullptr) return InternalError("zstd: cannot create a decompression context");
  std::vector<std::byte> window(size_t{1} << 16);
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  Status status;
  size_t ret = 1;
  while (true) {
    ZSTD_outBuffer output{window.data(), window.size(), 0};
    ret = ZSTD_decompressStream(ctx, &output, &input);
    if (ZSTD_isError(ret)) {
      status = DataLossError(
          fmt::format("{}: its zstd body is corrupt ({})", what, ZSTD_getErrorName(ret)));
      break;
    }
    if (out.size() + output.pos > kMaxOcdbtNodeBytes) {
      status = DataLossError(
          fmt::format("{}: its zstd body decodes to more than {} bytes", what, kMaxOcdbtNodeBytes));
      break;
    }
    out.insert(out.end(), window.begin(), window.begin() + static_cast<ptrdiff_t>(output.pos));
    if (ret == 0 && input.pos == input.size) break;
    if (output.pos == 0 && input.pos == input.size) {
      status = DataLossError(fmt::format("{}: its zstd body ends early", what));
      break;
    }
  }
  ZSTD_freeDCtx(ctx);
  return status;
}

// A data file path from a table: relative, inside the database.
Status CheckRelativePath(const std::string& path, std::string_view what) {
  if (path.empty() || path.front() == '/' || path.find('\0') != std::string::npos) {
    return DataLossError(
        fmt::format("{}: data file path {} is not a relative path", what, json::QuoteShort(path)));
  }
  for (const auto& part : fs::path(path)) {
    if (part == "..") {
      return DataLossError(fmt::format("{}: data file path {} leaves the database's directory",
                                       what, json::QuoteShort(path)));
    }
  }
  return Status::Ok();
}

// A data file table: full paths (transitive + path) and the base paths children resolve
// against (transitive + base path).
Status ReadDataFileTable(Cursor& c, const std::string& transitive, std::string_view what,
                         std::vector<std::string>& files, std::vector<std::string>& bases) {
  uint64_t n = 0;
  RESHARD_RETURN_IF_ERROR(c.Count(n, "data file count"));
  std::vector<uint64_t> prefix(n, 0), suffix(n), base(n);
  for (uint64_t i = 0; i + 1 < n; ++i) RESHARD_RETURN_IF_ERROR(c.Varint(prefix[i + 1], "prefix"));
  for (uint64_t i = 0; i < n; ++i) RESHARD_RETURN_IF_ERROR(c.Varint(suffix[i], "path suffix"));
  for (uint64_t i = 0; i < n; ++i) RESHARD_RETURN_IF_ERROR(c.Varint(base[i], "base path"));
  std::string previous;
  for (uint64_t i = 0; i < n; ++i) {
    if (prefix[i] > previous.size()) {
      return c.Error(fmt::format("data file {} shares {} bytes with a path of {}", i, prefix[i],
                                 previous.size()));
    }
    std::span<const std::byte> s;
    RESHARD_RETURN_IF_ERROR(c.Bytes(suffix[i], s, "data file path"));
    std::string path = previous.substr(0, prefix[i]) + AsString(s);
    if (path.size() > 65535 || base[i] > path.size()) {
      return c.Error(fmt::format("data file {} has a path of {} bytes and a base of {}", i,
                                 path.size(), base[i]));
    }
    std::string full = transitive + path;
    RESHARD_RETURN_IF_ERROR(CheckRelativePath(full, what));
    files.push_back(std::move(full));
    bases.push_back(transitive + path.substr(0, base[i]));
    previous = std::move(path);
  }
  return Status::Ok();
}

}  // namespace

uint32_t Crc32c(std::span<const std::byte> bytes) {
  uint32_t crc = 0xffffffffu;
  for (std::byte b : bytes) {
    crc = kCrc32cTable[(crc ^ static_cast<uint8_t>(b)) & 0xff] ^ (crc >> 8);
  }
  return crc ^ 0xffffffffu;
}

Result<std::vector<std::byte>> DecodeOcdbtStructure(std::span<const std::byte> bytes,
                                                    uint32_t magic, std::string_view what) {
  if (bytes.size() < 16) {
    return DataLossError(fmt::format("{}: {} bytes, too short for a header", what, bytes.size()));
  }
  uint32_t got = 0;
  for (int i = 0; i < 4; ++i) got = (got << 8) | static_cast<uint8_t>(bytes[i]);
  if (got != magic) {
    return DataLossError(
        fmt::format("{}: magic 0x{:08x}, expected 0x{:08x} (not an OCDBT structure of this kind)",
                    what, got, magic));
  }
  Cursor c(bytes, what);
  uint64_t skip = 0, length = 0, version = 0, compression = 0;
  RESHARD_RETURN_IF_ERROR(c.Fixed(4, skip, "magic"));
  RESHARD_RETURN_IF_ERROR(c.Fixed(8, length, "length"));
  if (length != bytes.size()) {
    return DataLossError(
        fmt::format("{}: its header says {} bytes, but it has {}", what, length, bytes.size()));
  }
  RESHARD_RETURN_IF_ERROR(c.Varint(version, "version"));
  RESHARD_RETURN_IF_ERROR(c.Varint(compression, "compression"));
  if (version != 0) return c.Error(fmt::format("format version {} (only 0 is read)", version));
  if (compression > 1) return c.Error(fmt::format("unknown compression format {}", compression));
  if (c.left() < 4) return c.Error("no room for the CRC-32C");
  const auto stored_crc = bytes.subspan(bytes.size() - 4);
  uint32_t want = 0;
  for (int i = 3; i >= 0; --i) want = (want << 8) | static_cast<uint8_t>(stored_crc[i]);
  const uint32_t crc = Crc32c(bytes.first(bytes.size() - 4));
  if (crc != want) {
    return DataLossError(
        fmt::format("{}: CRC-32C 0x{:08x}, but it records 0x{:08x}", what, crc, want));
  }
  const auto body = bytes.subspan(c.pos(), c.left() - 4);
  std::vector<std::byte> out;
  if (compression == 0) {
    out.assign(body.begin(), body.end());
  } else {
    RESHARD_RETURN_IF_ERROR(InflateZstd(body, what, out));
  }
  return out;
}

Result<OcdbtRoot> ParseOcdbtManifest(std::span<const std::byte> bytes, std::string_view what) {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<std::byte> body,
                           DecodeOcdbtStructure(bytes, kManifestMagic, what));
  Cursor c(body, what);
  std::span<const std::byte> uuid;
  uint8_t kind = 0, arity_log2 = 0;
  uint64_t max_inline = 0, max_node = 0, method = 0, level = 0;
  RESHARD_RETURN_IF_ERROR(c.Bytes(16, uuid, "uuid"));
  RESHARD_RETURN_IF_ERROR(c.Byte(kind, "manifest kind"));
  if (kind == 1) {
    return FailedPreconditionError(fmt::format(
        "{}: a numbered manifest (manifest kind 1), which tensorstore writes only when asked "
        "and Orbax never does, is not read",
        what));
  }
  if (kind != 0) return c.Error(fmt::format("unknown manifest kind {}", kind));
  RESHARD_RETURN_IF_ERROR(c.Varint(max_inline, "max_inline_value_bytes"));
  RESHARD_RETURN_IF_ERROR(c.Varint(max_node, "max_decoded_node_bytes"));
  RESHARD_RETURN_IF_ERROR(c.Byte(arity_log2, "version_tree_arity_log2"));
  if (arity_log2 == 0 || arity_log2 > 16) {
    return c.Error(fmt::format("version_tree_arity_log2 {} (1 to 16)", arity_log2));
  }
  RESHARD_RETURN_IF_ERROR(c.Varint(method, "compression method"));
  if (method == 1) {
    RESHARD_RETURN_IF_ERROR(c.Fixed(4, level, "zstd level"));
  } else if (method != 0) {
    return c.Error(fmt::format("unknown compression method {}", method));
  }
  std::vector<std::string> files, bases;
  RESHARD_RETURN_IF_ERROR(ReadDataFileTable(c, "", what, files, bases));
  // The inline versions: columns of n entries each.
  uint64_t n = 0;
  RESHARD_RETURN_IF_ERROR(c.Count(n, "version count"));
  std::vector<uint64_t> generation(n), file(n), offset(n), length(n), stat(n);
  std::vector<uint8_t> height(n);
  for (auto& g : generation) RESHARD_RETURN_IF_ERROR(c.Varint(g, "generation number"));
  for (auto& h : height) RESHARD_RETURN_IF_ERROR(c.Byte(h, "root height"));
  for (auto& f : file) RESHARD_RETURN_IF_ERROR(c.Varint(f, "data file id"));
  for (auto& o : offset) RESHARD_RETURN_IF_ERROR(c.Varint(o, "data file offset"));
  for (auto& l : length) RESHARD_RETURN_IF_ERROR(c.Varint(l, "data file length"));
  for (int k = 0; k < 3; ++k) {
    for (auto& s : stat) RESHARD_RETURN_IF_ERROR(c.Varint(s, "statistic"));
  }
  for (uint64_t i = 0; i < n; ++i) RESHARD_RETURN_IF_ERROR(c.Fixed(8, stat[0], "commit time"));
  if (n == 0) return OcdbtRoot{};  // no version written: an empty database
  for (uint64_t i = 1; i < n; ++i) {
    if (generation[i] <= generation[i - 1]) {
      return c.Error("generation numbers are not increasing");
    }
  }
  OcdbtRoot root;
  root.generation = generation[n - 1];
  root.height = height[n - 1];
  root.offset = offset[n - 1];
  root.length = length[n - 1];
  if (root.length == 0) return root;  // an empty tree
  if (file[n - 1] >= files.size()) {
    return c.Error(
        fmt::format("the newest root names data file {} of {}", file[n - 1], files.size()));
  }
  root.file = files[file[n - 1]];
  root.base = bases[file[n - 1]];
  return root;
}

namespace {

Status ReadLeafEntries(Cursor& c, uint64_t n, const std::vector<std::string>& files,
                       OcdbtNode& node) {
  std::vector<uint64_t> prefix(n, 0), suffix(n), length(n), kind(n);
  for (uint64_t i = 1; i < n; ++i) RESHARD_RETURN_IF_ERROR(c.Varint(prefix[i], "key prefix"));
  for (auto& s : suffix) RESHARD_RETURN_IF_ERROR(c.Varint(s, "key suffix length"));
  std::string previous;
  for (uint64_t i = 0; i < n; ++i) {
    if (prefix[i] > previous.size()) return c.Error("a key prefix longer than the previous key");
    std::span<const std::byte> s;
    RESHARD_RETURN_IF_ERROR(c.Bytes(suffix[i], s, "key suffix"));
    previous = previous.substr(0, prefix[i]) + AsString(s);
    node.values.emplace_back(previous, OcdbtValue{});
  }
  for (auto& l : length) RESHARD_RETURN_IF_ERROR(c.Varint(l, "value length"));
  for (auto& k : kind) {
    RESHARD_RETURN_IF_ERROR(c.Varint(k, "value kind"));
    if (k > 1) return c.Error(fmt::format("unknown value kind {}", k));
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (kind[i] != 1) continue;
    uint64_t id = 0;
    RESHARD_RETURN_IF_ERROR(c.Varint(id, "data file id"));
    if (id >= files.size()) {
      return c.Error(fmt::format("a value names data file {} of {}", id, files.size()));
    }
    node.values[i].second.file = id;
    node.values[i].second.length = length[i];
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (kind[i] == 1) RESHARD_RETURN_IF_ERROR(c.Varint(node.values[i].second.offset, "offset"));
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (kind[i] != 0) continue;
    std::span<const std::byte> v;
    RESHARD_RETURN_IF_ERROR(c.Bytes(length[i], v, "inline value"));
    node.values[i].second.is_inline = true;
    node.values[i].second.inline_bytes = AsString(v);
  }
  return Status::Ok();
}

Status ReadInteriorEntries(Cursor& c, uint64_t n, const std::vector<std::string>& files,
                           OcdbtNode& node) {
  std::vector<uint64_t> prefix(n, 0), suffix(n), common(n), stat(n);
  for (uint64_t i = 1; i < n; ++i) RESHARD_RETURN_IF_ERROR(c.Varint(prefix[i], "key prefix"));
  for (auto& s : suffix) RESHARD_RETURN_IF_ERROR(c.Varint(s, "key suffix length"));
  for (auto& s : common) RESHARD_RETURN_IF_ERROR(c.Varint(s, "subtree prefix length"));
  std::string previous;
  node.children.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (prefix[i] > previous.size()) return c.Error("a key prefix longer than the previous key");
    std::span<const std::byte> s;
    RESHARD_RETURN_IF_ERROR(c.Bytes(suffix[i], s, "key suffix"));
    previous = previous.substr(0, prefix[i]) + AsString(s);
    if (common[i] > previous.size()) {
      return c.Error("a subtree prefix longer than its key");
    }
    node.children[i].key = previous;
    node.children[i].prefix_length = common[i];
  }
  for (auto& child : node.children) {
    uint64_t id = 0;
    RESHARD_RETURN_IF_ERROR(c.Varint(id, "data file id"));
    if (id >= files.size()) {
      return c.Error(fmt::format("a child names data file {} of {}", id, files.size()));
    }
    child.file = id;
  }
  for (auto& child : node.children) RESHARD_RETURN_IF_ERROR(c.Varint(child.offset, "offset"));
  for (auto& child : node.children) RESHARD_RETURN_IF_ERROR(c.Varint(child.length, "length"));
  for (int k = 0; k < 3; ++k) {
    for (auto& s : stat) RESHARD_RETURN_IF_ERROR(c.Varint(s, "statistic"));
  }
  return Status::Ok();
}

}  // namespace

Result<OcdbtNode> ParseOcdbtNode(std::span<const std::byte> bytes, const std::string& transitive,
                                 std::string_view what) {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<std::byte> body,
                           DecodeOcdbtStructure(bytes, kBtreeMagic, what));
  Cursor c(body, what);
  OcdbtNode node;
  uint8_t height = 0;
  RESHARD_RETURN_IF_ERROR(c.Byte(height, "height"));
  node.height = height;
  RESHARD_RETURN_IF_ERROR(ReadDataFileTable(c, transitive, what, node.files, node.base_paths));
  uint64_t n = 0;
  RESHARD_RETURN_IF_ERROR(c.Count(n, "entry count"));
  RESHARD_RETURN_IF_ERROR(height == 0 ? ReadLeafEntries(c, n, node.files, node)
                                      : ReadInteriorEntries(c, n, node.files, node));
  if (c.left() != 0) return c.Error(fmt::format("{} bytes after the entries", c.left()));
  return node;
}

struct OcdbtDatabase::Mapped {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<MappedFile>> files;
};

Result<std::span<const std::byte>> OcdbtDatabase::FileBytes(const std::string& relative) const {
  std::lock_guard<std::mutex> lock(mapped_->mu);
  auto it = mapped_->files.find(relative);
  if (it == mapped_->files.end()) {
    Result<MappedFile> m = MappedFile::Open((fs::path(dir_) / relative).string());
    if (!m.ok()) {
      return DataLossError(fmt::format("OCDBT database \"{}\" names data file \"{}\": {}", dir_,
                                       relative, m.status().message()));
    }
    it = mapped_->files.emplace(relative, std::make_shared<MappedFile>(*std::move(m))).first;
  }
  return it->second->bytes();
}

size_t OcdbtDatabase::FileIndex(const std::string& relative) {
  for (size_t i = 0; i < files_.size(); ++i) {
    if (files_[i] == relative) return i;
  }
  files_.push_back(relative);
  return files_.size() - 1;
}

Status OcdbtDatabase::Walk(const std::string& file, uint64_t offset, uint64_t length, int height,
                           const std::string& transitive, const std::string& prefix, int depth) {
  const std::string what =
      fmt::format("\"{}\": B+tree node at [{}, {}) of \"{}\"", dir_, offset, offset + length, file);
  if (depth > kMaxHeight) return DataLossError(what + ": the tree is deeper than it says");
  RESHARD_ASSIGN_OR_RETURN(const auto bytes, FileBytes(file));
  if (offset > bytes.size() || length > bytes.size() - offset) {
    return DataLossError(fmt::format("{}: the file has {} bytes", what, bytes.size()));
  }
  RESHARD_ASSIGN_OR_RETURN(OcdbtNode node,
                           ParseOcdbtNode(bytes.subspan(offset, length), transitive, what));
  if (node.height != height) {
    return DataLossError(
        fmt::format("{}: height {}, but its parent says {}", what, node.height, height));
  }
  for (auto& [key, value] : node.values) {
    if (!value.is_inline) value.file = FileIndex(node.files[value.file]);
    if (keys_.size() >= kMaxKeys) {
      return DataLossError(fmt::format("{}: more than {} keys", what, kMaxKeys));
    }
    keys_.insert_or_assign(prefix + key, std::move(value));
  }
  for (const OcdbtNode::Child& child : node.children) {
    RESHARD_RETURN_IF_ERROR(Walk(node.files[child.file], child.offset, child.length, height - 1,
                                 node.base_paths[child.file],
                                 prefix + child.key.substr(0, child.prefix_length), depth + 1));
  }
  return Status::Ok();
}

Result<std::shared_ptr<OcdbtDatabase>> OcdbtDatabase::Open(const std::string& dir) {
  const std::string manifest_path = (fs::path(dir) / "manifest.ocdbt").string();
  RESHARD_ASSIGN_OR_RETURN(MappedFile manifest, MappedFile::Open(manifest_path));
  RESHARD_ASSIGN_OR_RETURN(const OcdbtRoot root,
                           ParseOcdbtManifest(manifest.bytes(), "\"" + manifest_path + "\""));
  std::shared_ptr<OcdbtDatabase> db(new OcdbtDatabase());
  db->dir_ = dir;
  db->mapped_ = std::make_shared<Mapped>();
  if (root.length == 0) return db;
  if (root.height > kMaxHeight) {
    return DataLossError(fmt::format("\"{}\": a B+tree of height {}", manifest_path, root.height));
  }
  RESHARD_RETURN_IF_ERROR(
      db->Walk(root.file, root.offset, root.length, root.height, root.base, "", 0));
  // Every out-of-line value inside its file.
  for (const auto& [key, value] : db->keys_) {
    if (value.is_inline) continue;
    RESHARD_ASSIGN_OR_RETURN(const auto bytes, db->FileBytes(db->files_[value.file]));
    if (value.offset > bytes.size() || value.length > bytes.size() - value.offset) {
      return DataLossError(
          fmt::format("\"{}\": the value of key {} is bytes [{}, {}) of \"{}\", which has {}", dir,
                      json::QuoteShort(key), value.offset, value.offset + value.length,
                      db->files_[value.file], bytes.size()));
    }
  }
  return db;
}

Result<std::span<const std::byte>> OcdbtDatabase::Read(const std::string& key) const {
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    return NotFoundError(fmt::format("\"{}\" holds no key {}", dir_, json::QuoteShort(key)));
  }
  const OcdbtValue& v = it->second;
  if (v.is_inline) {
    return std::span<const std::byte>(reinterpret_cast<const std::byte*>(v.inline_bytes.data()),
                                      v.inline_bytes.size());
  }
  RESHARD_ASSIGN_OR_RETURN(const auto bytes, FileBytes(files_[v.file]));
  return bytes.subspan(v.offset, v.length);
}

void OcdbtDatabase::Release(const std::string& key) const {
  auto it = keys_.find(key);
  if (it == keys_.end() || it->second.is_inline) return;
  Result<std::span<const std::byte>> bytes = Read(key);
  if (bytes.ok()) ReleaseMappedPages(*bytes);
}

}  // namespace reshard
