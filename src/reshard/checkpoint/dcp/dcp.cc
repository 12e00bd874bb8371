// DCP checkpoint directories: opening (torch_save items and the HF-storage variant), reading
// items, and the ShardSource over them.
#include "reshard/checkpoint/dcp/dcp.h"

#include <fmt/format.h>
// ZSTD_decompressBound (stable in the library since 1.4.0, still declared in the advanced section).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <regex>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/parallel_runs.h"
#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/checkpoint/self_described.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_file.h"

namespace reshard {

namespace fs = std::filesystem;

struct DcpCheckpoint::File {
  File(std::string p, MappedFile m) : path(std::move(p)), mapped(std::move(m)) {}
  std::string path;
  MappedFile mapped;
};

namespace {

constexpr char kMetadataName[] = ".metadata";
constexpr char kShardingInfoKey[] = "DCP_SHARDING_INFO";
// What a zstd item may decompress to beyond the chunk's own bytes (the archive's headers and
// pickle); a larger item is refused rather than inflated.
constexpr uint64_t kZstdSlack = uint64_t{64} << 20;
// What a zstd item may decompress to per byte of its stream, beyond kZstdSlack: the metadata's
// claim is held against the item's real size, so that a small file never claims much memory.
// Tensors compress far less (zstd -3 on torch.save of normal bf16 1.3 : 1, fp32 1.1 : 1, bf16
// with 90% zeros 6.3 : 1, 99% zeros 42 : 1); a run of one value compresses up to 32 768 : 1 (4
// bytes per 128 KiB block), which is refused beyond kZstdSlack.
constexpr uint64_t kZstdMaxRatio = 256;

std::string ChunkWhat(const DcpTensor& t, size_t c) {
  return fmt::format("\"{}\" chunk {}", t.fqn, c);
}

const std::regex& PerRankMetadataName() {
  static const std::regex re("__([0-9]+)\\.metadata");
  return re;
}

const std::regex& HfShardName() {
  static const std::regex re("shard-([0-9]+)-model-([0-9]+)-of-([0-9]+)\\.safetensors");
  return re;
}

std::vector<std::string> ListNames(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool IsDir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool Exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

// Whether `dir` has an entry `name`, whatever it is (a symbolic link that loops or dangles
// included: opening it then says what is wrong with it).
bool HasEntry(const std::string& dir, std::string_view name) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(fs::path(dir) / name, ec));
}

// Where the HF-storage variant keeps its shards: `dir` or `dir/sharded`; empty: neither.
std::string HfShardDir(const std::string& dir) {
  for (const std::string& d : {dir, dir + "/sharded"}) {
    if (!IsDir(d)) continue;
    for (const std::string& n : ListNames(d)) {
      if (std::regex_match(n, HfShardName())) return d;
    }
  }
  return "";
}

// Merges per-rank metadata (each lists its own items) into one (`first`: the first rank's).
Status Merge(DcpMetadata part, std::string_view name, bool first, DcpMetadata& all,
             std::map<std::string, size_t>& tensor_index) {
  if (first) {
    all.version = part.version;
  } else if (part.version != all.version) {
    return DataLossError(
        fmt::format("{}: version \"{}\", but an earlier rank's metadata has \"{}\"", name,
                    part.version, all.version));
  }
  std::vector<size_t> file_map;
  for (const std::string& f : part.files) {
    const auto it = std::find(all.files.begin(), all.files.end(), f);
    file_map.push_back(static_cast<size_t>(it - all.files.begin()));
    if (it == all.files.end()) all.files.push_back(f);
  }
  for (DcpTensor& t : part.tensors) {
    for (DcpChunk& c : t.chunks) c.location.file = file_map[c.location.file];
    const auto [it, inserted] = tensor_index.emplace(t.fqn, all.tensors.size());
    if (inserted) {
      all.tensors.push_back(std::move(t));
      continue;
    }
    DcpTensor& have = all.tensors[it->second];
    if (have.shape != t.shape || have.dtype != t.dtype) {
      return DataLossError(
          fmt::format("{}: \"{}\" has shape [{}] {} here but [{}] {} in an "
                      "earlier rank's metadata",
                      name, t.fqn, fmt::join(t.shape, ", "), DTypeName(t.dtype),
                      fmt::join(have.shape, ", "), DTypeName(have.dtype)));
    }
    for (DcpChunk& c : t.chunks) have.chunks.push_back(std::move(c));
  }
  for (DcpBytesItem& b : part.bytes_items) {
    b.location.file = file_map[b.location.file];
    all.bytes_items.push_back(std::move(b));
  }
  return Status::Ok();
}

Result<DcpMetadata> ReadMetadataFile(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path));
  return ParseDcpMetadata(f.bytes(), path);
}

