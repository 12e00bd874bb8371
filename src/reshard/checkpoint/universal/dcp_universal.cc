// PyTorch Distributed Checkpoint -> universal checkpoint (ConvertDcpToUniversal, universal.h).
//
// The output (docs/formats.md, "The universal checkpoint", from a DCP checkpoint):
//   OUT/latest_universal                     "<dir name>_universal", no newline
//   OUT/<dir name>_universal/zero/optimizer_state.pt   {"param_groups": [...]}
//   OUT/<dir name>_universal/zero/<param>/fp32.pt      {"param": full tensor}
//   OUT/<dir name>_universal/zero/<param>/{exp_avg,exp_avg_sq,max_exp_avg_sq}.pt   likewise
//   OUT/<dir name>_universal/zero/<param>/step.pt      the optimizer's step, a bare tensor
// A parameter is a name P with optimizer state "<opt>.state.<P>.<state>" (get_state_dict's
// nesting, or TorchTitan's flattened keys: the same dotted key) and a model tensor "model.<P>"
// or "<P>"; a frozen parameter, one a param group lists without optimizer state, has fp32.pt
// alone. Every other tensor of the model (a buffer) and every state the folder has no file for
// is refused unless dropped by name. Each file is one job; a state file rebuilds the full
// tensor from the chunks straight into the writer's buffer. Under several processes each
// writes its share of the files into the temporary directory process 0 made, and process 0
// commits.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_file.h"
#include "reshard/io/torch_writer.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// The optimizer's tensor states a universal checkpoint holds beside fp32.pt, each as
// <state>.pt ({"param": the full tensor}): Adam's moments and AdamW(amsgrad=True)'s maximum
// of the second moment. DeepSpeed's universal loader reads every <state>.pt of a folder.
constexpr const char* kMoments[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

// A parameter of the output: its tensors' indices in the source's manifest. A frozen parameter
// (one a param group names, without optimizer state) has no states: its folder holds fp32.pt.
struct UniversalParam {
  std::string name;
  size_t weight = 0;
  std::map<std::string, size_t> states;  // kMoments and "step" stored as tensors
  std::optional<size_t> step_bytes;      // "step" stored as a Python number (a bytes item)
};

// A key of the optimizer's state, "<opt>.state.<param>.<state>": {param, state}.
std::optional<std::pair<std::string, std::string>> StateKey(const std::string& key) {
  const size_t top = key.find('.');
  if (top == std::string::npos || !IsDcpOptimizerState(std::span(&key, 1))) return std::nullopt;
  const std::string_view rest = std::string_view(key).substr(top + 1);
  const size_t last = rest.rfind('.');
  if (!rest.starts_with("state.") || last == std::string_view::npos || last <= 6) {
    return std::nullopt;
  }
  return std::pair{std::string(rest.substr(6, last - 6)), std::string(rest.substr(last + 1))};
}

// The names each param group's "params" bytes item lists ("<opt>.param_groups.<g>.params", a
// list of str as get_state_dict writes it), by group; empty when no group records them.
Result<std::map<int64_t, std::vector<std::string>>> GroupParamNames(const DcpCheckpoint& ckpt) {
  std::map<int64_t, std::vector<std::string>> out;
  for (size_t i = 0; i < ckpt.bytes_items().size(); ++i) {
    const DcpBytesItem& item = ckpt.bytes_items()[i];
    const auto& e = item.path;
    if (e.size() != 4 || !IsDcpOptimizerState(e) || e[1] != "param_groups" || e[3] != "params" ||
        item.path_is_index.size() != 4 || !item.path_is_index[2]) {
      continue;
    }
    int64_t g = 0;
    std::from_chars(e[2].data(), e[2].data() + e[2].size(), g);  // an int's digits
    if (out.contains(g)) continue;                               // per-rank saves repeat items
    std::vector<std::byte> owned;
    RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt.ReadBytesItem(i, owned));
    Result<TorchFile> f = TorchFile::Parse(bytes);
    if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\" (bytes)", item.fqn));
    const PickleTree& t = f->tree();
    const PickleNode& root = t.node(t.root());
    std::vector<std::string>& names = out[g];
    for (const PickleNodeId n : root.items) {
      if (t.node(n).kind != PickleKind::kStr) {
        return FailedPreconditionError(fmt::format(
            "\"{}\": \"{}\" lists something other than parameter names", ckpt.dir(), item.fqn));
      }
      names.push_back(t.node(n).text);
    }
    if (root.kind != PickleKind::kList && root.kind != PickleKind::kTuple) {
      return FailedPreconditionError(
          fmt::format("\"{}\": \"{}\" is not a list of parameter names", ckpt.dir(), item.fqn));
    }
  }
  return out;
}

