// Orbax checkpoints: finding the items, reading their metadata, the boxes of each device, and
// the ShardSource over them.
#include "reshard/checkpoint/orbax/orbax.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"

namespace reshard {

namespace fs = std::filesystem;
using json::Json;

namespace {

// Metadata files are small; a larger one is refused before it is read.
constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}
bool IsDir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

std::vector<fs::path> SubDirs(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code type_error;
    if (e.is_directory(type_error)) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool IsItem(const fs::path& dir) { return IsFile(dir / "_METADATA"); }
bool IsStep(const fs::path& dir) {
  if (IsFile(dir / "_CHECKPOINT_METADATA")) return true;
  const auto subs = SubDirs(dir);
  return std::any_of(subs.begin(), subs.end(), IsItem);
}

// The step number at the end of a step directory's name ("120", "checkpoint_120"); none for a
// save still in progress ("120.orbax-checkpoint-tmp-<n>").
std::optional<int64_t> StepNumber(const std::string& name) {
  if (name.find(".orbax-checkpoint-tmp") != std::string::npos) return std::nullopt;
  size_t i = name.size();
  while (i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9') --i;
  if (i == name.size() || name.size() - i > 18) return std::nullopt;
  int64_t v = 0;
  std::from_chars(name.data() + i, name.data() + name.size(), v);
  return v;
}

Result<std::string> ReadSmallFile(const fs::path& p) {
  RESHARD_ASSIGN_OR_RETURN(MappedFile m, MappedFile::Open(p.string()));
  if (m.bytes().size() > kMaxMetadataBytes) {
    return DataLossError(fmt::format("\"{}\": {} bytes, more than a metadata file may have",
                                     p.string(), m.bytes().size()));
  }
  return std::string(reinterpret_cast<const char*>(m.bytes().data()), m.bytes().size());
}

Result<std::string> Base64Decode(std::string_view in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v = -1;
    if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
    if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
    if (ch == '+' || ch == '-') v = 62;
    if (ch == '/' || ch == '_') v = 63;
    if (ch == '=') break;
    if (v < 0) return InvalidArgumentError(fmt::format("{} is not base64", json::QuoteShort(in)));
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

Status Annotated(const Status& s, const fs::path& file) {
  return s.Annotate(fmt::format("\"{}\"", file.string()));
}

// One leaf's sharding, from the JSON text _sharding records for it.
Result<OrbaxSharding> ParseSharding(const std::string& text, size_t array_rank) {
  RESHARD_ASSIGN_OR_RETURN(const Json j, json::ParseJson(text));
  if (!j.is_object()) return json::TypeError("", "an object", j);
  OrbaxSharding s;
  RESHARD_ASSIGN_OR_RETURN(const Json* type, json::Require(j, "", "sharding_type"));
  RESHARD_ASSIGN_OR_RETURN(s.type, json::ReadString(*type, "sharding_type"));
  if (s.type != "NamedSharding") return s;
  RESHARD_ASSIGN_OR_RETURN(const Json* shape, json::Require(j, "", "shape"));
  RESHARD_ASSIGN_OR_RETURN(s.mesh_shape, json::ReadIntArray(*shape, "shape", json::kPositive));
  RESHARD_ASSIGN_OR_RETURN(const Json* names, json::Require(j, "", "axis_names"));
  if (!names->is_array() || names->size() != s.mesh_shape.size()) {
    return json::TypeError("axis_names", "one name per mesh dimension", *names);
  }
  for (size_t a = 0; a < names->size(); ++a) {
    RESHARD_ASSIGN_OR_RETURN(std::string n,
                             json::ReadString((*names)[a], json::Element("axis_names", a)));
    s.axis_names.push_back(std::move(n));
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* spec, json::Require(j, "", "partition_spec"));
  if (!spec->is_array() || spec->size() > array_rank) {
    return json::TypeError("partition_spec", "at most one entry per array dimension", *spec);
  }
  std::set<std::string> used;
  s.spec.assign(array_rank, {});
  for (size_t d = 0; d < spec->size(); ++d) {
    const Json& e = (*spec)[d];
    const std::string at = json::Element("partition_spec", d);
    std::vector<std::string> axes;
    if (e.is_string()) axes.push_back(e.get<std::string>());
    if (e.is_array()) {
      for (size_t k = 0; k < e.size(); ++k) {
        RESHARD_ASSIGN_OR_RETURN(std::string n, json::ReadString(e[k], json::Element(at, k)));
        axes.push_back(std::move(n));
      }
    }
    if (!e.is_null() && !e.is_string() && !e.is_array()) {
      return json::TypeError(at, "null, an axis name or a list of them", e);
    }
    for (const std::string& a : axes) {
      if (std::find(s.axis_names.begin(), s.axis_names.end(), a) == s.axis_names.end()) {
        return json::ErrorAt(at, fmt::format("{} is not an axis of the mesh", json::Quote(a)));
      }
      if (!used.insert(a).second) {
        return json::ErrorAt(at, fmt::format("axis {} is used twice", json::Quote(a)));
      }
    }
    s.spec[d] = std::move(axes);
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* dm, json::Require(j, "", "device_mesh"));
  RESHARD_ASSIGN_OR_RETURN(const Json* mesh, json::Require(*dm, "device_mesh", "mesh"));
  const Json flat = mesh->flatten();  // "/0/1/id" -> id
  // flatten() sorts by its keys' text; the row-major order comes from the indices themselves.
  std::vector<std::pair<Shape, int64_t>> ids;
  for (const auto& [key, value] : flat.items()) {
    if (!key.ends_with("/id")) continue;  // other fields of a device
    Shape idx;
    for (size_t at = 1; at < key.size();) {
      const size_t end = key.find('/', at);
      const std::string part = key.substr(at, end - at);
      at = end == std::string::npos ? key.size() : end + 1;
      if (end == std::string::npos) break;  // "id"
      Index v = 0;
      std::from_chars(part.data(), part.data() + part.size(), v);
      idx.push_back(v);
    }
    RESHARD_ASSIGN_OR_RETURN(const Index id,
                             json::ReadInt(value, "device_mesh.mesh", json::kCount));
    ids.emplace_back(std::move(idx), id);
  }
  RESHARD_ASSIGN_OR_RETURN(const Index devices, CheckedProduct(s.mesh_shape));
  if (static_cast<Index>(ids.size()) != devices || devices > (Index{1} << 24)) {
    return json::ErrorAt("device_mesh.mesh", fmt::format("{} devices for a mesh of {}", ids.size(),
                                                         FormatShape(s.mesh_shape)));
  }
  std::sort(ids.begin(), ids.end());
  for (size_t m = 0; m < ids.size(); ++m) {
    if (ids[m].first != UnravelIndex(static_cast<Index>(m), s.mesh_shape)) {
      return json::ErrorAt("device_mesh.mesh", "not nested as the mesh's shape");
    }
  }
  for (auto& [idx, id] : ids) s.device_ids.push_back(id);
  if (std::set<int64_t>(s.device_ids.begin(), s.device_ids.end()).size() != ids.size()) {
    return json::ErrorAt("device_mesh.mesh", "a device appears twice");
  }
  return s;
}

}  // namespace

// One item's storage: OCDBT databases (merged, or per process) or plain files.
struct OrbaxCheckpoint::Item {
  std::string dir;
  std::string storage;
  std::vector<std::shared_ptr<OcdbtDatabase>> dbs;
  std::map<std::string, size_t> key_db;  // key -> dbs index

  bool Has(const std::string& key) const {
    if (!dbs.empty()) return key_db.count(key) > 0;
    return IsFile(fs::path(dir) / key);
  }
  // A key's bytes; `missing` when it is not stored. A database's are a view into its mapped
  // data file; a plain file is read into `owned` (never mapped: several threads may read one
  // chunk at once, and a checkpoint of many chunks would need a mapping each).
  Result<std::span<const std::byte>> Read(const std::string& key, bool& missing,
                                          std::string& owned) const {
    missing = false;
    if (!dbs.empty()) {
      auto it = key_db.find(key);
      if (it == key_db.end()) {
        missing = true;
        return std::span<const std::byte>();
      }
      return dbs[it->second]->Read(key);
    }
    const fs::path p = fs::path(dir) / key;
    if (!IsFile(p)) {
      missing = true;
      return std::span<const std::byte>();
    }
    RESHARD_ASSIGN_OR_RETURN(owned, ReadFileToString(p.string()));
    return std::as_bytes(std::span<const char>(owned.data(), owned.size()));
  }
  void Release(const std::string& key) const {
    if (dbs.empty()) return;
    auto it = key_db.find(key);
    if (it != key_db.end()) dbs[it->second]->Release(key);
  }
};

namespace {

Status OpenStorage(OrbaxCheckpoint* /*unused*/, const fs::path& dir, std::string& storage,
                   std::vector<std::shared_ptr<OcdbtDatabase>>& dbs,
                   std::map<std::string, size_t>& key_db) {
  std::vector<fs::path> db_dirs;
  if (IsFile(dir / "manifest.ocdbt")) {
    db_dirs.push_back(dir);
  } else {
    for (const fs::path& sub : SubDirs(dir)) {
      if (sub.filename().string().starts_with("ocdbt.process_") && IsFile(sub / "manifest.ocdbt")) {
        db_dirs.push_back(sub);
      }
    }
  }
  if (db_dirs.empty()) {
    storage = "";
    return Status::Ok();
  }
  storage = db_dirs.size() == 1 && db_dirs[0] == dir ? "ocdbt" : "ocdbt (per process)";
  for (const fs::path& d : db_dirs) {
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<OcdbtDatabase> db, OcdbtDatabase::Open(d.string()));
    for (const auto& [key, value] : db->keys()) key_db.emplace(key, dbs.size());
    dbs.push_back(std::move(db));
  }
  return Status::Ok();
}

// The leaf paths of _METADATA: (path, is_index, value_type, write_shape), in its order.
struct Leaf {
  std::vector<std::string> path;
  std::vector<bool> is_index;
  std::string value_type;
  Shape write_shape;
};

Result<std::vector<Leaf>> ParseTreeMetadata(const std::string& text) {
  RESHARD_ASSIGN_OR_RETURN(const Json j, json::ParseJson(text));
  if (!j.is_object()) return json::TypeError("", "an object", j);
  RESHARD_ASSIGN_OR_RETURN(const Json* tree, json::Require(j, "", "tree_metadata"));
  if (!tree->is_object()) return json::TypeError("tree_metadata", "an object", *tree);
  std::vector<Leaf> leaves;
  for (const auto& [tuple, entry] : tree->items()) {
    const std::string at = json::Member("tree_metadata", tuple);
    Leaf leaf;
    RESHARD_ASSIGN_OR_RETURN(const Json* keys, json::Require(entry, at, "key_metadata"));
    if (!keys->is_array() || keys->empty()) {
      return json::TypeError(json::Member(at, "key_metadata"), "a non-empty array", *keys);
    }
    for (size_t k = 0; k < keys->size(); ++k) {
      const std::string kat = json::Element(json::Member(at, "key_metadata"), k);
      RESHARD_ASSIGN_OR_RETURN(const Json* key, json::Require((*keys)[k], kat, "key"));
      std::string name = key->is_string() ? key->get<std::string>() : key->dump();
      if (name.empty() || name.find('/') != std::string::npos ||
          name.find('\0') != std::string::npos) {
        return json::ErrorAt(kat, fmt::format("key {} cannot name an array", json::Quote(name)));
      }
      const Json* type = json::Find((*keys)[k], "key_type");
      leaf.path.push_back(std::move(name));
      leaf.is_index.push_back(type != nullptr && *type == 1);
    }
    RESHARD_ASSIGN_OR_RETURN(const Json* value, json::Require(entry, at, "value_metadata"));
    if (const Json* t = json::Find(*value, "value_type"); t != nullptr && t->is_string()) {
      leaf.value_type = t->get<std::string>();
    }
    if (const Json* w = json::Find(*value, "write_shape"); w != nullptr && w->is_array()) {
      RESHARD_ASSIGN_OR_RETURN(
          leaf.write_shape, json::ReadIntArray(*w, json::Member(at, "write_shape"), json::kCount));
    }
    leaves.push_back(std::move(leaf));
  }
  return leaves;
}

bool IsOptimizerKey(const std::string& first) {
  return first == "opt_state" || first == "optimizer" || first == "optimizer_state" ||
         first == "opt";
}

std::string Join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ".") + p;
  return out;
}

}  // namespace