// The HF-storage variant: every tensor of every shard file is a chunk.
Result<DcpMetadata> ReadHfShards(const std::string& dir, const std::string& shard_dir) {
  DcpMetadata out;
  std::map<std::string, size_t> index;
  const std::string prefix = shard_dir == dir ? "" : "sharded/";
  for (const std::string& name : ListNames(shard_dir)) {
    std::smatch m;
    if (!std::regex_match(name, m, HfShardName())) continue;
    const std::string path = fmt::format("{}/{}", shard_dir, name);
    int64_t shard = 0;
    const std::string digits = m[1].str();
    const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), shard);
    if (ec != std::errc() || shard < 1 || shard > (int64_t{1} << 16)) {
      return DataLossError(fmt::format("{}: shard index {} is not 1..65536", path, digits));
    }
    RESHARD_ASSIGN_OR_RETURN(const SafetensorsHeader h, ReadSafetensorsHeader(path));
    json::Json info;
    const auto meta = h.metadata.find(kShardingInfoKey);
    if (meta != h.metadata.end()) {
      auto parsed = json::ParseJson(meta->second);
      if (!parsed.ok() || !parsed->is_object()) {
        return DataLossError(fmt::format("{}: {} is not a JSON object", path, kShardingInfoKey));
      }
      info = std::move(*parsed);
    }
    const size_t file = out.files.size();
    out.files.push_back(prefix + name);
    for (const TensorInfo& t : h.tensors) {
      DcpChunk chunk;
      chunk.rank = static_cast<Rank>(shard - 1);
      chunk.sizes = t.shape;
      chunk.offsets.assign(t.shape.size(), 0);
      if (const json::Json* e = info.is_object() ? json::Find(info, t.name) : nullptr) {
        const std::string where = fmt::format("{}: {}[{}]", path, kShardingInfoKey, t.name);
        RESHARD_ASSIGN_OR_RETURN(const json::Json* off, json::Require(*e, where, "saved_offsets"));
        RESHARD_ASSIGN_OR_RETURN(chunk.offsets, json::ReadIntArray(*off, where, Index{0}));
        if (chunk.offsets.size() != t.shape.size()) {
          return DataLossError(fmt::format("{}: {} offsets for a tensor of {} dims", where,
                                           chunk.offsets.size(), t.shape.size()));
        }
      }
      chunk.location = {file, h.data_offset + t.data_begin, t.num_bytes(), {}};
      const auto [it, inserted] = index.emplace(t.name, out.tensors.size());
      if (inserted) {
        DcpTensor tensor;
        tensor.fqn = t.name;
        tensor.path = {t.name};
        tensor.path_is_index = {false};
        tensor.dtype = t.dtype;
        tensor.shape.assign(t.shape.size(), 0);
        out.tensors.push_back(std::move(tensor));
      }
      DcpTensor& tensor = out.tensors[it->second];
      if (tensor.dtype != t.dtype || tensor.shape.size() != t.shape.size()) {
        return DataLossError(fmt::format("{}: \"{}\" is {} of {} dims here, {} of {} elsewhere",
                                         path, t.name, DTypeName(t.dtype), t.shape.size(),
                                         DTypeName(tensor.dtype), tensor.shape.size()));
      }
      // The global shape is the far corner of the chunks, as torch's reader takes it.
      for (size_t d = 0; d < t.shape.size(); ++d) {
        const auto end = CheckedAdd(chunk.offsets[d], chunk.sizes[d]);
        if (!end) return DataLossError(fmt::format("{}: \"{}\" offsets overflow", path, t.name));
        tensor.shape[d] = std::max(tensor.shape[d], *end);
      }
      tensor.chunks.push_back(std::move(chunk));
    }
  }
  return out;
}

