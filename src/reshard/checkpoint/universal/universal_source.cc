// DeepSpeed's universal checkpoint as a source (OpenUniversal, universal.h).
//
// The folder (docs/formats.md, "The universal checkpoint"; `OUT/latest_universal` names it):
//   zero/<param>/fp32.pt         {"param": the full fp32 master weight, ...category keys}
//   zero/<param>/exp_avg.pt      the same for Adam's first moment
//   zero/<param>/exp_avg_sq.pt   and its second
//   zero/<param>/step.pt         the optimizer's step (a tensor, or a number)
//   zero/optimizer_state.pt      {"param_groups": [...], ...DeepSpeed's global state}
//   *model_states.pt             copies of DeepSpeed's (none from a DCP source)
// ZeRO 3 at TP 1 keeps bare flat tensors instead of the dicts; their shapes come from the
// model-states copy's param_shapes. Each tensor is one rank's whole shard (world size 1),
// read in place from its mapped file. The layout that lays it out at another TP degree comes
// from the model-states copy's universal_checkpoint_info (as DeepSpeed's loader splits the full
// tensor), and the module's dtype from that copy's module weights (fp32 without one).
// step.pt and optimizer_state.pt are read for a trainer's state dict only (a DCP output): the
// structure get_state_dict gives an FSDP2 model and torch's AdamW.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_file.h"
#include "reshard/io/torch_writer.h"
#include "reshard/layouts/basic.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

using internal::Get;
using internal::IntAt;
using internal::IsNone;

// A parameter's files: its fp32 master weight (which the module's weights are read from too),
// Adam's moments and AdamW(amsgrad=True)'s maximum of the second (optional). A frozen
// parameter's folder (from a DCP source) holds fp32.pt alone.
constexpr const char* kStateFiles[] = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt",
                                       "max_exp_avg_sq.pt"};
constexpr size_t kMaxExpAvgSq = 3;

struct UniversalTensor {
  std::unique_ptr<TorchFile> file;
  const TorchTensor* tensor = nullptr;
  bool flat = false;  // the bare tensor of the flat form, not {"param": ...}
};

struct UniversalParamFiles {
  std::string name;
  Shape shape;
  std::optional<LayoutDescriptor> layout;
  // [state]: fp32, exp_avg, exp_avg_sq, max_exp_avg_sq (null when not opened or absent).
  std::array<UniversalTensor, 4> tensors;
  std::optional<float> step;  // step.pt's, read for a trainer's state dict
};

struct UniversalCheckpoint {
  std::string folder;
  std::vector<std::string> inputs;
  DType module_dtype = DType::kF32;
  std::vector<UniversalParamFiles> params;
  // The parameters of each optimizer group, from the model-states copy's param_shapes.
  std::vector<std::vector<std::string>> groups;
};

bool HasFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The folder `path` names: the one OUT/latest_universal names, or `path` itself.
Result<std::string> UniversalFolder(const std::string& path) {
  const fs::path latest = fs::path(path) / "latest_universal";
  if (!HasFile(latest)) return path;
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(latest.string()));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' '))
    text.pop_back();
  const fs::path folder = fs::path(path) / text;
  std::error_code ec;
  if (text.empty() || text.find('/') != std::string::npos ||
      !fs::is_directory(folder / "zero", ec)) {
    return NotFoundError(
        fmt::format("\"{}\" names \"{}\", which is no universal checkpoint folder (no \"{}\")",
                    latest.string(), text, (folder / "zero").string()));
  }
  return folder.string();
}

