#include "reshard/checkpoint/checkpoint_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/exec/dequantize.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"
#include "reshard/io/temporaries.h"
#include "reshard/ir/block_grid.h"
#include "reshard/ir/compose.h"
#include "reshard/layouts/basic.h"

namespace reshard {

namespace {

bool IsPowerOfTwo(double x) {
  int exponent = 0;
  return std::frexp(std::abs(x), &exponent) == 0.5;
}

// Warns about a parameter held at a scale that is not a power of two (scatter and gather
// apply it; the values are rounded).
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

// The bytes of every copy of `p`'s replicated pieces: what comparing its replicas reads.
uint64_t ReplicaBytes(const ShardedParam& p) {
  uint64_t bytes = 0;
  for (const RankShard& shard : p.map.ranks()) {
    for (const Piece& piece : shard.pieces) {
      if (piece.is_replicated()) bytes += ElementBytes(piece.num_elements(), p.dtype);
    }
  }
  return bytes;
}

// Splits items of `sizes` (bytes), in order, into consecutive parts of at most `max_bytes`
// (0: one part); an item larger than that gets a part of its own. Returns the items' indices.
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

// Copies the valid region of a padded F (logical shape) to or from a dense tensor of the
// valid shape.
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

ExecOptions ExecOptionsFor(const CheckpointOptions& options, int scale_power) {
  ExecOptions e;
  e.scale_power = scale_power;
  e.allow_scaled_optimizer_state = options.allow_scaled_optimizer_state;
  e.verify_replicas = options.verify_replicas;
  e.allow_lossy_scale = options.allow_lossy_scale;
  e.num_threads = options.num_threads;
  return e;
}

// What this process reads and writes, counted by its writer threads.
struct Counters {
  std::atomic<uint64_t> read{0};
  std::atomic<uint64_t> verified{0};
  std::atomic<uint64_t> copied{0};  // by the file system (copy_file_range)
};

// Writes the files of `files` that `owners` gives this process; write(k) writes file k.
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

// Writes a sharded checkpoint: every file of every rank (files in parallel; across processes,
// each process its share), one tensor per parameter of `manifest`, each produced by
// fill(param index, rank, buffer) straight into the writer's buffer; then the manifest, then
// the commit. The manifest's file lists are filled in.
using ShardFill = std::function<Status(size_t param, Rank rank, std::span<std::byte> buffer)>;

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

// Where rank `rank`'s shard of parameter `param` is bytes of an input file unchanged: those
// ranges, each with its byte offset in the rank's tensor; nullopt where it is not.
using PlacedRange = std::pair<uint64_t, FileRange>;
using ShardRanges = std::function<std::optional<std::vector<PlacedRange>>(size_t param, Rank rank)>;

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

// Whether `strides` lay out `shape` densely in row-major order (dimensions of one element
// aside).
bool IsDenseRowMajor(const Shape& shape, const Shape& strides) {
  Index expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// A range copy costs a system call: pieces smaller than this go through memory, unless the
// shard is one piece.
constexpr uint64_t kMinRangeBytes = uint64_t{64} * 1024;

// Rank r's shard of `map` as ranges of the file `path` holding the full tensor at `offset`:
// when every piece is an unscaled dense block of the tensor, densely placed in the shard.
std::optional<std::vector<PlacedRange>> FullTensorRanges(const ParamMap& map, DType dtype, Rank r,
                                                         const std::string& path, uint64_t offset) {
  if (map.has_padding()) return std::nullopt;
  const std::vector<Piece>& pieces = map.rank(r).pieces;
  const uint64_t element = DTypeSize(dtype);
  std::vector<PlacedRange> out;
  for (const Piece& p : pieces) {
    const uint64_t bytes = static_cast<uint64_t>(p.num_elements()) * element;
    if (p.scale != 1.0 || !IsDenseRowMajor(p.shape, p.source.strides) ||
        !IsDenseRowMajor(p.shape, p.dest.strides) ||
        (bytes < kMinRangeBytes && pieces.size() > 1)) {
      return std::nullopt;
    }
    out.push_back(
        {static_cast<uint64_t>(p.dest.offset) * element,
         FileRange{path, offset + static_cast<uint64_t>(p.source.offset) * element, bytes}});
  }
  return out;
}

Status WriteSharded(const std::string& out_dir, std::span<const std::string> inputs,
                    Manifest& manifest, const CheckpointOptions& options,
                    const std::vector<OutputFile>& files, const std::vector<int>& owners,
                    Counters& counters, const ShardFill& fill, const ShardRanges& ranges = {}) {
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

}  // namespace

MapProvider MapsFromDocument(const MapDocument& doc) {
  auto by_name = std::make_shared<std::map<std::string, ParamMap>>();
  for (const auto& [name, map] : doc.params) by_name->emplace(name, map);
  return [by_name](const std::string& name, const Shape&) -> Result<ProvidedMap> {
    auto it = by_name->find(name);
    if (it == by_name->end()) return NotFoundError(fmt::format("no map for \"{}\"", name));
    return ProvidedMap{it->second, std::nullopt, true};
  };
}

MapProvider MapsFromLayouts(std::map<std::string, LayoutDescriptor> layouts, int world_size) {
  auto shared = std::make_shared<std::map<std::string, LayoutDescriptor>>(std::move(layouts));
  return [shared, world_size](const std::string& name, const Shape& shape) -> Result<ProvidedMap> {
    auto it = shared->find(name);
    if (it == shared->end()) it = shared->find("*");
    if (it == shared->end()) return NotFoundError(fmt::format("no layout for \"{}\"", name));
    Result<ParamMap> map = BuildMap(it->second, shape, world_size);
    if (!map.ok()) return map.status().Annotate(fmt::format("layout of \"{}\"", name));
    return ProvidedMap{*std::move(map), it->second};
  };
}

namespace {

// A provider's NotFound for tensor `name` as scatter says it; other errors as they are.
Status NoMapError(const Status& st, const std::string& name, const Shape& shape) {
  if (st.code() != StatusCode::kNotFound) return st;
  return FailedPreconditionError(
      fmt::format("tensor \"{}\" (shape {}) has no map; give it one in the maps or layouts (a "
                  "layouts file may set a default with the key \"*\")",
                  name, FormatShape(shape)));
}

}  // namespace

Result<MapDocument> DocumentOfMaps(const MapProvider& maps, const BufferSetBuilder& buffers,
                                   const Manifest& m) {
  MapDocument doc;
  for (const ShardedParam& p : m.params) {
    Result<ProvidedMap> provided = maps(p.name, p.map.valid_shape());
    if (!provided.ok()) return NoMapError(provided.status(), p.name, p.map.valid_shape());
    doc.params.emplace_back(p.name, std::move(provided->map));
  }
  RESHARD_RETURN_IF_ERROR(ValidateBuffers(doc, buffers));
  return doc;
}

Result<ResolvedMap> ResolveMap(const MapProvider& maps, const std::string& name,
                               const Shape& shape) {
  for (auto [suffix, power] :
       {std::pair{".exp_avg_sq", -2}, std::pair{".exp_avg", -1}, std::pair{".fp32", 1}}) {
    const std::string_view s(suffix);
    if (name.size() <= s.size() || !name.ends_with(s)) continue;
    if (Result<ProvidedMap> own = maps(name, shape); own.ok() && own->exact) {
      return ResolvedMap{*std::move(own), power};
    }
    Result<ProvidedMap> base = maps(name.substr(0, name.size() - s.size()), shape);
    if (!base.ok() && base.status().code() == StatusCode::kNotFound) {
      RESHARD_ASSIGN_OR_RETURN(ProvidedMap own, maps(name, shape));
      return ResolvedMap{std::move(own), power};
    }
    if (!base.ok()) return base.status();
    return ResolvedMap{*std::move(base), power, true};
  }
  RESHARD_ASSIGN_OR_RETURN(ProvidedMap own, maps(name, shape));
  return ResolvedMap{std::move(own), 1};
}

namespace {

// An optimizer state that takes its parameter's map over buffers lies in buffers of its own,
// "<buffer><suffix>" (".exp_avg"), each declared as the parameter's buffer is but of the state's
// dtype (added to `buffers` unless declared already): the state never writes its parameter's
// elements.
Result<ParamMap> StateInOwnBuffers(const ParamMap& map, std::string_view name, DType dtype,
                                   BufferSetBuilder& buffers) {
  const std::string suffix(name.substr(name.rfind('.')));
  ParamMapBuilder b(map);
  for (Rank r = 0; r < map.world_size(); ++r) {
    if (!map.rank(r).is_buffered()) continue;
    const std::string& base = map.buffer(r);
    const std::string own = base + suffix;
    b.set_buffer(r, own);
    const auto named = [&](const std::string& n) {
      return [&n](const BufferDecl& d) { return d.name == n; };
    };
    const std::vector<BufferDecl>& declared = buffers.buffers();
    if (std::any_of(declared.begin(), declared.end(), named(own))) continue;
    const auto it = std::find_if(declared.begin(), declared.end(), named(base));
    if (it == declared.end()) continue;  // undeclared: the buffer set's check names it
    BufferDecl decl = *it;
    decl.name = own;
    decl.dtype = dtype;
    buffers.add(std::move(decl));
  }
  return b.Finalize();
}

// The sharded manifest of a scatter and, per parameter, its source tensor.
Result<Manifest> PlanScatter(const FullCheckpoint& full, int world_size, const MapProvider& maps,
                             const BufferSetBuilder& given_buffers,
                             const CheckpointOptions& options,
                             std::vector<const TensorRef*>& sources) {
  BufferSetBuilder buffers = given_buffers;
  Manifest manifest;
  manifest.world_size = world_size;
  manifest.constraints = options.degree_constraints;
  manifest.model_config = options.model_config;
  for (const TensorRef& t : full.tensors()) {
    const std::string& name = t.info->name;
    Result<ResolvedMap> resolved = ResolveMap(maps, name, t.info->shape);
    if (!resolved.ok()) {
      return NoMapError(resolved.status(), name, t.info->shape);
    }
    const ProvidedMap* provided = &resolved->provided;
    const ParamMap& map = provided->map;
    if (map.world_size() != world_size) {
      return FailedPreconditionError(fmt::format("the map of \"{}\" has {} ranks, not {}", name,
                                                 map.world_size(), world_size));
    }
    if (map.valid_shape() != t.info->shape) {
      return FailedPreconditionError(
          fmt::format("the map of \"{}\" is for a tensor of shape {} but the checkpoint stores {}",
                      name, FormatShape(map.valid_shape()), FormatShape(t.info->shape)));
    }
    ParamMap placed = map;
    if (resolved->inherited && map.has_buffers()) {
      Result<ParamMap> own = StateInOwnBuffers(map, name, t.info->dtype, buffers);
      if (!own.ok()) return own.status().Annotate(fmt::format("\"{}\"", name));
      placed = *std::move(own);
    }
    manifest.params.push_back(ShardedParam{name, t.info->dtype, std::move(placed), provided->layout,
                                           resolved->scale_power});
    WarnAboutScales(options, manifest.params.back(), "holding it at");
    sources.push_back(&t);
  }
  RESHARD_RETURN_IF_ERROR(ValidateManifestBuffers(manifest, buffers));
  for (const ShardedParam& p : manifest.params) {
    if (auto tie = options.block_scales.find(p.name); tie != options.block_scales.end())
      manifest.block_scales.insert(*tie);
  }
  RESHARD_RETURN_IF_ERROR(CheckBlockTies(manifest));
  return manifest;
}

}  // namespace

Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const std::string& out_dir, const CheckpointOptions& all_options) {
  return Scatter(full_dir, world_size, maps, BufferSetBuilder(), out_dir, all_options);
}

Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const BufferSetBuilder& buffers, const std::string& out_dir,
               const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<FullCheckpoint> full = FullCheckpoint::Open(full_dir);
  std::vector<const TensorRef*> sources;
  Result<Manifest> planned =
      full.ok() ? PlanScatter(*full, world_size, maps, buffers, options, sources) : full.status();
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, planned.status()));
  Manifest& manifest = *planned;
  const std::vector<OutputFile> files = ShardedFiles(manifest, options.max_shard_bytes);
  const std::vector<int> owners = OwnersOf(files, comm.size());
  // Files are written in parallel; each copies on its own thread.
  CheckpointOptions per_file = options;
  per_file.num_threads = 1;
  std::vector<std::string> inputs = {full_dir};
  const std::vector<std::string> input_paths = full->file_paths();
  inputs.insert(inputs.end(), input_paths.begin(), input_paths.end());
  Counters counters;
  return WriteSharded(
      out_dir, inputs, manifest, options, files, owners, counters,
      [&](size_t i, Rank r, std::span<std::byte> buffer) -> Status {
        const ShardedParam& param = manifest.params[i];
        const ParamMap& map = param.map;
        const TensorRef* src = sources[i];
        std::vector<std::byte> padded;
        ConstBuffer f{src->data.data(), map.num_elements()};
        if (map.has_padding()) {
          padded.assign(static_cast<size_t>(map.num_elements()) * DTypeSize(param.dtype),
                        std::byte{0});
          RESHARD_RETURN_IF_ERROR(
              CopyValidRegion(map, param.dtype, src->data.data(), padded.data(), false, 1));
          f.data = padded.data();
        }
        counters.read += map.has_padding() ? src->data.size() : HeldBytes(param, r);
        RESHARD_RETURN_IF_ERROR(Extract(map, param.dtype, r, f,
                                        {buffer.data(), map.shard_num_elements(r)},
                                        ExecOptionsFor(per_file, param.scale_power)));
        ReleaseMappedPages(src->data);
        return Status::Ok();
      },
      [&](size_t i, Rank r) {
        const TensorRef* src = sources[i];
        return FullTensorRanges(manifest.params[i].map, manifest.params[i].dtype, r,
                                input_paths[src->file], src->offset);
      });
}