// Where the next zip entry of a torch.save archive starts, as its bytes arrive: the archive's
// entries come first, each a local header ("PK\3\4", its stored size at byte 18, name and extra
// lengths at 26 and 28) and its bytes, then the central directory ("PK\1\2") and its end.
struct ZipEntryWalk {
  uint64_t next = 0;
  bool done = false;  // at the central directory, or sizes the local header does not give
};

uint32_t LittleEndianAt(std::span<const std::byte> b, uint64_t at, int bytes) {
  uint32_t v = 0;
  for (int k = bytes - 1; k >= 0; --k) v = v << 8 | std::to_integer<uint32_t>(b[at + k]);
  return v;
}

// Walks the entries `out` now holds; DataLoss at the first bytes that are no zip entry, so a
// stream that is no archive stops at its first window instead of filling all its claim.
Status WalkZipEntries(std::span<const std::byte> out, ZipEntryWalk& w, std::string_view what) {
  while (!w.done && out.size() >= w.next + 4) {
    const uint32_t signature = LittleEndianAt(out, w.next, 4);
    if (signature == 0x02014b50 || signature == 0x06054b50 || signature == 0x06064b50) {
      w.done = true;  // the central directory, or an archive without entries
      break;
    }
    if (signature != 0x04034b50) {
      return DataLossError(
          fmt::format("{}: not a torch.save archive (no zip entry at byte {} of its zstd stream)",
                      what, w.next));
    }
    if (out.size() < w.next + 30) break;
    const uint32_t flags = LittleEndianAt(out, w.next + 6, 2);
    const uint32_t size = LittleEndianAt(out, w.next + 18, 4);
    if ((flags & 8) != 0 || size == 0xFFFFFFFF) {  // a data descriptor, or zip64 sizes
      w.done = true;
      break;
    }
    w.next += 30 + uint64_t{LittleEndianAt(out, w.next + 26, 2)} +
              LittleEndianAt(out, w.next + 28, 2) + size;
  }
  return Status::Ok();
}

// Decompresses `in` into `out`, which ends up no larger than what the stream holds and never
// beyond `max_bytes` (what the chunk needs). With `archive` (a torch.save archive is what the
// stream holds), its zip entries are checked as they arrive (WalkZipEntries). Memory follows the
// stream, bounded twice: by the file (ZSTD_decompressBound: what these compressed bytes can hold at
// most) and by the claim; `out` is reserved once at the smaller bound and filled through a small
// window, so it never doubles or copies. A bound past kZstdMaxRatio times the stream (beyond
// kZstdSlack), and one this process cannot allocate, are refused naming the item, before any byte
// is decompressed.
Status DecompressZstd(std::span<const std::byte> in, uint64_t max_bytes, std::string_view what,
                      bool archive, std::vector<std::byte>& out) {
  ZipEntryWalk walk;
  walk.done = !archive;
  out.clear();
  const unsigned long long bound = ZSTD_decompressBound(in.data(), in.size());
  if (bound == ZSTD_CONTENTSIZE_ERROR) {
    return DataLossError(fmt::format("{}: its zstd stream is corrupt (no valid frame)", what));
  }
  const uint64_t reserve = std::min<uint64_t>(bound, max_bytes);
  if (reserve > kZstdSlack && reserve / kZstdMaxRatio > in.size()) {
    return DataLossError(fmt::format(
        "{}: its zstd stream of {} bytes may decompress to {} bytes, more than {} times its own "
        "size: a zstd item may hold at most that, or {} bytes, so that a small file cannot "
        "claim much memory. An item that compresses better (a tensor of one value) is read "
        "once the checkpoint is saved again without the ZStandard extension",
        what, in.size(), reserve, kZstdMaxRatio, kZstdSlack));
  }
  try {
    out.reserve(static_cast<size_t>(reserve));
  } catch (const std::bad_alloc&) {
    return DataLossError(fmt::format(
        "{}: its zstd stream may decompress to {} bytes (the chunk's claimed size), more memory "
        "than this process can have",
        what, reserve));
  }
  ZSTD_DCtx* ctx = ZSTD_createDCtx();
  if (ctx == nullptr) return InternalError("zstd: cannot create a decompression context");
  std::vector<std::byte> window(std::min<size_t>(ZSTD_DStreamOutSize(), size_t{1} << 20) + 1);
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  Status status;
  while (true) {
    ZSTD_outBuffer output{window.data(), window.size(), 0};
    const size_t ret = ZSTD_decompressStream(ctx, &output, &input);
    if (ZSTD_isError(ret)) {
      status = DataLossError(
          fmt::format("{}: its zstd stream is corrupt ({})", what, ZSTD_getErrorName(ret)));
      break;
    }
    if (output.pos > max_bytes - out.size()) {
      status = DataLossError(
          fmt::format("{}: its zstd stream decompresses to more than the {} bytes its chunk needs",
                      what, max_bytes));
      break;
    }
    if (output.pos > reserve - out.size()) {  // the file's bound is a bound: never reached
      status = DataLossError(fmt::format("{}: its zstd stream is corrupt", what));
      break;
    }
    out.insert(out.end(), window.begin(), window.begin() + static_cast<std::ptrdiff_t>(output.pos));
    status = WalkZipEntries(out, walk, what);
    if (!status.ok()) break;
    if (ret == 0 && input.pos == input.size) break;
    if (input.pos == input.size && output.pos < window.size()) {
      status = DataLossError(fmt::format("{}: its zstd stream is truncated", what));
      break;
    }
  }
  ZSTD_freeDCtx(ctx);
  return status;
}

}  // namespace