// The parameters of `ckpt` (whose DcpSource manifest is `m`: names are the DCP keys), by name,
// and the checks that they are one training state the universal checkpoint holds whole.
class DcpParamsPlanner {
 public:
  DcpParamsPlanner(const DcpCheckpoint& ckpt, const Manifest& m,
                   const std::vector<std::string>& drop)
      : ckpt_(ckpt), m_(m), drop_(drop.begin(), drop.end()) {}

  Result<std::vector<UniversalParam>> Plan();

 private:
  bool Dropped(const std::string& key) {
    if (!drop_.contains(key)) return false;
    dropped_.insert(key);
    return true;
  }
  Status CollectStates();
  Status CheckParam(const UniversalParam& p) const;
  Status CheckGroups(const std::vector<UniversalParam>& params,
                     const std::map<int64_t, std::vector<std::string>>& groups) const;

  const DcpCheckpoint& ckpt_;
  const Manifest& m_;
  std::set<std::string> drop_, dropped_;
  std::map<std::string, size_t> by_key_;          // every tensor not dropped
  std::map<std::string, UniversalParam> params_;  // by name: those with optimizer state
  std::set<std::string> unknown_;                 // state keys a universal checkpoint lacks
};

Status DcpParamsPlanner::CollectStates() {
  for (size_t i = 0; i < m_.params.size(); ++i) {
    const std::string& key = m_.params[i].name;
    if (Dropped(key)) continue;
    by_key_.emplace(key, i);
    const auto state = StateKey(key);
    if (!state) continue;
    const std::string& name = state->first;
    const std::string& s = state->second;
    UniversalParam& p = params_[name];
    p.name = name;
    if (s == "step" || std::any_of(std::begin(kMoments), std::end(kMoments),
                                   [&](const char* k) { return s == k; })) {
      p.states[s] = i;
    } else {
      unknown_.insert(key);
    }
  }
  for (size_t i = 0; i < ckpt_.bytes_items().size(); ++i) {
    const std::string& key = ckpt_.bytes_items()[i].fqn;
    const auto state = StateKey(key);
    if (!state || Dropped(key)) continue;
    UniversalParam& p = params_[state->first];
    p.name = state->first;
    if (state->second == "step" && !p.states.contains("step")) {
      p.step_bytes = i;
    } else if (state->second != "step") {
      unknown_.insert(key);
    }
  }
  return Status::Ok();
}

// A parameter with optimizer state: both of Adam's moments, every state fp32 of the weight's
// shape, nothing the universal checkpoint cannot hold.
Status DcpParamsPlanner::CheckParam(const UniversalParam& p) const {
  const std::string& dir = ckpt_.dir();
  const ShardedParam& w = m_.params[p.weight];
  for (const auto& [state, i] : p.states) {
    const ShardedParam& t = m_.params[i];
    if (t.dtype != DType::kF32) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": tensor \"{}\" is {}; a universal checkpoint holds fp32 master weights and "
          "moments",
          dir, t.name, DTypeName(t.dtype)));
    }
    const bool step = state == "step";
    if ((step && t.map.num_elements() != 1) ||
        (!step && t.map.valid_shape() != w.map.valid_shape())) {
      return FailedPreconditionError(
          fmt::format("\"{}\": \"{}\" has the shape {}, but its parameter \"{}\" {}{}", dir, t.name,
                      FormatShape(t.map.valid_shape()), w.name, FormatShape(w.map.valid_shape()),
                      step ? " (a step is one number)" : ""));
    }
  }
  return Status::Ok();
}

