// reshard inspect FILE_OR_DIR [--json]: the tensors and object tree of a .pt or .safetensors file,
// or of every such file in a directory (a DeepSpeed save dir through its `latest` tag).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_status.h"
#include "inspect_model.h"
#include "reshard/checkpoint/deepspeed.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_file.h"

namespace reshard::cli {

namespace {

using nlohmann::ordered_json;

struct InspectArgs {
  std::string path;
  bool json = false;
};

std::string Hex(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

// The object tree as JSON: plain values as themselves (dicts with only str keys as objects),
// tuples, sets, bytes, tensors, globals and records as one-key objects saying what they are.
ordered_json TreeJson(const TorchFile& f, PickleNodeId id) {
  const PickleNode& n = f.tree().node(id);
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
      return {{"persistent_id", TreeJson(f, n.items[0])}};
    case PickleKind::kList:
    case PickleKind::kTuple:
    case PickleKind::kSet: {
      ordered_json items = ordered_json::array();
      for (PickleNodeId c : n.items) items.push_back(TreeJson(f, c));
      if (n.kind == PickleKind::kList) return items;
      return {{n.kind == PickleKind::kTuple ? "tuple" : "set", items}};
    }
    case PickleKind::kDict: {
      const bool str_keys = std::all_of(n.entries.begin(), n.entries.end(), [&](auto& e) {
        return f.tree().node(e.first).kind == PickleKind::kStr;
      });
      ordered_json out = str_keys ? ordered_json::object() : ordered_json::array();
      for (const auto& [k, v] : n.entries) {
        if (str_keys) {
          // Keys are unique (the reader keeps the last value of a repeated key): append
          // without ordered_json's linear lookup, which is quadratic over a large dict.
          out.get_ref<ordered_json::object_t&>().emplace_back(f.tree().node(k).text,
                                                              TreeJson(f, v));
        } else {
          out.push_back(ordered_json::array({TreeJson(f, k), TreeJson(f, v)}));
        }
      }
      return str_keys ? out : ordered_json{{"dict", out}};
    }
    case PickleKind::kRecord: {
      if (const TorchTensor* t = f.TensorAt(id)) return {{"tensor", t->name}};
      const PickleNode& args = f.tree().node(n.args);
      if (!args.items.empty() && f.TensorAt(args.items[0]) != nullptr) {
        return {{"tensor", f.TensorAt(args.items[0])->name}};  // a parameter
      }
      ordered_json out = {{"record", n.text}, {"args", TreeJson(f, n.args)["tuple"]}};
      if (n.state != kNoPickleNode) out["state"] = TreeJson(f, n.state);
      return out;
    }
  }
  return nullptr;
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
  return {{"format", "torch"},
          {"root", f.root()},
          {"tensors", tensors},
          {"storages", storages},
          {"tree", TreeJson(f, f.tree().root())}};
}

// "path = value" for every value of the tree that is not a tensor or a container of them.
void ValueLines(const TorchFile& f, PickleNodeId id, const std::string& path,
                std::vector<std::string>& out) {
  const PickleNode& n = f.tree().node(id);
  const auto join = [&](const std::string& c) { return path.empty() ? c : path + "." + c; };
  const auto line = [&](const std::string& v) {
    out.push_back((path.empty() ? "(root)" : path) + " = " + v);
  };
  if (n.kind == PickleKind::kDict || n.kind == PickleKind::kList || n.kind == PickleKind::kTuple) {
    if (n.items.empty() && n.entries.empty()) line(n.kind == PickleKind::kDict ? "{}" : "[]");
    for (size_t i = 0; i < n.items.size(); ++i)
      ValueLines(f, n.items[i], join(std::to_string(i)), out);
    for (const auto& [k, v] : n.entries) {
      const PickleNode& key = f.tree().node(k);
      ValueLines(f, v, join(key.kind == PickleKind::kStr ? key.text : TreeJson(f, k).dump()), out);
    }
    return;
  }
  if (n.kind == PickleKind::kRecord) {
    const PickleNode& args = f.tree().node(n.args);
    if (f.TensorAt(id) != nullptr ||
        (!args.items.empty() && f.TensorAt(args.items[0]) != nullptr)) {
      return;
    }
    const std::string args_json = TreeJson(f, n.args)["tuple"].dump();  // "[...]"
    line(n.text + "(" + args_json.substr(1, args_json.size() - 2) + ")");
    if (n.state != kNoPickleNode) ValueLines(f, n.state, path, out);
    return;
  }
  line(TreeJson(f, id).dump());
}

void PrintTorch(const std::string& path, const TorchFile& f) {
  uint64_t storage_bytes = 0;
  for (const TorchStorage& s : f.storages()) storage_bytes += s.bytes.size();
  fmt::print("\"{}\": torch.save file (root \"{}\"): {} tensors over {} storages, {} bytes\n", path,
             f.root(), f.tensors().size(), f.storages().size(), storage_bytes);
  for (const TorchTensor& t : f.tensors()) {
    fmt::print("  {}  {} {}", t.name.empty() ? "(root)" : t.name, t.dtype.name,
               FormatShape(t.shape));
    if (!t.is_contiguous()) fmt::print(" stride {}", FormatShape(t.strides));
    if (t.storage_offset != 0) fmt::print(" offset {}", t.storage_offset);
    fmt::print("  storage {}{}\n", f.storages()[t.storage].key, t.parameter ? "  parameter" : "");
  }
  std::vector<std::string> lines;
  ValueLines(f, f.tree().root(), "", lines);
  if (!lines.empty()) fmt::print("other values:\n");
  for (const std::string& line : lines) fmt::print("  {}\n", line);
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

// One file: printed as text, or its JSON put in `out`.
Status InspectFile(const std::string& path, ordered_json* out) {
  RESHARD_ASSIGN_OR_RETURN(const MappedFile mapped, MappedFile::Open(path));
  if (LooksLikeTorchFile(mapped.bytes())) {
    RESHARD_ASSIGN_OR_RETURN(const TorchFile f, TorchFile::Open(path));
    if (out != nullptr) {
      *out = TorchJson(f);
    } else {
      PrintTorch(path, f);
    }
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(const SafetensorsHeader h, ReadSafetensorsHeader(path));
  if (out != nullptr) {
    *out = SafetensorsJson(h);
    return Status::Ok();
  }
  fmt::print("\"{}\": safetensors file: {} tensors, {} bytes of data\n", path, h.tensors.size(),
             h.data_size);
  for (const TensorInfo& t : h.tensors) {
    fmt::print("  {}  {} {}\n", t.name, DTypeName(t.dtype), FormatShape(t.shape));
  }
  for (const auto& [k, v] : h.metadata) fmt::print("  metadata {} = {}\n", k, v);
  return Status::Ok();
}

bool IsTensorFile(const std::filesystem::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".pt" || ext == ".pth" || ext == ".bin" || ext == ".safetensors";
}

// A directory: every .pt/.pth/.bin/.safetensors file in it (not recursive), in name order. A
// DeepSpeed save dir (a `latest` file naming a tag dir) is read through its tag dir.
Status InspectDirectory(const InspectArgs& args) {
  namespace fs = std::filesystem;
  fs::path dir = args.path;
  std::string tag;
  if (Result<std::string> latest = ReadFileToString((dir / "latest").string()); latest.ok()) {
    tag = *latest;
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
    if (tag.empty() || tag.find('/') != std::string::npos || !fs::is_directory(dir / tag)) {
      return DataLossError("\"" + (dir / "latest").string() + "\" names \"" + tag +
                           "\", which is not a directory beside it");
    }
    dir /= tag;
  }
  std::vector<fs::path> files, others;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    if (!entry.is_regular_file()) continue;
    (IsTensorFile(entry.path()) ? files : others).push_back(entry.path());
  }
  if (error)
    return InvalidArgumentError("cannot list \"" + dir.string() + "\": " + error.message());
  std::sort(files.begin(), files.end());
  std::sort(others.begin(), others.end());
  ordered_json doc = {{"format", "directory"}, {"path", dir.string()}};
  if (!tag.empty()) doc["deepspeed_tag"] = tag;
  if (!args.json) {
    fmt::print("\"{}\": directory{}, {} tensor files\n", dir.string(),
               tag.empty() ? "" : fmt::format(" (DeepSpeed tag \"{}\")", tag), files.size());
  }
  if (IsDeepSpeedCheckpoint(dir.string())) {
    RESHARD_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ds, DeepSpeedCheckpoint::Open(args.path));
    if (args.json) {
      doc["deepspeed"] = ordered_json::parse(DeepSpeedSummaryJson(ds));
    } else {
      fmt::print("{}", DeepSpeedSummaryText(ds));
    }
  }
  ordered_json listed = ordered_json::array();
  const ModelDir model_dir = ModelDirOf(dir.string());
  RESHARD_ASSIGN_OR_RETURN(ordered_json model, ModelView(dir.string(), model_dir));
  const std::vector<std::string> model_files = ModelFiles(model);
  for (const fs::path& f : files) {
    // A Hugging Face model's tensors are listed once, by its model view below.
    if (model_dir == ModelDir::kHuggingFace && !args.json &&
        std::count(model_files.begin(), model_files.end(), f.filename().string()) > 0) {
      continue;
    }
    ordered_json one;
    RESHARD_RETURN_IF_ERROR(InspectFile(f.string(), args.json ? &one : nullptr));
    if (args.json) listed.push_back({{"file", f.filename().string()}, {"contents", one}});
  }
  if (args.json && model_dir != ModelDir::kNone) doc["model"] = std::move(model);
  if (!args.json) PrintModelView(dir.string(), model);
  ordered_json rest = ordered_json::array();
  for (const fs::path& f : others) rest.push_back(f.filename().string());
  if (args.json) {
    doc["files"] = listed;
    doc["other_files"] = rest;
    fmt::print("{}\n", doc.dump(2));
  } else if (!others.empty()) {
    fmt::print("other files: {}\n", rest.dump());
  }
  return Status::Ok();
}

Status RunInspect(const InspectArgs& args) {
  if (std::filesystem::is_directory(args.path)) return InspectDirectory(args);
  if (!args.json) return InspectFile(args.path, nullptr);
  ordered_json doc;
  RESHARD_RETURN_IF_ERROR(InspectFile(args.path, &doc));
  fmt::print("{}\n", doc.dump(2));
  return Status::Ok();
}

void AddInspectOptions(CLI::App* cmd, InspectArgs* args) {
  cmd->add_option("FILE_OR_DIR", args->path,
                  "a .pt (torch.save) or .safetensors file, or a directory of them")
      ->required();
  AddJsonFlag(cmd, args->json, "machine-readable output");
}

}  // namespace

CommandBody InspectCommand() { return {AddInspectOptions, RunInspect}; }

}  // namespace reshard::cli