bool IsDcpCheckpoint(const std::string& path) {
  if (!IsDir(path)) return false;
  if (HasEntry(path, kMetadataName)) return true;
  for (const std::string& n : ListNames(path)) {
    if (std::regex_match(n, PerRankMetadataName())) return true;
  }
  const std::string shards = HfShardDir(path);
  if (shards.empty()) return false;
  // HuggingFaceStorageWriter with consolidation writes the full checkpoint beside sharded/:
  // that directory is a Hugging Face checkpoint (its sharded/ folder the DCP one).
  return shards == path ||
         (!Exists(path + "/model.safetensors") && !Exists(path + "/model.safetensors.index.json"));
}

Result<std::shared_ptr<const DcpCheckpoint>> DcpCheckpoint::Open(const std::string& dir) {
  if (!IsDir(dir)) return NotFoundError(fmt::format("\"{}\" is not a directory", dir));
  std::shared_ptr<DcpCheckpoint> c(new DcpCheckpoint());
  c->dir_ = dir;
  const std::string single = dir + "/" + kMetadataName;
  if (HasEntry(dir, kMetadataName)) {
    c->storage_ = "torch_save";
    c->metadata_files_ = {single};
    RESHARD_ASSIGN_OR_RETURN(c->metadata_, ReadMetadataFile(single));
  } else {
    std::map<std::string, size_t> index;
    for (const std::string& n : ListNames(dir)) {
      if (!std::regex_match(n, PerRankMetadataName())) continue;
      const std::string path = fmt::format("{}/{}", dir, n);
      RESHARD_ASSIGN_OR_RETURN(DcpMetadata part, ReadMetadataFile(path));
      RESHARD_RETURN_IF_ERROR(
          Merge(std::move(part), path, c->metadata_files_.empty(), c->metadata_, index));
      c->metadata_files_.push_back(path);
    }
    if (!c->metadata_files_.empty()) {
      c->storage_ = "torch_save";
    } else if (const std::string shards = HfShardDir(dir); !shards.empty()) {
      c->storage_ = "safetensors";
      RESHARD_ASSIGN_OR_RETURN(c->metadata_, ReadHfShards(dir, shards));
    } else {
      return NotFoundError(fmt::format(
          "\"{}\" is not a DCP checkpoint: it has no .metadata, no __<rank>.metadata and no "
          "shard-*-model-*-of-*.safetensors files",
          dir));
    }
  }
  // Every file the items name, mapped; every item inside its file.
  for (const std::string& rel : c->metadata_.files) {
    const std::string path = fmt::format("{}/{}", dir, rel);
    auto mapped = MappedFile::Open(path);
    if (!mapped.ok()) {
      return Status(mapped.status().code(),
                    fmt::format("DCP data file {} (named by the checkpoint's metadata): {}", path,
                                mapped.status().message()));
    }
    c->files_.push_back(std::make_shared<File>(path, std::move(*mapped)));
  }
  const auto check = [&](const DcpItemLocation& loc, std::string_view what) -> Status {
    const uint64_t size = c->files_[loc.file]->mapped.bytes().size();
    if (loc.offset > size || loc.length > size - loc.offset) {
      return DataLossError(
          fmt::format("{}: {} is bytes [{}, {}) of {}, which has {} bytes (truncated, or not this "
                      "checkpoint's file)",
                      c->files_[loc.file]->path, what, loc.offset, loc.offset + loc.length,
                      c->metadata_.files[loc.file], size));
    }
    return Status::Ok();
  };
  Rank high = -1;
  for (const DcpTensor& t : c->metadata_.tensors) {
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      RESHARD_RETURN_IF_ERROR(check(t.chunks[i].location, ChunkWhat(t, i)));
      high = std::max(high, t.chunks[i].rank);
    }
  }
  for (const DcpBytesItem& b : c->metadata_.bytes_items) {
    RESHARD_RETURN_IF_ERROR(check(b.location, fmt::format("\"{}\" (bytes)", b.fqn)));
    high = std::max(high, b.rank);
  }
  c->world_size_ = std::max<int>(1, high + 1);
  for (const DcpTensor& t : c->metadata_.tensors) {
    auto map =
        ChunksToMap(fmt::format("{}: \"{}\"", dir, t.fqn), t.shape, t.chunks, c->world_size_);
    if (!map.ok()) return DataLossError(map.status().message());
    c->maps_.push_back(std::move(*map));
  }
  return std::shared_ptr<const DcpCheckpoint>(std::move(c));
}