Status OrbaxCheckpoint::OpenItem(const std::string& dir_text, const std::string& prefix) {
  const fs::path dir(dir_text);
  auto item = std::make_shared<Item>();
  item->dir = dir_text;
  RESHARD_RETURN_IF_ERROR(OpenStorage(this, dir, item->storage, item->dbs, item->key_db));
  RESHARD_ASSIGN_OR_RETURN(const std::string meta_text, ReadSmallFile(dir / "_METADATA"));
  Result<std::vector<Leaf>> leaves = ParseTreeMetadata(meta_text);
  if (!leaves.ok()) return DataLossError(Annotated(leaves.status(), dir / "_METADATA").message());
  std::map<std::string, std::string> shardings;  // param name -> sharding JSON text
  if (IsFile(dir / "_sharding")) {
    RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(dir / "_sharding"));
    Result<Json> j = json::ParseJson(text);
    if (!j.ok() || !j->is_object()) {
      return DataLossError(fmt::format("\"{}\": not a JSON object{}", (dir / "_sharding").string(),
                                       j.ok() ? "" : ": " + j.status().message()));
    }
    for (const auto& [key, value] : j->items()) {
      Result<std::string> name = Base64Decode(key);
      if (!name.ok() || !value.is_string()) {
        return DataLossError(fmt::format("\"{}\": entry {} is not base64(name) -> JSON text",
                                         (dir / "_sharding").string(), json::QuoteShort(key)));
      }
      shardings.emplace(*name, value.get<std::string>());
    }
  }
  const size_t item_index = items_data_.size();
  for (Leaf& leaf : *leaves) {
    OrbaxArray a;
    a.name = prefix + Join(leaf.path);
    const std::string stored = Join(leaf.path);
    if (stored == "." || stored == "..") {
      return DataLossError(fmt::format("\"{}\": leaf {} cannot name an array",
                                       (dir / "_METADATA").string(), json::Quote(stored)));
    }
    a.path = std::move(leaf.path);
    a.path_is_index = std::move(leaf.is_index);
    a.value_type = leaf.value_type;
    a.write_shape = std::move(leaf.write_shape);
    a.optimizer_state = IsOptimizerKey(a.path.front());
    std::string meta_key = stored + "/.zarray";
    if (!item->Has(meta_key)) meta_key = stored + "/zarr.json";
    if (!item->Has(meta_key)) {
      others_.emplace_back(a.name, a.value_type.empty() ? "unknown" : a.value_type);
      continue;
    }
    bool missing = false;
    std::string owned;
    RESHARD_ASSIGN_OR_RETURN(const auto meta, item->Read(meta_key, missing, owned));
    const std::string where = fmt::format("\"{}\": {}", dir_text, meta_key);
    if (meta.size() > kMaxMetadataBytes) return DataLossError(where + ": too large");
    Result<ZarrArray> z = ParseZarrMetadata(
        std::string_view(reinterpret_cast<const char*>(meta.data()), meta.size()), where);
    if (!z.ok()) {
      if (z.status().code() == StatusCode::kInvalidArgument) {
        return DataLossError(z.status().message());
      }
      return z.status();
    }
    a.zarr = *std::move(z);
    if (auto it = shardings.find(stored); it != shardings.end()) {
      Result<OrbaxSharding> s = ParseSharding(it->second, a.zarr.shape.size());
      if (!s.ok()) {
        return DataLossError(fmt::format("\"{}\": the sharding of {}: {}",
                                         (dir / "_sharding").string(), json::Quote(stored),
                                         s.status().message()));
      }
      a.sharding = *std::move(s);
    }
    arrays_.push_back(std::move(a));
    item_of_.push_back(item_index);
  }
  if (storage_.empty()) {
    const bool v3 = std::any_of(arrays_.begin(), arrays_.end(),
                                [](const OrbaxArray& a) { return a.zarr.zarr_format == 3; });
    storage_ = (item->storage.empty() ? "" : item->storage + "+") + (v3 ? "zarr3" : "zarr2");
  }
  items_.push_back(dir_text);
  items_data_.push_back(std::move(item));
  return Status::Ok();
}

