// Megatron-Core dist-ckpt -> universal checkpoint (ConvertMegatronToUniversal, universal.h).
//
// The output (docs/formats.md, "The universal checkpoint", from a Megatron-Core checkpoint):
//   OUT/latest_universal                                   "<dir name>_universal", no newline
//   OUT/<dir name>_universal/zero/<hf name>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": full tensor}
// The tensors are the Megatron source's (megatron.h) with the optimizer state: each Hugging Face
// tensor "<hf name>" has "<hf name>.fp32", ".exp_avg" and ".exp_avg_sq", each file rebuilt from
// the chunks straight into the writer's buffer, one file per job.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/io/file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStates[] = {"fp32", "exp_avg", "exp_avg_sq"};

// The files, largest first: per Hugging Face tensor with optimizer state, its three states.
Result<std::vector<UniversalFile>> PlanMegatronUniversal(const std::shared_ptr<ShardSource>& source,
                                                         const std::string& folder,
                                                         const std::string& dir, bool verify) {
  const Manifest& m = source->manifest();
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < m.params.size(); ++i) by_name.emplace(m.params[i].name, i);
  std::vector<UniversalFile> files;
  for (const ShardedParam& p : m.params) {
    if (!by_name.contains(p.name + ".fp32")) continue;  // a state itself, or no state
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
  if (files.empty()) {
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
  Result<std::unique_ptr<ShardSource>> opened =
      OpenMegatronSource(path, MegatronSourceOptions{*config, config_path, true});
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  std::shared_ptr<ShardSource> source = *std::move(opened);
  std::string base = fs::path(*dir).filename().string();
  if (base.empty()) base = fs::path(*dir).parent_path().filename().string();
  const std::string folder = base + "_universal";
  // Every process reads the same files, so the plan agrees without a word.
  RESHARD_ASSIGN_OR_RETURN(std::vector<UniversalFile> files,
                           PlanMegatronUniversal(source, folder, *dir, options.verify_replicas));
  return WriteUniversalFiles(comm, out_dir, options, source->inputs(), folder, files);
}

}  // namespace reshard