// The model-states copy whose metadata the source takes (TP rank 0's), or "" without one.
std::string ModelStatesOf(const std::string& folder) {
  for (const char* name :
       {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"}) {
    if (HasFile(fs::path(folder) / name)) return (fs::path(folder) / name).string();
  }
  return "";
}

// The names in each group of a model-states file's param_shapes, in order.
std::vector<std::vector<std::string>> ParamGroups(const TorchFile& f) {
  const PickleTree& t = f.tree();
  std::vector<std::vector<std::string>> out;
  const PickleNodeId groups = Get(t, t.root(), "param_shapes");
  if (groups == kNoPickleNode || IsNone(t, groups)) return out;
  for (const PickleNodeId g : t.node(groups).items) {
    std::vector<std::string>& names = out.emplace_back();
    for (const auto& [k, v] : t.node(g).entries) {
      if (t.node(k).kind == PickleKind::kStr) names.push_back(t.node(k).text);
    }
  }
  return out;
}

// param_shapes of a model-states file: {name: shape} over every group.
std::map<std::string, Shape> ParamShapes(const TorchFile& f) {
  const PickleTree& t = f.tree();
  std::map<std::string, Shape> out;
  const PickleNodeId groups = Get(t, t.root(), "param_shapes");
  if (groups == kNoPickleNode || IsNone(t, groups)) return out;
  for (const PickleNodeId g : t.node(groups).items) {
    for (const auto& [k, v] : t.node(g).entries) {
      if (t.node(k).kind != PickleKind::kStr) continue;
      Shape s;
      bool ok = true;
      for (const PickleNodeId c : t.node(v).items) {
        const std::optional<int64_t> d = IntAt(t, c);
        ok = ok && d.has_value();
        if (d) s.push_back(*d);
      }
      if (ok) out.emplace(t.node(k).text, std::move(s));
    }
  }
  return out;
}

// The module's dtype: that of the model-states file's module weights (fp32 without any).
DType ModuleDType(const TorchFile& f) {
  for (const TorchTensor& t : f.tensors()) {
    if (t.name.starts_with("module.") && t.dtype.dtype) return *t.dtype.dtype;
  }
  return DType::kF32;
}

// Opens zero/<param>/<file> and finds its tensor: at "param" of the dict, or the whole file
// (the flat form) when `flat` shapes are known for it.
Result<UniversalTensor> OpenStateFile(const fs::path& path,
                                      const std::map<std::string, Shape>& flat,
                                      const std::string& param) {
  Result<TorchFile> opened = TorchFile::Open(path.string());
  if (!opened.ok()) return opened.status().Annotate(fmt::format("\"{}\"", path.string()));
  UniversalTensor out;
  out.file = std::make_unique<TorchFile>(*std::move(opened));
  const PickleTree& t = out.file->tree();
  const PickleNodeId node =
      t.node(t.root()).kind == PickleKind::kDict ? Get(t, t.root(), "param") : t.root();
  out.tensor = node == kNoPickleNode ? nullptr : out.file->TensorAt(node);
  out.flat = node == t.root();
  if (out.tensor == nullptr || (node == t.root() && !flat.contains(param))) {
    return InvalidArgumentError(fmt::format(
        "\"{}\": no tensor at \"param\" (a universal checkpoint's file holds {{\"param\": the full "
        "tensor}})",
        path.string()));
  }
  if (out.tensor->dtype.dtype != DType::kF32) {
    return InvalidArgumentError(
        fmt::format("\"{}\": the tensor is {}, not the fp32 a universal "
                    "checkpoint holds",
                    path.string(), out.tensor->dtype.name));
  }
  return out;
}

// Parameter `name`'s files, their shapes checked against each other (and the flat form's
// against param_shapes). Without either of Adam's moments the parameter is a frozen one (fp32.pt
// alone); one without the other is refused.
Result<UniversalParamFiles> OpenParam(const fs::path& dir, const std::string& name,
                                      const std::map<std::string, Shape>& flat,
                                      bool optimizer_state) {
  UniversalParamFiles p;
  p.name = name;
  const bool frozen = !HasFile(dir / kStateFiles[1]) && !HasFile(dir / kStateFiles[2]);
  const int states = !optimizer_state ? 1 : frozen ? 1 : 4;
  for (int s = 0; s < states; ++s) {
    const fs::path path = dir / kStateFiles[s];
    if (static_cast<size_t>(s) == kMaxExpAvgSq && !HasFile(path)) continue;
    if (!HasFile(path)) {
      return NotFoundError(
          fmt::format("\"{}\" is missing: parameter \"{}\" of the universal checkpoint has no {}",
                      path.string(), name, s == 0 ? "fp32 master weight" : kStateFiles[s]));
    }
    RESHARD_ASSIGN_OR_RETURN(p.tensors[static_cast<size_t>(s)], OpenStateFile(path, flat, name));
    const TorchTensor& t = *p.tensors[static_cast<size_t>(s)].tensor;
    Shape shape = t.shape;
    if (const auto it = flat.find(name);
        it != flat.end() && p.tensors[static_cast<size_t>(s)].flat) {
      if (ProductOf(it->second) != t.numel()) {
        return InvalidArgumentError(
            fmt::format("\"{}\": {} elements, but param_shapes gives \"{}\" the shape {}",
                        path.string(), t.numel(), name, FormatShape(it->second)));
      }
      shape = it->second;
    }
    if (s == 0) {
      p.shape = shape;
    } else if (shape != p.shape) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" holds a tensor of shape {}, but \"{}\" one of shape {}", path.string(),
          FormatShape(shape), (dir / "fp32.pt").string(), FormatShape(p.shape)));
    }
  }
  return p;
}

