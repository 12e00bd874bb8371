#include "reshard/checkpoint/inspect.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/json_writer.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/parallel_runs.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_file.h"
#include "reshard/ir/map_summary.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

// ---- Model views: a reshard sharded checkpoint or a Hugging Face directory as one model.

enum class ModelDir {
  kNone,         // neither
  kSharded,      // reshard.json
  kHuggingFace,  // config.json and model.safetensors or model.safetensors.index.json
};

ordered_json RanksJson(const ShardedParam& p) {
  const MapSummary summary = Summarize(p.map);
  ordered_json ranks = ordered_json::array();
  for (Rank r = 0; r < p.map.world_size(); ++r) {
    const RankSummary& s = summary.ranks[static_cast<size_t>(r)];
    ranks.push_back({{"rank", r},
                     {"shard_shape", p.map.rank(r).shard_shape},
                     {"pieces", s.pieces},
                     {"elements", s.elements},
                     {"replicated_elements", s.replicated_elements}});
  }
  return ranks;
}

ordered_json ShardedJson(const ShardedCheckpoint& c) {
  const Manifest& m = c.manifest();
  ordered_json files = ordered_json::object();
  for (size_t r = 0; r < m.files.size(); ++r)
    json::AppendMember(files, std::to_string(r), m.files[r]);
  ordered_json constraints = ordered_json::array();
  for (const DegreeConstraint& k : m.constraints) {
    constraints.push_back({{"module", k.module},
                           {"style", k.style},
                           {"count", k.count},
                           {"meaning", k.meaning},
                           {"replicate_above", k.replicate_above}});
  }
  ordered_json params = ordered_json::array();
  for (const ShardedParam& p : m.params) {
    ordered_json one = {
        {"name", p.name}, {"dtype", DTypeName(p.dtype)}, {"logical_shape", p.map.logical_shape()}};
    if (p.map.has_padding()) one["valid_shape"] = p.map.valid_shape();
    one["scale_power"] = p.scale_power;
    if (p.layout) one["layout"] = ordered_json::parse(LayoutToJson(*p.layout));
    if (auto tie = m.block_scales.find(p.name); tie != m.block_scales.end()) {
      one["block_scales"] = {{"of", tie->second.data},
                             {"block", tie->second.block},
                             {"format", tie->second.format},
                             {"dequantizes", tie->second.dequantizes}};
    }
    one["ranks"] = RanksJson(p);
    params.push_back(std::move(one));
  }
  return {{"format", "reshard"}, {"world_size", m.world_size}, {"bytes", c.total_bytes()},
          {"files", files},      {"constraints", constraints}, {"params", params}};
}

// "  fp8-block scales of "D" in blocks of [128, 128]" for a tensor with block_scales.
std::string BlockScalesText(const ordered_json& t) {
  if (!t.contains("block_scales")) return "";
  const ordered_json& b = t["block_scales"];
  return fmt::format("  {} scales of \"{}\" in blocks of {}{}", b["format"].get<std::string>(),
                     b["of"].get<std::string>(), FormatShape(b["block"].get<Shape>()),
                     b["dequantizes"].get<bool>() ? "" : " (per tensor, not applied)");
}

void AppendSharded(const std::string& dir, const ordered_json& j, std::string& out) {
  fmt::format_to(std::back_inserter(out),
                 "\"{}\": reshard sharded checkpoint: world size {}, {} parameters, {} bytes\n",
                 dir, j["world_size"].get<int>(), j["params"].size(), j["bytes"].get<uint64_t>());
  for (const ordered_json& k : j["constraints"]) {
    fmt::format_to(std::back_inserter(out), "  constraint: {} ({}) splits {} {}{}\n",
                   k["module"].get<std::string>(), k["style"].get<std::string>(),
                   k["count"].get<int64_t>(), k["meaning"].get<std::string>(),
                   k["replicate_above"].get<bool>() ? ", replicated above" : "");
  }
  for (const ordered_json& p : j["params"]) {
    fmt::format_to(std::back_inserter(out), "  {}  {} {}", p["name"].get<std::string>(),
                   p["dtype"].get<std::string>(), FormatShape(p["logical_shape"].get<Shape>()));
    if (p.contains("valid_shape")) {
      fmt::format_to(std::back_inserter(out), " (valid {})",
                     FormatShape(p["valid_shape"].get<Shape>()));
    }
    if (p["scale_power"].get<int>() != 1)
      fmt::format_to(std::back_inserter(out), "  scale^{}", p["scale_power"].get<int>());
    if (p.contains("layout"))
      fmt::format_to(std::back_inserter(out), "  layout {}", p["layout"].dump());
    out += BlockScalesText(p);
    std::string ranks;
    for (const ordered_json& r : p["ranks"]) {
      const auto pieces = r["pieces"].get<int64_t>();
      const auto replicated = r["replicated_elements"].get<int64_t>();
      ranks += fmt::format("{}rank {}: {} in {} piece{}{}", ranks.empty() ? "" : "; ",
                           r["rank"].get<int>(), FormatShape(r["shard_shape"].get<Shape>()), pieces,
                           pieces == 1 ? "" : "s",
                           replicated > 0 ? fmt::format(", {} replicated", replicated) : "");
    }
    fmt::format_to(std::back_inserter(out), "\n    {}\n", ranks);
  }
  for (const auto& [rank, files] : j["files"].items()) {
    fmt::format_to(std::back_inserter(out), "  rank {} files: {}\n", rank, files.dump());
  }
}