std::vector<std::string> DcpCheckpoint::file_paths() const {
  std::vector<std::string> out = metadata_files_;
  for (const auto& f : files_) out.push_back(f->path);
  return out;
}

Result<std::span<const std::byte>> DcpCheckpoint::ItemBytes(const DcpItemLocation& loc,
                                                            std::string_view what,
                                                            uint64_t max_bytes,
                                                            std::vector<std::byte>& owned) const {
  std::span<const std::byte> bytes =
      files_[loc.file]->mapped.bytes().subspan(loc.offset, loc.length);
  for (auto t = loc.transforms.rbegin(); t != loc.transforms.rend(); ++t) {
    if (t->rfind("stream.zstd/", 0) != 0) {
      return UnimplementedError(
          fmt::format("{} in {}: its transform \"{}\" is not one reshard reads (only stream.zstd)",
                      what, files_[loc.file]->path, *t));
    }
    std::vector<std::byte> out;
    const bool archive = storage_ == "torch_save" && t + 1 == loc.transforms.rend();
    RESHARD_RETURN_IF_ERROR(DecompressZstd(
        bytes, max_bytes, fmt::format("{} in {}", what, files_[loc.file]->path), archive, out));
    owned = std::move(out);
    bytes = owned;
  }
  return bytes;
}

Result<std::span<const std::byte>> DcpCheckpoint::ReadChunk(size_t t, size_t c,
                                                            std::vector<std::byte>& owned) const {
  const DcpTensor& tensor = metadata_.tensors[t];
  const DcpChunk& chunk = tensor.chunks[c];
  const std::string what = ChunkWhat(tensor, c);
  const uint64_t need = static_cast<uint64_t>(ProductOf(chunk.sizes)) * DTypeSize(tensor.dtype);
  const std::string& path = files_[chunk.location.file]->path;
  RESHARD_ASSIGN_OR_RETURN(std::span<const std::byte> bytes,
                           ItemBytes(chunk.location, what, need + kZstdSlack, owned));
  if (storage_ == "safetensors") {
    if (bytes.size() != need) {
      return DataLossError(
          fmt::format("{}: {} holds {} bytes, its chunk needs {}", path, what, bytes.size(), need));
    }
    return bytes;
  }
  auto file = TorchFile::Parse(bytes);
  if (!file.ok()) {
    return Status(file.status().code(),
                  fmt::format("{}: {} (bytes [{}, {})) is not a torch.save archive: {}", path, what,
                              chunk.location.offset, chunk.location.offset + chunk.location.length,
                              file.status().message()));
  }
  if (file->tensors().size() != 1) {
    return DataLossError(
        fmt::format("{}: {} holds {} tensors, not one", path, what, file->tensors().size()));
  }
  const TorchTensor& tt = file->tensors()[0];
  if (tt.dtype.dtype != tensor.dtype || tt.shape != chunk.sizes) {
    return DataLossError(
        fmt::format("{}: {} holds a {} tensor of shape [{}], the metadata says {} [{}]", path, what,
                    tt.dtype.name, fmt::join(tt.shape, ", "), DTypeName(tensor.dtype),
                    fmt::join(chunk.sizes, ", ")));
  }
  if (tt.is_contiguous()) {
    const TorchStorage& s = file->storages()[tt.storage];
    return s.bytes.subspan(static_cast<size_t>(tt.storage_offset) * tt.dtype.size, need);
  }
  std::vector<std::byte> dense(need);
  RESHARD_RETURN_IF_ERROR(file->CopyTo(tt, dense));
  owned = std::move(dense);
  return std::span<const std::byte>(owned);
}