// The step a step.pt holds: a one-element tensor (torch's Adam: 0-d fp32) or a number.
// InvalidArgument, naming the file, for anything else.
Result<float> ReadStep(const fs::path& path) {
  Result<TorchFile> f = TorchFile::Open(path.string());
  if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\"", path.string()));
  const PickleTree& t = f->tree();
  const PickleNode& root = t.node(t.root());
  if (root.kind == PickleKind::kInt) return static_cast<float>(root.int_value);
  if (root.kind == PickleKind::kFloat) return static_cast<float>(root.float_value);
  const TorchTensor* tensor = f->TensorAt(t.root());
  const std::optional<DType> dtype = tensor == nullptr ? std::nullopt : tensor->dtype.dtype;
  if (tensor != nullptr && tensor->numel() == 1 && dtype &&
      (*dtype == DType::kF32 || *dtype == DType::kF64 || *dtype == DType::kI64)) {
    std::array<std::byte, 8> bytes{};
    RESHARD_RETURN_IF_ERROR(f->CopyTo(*tensor, std::span(bytes).first(DTypeSize(*dtype)))
                                .Annotate(fmt::format("\"{}\"", path.string())));
    if (*dtype == DType::kF32) return std::bit_cast<std::array<float, 2>>(bytes)[0];
    if (*dtype == DType::kF64) return static_cast<float>(std::bit_cast<double>(bytes));
    return static_cast<float>(std::bit_cast<int64_t>(bytes));
  }
  return InvalidArgumentError(fmt::format(
      "\"{}\": the optimizer's step is neither a number nor a one-element fp32, fp64 or int64 "
      "tensor",
      path.string()));
}

