// Orbax checkpoints written (WriteOrbax, orbax.h): one item, each array a zarr array (v3 or v2)
// of zstd chunks, one chunk per distinct device box of its NamedSharding, as keys of an OCDBT
// database (ocdbt_writer.cc) or as files of per-array directories.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/sharded_io.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"
#include "reshard/ir/compose.h"

namespace reshard {

namespace fs = std::filesystem;
using json::Json;

namespace {

// The database of process 0, beside the merged one in the item directory.
constexpr char kProcessDatabase[] = "ocdbt.process_0";

Result<std::vector<std::vector<std::string>>> ReadSpec(const Json& j, std::string_view path,
                                                       const OrbaxTarget& t) {
  std::vector<std::vector<std::string>> spec;
  if (j.is_null()) return spec;
  if (!j.is_array()) return json::TypeError(path, "a partition spec (an array) or null", j);
  std::set<std::string> used;
  for (size_t d = 0; d < j.size(); ++d) {
    const std::string at = json::Element(path, d);
    std::vector<std::string> axes;
    if (j[d].is_string()) axes.push_back(j[d].get<std::string>());
    if (j[d].is_array()) {
      for (size_t k = 0; k < j[d].size(); ++k) {
        RESHARD_ASSIGN_OR_RETURN(std::string a, json::ReadString(j[d][k], json::Element(at, k)));
        axes.push_back(std::move(a));
      }
    }
    if (!j[d].is_null() && !j[d].is_string() && !j[d].is_array()) {
      return json::TypeError(at, "null, a mesh axis or a list of them", j[d]);
    }
    for (const std::string& a : axes) {
      if (std::find(t.axis_names.begin(), t.axis_names.end(), a) == t.axis_names.end()) {
        return json::ErrorAt(at, fmt::format("{} is not an axis of the mesh", json::Quote(a)));
      }
      if (!used.insert(a).second) {
        return json::ErrorAt(at, fmt::format("axis {} is used twice", json::Quote(a)));
      }
    }
    spec.push_back(std::move(axes));
  }
  return spec;
}

bool Matches(const std::string& pattern, const std::string& name) {
  std::string re;
  for (char c : pattern) {
    if (c == '*') {
      re += ".*";
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      re += c;
    } else {
      re += '\\';
      re += c;
    }
  }
  return std::regex_match(name, std::regex(re));
}

std::string Base64(std::string_view in) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    acc = (acc << 8) | static_cast<uint8_t>(c);
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out += kAlphabet[(acc >> bits) & 63];
    }
  }
  if (bits > 0) out += kAlphabet[(acc << (6 - bits)) & 63];
  while (out.size() % 4 != 0) out += '=';
  return out;
}

// One array's layout on the target mesh: its spec padded to its rank, the device box shape.
struct ArrayLayout {
  std::vector<std::vector<std::string>> spec;
  Shape box;    // every device's box shape (the split divides each dimension)
  Shape parts;  // boxes along each dimension
};

Result<ArrayLayout> LayoutOf(const OrbaxTarget& t, const std::string& name, const Shape& shape) {
  ArrayLayout l;
  for (const auto& [pattern, spec] : t.specs) {
    if (Matches(pattern, name)) {
      l.spec = spec;
      break;
    }
  }
  if (l.spec.size() > shape.size()) {
    return InvalidArgumentError(
        fmt::format("{}: a partition spec of {} entries for an array of "
                    "{} dimensions",
                    json::Quote(name), l.spec.size(), shape.size()));
  }
  l.spec.resize(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    Index parts = 1;
    for (const std::string& axis : l.spec[d]) {
      const auto a = static_cast<size_t>(std::find(t.axis_names.begin(), t.axis_names.end(), axis) -
                                         t.axis_names.begin());
      parts *= t.mesh_shape[a];
    }
    if (shape[d] % parts != 0) {
      return FailedPreconditionError(fmt::format(
          "{}: dimension {} of {} elements does not split into {} equal parts, which a JAX "
          "NamedSharding needs",
          json::Quote(name), d, shape[d], parts));
    }
    l.parts.push_back(parts);
    l.box.push_back(std::max<Index>(shape[d] / parts, 1));
  }
  return l;
}

