#include "reshard/checkpoint/sharded_io.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/mapped_file.h"
#include "reshard/layouts/basic.h"

namespace reshard {

namespace internal {

bool IsPowerOfTwo(double x) {
  int exponent = 0;
  return std::frexp(std::abs(x), &exponent) == 0.5;
}

void WarnAboutScales(const CheckpointOptions& options, const ShardedParam& p, const char* verb) {
  // Without allow_lossy_scale the copy refuses any value the scale changes instead.
  if (!options.warn || !options.allow_lossy_scale || DTypeKindOf(p.dtype) != DTypeKind::kFloat)
    return;
  for (const RankShard& shard : p.map.ranks()) {
    for (const Piece& piece : shard.pieces) {
      if (!IsPowerOfTwo(piece.scale)) {
        options.warn(p.name, fmt::format("{} a scale of {} (not a power of two): the values are "
                                         "rounded, so a round trip is exact only to the last bit",
                                         verb, piece.scale));
        return;
      }
    }
  }
}

uint64_t ElementBytes(Index elements, DType dtype) {
  return static_cast<uint64_t>(elements) * DTypeSize(dtype);
}

uint64_t ReplicaBytes(const ShardedParam& p) {
  uint64_t bytes = 0;
  for (const RankShard& shard : p.map.ranks()) {
    for (const Piece& piece : shard.pieces) {
      if (piece.is_replicated()) bytes += ElementBytes(piece.num_elements(), p.dtype);
    }
  }
  return bytes;
}

std::vector<std::vector<size_t>> SplitIntoParts(std::span<const uint64_t> sizes,
                                                uint64_t max_bytes) {
  std::vector<std::vector<size_t>> parts(1);
  uint64_t in_part = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (max_bytes > 0 && !parts.back().empty() && in_part + sizes[i] > max_bytes) {
      parts.emplace_back();
      in_part = 0;
    }
    in_part += sizes[i];
    parts.back().push_back(i);
  }
  return parts;
}

std::vector<OutputFile> ShardedFiles(const Manifest& m, uint64_t max_bytes) {
  std::vector<OutputFile> files;
  for (Rank r = 0; r < m.world_size; ++r) {
    std::vector<RankTensor> tensors = RankTensorsOf(m, r);
    std::vector<uint64_t> sizes;
    for (const RankTensor& t : tensors) sizes.push_back(ElementBytes(ProductOf(t.shape), t.dtype));
    const auto parts = SplitIntoParts(sizes, max_bytes);
    for (size_t part = 0; part < parts.size(); ++part) {
      OutputFile f{ShardFileName(r, static_cast<int>(part)), r, {}, 0, {}};
      for (size_t k : parts[part]) {
        f.bytes += sizes[k];
        f.tensors.push_back(std::move(tensors[k]));
      }
      files.push_back(std::move(f));
    }
  }
  return files;
}

Status CopyValidRegion(const ParamMap& map, DType dtype, const std::byte* src, std::byte* dst,
                       bool padded_to_valid, int num_threads) {
  const Shape valid_strides = RowMajorStrides(map.valid_shape());
  const Shape full_strides = RowMajorStrides(map.logical_shape());
  StridedMove move{map.valid_shape(),
                   src,
                   padded_to_valid ? full_strides : valid_strides,
                   dst,
                   padded_to_valid ? valid_strides : full_strides,
                   ScaleOp::None()};
  return StridedCopy(dtype, std::span<const StridedMove>(&move, 1), num_threads);
}

ExecOptions ExecOptionsFor(const CheckpointOptions& options, int scale_power) {
  ExecOptions e;
  e.scale_power = scale_power;
  e.allow_scaled_optimizer_state = options.allow_scaled_optimizer_state;
  e.verify_replicas = options.verify_replicas;
  e.allow_lossy_scale = options.allow_lossy_scale;
  e.num_threads = options.num_threads;
  return e;
}

Status WriteOwnFiles(Communicator& comm, const std::vector<OutputFile>& files,
                     const std::vector<int>& owners, int num_threads, ProcessStats& mine,
                     const std::function<Status(const OutputFile&)>& write) {
  std::vector<size_t> own;
  for (size_t k = 0; k < files.size(); ++k) {
    if (owners[k] != comm.rank()) continue;
    own.push_back(k);
    mine.files.push_back(files[k].name);
    mine.bytes_written += files[k].bytes;
  }
  return ForEachIndex(own.size(), num_threads, [&](size_t j) { return write(files[own[j]]); });
}

std::vector<int> OwnersOf(const std::vector<OutputFile>& files, int processes) {
  std::vector<uint64_t> sizes;
  for (const OutputFile& f : files) sizes.push_back(f.bytes);
  return BalanceByBytes(sizes, processes);
}

namespace {

// Every element of `bytes` set to the buffer's fill value.
Status FillBuffer(const BufferDecl& decl, std::span<std::byte> bytes) {
  if (decl.fill == 0.0 && !std::signbit(decl.fill)) {  // +0.0: zero bytes
    std::memset(bytes.data(), 0, bytes.size());
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(const std::vector<std::byte> element,
                           ElementBytes(decl.dtype, decl.fill));
  for (size_t at = 0; at + element.size() <= bytes.size(); at += element.size()) {
    std::memcpy(bytes.data() + at, element.data(), element.size());
  }
  return Status::Ok();
}

Status WriteManifest(const OutputDirectory& out, const Manifest& m, bool sync) {
  return WriteFileAtomically(out.FilePath(kManifestName), ManifestToJson(m), {.sync = sync});
}

// Copies those of `ModelSideFiles()` that `from_dir` holds (regular files) into `out`; a
// non-empty `config` is written as config.json instead.
Status CopyModelSideFiles(const std::string& from_dir, const OutputDirectory& out, bool sync,
                          const std::string& config = {}) {
  if (!config.empty()) {
    RESHARD_RETURN_IF_ERROR(
        WriteFileAtomically(out.FilePath("config.json"), config, {.sync = sync}));
  }
  std::error_code ec;
  if (from_dir.empty() || !std::filesystem::is_directory(from_dir, ec)) return Status::Ok();
  for (const char* name : ModelSideFiles()) {
    if (!config.empty() && std::string_view(name) == "config.json") continue;
    const std::filesystem::path path = std::filesystem::path(from_dir) / name;
    if (!std::filesystem::is_regular_file(path, ec)) continue;
    RESHARD_ASSIGN_OR_RETURN(std::string contents, ReadFileToString(path.string()));
    RESHARD_RETURN_IF_ERROR(WriteFileAtomically(out.FilePath(name), contents, {.sync = sync}));
  }
  return Status::Ok();
}

// The bytes of `t` (`bytes` of them) on rank `rank` as ranges of input files, in order, when
// every parameter's pieces are such ranges and together cover the tensor; else none.
// Neighbouring ranges of one file are merged (an expert's gate and up rows, stored one after
// the other, become one copy).
std::vector<FileRange> TensorRanges(const RankTensor& t, Rank rank, uint64_t bytes,
                                    const ShardRanges& ranges) {
  if (!ranges || bytes == 0) return {};
  if (t.buffer != nullptr && !t.buffer->ranks[static_cast<size_t>(rank)].padding.empty()) {
    return {};
  }
  std::vector<PlacedRange> placed;
  for (size_t i : t.params) {
    std::optional<std::vector<PlacedRange>> mine = ranges(i, rank);
    if (!mine) return {};
    placed.insert(placed.end(), mine->begin(), mine->end());
  }
  std::sort(placed.begin(), placed.end(),
            [](const PlacedRange& a, const PlacedRange& b) { return a.first < b.first; });
  std::vector<FileRange> out;
  uint64_t at = 0;
  for (auto& [dest, range] : placed) {
    if (dest != at) return {};  // a gap or an overlap: the fill decides
    at += range.length;
    if (!out.empty() && out.back().path == range.path &&
        out.back().offset + out.back().length == range.offset) {
      out.back().length += range.length;
    } else {
      out.push_back(std::move(range));
    }
  }
  if (at != bytes) return {};
  return out;
}

}  // namespace

Status WriteSharded(const std::string& out_dir, std::span<const std::string> inputs,
                    Manifest& manifest, const CheckpointOptions& options,
                    const std::vector<OutputFile>& files, const std::vector<int>& owners,
                    Counters& counters, const ShardFill& fill, const ShardRanges& ranges) {
  Communicator& comm = CommunicatorOf(options);
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out, OpenOutput(comm, out_dir, options, inputs));
  uint64_t total = 0;
  for (const OutputFile& f : files) total += f.bytes;
  ProcessStats mine;
  ProgressCounter progress(options, total);  // until the end: process 0 shows the others' too
  const Status written = WriteOwnFiles(
      comm, files, owners, options.num_threads, mine, [&](const OutputFile& f) -> Status {
        std::vector<TensorToWrite> tensors;
        std::vector<TensorCopy> copies;
        for (const RankTensor& t : f.tensors) {
          const uint64_t bytes = ElementBytes(ProductOf(t.shape), t.dtype);
          tensors.push_back({t.name, t.dtype, t.shape, [&](std::span<std::byte> buffer) -> Status {
                               // A buffer's padding holds its fill (zero by default); every
                               // other element is written by exactly one of its parameters'
                               // pieces.
                               if (t.buffer != nullptr &&
                                   !t.buffer->ranks[static_cast<size_t>(f.rank)].padding.empty()) {
                                 RESHARD_RETURN_IF_ERROR(FillBuffer(*t.buffer, buffer));
                               }
                               // The writer names the tensor in any error.
                               for (size_t i : t.params) {
                                 Status st = fill(i, f.rank, buffer);
                                 if (!st.ok() && t.buffer != nullptr) {
                                   return std::move(st).Annotate(
                                       fmt::format("parameter \"{}\"", manifest.params[i].name));
                                 }
                                 RESHARD_RETURN_IF_ERROR(st);
                               }
                               progress.Add(buffer.size());
                               return Status::Ok();
                             }});
          copies.push_back({TensorRanges(t, f.rank, bytes, ranges), [&progress, &counters, bytes] {
                              counters.read += bytes;
                              counters.copied += bytes;
                              progress.Add(bytes);
                            }});
        }
        return WriteSafetensors(out.FilePath(f.name), std::move(tensors), ProducerMetadata(),
                                OutputFileOptions(options), std::move(copies));
      });
  const Status synced = SyncOutputFiles(out, written, mine.files, options);
  mine.bytes_read = counters.read;
  mine.bytes_verified = counters.verified;
  mine.bytes_copied = counters.copied;
  manifest.files.assign(static_cast<size_t>(manifest.world_size), {});
  for (const OutputFile& f : files) manifest.files[static_cast<size_t>(f.rank)].push_back(f.name);
  return FinishOutput(comm, out, synced, std::move(mine), options, [&]() -> Status {
    RESHARD_RETURN_IF_ERROR(WriteManifest(out, manifest, options.sync));
    // The first input is the source directory (the full checkpoint, the sharded one).
    RESHARD_RETURN_IF_ERROR(CopyModelSideFiles(inputs.empty() ? std::string() : inputs[0], out,
                                               options.sync, options.output_config));
    return out.Commit(options.sync);
  });
}

}  // namespace internal