namespace {

// The files of a full output: model.safetensors, or parts of at most max_bytes.
std::vector<OutputFile> FullFiles(const Manifest& m, uint64_t max_bytes) {
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const ShardedParam& p : m.params) {
    sizes.push_back(ElementBytes(ProductOf(p.map.valid_shape()), p.dtype));
    total += sizes.back();
  }
  const bool split = max_bytes > 0 && total > max_bytes;
  const auto parts = SplitIntoParts(sizes, split ? max_bytes : 0);
  std::vector<OutputFile> files;
  for (size_t part = 0; part < parts.size(); ++part) {
    OutputFile f{!split ? std::string("model.safetensors")
                        : fmt::format("model-{:05d}-of-{:05d}.safetensors", part + 1, parts.size()),
                 0,
                 parts[part],
                 0,
                 {}};
    for (size_t i : f.params) f.bytes += sizes[i];
    files.push_back(std::move(f));
  }
  return files;
}

// model.safetensors.index.json of a full output in parts.
Status WriteFullIndex(const OutputDirectory& out, const Manifest& m, bool sync,
                      const std::vector<OutputFile>& files) {
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total = 0;
  for (const OutputFile& f : files) {
    for (size_t i : f.params) weight_map[m.params[i].name] = f.name;
    total += f.bytes;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteFileAtomically(out.FilePath("model.safetensors.index.json"), index.dump(2) + "\n",
                             {.sync = sync});
}

// Rebuilds parameter i of `source` (its valid region) into `buffer`.
Status RebuildInto(ShardSource& source, size_t i, const CheckpointOptions& options,
                   std::span<std::byte> buffer, Counters& counters) {
  const ShardedParam& param = source.manifest().params[i];
  const ParamMap& map = param.map;
  AcquiredShards shards(source, i);
  RESHARD_RETURN_IF_ERROR(shards.status());
  std::vector<std::byte> padded;
  MutableBuffer f{buffer.data(), map.num_elements()};
  if (map.has_padding()) {
    padded.resize(static_cast<size_t>(map.num_elements()) * DTypeSize(param.dtype));
    f.data = padded.data();
  }
  uint64_t held = 0;
  for (Rank r = 0; r < map.world_size(); ++r) held += HeldBytes(param, r);
  counters.read += std::min(held, ElementBytes(map.num_elements(), param.dtype));
  if (options.verify_replicas) counters.verified += ReplicaBytes(param);
  // The writer names the tensor in any error.
  RESHARD_RETURN_IF_ERROR(
      Rebuild(map, param.dtype, shards.shards(), f, ExecOptionsFor(options, param.scale_power)));
  if (map.has_padding()) {
    RESHARD_RETURN_IF_ERROR(
        CopyValidRegion(map, param.dtype, padded.data(), buffer.data(), true, options.num_threads));
  }
  return Status::Ok();
}

// A tensor a gather writes: one parameter rebuilt as it is, or a dequantized one (its data
// and scales rebuilt, then dequantized).
struct GatherOutput {
  std::string name;
  DType dtype;
  Shape shape;
  size_t param = 0;
  // Dequantized outputs only:
  std::optional<size_t> scales;
  std::optional<size_t> global;  // a per-tensor second-level scale (NVFP4's weight_scale_2)
  DequantizeSpec spec;
  bool mxfp4 = false;  // written [E, G * 32, R] as transformers holds gpt-oss's experts
};

// A rebuilt parameter in memory of its own (uninitialised).
struct Rebuilt {
  std::unique_ptr<std::byte[]> bytes;
  size_t size = 0;
  std::span<std::byte> span() { return {bytes.get(), size}; }
};

Result<Rebuilt> RebuildOwned(ShardSource& source, size_t i, const CheckpointOptions& options,
                             Counters& counters) {
  const ShardedParam& p = source.manifest().params[i];
  Rebuilt out;
  out.size = static_cast<size_t>(ElementBytes(ProductOf(p.map.valid_shape()), p.dtype));
  out.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(out.size, 1)]);
  if (!out.bytes) {
    return ResourceExhaustedError(
        fmt::format("cannot allocate {} bytes for \"{}\"", out.size, p.name));
  }
  RESHARD_RETURN_IF_ERROR(RebuildInto(source, i, options, out.span(), counters));
  return out;
}