// Each parameter with optimizer state in exactly one param group, and every name a group
// lists a tensor of the checkpoint (when the groups record their parameters).
Status DcpParamsPlanner::CheckGroups(
    const std::vector<UniversalParam>& params,
    const std::map<int64_t, std::vector<std::string>>& groups) const {
  if (groups.empty()) return Status::Ok();
  std::map<std::string, int64_t> group_of;
  for (const auto& [g, names] : groups) {
    for (const std::string& name : names) {
      if (const auto [it, fresh] = group_of.emplace(name, g); !fresh) {
        return FailedPreconditionError(
            fmt::format("\"{}\": parameter \"{}\" is in param group {} and again in group {}",
                        ckpt_.dir(), name, it->second, g));
      }
      const bool held = by_key_.contains("model." + name) || by_key_.contains(name);
      if (!held && !drop_.contains("model." + name) && !drop_.contains(name)) {
        return FailedPreconditionError(fmt::format(
            "\"{}\": param group {} lists \"{}\", but the checkpoint has no tensor \"model.{}\" "
            "or \"{}\"",
            ckpt_.dir(), g, name, name, name));
      }
    }
  }
  for (const UniversalParam& p : params) {
    if (!p.states.empty() && !group_of.contains(p.name)) {
      return FailedPreconditionError(
          fmt::format("\"{}\": parameter \"{}\" has optimizer state, but no param group lists it",
                      ckpt_.dir(), p.name));
    }
  }
  return Status::Ok();
}

Result<std::vector<UniversalParam>> DcpParamsPlanner::Plan() {
  const std::string& dir = ckpt_.dir();
  RESHARD_RETURN_IF_ERROR(CollectStates());
  for (const std::string& d : drop_) {
    if (!dropped_.contains(d)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\", asked to be dropped: \"{}\" holds no tensor or state of that key", d, dir));
    }
  }
  std::set<size_t> claimed;
  std::vector<UniversalParam> out;
  for (auto& [name, p] : params_) {
    auto it = by_key_.find("model." + name);
    if (it == by_key_.end()) it = by_key_.find(name);
    if (it == by_key_.end()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": optimizer state of \"{}\" but no model tensor \"model.{}\" or \"{}\"", dir, name,
          name, name));
    }
    if (!p.states.contains("exp_avg") || !p.states.contains("exp_avg_sq")) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": parameter \"{}\" has no exp_avg and exp_avg_sq (Adam's moments)", dir, name));
    }
    p.weight = it->second;
    claimed.insert(it->second);
    RESHARD_RETURN_IF_ERROR(CheckParam(p));
    out.push_back(std::move(p));
  }
  if (!unknown_.empty()) {
    const std::string& key = *unknown_.begin();
    return FailedPreconditionError(fmt::format(
        "\"{}\": optimizer state \"{}\" has no place in a universal checkpoint (a parameter's "
        "folder holds fp32, exp_avg, exp_avg_sq, max_exp_avg_sq and step); dropping \"{}\" by name "
        "leaves it out",
        dir, key, key));
  }
  if (out.empty()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" holds no optimizer state (\"optim.state.<param>.exp_avg\"), which a universal "
        "checkpoint is made of",
        dir));
  }
  const bool stepped = std::any_of(out.begin(), out.end(), [](const UniversalParam& p) {
    return p.states.contains("step") || p.step_bytes;
  });
  for (const UniversalParam& p : out) {
    if (stepped && !p.states.contains("step") && !p.step_bytes) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": parameter \"{}\" has no step (\"optim.state.{}.step\") where the others have "
          "one",
          dir, p.name, p.name));
    }
  }
  RESHARD_ASSIGN_OR_RETURN(const auto groups, GroupParamNames(ckpt_));
  std::set<std::string> listed;
  for (const auto& [g, names] : groups) listed.insert(names.begin(), names.end());
  // The model's other tensors: a frozen parameter (a group lists it) has a folder with its
  // weight alone; anything else (a buffer, a parameter no optimizer holds) cannot be told
  // from a buffer, and has no place in a universal checkpoint.
  for (const auto& [key, i] : by_key_) {
    if (claimed.contains(i) || IsDcpOptimizerState(std::span(&key, 1))) continue;
    const std::string name = key.starts_with("model.") ? key.substr(6) : key;
    const std::string& as_listed = listed.contains(name) ? name : key;
    if (!listed.contains(as_listed)) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": tensor \"{}\" has no optimizer state and no param group lists it (a buffer, "
          "or a parameter the optimizer does not hold): a universal checkpoint holds the "
          "optimizer's parameters only; dropping \"{}\" by name leaves it out",
          dir, key, key));
    }
    if (m_.params[i].dtype != DType::kF32) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": tensor \"{}\" is {}; a universal checkpoint holds fp32 master weights", dir, key,
          DTypeName(m_.params[i].dtype)));
    }
    out.push_back(UniversalParam{as_listed, i, {}, std::nullopt});
  }
  RESHARD_RETURN_IF_ERROR(CheckGroups(out, groups));
  for (const UniversalParam& p : out) {
    if (p.name.empty() || p.name == "." || p.name == ".." ||
        p.name.find('/') != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("parameter \"{}\" cannot name a folder of the universal checkpoint", p.name));
    }
  }
  return out;
}

