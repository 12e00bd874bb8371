#include "reshard/checkpoint/universal/universal_files.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"

namespace reshard {

namespace fs = std::filesystem;

Status FillFull(ShardSource& source, size_t i, bool verify, std::span<std::byte> out) {
  const ShardedParam& p = source.manifest().params[i];
  if (source.ReadsRegions()) {
    const Shape& shape = p.map.valid_shape();
    return source.ReadRegion(i, Shape(shape.size(), 0), shape, out, 1)
        .Annotate(fmt::format("tensor \"{}\"", p.name));
  }
  AcquiredShards shards(source, i);
  RESHARD_RETURN_IF_ERROR(shards.status());
  ExecOptions e;
  e.verify_replicas = verify;
  e.num_threads = 1;  // one file per thread already
  return Rebuild(p.map, p.dtype, shards.shards(), {out.data(), p.map.num_elements()}, e)
      .Annotate(fmt::format("tensor \"{}\"", p.name));
}

UniversalFile TensorFile(std::shared_ptr<ShardSource> source, size_t i, std::string name,
                         bool in_dict, bool requires_grad, bool verify) {
  const ShardedParam& p = source->manifest().params[i];
  const uint64_t bytes = static_cast<uint64_t>(p.map.num_elements()) * DTypeSize(p.dtype);
  return {std::move(name), bytes,
          [source, i, in_dict, requires_grad, verify](const std::string& path,
                                                      const TorchWriteOptions& options) -> Status {
            const ShardedParam& t = source->manifest().params[i];
            TorchTreeBuilder b;
            const PickleNodeId tensor = b.Tensor(
                t.dtype, t.map.valid_shape(),
                [&](std::span<std::byte> out) { return FillFull(*source, i, verify, out); },
                requires_grad);
            const PickleNodeId root = in_dict ? b.Dict({{b.Str("param"), tensor}}) : tensor;
            return b.Write(path, root, options);
          }};
}

UniversalFile Fp32TensorFile(std::shared_ptr<ShardSource> source, size_t i, std::string name,
                             bool requires_grad, bool verify) {
  const ShardedParam& p = source->manifest().params[i];
  const uint64_t bytes = static_cast<uint64_t>(p.map.num_elements()) * 4;
  return {std::move(name), bytes,
          [source, i, requires_grad, verify](const std::string& path,
                                             const TorchWriteOptions& options) {
            const ShardedParam& t = source->manifest().params[i];
            TorchTreeBuilder b;
            const PickleNodeId tensor = b.Tensor(
                DType::kF32, t.map.valid_shape(),
                [&](std::span<std::byte> out) -> Status {
                  if (t.dtype == DType::kF32) return FillFull(*source, i, verify, out);
                  // The 16-bit values into the buffer's first half, widened from the last one
                  // down: value k's 4 bytes cover only values 2k and 2k + 1, widened already.
                  const size_t n = out.size() / 4;
                  RESHARD_RETURN_IF_ERROR(FillFull(*source, i, verify, out.first(n * 2)));
                  for (size_t k = n; k-- > 0;) {
                    uint16_t narrow = 0;
                    std::memcpy(&narrow, out.data() + k * 2, 2);
                    const float wide =
                        t.dtype == DType::kBF16 ? BFloat16ToFloat(narrow) : HalfToFloat(narrow);
                    std::memcpy(out.data() + k * 4, &wide, 4);
                  }
                  return Status::Ok();
                },
                requires_grad);
            return b.Write(path, b.Dict({{b.Str("param"), tensor}}), options);
          }};
}

// Files are synced together before the commit (SyncFiles), not one by one: a thread does not
// wait for the disk between two files. Each file's writeback starts as it is closed, so the disk
// works while the next ones are written (on a 2.3 GB output here: 2.0 s -> 1.5 s in all).
TorchWriteOptions WriteOptionsFor(const std::string& path, const CheckpointOptions& options) {
  TorchWriteOptions o;
  o.root = fs::path(path).stem().string();
  o.sync = false;
  o.start_writeback = options.sync;
  o.in_fresh_directory = true;  // every file goes into the output's temporary (OpenOutput)
  return o;
}

Status WriteUniversalFiles(Communicator& comm, const std::string& out_dir,
                           const CheckpointOptions& options, const std::vector<std::string>& inputs,
                           const std::string& folder, const std::vector<UniversalFile>& files,
                           const std::string& pointer) {
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out, OpenOutput(comm, out_dir, options, inputs));
  // Each folder inside its parent (a path sorts after its parent): a signal's cleanup may
  // remove the temporary at any moment, and must not see it made again.
  std::set<std::string> dirs;
  for (const UniversalFile& f : files) {
    for (fs::path d = fs::path(f.name).parent_path(); !d.empty(); d = d.parent_path())
      dirs.insert(out.FilePath(d.string()));
  }
  Status made;
  for (auto d = dirs.begin(); comm.rank() == 0 && made.ok() && d != dirs.end(); ++d) {
    if (::mkdir(d->c_str(), 0777) != 0 && errno != EEXIST)
      made = ErrnoStatus(errno, "creating", *d);
  }
  dirs.insert(out.temporary());
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, made));
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const UniversalFile& f : files) {
    sizes.push_back(f.bytes);
    total += f.bytes;
  }
  const std::vector<int> owners = BalanceByBytes(sizes, comm.size());
  ProcessStats mine;
  std::vector<size_t> own;
  std::vector<std::string> written;
  for (size_t j = 0; j < files.size(); ++j) {
    if (owners[j] != comm.rank()) continue;
    own.push_back(j);
    mine.files.push_back(files[j].name);
    mine.bytes_written += files[j].bytes;
    written.push_back(out.FilePath(files[j].name));
  }
  if (comm.rank() == 0) mine.files.push_back(pointer);
  ProgressCounter progress(options, total);
  Status wrote = ForEachIndex(own.size(), options.num_threads, [&](size_t k) -> Status {
    const UniversalFile& f = files[own[k]];
    const std::string path = out.FilePath(f.name);
    RESHARD_RETURN_IF_ERROR(f.write(path, WriteOptionsFor(path, options)));
    progress.Add(f.bytes);
    return Status::Ok();
  });
  const int sync_threads = std::max(options.num_threads, 8);
  if (wrote.ok() && options.sync) wrote = SyncFiles(written, sync_threads);
  return FinishOutput(comm, out, wrote, std::move(mine), options, [&]() -> Status {
    RESHARD_RETURN_IF_ERROR(
        WriteFileAtomically(out.FilePath(pointer), folder, {.sync = options.sync}));
    if (options.sync) {
      RESHARD_RETURN_IF_ERROR(
          SyncFiles(std::vector<std::string>(dirs.begin(), dirs.end()), sync_threads));
    }
    return out.Commit(options.sync);
  });
}

}  // namespace reshard