// Whether `v` walks `shape` row-major from offset 0 (dimensions of one element aside).
bool IsDenseView(const StridedView& v, const Shape& shape) {
  if (v.offset != 0) return false;
  Index expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && v.strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

// A rank whose shard is the whole tensor as it is, held by no other rank (one unscaled piece,
// row-major in F and in the shard): its shard can be read in place of a rebuild, with no
// replica to compare.
std::optional<Rank> SoleWholeHolder(const ParamMap& map) {
  if (map.has_padding()) return std::nullopt;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& s = map.rank(r);
    if (s.is_buffered() || s.pieces.size() != 1) continue;
    const Piece& p = s.pieces[0];
    if (p.scale != 1.0 || p.is_replicated() || p.num_elements() != map.num_elements() ||
        ProductOf(s.shard_shape) != map.num_elements()) {
      continue;
    }
    if (IsDenseView(p.source, p.shape) && IsDenseView(p.dest, p.shape)) return r;
  }
  return std::nullopt;
}

// A parameter's valid bytes: the shard of its sole whole holder read in place (a Hugging Face
// file's tensor, mapped), else rebuilt into memory of its own.
struct ParamBytes {
  std::unique_ptr<AcquiredShards> held;
  Rebuilt rebuilt;
  std::span<const std::byte> bytes;
};