ordered_json HuggingFaceJson(const std::string& dir, const FullCheckpoint& c,
                             const QuantizedPairs& pairs) {
  // The block-quantized pairs its config.json says (a config that cannot be read is reported,
  // not raised: inspect shows what is there).
  std::map<std::string, BlockScales> ties;
  std::string quantization_error;
  if (pairs) {
    Result<std::map<std::string, BlockScales>> found = pairs(dir);
    if (found.ok()) {
      ties = *std::move(found);
    } else {
      quantization_error = found.status().message();
    }
  }
  const std::vector<std::string> paths = c.file_paths();
  ordered_json files = ordered_json::array();
  for (const std::string& p : paths) files.push_back(fs::path(p).filename().string());
  ordered_json tensors = ordered_json::array();
  for (const TensorRef& t : c.tensors()) {
    tensors.push_back({{"name", t.info->name},
                       {"dtype", DTypeName(t.info->dtype)},
                       {"shape", t.info->shape},
                       {"bytes", t.data.size()},
                       {"file", files[t.file]}});
    if (auto tie = ties.find(t.info->name); tie != ties.end()) {
      tensors.back()["block_scales"] = {{"of", tie->second.data},
                                        {"block", tie->second.block},
                                        {"format", tie->second.format},
                                        {"dequantizes", tie->second.dequantizes}};
    }
  }
  std::error_code ec;
  const bool index = fs::exists(fs::path(dir) / "model.safetensors.index.json", ec);
  ordered_json out = {
      {"format", "huggingface"},
      {"index", index ? ordered_json("model.safetensors.index.json") : ordered_json(nullptr)},
      {"bytes", c.total_bytes()},
      {"files", files},
      {"tensors", tensors}};
  if (!quantization_error.empty()) out["quantization_error"] = quantization_error;
  return out;
}

void AppendHuggingFace(const std::string& dir, const ordered_json& j, std::string& out) {
  fmt::format_to(std::back_inserter(out),
                 "\"{}\": Hugging Face checkpoint{}: {} tensors, {} bytes in {} file{}\n", dir,
                 j["index"].is_null() ? "" : " (model.safetensors.index.json)", j["tensors"].size(),
                 j["bytes"].get<uint64_t>(), j["files"].size(), j["files"].size() == 1 ? "" : "s");
  for (const ordered_json& t : j["tensors"]) {
    fmt::format_to(std::back_inserter(out), "  {}  {} {}  {}{}\n", t["name"].get<std::string>(),
                   t["dtype"].get<std::string>(), FormatShape(t["shape"].get<Shape>()),
                   t["file"].get<std::string>(), BlockScalesText(t));
  }
  if (j.contains("quantization_error")) {
    fmt::format_to(std::back_inserter(out), "  quantization: {}\n",
                   j["quantization_error"].get<std::string>());
  }
}

ModelDir ModelDirOf(const std::string& dir) {
  std::error_code ec;
  const fs::path d(dir);
  if (fs::is_regular_file(d / kManifestName, ec)) return ModelDir::kSharded;
  if (fs::is_regular_file(d / "config.json", ec) &&
      (fs::exists(d / "model.safetensors", ec) ||
       fs::exists(d / "model.safetensors.index.json", ec))) {
    return ModelDir::kHuggingFace;
  }
  return ModelDir::kNone;
}