// A value of a param group: a bytes item's object, a tensor item, or the dict or list that
// the deeper keys of its items nest into ("<opt>.param_groups.<g>.my.a": {"my": {"a": ...}}).
struct GroupValue {
  std::optional<size_t> bytes;       // index into the checkpoint's bytes items
  std::optional<size_t> tensor;      // index into the source's manifest
  bool list = false;                 // children keyed by list index
  std::vector<std::string> keys;     // the children's keys, in the order first seen
  std::vector<GroupValue> children;  // parallel to keys

  GroupValue& Child(const std::string& key, bool index);
};

// The child at `key` (made when new); `index`: the children are a list's items.
GroupValue& GroupValue::Child(const std::string& key, bool index) {
  list = index;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k] == key) return children[k];
  }
  keys.push_back(key);
  return children.emplace_back();
}

// Adds the item at `path[3..]` of group `groups[g]`; false if it clashes with another.
bool AddGroupItem(std::map<int64_t, GroupValue>& groups, std::span<const std::string> path,
                  const std::vector<bool>& is_index, std::optional<size_t> bytes,
                  std::optional<size_t> tensor) {
  int64_t g = 0;
  std::from_chars(path[2].data(), path[2].data() + path[2].size(), g);  // an int's digits
  GroupValue* v = &groups[g];
  for (size_t j = 3; j < path.size(); ++j) {
    if (v->bytes || v->tensor) return false;
    v = &v->Child(path[j], j < is_index.size() && is_index[j]);
  }
  if (!v->children.empty()) return false;
  if (v->bytes || v->tensor) return true;  // per-rank saves repeat items: the first is kept
  v->bytes = bytes;
  v->tensor = tensor;
  return true;
}

// The pickle of a param group's value in `b`.
class GroupValueWriter {
 public:
  GroupValueWriter(std::shared_ptr<const DcpCheckpoint> ckpt, std::shared_ptr<ShardSource> source,
                   bool verify, TorchTreeBuilder& b)
      : ckpt_(std::move(ckpt)), source_(std::move(source)), verify_(verify), b_(b) {
    owned_.resize(ckpt_->bytes_items().size());
    files_.reserve(ckpt_->bytes_items().size());
  }