std::string ShardingText(const OrbaxTarget& t, const ArrayLayout& l) {
  nlohmann::ordered_json spec = nlohmann::ordered_json::array();
  for (const auto& axes : l.spec) {
    if (axes.empty()) {
      spec.push_back(nullptr);
    } else if (axes.size() == 1) {
      spec.push_back(axes[0]);
    } else {
      spec.push_back(axes);
    }
  }
  // The device mesh: ids 0.. row-major, nested as the mesh's shape.
  const Index devices = ProductOf(t.mesh_shape);
  std::vector<nlohmann::ordered_json> level;
  for (Index id = 0; id < devices; ++id) level.push_back({{"id", id}});
  for (size_t a = t.mesh_shape.size(); a-- > 0;) {
    std::vector<nlohmann::ordered_json> up;
    const auto n = static_cast<size_t>(t.mesh_shape[a]);
    for (size_t i = 0; i < level.size(); i += n) {
      up.push_back(nlohmann::ordered_json(
          std::vector<nlohmann::ordered_json>(level.begin() + static_cast<ptrdiff_t>(i),
                                              level.begin() + static_cast<ptrdiff_t>(i + n))));
    }
    level = std::move(up);
  }
  std::vector<std::string> types(t.axis_names.size(), "AxisType.Auto");
  const nlohmann::ordered_json s = {
      {"sharding_type", "NamedSharding"}, {"shape", t.mesh_shape},
      {"axis_names", t.axis_names},       {"axis_types", types},
      {"partition_spec", spec},           {"device_mesh", {{"mesh", level.at(0)}}}};
  return s.dump();
}

Status WriteText(const OutputDirectory& out, const std::string& name, std::string_view text,
                 const CheckpointOptions& options) {
  const std::string path = out.FilePath(name);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  WriteOptions w;
  w.sync = options.sync;
  return WriteFileAtomically(path, text, w);
}

// Where an array's keys go: files of the item (plain) or keys of its OCDBT database.
using PutValue = std::function<Status(const std::string& key, std::string_view value)>;

// Writes every chunk of parameter i (one per device box), one at a time: each box is read from
// the source's stored chunks (a source that reads regions) or moved out of its shards by the
// plan into the boxes, encoded, and handed to `put` before the next is made.
Status WriteChunks(ShardSource& source, size_t i, const Shape& shape, const ArrayLayout& l,
                   int zarr_format, const PutValue& put, const CheckpointOptions& options) {
  const ShardedParam& p = source.manifest().params[i];
  const Index chunks = ProductOf(shape) == 0 ? 0 : ProductOf(l.parts);
  if (chunks == 0) return Status::Ok();
  std::vector<DcpChunk> boxes;
  for (Index c = 0; c < chunks; ++c) {
    const Shape grid = UnravelIndex(c, l.parts);
    Shape offsets(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) offsets[d] = grid[d] * l.box[d];
    boxes.push_back(DcpChunk{offsets, l.box, static_cast<Rank>(c), {}});
  }
  std::vector<std::byte> box;
  try {
    box.resize(static_cast<size_t>(ProductOf(l.box)) * DTypeSize(p.dtype));
  } catch (const std::bad_alloc&) {
    return DataLossError(
        fmt::format("{}: a chunk of {} elements is more memory than this "
                    "process can have",
                    json::Quote(p.name), ProductOf(l.box)));
  }
  // Without regions: the moves into each box, from the shards held while the array is written.
  std::optional<AcquiredShards> shards;
  std::vector<ParamPlan> plans;
  if (!source.ReadsRegions()) {
    RESHARD_ASSIGN_OR_RETURN(const ParamMap target,
                             ChunksToMap(p.name, shape, boxes, static_cast<int>(chunks)));
    Result<ParamPlan> composed = Compose(target, p.map);
    if (!composed.ok()) return composed.status().Annotate(json::Quote(p.name));
    const ParamPlan& plan = *composed;
    plans.resize(static_cast<size_t>(chunks));
    for (ParamPlan& one : plans) {
      one.source_world = plan.source_world;
      one.target_world = 1;
      one.source_buffers = plan.source_buffers;
    }
    for (const Move& mv : plan.moves) {
      plans[static_cast<size_t>(mv.dst_rank)].moves.push_back(mv);
      plans[static_cast<size_t>(mv.dst_rank)].moves.back().dst_rank = 0;
    }
    for (const UnwrittenBlock& u : plan.unwritten) {
      plans[static_cast<size_t>(u.dst_rank)].unwritten.push_back(u);
      plans[static_cast<size_t>(u.dst_rank)].unwritten.back().dst_rank = 0;
    }
    shards.emplace(source, i);
    RESHARD_RETURN_IF_ERROR(shards->status());
    internal::WarnAboutScales(options, p, "writing it applies");
  }
  const ExecOptions exec = internal::ExecOptionsFor(options, p.scale_power);
  const ZarrArray keys = ZarrKeysOf(zarr_format);
  std::string packed;
  for (Index c = 0; c < chunks; ++c) {
    const DcpChunk& b = boxes[static_cast<size_t>(c)];
    if (shards) {
      const MutableBuffer target{box.data(), ProductOf(l.box)};
      RESHARD_RETURN_IF_ERROR(ExecutePlan(plans[static_cast<size_t>(c)], p.dtype, shards->shards(),
                                          std::span(&target, 1), exec)
                                  .Annotate(json::Quote(p.name)));
    } else {
      RESHARD_RETURN_IF_ERROR(source.ReadRegion(i, b.offsets, b.sizes, box, 1));
    }
    RESHARD_RETURN_IF_ERROR(EncodeZarrChunk(zarr_format, box, packed));
    const Shape grid = UnravelIndex(c, l.parts);
    RESHARD_RETURN_IF_ERROR(put(p.name + "/" + ZarrChunkKey(keys, grid), packed));
  }
  return Status::Ok();
}

}  // namespace