// The model view of `dir`, and the run that wrote it into `run` (when not set already).
Result<ordered_json> ModelView(const std::string& dir, ModelDir kind, const QuantizedPairs& pairs,
                               std::optional<ParallelRun>& run) {
  if (kind == ModelDir::kSharded) {
    RESHARD_ASSIGN_OR_RETURN(const ShardedCheckpoint c, ShardedCheckpoint::Open(dir));
    if (!run) run = ShardedRunOf(c.manifest());
    return ShardedJson(c);
  }
  if (kind == ModelDir::kHuggingFace) {
    RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint c, FullCheckpoint::Open(dir));
    if (!run) run = HuggingFaceRun();
    return HuggingFaceJson(dir, c, pairs);
  }
  return ordered_json(nullptr);
}

void AppendModelView(const std::string& dir, const ordered_json& view, std::string& out) {
  if (!view.is_object()) return;
  if (view["format"] == "reshard") {
    AppendSharded(dir, view, out);
  } else {
    AppendHuggingFace(dir, view, out);
  }
}

std::vector<std::string> ModelFiles(const ordered_json& view) {
  std::vector<std::string> out;
  if (!view.is_object()) return out;
  if (view["format"] == "reshard") {
    for (const auto& [rank, files] : view["files"].items()) {
      for (const auto& f : files) out.push_back(f.get<std::string>());
    }
  } else {
    for (const auto& f : view["files"]) out.push_back(f.get<std::string>());
  }
  return out;
}

// ---- Files.