Result<std::span<const std::byte>> DcpCheckpoint::ReadBytesItem(
    size_t i, std::vector<std::byte>& owned) const {
  const DcpBytesItem& b = metadata_.bytes_items[i];
  return ItemBytes(b.location, fmt::format("\"{}\" (bytes)", b.fqn), b.location.length + kZstdSlack,
                   owned);
}

std::span<const std::byte> DcpCheckpoint::StoredBytesItem(size_t i) const {
  const DcpItemLocation& loc = metadata_.bytes_items[i].location;
  return files_[loc.file]->mapped.bytes().subspan(loc.offset, loc.length);
}

void DcpCheckpoint::ReleaseChunk(size_t t, size_t c) const {
  const DcpItemLocation& loc = metadata_.tensors[t].chunks[c].location;
  ReleaseMappedPages(files_[loc.file]->mapped.bytes().subspan(loc.offset, loc.length));
}

namespace {

using ordered_json = nlohmann::ordered_json;

// A bytes item's object, inert: its plain value (a torch.save archive of plain data), else
// what it is.
ordered_json BytesValue(const DcpCheckpoint& c, size_t i) {
  std::vector<std::byte> owned;
  auto bytes = c.ReadBytesItem(i, owned);
  if (!bytes.ok()) return {{"unread", std::string(bytes.status().message())}};
  if (!LooksLikeTorchFile(*bytes)) return {{"raw_bytes", bytes->size()}};
  auto file = TorchFile::Parse(*bytes);
  if (!file.ok()) return {{"unread", std::string(file.status().message())}};
  if (!file->tensors().empty()) return {{"tensors", file->tensors().size()}};
  nlohmann::json v = internal::ToJson(file->tree(), file->tree().root());
  if (v.is_null() && file->tree().node(file->tree().root()).kind != PickleKind::kNone) {
    return {{"object", std::string(PickleKindName(file->tree().node(file->tree().root()).kind))}};
  }
  return {{"value", ordered_json::parse(v.dump())}};
}

std::string ShortValue(const ordered_json& v) {
  std::string text = v.contains("value") ? v["value"].dump() : v.dump();
  if (text.size() > 120) text = text.substr(0, 117) + "...";
  return text;
}

}  // namespace

std::string DcpSummaryJson(const DcpCheckpoint& c) {
  ordered_json tensors = ordered_json::array();
  for (size_t i = 0; i < c.tensors().size(); ++i) {
    const DcpTensor& t = c.tensors()[i];
    ordered_json chunks = ordered_json::array();
    for (const DcpChunk& ch : t.chunks) {
      chunks.push_back({{"offsets", ch.offsets},
                        {"sizes", ch.sizes},
                        {"rank", ch.rank},
                        {"file", c.metadata().files[ch.location.file]},
                        {"offset", ch.location.offset},
                        {"length", ch.location.length},
                        {"transforms", ch.location.transforms}});
    }
    tensors.push_back({{"name", t.fqn},
                       {"dtype", DTypeName(t.dtype)},
                       {"shape", t.shape},
                       {"optimizer_state", t.optimizer_state},
                       {"chunks", chunks}});
  }
  ordered_json items = ordered_json::array();
  for (size_t i = 0; i < c.bytes_items().size(); ++i) {
    const DcpBytesItem& b = c.bytes_items()[i];
    items.push_back({{"name", b.fqn},
                     {"rank", b.rank},
                     {"file", c.metadata().files[b.location.file]},
                     {"offset", b.location.offset},
                     {"length", b.location.length},
                     {"contents", BytesValue(c, i)}});
  }
  ordered_json doc = {{"format", "dcp"},
                      {"storage", c.storage()},
                      {"version", c.metadata().version},
                      {"world_size", c.world_size()},
                      {"files", c.metadata().files},
                      {"tensors", tensors},
                      {"bytes", items}};
  return doc.dump();
}