namespace {

// A sharded checkpoint as a source: shards are views of its mapped files.
class ShardedDirSource : public ShardSource {
 public:
  ShardedDirSource(std::string dir, std::shared_ptr<const ShardedCheckpoint> ckpt)
      : dir_(std::move(dir)), ckpt_(std::move(ckpt)) {}
  const Manifest& manifest() const override { return ckpt_->manifest(); }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const ParamMap& map = ckpt_->manifest().params[i].map;
    std::vector<ConstBuffer> shards;
    for (Rank r = 0; r < map.world_size(); ++r) {
      shards.push_back({ckpt_->shard(i, r).data(), map.shard_num_elements(r)});
    }
    return shards;
  }
  void ReleaseShards(size_t i) override {
    for (Rank r = 0; r < ckpt_->manifest().world_size; ++r) {
      ReleaseMappedPages(ckpt_->shard(i, r));
    }
  }
  // Everything a run from a sharded checkpoint reads, which its output may not touch.
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {dir_,
                                       (std::filesystem::path(dir_) / kManifestName).string()};
    for (std::string& path : ckpt_->file_paths()) inputs.push_back(std::move(path));
    return inputs;
  }

 private:
  std::string dir_;
  std::shared_ptr<const ShardedCheckpoint> ckpt_;
};

