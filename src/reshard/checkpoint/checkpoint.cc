#include "reshard/checkpoint/checkpoint.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_json_value.h"
#include "reshard/layouts/descriptor_json.h"

namespace reshard {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::string TypeName(const Json& j) { return j.type_name(); }

// A scale tensor's tie: {"of": "<data>", "block": [..], "format": "fp8-block", "dequantizes"?}.
Result<BlockScales> BlockScalesFromJson(const Json& j, const std::string& path) {
  if (!j.is_object()) return json::TypeError(path, "an object", j);
  RESHARD_RETURN_IF_ERROR(
      json::CheckKeys(j, path, {"of", "block", "format", "dequantizes"}, "block_scales"));
  BlockScales tie;
  RESHARD_ASSIGN_OR_RETURN(const Json* of, json::Require(j, path, "of"));
  RESHARD_ASSIGN_OR_RETURN(tie.data, json::ReadString(*of, path + ".of"));
  RESHARD_ASSIGN_OR_RETURN(const Json* block, json::Require(j, path, "block"));
  RESHARD_ASSIGN_OR_RETURN(tie.block, json::ReadIntArray(*block, path + ".block", json::kPositive));
  RESHARD_ASSIGN_OR_RETURN(const Json* format, json::Require(j, path, "format"));
  RESHARD_ASSIGN_OR_RETURN(tie.format, json::ReadString(*format, path + ".format"));
  if (const Json* d = json::Find(j, "dequantizes")) {
    RESHARD_ASSIGN_OR_RETURN(tie.dequantizes, json::ReadBool(*d, path + ".dequantizes"));
  }
  return tie;
}

json::OrderedJson BlockScalesToJson(const BlockScales& tie) {
  json::OrderedJson j;
  j["of"] = tie.data;
  j["block"] = tie.block;
  j["format"] = tie.format;
  if (!tie.dequantizes) j["dequantizes"] = false;
  return j;
}

Result<Index> ReadInt(const Json& j, const std::string& path) {
  if (!j.is_number_integer() || (j.is_number_unsigned() && j.get<uint64_t>() > INT64_MAX)) {
    return InvalidArgumentError(fmt::format("{}: expected an integer, got {}", path,
                                            j.is_number() ? j.dump() : TypeName(j)));
  }
  return j.get<Index>();
}

Result<std::string> ReadString(const Json& object, const char* key, const std::string& path) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string() || it->get<std::string>().empty())
    return InvalidArgumentError(fmt::format("{}.{}: expected a non-empty string", path, key));
  return it->get<std::string>();
}

// "constraints": [{"module", "style", "count", "meaning", "replicate_above"?}, ...]
Result<std::vector<DegreeConstraint>> ReadConstraints(const Json& list) {
  if (!list.is_array())
    return InvalidArgumentError(
        fmt::format("constraints: expected an array, got {}", TypeName(list)));
  std::vector<DegreeConstraint> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("constraints[{}]", i);
    const Json& c = list[i];
    if (!c.is_object()) return InvalidArgumentError(fmt::format("{}: expected an object", path));
    DegreeConstraint k;
    RESHARD_ASSIGN_OR_RETURN(k.module, ReadString(c, "module", path));
    RESHARD_ASSIGN_OR_RETURN(k.style, ReadString(c, "style", path));
    RESHARD_ASSIGN_OR_RETURN(k.meaning, ReadString(c, "meaning", path));
    auto count = c.find("count");
    if (count == c.end())
      return InvalidArgumentError(fmt::format("{}: missing key \"count\"", path));
    RESHARD_ASSIGN_OR_RETURN(k.count, ReadInt(*count, path + ".count"));
    if (k.count < 1)
      return InvalidArgumentError(
          fmt::format("{}.count: {} is not a positive count", path, k.count));
    if (auto r = c.find("replicate_above"); r != c.end()) {
      if (!r->is_boolean())
        return InvalidArgumentError(
            fmt::format("{}.replicate_above: expected true or false", path));
      k.replicate_above = r->get<bool>();
    }
    out.push_back(std::move(k));
  }
  return out;
}