std::string DcpSummaryText(const DcpCheckpoint& c) {
  size_t optimizer = 0;
  for (const DcpTensor& t : c.tensors()) optimizer += t.optimizer_state ? 1 : 0;
  std::string out = fmt::format(
      "DCP checkpoint \"{}\" ({}{}): written by {} ranks in {} files; {} tensors ({} optimizer "
      "state), {} bytes items\n",
      c.dir(), c.storage(), c.metadata().version.empty() ? "" : ", version " + c.metadata().version,
      c.world_size(), c.metadata().files.size(), c.tensors().size(), optimizer,
      c.bytes_items().size());
  for (const DcpTensor& t : c.tensors()) {
    std::string chunks;
    for (const DcpChunk& ch : t.chunks) {
      chunks += fmt::format("{}rank {}: {}+{}", chunks.empty() ? "" : "; ", ch.rank,
                            FormatShape(ch.offsets), FormatShape(ch.sizes));
      if (!ch.location.transforms.empty()) {
        chunks += fmt::format(" ({})", fmt::join(ch.location.transforms, ", "));
      }
    }
    out += fmt::format("  {}  {} {}{}  {} chunk{}\n    {}\n", t.fqn, DTypeName(t.dtype),
                       FormatShape(t.shape), t.optimizer_state ? "  (optimizer state)" : "",
                       t.chunks.size(), t.chunks.size() == 1 ? "" : "s", chunks);
  }
  for (size_t i = 0; i < c.bytes_items().size(); ++i) {
    const DcpBytesItem& b = c.bytes_items()[i];
    out += fmt::format("  {}  bytes ({} bytes, rank {})  {}\n", b.fqn, b.location.length, b.rank,
                       ShortValue(BytesValue(c, i)));
  }
  return out;
}

namespace {

class DcpShardSource : public ShardSource {
 public:
  DcpShardSource(std::shared_ptr<const DcpCheckpoint> ckpt, const DcpSourceOptions& options)
      : ckpt_(std::move(ckpt)) {
    manifest_.world_size = ckpt_->world_size();
    for (size_t i = 0; i < ckpt_->tensors().size(); ++i) {
      const DcpTensor& t = ckpt_->tensors()[i];
      if (options.weights_only && t.optimizer_state) continue;
      manifest_.params.push_back(
          ShardedParam{t.fqn, t.dtype, ckpt_->map(i), DcpDefaultLayout(t.shape), 1});
      which_.push_back(i);
    }
  }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {ckpt_->dir()};
    for (const std::string& p : ckpt_->file_paths()) inputs.push_back(p);
    return inputs;
  }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(i);
      if (it != cache_.end()) {
        ++it->second->users;
        return it->second->buffers;
      }
    }
    auto e = std::make_shared<Entry>();
    RESHARD_RETURN_IF_ERROR(Read(i, *e));
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = cache_.emplace(i, e);
    ++it->second->users;
    return it->second->buffers;
  }

  void ReleaseShards(size_t i) override {
    std::shared_ptr<Entry> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(i);
      if (it == cache_.end() || --it->second->users > 0) return;
      done = std::move(it->second);
      cache_.erase(it);
    }
    const size_t t = which_[i];
    for (size_t c = 0; c < ckpt_->tensors()[t].chunks.size(); ++c) ckpt_->ReleaseChunk(t, c);
  }

 private:
  struct Entry {
    int users = 0;
    std::vector<ConstBuffer> buffers;           // per rank
    std::vector<std::vector<std::byte>> owned;  // per rank, when assembled or copied
  };

  Status Read(size_t i, Entry& e) {
    const size_t t = which_[i];
    const DcpTensor& tensor = ckpt_->tensors()[t];
    const ParamMap& map = manifest_.params[i].map;
    const size_t esize = DTypeSize(tensor.dtype);
    const auto world = static_cast<size_t>(map.world_size());
    e.buffers.assign(world, {});
    e.owned.assign(world, {});
    std::vector<std::vector<size_t>> by_rank(world);
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      if (ProductOf(tensor.chunks[c].sizes) > 0) {
        by_rank[static_cast<size_t>(tensor.chunks[c].rank)].push_back(c);
      }
    }
    for (size_t r = 0; r < world; ++r) {
      const Index n = map.shard_num_elements(static_cast<Rank>(r));
      if (by_rank[r].size() == 1) {
        // One chunk: its bytes in place when the item holds them densely.
        std::vector<std::byte> owned;
        RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt_->ReadChunk(t, by_rank[r][0], owned));
        e.owned[r] = std::move(owned);
        e.buffers[r] = {bytes.data(), n};
        continue;
      }
      std::vector<std::byte>& dense = e.owned[r];
      dense.resize(static_cast<size_t>(n) * esize);
      size_t at = 0;
      for (size_t c : by_rank[r]) {
        std::vector<std::byte> owned;
        RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt_->ReadChunk(t, c, owned));
        std::memcpy(dense.data() + at, bytes.data(), bytes.size());
        at += bytes.size();
      }
      e.buffers[r] = {dense.data(), n};
    }
    return Status::Ok();
  }

  std::shared_ptr<const DcpCheckpoint> ckpt_;
  Manifest manifest_;
  std::vector<size_t> which_;
  std::mutex mu_;
  std::map<size_t, std::shared_ptr<Entry>> cache_;
};

}  // namespace