Result<ParamBytes> ReadParamBytes(ShardSource& source, size_t i, const CheckpointOptions& options,
                                  Counters& counters) {
  const ShardedParam& p = source.manifest().params[i];
  ParamBytes out;
  if (const std::optional<Rank> r = SoleWholeHolder(p.map)) {
    out.held = std::make_unique<AcquiredShards>(source, i);
    RESHARD_RETURN_IF_ERROR(out.held->status());
    const ConstBuffer& shard = out.held->shards()[static_cast<size_t>(*r)];
    out.bytes = {shard.data, static_cast<size_t>(ElementBytes(shard.num_elements, p.dtype))};
    counters.read += out.bytes.size();
    return out;
  }
  RESHARD_ASSIGN_OR_RETURN(out.rebuilt, RebuildOwned(source, i, options, counters));
  out.bytes = out.rebuilt.span();
  return out;
}

// Writes a dequantized output into `buffer`.
Status FillDequantized(ShardSource& source, const GatherOutput& o, const CheckpointOptions& options,
                       std::span<std::byte> buffer, Counters& counters) {
  const Manifest& m = source.manifest();
  RESHARD_ASSIGN_OR_RETURN(ParamBytes data, ReadParamBytes(source, o.param, options, counters));
  RESHARD_ASSIGN_OR_RETURN(ParamBytes scales, ReadParamBytes(source, *o.scales, options, counters));
  DequantizeSpec spec = o.spec;
  if (o.global) {
    const ShardedParam& gp = m.params[*o.global];
    RESHARD_ASSIGN_OR_RETURN(Rebuilt g, RebuildOwned(source, *o.global, options, counters));
    if (gp.dtype != DType::kF32 || g.size != 4) {
      return FailedPreconditionError(fmt::format("\"{}\": expected one F32 value", gp.name));
    }
    std::memcpy(&spec.global_scale, g.bytes.get(), 4);
    if (!std::isfinite(spec.global_scale) || spec.global_scale <= 0) {
      return FailedPreconditionError(
          fmt::format("\"{}\": the per-tensor scale of \"{}\" is {}, not a positive number",
                      gp.name, m.params[o.param].name, spec.global_scale));
    }
    // compressed-tensors divides by its global scale; a 0-d one keeps the factor bfloat16.
    spec.global_divides = gp.name.ends_with(".weight_global_scale");
    spec.factor_to_bf16 = spec.global_divides && gp.map.valid_shape().empty();
  }
  const auto annotate = [&](const Status& st) {
    return st.ok() ? st
                   : Status(st.code(), fmt::format("dequantizing \"{}\" with \"{}\": {}",
                                                   m.params[o.param].name, m.params[*o.scales].name,
                                                   st.message()));
  };
  if (!o.mxfp4) return annotate(Dequantize(spec, data.bytes, scales.bytes, o.dtype, buffer));
  // [E, R, G * 32] dequantized, then its last two dimensions swapped.
  Rebuilt flat;
  flat.size = buffer.size();
  flat.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(flat.size, 1)]);
  if (!flat.bytes) return ResourceExhaustedError("cannot allocate the dequantized experts");
  RESHARD_RETURN_IF_ERROR(
      annotate(Dequantize(spec, data.bytes, scales.bytes, o.dtype, flat.span())));
  const Shape& out_shape = o.shape;  // [..., cols, rows]
  const size_t nd = out_shape.size();
  const Index rows = out_shape[nd - 1], cols = out_shape[nd - 2];
  const Index outer = ProductOf(std::span(out_shape).first(nd - 2));
  const size_t es = DTypeSize(o.dtype);
  for (Index e = 0; e < outer; ++e) {
    const std::byte* from = flat.bytes.get() + static_cast<size_t>(e * rows * cols) * es;
    std::byte* to = buffer.data() + static_cast<size_t>(e * rows * cols) * es;
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < cols; ++c) {
        std::memcpy(to + static_cast<size_t>(c * rows + r) * es,
                    from + static_cast<size_t>(r * cols + c) * es, es);
      }
    }
  }
  return Status::Ok();
}