namespace {

// The box device `m` (row-major over the mesh) holds.
std::pair<Shape, Shape> DeviceBox(const OrbaxSharding& s, const Shape& shape, Index m) {
  const Shape coords = UnravelIndex(m, s.mesh_shape);
  Shape offsets(shape.size(), 0), sizes = shape;
  for (size_t d = 0; d < shape.size(); ++d) {
    Index parts = 1, index = 0;
    for (const std::string& axis : s.spec[d]) {
      const auto a = static_cast<size_t>(std::find(s.axis_names.begin(), s.axis_names.end(), axis) -
                                         s.axis_names.begin());
      parts *= s.mesh_shape[a];
      index = index * s.mesh_shape[a] + coords[a];
    }
    const Index step = (shape[d] + parts - 1) / parts;
    offsets[d] = std::min(shape[d], index * step);
    sizes[d] = std::min(shape[d], offsets[d] + step) - offsets[d];
  }
  return {offsets, sizes};
}

}  // namespace

Status OrbaxCheckpoint::BuildMaps() {
  std::set<int64_t> ids;
  for (const OrbaxArray& a : arrays_) {
    if (a.sharding && a.sharding->type == "NamedSharding") {
      ids.insert(a.sharding->device_ids.begin(), a.sharding->device_ids.end());
    }
  }
  device_ids_.assign(ids.begin(), ids.end());
  std::map<int64_t, Rank> rank_of;
  for (size_t r = 0; r < device_ids_.size(); ++r) rank_of[device_ids_[r]] = static_cast<Rank>(r);
  const int world = world_size();
  for (const OrbaxArray& a : arrays_) {
    const Shape& shape = a.zarr.shape;
    std::vector<std::pair<Shape, Shape>> boxes(static_cast<size_t>(world),
                                               {Shape(shape.size(), 0), Shape(shape.size(), 0)});
    std::vector<DcpChunk> chunks;
    if (a.sharding && a.sharding->type == "NamedSharding") {
      const OrbaxSharding& s = *a.sharding;
      for (size_t m = 0; m < s.device_ids.size(); ++m) {
        const Rank r = rank_of.at(s.device_ids[m]);
        boxes[static_cast<size_t>(r)] = DeviceBox(s, shape, static_cast<Index>(m));
        chunks.push_back(DcpChunk{
            boxes[static_cast<size_t>(r)].first, boxes[static_cast<size_t>(r)].second, r, {}});
      }
      // Orbax writes a device's box in pieces of write_shape (the box itself, or a part of it
      // under chunk_byte_size): they tile the box.
      if (a.write_shape.size() == shape.size() && !s.device_ids.empty()) {
        const Shape& first = boxes[static_cast<size_t>(rank_of.at(s.device_ids[0]))].second;
        for (size_t d = 0; d < shape.size(); ++d) {
          if (a.write_shape[d] <= 0 ? first[d] != 0 : first[d] % a.write_shape[d] != 0) {
            return DataLossError(fmt::format(
                "\"{}\": {}: write_shape {} does not tile the box {} its sharding gives the "
                "first device",
                path_, json::Quote(a.name), FormatShape(a.write_shape), FormatShape(first)));
          }
        }
      }
    } else {
      boxes[0] = {Shape(shape.size(), 0), shape};
      chunks.push_back(DcpChunk{boxes[0].first, boxes[0].second, 0, {}});
    }
    Result<ParamMap> map = ChunksToMap(a.name, shape, chunks, world);
    if (!map.ok()) return DataLossError(fmt::format("\"{}\": {}", path_, map.status().message()));
    maps_.push_back(*std::move(map));
    boxes_.push_back(std::move(boxes));
  }
  return Status::Ok();
}