  Result<PickleNodeId> Write(const GroupValue& v) {
    if (v.bytes) {
      const size_t i = *v.bytes;
      const std::string what = fmt::format("\"{}\" (bytes)", ckpt_->bytes_items()[i].fqn);
      RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt_->ReadBytesItem(i, owned_[i]));
      Result<TorchFile> f = TorchFile::Parse(bytes);
      if (!f.ok()) return f.status().Annotate(what);
      files_.push_back(std::make_unique<TorchFile>(*std::move(f)));
      Result<PickleNodeId> value = b_.Copy(*files_.back(), files_.back()->tree().root());
      if (!value.ok()) return value.status().Annotate(what);
      return *value;
    }
    if (v.tensor) {
      const size_t i = *v.tensor;
      const ShardedParam& t = source_->manifest().params[i];
      return b_.Tensor(t.dtype, t.map.valid_shape(),
                       [source = source_, i, verify = verify_](std::span<std::byte> out) {
                         return FillFull(*source, i, verify, out);
                       });
    }
    std::vector<std::pair<PickleNodeId, PickleNodeId>> entries;
    std::vector<PickleNodeId> items(v.list ? v.children.size() : 0, kNoPickleNode);
    for (size_t j = 0; j < v.children.size(); ++j) {
      const std::string& key = v.keys[j];
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, Write(v.children[j]));
      if (!v.list) {
        entries.emplace_back(b_.Str(key), value);
        continue;
      }
      size_t k = items.size();
      std::from_chars(key.data(), key.data() + key.size(), k);
      if (k >= items.size() || items[k] != kNoPickleNode) {
        return FailedPreconditionError(
            fmt::format("\"{}\": a param group's list has an item at {} among {}", ckpt_->dir(),
                        key, items.size()));
      }
      items[k] = value;
    }
    return v.list ? b_.List(std::move(items)) : b_.Dict(std::move(entries));
  }

 private:
  std::shared_ptr<const DcpCheckpoint> ckpt_;
  std::shared_ptr<ShardSource> source_;
  bool verify_;
  TorchTreeBuilder& b_;
  std::vector<std::vector<std::byte>> owned_;  // the items' bytes, alive until written
  std::vector<std::unique_ptr<TorchFile>> files_;
};

// zero/optimizer_state.pt: {"param_groups": [...]}, each group rebuilt from its items
// "<opt>.param_groups.<g>.<key>[.<deeper keys>]" (get_state_dict's nesting, flattened by DCP):
// a bytes item's value copied as pickled, a tensor item (`lr` as a tensor) as the tensor, and
// deeper keys nested back into their dicts and lists.
UniversalFile OptimizerStateFile(const std::shared_ptr<const DcpCheckpoint>& ckpt,
                                 const std::shared_ptr<ShardSource>& source, bool verify,
                                 std::string name) {
  return {
      std::move(name), 0,
      [ckpt, source, verify](const std::string& path, const TorchWriteOptions& options) -> Status {
        std::map<int64_t, GroupValue> groups;
        const auto in_group = [](const std::vector<std::string>& e, const std::vector<bool>& idx) {
          return e.size() >= 4 && IsDcpOptimizerState(e) && e[1] == "param_groups" &&
                 idx.size() == e.size() && idx[2];
        };
        const auto clash = [&](const std::string& fqn) {
          return FailedPreconditionError(
              fmt::format("\"{}\": \"{}\" clashes with another param group item of that key",
                          ckpt->dir(), fqn));
        };
        for (size_t i = 0; i < ckpt->bytes_items().size(); ++i) {
          const DcpBytesItem& item = ckpt->bytes_items()[i];
          if (!in_group(item.path, item.path_is_index)) continue;
          if (!AddGroupItem(groups, item.path, item.path_is_index, i, std::nullopt)) {
            return clash(item.fqn);
          }
        }
        for (size_t i = 0; i < ckpt->tensors().size(); ++i) {
          const DcpTensor& t = ckpt->tensors()[i];
          if (!in_group(t.path, t.path_is_index)) continue;
          if (!AddGroupItem(groups, t.path, t.path_is_index, std::nullopt, i)) {
            return clash(t.fqn);
          }
        }
        TorchTreeBuilder b;
        GroupValueWriter writer(ckpt, source, verify, b);
        std::vector<PickleNodeId> list;
        for (const auto& [g, group] : groups) {
          RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, writer.Write(group));
          list.push_back(value);
        }
        const PickleNodeId root = b.Dict({{b.Str("param_groups"), b.List(std::move(list))}});
        return b.Write(path, root, options);
      }};
}