LayoutDescriptor DcpDefaultLayout(const Shape& shape) {
  LayoutDescriptor d;
  if (shape.empty()) return d;  // replicated
  d.family = LayoutFamily::kSplit;
  d.dim = 0;
  d.rule.remainder = Remainder::kCeil;
  return d;
}

std::unique_ptr<ShardSource> DcpSource(std::shared_ptr<const DcpCheckpoint> ckpt,
                                       const DcpSourceOptions& options) {
  return std::make_unique<DcpShardSource>(std::move(ckpt), options);
}

std::shared_ptr<const StateDictStructure> DcpStateDict(
    const std::shared_ptr<const DcpCheckpoint>& ckpt, bool weights_only) {
  auto out = std::make_shared<StateDictStructure>();
  // A path planner_data does not record: the key alone, as torch's loader then takes it.
  const auto path_of = [](const auto& item) {
    if (item.path_recorded) return StateDictPath{item.path, item.path_is_index};
    return StateDictPath{{item.fqn}, {false}};
  };
  for (const DcpTensor& t : ckpt->tensors()) {
    if (weights_only && t.optimizer_state) continue;
    out->tensor_paths.emplace(t.fqn, path_of(t));
  }
  // Per-rank saves store a value once per rank under one key: the lowest rank's copy is kept
  // (copies are not compared: torch.save archives of one object differ in their random
  // serialization_id).
  std::map<std::string, size_t> first;  // key -> its lowest-rank item
  for (size_t i = 0; i < ckpt->bytes_items().size(); ++i) {
    const DcpBytesItem& b = ckpt->bytes_items()[i];
    const auto [it, fresh] = first.emplace(b.fqn, i);
    if (!fresh && b.rank < ckpt->bytes_items()[it->second].rank) it->second = i;
  }
  for (size_t i = 0; i < ckpt->bytes_items().size(); ++i) {
    const DcpBytesItem& b = ckpt->bytes_items()[i];
    if (first.at(b.fqn) != i || (weights_only && IsDcpOptimizerState(b.path))) continue;
    StateDictObject object{b.fqn, path_of(b), b.location.transforms, b.location.length, {}};
    object.read = [ckpt, i]() -> Result<std::span<const std::byte>> {
      return ckpt->StoredBytesItem(i);
    };
    out->objects.push_back(std::move(object));
  }
  return out;
}

Status CheckDcpOptions(const std::string& path, const SourceOptions& options) {
  return internal::CheckSelfDescribedOptions(path, options,
                                             {"a PyTorch Distributed Checkpoint", "tensors"});
}

Result<OpenedCheckpoint> OpenDcp(const std::string& path, const SourceOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckDcpOptions(path, options));
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const DcpCheckpoint> ckpt, DcpCheckpoint::Open(path));
  OpenedCheckpoint out;
  out.format = "dcp";
  out.run = DcpRunOf(*ckpt);
  DcpSourceOptions source;
  source.weights_only =
      options.use == SourceUse::kGather ? !options.optimizer_state : options.weights_only;
  if (options.use == SourceUse::kConvert) out.state_dict = DcpStateDict(ckpt, source.weights_only);
  out.source = DcpSource(std::move(ckpt), source);
  return out;
}

}  // namespace reshard