json::OrderedJson ConstraintsToJson(const std::vector<DegreeConstraint>& constraints) {
  json::OrderedJson out = json::OrderedJson::array();
  for (const DegreeConstraint& c : constraints) {
    json::OrderedJson j = {
        {"module", c.module}, {"style", c.style}, {"count", c.count}, {"meaning", c.meaning}};
    if (c.replicate_above) j["replicate_above"] = true;
    out.push_back(std::move(j));
  }
  return out;
}

Result<std::shared_ptr<SafetensorsFile>> OpenShared(const std::string& path) {
  Result<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  return std::make_shared<SafetensorsFile>(*std::move(file));
}

}  // namespace

std::string ShardFileName(Rank rank, int part) {
  return fmt::format("model-rank-{}-part-{}.safetensors", rank, part);
}

Result<Manifest> ParseManifestJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json doc, json::ParseJson(text));
  if (!doc.is_object())
    return InvalidArgumentError(fmt::format("expected a JSON object, got {}", TypeName(doc)));
  auto format = doc.find("format");
  if (format == doc.end() || !format->is_string() || format->get<std::string>() != "reshard") {
    return InvalidArgumentError("format: expected \"reshard\"; this is not a reshard manifest");
  }
  auto version = doc.find("version");
  if (version == doc.end()) return InvalidArgumentError("missing key \"version\"");
  RESHARD_ASSIGN_OR_RETURN(Index v, ReadInt(*version, "version"));
  if (v != kManifestVersion && v != kBufferedManifestVersion) {
    return InvalidArgumentError(
        fmt::format("version {} is not supported; this reader knows versions {} and {} (with "
                    "buffers)",
                    v, kManifestVersion, kBufferedManifestVersion));
  }
  Manifest m;
  BufferSetBuilder buffers;
  if (v == kBufferedManifestVersion) {
    auto decls = doc.find("buffers");
    if (decls == doc.end()) {
      return InvalidArgumentError("missing key \"buffers\" (version 2 declares its buffers)");
    }
    RESHARD_ASSIGN_OR_RETURN(buffers, BufferSetFromJson(*decls, "buffers"));
  }
  auto world = doc.find("world_size");
  if (world == doc.end()) return InvalidArgumentError("missing key \"world_size\"");
  RESHARD_ASSIGN_OR_RETURN(Index w, ReadInt(*world, "world_size"));
  if (w < 1 || w > (1 << 20))
    return InvalidArgumentError(fmt::format("world_size: {} is not a world size", w));
  m.world_size = static_cast<int>(w);
  auto files = doc.find("files");
  if (files == doc.end() || !files->is_object())
    return InvalidArgumentError("files: expected an object of rank -> [file names]");
  m.files.resize(static_cast<size_t>(m.world_size));
  for (Rank r = 0; r < m.world_size; ++r) {
    const std::string key = std::to_string(r);
    auto list = files->find(key);
    const std::string path = fmt::format("files[\"{}\"]", r);
    if (list == files->end())
      return InvalidArgumentError(fmt::format("{}: missing; every rank needs its files", path));
    if (!list->is_array() || list->empty())
      return InvalidArgumentError(
          fmt::format("{}: expected a non-empty array of file names", path));
    for (size_t i = 0; i < list->size(); ++i) {
      const Json& f = (*list)[i];
      if (!f.is_string())
        return InvalidArgumentError(fmt::format("{}[{}]: expected a file name", path, i));
      const std::string name = f.get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
        return InvalidArgumentError(fmt::format(
            "{}[{}]: \"{}\" is not a plain file name in the checkpoint directory", path, i, name));
      }
      m.files[static_cast<size_t>(r)].push_back(name);
    }
  }
  if (files->size() != static_cast<size_t>(m.world_size)) {
    return InvalidArgumentError(
        fmt::format("files: {} entries for a world of {} ranks", files->size(), m.world_size));
  }
  if (auto config = doc.find("model_config"); config != doc.end() && !config->is_null()) {
    if (!config->is_object()) {
      return InvalidArgumentError("model_config: expected the model's config.json (an object)");
    }
    m.model_config = config->dump();
  }
  if (auto constraints = doc.find("constraints"); constraints != doc.end()) {
    RESHARD_ASSIGN_OR_RETURN(m.constraints, ReadConstraints(*constraints));
  }
  auto params = doc.find("params");
  if (params == doc.end() || !params->is_object())
    return InvalidArgumentError("params: expected an object of name -> parameter");
  for (auto it = params->begin(); it != params->end(); ++it) {
    const std::string path = fmt::format("params[{}]", Json(it.key()).dump());
    const Json& p = it.value();
    if (!p.is_object()) return InvalidArgumentError(fmt::format("{}: expected an object", path));
    auto dtype = p.find("dtype");
    if (dtype == p.end() || !dtype->is_string())
      return InvalidArgumentError(fmt::format("{}.dtype: expected a dtype name", path));
    std::optional<DType> d = DTypeFromName(dtype->get<std::string>());
    if (!d)
      return InvalidArgumentError(fmt::format("{}.dtype: unknown dtype {}", path, dtype->dump()));
    auto map = p.find("map");
    if (map == p.end()) return InvalidArgumentError(fmt::format("{}: missing key \"map\"", path));
    Result<ParamMapBuilder> builder = ParamMapFromJson(*map);
    if (!builder.ok()) return builder.status().Annotate(path + ".map");
    Result<ParamMap> built = builder->Finalize();
    if (!built.ok()) return AsFailedCheck(built.status().Annotate(path + ".map"));
    if (built->world_size() != m.world_size) {
      return InvalidArgumentError(fmt::format("{}.map: has {} ranks but world_size is {}", path,
                                              built->world_size(), m.world_size));
    }
    std::optional<LayoutDescriptor> layout_desc;
    int scale_power = 1;
    if (auto layout = p.find("layout"); layout != p.end() && !layout->is_null()) {
      Result<LayoutDescriptor> l = LayoutFromJson(*layout);
      if (!l.ok()) return l.status().Annotate(path + ".layout");
      layout_desc = *std::move(l);
    }
    if (auto power = p.find("scale_power"); power != p.end()) {
      RESHARD_ASSIGN_OR_RETURN(Index pw, ReadInt(*power, path + ".scale_power"));
      if (pw < -8 || pw > 8)
        return InvalidArgumentError(fmt::format("{}.scale_power: {} is out of range", path, pw));
      scale_power = static_cast<int>(pw);
    }
    m.params.push_back(
        ShardedParam{it.key(), *d, *std::move(built), std::move(layout_desc), scale_power});
    if (auto tie = p.find("block_scales"); tie != p.end() && !tie->is_null()) {
      RESHARD_ASSIGN_OR_RETURN(BlockScales b, BlockScalesFromJson(*tie, path + ".block_scales"));
      m.block_scales.emplace(it.key(), std::move(b));
    }
  }
  RESHARD_RETURN_IF_ERROR(ValidateManifestBuffers(m, buffers));
  RESHARD_RETURN_IF_ERROR(CheckBlockTies(m));
  return m;
}