Result<UniversalCheckpoint> OpenUniversalFiles(const std::string& path, bool optimizer_state,
                                               bool steps) {
  UniversalCheckpoint c;
  RESHARD_ASSIGN_OR_RETURN(c.folder, UniversalFolder(path));
  c.inputs.push_back(c.folder);
  const fs::path zero = fs::path(c.folder) / "zero";
  std::error_code ec;
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(zero, ec)) {
    if (e.is_directory(ec)) names.push_back(e.path().filename().string());
  }
  if (ec) return NotFoundError(fmt::format("listing \"{}\": {}", zero.string(), ec.message()));
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    return InvalidArgumentError(
        fmt::format("\"{}\" holds no parameter folders (zero/<param>/fp32.pt)", zero.string()));
  }
  std::unique_ptr<TorchFile> states;
  std::map<std::string, Shape> flat;
  if (const std::string ms = ModelStatesOf(c.folder); !ms.empty()) {
    Result<TorchFile> f = TorchFile::Open(ms);
    if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\"", ms));
    states = std::make_unique<TorchFile>(*std::move(f));
    c.module_dtype = ModuleDType(*states);
    flat = ParamShapes(*states);
    c.groups = ParamGroups(*states);
    c.inputs.push_back(ms);
  }
  for (const std::string& name : names) {
    RESHARD_ASSIGN_OR_RETURN(UniversalParamFiles p,
                             OpenParam(zero / name, name, flat, optimizer_state));
    if (steps && HasFile(zero / name / "step.pt")) {
      RESHARD_ASSIGN_OR_RETURN(p.step, ReadStep(zero / name / "step.pt"));
    }
    c.params.push_back(std::move(p));
  }
  if (states != nullptr) {
    std::vector<std::pair<std::string, Shape>> shapes;
    for (const UniversalParamFiles& p : c.params) shapes.emplace_back(p.name, p.shape);
    Result<std::vector<std::optional<LayoutDescriptor>>> layouts =
        DeepSpeedLayoutsOf(*states, shapes);
    if (!layouts.ok()) return layouts.status().Annotate(fmt::format("\"{}\"", c.inputs.back()));
    for (size_t i = 0; i < c.params.size(); ++i) c.params[i].layout = (*layouts)[i];
  }
  return c;
}

// The tensors as one rank's whole shards: views of the mapped files where they are dense fp32,
// copies for the module's weights in a narrower dtype (rounded to nearest even, as DeepSpeed
// copies its masters into the module).
class UniversalShardSource : public ShardSource {
 public:
  // The tensors of `states` for every parameter (the first under the parameter's name, the
  // others as "<param>.<state>"), then with `steps` each step read as "<param>.step" (0-d).
  // A frozen parameter (no moments) has its first tensor only; max_exp_avg_sq follows the
  // states where a parameter has one (as "<param>.max_exp_avg_sq", scaled as exp_avg_sq).
  UniversalShardSource(std::shared_ptr<const UniversalCheckpoint> ckpt,
                       std::vector<DeepSpeedState> states, bool steps)
      : ckpt_(std::move(ckpt)) {
    manifest_.world_size = 1;
    for (const DeepSpeedState s : states) {
      for (size_t i = 0; i < ckpt_->params.size(); ++i) {
        const UniversalParamFiles& p = ckpt_->params[i];
        const size_t slot = s == DeepSpeedState::kModule ? 0 : static_cast<size_t>(s) - 1;
        if (s != states.front() && p.tensors[slot].tensor == nullptr) continue;
        const std::string name =
            s == states.front() ? p.name : fmt::format("{}.{}", p.name, DeepSpeedStateName(s));
        const DType dtype = s == DeepSpeedState::kModule ? ckpt_->module_dtype : DType::kF32;
        Result<ParamMap> map = ReplicatedMap(p.shape, 1);  // a valid shape: cannot fail
        manifest_.params.push_back(
            ShardedParam{name, dtype, *std::move(map), p.layout, DeepSpeedScalePower(s)});
        which_.push_back({i, slot, false});
      }
    }
    for (size_t i = 0; states.size() > 1 && i < ckpt_->params.size(); ++i) {
      const UniversalParamFiles& p = ckpt_->params[i];
      if (p.tensors[kMaxExpAvgSq].tensor == nullptr) continue;
      Result<ParamMap> map = ReplicatedMap(p.shape, 1);  // a valid shape: cannot fail
      manifest_.params.push_back(ShardedParam{p.name + ".max_exp_avg_sq", DType::kF32,
                                              *std::move(map), p.layout,
                                              DeepSpeedScalePower(DeepSpeedState::kExpAvgSq)});
      which_.push_back({i, kMaxExpAvgSq, false});
    }
    for (size_t i = 0; steps && i < ckpt_->params.size(); ++i) {
      const UniversalParamFiles& p = ckpt_->params[i];
      if (!p.step) continue;
      Result<ParamMap> map = ReplicatedMap({}, 1);  // a 0-d tensor: cannot fail
      manifest_.params.push_back(
          ShardedParam{p.name + ".step", DType::kF32, *std::move(map), std::nullopt, 1});
      which_.push_back({i, 0, true});
    }
  }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override { return ckpt_->inputs; }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const auto [param, slot, step] = which_[i];
    if (step) {
      return std::vector<ConstBuffer>{
          {reinterpret_cast<const std::byte*>(&*ckpt_->params[param].step), 1}};
    }
    const UniversalTensor& u = ckpt_->params[param].tensors[slot];
    const TorchTensor& t = *u.tensor;
    const Index n = t.numel();
    const DType dtype = manifest_.params[i].dtype;
    if (dtype == DType::kF32 && t.is_contiguous()) {
      const std::byte* base = u.file->storages()[t.storage].bytes.data();
      return std::vector<ConstBuffer>{{base + static_cast<size_t>(t.storage_offset) * 4, n}};
    }
    return cache_.Acquire(
        i, manifest_.params[i].map, [&](std::vector<std::vector<std::byte>>& data) {
          std::vector<std::byte> fp32(static_cast<size_t>(n) * 4);
          Status s = u.file->CopyTo(t, fp32);
          if (!s.ok()) return s.Annotate(fmt::format("parameter \"{}\"", manifest_.params[i].name));
          std::vector<std::byte>& out = data[0];  // one rank
          if (dtype == DType::kF32) {
            out = std::move(fp32);
          } else {
            out.resize(static_cast<size_t>(n) * 2);
            const auto* in = reinterpret_cast<const float*>(fp32.data());
            auto* o = reinterpret_cast<uint16_t*>(out.data());
            for (Index k = 0; k < n; ++k) {
              o[k] = dtype == DType::kBF16 ? FloatToBFloat16(in[k]) : FloatToHalf(in[k]);
            }
          }
          return Status::Ok();
        });
  }
  void ReleaseShards(size_t i) override { cache_.Release(i); }

 private:
  std::shared_ptr<const UniversalCheckpoint> ckpt_;
  Manifest manifest_;
  struct Which {
    size_t param;
    size_t slot;  // into UniversalParamFiles::tensors
    bool step;    // the parameter's step, not a state's tensor
  };
  std::vector<Which> which_;
  ShardCache cache_;
};