// The dequantized output of data parameter `d` scaled by parameter `s` under `tie`.
Result<GatherOutput> DequantizedOutput(const Manifest& m, size_t d, size_t s,
                                       const BlockScales& tie, DType dtype) {
  const ShardedParam& data = m.params[d];
  const ShardedParam& scales = m.params[s];
  GatherOutput o{data.name, dtype, data.map.valid_shape(), d, s, std::nullopt, {}, false};
  o.spec = DequantizeSpec{data.dtype, data.map.valid_shape(), scales.dtype, tie.block, 1.0f};
  RESHARD_RETURN_IF_ERROR(CheckBlockScaleDType(tie.format, scales.name, data.name, scales.dtype));
  const bool packed = tie.format == "mxfp4" || tie.format == "nvfp4";
  if (packed != (data.dtype == DType::kU8)) {
    return FailedPreconditionError(fmt::format("\"{}\" is {}, which {} does not store", data.name,
                                               DTypeName(data.dtype), tie.format));
  }
  if (packed) o.shape.back() *= 2;
  // compressed-tensors' packed `X.weight_packed` holds the numbers of `X.weight`.
  if (data.name.ends_with(".weight_packed")) o.name = data.name.substr(0, data.name.size() - 7);
  if (tie.format == "mxfp4") {
    // gpt-oss: X_blocks [E, R, G, 16] -> X [E, G * 32, R] (transformers' dequantized experts).
    if (o.shape.size() != 4 || !data.name.ends_with("_blocks")) {
      return FailedPreconditionError(
          fmt::format("MXFP4 blocks \"{}\" {}: expected [experts, rows, groups, 16] named *_blocks",
                      data.name, FormatShape(data.map.valid_shape())));
    }
    o.name = data.name.substr(0, data.name.size() - 7);
    o.shape = {o.shape[0], o.shape[2] * o.shape[3], o.shape[1]};
    o.mxfp4 = true;
  }
  return o;
}

// What a gather writes: every parameter as it is, or, dequantizing, each quantized tensor as
// numbers and no scales.
Result<std::vector<GatherOutput>> GatherOutputs(const Manifest& m,
                                                const CheckpointOptions& options) {
  std::vector<GatherOutput> out;
  if (!options.dequantize) {
    for (size_t i = 0; i < m.params.size(); ++i) {
      const ShardedParam& p = m.params[i];
      out.push_back(
          {p.name, p.dtype, p.map.valid_shape(), i, std::nullopt, std::nullopt, {}, false});
    }
    return out;
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.params.size(); ++i) index.emplace(m.params[i].name, i);
  std::map<size_t, std::pair<size_t, BlockScales>> scales_of;  // data -> block scale
  std::map<size_t, size_t> global_of;                          // data -> second-level scale
  std::set<size_t> dropped;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ShardedParam& p = m.params[i];
    auto given = options.dequantize->ties.find(p.name);
    auto recorded = m.block_scales.find(p.name);
    const BlockScales* tie = given != options.dequantize->ties.end() ? &given->second
                             : recorded != m.block_scales.end()      ? &recorded->second
                                                                     : nullptr;
    if (tie == nullptr) continue;
    auto d = index.find(tie->data);
    if (d == index.end()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" scales \"{}\", which the checkpoint does not hold", p.name, tie->data));
    }
    dropped.insert(i);
    if (tie->dequantizes) {
      if (!scales_of.emplace(d->second, std::pair{i, *tie}).second) {
        return FailedPreconditionError(fmt::format("\"{}\" has two block scales", tie->data));
      }
    } else if (p.name.ends_with(".weight_scale_2") || p.name.ends_with(".weight_global_scale")) {
      if (!global_of.emplace(d->second, i).second) {
        return FailedPreconditionError(
            fmt::format("\"{}\" has two per-tensor weight scales", tie->data));
      }
    }
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (dropped.contains(i)) continue;
    const ShardedParam& p = m.params[i];
    auto sc = scales_of.find(i);
    if (sc == scales_of.end()) {
      // FP8 numbers mean nothing without their scales: written as they are under a config
      // without quantization_config, they would load as the wrong weights.
      if (p.dtype == DType::kF8E4M3 || p.dtype == DType::kF8E5M2) {
        return FailedPreconditionError(fmt::format(
            "\"{}\" is {} but the checkpoint records no block scale for it (no scale tensor "
            "whose block_scales names it and dequantizes): its numbers are unknown",
            p.name, DTypeName(p.dtype)));
      }
      out.push_back(
          {p.name, p.dtype, p.map.valid_shape(), i, std::nullopt, std::nullopt, {}, false});
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(
        GatherOutput o,
        DequantizedOutput(m, i, sc->second.first, sc->second.second, options.dequantize->dtype));
    if (auto g = global_of.find(i); g != global_of.end()) {
      o.global = g->second;
    } else if (sc->second.second.format == "nvfp4" && p.name.ends_with(".weight")) {
      // ModelOpt's NVFP4 (compressed-tensors' is `weight_packed`): a per-tensor factor too.
      return FailedPreconditionError(fmt::format(
          "\"{}\" is ModelOpt NVFP4, whose values are the FP4 value times its per-16 scale "
          "times \"{}_scale_2\", which the checkpoint does not hold",
          p.name, p.name));
    }
    out.push_back(std::move(o));
  }
  return out;
}