Status CheckBlockTies(const Manifest& m) {
  std::map<std::string_view, const ShardedParam*> by_name;
  for (const ShardedParam& p : m.params) by_name.emplace(p.name, &p);
  for (const auto& [scale_name, tie] : m.block_scales) {
    auto scale = by_name.find(scale_name);
    if (scale == by_name.end()) {
      return InvalidArgumentError(
          fmt::format("block_scales: \"{}\" is not a parameter of the checkpoint", scale_name));
    }
    const ShardedParam& p = *scale->second;
    auto data = by_name.find(tie.data);
    if (data == by_name.end()) {
      return InvalidArgumentError(fmt::format(
          "params[\"{}\"].block_scales: the data tensor \"{}\" is not in the checkpoint", p.name,
          tie.data));
    }
    if (m.block_scales.contains(tie.data)) {
      return InvalidArgumentError(fmt::format(
          "params[\"{}\"].block_scales: \"{}\" is itself a scale tensor", p.name, tie.data));
    }
    if (tie.block.size() != data->second->map.logical_shape().size()) {
      return InvalidArgumentError(
          fmt::format("params[\"{}\"].block_scales.block: {} for data of shape {}", p.name,
                      FormatShape(tie.block), FormatShape(data->second->map.logical_shape())));
    }
    Status tied = CheckBlockTie(data->second->map, p.map, tie.block);
    if (!tied.ok()) {
      return FailedPreconditionError(
          fmt::format("\"{}\" are the scales of \"{}\" in blocks of {}, but {}", p.name, tie.data,
                      FormatShape(tie.block), tied.message()));
    }
  }
  return Status::Ok();
}

