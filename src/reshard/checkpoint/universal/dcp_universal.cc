// PyTorch Distributed Checkpoint -> universal checkpoint (ConvertDcpToUniversal, universal.h).
//
// The output (docs/formats.md, "The universal checkpoint", from a DCP checkpoint):
//   OUT/latest_universal                     "<dir name>_universal", no newline
//   OUT/<dir name>_universal/zero/optimizer_state.pt   {"param_groups": [...]}
//   OUT/<dir name>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": full tensor}
//   OUT/<dir name>_universal/zero/<param>/step.pt      the optimizer's step, a bare tensor
// A parameter is a name P with optimizer state "<opt>.state.<P>.<state>" (get_state_dict's
// nesting, or TorchTitan's flattened keys: the same dotted key) and a model tensor "model.<P>"
// or "<P>". Each file is one job; a state file rebuilds the full tensor from the chunks
// straight into the writer's buffer. Under several processes each writes its share of the
// files into the temporary directory process 0 made, and process 0 commits.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
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

// The optimizer's states a universal checkpoint holds, named as in both (torch's Adam and the
// universal files: <state>.pt).
constexpr const char* kStates[] = {"exp_avg", "exp_avg_sq", "step"};

// A parameter of the output: its tensors' indices in the source's manifest.
struct UniversalParam {
  std::string name;
  size_t weight = 0;
  std::map<std::string, size_t> states;  // "exp_avg", "exp_avg_sq", "step"
};

// The parameters of `m` (DcpSource's manifest: names are the DCP keys) that have optimizer
// state, by name. FailedPrecondition for state without a model tensor, or a parameter
// without moments.
Result<std::vector<UniversalParam>> DcpParams(const Manifest& m, const std::string& dir) {
  std::map<std::string, size_t> by_key;
  for (size_t i = 0; i < m.params.size(); ++i) by_key.emplace(m.params[i].name, i);
  std::map<std::string, UniversalParam> params;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const std::string& key = m.params[i].name;
    const size_t top = key.find('.');
    if (top == std::string::npos || !IsDcpOptimizerState(std::span(&key, 1))) continue;
    const std::string_view rest = std::string_view(key).substr(top + 1);
    const size_t last = rest.rfind('.');
    if (!rest.starts_with("state.") || last == std::string_view::npos || last <= 6) continue;
    const std::string state(rest.substr(last + 1));
    if (std::none_of(std::begin(kStates), std::end(kStates),
                     [&](const char* s) { return state == s; })) {
      continue;
    }
    const std::string name(rest.substr(6, last - 6));
    UniversalParam& p = params[name];
    p.name = name;
    p.states[state] = i;
  }
  std::vector<UniversalParam> out;
  for (auto& [name, p] : params) {
    auto it = by_key.find("model." + name);
    if (it == by_key.end()) it = by_key.find(name);
    if (it == by_key.end()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": optimizer state of \"{}\" but no model tensor \"model.{}\" or \"{}\"", dir, name,
          name, name));
    }
    if (!p.states.contains("exp_avg") || !p.states.contains("exp_avg_sq")) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": parameter \"{}\" has no exp_avg and exp_avg_sq (Adam's moments)", dir, name));
    }
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("parameter \"{}\" cannot name a folder of the universal checkpoint", name));
    }
    p.weight = it->second;
    out.push_back(std::move(p));
  }
  if (out.empty()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" holds no optimizer state (\"optim.state.<param>.exp_avg\"), which a universal "
        "checkpoint is made of",
        dir));
  }
  return out;
}

// zero/optimizer_state.pt: {"param_groups": [...]}, the groups rebuilt from the bytes items
// "<opt>.param_groups.<g>.<key>" (get_state_dict's nesting), each value copied as pickled.
UniversalFile OptimizerStateFile(const std::shared_ptr<const DcpCheckpoint>& ckpt,
                                 std::string name) {
  return {std::move(name), 0,
          [ckpt](const std::string& path, const TorchWriteOptions& options) -> Status {
            std::map<int64_t, std::vector<std::pair<std::string, size_t>>> groups;
            std::set<std::pair<int64_t, std::string>> seen;  // per-rank saves repeat items
            for (size_t i = 0; i < ckpt->bytes_items().size(); ++i) {
              const DcpBytesItem& item = ckpt->bytes_items()[i];
              const auto& e = item.path;
              if (e.size() != 4 || !IsDcpOptimizerState(item.path) || e[1] != "param_groups" ||
                  item.path_is_index.size() != 4 || !item.path_is_index[2]) {
                continue;
              }
              int64_t g = 0;
              std::from_chars(e[2].data(), e[2].data() + e[2].size(), g);  // an int's digits
              if (seen.emplace(g, e[3]).second) groups[g].emplace_back(e[3], i);
            }
            std::vector<TorchFile> files;  // the items' archives, alive until written
            files.reserve(ckpt->bytes_items().size());
            std::vector<std::vector<std::byte>> owned(ckpt->bytes_items().size());
            TorchTreeBuilder b;
            std::vector<PickleNodeId> list;
            for (const auto& [g, entries] : groups) {
              const PickleNodeId group = b.Dict();
              for (const auto& [key, i] : entries) {
                const std::string what = fmt::format("\"{}\" (bytes)", ckpt->bytes_items()[i].fqn);
                RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt->ReadBytesItem(i, owned[i]));
                Result<TorchFile> f = TorchFile::Parse(bytes);
                if (!f.ok()) return f.status().Annotate(what);
                files.push_back(*std::move(f));
                Result<PickleNodeId> value = b.Copy(files.back(), files.back().tree().root());
                if (!value.ok()) return value.status().Annotate(what);
                b.Insert(group, b.Str(key), *value);
              }
              list.push_back(group);
            }
            const PickleNodeId root = b.Dict({{b.Str("param_groups"), b.List(std::move(list))}});
            return b.Write(path, root, options);
          }};
}

// The files, largest first (so the pool ends evenly).
Result<std::vector<UniversalFile>> PlanDcpUniversal(
    const std::shared_ptr<const DcpCheckpoint>& ckpt, const std::shared_ptr<ShardSource>& source,
    const std::string& folder, bool verify) {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<UniversalParam> params,
                           DcpParams(source->manifest(), ckpt->dir()));
  const std::string zero = folder + "/zero";
  std::vector<UniversalFile> files;
  for (const UniversalParam& p : params) {
    for (const size_t i : {p.weight, p.states.at("exp_avg"), p.states.at("exp_avg_sq")}) {
      const ShardedParam& t = source->manifest().params[i];
      if (t.dtype != DType::kF32) {
        return FailedPreconditionError(fmt::format(
            "\"{}\": tensor \"{}\" is {}; a universal checkpoint holds fp32 master weights and "
            "moments",
            ckpt->dir(), t.name, DTypeName(t.dtype)));
      }
    }
    files.push_back(TensorFile(source, p.weight, fmt::format("{}/{}/fp32.pt", zero, p.name), true,
                               true, verify));
    for (const char* state : kStates) {
      const auto it = p.states.find(state);
      if (it == p.states.end()) continue;
      const bool step = std::string_view(state) == "step";
      files.push_back(TensorFile(source, it->second,
                                 fmt::format("{}/{}/{}.pt", zero, p.name, state), !step, false,
                                 verify));
    }
  }
  files.push_back(OptimizerStateFile(ckpt, zero + "/optimizer_state.pt"));
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
                           PlanDcpUniversal(ckpt, source, folder, options.verify_replicas));
  return WriteUniversalFiles(comm, out_dir, options, source->inputs(), folder, files);
}

}  // namespace reshard
