#include "reshard/checkpoint/checkpoint_ops.h"

#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "reshard/checkpoint/output_dir.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"
#include "reshard/ir/compose.h"

namespace reshard {

namespace {

// Counts written bytes and reports them.
class ProgressCounter {
 public:
  ProgressCounter(const CheckpointOptions& options, uint64_t total)
      : report_(options.progress), total_(total) {
    if (report_) report_(0, total_);
  }
  void Add(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ += bytes;
    if (report_) report_(done_, total_);
  }

 private:
  std::mutex mu_;
  std::function<void(uint64_t, uint64_t)> report_;
  uint64_t total_;
  uint64_t done_ = 0;
};

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

uint64_t Bytes(const TensorToWrite& t) {
  return static_cast<uint64_t>(ProductOf(t.shape)) * DTypeSize(t.dtype);
}

// Splits tensors, in order, into parts of at most `max_bytes` (0: one part).
std::vector<std::vector<TensorToWrite>> SplitIntoParts(std::vector<TensorToWrite> tensors,
                                                       uint64_t max_bytes) {
  std::vector<std::vector<TensorToWrite>> parts(1);
  uint64_t in_part = 0;
  for (TensorToWrite& t : tensors) {
    const uint64_t b = Bytes(t);
    if (max_bytes > 0 && !parts.back().empty() && in_part + b > max_bytes) {
      parts.emplace_back();
      in_part = 0;
    }
    in_part += b;
    parts.back().push_back(std::move(t));
  }
  return parts;
}

// Writes rank `rank`'s tensors as model-rank-{r}-part-{p}.safetensors; returns the names.
Result<std::vector<std::string>> WriteRankFiles(const OutputDirectory& out, Rank rank,
                                                std::vector<TensorToWrite> tensors,
                                                uint64_t max_bytes) {
  std::vector<std::string> names;
  auto parts = SplitIntoParts(std::move(tensors), max_bytes);
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string name = ShardFileName(rank, static_cast<int>(p));
    RESHARD_RETURN_IF_ERROR(
        WriteSafetensors(out.FilePath(name), std::move(parts[p]), ProducerMetadata()));
    names.push_back(name);
  }
  return names;
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

// Runs fn(rank) for every rank, on up to one thread per core: each rank's files are written
// by one thread, so the kernel's copies into the page cache and the memory copies of several
// ranks overlap. Returns the first error (ranks not yet started are then skipped).
Status ForEachRank(int world, int num_threads, const std::function<Status(Rank)>& fn) {
  int threads =
      num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(1, std::min(threads, world));
  std::atomic<int> next{0};
  std::mutex mu;
  Status first;
  auto worker = [&] {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!first.ok()) return;
      }
      const int r = next.fetch_add(1);
      if (r >= world) return;
      Status s = fn(static_cast<Rank>(r));
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(s);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return first;
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

Status WriteManifest(const OutputDirectory& out, const Manifest& m) {
  return WriteFileAtomically(out.FilePath(kManifestName), ManifestToJson(m));
}

// Writes a sharded checkpoint: for every rank (ranks in parallel), one tensor per parameter
// of `manifest`, each produced by fill(param index, rank, buffer) straight into the writer's
// buffer; then the manifest, then the commit. The manifest's file lists are filled in.
using ShardFill = std::function<Status(size_t param, Rank rank, std::span<std::byte> buffer)>;

Status WriteSharded(const std::string& out_dir, std::span<const std::string> inputs,
                    Manifest& manifest, const CheckpointOptions& options, const ShardFill& fill) {
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OutputDirectory::Create(out_dir, options.overwrite, inputs));
  uint64_t total = 0;
  for (const ShardedParam& p : manifest.params) {
    for (Rank r = 0; r < manifest.world_size; ++r) {
      total += static_cast<uint64_t>(p.map.shard_num_elements(r)) * DTypeSize(p.dtype);
    }
  }
  ProgressCounter progress(options, total);
  manifest.files.assign(static_cast<size_t>(manifest.world_size), {});
  RESHARD_RETURN_IF_ERROR(
      ForEachRank(manifest.world_size, options.num_threads, [&](Rank r) -> Status {
        std::vector<TensorToWrite> tensors;
        for (size_t i = 0; i < manifest.params.size(); ++i) {
          const ShardedParam& p = manifest.params[i];
          tensors.push_back({p.name, p.dtype, p.map.rank(r).shard_shape,
                             [&, r, i](std::span<std::byte> buffer) -> Status {
                               // The writer names the tensor in any error.
                               RESHARD_RETURN_IF_ERROR(fill(i, r, buffer));
                               progress.Add(buffer.size());
                               return Status::Ok();
                             }});
        }
        RESHARD_ASSIGN_OR_RETURN(
            manifest.files[static_cast<size_t>(r)],
            WriteRankFiles(out, r, std::move(tensors), options.max_shard_bytes));
        return Status::Ok();
      }));
  RESHARD_RETURN_IF_ERROR(WriteManifest(out, manifest));
  return out.Commit();
}

// A sharded checkpoint as a source: shards are views of its mapped files.
class ShardedDirSource : public ShardSource {
 public:
  ShardedDirSource(std::string dir, ShardedCheckpoint ckpt)
      : dir_(std::move(dir)), ckpt_(std::move(ckpt)) {}
  int world_size() const override { return ckpt_.manifest().world_size; }
  const std::vector<ShardedParam>& params() const override { return ckpt_.manifest().params; }
  std::vector<DegreeConstraint> constraints() const override {
    return ckpt_.manifest().constraints;
  }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const ParamMap& map = ckpt_.manifest().params[i].map;
    std::vector<ConstBuffer> shards;
    for (Rank r = 0; r < map.world_size(); ++r) {
      shards.push_back({ckpt_.shard(i, r).data(), map.shard_num_elements(r)});
    }
    return shards;
  }
  void ReleaseShards(size_t i) override {
    for (Rank r = 0; r < world_size(); ++r) ReleaseMappedPages(ckpt_.shard(i, r));
  }
  // Everything a run from a sharded checkpoint reads, which its output may not touch.
  std::vector<std::string> inputs() const override {
    std::vector<std::string> inputs = {dir_,
                                       (std::filesystem::path(dir_) / kManifestName).string()};
    for (std::string& path : ckpt_.file_paths()) inputs.push_back(std::move(path));
    return inputs;
  }