// step.pt of a step stored as a Python number (bytes item `i`): the 0-d fp32 tensor torch's
// Adam keeps. FailedPrecondition for anything but a number.
UniversalFile StepFile(const std::shared_ptr<const DcpCheckpoint>& ckpt, size_t i,
                       std::string name) {
  return {std::move(name), 4,
          [ckpt, i](const std::string& path, const TorchWriteOptions& options) -> Status {
            const DcpBytesItem& item = ckpt->bytes_items()[i];
            std::vector<std::byte> owned;
            RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt->ReadBytesItem(i, owned));
            Result<TorchFile> f = TorchFile::Parse(bytes);
            if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\" (bytes)", item.fqn));
            const PickleNode& n = f->tree().node(f->tree().root());
            if (n.kind != PickleKind::kInt && n.kind != PickleKind::kFloat) {
              return FailedPreconditionError(fmt::format(
                  "\"{}\": \"{}\" is neither a tensor nor a number", ckpt->dir(), item.fqn));
            }
            const float step = n.kind == PickleKind::kInt ? static_cast<float>(n.int_value)
                                                          : static_cast<float>(n.float_value);
            TorchTreeBuilder b;
            const PickleNodeId root = b.Tensor(DType::kF32, {}, [step](std::span<std::byte> out) {
              std::memcpy(out.data(), &step, sizeof(step));
              return Status::Ok();
            });
            return b.Write(path, root, options);
          }};
}

// The files, largest first (so the pool ends evenly).
Result<std::vector<UniversalFile>> PlanDcpUniversal(
    const std::shared_ptr<const DcpCheckpoint>& ckpt, const std::shared_ptr<ShardSource>& source,
    const std::string& folder, const CheckpointOptions& options) {
  const bool verify = options.verify_replicas;
  DcpParamsPlanner planner(*ckpt, source->manifest(), options.drop);
  RESHARD_ASSIGN_OR_RETURN(const std::vector<UniversalParam> params, planner.Plan());
  const std::string zero = folder + "/zero";
  std::vector<UniversalFile> files;
  for (const UniversalParam& p : params) {
    files.push_back(TensorFile(source, p.weight, fmt::format("{}/{}/fp32.pt", zero, p.name), true,
                               true, verify));
    for (const auto& [state, i] : p.states) {
      const bool step = state == "step";
      files.push_back(TensorFile(source, i, fmt::format("{}/{}/{}.pt", zero, p.name, state), !step,
                                 false, verify));
    }
    if (p.step_bytes) {
      files.push_back(StepFile(ckpt, *p.step_bytes, fmt::format("{}/{}/step.pt", zero, p.name)));
    }
  }
  files.push_back(OptimizerStateFile(ckpt, source, verify, zero + "/optimizer_state.pt"));
  std::stable_sort(files.begin(), files.end(), [](const UniversalFile& a, const UniversalFile& b) {
    return a.bytes > b.bytes;
  });
  return files;
}

}  // namespace

Status ConvertDcpToUniversal(const std::string& dcp_dir, const std::string& out_dir,
                             const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<std::shared_ptr<const DcpCheckpoint>> opened = DcpCheckpoint::Open(dcp_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  const std::shared_ptr<const DcpCheckpoint> ckpt = *opened;
  std::shared_ptr<ShardSource> source = DcpSource(ckpt);
  std::string base = fs::path(ckpt->dir()).filename().string();
  if (base.empty()) base = fs::path(ckpt->dir()).parent_path().filename().string();
  const std::string folder = base + "_universal";
  // Every process reads the same files, so the plan agrees without a word.
  RESHARD_ASSIGN_OR_RETURN(std::vector<UniversalFile> files,
                           PlanDcpUniversal(ckpt, source, folder, options));
  return WriteUniversalFiles(comm, out_dir, options, source->inputs(), folder, files);
}

}  // namespace reshard