Result<std::shared_ptr<const OrbaxCheckpoint>> OrbaxCheckpoint::Open(const std::string& path) {
  fs::path dir(path);
  if (!IsDir(dir)) return NotFoundError(fmt::format("\"{}\" is not a directory", path));
  if (!IsItem(dir) && !IsStep(dir)) {
    // A checkpoint root: its newest step.
    std::optional<std::pair<int64_t, fs::path>> newest;
    for (const fs::path& sub : SubDirs(dir)) {
      const auto step = StepNumber(sub.filename().string());
      if (step && IsStep(sub) && (!newest || *step > newest->first)) newest = {{*step, sub}};
    }
    if (!newest) {
      return DataLossError(fmt::format(
          "\"{}\" is no Orbax checkpoint: no _METADATA in it, and no step directory inside it",
          path));
    }
    dir = newest->second;
  }
  std::shared_ptr<OrbaxCheckpoint> c(new OrbaxCheckpoint());
  c->path_ = dir.string();
  if (IsItem(dir)) {
    RESHARD_RETURN_IF_ERROR(c->OpenItem(dir.string(), ""));
  } else {
    std::vector<fs::path> items;
    for (const fs::path& sub : SubDirs(dir)) {
      if (IsItem(sub)) items.push_back(sub);
    }
    if (items.empty()) {
      return DataLossError(fmt::format("\"{}\": a step directory with no item inside it", path));
    }
    for (const fs::path& item : items) {
      RESHARD_RETURN_IF_ERROR(
          c->OpenItem(item.string(), items.size() == 1 ? "" : item.filename().string() + "."));
    }
  }
  RESHARD_RETURN_IF_ERROR(c->BuildMaps());
  return std::shared_ptr<const OrbaxCheckpoint>(std::move(c));
}

