// What scatter (scatter.cc), gather (gather.cc) and convert (convert.cc) share: the sources
// of sharded and full directories, the plan of the files an output is written as, and the
// writing of a sharded directory (every rank's files, then the manifest, then the commit).
// Internal to the checkpoint library; the operations' interface is checkpoint_ops.h.
#ifndef RESHARD_CHECKPOINT_SHARDED_IO_H_
#define RESHARD_CHECKPOINT_SHARDED_IO_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"

namespace reshard::internal {

bool IsPowerOfTwo(double x);

// Warns about a parameter held at a scale that is not a power of two (scatter and gather
// apply it; the values are rounded).
void WarnAboutScales(const CheckpointOptions& options, const ShardedParam& p, const char* verb);

uint64_t ElementBytes(Index elements, DType dtype);

// The bytes of every copy of `p`'s replicated pieces: what comparing its replicas reads.
uint64_t ReplicaBytes(const ShardedParam& p);

// Splits items of `sizes` (bytes), in order, into consecutive parts of at most `max_bytes`
// (0: one part); an item larger than that gets a part of its own. Returns the items' indices.
std::vector<std::vector<size_t>> SplitIntoParts(std::span<const uint64_t> sizes,
                                                uint64_t max_bytes);

// One output file: its name, the rank whose shard it holds (sharded outputs), the parameters
// it holds (indices into the manifest: full outputs) or its rank tensors (sharded outputs), and
// their bytes.
struct OutputFile {
  std::string name;
  Rank rank = 0;
  std::vector<size_t> params;
  uint64_t bytes = 0;
  std::vector<RankTensor> tensors;
};

// The files of a sharded output: model-rank-{r}-part-{p}.safetensors for every rank, holding
// its rank tensors (parameters' own shards and buffers).
std::vector<OutputFile> ShardedFiles(const Manifest& m, uint64_t max_bytes);

// Copies the valid region of a padded F (logical shape) to or from a dense tensor of the
// valid shape.
Status CopyValidRegion(const ParamMap& map, DType dtype, const std::byte* src, std::byte* dst,
                       bool padded_to_valid, int num_threads);

ExecOptions ExecOptionsFor(const CheckpointOptions& options, int scale_power);

// What this process reads and writes, counted by its writer threads.
struct Counters {
  std::atomic<uint64_t> read{0};
  std::atomic<uint64_t> verified{0};
  std::atomic<uint64_t> copied{0};  // by the file system (copy_file_range)
};

// Writes the files of `files` that `owners` gives this process; write(k) writes file k.
Status WriteOwnFiles(Communicator& comm, const std::vector<OutputFile>& files,
                     const std::vector<int>& owners, int num_threads, ProcessStats& mine,
                     const std::function<Status(const OutputFile&)>& write);

// The process that writes each file: the files' bytes balanced over `processes`.
std::vector<int> OwnersOf(const std::vector<OutputFile>& files, int processes);

// Produces parameter `param`'s shard of rank `rank` straight into the writer's buffer.
using ShardFill = std::function<Status(size_t param, Rank rank, std::span<std::byte> buffer)>;

// Where rank `rank`'s shard of parameter `param` is bytes of an input file unchanged: those
// ranges, each with its byte offset in the rank's tensor; nullopt where it is not.
using PlacedRange = std::pair<uint64_t, FileRange>;
using ShardRanges = std::function<std::optional<std::vector<PlacedRange>>(size_t param, Rank rank)>;

// Writes a sharded checkpoint: every file of every rank (files in parallel; across processes,
// each process those `owners` gives it), one tensor per parameter of `manifest`, each produced
// by `fill` straight into the writer's buffer, or copied from input files where `ranges` says
// a rank tensor is their bytes unchanged; then the manifest, then the commit. The manifest's
// file lists are filled in. `inputs` are what the run reads, the first the source directory
// (its model side files are kept).
Status WriteSharded(const std::string& out_dir, std::span<const std::string> inputs,
                    Manifest& manifest, const CheckpointOptions& options,
                    const std::vector<OutputFile>& files, const std::vector<int>& owners,
                    Counters& counters, const ShardFill& fill, const ShardRanges& ranges = {});

}  // namespace reshard::internal

#endif  // RESHARD_CHECKPOINT_SHARDED_IO_H_