// A map of `shape` at `world` ranks that rank 0 holds whole and the others not at all.
Result<ParamMap> HeldByRankZero(const Shape& shape, int world) {
  RESHARD_ASSIGN_OR_RETURN(ParamMap one, ReplicatedMap(shape, 1));
  if (world == 1) return one;
  ParamMapBuilder b;
  b.set_logical_shape(shape).set_world_size(world).set_shard_shape(0, shape);
  for (Rank r = 1; r < world; ++r) b.set_shard_shape(r, Shape{0});
  for (const Piece& piece : one.rank(0).pieces) b.add_piece(0, piece);
  return b.Finalize();
}

// A source with its block-quantized tensors read as numbers (DequantizedView). A dequantized
// tensor is made whole (on rank 0) at its first acquire and freed at its last release: memory
// is set by the tensors being written, never the checkpoint.
class DequantizedSource : public ShardSource {
 public:
  DequantizedSource(ShardSource& inner, CheckpointOptions options,
                    std::vector<GatherOutput> outputs, Manifest manifest)
      : inner_(inner),
        options_(std::move(options)),
        outputs_(std::move(outputs)),
        manifest_(std::move(manifest)),
        made_(outputs_.size()) {
    for (auto& m : made_) m = std::make_unique<Made>();
  }
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const GatherOutput& o = outputs_[i];
    if (!o.scales) return inner_.AcquireShards(o.param);
    Made& made = *made_[i];
    std::lock_guard lock(made.mu);
    if (made.refs == 0) {
      made.tensor.size = static_cast<size_t>(ElementBytes(ProductOf(o.shape), o.dtype));
      made.tensor.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(made.tensor.size, 1)]);
      if (!made.tensor.bytes) {
        return ResourceExhaustedError(
            fmt::format("cannot allocate {} bytes for \"{}\"", made.tensor.size, o.name));
      }
      RESHARD_RETURN_IF_ERROR(FillDequantized(inner_, o, options_, made.tensor.span(), counters_));
    }
    ++made.refs;
    std::vector<ConstBuffer> shards(static_cast<size_t>(manifest_.world_size));
    shards[0] = {made.tensor.bytes.get(), ProductOf(o.shape)};
    return shards;
  }
  void ReleaseShards(size_t i) override {
    const GatherOutput& o = outputs_[i];
    if (!o.scales) return inner_.ReleaseShards(o.param);
    Made& made = *made_[i];
    std::lock_guard lock(made.mu);
    if (--made.refs == 0) made.tensor = Rebuilt();
  }
  std::vector<std::string> inputs() const override { return inner_.inputs(); }

 private:
  struct Made {
    std::mutex mu;
    int refs = 0;
    Rebuilt tensor;
  };
  ShardSource& inner_;
  const CheckpointOptions options_;
  const std::vector<GatherOutput> outputs_;
  const Manifest manifest_;
  std::vector<std::unique_ptr<Made>> made_;
  Counters counters_;
};

}  // namespace

Result<std::unique_ptr<ShardSource>> DequantizedView(ShardSource& inner,
                                                     const CheckpointOptions& options,
                                                     const DequantizedManifest& recorded) {
  if (!options.dequantize)
    return InvalidArgumentError("a dequantized view needs DequantizeOptions");
  const Manifest& in = inner.manifest();
  RESHARD_ASSIGN_OR_RETURN(std::vector<GatherOutput> outputs, GatherOutputs(in, options));
  Manifest m;
  m.world_size = in.world_size;
  m.model_config = recorded.model_config ? *recorded.model_config : in.model_config;
  m.constraints = recorded.constraints ? *recorded.constraints : in.constraints;
  for (const GatherOutput& o : outputs) {
    const ShardedParam& p = in.params[o.param];
    if (!o.scales) {
      m.params.push_back(p);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, HeldByRankZero(o.shape, in.world_size));
    // A layout descriptor is in terms of the data's dimensions: it holds while they do.
    std::optional<LayoutDescriptor> layout;
    if (o.shape == p.map.valid_shape()) layout = p.layout;
    m.params.push_back({o.name, o.dtype, std::move(map), std::move(layout), 1});
  }
  CheckpointOptions own = options;
  own.progress = nullptr;  // the scatter or convert reads through the view reports
  own.warn = nullptr;
  return std::unique_ptr<ShardSource>(
      std::make_unique<DequantizedSource>(inner, own, std::move(outputs), std::move(m)));
}

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

Status Gather(const std::string& sharded_dir, const std::string& out_dir,
              const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  ShardedDirSource source(sharded_dir,
                          std::make_shared<const ShardedCheckpoint>(*std::move(opened)));
  return GatherFrom(source, out_dir, all_options);
}