std::pair<Shape, Shape> OrbaxCheckpoint::Box(size_t i, Rank rank) const {
  return boxes_[i][static_cast<size_t>(rank)];
}

std::vector<std::string> OrbaxCheckpoint::inputs() const {
  std::vector<std::string> out = {path_};
  for (const std::string& i : items_) out.push_back(i);
  return out;
}

Status OrbaxCheckpoint::ReadBox(size_t i, const Shape& offsets, const Shape& sizes,
                                std::span<std::byte> out, int threads) const {
  const OrbaxArray& a = arrays_[i];
  const Item& item = *items_data_[item_of_[i]];
  const size_t rank = sizes.size();
  if (ProductOf(sizes) == 0 && rank > 0) return Status::Ok();
  Shape lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = offsets[d] / a.zarr.chunk_shape[d];
    hi[d] = (offsets[d] + sizes[d] - 1) / a.zarr.chunk_shape[d] + 1;
  }
  // The chunks the box overlaps, row-major: each lands in a part of `out` of its own, so
  // threads take them in turn, each with its own decode buffer.
  std::vector<Shape> chunks;
  for (Shape at = lo;;) {
    chunks.push_back(at);
    size_t d = rank;
    while (d-- > 0) {
      if (++at[d] < hi[d]) break;
      at[d] = lo[d];
    }
    if (d == static_cast<size_t>(-1)) break;
  }
  const std::string stored = Join(a.path);
  const size_t esize = DTypeSize(a.zarr.dtype);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first = Status::Ok();
  auto work = [&] {
    std::vector<std::byte> chunk;
    std::string owned;
    for (size_t k = next++; k < chunks.size() && !failed; k = next++) {
      const Shape& at = chunks[k];
      const std::string key = stored + "/" + ZarrChunkKey(a.zarr, at);
      Status s = [&]() -> Status {
        const std::string what = fmt::format("\"{}\": chunk {}", item.dir, json::Quote(key));
        bool missing = false;
        RESHARD_ASSIGN_OR_RETURN(const auto bytes, item.Read(key, missing, owned));
        RESHARD_RETURN_IF_ERROR(DecodeZarrChunk(a.zarr, bytes, missing, what, chunk));
        item.Release(key);
        Shape origin(rank);
        for (size_t d = 0; d < rank; ++d) origin[d] = at[d] * a.zarr.chunk_shape[d];
        CopyChunkIntoBox(origin, a.zarr.chunk_shape, chunk, offsets, sizes, esize, out);
        return Status::Ok();
      }();
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(s);
        failed = true;
      }
    }
  };
  const size_t helpers = std::min(chunks.size(), static_cast<size_t>(std::max(threads, 1))) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (size_t t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return first;
}

}  // namespace reshard