// The archive of `value` (a DCP bytes item), a node of `b`.
Result<std::shared_ptr<const std::string>> ArchiveOf(TorchTreeBuilder& b, PickleNodeId value) {
  RESHARD_ASSIGN_OR_RETURN(std::string bytes, b.Archive(value));
  return std::make_shared<const std::string>(std::move(bytes));
}

StateDictObject ObjectOf(std::vector<std::string> keys, std::vector<bool> is_index,
                         const std::shared_ptr<const std::string>& bytes) {
  StateDictObject o;
  o.key = fmt::format("{}", fmt::join(keys, "."));
  o.path = StateDictPath{std::move(keys), std::move(is_index)};
  o.stored_bytes = bytes->size();
  o.read = [bytes]() -> Result<std::span<const std::byte>> {
    return std::as_bytes(std::span(bytes->data(), bytes->size()));
  };
  return o;
}

// Group g's "params" as get_state_dict gives them: the parameters' names. A list of str is
// kept (a universal checkpoint from DCP); else (DeepSpeed's indices into its flat groups, or
// none: Megatron's) the names the model-states copy's param_shapes gives group g, or every
// parameter for one group; nullopt when nothing says which group holds which parameter.
std::optional<std::vector<std::string>> GroupParams(const UniversalCheckpoint& c,
                                                    const PickleTree& t, PickleNodeId params,
                                                    size_t g, size_t groups) {
  std::vector<std::string> names;
  if (params != kNoPickleNode) {
    const PickleNode& n = t.node(params);
    const bool strs =
        (n.kind == PickleKind::kList || n.kind == PickleKind::kTuple) && !n.items.empty() &&
        std::all_of(n.items.begin(), n.items.end(),
                    [&](PickleNodeId i) { return t.node(i).kind == PickleKind::kStr; });
    if (strs) {
      for (const PickleNodeId i : n.items) names.push_back(t.node(i).text);
      return names;
    }
  }
  if (c.groups.size() == groups) return c.groups[g];
  if (groups != 1) return std::nullopt;
  for (const UniversalParamFiles& p : c.params) names.push_back(p.name);
  return names;
}