 private:
  std::string dir_;
  ShardedCheckpoint ckpt_;
};

// Acquires a parameter's shards and releases them when it goes out of scope.
class AcquiredShards {
 public:
  AcquiredShards(ShardSource& source, size_t i) : source_(source), i_(i) {
    Result<std::vector<ConstBuffer>> shards = source.AcquireShards(i);
    if (shards.ok()) {
      shards_ = *std::move(shards);
    } else {
      status_ = shards.status();
    }
  }
  ~AcquiredShards() {
    if (status_.ok()) source_.ReleaseShards(i_);
  }
  AcquiredShards(const AcquiredShards&) = delete;
  AcquiredShards& operator=(const AcquiredShards&) = delete;
  const Status& status() const { return status_; }
  const std::vector<ConstBuffer>& shards() const { return shards_; }

 private:
  ShardSource& source_;
  size_t i_;
  Status status_;
  std::vector<ConstBuffer> shards_;
};

// Writes the full tensors as model.safetensors, or as parts and an index.
Status WriteFull(const OutputDirectory& out, std::vector<TensorToWrite> tensors, uint64_t total,
                 const CheckpointOptions& options) {
  if (options.max_shard_bytes == 0 || total <= options.max_shard_bytes) {
    return WriteSafetensors(out.FilePath("model.safetensors"), std::move(tensors),
                            ProducerMetadata());
  }
  auto parts = SplitIntoParts(std::move(tensors), options.max_shard_bytes);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", p + 1, parts.size());
    for (const TensorToWrite& t : parts[p]) weight_map[t.name] = name;
    RESHARD_RETURN_IF_ERROR(
        WriteSafetensors(out.FilePath(name), std::move(parts[p]), ProducerMetadata()));
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteFileAtomically(out.FilePath("model.safetensors.index.json"), index.dump(2) + "\n");
}

// Warns about a plan that moves values through a factor that is not a power of two.
void WarnAboutFactors(const CheckpointOptions& options, const ShardedParam& p,
                      const ParamPlan& plan) {
  if (!options.warn || !options.allow_lossy_scale || DTypeKindOf(p.dtype) != DTypeKind::kFloat)
    return;
  for (const Move& mv : plan.moves) {
    if (!IsPowerOfTwo(mv.factor)) {
      options.warn(p.name, fmt::format("moving it applies a factor of {} (not a power of two): "
                                       "the values are rounded, so a round trip is exact only "
                                       "to the last bit",
                                       mv.factor));
      return;
    }
  }
}

}  // namespace