Status ValidateManifestBuffers(Manifest& m, const BufferSetBuilder& buffers) {
  std::vector<NamedMapRef> refs;
  std::vector<DType> dtypes;
  std::set<std::string_view> own;  // parameters with a tensor of their own on some rank
  for (const ShardedParam& p : m.params) {
    refs.push_back({p.name, &p.map});
    dtypes.push_back(p.dtype);
    for (Rank r = 0; r < p.map.world_size(); ++r) {
      if (!p.map.rank(r).is_buffered()) own.insert(p.name);
    }
  }
  Result<BufferSet> set = buffers.Finalize(refs, dtypes);
  if (!set.ok()) return AsFailedCheck(set.status());
  if (!set->empty() && set->world_size() != m.world_size) {
    return InvalidArgumentError(
        fmt::format("buffers: {} ranks but world_size is {}", set->world_size(), m.world_size));
  }
  for (const BufferDecl& b : set->buffers()) {
    if (own.count(b.name)) {
      return InvalidArgumentError(fmt::format(
          "buffers[\"{}\"]: a parameter of that name has a shard of its own; rank files name "
          "each tensor once",
          b.name));
    }
  }
  m.buffers = *std::move(set);
  return Status::Ok();
}

uint64_t HeldBytes(const ShardedParam& p, Rank r) {
  const RankShard& shard = p.map.rank(r);
  Index n = 0;
  if (shard.is_buffered()) {
    for (const Piece& piece : shard.pieces) n += piece.num_elements();
  } else {
    n = ProductOf(shard.shard_shape);
  }
  return static_cast<uint64_t>(n) * DTypeSize(p.dtype);
}

std::vector<RankTensor> RankTensorsOf(const Manifest& m, Rank rank) {
  std::vector<RankTensor> out;
  std::map<std::string_view, size_t> buffer_at;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ShardedParam& p = m.params[i];
    const RankShard& shard = p.map.rank(rank);
    if (!shard.is_buffered()) {
      out.push_back({p.name, p.dtype, shard.shard_shape, {i}, nullptr});
      continue;
    }
    auto [it, fresh] = buffer_at.try_emplace(shard.buffer, out.size());
    if (fresh) {
      const BufferDecl* b = m.buffers.Find(shard.buffer);
      out.push_back({b->name, b->dtype, b->ranks[static_cast<size_t>(rank)].shape, {}, b});
    }
    out[it->second].params.push_back(i);
  }
  // Buffers no parameter writes on this rank (all padding) are still the rank's tensors.
  for (const BufferDecl& b : m.buffers.buffers()) {
    if (!buffer_at.count(b.name)) {
      out.push_back({b.name, b.dtype, b.ranks[static_cast<size_t>(rank)].shape, {}, &b});
    }
  }
  return out;
}