// The param_groups of zero/optimizer_state.pt as get_state_dict's bytes items
// "optim.param_groups.<g>.<key>": each value copied as pickled, "params" the names.
Status AddParamGroups(const UniversalCheckpoint& c, StateDictStructure& out) {
  const fs::path path = fs::path(c.folder) / "zero" / "optimizer_state.pt";
  if (!HasFile(path)) return Status::Ok();
  Result<TorchFile> f = TorchFile::Open(path.string());
  if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\"", path.string()));
  const PickleTree& t = f->tree();
  const PickleNodeId groups = Get(t, t.root(), "param_groups");
  if (groups == kNoPickleNode ||
      (t.node(groups).kind != PickleKind::kList && t.node(groups).kind != PickleKind::kTuple)) {
    return InvalidArgumentError(
        fmt::format("\"{}\" holds no list \"param_groups\"", path.string()));
  }
  const std::vector<PickleNodeId>& items = t.node(groups).items;
  // Keys are the value's path as DCP flattens a state dict (torch's traverse_state_dict):
  // into every dict, and into a list holding a dict, a list or a tensor; the rest is a leaf.
  std::vector<std::string> keys = {"optim", "param_groups", "", ""};
  std::vector<bool> is_index = {false, false, true, false};
  const auto add = [&](TorchTreeBuilder& b, PickleNodeId value) -> Status {
    Result<std::shared_ptr<const std::string>> bytes = ArchiveOf(b, value);
    if (!bytes.ok()) {
      return bytes.status().Annotate(
          fmt::format("\"{}\": {}", path.string(), fmt::join(keys, ".")));
    }
    out.objects.push_back(ObjectOf(keys, is_index, *std::move(bytes)));
    return Status::Ok();
  };
  const std::function<Status(PickleNodeId)> add_value = [&](PickleNodeId v) -> Status {
    const PickleNode& n = t.node(v);
    const bool dict = n.kind == PickleKind::kDict &&
                      std::all_of(n.entries.begin(), n.entries.end(), [&](const auto& e) {
                        return t.node(e.first).kind == PickleKind::kStr;
                      });
    const bool list =
        n.kind == PickleKind::kList &&
        std::any_of(n.items.begin(), n.items.end(), [&](PickleNodeId i) {
          const PickleKind k = t.node(i).kind;
          return k == PickleKind::kDict || k == PickleKind::kList || f->TensorAt(i) != nullptr;
        });
    if (dict || list) {
      for (size_t j = 0; j < (dict ? n.entries.size() : n.items.size()); ++j) {
        keys.push_back(dict ? t.node(n.entries[j].first).text : std::to_string(j));
        is_index.push_back(!dict);
        const Status s = add_value(dict ? n.entries[j].second : n.items[j]);
        keys.pop_back();
        is_index.pop_back();
        RESHARD_RETURN_IF_ERROR(s);
      }
      return Status::Ok();
    }
    TorchTreeBuilder b;
    Result<PickleNodeId> copied = b.Copy(*f, v);
    if (!copied.ok()) {
      return copied.status().Annotate(
          fmt::format("\"{}\": {}", path.string(), fmt::join(keys, ".")));
    }
    return add(b, *copied);
  };
  for (size_t g = 0; g < items.size(); ++g) {
    if (t.node(items[g]).kind != PickleKind::kDict) {
      return InvalidArgumentError(
          fmt::format("\"{}\": param_groups[{}] is no dict", path.string(), g));
    }
    keys[2] = std::to_string(g);
    PickleNodeId params = kNoPickleNode;
    for (const auto& [k, v] : t.node(items[g]).entries) {
      if (t.node(k).kind != PickleKind::kStr) continue;
      const std::string& key = t.node(k).text;
      if (key == "params") {
        params = v;
        continue;
      }
      keys[3] = key;
      RESHARD_RETURN_IF_ERROR(add_value(v));
    }
    if (const std::optional<std::vector<std::string>> names =
            GroupParams(c, t, params, g, items.size())) {
      TorchTreeBuilder b;
      std::vector<PickleNodeId> list;
      for (const std::string& name : *names) list.push_back(b.Str(name));
      keys[3] = "params";
      RESHARD_RETURN_IF_ERROR(add(b, b.List(std::move(list))));
    }
  }
  return Status::Ok();
}