Result<OrbaxStorage> ParseOrbaxStorage(std::string_view name) {
  if (name == "zarr3") return OrbaxStorage::kZarr3;
  if (name == "zarr2") return OrbaxStorage::kZarr2;
  if (name == "plain") return OrbaxStorage::kPlain;
  return InvalidArgumentError(fmt::format(
      "Orbax storage {}: expected zarr3 (OCDBT + zarr v3), zarr2 (OCDBT + zarr v2) or plain "
      "(a zarr v2 directory per array)",
      json::Quote(name)));
}

Result<OrbaxTarget> ParseOrbaxTarget(std::string_view mesh, std::string_view specs_json) {
  OrbaxTarget t;
  size_t at = 0;
  while (at <= mesh.size()) {
    const size_t end = std::min(mesh.find(',', at), mesh.size());
    const std::string_view part = mesh.substr(at, end - at);
    const size_t eq = part.find('=');
    Index n = 0;
    const bool number = eq != std::string_view::npos &&
                        std::from_chars(part.data() + eq + 1, part.data() + part.size(), n).ptr ==
                            part.data() + part.size();
    if (!number || eq == 0 || n < 1 || n > (1 << 20)) {
      return InvalidArgumentError(
          fmt::format("mesh {}: expected axis=size pairs separated by commas (\"fsdp=2,tensor=4\")",
                      json::Quote(mesh)));
    }
    const std::string name(part.substr(0, eq));
    if (std::find(t.axis_names.begin(), t.axis_names.end(), name) != t.axis_names.end()) {
      return InvalidArgumentError(fmt::format("mesh: axis {} given twice", json::Quote(name)));
    }
    t.axis_names.push_back(name);
    t.mesh_shape.push_back(n);
    at = end + 1;
  }
  if (!CheckedProduct(t.mesh_shape).ok() || ProductOf(t.mesh_shape) > (1 << 20)) {
    return InvalidArgumentError("mesh: more than 2^20 devices");
  }
  if (specs_json.empty()) return t;
  std::vector<std::string> keys;  // in the file's order: the first match wins
  RESHARD_ASSIGN_OR_RETURN(const Json j, json::ParseJson(specs_json, &keys));
  if (!j.is_object()) return json::TypeError("", "an object of name patterns -> specs", j);
  for (const std::string& pattern : keys) {
    RESHARD_ASSIGN_OR_RETURN(auto spec, ReadSpec(j.at(pattern), json::Member("", pattern), t));
    t.specs.emplace_back(pattern, std::move(spec));
  }
  return t;
}