Status GatherFrom(ShardSource& source, const std::string& out_dir,
                  const CheckpointOptions& all_options, const std::vector<ExtraFile>& extra_files) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  const Manifest& m = source.manifest();
  for (const ShardedParam& p : m.params) WarnAboutScales(options, p, "undoing");
  Result<std::vector<GatherOutput>> outputs_or = GatherOutputs(m, options);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, outputs_or.status()));
  const std::vector<GatherOutput>& outputs = *outputs_or;
  // What is written, as a manifest of full tensors (for the file plan and the index).
  Manifest written_m;
  for (const GatherOutput& o : outputs) {
    RESHARD_ASSIGN_OR_RETURN(ParamMap full, ReplicatedMap(o.shape, 1));
    written_m.params.push_back({o.name, o.dtype, std::move(full), std::nullopt, 1});
  }
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OpenOutput(comm, out_dir, options, source.inputs()));
  const std::vector<OutputFile> files = FullFiles(written_m, options.max_shard_bytes);
  const std::vector<int> owners = OwnersOf(files, comm.size());
  uint64_t total = 0;
  for (const OutputFile& f : files) total += f.bytes;
  ProgressCounter progress(options, total);
  Counters counters;
  ProcessStats mine;
  // Files are written one after the other; each tensor is rebuilt on every core.
  const Status written =
      WriteOwnFiles(comm, files, owners, 1, mine, [&](const OutputFile& f) -> Status {
        std::vector<TensorToWrite> tensors;
        for (const size_t k : f.params) {
          const GatherOutput& o = outputs[k];
          tensors.push_back({o.name, o.dtype, o.shape, [&](std::span<std::byte> buffer) {
                               RESHARD_RETURN_IF_ERROR(
                                   o.scales
                                       ? FillDequantized(source, o, options, buffer, counters)
                                       : RebuildInto(source, o.param, options, buffer, counters));
                               progress.Add(buffer.size());
                               return Status::Ok();
                             }});
        }
        return WriteSafetensors(out.FilePath(f.name), std::move(tensors), ProducerMetadata(),
                                OutputFileOptions(options));
      });
  const Status synced = SyncOutputFiles(out, written, mine.files, options);
  mine.bytes_read = counters.read;
  mine.bytes_verified = counters.verified;
  return FinishOutput(comm, out, synced, std::move(mine), options, [&]() -> Status {
    if (files.front().name != "model.safetensors") {
      RESHARD_RETURN_IF_ERROR(WriteFullIndex(out, written_m, options.sync, files));
    }
    for (const ExtraFile& f : extra_files) {
      RESHARD_RETURN_IF_ERROR(
          WriteFileAtomically(out.FilePath(f.name), f.contents, {.sync = options.sync}));
    }
    return out.Commit(options.sync);
  });
}

namespace {

// A conversion planned: the target manifest and every parameter's plan.
struct ConvertPlan {
  Manifest target;
  std::vector<ParamPlan> plans;
};

// The map of parameter `p` at `world_size`: from `given` (removed from it) when there are
// target maps, else from its recorded layout.
Result<ParamMap> TargetMapOf(const ShardedParam& p, int world_size, bool have_target_maps,
                             std::map<std::string, const ParamMap*>& given) {
  const std::string where = fmt::format("parameter \"{}\"", p.name);
  std::optional<ParamMap> target;
  if (have_target_maps) {
    auto it = given.find(p.name);
    if (it == given.end())
      return FailedPreconditionError(fmt::format("{} has no map in the target maps", where));
    target = *it->second;
    given.erase(it);
  } else if (p.layout) {
    Result<ParamMap> built = BuildMap(*p.layout, p.map.valid_shape(), world_size);
    if (!built.ok()) return built.status().Annotate(where);
    target = *std::move(built);
  } else {
    return FailedPreconditionError(
        fmt::format("{} has no recorded layout descriptor, so its map at {} ranks is unknown "
                    "without target maps",
                    where, world_size));
  }
  if (target->world_size() != world_size) {
    return FailedPreconditionError(fmt::format("{}: the target map has {} ranks, not {}", where,
                                               target->world_size(), world_size));
  }
  return *std::move(target);
}

Result<ConvertPlan> PlanConvert(const Manifest& src, int world_size,
                                const std::optional<MapDocument>& target_maps,
                                const CheckpointOptions& options) {
  // Maps built from the recorded layouts follow the model's plan: it must take the degree.
  if (!target_maps && FirstBrokenConstraint(src.constraints, world_size)) {
    return FailedPreconditionError(DegreeRefusalMessage(
        src.constraints, world_size, TransformersBrokenDegreeConsequence(world_size)));
  }
  std::map<std::string, const ParamMap*> given;
  if (target_maps) {
    for (const auto& [name, map] : target_maps->params) given[name] = &map;
  }
  ConvertPlan out;
  out.target.world_size = world_size;
  out.target.constraints = src.constraints;
  out.target.model_config = src.model_config;
  // Scales without target maps or a layout follow their data (block images): data first.
  std::map<std::string_view, ParamMap> data_targets;
  auto tie_of = [&](const ShardedParam& p) -> const BlockScales* {
    auto it = src.block_scales.find(p.name);
    return it == src.block_scales.end() ? nullptr : &it->second;
  };
  for (const ShardedParam& p : src.params) {
    if (!tie_of(p) || target_maps || p.layout) continue;
    auto data = std::find_if(src.params.begin(), src.params.end(),
                             [&](const ShardedParam& q) { return q.name == tie_of(p)->data; });
    if (data == src.params.end()) continue;  // CheckBlockTies names it
    RESHARD_ASSIGN_OR_RETURN(ParamMap t, TargetMapOf(*data, world_size, false, given));
    data_targets.emplace(data->name, std::move(t));
  }
  for (const ShardedParam& p : src.params) {
    Result<ParamMap> target_or =
        tie_of(p) && data_targets.contains(tie_of(p)->data)
            ? BlockImage(data_targets.at(tie_of(p)->data), tie_of(p)->block, p.map.logical_shape())
            : TargetMapOf(p, world_size, target_maps.has_value(), given);
    if (!target_or.ok())
      return target_or.status().Annotate(fmt::format("parameter \"{}\"", p.name));
    ParamMap target = *std::move(target_or);
    Result<ParamPlan> plan = Compose(target, p.map);
    if (!plan.ok()) return plan.status().Annotate(fmt::format("parameter \"{}\"", p.name));
    if (options.warn && options.allow_lossy_scale && DTypeKindOf(p.dtype) == DTypeKind::kFloat) {
      for (const Move& mv : plan->moves) {
        if (!IsPowerOfTwo(mv.factor)) {
          options.warn(p.name, fmt::format("moving it applies a factor of {} (not a power of two): "
                                           "the values are rounded, so a round trip is exact only "
                                           "to the last bit",
                                           mv.factor));
          break;
        }
      }
    }
    out.plans.push_back(*std::move(plan));
    out.target.params.push_back(
        ShardedParam{p.name, p.dtype, std::move(target), p.layout, p.scale_power});
  }
  if (!given.empty()) {
    return FailedPreconditionError(fmt::format(
        "the target maps name \"{}\", which the checkpoint does not hold", given.begin()->first));
  }
  if (target_maps) {
    RESHARD_RETURN_IF_ERROR(
        ValidateManifestBuffers(out.target, BufferSetBuilder(target_maps->buffers))
            .Annotate("the target maps"));
  }
  out.target.block_scales = src.block_scales;
  RESHARD_RETURN_IF_ERROR(CheckBlockTies(out.target).Annotate("the target layout"));
  return out;
}

// The process that compares parameter i's replicas: the writer of target rank (i mod world)'s
// file holding it, so the comparisons spread over the processes.
std::vector<int> Verifiers(const Manifest& target, const std::vector<OutputFile>& files,
                           const std::vector<int>& owners) {
  std::vector<int> verifier(target.params.size(), 0);
  for (size_t k = 0; k < files.size(); ++k) {
    for (const RankTensor& t : files[k].tensors) {
      for (size_t i : t.params) {
        if (files[k].rank == static_cast<Rank>(i % static_cast<size_t>(target.world_size))) {
          verifier[i] = owners[k];
        }
      }
    }
  }
  return verifier;
}

}  // namespace