// A full checkpoint as a source at world size 1: each tensor is its own one-rank shard.
class FullDirSource : public ShardSource {
 public:
  FullDirSource(std::string dir, std::shared_ptr<const FullCheckpoint> ckpt, Manifest manifest)
      : dir_(std::move(dir)), ckpt_(std::move(ckpt)), manifest_(std::move(manifest)) {}
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const TensorRef& t = ckpt_->tensors()[i];
    return std::vector<ConstBuffer>{{t.data.data(), manifest_.params[i].map.shard_num_elements(0)}};
  }
  void ReleaseShards(size_t i) override { ReleaseMappedPages(ckpt_->tensors()[i].data); }
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {dir_};
    for (std::string& path : ckpt_->file_paths()) inputs.push_back(std::move(path));
    return inputs;
  }

 private:
  std::string dir_;
  std::shared_ptr<const FullCheckpoint> ckpt_;
  Manifest manifest_;
};

}  // namespace

std::unique_ptr<ShardSource> SourceOfShardedDir(std::string dir,
                                                std::shared_ptr<const ShardedCheckpoint> ckpt) {
  return std::make_unique<ShardedDirSource>(std::move(dir), std::move(ckpt));
}

Result<std::unique_ptr<ShardSource>> SourceOfFullDir(std::string dir,
                                                     std::shared_ptr<const FullCheckpoint> ckpt) {
  Manifest m;
  m.world_size = 1;
  for (const TensorRef& t : ckpt->tensors()) {
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, ReplicatedMap(t.info->shape, 1));
    m.params.push_back({.name = t.info->name,
                        .dtype = t.info->dtype,
                        .map = std::move(map),
                        .layout = std::nullopt,
                        .scale_power = 1});
  }
  return std::unique_ptr<ShardSource>(
      std::make_unique<FullDirSource>(std::move(dir), std::move(ckpt), std::move(m)));
}

Result<std::vector<ConstBuffer>> ShardCache::Acquire(size_t i, const ParamMap& map,
                                                     const Reader& read) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = cache_[i];
  if (e.users == 0) {
    e.data.assign(static_cast<size_t>(map.world_size()), {});
    Status s = read(e.data);
    if (!s.ok()) {
      cache_.erase(i);
      return s;
    }
  }
  ++e.users;
  std::vector<ConstBuffer> out;
  for (Rank r = 0; r < map.world_size(); ++r) {
    out.push_back({e.data[static_cast<size_t>(r)].data(), map.shard_num_elements(r)});
  }
  return out;
}

void ShardCache::Release(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cache_.find(i);
  if (it != cache_.end() && --it->second.users == 0) cache_.erase(it);
}

}  // namespace reshard
