// Megatron-Core dist-ckpt -> universal checkpoint (ConvertMegatronToUniversal, universal.h).
//
// The output (docs/formats.md, "The universal checkpoint", from a Megatron-Core checkpoint):
//   OUT/latest_universal                                   "<dir name>_universal", no newline
//   OUT/<dir name>_universal/zero/<hf name>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": full tensor}
//   OUT/<dir name>_universal/zero/<hf name>/step.pt        the optimizer's step, a 0-d fp32 tensor
//   OUT/<dir name>_universal/zero/optimizer_state.pt      {"param_groups": [...], "ds_version"}
// The tensors are the Megatron source's (megatron.h) with the optimizer state: each Hugging Face
// tensor "<hf name>" has "<hf name>.fp32", ".exp_avg" and ".exp_avg_sq", each file rebuilt from
// the chunks straight into the writer's buffer, one file per job. The step and the param groups
// come from the pickled common state, common.pt, read by reshard's pickle reader (no pickle code
// runs): Megatron's distributed optimizer keeps them at optimizer.optimizer.param_groups (a
// chain of optimizers: optimizer.<i>.optimizer.param_groups), each group with its "step".
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_file.h"
#include "reshard/io/torch_writer.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStates[] = {"fp32", "exp_avg", "exp_avg_sq"};

// The files, largest first: per Hugging Face tensor with optimizer state, its three states; per
// one without (a frozen parameter), its weight as fp32.pt alone.
Result<std::vector<UniversalFile>> PlanMegatronUniversal(const std::shared_ptr<ShardSource>& source,
                                                         const std::string& folder,
                                                         const std::string& dir, bool verify) {
  const Manifest& m = source->manifest();
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < m.params.size(); ++i) by_name.emplace(m.params[i].name, i);
  const auto is_state = [&](const std::string& name) {
    return std::any_of(std::begin(kStates), std::end(kStates), [&](const char* s) {
      const std::string suffix = std::string(".") + s;
      return name.ends_with(suffix) &&
             by_name.contains(name.substr(0, name.size() - suffix.size()));
    });
  };
  std::vector<UniversalFile> files;
  size_t stateful = 0;
  for (size_t j = 0; j < m.params.size(); ++j) {
    const ShardedParam& p = m.params[j];
    if (is_state(p.name)) continue;
    if (!by_name.contains(p.name + ".fp32")) {
      const DType d = p.dtype;
      if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
        return FailedPreconditionError(fmt::format(
            "\"{}\": \"{}\" (without optimizer state) is {}; a universal checkpoint holds fp32 "
            "weights",
            dir, p.name, DTypeName(d)));
      }
      // A frozen parameter: fp32.pt alone, its weight widened.
      files.push_back(Fp32TensorFile(source, j, fmt::format("{}/zero/{}/fp32.pt", folder, p.name),
                                     true, verify));
      continue;
    }
    ++stateful;
    for (const char* state : kStates) {
      const size_t i = by_name.at(fmt::format("{}.{}", p.name, state));
      if (m.params[i].dtype != DType::kF32) {
        return FailedPreconditionError(fmt::format(
            "\"{}\": the {} of \"{}\" is {}; a universal checkpoint holds fp32 main weights and "
            "moments",
            dir, state, p.name, DTypeName(m.params[i].dtype)));
      }
      const bool fp32 = std::string_view(state) == "fp32";
      files.push_back(TensorFile(source, i, fmt::format("{}/zero/{}/{}.pt", folder, p.name, state),
                                 true, fp32, verify));
    }
  }
  if (stateful == 0) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" holds no distributed-optimizer state (\"optimizer.state.exp_avg.<key>\"), which a "
        "universal checkpoint is made of",
        dir));
  }
  std::stable_sort(files.begin(), files.end(), [](const UniversalFile& a, const UniversalFile& b) {
    return a.bytes > b.bytes;
  });
  return files;
}

// The param groups of a Megatron checkpoint's common.pt, in the chain's order.
struct MegatronCommon {
  std::string path;
  std::shared_ptr<const TorchFile> file;
  std::vector<PickleNodeId> groups;
  float step = 0;
};