std::string Hex(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

// The object tree as JSON (TreeWriter::Json): plain values as themselves (dicts with only str
// keys as objects), tuples, sets, bytes, tensors, globals and records as one-key objects saying
// what they are; or as "path = value" lines (TreeWriter::Lines) for every value that is not a
// tensor or a container of them.
//
// Each object is written once. One reached again through the pickle's memo (a container,
// record or persistent id, or a str, bytes, big int or global longer than 64 bytes) is written
// as a reference to where it was first written: {"ref": "/a/tuple/0"}, a JSON Pointer into the
// tree, or in lines "a.1 = (same object as a.0)". So the report costs what the file holds
// however its objects are shared (l = (l, l) nested 60 deep is 60 objects, not 2^60).
// Tensors are written by name ({"tensor": "w"}) wherever they are reached.
class TreeWriter {
 public:
  // `pointer`: locations are JSON Pointers into the tree; otherwise dotted paths.
  TreeWriter(const TorchFile& f, bool pointer) : f_(f), pointer_(pointer) { FindShared(); }
  ordered_json Json(PickleNodeId id, const std::string& where);
  void Lines(PickleNodeId id, const std::string& path, std::vector<std::string>& out);

 private:
  const PickleNode& N(PickleNodeId id) const { return f_.tree().node(id); }
  void FindShared();
  // The location where `id` was first written if it is a shared object written before;
  // otherwise nullptr, and `where` is kept as its location if it is shared.
  const std::string* Seen(PickleNodeId id, const std::string& where);
  // A child's location: `kind` ("tuple", "set", "dict", "args") is a step of the JSON only.
  std::string Child(const std::string& where, std::string_view kind, std::string_view step) const;
  const TorchTensor* TensorOf(PickleNodeId id) const;
  ordered_json Args(PickleNodeId args, const std::string& where);

  const TorchFile& f_;
  const bool pointer_;
  std::vector<uint8_t> shared_;  // reached from two places or more, and worth a reference
  std::unordered_map<PickleNodeId, std::string> first_;
};

void TreeWriter::FindShared() {
  const PickleTree& t = f_.tree();
  std::vector<uint8_t> uses(t.size(), 0);
  std::vector<PickleNodeId> stack = {t.root()};
  uses[t.root()] = 1;
  const auto visit = [&](PickleNodeId c) {
    if (c == kNoPickleNode) return;
    if (uses[c]++ == 0) stack.push_back(c);
    uses[c] = std::min<uint8_t>(uses[c], 2);
  };
  while (!stack.empty()) {
    const PickleNode& n = t.node(stack.back());
    stack.pop_back();
    for (PickleNodeId c : n.items) visit(c);
    for (const auto& [k, v] : n.entries) visit(k), visit(v);
    visit(n.args);
    visit(n.state);
  }
  shared_.assign(t.size(), 0);
  for (size_t i = 0; i < t.size(); ++i) {
    const PickleNode& n = t.node(static_cast<PickleNodeId>(i));
    const bool text = n.kind == PickleKind::kStr || n.kind == PickleKind::kBytes ||
                      n.kind == PickleKind::kBigInt || n.kind == PickleKind::kGlobal;
    const bool scalar = text || n.kind == PickleKind::kNone || n.kind == PickleKind::kBool ||
                        n.kind == PickleKind::kInt || n.kind == PickleKind::kFloat;
    shared_[i] = uses[i] >= 2 && (!scalar || (text && n.text.size() > 64));
  }
}

const std::string* TreeWriter::Seen(PickleNodeId id, const std::string& where) {
  if (!shared_[id]) return nullptr;
  const auto [it, inserted] = first_.emplace(id, where);
  return inserted ? nullptr : &it->second;
}

std::string TreeWriter::Child(const std::string& where, std::string_view kind,
                              std::string_view step) const {
  if (!pointer_) return where.empty() ? std::string(step) : where + "." + std::string(step);
  std::string out = where;
  if (!kind.empty()) {
    out += '/';
    out += kind;
  }
  out += '/';
  for (char c : step) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

// The tensor a record makes: a rebuilt tensor, or a parameter of one.
const TorchTensor* TreeWriter::TensorOf(PickleNodeId id) const {
  const PickleNode& n = N(id);
  if (n.kind != PickleKind::kRecord) return nullptr;
  if (const TorchTensor* t = f_.TensorAt(id)) return t;
  const PickleNode& args = N(n.args);
  return args.items.empty() ? nullptr : f_.TensorAt(args.items[0]);
}

// A record's arguments as an array (a reference when the tuple was written before).
ordered_json TreeWriter::Args(PickleNodeId args, const std::string& where) {
  if (const std::string* first = Seen(args, where)) return {{"ref", *first}};
  ordered_json items = ordered_json::array();
  const std::vector<PickleNodeId>& a = N(args).items;
  for (size_t i = 0; i < a.size(); ++i)
    items.push_back(Json(a[i], Child(where, "", std::to_string(i))));
  return items;
}

ordered_json TreeWriter::Json(PickleNodeId id, const std::string& where) {
  const PickleNode& n = N(id);
  if (const TorchTensor* t = TensorOf(id)) return {{"tensor", t->name}};
  if (const std::string* first = Seen(id, where)) return {{"ref", *first}};
  switch (n.kind) {
    case PickleKind::kNone:
      return nullptr;
    case PickleKind::kBool:
      return n.bool_value;
    case PickleKind::kInt:
      return n.int_value;
    case PickleKind::kBigInt:
      return {{"int_bytes_le", Hex(n.text)}};
    case PickleKind::kFloat:
      if (std::isfinite(n.float_value)) return n.float_value;
      return {{"float", fmt::format("{}", n.float_value)}};
    case PickleKind::kStr:
      return n.text;
    case PickleKind::kBytes:
      return {{"bytes", Hex(n.text)}};
    case PickleKind::kGlobal:
      return {{"global", n.text}};
    case PickleKind::kPersistentId:
      return {{"persistent_id", Json(n.items[0], Child(where, "", "persistent_id"))}};
    case PickleKind::kList:
    case PickleKind::kTuple:
    case PickleKind::kSet: {
      const std::string_view kind = n.kind == PickleKind::kList    ? ""
                                    : n.kind == PickleKind::kTuple ? "tuple"
                                                                   : "set";
      ordered_json items = ordered_json::array();
      for (size_t i = 0; i < n.items.size(); ++i)
        items.push_back(Json(n.items[i], Child(where, kind, std::to_string(i))));
      if (n.kind == PickleKind::kList) return items;
      return {{std::string(kind), items}};
    }
    case PickleKind::kDict: {
      const bool str_keys = std::all_of(n.entries.begin(), n.entries.end(), [&](auto& e) {
        return N(e.first).kind == PickleKind::kStr;
      });
      ordered_json out = str_keys ? ordered_json::object() : ordered_json::array();
      for (size_t i = 0; i < n.entries.size(); ++i) {
        const auto& [k, v] = n.entries[i];
        if (str_keys) {
          // Keys are unique (the reader keeps the last value of a repeated key): append
          // without ordered_json's linear lookup, which is quadratic over a large dict.
          out.get_ref<ordered_json::object_t&>().emplace_back(N(k).text,
                                                              Json(v, Child(where, "", N(k).text)));
        } else {
          const std::string entry = Child(where, "dict", std::to_string(i));
          out.push_back(ordered_json::array(
              {Json(k, Child(entry, "", "0")), Json(v, Child(entry, "", "1"))}));
        }
      }
      return str_keys ? out : ordered_json{{"dict", out}};
    }
    case PickleKind::kRecord: {
      ordered_json out = {{"record", n.text}, {"args", Args(n.args, Child(where, "", "args"))}};
      if (n.state != kNoPickleNode) out["state"] = Json(n.state, Child(where, "", "state"));
      return out;
    }
  }
  return nullptr;
}

void TreeWriter::Lines(PickleNodeId id, const std::string& path, std::vector<std::string>& out) {
  const PickleNode& n = N(id);
  const auto join = [&](const std::string& c) { return path.empty() ? c : path + "." + c; };
  const auto line = [&](const std::string& v) {
    out.push_back((path.empty() ? "(root)" : path) + " = " + v);
  };
  if (n.kind == PickleKind::kDict || n.kind == PickleKind::kList || n.kind == PickleKind::kTuple ||
      (n.kind == PickleKind::kRecord && TensorOf(id) == nullptr)) {
    if (const std::string* first = Seen(id, path)) {
      line("(same object as " + (first->empty() ? std::string("(root)") : *first) + ")");
      return;
    }
  }
  if (n.kind == PickleKind::kDict || n.kind == PickleKind::kList || n.kind == PickleKind::kTuple) {
    if (n.items.empty() && n.entries.empty()) line(n.kind == PickleKind::kDict ? "{}" : "[]");
    for (size_t i = 0; i < n.items.size(); ++i) Lines(n.items[i], join(std::to_string(i)), out);
    for (size_t i = 0; i < n.entries.size(); ++i) {
      const auto& [k, v] = n.entries[i];
      const PickleNode& key = N(k);
      Lines(v,
            join(key.kind == PickleKind::kStr ? key.text
                                              : Json(k, join(fmt::format("#{}", i))).dump()),
            out);
    }
    return;
  }
  if (n.kind == PickleKind::kRecord) {
    if (TensorOf(id) != nullptr) return;
    const ordered_json args = Args(n.args, join("args"));
    const std::string args_json = args.dump();
    line(n.text + "(" + (args.is_array() ? args_json.substr(1, args_json.size() - 2) : args_json) +
         ")");
    if (n.state != kNoPickleNode) Lines(n.state, path, out);
    return;
  }
  line(Json(id, path).dump());
}

ordered_json TorchJson(const TorchFile& f) {
  ordered_json tensors = ordered_json::array();
  for (const TorchTensor& t : f.tensors()) {
    tensors.push_back({{"name", t.name},
                       {"dtype", t.dtype.name},
                       {"shape", t.shape},
                       {"strides", t.strides},
                       {"storage_offset", t.storage_offset},
                       {"storage", f.storages()[t.storage].key},
                       {"bytes", t.num_bytes()},
                       {"contiguous", t.is_contiguous()},
                       {"requires_grad", t.requires_grad},
                       {"parameter", t.parameter}});
  }
  ordered_json storages = ordered_json::array();
  for (const TorchStorage& s : f.storages()) {
    storages.push_back(
        {{"key", s.key}, {"dtype", s.dtype.name}, {"numel", s.numel}, {"bytes", s.bytes.size()}});
  }
  TreeWriter tree(f, /*pointer=*/true);
  return {{"format", "torch"},
          {"root", f.root()},
          {"tensors", tensors},
          {"storages", storages},
          {"tree", tree.Json(f.tree().root(), "")}};
}

void AppendTorch(const std::string& path, const TorchFile& f, std::string& text) {
  uint64_t storage_bytes = 0;
  for (const TorchStorage& s : f.storages()) storage_bytes += s.bytes.size();
  fmt::format_to(std::back_inserter(text),
                 "\"{}\": torch.save file (root \"{}\"): {} tensors over {} storages, {} bytes\n",
                 path, f.root(), f.tensors().size(), f.storages().size(), storage_bytes);
  for (const TorchTensor& t : f.tensors()) {
    fmt::format_to(std::back_inserter(text), "  {}  {} {}", t.name.empty() ? "(root)" : t.name,
                   t.dtype.name, FormatShape(t.shape));
    if (!t.is_contiguous())
      fmt::format_to(std::back_inserter(text), " stride {}", FormatShape(t.strides));
    if (t.storage_offset != 0)
      fmt::format_to(std::back_inserter(text), " offset {}", t.storage_offset);
    fmt::format_to(std::back_inserter(text), "  storage {}{}\n", f.storages()[t.storage].key,
                   t.parameter ? "  parameter" : "");
  }
  std::vector<std::string> lines;
  TreeWriter(f, /*pointer=*/false).Lines(f.tree().root(), "", lines);
  if (!lines.empty()) fmt::format_to(std::back_inserter(text), "other values:\n");
  for (const std::string& line : lines) fmt::format_to(std::back_inserter(text), "  {}\n", line);
}

ordered_json SafetensorsJson(const SafetensorsHeader& h) {
  ordered_json tensors = ordered_json::array();
  for (const TensorInfo& t : h.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", DTypeName(t.dtype)},
                       {"shape", t.shape},
                       {"data_offsets", {t.data_begin, t.data_end}},
                       {"bytes", t.num_bytes()}});
  }
  return {{"format", "safetensors"}, {"tensors", tensors}, {"metadata", h.metadata}};
}