bool IsManifestJson(std::string_view text) {
  Result<Json> doc = json::ParseJson(text);
  if (!doc.ok()) return false;
  const Json* format = json::Find(*doc, "format");
  return format != nullptr && format->is_string() && *format == "reshard";
}

std::string ManifestToJson(const Manifest& m) {
  json::OrderedJson j;
  j["format"] = "reshard";
  j["version"] = m.buffers.empty() ? kManifestVersion : kBufferedManifestVersion;
  j["world_size"] = m.world_size;
  json::OrderedJson& files = j["files"] = json::OrderedJson::object();
  for (size_t r = 0; r < m.files.size(); ++r)
    json::AppendMember(files, std::to_string(r), m.files[r]);
  if (!m.constraints.empty()) j["constraints"] = ConstraintsToJson(m.constraints);
  if (!m.buffers.empty()) j["buffers"] = BufferSetToJsonValue(m.buffers);
  if (!m.model_config.empty()) {
    j["model_config"] = json::OrderedJson::parse(m.model_config, nullptr, false);
  }
  json::OrderedJson& params = j["params"] = json::OrderedJson::object();
  for (const ShardedParam& p : m.params) {
    json::OrderedJson param;
    param["dtype"] = std::string(DTypeName(p.dtype));
    if (p.scale_power != 1) param["scale_power"] = p.scale_power;
    if (p.layout) param["layout"] = LayoutToJsonValue(*p.layout);
    if (auto tie = m.block_scales.find(p.name); tie != m.block_scales.end())
      param["block_scales"] = BlockScalesToJson(tie->second);
    param["map"] = ParamMapToJsonValue(p.map);
    json::AppendMember(params, p.name, std::move(param));
  }
  return json::WriteJson(j) + "\n";
}

const TensorRef* FullCheckpoint::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

uint64_t FullCheckpoint::total_bytes() const {
  uint64_t n = 0;
  for (const TensorRef& t : tensors_) n += t.data.size();
  return n;
}

Result<FullCheckpoint> FullCheckpoint::Open(const std::string& dir) {
  FullCheckpoint ckpt;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return NotFoundError(fmt::format("\"{}\" is not a directory", dir));
  }
  fs::path single = root / "model.safetensors";
  const fs::path index = root / "model.safetensors.index.json";
  // A PEFT adapter directory: its tensors are one file of its own name.
  if (!fs::exists(single, ec) && !fs::exists(index, ec) && IsPeftAdapterDir(dir)) {
    single = root / kAdapterWeightsName;
  }
  const bool has_single = fs::exists(single, ec);
  const bool has_index = fs::exists(index, ec);
  if (has_single && has_index) {
    return InvalidArgumentError(
        fmt::format("\"{}\" has both model.safetensors and model.safetensors.index.json; which one "
                    "is the checkpoint is ambiguous",
                    dir));
  }
  auto add_file = [&](const fs::path& path, const std::set<std::string>* expected) -> Status {
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, OpenShared(path.string()));
    for (const TensorInfo& t : file->header().tensors) {
      if (expected && !expected->count(t.name)) {
        return DataLossError(fmt::format(
            "\"{}\": tensor \"{}\" is not listed for this file in model.safetensors.index.json",
            path.string(), t.name));
      }
      if (ckpt.by_name_.count(t.name)) {
        return DataLossError(fmt::format("\"{}\": tensor \"{}\" is stored twice in the checkpoint",
                                         path.string(), t.name));
      }
      ckpt.by_name_[t.name] = ckpt.tensors_.size();
      ckpt.tensors_.push_back(
          {&t, file->data(t), ckpt.files_.size(), file->header().data_offset + t.data_begin});
    }
    ckpt.files_.push_back(std::move(file));
    return Status::Ok();
  };
  if (has_single) {
    RESHARD_RETURN_IF_ERROR(add_file(single, nullptr));
  } else if (has_index) {
    RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index.string()));
    Json doc = Json::parse(text, nullptr, false);
    const std::string where = fmt::format("error reading \"{}\"", index.string());
    if (doc.is_discarded() || !doc.is_object())
      return InvalidArgumentError(where + ": not a JSON object");
    auto wm = doc.find("weight_map");
    if (wm == doc.end() || !wm->is_object())
      return InvalidArgumentError(where +
                                  ": weight_map: expected an object of tensor name -> file");
    std::map<std::string, std::set<std::string>> by_file;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        return InvalidArgumentError(
            fmt::format("{}: weight_map[{}]: expected a file name", where, Json(it.key()).dump()));
      const std::string file = it.value().get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        return InvalidArgumentError(
            fmt::format("{}: weight_map[{}]: \"{}\" is not a file in the checkpoint directory",
                        where, Json(it.key()).dump(), file));
      }
      by_file[file].insert(it.key());
    }
    for (const auto& [file, names] : by_file)
      RESHARD_RETURN_IF_ERROR(add_file(root / file, &names));
    for (const auto& [file, names] : by_file) {
      for (const std::string& name : names) {
        if (!ckpt.by_name_.count(name)) {
          return DataLossError(
              fmt::format("\"{}\": tensor \"{}\" is listed in model.safetensors.index.json but not "
                          "stored in it",
                          (root / file).string(), name));
        }
      }
    }
  } else {
    return NotFoundError(fmt::format(
        "\"{}\" holds neither model.safetensors nor model.safetensors.index.json", dir));
  }
  return ckpt;
}