// Reads `dir`/common.pt: nullopt without the file. InvalidArgument, naming it, for a file
// without param groups or whose groups disagree on the step.
Result<std::optional<MegatronCommon>> ReadMegatronCommon(const std::string& dir) {
  MegatronCommon c;
  c.path = (fs::path(dir) / "common.pt").string();
  std::error_code ec;
  if (!fs::is_regular_file(c.path, ec)) return std::optional<MegatronCommon>();
  Result<TorchFile> f = TorchFile::Open(c.path);
  if (!f.ok()) return f.status().Annotate(fmt::format("\"{}\"", c.path));
  c.file = std::make_shared<const TorchFile>(*std::move(f));
  const PickleTree& t = c.file->tree();
  const PickleNodeId optimizer = internal::Get(t, t.root(), "optimizer");
  std::vector<PickleNodeId> optimizers;
  if (optimizer != kNoPickleNode && t.node(optimizer).kind == PickleKind::kDict) {
    if (internal::Get(t, optimizer, "param_groups") != kNoPickleNode) {
      optimizers.push_back(optimizer);
    } else if (const PickleNodeId inner = internal::Get(t, optimizer, "optimizer");
               inner != kNoPickleNode) {
      optimizers.push_back(inner);
    } else {  // a chain: {0: {"optimizer": ...}, 1: ...}
      for (const auto& [k, v] : t.node(optimizer).entries) {
        const PickleNodeId link = internal::Get(t, v, "optimizer");
        if (link != kNoPickleNode) optimizers.push_back(link);
      }
    }
  }
  for (const PickleNodeId o : optimizers) {
    const PickleNodeId groups = internal::Get(t, o, "param_groups");
    if (groups == kNoPickleNode || t.node(groups).kind != PickleKind::kList) continue;
    for (const PickleNodeId g : t.node(groups).items) c.groups.push_back(g);
  }
  if (c.groups.empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds no optimizer param_groups (at \"optimizer.optimizer.param_groups\")",
        c.path));
  }
  for (size_t g = 0; g < c.groups.size(); ++g) {
    const PickleNodeId step = internal::Get(t, c.groups[g], "step");
    const PickleNode* n = step == kNoPickleNode ? nullptr : &t.node(step);
    if (n == nullptr || (n->kind != PickleKind::kInt && n->kind != PickleKind::kFloat)) {
      return InvalidArgumentError(
          fmt::format("\"{}\": param_groups[{}] holds no step (a number)", c.path, g));
    }
    const float value = n->kind == PickleKind::kInt ? static_cast<float>(n->int_value)
                                                    : static_cast<float>(n->float_value);
    if (g > 0 && value != c.step) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": param_groups[{}] is at step {}, param_groups[0] at step {}: a universal "
          "checkpoint holds one step",
          c.path, g, value, c.step));
    }
    c.step = value;
  }
  return std::optional<MegatronCommon>(std::move(c));
}

// zero/<param>/step.pt: the step as torch's Adam keeps it, a 0-d fp32 tensor.
UniversalFile StepFile(float step, std::string name) {
  return {std::move(name), sizeof(float),
          [step](const std::string& path, const TorchWriteOptions& options) -> Status {
            TorchTreeBuilder b;
            const PickleNodeId t = b.Tensor(DType::kF32, {}, [step](std::span<std::byte> out) {
              std::memcpy(out.data(), &step, sizeof(step));
              return Status::Ok();
            });
            return b.Write(path, t, options);
          }};
}

// zero/optimizer_state.pt: {"param_groups": Megatron's groups copied as pickled,
// "ds_version"}, the global state DeepSpeed's universal loader asserts (ZeRO 1/2).
UniversalFile MegatronOptimizerStateFile(const std::shared_ptr<const MegatronCommon>& common,
                                         std::string name) {
  return {std::move(name), 0,
          [common](const std::string& path, const TorchWriteOptions& options) -> Status {
            TorchTreeBuilder b;
            std::vector<PickleNodeId> groups;
            for (const PickleNodeId g : common->groups) {
              Result<PickleNodeId> copied = b.Copy(*common->file, g);
              if (!copied.ok())
                return copied.status().Annotate(fmt::format("\"{}\"", common->path));
              groups.push_back(*copied);
            }
            const PickleNodeId root =
                b.Dict({{b.Str("param_groups"), b.List(std::move(groups))},
                        {b.Str("ds_version"), b.Str(std::string(kUniversalDsVersion))}});
            return b.Write(path, root, options);
          }};
}

}  // namespace

Status ConvertMegatronToUniversal(const std::string& path, const std::string& config_path,
                                  const std::string& out_dir,
                                  const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<std::string> dir = MegatronCheckpointDir(path);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, dir.status()));
  Result<std::string> config =
      config_path.empty() ? Result<std::string>(std::string()) : ReadFileToString(config_path);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, config.status()));
  MegatronSourceOptions source_options{*config, config_path, true};
  source_options.stateless_parameters = true;  // a frozen parameter: fp32.pt alone
  Result<std::unique_ptr<ShardSource>> opened = OpenMegatronSource(path, source_options);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  std::shared_ptr<ShardSource> source = *std::move(opened);
  std::string base = fs::path(*dir).filename().string();
  if (base.empty()) base = fs::path(*dir).parent_path().filename().string();
  const std::string folder = base + "_universal";
  // Every process reads the same files, so the plan agrees without a word.
  RESHARD_ASSIGN_OR_RETURN(std::vector<UniversalFile> files,
                           PlanMegatronUniversal(source, folder, *dir, options.verify_replicas));
  RESHARD_ASSIGN_OR_RETURN(std::optional<MegatronCommon> common, ReadMegatronCommon(*dir));
  std::vector<std::string> inputs = source->inputs();
  if (common) {
    auto shared = std::make_shared<const MegatronCommon>(*std::move(common));
    std::set<std::string> params;  // those with optimizer state: a frozen one has no step
    for (const UniversalFile& f : files) {
      if (fs::path(f.name).filename() == "exp_avg.pt")
        params.insert(fs::path(f.name).parent_path().string());  // <folder>/zero/<param>
    }
    for (const std::string& p : params) files.push_back(StepFile(shared->step, p + "/step.pt"));
    files.push_back(MegatronOptimizerStateFile(shared, folder + "/zero/optimizer_state.pt"));
    inputs.push_back(shared->path);
  }
  return WriteUniversalFiles(comm, out_dir, options, inputs, folder, files);
}

}  // namespace reshard
