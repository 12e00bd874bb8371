#include "inspect_model.h"

#include <fmt/format.h>

#include <filesystem>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/ir/map_summary.h"
#include "reshard/layouts/descriptor.h"

namespace reshard::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

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
  for (size_t r = 0; r < m.files.size(); ++r) files[std::to_string(r)] = m.files[r];
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
    one["ranks"] = RanksJson(p);
    params.push_back(std::move(one));
  }
  return {{"format", "reshard"}, {"world_size", m.world_size}, {"bytes", c.total_bytes()},
          {"files", files},      {"constraints", constraints}, {"params", params}};
}

void PrintSharded(const std::string& dir, const ordered_json& j) {
  fmt::print("\"{}\": reshard sharded checkpoint: world size {}, {} parameters, {} bytes\n", dir,
             j["world_size"].get<int>(), j["params"].size(), j["bytes"].get<uint64_t>());
  for (const ordered_json& k : j["constraints"]) {
    fmt::print("  constraint: {} ({}) splits {} {}{}\n", k["module"].get<std::string>(),
               k["style"].get<std::string>(), k["count"].get<int64_t>(),
               k["meaning"].get<std::string>(),
               k["replicate_above"].get<bool>() ? ", replicated above" : "");
  }
  for (const ordered_json& p : j["params"]) {
    fmt::print("  {}  {} {}", p["name"].get<std::string>(), p["dtype"].get<std::string>(),
               FormatShape(p["logical_shape"].get<Shape>()));
    if (p.contains("valid_shape")) {
      fmt::print(" (valid {})", FormatShape(p["valid_shape"].get<Shape>()));
    }
    if (p["scale_power"].get<int>() != 1) fmt::print("  scale^{}", p["scale_power"].get<int>());
    if (p.contains("layout")) fmt::print("  layout {}", p["layout"].dump());
    std::string ranks;
    for (const ordered_json& r : p["ranks"]) {
      const auto pieces = r["pieces"].get<int64_t>();
      const auto replicated = r["replicated_elements"].get<int64_t>();
      ranks += fmt::format("{}rank {}: {} in {} piece{}{}", ranks.empty() ? "" : "; ",
                           r["rank"].get<int>(), FormatShape(r["shard_shape"].get<Shape>()), pieces,
                           pieces == 1 ? "" : "s",
                           replicated > 0 ? fmt::format(", {} replicated", replicated) : "");
    }
    fmt::print("\n    {}\n", ranks);
  }
  for (const auto& [rank, files] : j["files"].items()) {
    fmt::print("  rank {} files: {}\n", rank, files.dump());
  }
}

ordered_json HuggingFaceJson(const std::string& dir, const FullCheckpoint& c) {
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
  }
  const bool index = fs::exists(fs::path(dir) / "model.safetensors.index.json");
  return {{"format", "huggingface"},
          {"index", index ? ordered_json("model.safetensors.index.json") : ordered_json(nullptr)},
          {"bytes", c.total_bytes()},
          {"files", files},
          {"tensors", tensors}};
}

void PrintHuggingFace(const std::string& dir, const ordered_json& j) {
  fmt::print("\"{}\": Hugging Face checkpoint{}: {} tensors, {} bytes in {} file{}\n", dir,
             j["index"].is_null() ? "" : " (model.safetensors.index.json)", j["tensors"].size(),
             j["bytes"].get<uint64_t>(), j["files"].size(), j["files"].size() == 1 ? "" : "s");
  for (const ordered_json& t : j["tensors"]) {
    fmt::print("  {}  {} {}  {}\n", t["name"].get<std::string>(), t["dtype"].get<std::string>(),
               FormatShape(t["shape"].get<Shape>()), t["file"].get<std::string>());
  }
}

}  // namespace

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

Result<ordered_json> ModelView(const std::string& dir, ModelDir kind) {
  if (kind == ModelDir::kSharded) {
    RESHARD_ASSIGN_OR_RETURN(const ShardedCheckpoint c, ShardedCheckpoint::Open(dir));
    return ShardedJson(c);
  }
  if (kind == ModelDir::kHuggingFace) {
    RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint c, FullCheckpoint::Open(dir));
    return HuggingFaceJson(dir, c);
  }
  return ordered_json(nullptr);
}

void PrintModelView(const std::string& dir, const ordered_json& view) {
  if (!view.is_object()) return;
  if (view["format"] == "reshard") {
    PrintSharded(dir, view);
  } else {
    PrintHuggingFace(dir, view);
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

}  // namespace reshard::cli