MapProvider MapsFromDocument(const MapDocument& doc) {
  auto by_name = std::make_shared<std::map<std::string, ParamMap>>();
  for (const auto& [name, map] : doc.params) by_name->emplace(name, map);
  return [by_name](const std::string& name, const Shape&) -> Result<ProvidedMap> {
    auto it = by_name->find(name);
    if (it == by_name->end()) return NotFoundError(fmt::format("no map for \"{}\"", name));
    return ProvidedMap{it->second, std::nullopt};
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

Result<ResolvedMap> ResolveMap(const MapProvider& maps, const std::string& name,
                               const Shape& shape) {
  for (auto [suffix, power] : {std::pair{".exp_avg_sq", -2}, std::pair{".exp_avg", -1}}) {
    const std::string_view s(suffix);
    if (name.size() <= s.size() || !name.ends_with(s)) continue;
    Result<ProvidedMap> base = maps(name.substr(0, name.size() - s.size()), shape);
    if (!base.ok() && base.status().code() == StatusCode::kNotFound) base = maps(name, shape);
    if (!base.ok()) return base.status();
    return ResolvedMap{*std::move(base), power};
  }
  RESHARD_ASSIGN_OR_RETURN(ProvidedMap own, maps(name, shape));
  return ResolvedMap{std::move(own), 1};
}

Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const std::string& out_dir, const CheckpointOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint full, FullCheckpoint::Open(full_dir));
  Manifest manifest;
  manifest.world_size = world_size;
  manifest.constraints = options.degree_constraints;
  std::vector<const TensorRef*> sources;
  for (const TensorRef& t : full.tensors()) {
    const std::string& name = t.info->name;
    Result<ResolvedMap> resolved = ResolveMap(maps, name, t.info->shape);
    if (!resolved.ok()) {
      if (resolved.status().code() == StatusCode::kNotFound) {
        return FailedPreconditionError(fmt::format(
            "tensor \"{}\" (shape {}) has no map; give it one in the maps or layouts (a "
            "layouts file may set a default with the key \"*\")",
            name, FormatShape(t.info->shape)));
      }
      return resolved.status();
    }
    const ProvidedMap* provided = &resolved->provided;
    const int power = resolved->scale_power;
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
    manifest.params.push_back(ShardedParam{name, t.info->dtype, map, provided->layout, power});
    WarnAboutScales(options, manifest.params.back(), "holding it at");
    sources.push_back(&t);
  }
  // Ranks run in parallel; each copies on its own thread.
  CheckpointOptions per_rank = options;
  per_rank.num_threads = 1;
  std::vector<std::string> inputs = {full_dir};
  for (std::string& path : full.file_paths()) inputs.push_back(std::move(path));
  return WriteSharded(
      out_dir, inputs, manifest, options,
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
        RESHARD_RETURN_IF_ERROR(Extract(map, param.dtype, r, f,
                                        {buffer.data(), map.shard_num_elements(r)},
                                        ExecOptionsFor(per_rank, param.scale_power)));
        ReleaseMappedPages(src->data);
        return Status::Ok();
      });
}

Status Gather(const std::string& sharded_dir, const std::string& out_dir,
              const CheckpointOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(ShardedCheckpoint ckpt, ShardedCheckpoint::Open(sharded_dir));
  ShardedDirSource source(sharded_dir, std::move(ckpt));
  return GatherFrom(source, out_dir, options);
}

Status GatherFrom(ShardSource& source, const std::string& out_dir, const CheckpointOptions& options,
                  const std::vector<ExtraFile>& extra_files) {
  const std::vector<ShardedParam>& params = source.params();
  for (const ShardedParam& p : params) WarnAboutScales(options, p, "undoing");
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OutputDirectory::Create(out_dir, options.overwrite, source.inputs()));
  uint64_t total = 0;
  for (const ShardedParam& p : params)
    total += static_cast<uint64_t>(ProductOf(p.map.valid_shape())) * DTypeSize(p.dtype);
  ProgressCounter progress(options, total);
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardedParam& p = params[i];
    tensors.push_back(
        {p.name, p.dtype, p.map.valid_shape(), [&, i](std::span<std::byte> buffer) -> Status {
           const ShardedParam& param = params[i];
           const ParamMap& map = param.map;
           AcquiredShards shards(source, i);
           RESHARD_RETURN_IF_ERROR(shards.status());
           std::vector<std::byte> padded;
           MutableBuffer f{buffer.data(), map.num_elements()};
           if (map.has_padding()) {
             padded.resize(static_cast<size_t>(map.num_elements()) * DTypeSize(param.dtype));
             f.data = padded.data();
           }
           // The writer names the tensor in any error.
           RESHARD_RETURN_IF_ERROR(Rebuild(map, param.dtype, shards.shards(), f,
                                           ExecOptionsFor(options, param.scale_power)));
           if (map.has_padding()) {
             RESHARD_RETURN_IF_ERROR(CopyValidRegion(map, param.dtype, padded.data(), buffer.data(),
                                                     true, options.num_threads));
           }
           progress.Add(buffer.size());
           return Status::Ok();
         }});
  }
  RESHARD_RETURN_IF_ERROR(WriteFull(out, std::move(tensors), total, options));
  for (const ExtraFile& f : extra_files) {
    RESHARD_RETURN_IF_ERROR(WriteFileAtomically(out.FilePath(f.name), f.contents));
  }
  return out.Commit();
}