namespace {

std::vector<std::string> PathsOf(const std::vector<std::shared_ptr<SafetensorsFile>>& files) {
  std::vector<std::string> paths;
  for (const auto& f : files) paths.push_back(f->path());
  return paths;
}

}  // namespace

std::vector<std::string> FullCheckpoint::file_paths() const { return PathsOf(files_); }

std::vector<std::string> ShardedCheckpoint::file_paths() const { return PathsOf(files_); }

uint64_t ShardedCheckpoint::total_bytes() const {
  // A buffer is the shard of several parameters: count each tensor once.
  std::set<const std::byte*> seen;
  uint64_t n = 0;
  for (const auto& per_param : shards_) {
    for (const auto& s : per_param) {
      if (s.empty() || seen.insert(s.data()).second) n += s.size();
    }
  }
  return n;
}

Result<ShardedCheckpoint> ShardedCheckpoint::Open(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    return NotFoundError(fmt::format("\"{}\" is not a directory", dir));
  const std::string manifest_path = (root / kManifestName).string();
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest_path));
  Result<Manifest> manifest = ParseManifestJson(text);
  if (!manifest.ok())
    return manifest.status().Annotate(fmt::format("error reading \"{}\"", manifest_path));
  ShardedCheckpoint ckpt;
  ckpt.manifest_ = *std::move(manifest);
  const Manifest& m = ckpt.manifest_;
  // Per rank: tensor name -> (file, info).
  std::vector<std::map<std::string, std::pair<SafetensorsFile*, const TensorInfo*>>> found(
      static_cast<size_t>(m.world_size));
  // Every file serves one rank, once: by name, and by identity (a link to another rank's file
  // would pass every shape check and hand one rank's data to another).
  std::map<std::string, Rank> rank_of_name;
  std::map<std::pair<dev_t, ino_t>, std::pair<std::string, Rank>> rank_of_file;
  for (Rank r = 0; r < m.world_size; ++r) {
    for (const std::string& name : m.files[static_cast<size_t>(r)]) {
      const std::string path = (root / name).string();
      if (auto [it, fresh] = rank_of_name.emplace(name, r); !fresh) {
        return DataLossError(fmt::format(
            "error reading \"{}\": files: \"{}\" is listed for rank {} and again for rank {}; "
            "every file holds the shards of one rank",
            manifest_path, name, it->second, r));
      }
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0) {
        auto [it, fresh] = rank_of_file.try_emplace({st.st_dev, st.st_ino}, name, r);
        if (!fresh) {
          return DataLossError(fmt::format(
              "\"{}\" (listed for rank {}) is the same file as \"{}\" (listed for rank {}); "
              "every file holds the shards of one rank",
              path, r, (root / it->second.first).string(), it->second.second));
        }
      }
      RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, OpenShared(path));
      for (const TensorInfo& t : file->header().tensors) {
        if (!found[static_cast<size_t>(r)].emplace(t.name, std::make_pair(file.get(), &t)).second) {
          return DataLossError(
              fmt::format("\"{}\": rank {} stores tensor \"{}\" twice", path, r, t.name));
        }
      }
      ckpt.files_.push_back(std::move(file));
    }
  }
  ckpt.shards_.assign(m.params.size(),
                      std::vector<std::span<const std::byte>>(static_cast<size_t>(m.world_size)));
  for (Rank r = 0; r < m.world_size; ++r) {
    for (const RankTensor& t : RankTensorsOf(m, r)) {
      const char* what = t.buffer ? "buffer" : "parameter";
      auto it = found[static_cast<size_t>(r)].find(t.name);
      if (it == found[static_cast<size_t>(r)].end()) {
        return DataLossError(fmt::format("\"{}\": {} \"{}\" has no tensor in rank {}'s files {}",
                                         dir, what, t.name, r,
                                         Json(m.files[static_cast<size_t>(r)]).dump()));
      }
      const auto [file, info] = it->second;
      if (info->dtype != t.dtype) {
        return DataLossError(
            fmt::format("\"{}\": rank {}'s tensor of {} \"{}\" is {} but the manifest says {}",
                        file->path(), r, what, t.name, DTypeName(info->dtype), DTypeName(t.dtype)));
      }
      if (info->shape != t.shape) {
        return DataLossError(fmt::format(
            "\"{}\": rank {}'s tensor of {} \"{}\" has shape {} but the manifest says {}",
            file->path(), r, what, t.name, FormatShape(info->shape), FormatShape(t.shape)));
      }
      for (size_t i : t.params) ckpt.shards_[i][static_cast<size_t>(r)] = file->data(*info);
      found[static_cast<size_t>(r)].erase(it);
    }
  }
  for (Rank r = 0; r < m.world_size; ++r) {
    if (!found[static_cast<size_t>(r)].empty()) {
      return DataLossError(fmt::format(
          "\"{}\": rank {}'s files hold tensor \"{}\", which the manifest does not list", dir, r,
          found[static_cast<size_t>(r)].begin()->first));
    }
  }
  return ckpt;
}

Result<uint64_t> ParseByteSize(std::string_view text) {
  std::string s(text);
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(s, &pos);
  } catch (...) {
    return InvalidArgumentError(fmt::format("\"{}\" is not a size (e.g. 5GB, 500MB, 2GiB)", text));
  }
  std::string unit = s.substr(pos);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> kUnits = {{"", 1},
                                                       {"B", 1},
                                                       {"KB", 1e3},
                                                       {"MB", 1e6},
                                                       {"GB", 1e9},
                                                       {"TB", 1e12},
                                                       {"KIB", 1024.0},
                                                       {"MIB", 1048576.0},
                                                       {"GIB", 1073741824.0},
                                                       {"TIB", 1099511627776.0}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end() || !(value > 0) || !std::isfinite(value)) {
    return InvalidArgumentError(fmt::format("\"{}\" is not a size (e.g. 5GB, 500MB, 2GiB)", text));
  }
  const double bytes = value * it->second;
  if (bytes >= 9.2e18) return InvalidArgumentError(fmt::format("\"{}\" is too large", text));
  return static_cast<uint64_t>(bytes);
}

}  // namespace reshard