// One file: its JSON put in `json`, or its text appended to `text` (the other is null).
Status InspectFile(const std::string& path, ordered_json* json, std::string* text) {
  RESHARD_ASSIGN_OR_RETURN(const MappedFile mapped, MappedFile::Open(path));
  if (LooksLikeTorchFile(mapped.bytes())) {
    RESHARD_ASSIGN_OR_RETURN(const TorchFile f, TorchFile::Open(path));
    if (json != nullptr) {
      *json = TorchJson(f);
    } else {
      AppendTorch(path, f, *text);
    }
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(const SafetensorsHeader h, ReadSafetensorsHeader(path));
  if (json != nullptr) {
    *json = SafetensorsJson(h);
    return Status::Ok();
  }
  auto out = std::back_inserter(*text);
  fmt::format_to(out, "\"{}\": safetensors file: {} tensors, {} bytes of data\n", path,
                 h.tensors.size(), h.data_size);
  for (const TensorInfo& t : h.tensors) {
    fmt::format_to(out, "  {}  {} {}\n", t.name, DTypeName(t.dtype), FormatShape(t.shape));
  }
  for (const auto& [k, v] : h.metadata) fmt::format_to(out, "  metadata {} = {}\n", k, v);
  return Status::Ok();
}

// A universal checkpoint (OpenUniversal): its parameters, their full shapes, and which
// optimizer states it holds for them.
Result<ordered_json> UniversalSummary(const std::string& path) {
  SourceOptions options;
  options.use = SourceUse::kConvert;
  RESHARD_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenUniversal(path, options));
  const Manifest& m = opened.source->manifest();
  ordered_json params = ordered_json::array();
  std::map<std::string, int64_t> states;  // ".exp_avg" -> how many parameters have it
  int64_t elements = 0;
  for (const ShardedParam& p : m.params) {
    const std::string& name = p.name;
    const size_t dot = name.rfind('.');
    const std::string suffix = dot == std::string::npos ? "" : name.substr(dot);
    if (suffix == ".fp32" || suffix == ".exp_avg" || suffix == ".exp_avg_sq" ||
        suffix == ".max_exp_avg_sq") {
      ++states[suffix.substr(1)];
      continue;
    }
    elements += ProductOf(p.map.logical_shape());
    params.push_back(
        {{"name", name}, {"dtype", DTypeName(p.dtype)}, {"shape", p.map.logical_shape()}});
  }
  ordered_json state_counts = ordered_json::object();
  for (const auto& [state, count] : states) state_counts[state] = count;
  return ordered_json{{"parameters", params.size()},
                      {"elements", elements},
                      {"optimizer_states", state_counts},
                      {"params", params}};
}

