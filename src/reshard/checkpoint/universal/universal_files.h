// The universal checkpoint's files, written by several processes: each output file a job of
// its own (its name, size and how it is written), the folders made once, the files shared out
// by size, and the commit with OUT/latest_universal. Internal to checkpoint/universal/.
#ifndef RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_FILES_H_
#define RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_FILES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/status.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/io/torch_writer.h"

namespace reshard {

// The "ds_version" of the optimizer_state.pt written where no DeepSpeed run records one (from
// Megatron): the DeepSpeed release whose universal layout the folder follows (docs/formats.md).
inline constexpr std::string_view kUniversalDsVersion = "0.19.8";

// One output file: its name (relative to the output), size in bytes, and how it is written
// to `path` (the options of a torch.save file there).
struct UniversalFile {
  std::string name;
  uint64_t bytes = 0;
  std::function<Status(const std::string& path, const TorchWriteOptions& options)> write;
};

// A full tensor of parameter `i` of `source` (its own dtype) rebuilt into `out`, replicas
// compared when `verify`.
Status FillFull(ShardSource& source, size_t i, bool verify, std::span<std::byte> out);

// A file of tensor `i` of `source` rebuilt whole (its chunks straight into the writer's buffer,
// replicas compared when `verify`): {"param": tensor} when `in_dict` (with requires_grad, as
// DeepSpeed saves fp32.pt), else the bare tensor (step.pt).
UniversalFile TensorFile(std::shared_ptr<ShardSource> source, size_t i, std::string name,
                         bool in_dict, bool requires_grad, bool verify);

// {"param": tensor `i` of `source` rebuilt whole as fp32}: an fp32 tensor as it is, a bf16 or f16
// one widened (exactly: their values are fp32 values); with requires_grad when `requires_grad`
// (fp32.pt). The caller checks the dtype is one of those three.
UniversalFile Fp32TensorFile(std::shared_ptr<ShardSource> source, size_t i, std::string name,
                             bool requires_grad, bool verify);

// How every universal file is saved: without syncing each file, its writeback started as it
// is closed (when the options sync), all synced before the commit.
TorchWriteOptions WriteOptionsFor(const std::string& path, const CheckpointOptions& options);

// Writes `files` into `out_dir` with OUT/`pointer` (latest_universal; a DeepSpeed save dir's
// `latest`) naming `folder`: process 0 makes the
// folders, each process writes the files BalanceByBytes gives it (a thread per file), and
// process 0 commits once all have succeeded. `inputs` are the files the output must not
// replace.
Status WriteUniversalFiles(Communicator& comm, const std::string& out_dir,
                           const CheckpointOptions& options, const std::vector<std::string>& inputs,
                           const std::string& folder, const std::vector<UniversalFile>& files,
                           const std::string& pointer = "latest_universal");

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_UNIVERSAL_UNIVERSAL_FILES_H_