Status Convert(const std::string& sharded_dir, int world_size,
               const std::optional<MapDocument>& target_maps, const std::string& out_dir,
               const CheckpointOptions& options) {
  if (world_size < 1)
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  RESHARD_ASSIGN_OR_RETURN(ShardedCheckpoint ckpt, ShardedCheckpoint::Open(sharded_dir));
  ShardedDirSource source(sharded_dir, std::move(ckpt));
  return ConvertFrom(source, world_size, target_maps, out_dir, options);
}

Status ConvertFrom(ShardSource& source, int world_size,
                   const std::optional<MapDocument>& target_maps, const std::string& out_dir,
                   const CheckpointOptions& options) {
  if (world_size < 1)
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  const std::vector<DegreeConstraint> constraints = source.constraints();
  // Maps built from the recorded layouts follow the model's plan: it must take the degree.
  if (!target_maps && FirstBrokenConstraint(constraints, world_size)) {
    return FailedPreconditionError(DegreeRefusalMessage(
        constraints, world_size, TransformersBrokenDegreeConsequence(world_size)));
  }
  std::map<std::string, const ParamMap*> given;
  if (target_maps) {
    for (const auto& [name, map] : target_maps->params) given[name] = &map;
  }
  Manifest dst;
  dst.world_size = world_size;
  dst.constraints = constraints;
  std::vector<ParamPlan> plans;
  for (const ShardedParam& p : source.params()) {
    const std::string where = fmt::format("parameter \"{}\"", p.name);
    std::optional<ParamMap> target;
    if (target_maps) {
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
    Result<ParamPlan> plan = Compose(*target, p.map);
    if (!plan.ok()) return plan.status().Annotate(where);
    WarnAboutFactors(options, p, *plan);
    plans.push_back(*std::move(plan));
    dst.params.push_back(
        ShardedParam{p.name, p.dtype, *std::move(target), p.layout, p.scale_power});
  }
  if (!given.empty()) {
    return FailedPreconditionError(fmt::format(
        "the target maps name \"{}\", which the checkpoint does not hold", given.begin()->first));
  }
  // Replicas agree (P2): a plan reads each replicated block from one holder only, so every
  // parameter's replicas are compared once, by the first rank thread to reach it, just before
  // its data is moved (the source pages are read once for both). A disagreement fails the
  // run, and a failed run leaves no output.
  std::vector<std::once_flag> verify_once(source.params().size());
  std::vector<Status> verified(source.params().size());
  auto verify = [&](size_t i, const std::vector<ConstBuffer>& shards) {
    const ShardedParam& p = source.params()[i];
    verified[i] = VerifyReplicas(p.map, p.dtype, shards, ExecOptionsFor(options, p.scale_power));
  };
  CheckpointOptions per_rank = options;
  per_rank.num_threads = 1;
  return WriteSharded(
      out_dir, source.inputs(), dst, options,
      [&](size_t i, Rank r, std::span<std::byte> buffer) -> Status {
        AcquiredShards sources(source, i);
        RESHARD_RETURN_IF_ERROR(sources.status());
        if (options.verify_replicas) {
          std::call_once(verify_once[i], verify, i, sources.shards());
          RESHARD_RETURN_IF_ERROR(verified[i]);
        }
        const ShardedParam& param = dst.params[i];
        const ParamPlan& plan = plans[i];
        ParamPlan mine;  // the moves into rank r
        mine.source_world = plan.source_world;
        mine.target_world = plan.target_world;
        for (const Move& mv : plan.moves) {
          if (mv.dst_rank == r) mine.moves.push_back(mv);
        }
        for (const UnwrittenBlock& u : plan.unwritten) {
          if (u.dst_rank == r) mine.unwritten.push_back(u);
        }
        std::vector<MutableBuffer> targets(static_cast<size_t>(plan.target_world));
        targets[static_cast<size_t>(r)] = {buffer.data(), param.map.shard_num_elements(r)};
        return ExecutePlan(mine, param.dtype, sources.shards(), targets,
                           ExecOptionsFor(per_rank, param.scale_power));
      });
}

}  // namespace reshard