std::string UniversalSummaryText(const ordered_json& u) {
  std::string out = fmt::format("universal checkpoint: {} parameters, {} elements",
                                u["parameters"].get<int64_t>(), u["elements"].get<int64_t>());
  for (const auto& [state, count] : u["optimizer_states"].items()) {
    out += fmt::format("; {} for {}", state, count.get<int64_t>());
  }
  out += "\n";
  for (const auto& p : u["params"]) {
    out += fmt::format("  {}  {} {}\n", p["name"].get<std::string>(), p["dtype"].get<std::string>(),
                       FormatShape(p["shape"].get<Shape>()));
  }
  return out;
}

// A LoRA adapter's config (adapter_config.json beside its tensors, or beside a scattered
// adapter's shards): rank, alpha, scaling and targets; null where there is none.
Result<ordered_json> AdapterSummary(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / kAdapterConfigName, ec)) return ordered_json(nullptr);
  RESHARD_ASSIGN_OR_RETURN(const std::string text,
                           ReadFileToString((dir / kAdapterConfigName).string()));
  Result<LoraConfig> c = ParseLoraConfigJson(text);
  if (!c.ok()) return c.status().Annotate((dir / kAdapterConfigName).string());
  ordered_json targets =
      c->target_regex.empty() ? ordered_json(c->target_modules) : ordered_json(c->target_regex);
  return ordered_json{{"r", c->r},
                      {"lora_alpha", c->alpha},
                      {"scaling", c->Scaling()},
                      {"scaling_rule", c->ScalingRule()},
                      {"target_modules", std::move(targets)},
                      {"modules_to_save", c->modules_to_save},
                      {"use_dora", c->use_dora},
                      {"fan_in_fan_out", c->fan_in_fan_out}};
}