Status Convert(const std::string& sharded_dir, int world_size,
               const std::optional<MapDocument>& target_maps, const std::string& out_dir,
               const CheckpointOptions& all_options) {
  if (world_size < 1)
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  ShardedDirSource source(sharded_dir,
                          std::make_shared<const ShardedCheckpoint>(*std::move(opened)));
  return ConvertFrom(source, world_size, target_maps, out_dir, all_options);
}

Status ConvertFrom(ShardSource& source, int world_size,
                   const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                   const CheckpointOptions& all_options) {
  if (world_size < 1)
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<ConvertPlan> planned = PlanConvert(source.manifest(), world_size, target_maps, options);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, planned.status()));
  const Manifest& src = source.manifest();
  Manifest& dst = planned->target;
  const std::vector<OutputFile> files = ShardedFiles(dst, options.max_shard_bytes);
  const std::vector<int> owners = OwnersOf(files, comm.size());
  const std::vector<int> verifiers = Verifiers(dst, files, owners);
  // Replicas agree (P2): a plan reads each replicated block from one holder only, so every
  // parameter's replicas are compared once, by one process (its first writer thread to reach
  // it), just before its data is moved (the source pages are read once for both). A
  // disagreement fails the run, and a failed run leaves no output.
  std::vector<std::once_flag> verify_once(src.params.size());
  std::vector<Status> verified(src.params.size());
  Counters counters;
  auto verify = [&](size_t i, const std::vector<ConstBuffer>& shards) {
    const ShardedParam& p = src.params[i];
    counters.verified += ReplicaBytes(p);
    verified[i] = VerifyReplicas(p.map, p.dtype, shards, ExecOptionsFor(options, p.scale_power));
  };
  CheckpointOptions per_file = options;
  per_file.num_threads = 1;
  return WriteSharded(
      out_dir, source.inputs(), dst, options, files, owners, counters,
      [&](size_t i, Rank r, std::span<std::byte> buffer) -> Status {
        AcquiredShards sources(source, i);
        RESHARD_RETURN_IF_ERROR(sources.status());
        if (options.verify_replicas && verifiers[i] == comm.rank()) {
          std::call_once(verify_once[i], verify, i, sources.shards());
          RESHARD_RETURN_IF_ERROR(verified[i]);
        }
        const ShardedParam& param = dst.params[i];
        const ParamPlan& plan = planned->plans[i];
        ParamPlan mine;  // the moves into rank r
        mine.source_world = plan.source_world;
        mine.target_world = plan.target_world;
        for (const Move& mv : plan.moves) {
          if (mv.dst_rank != r) continue;
          mine.moves.push_back(mv);
          counters.read += ElementBytes(mv.num_elements(), param.dtype);
        }
        for (const UnwrittenBlock& u : plan.unwritten) {
          if (u.dst_rank == r) mine.unwritten.push_back(u);
        }
        std::vector<MutableBuffer> targets(static_cast<size_t>(plan.target_world));
        targets[static_cast<size_t>(r)] = {buffer.data(), param.map.shard_num_elements(r)};
        return ExecutePlan(mine, param.dtype, sources.shards(), targets,
                           ExecOptionsFor(per_file, param.scale_power));
      });
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
