// Orbax checkpoint -> universal checkpoint (ConvertOrbaxToUniversal, universal.h).
//
// The output (docs/formats.md, "The universal checkpoint", from an Orbax checkpoint):
//   OUT/latest_universal                                 "<dir name>_universal", no newline
//   OUT/<dir>_universal/zero/<param>/fp32.pt             {"param": the full fp32 tensor}
//   OUT/<dir>_universal/zero/<param>/{exp_avg,exp_avg_sq}.pt   optax's mu and nu, likewise
//   OUT/<dir>_universal/zero/<param>/step.pt             the count beside mu, a 0-d fp32 tensor
//   OUT/<dir>_universal/zero/optimizer_state.pt          {"param_groups": [{"params": names}],
//                                                         "ds_version"}
// The moments are the Orbax source's (FindOrbaxMoments: "<param>.exp_avg", "<param>.exp_avg_sq");
// each file is read from the zarr chunks straight into the writer's buffer, one file per job.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/io/torch_writer.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

bool IsFp32Widenable(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// step.pt: the integer count (a 0-d array, parameter `i` of `source`) as torch's Adam keeps its
// step, a 0-d fp32 tensor.
UniversalFile CountStepFile(const std::shared_ptr<ShardSource>& source, size_t i,
                            std::string name) {
  return {std::move(name), sizeof(float),
          [source, i](const std::string& path, const TorchWriteOptions& options) -> Status {
            const ShardedParam& c = source->manifest().params[i];
            std::byte bytes[8] = {};
            RESHARD_RETURN_IF_ERROR(
                source->ReadRegion(i, {}, {}, std::span(bytes, DTypeSize(c.dtype)), 1));
            double value = 0;
            if (c.dtype == DType::kI32) {
              int32_t v = 0;
              std::memcpy(&v, bytes, 4);
              value = v;
            } else if (c.dtype == DType::kI64) {
              int64_t v = 0;
              std::memcpy(&v, bytes, 8);
              value = static_cast<double>(v);
            } else if (c.dtype == DType::kU32) {
              uint32_t v = 0;
              std::memcpy(&v, bytes, 4);
              value = v;
            } else {
              return FailedPreconditionError(
                  fmt::format("\"{}\" is {}, not a step count", c.name, DTypeName(c.dtype)));
            }
            const auto step = static_cast<float>(value);
            TorchTreeBuilder b;
            const PickleNodeId t = b.Tensor(DType::kF32, {}, [step](std::span<std::byte> out) {
              std::memcpy(out.data(), &step, sizeof(step));
              return Status::Ok();
            });
            return b.Write(path, t, options);
          }};
}

// zero/optimizer_state.pt: one param group listing the parameters, and the DeepSpeed release
// whose layout the folder follows (what DeepSpeed's universal loader asserts). optax's state
// holds no hyperparameters to give the group.
UniversalFile GroupsFile(std::vector<std::string> names, std::string name) {
  return {std::move(name), 0,
          [names = std::move(names)](const std::string& path,
                                     const TorchWriteOptions& options) -> Status {
            TorchTreeBuilder b;
            std::vector<PickleNodeId> params;
            for (const std::string& n : names) params.push_back(b.Str(n));
            const PickleNodeId group = b.Dict({{b.Str("params"), b.List(std::move(params))}});
            const PickleNodeId root =
                b.Dict({{b.Str("param_groups"), b.List({group})},
                        {b.Str("ds_version"), b.Str(std::string(kUniversalDsVersion))}});
            return b.Write(path, root, options);
          }};
}

// The files, largest first.
Result<std::vector<UniversalFile>> PlanOrbaxUniversal(const OrbaxCheckpoint& ckpt,
                                                      const std::shared_ptr<ShardSource>& source,
                                                      const std::string& folder,
                                                      const CheckpointOptions& options) {
  const std::vector<OrbaxArray>& arrays = ckpt.arrays();
  const std::string& dir = ckpt.path();
  const std::set<std::string> drop(options.drop.begin(), options.drop.end());
  for (const std::string& d : drop) {
    if (std::none_of(arrays.begin(), arrays.end(),
                     [&](const OrbaxArray& a) { return a.name == d; })) {
      return InvalidArgumentError(
          fmt::format("\"{}\", asked to be dropped: \"{}\" holds no array of that name", d, dir));
    }
  }
  const OrbaxMoments found = FindOrbaxMoments(ckpt);
  // Per model array, its moments' arrays by state ("exp_avg", "exp_avg_sq").
  std::map<size_t, std::map<std::string, size_t>> states;
  for (const auto& [m, of] : found.moments) {
    if (!drop.contains(arrays[m].name)) states[of.first][of.second] = m;
  }
  std::set<size_t> used;
  std::vector<UniversalFile> files;
  std::vector<std::string> names;
  const bool verify = options.verify_replicas;
  const auto refuse = [&](const OrbaxArray& a, std::string_view why) {
    return FailedPreconditionError(fmt::format(
        "\"{}\": \"{}\" ({} {}) {}: a universal checkpoint has no file for it; dropping \"{}\" "
        "by name leaves it out",
        dir, a.name, DTypeName(a.zarr.dtype), FormatShape(a.zarr.shape), why, a.name));
  };
  for (size_t j = 0; j < arrays.size(); ++j) {
    const OrbaxArray& a = arrays[j];
    if (a.optimizer_state || drop.contains(a.name)) continue;
    if (a.name.empty() || a.name.find('/') != std::string::npos) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": \"{}\" cannot name a folder of the universal checkpoint", dir, a.name));
    }
    const std::string zero = fmt::format("{}/zero/{}", folder, a.name);
    if (!IsFp32Widenable(a.zarr.dtype)) {
      return refuse(a, "is not a floating-point parameter (fp32, bf16 or f16)");
    }
    const auto it = states.find(j);
    const size_t n = it == states.end() ? 0 : it->second.size();
    if (n == 1) {
      return FailedPreconditionError(
          fmt::format("\"{}\": \"{}\" has one of Adam's moments (\"{}\") without the other", dir,
                      a.name, arrays[it->second.begin()->second].name));
    }
    names.push_back(a.name);
    files.push_back(Fp32TensorFile(source, j, zero + "/fp32.pt", true, verify));
    if (n == 0) continue;  // a frozen parameter: fp32.pt alone
    for (const auto& [state, m] : it->second) {
      if (!IsFp32Widenable(arrays[m].zarr.dtype)) {
        return FailedPreconditionError(fmt::format("\"{}\": the {} of \"{}\" (\"{}\") is {}", dir,
                                                   state, a.name, arrays[m].name,
                                                   DTypeName(arrays[m].zarr.dtype)));
      }
      used.insert(m);
      files.push_back(
          Fp32TensorFile(source, m, fmt::format("{}/{}.pt", zero, state), false, verify));
    }
    if (const auto count = found.counts.find(j);
        count != found.counts.end() && !drop.contains(arrays[count->second].name)) {
      used.insert(count->second);
      files.push_back(CountStepFile(source, count->second, zero + "/step.pt"));
    }
  }
  if (states.empty()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" holds no optimizer moments (optax's mu and nu, matched to the model's arrays), "
        "which a universal checkpoint is made of",
        dir));
  }
  for (size_t j = 0; j < arrays.size(); ++j) {
    const OrbaxArray& a = arrays[j];
    if (a.optimizer_state && !used.contains(j) && !drop.contains(a.name)) {
      return refuse(a, "is optimizer state other than Adam's moments and their count");
    }
  }
  files.push_back(GroupsFile(std::move(names), folder + "/zero/optimizer_state.pt"));
  std::stable_sort(files.begin(), files.end(), [](const UniversalFile& a, const UniversalFile& b) {
    return a.bytes > b.bytes;
  });
  return files;
}

}  // namespace

Status ConvertOrbaxToUniversal(const std::string& path, const std::string& out_dir,
                               const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<std::shared_ptr<const OrbaxCheckpoint>> opened = OrbaxCheckpoint::Open(path);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  const std::shared_ptr<const OrbaxCheckpoint> ckpt = *opened;
  // Every array, in the checkpoint's order: parameter i of the source is arrays()[i].
  std::shared_ptr<ShardSource> source = OrbaxSource(ckpt, false);
  std::string base = fs::path(path).filename().string();
  if (base.empty()) base = fs::path(path).parent_path().filename().string();
  const std::string folder = base + "_universal";
  RESHARD_ASSIGN_OR_RETURN(std::vector<UniversalFile> files,
                           PlanOrbaxUniversal(*ckpt, source, folder, options));
  return WriteUniversalFiles(comm, out_dir, options, source->inputs(), folder, files);
}

}  // namespace reshard