std::string AdapterSummaryText(const ordered_json& a) {
  return fmt::format(
      "LoRA adapter: r {}, alpha {}, scaling {} ({}), targets {}{}{}\n", a["r"].get<int64_t>(),
      a["lora_alpha"].get<double>(), a["scaling"].get<double>(),
      a["scaling_rule"].get<std::string>(), a["target_modules"].dump(),
      a["modules_to_save"].empty() ? std::string()
                                   : ", modules saved whole " + a["modules_to_save"].dump(),
      a["use_dora"].get<bool>() ? ", DoRA" : "");
}

// The adapter summary of `dir`, if it has one, into `doc` (JSON) or `out` (text).
Status AppendAdapter(const fs::path& dir, bool json, ordered_json& doc, std::string& out) {
  RESHARD_ASSIGN_OR_RETURN(const ordered_json adapter, AdapterSummary(dir));
  if (!adapter.is_null() && json) {
    doc["adapter"] = adapter;
  } else if (!adapter.is_null()) {
    out += AdapterSummaryText(adapter);
  }
  return Status::Ok();
}

bool IsTensorFile(const std::filesystem::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".pt" || ext == ".pth" || ext == ".bin" || ext == ".safetensors";
}

// A directory: every .pt/.pth/.bin/.safetensors file in it (not recursive), in name order. A
// DeepSpeed save dir (a `latest` file naming a tag dir) is read through its tag dir.
Status InspectDirectory(const std::string& path, bool json, const QuantizedPairs& pairs,
                        std::string& out) {
  fs::path dir = path;
  std::string tag;
  std::error_code error;
  Result<std::string> latest = ReadFileToString((dir / "latest").string());
  // A `latest` that is there but cannot be read (a symbolic link loop, a directory) is a
  // malformed DeepSpeed save dir, as gather and convert find it.
  if (!latest.ok() && latest.status().code() != StatusCode::kNotFound) return latest.status();
  if (latest.ok()) {
    tag = *latest;
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
    if (tag.empty() || tag.find('/') != std::string::npos || !fs::is_directory(dir / tag, error)) {
      return DataLossError(fmt::format("\"{}\" names \"{}\", which is not a directory beside it",
                                       (dir / "latest").string(), tag));
    }
    dir /= tag;
  }
  std::vector<fs::path> files, others;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    std::error_code type_error;
    const bool regular = entry.is_regular_file(type_error);
    // A tensor file that cannot even be looked at (a symbolic link loop, a name too long to
    // follow) is an unreadable input; anything else that is not a regular file is passed over.
    if (type_error && IsTensorFile(entry.path())) {
      return ErrnoStatus(type_error.value(), "cannot read", entry.path().string());
    }
    if (!regular) continue;
    (IsTensorFile(entry.path()) ? files : others).push_back(entry.path());
  }
  if (error)
    return InvalidArgumentError("cannot list \"" + dir.string() + "\": " + error.message());
  std::sort(files.begin(), files.end());
  std::sort(others.begin(), others.end());
  ordered_json doc = {{"format", "directory"}, {"path", dir.string()}};
  if (!tag.empty()) doc["deepspeed_tag"] = tag;
  if (!json) {
    fmt::format_to(std::back_inserter(out), "\"{}\": directory{}, {} tensor files\n", dir.string(),
                   tag.empty() ? "" : fmt::format(" (DeepSpeed tag \"{}\")", tag), files.size());
  }
  // The run that wrote it, printed after the line above once a reader has said it.
  const size_t run_at = out.size();
  std::optional<ParallelRun> run;
  if (IsUniversalCheckpoint(path)) {
    // Its model-states files are copies of the source's (DeepSpeed's own names), read for
    // their module's dtype only: the universal checkpoint is its zero/ folder.
    RESHARD_ASSIGN_OR_RETURN(ordered_json universal, UniversalSummary(path));
    run = UniversalRun(!universal["optimizer_states"].empty());
    if (json) {
      doc["universal"] = universal;
    } else {
      out += UniversalSummaryText(universal);
    }
  } else if (IsDeepSpeedCheckpoint(dir.string())) {
    RESHARD_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ds, DeepSpeedCheckpoint::Open(path));
    run = DeepSpeedRunOf(ds);
    if (json) {
      doc["deepspeed"] = ordered_json::parse(DeepSpeedSummaryJson(ds));
    } else {
      out += DeepSpeedSummaryText(ds);
    }
  }
  if (!IsUniversalCheckpoint(path) && !IsDeepSpeedCheckpoint(dir.string()) &&
      IsDcpCheckpoint(dir.string())) {
    RESHARD_ASSIGN_OR_RETURN(const auto dcp, DcpCheckpoint::Open(dir.string()));
    run = IsMegatronCheckpoint(dir.string()) ? MegatronRunOf(*dcp) : DcpRunOf(*dcp);
    if (json) {
      doc["dcp"] = ordered_json::parse(DcpSummaryJson(*dcp));
    } else {
      out += DcpSummaryText(*dcp);
    }
  }
  if (IsOrbaxCheckpoint(dir.string())) {
    RESHARD_ASSIGN_OR_RETURN(const auto orbax, OrbaxCheckpoint::Open(dir.string()));
    run = OrbaxRunOf(*orbax);
    if (json) {
      doc["orbax"] = ordered_json::parse(OrbaxSummaryJson(*orbax));
    } else {
      out += OrbaxSummaryText(*orbax);
    }
  }
  RESHARD_RETURN_IF_ERROR(AppendAdapter(dir, json, doc, out));
  ordered_json listed = ordered_json::array();
  const ModelDir model_dir = ModelDirOf(dir.string());
  RESHARD_ASSIGN_OR_RETURN(ordered_json model, ModelView(dir.string(), model_dir, pairs, run));
  if (run && json) {
    doc["parallelism"] = ordered_json::parse(ParallelRunJson(*run));
  } else if (run) {
    out.insert(run_at, fmt::format("parallelism: {}\n  files: {}\n", ParallelRunText(*run),
                                   run->files.empty() ? "(none)" : run->files));
  }
  const std::vector<std::string> model_files = ModelFiles(model);
  for (const fs::path& f : files) {
    // A Hugging Face model's tensors are listed once, by its model view below.
    if (model_dir == ModelDir::kHuggingFace && !json &&
        std::count(model_files.begin(), model_files.end(), f.filename().string()) > 0) {
      continue;
    }
    ordered_json one;
    RESHARD_RETURN_IF_ERROR(InspectFile(f.string(), json ? &one : nullptr, &out));
    if (json) listed.push_back({{"file", f.filename().string()}, {"contents", one}});
  }
  if (!json) {
    AppendModelView(dir.string(), model, out);
  } else if (model_dir != ModelDir::kNone) {
    doc["model"] = std::move(model);
  }
  ordered_json rest = ordered_json::array();
  for (const fs::path& f : others) rest.push_back(f.filename().string());
  if (json) {
    doc["files"] = listed;
    doc["other_files"] = rest;
    out += doc.dump(2) + "\n";
  } else if (!others.empty()) {
    out += "other files: " + rest.dump() + "\n";
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> Inspect(const std::string& path, InspectFormat format,
                            const QuantizedPairs& pairs) {
  const bool json = format == InspectFormat::kJson;
  std::string out;
  std::error_code ec;  // a path that cannot be looked at is InspectFile's to report
  if (fs::is_directory(path, ec)) {
    RESHARD_RETURN_IF_ERROR(InspectDirectory(path, json, pairs, out));
    return out;
  }
  if (!json) {
    RESHARD_RETURN_IF_ERROR(InspectFile(path, nullptr, &out));
    return out;
  }
  ordered_json doc;
  RESHARD_RETURN_IF_ERROR(InspectFile(path, &doc, nullptr));
  return doc.dump(2) + "\n";
}

}  // namespace reshard