Status WriteOrbax(ShardSource& source, const OrbaxTarget& target, const std::string& out_dir,
                  const CheckpointOptions& options) {
  const Manifest& m = source.manifest();
  // Names: dot-separated pytree paths, none a prefix of another (a leaf cannot be a dict).
  std::set<std::string> names;
  for (const ShardedParam& p : m.params) {
    if (p.name.empty() || p.name.front() == '.' || p.name.back() == '.' ||
        p.name.find("..") != std::string::npos ||
        p.name.find_first_of("'\\/\"") != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("{} cannot be a pytree path of an Orbax checkpoint", json::Quote(p.name)));
    }
    names.insert(p.name);
  }
  for (const std::string& n : names) {
    auto next = names.upper_bound(n);
    if (next != names.end() && next->starts_with(n + ".")) {
      return InvalidArgumentError(fmt::format("{} is both an array and a prefix of {}",
                                              json::Quote(n), json::Quote(*next)));
    }
  }
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OutputDirectory::Create(out_dir, options.overwrite, source.inputs()));
  // OCDBT: one database of process 0 under ocdbt.process_0/, merged into the item's own
  // manifest.ocdbt at the end, as Orbax leaves a checkpoint saved by one process.
  std::unique_ptr<OcdbtWriter> db;
  if (target.storage != OrbaxStorage::kPlain) {
    OcdbtWriteOptions o;
    o.sync = options.sync;
    RESHARD_ASSIGN_OR_RETURN(db, OcdbtWriter::Create(out.FilePath(kProcessDatabase), o));
  }
  const int zarr_format = target.storage == OrbaxStorage::kZarr3 ? 3 : 2;
  const PutValue put = [&](const std::string& key, std::string_view value) -> Status {
    if (db) return db->Put(key, value);
    return WriteText(out, key, value, options);
  };
  nlohmann::ordered_json tree = nlohmann::ordered_json::object();
  nlohmann::ordered_json shardings = nlohmann::ordered_json::object();
  nlohmann::ordered_json array_metadatas = nlohmann::ordered_json::array();
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ShardedParam& p = m.params[i];
    const Shape shape = p.map.valid_shape();
    RESHARD_ASSIGN_OR_RETURN(const ArrayLayout l, LayoutOf(target, p.name, shape));
    RESHARD_RETURN_IF_ERROR(put(p.name + (zarr_format == 3 ? "/zarr.json" : "/.zarray"),
                                ZarrMetadataText(zarr_format, p.dtype, shape, l.box)));
    RESHARD_RETURN_IF_ERROR(WriteChunks(source, i, shape, l, zarr_format, put, options));
    // _METADATA's key: the path as a Python tuple's repr.
    nlohmann::ordered_json keys = nlohmann::ordered_json::array();
    std::string tuple = "(";
    size_t at = 0;
    while (at <= p.name.size()) {
      const size_t end = std::min(p.name.find('.', at), p.name.size());
      const std::string part = p.name.substr(at, end - at);
      keys.push_back({{"key", part}, {"key_type", 2}});
      tuple += (at ? ", '" : "'") + part + "'";
      at = end + 1;
    }
    tuple += keys.size() == 1 ? ",)" : ")";
    tree[tuple] = {
        {"key_metadata", keys},
        {"value_metadata",
         {{"value_type", "jax.Array"}, {"skip_deserialize", false}, {"write_shape", l.box}}}};
    shardings[Base64(p.name)] = ShardingText(target, l);
    array_metadatas.push_back({{"array_metadata",
                                {{"param_name", p.name},
                                 {"write_shape", l.box},
                                 {"chunk_shape", l.box},
                                 {"ext_metadata", nullptr}}}});
  }
  const nlohmann::ordered_json metadata = {{"tree_metadata", tree},
                                           {"use_ocdbt", db != nullptr},
                                           {"use_zarr3", zarr_format == 3},
                                           {"store_array_data_equal_to_fill_value", true},
                                           {"custom_metadata", nullptr}};
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const nlohmann::ordered_json checkpoint = {
      {"item_handlers",
       "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"},
      {"metrics", nlohmann::ordered_json::object()},
      {"performance_metrics", nlohmann::ordered_json::object()},
      {"init_timestamp_nsecs", now},
      {"commit_timestamp_nsecs", now},
      {"custom_metadata", {{kOrbaxProducerKey, "reshard"}}}};  // what --force looks for
  if (db) {
    RESHARD_RETURN_IF_ERROR(db->Finish());
    RESHARD_RETURN_IF_ERROR(db->WriteMerged(out.temporary(), kProcessDatabase));
  }
  RESHARD_RETURN_IF_ERROR(WriteText(out, "_METADATA", metadata.dump(), options));
  RESHARD_RETURN_IF_ERROR(WriteText(out, "_sharding", shardings.dump(), options));
  RESHARD_RETURN_IF_ERROR(
      WriteText(out, "array_metadatas/process_0",
                nlohmann::ordered_json({{"array_metadatas", array_metadatas}}).dump(), options));
  RESHARD_RETURN_IF_ERROR(WriteText(out, kOrbaxCheckpointMetadata, checkpoint.dump(), options));
  return out.Commit(options.sync);
}

}  // namespace reshard