// What get_state_dict gives an FSDP2 model and torch's AdamW, as UniversalShardSource names the
// tensors with `steps`: "model.<param>" (the fp32 masters, named <param>),
// "optim.state.<param>.{exp_avg,exp_avg_sq,step}" and the param_groups.
Result<std::shared_ptr<const StateDictStructure>> TrainerStateDict(const UniversalCheckpoint& c) {
  auto out = std::make_shared<StateDictStructure>();
  const auto state = [](const std::string& param, std::string s) {
    return StateDictPath{{"optim", "state", param, std::move(s)}, {false, false, false, false}};
  };
  for (const UniversalParamFiles& p : c.params) {
    out->tensor_paths.emplace(p.name, StateDictPath{{"model", p.name}, {false, false}});
    for (size_t k = 1; k < p.tensors.size(); ++k) {
      if (p.tensors[k].tensor == nullptr) continue;  // a frozen parameter, Adam without amsgrad
      const std::string s = fs::path(kStateFiles[k]).stem().string();
      out->tensor_paths.emplace(fmt::format("{}.{}", p.name, s), state(p.name, s));
    }
    if (p.step) out->tensor_paths.emplace(p.name + ".step", state(p.name, "step"));
  }
  RESHARD_RETURN_IF_ERROR(AddParamGroups(c, *out));
  return std::shared_ptr<const StateDictStructure>(std::move(out));
}

}  // namespace

bool IsUniversalCheckpoint(const std::string& path) {
  const fs::path p(path);
  // A save dir with both `latest` and `latest_universal` (ds_to_universal's output beside the
  // tags) stays the DeepSpeed checkpoint; its universal folder is read when named.
  return (HasFile(p / "latest_universal") && !HasFile(p / "latest")) ||
         HasFile(p / "zero" / "optimizer_state.pt");
}

Result<OpenedCheckpoint> OpenUniversal(const std::string& path, const SourceOptions& options) {
  const bool convert = options.use == SourceUse::kConvert;
  const bool optimizer_state = convert && !options.weights_only;
  // A trainer's state dict: the model's weights are the fp32 masters, beside the moments and
  // the step.
  const bool trainer = optimizer_state && options.trainer_state_dict;
  RESHARD_ASSIGN_OR_RETURN(UniversalCheckpoint opened,
                           OpenUniversalFiles(path, optimizer_state, trainer));
  auto ckpt = std::make_shared<const UniversalCheckpoint>(std::move(opened));
  std::vector<DeepSpeedState> states = {(!convert && options.master_weights) || trainer
                                            ? DeepSpeedState::kMaster
                                            : DeepSpeedState::kModule};
  if (trainer) {
    states.insert(states.end(), {DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq});
  } else if (optimizer_state) {
    states.insert(states.end(),
                  {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg, DeepSpeedState::kExpAvgSq});
  }
  OpenedCheckpoint out;
  out.format = "universal";
  if (trainer) {
    RESHARD_ASSIGN_OR_RETURN(out.state_dict, TrainerStateDict(*ckpt));
  }
  out.source = std::make_shared<UniversalShardSource>(ckpt, std::move(states), trainer);
  return out;
}

}  // namespace reshard
