// convert: a sharded checkpoint (any ShardSource) re-sharded into another world size or onto
// other maps, moving only what each target rank lacks.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/sharded_io.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/ir/block_grid.h"
#include "reshard/ir/compose.h"

namespace reshard {

using internal::Counters;
using internal::ElementBytes;
using internal::ExecOptionsFor;
using internal::IsPowerOfTwo;
using internal::OutputFile;
using internal::OwnersOf;
using internal::ReplicaBytes;
using internal::ShardedFiles;
using internal::WriteSharded;

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

// The box of F (offsets, sizes) that piece `p` reads, when it reads one: it walks F with F's
// own row-major strides from a multi-index inside F.
std::optional<std::pair<Shape, Shape>> PieceAsBox(const Piece& p, const Shape& full) {
  if (p.shape.size() != full.size() || p.num_elements() == 0) return std::nullopt;
  const Shape full_strides = RowMajorStrides(full);
  Shape offsets(full.size());
  Index rest = p.source.offset;
  for (size_t k = 0; k < full.size(); ++k) {
    if (p.shape[k] != 1 && p.source.strides[k] != full_strides[k]) return std::nullopt;
    offsets[k] = rest / full_strides[k];
    rest %= full_strides[k];
    if (offsets[k] + p.shape[k] > full[k]) return std::nullopt;
  }
  return std::pair{std::move(offsets), p.shape};
}

// The box of F (offsets, sizes) that rank r's shard of `map` is, row-major, when it is one: a
// single unscaled piece filling the shard densely from its start, walking F with F's own
// row-major strides (rows or columns of a split, a replica); nullopt otherwise (a buffered
// shard, several pieces, an interleaved view, padding).
std::optional<std::pair<Shape, Shape>> ShardAsBox(const ParamMap& map, Rank r) {
  const RankShard& s = map.rank(r);
  if (map.has_padding() || s.is_buffered() || s.pieces.size() != 1) return std::nullopt;
  const Piece& p = s.pieces[0];
  if (p.scale != 1.0 || ProductOf(s.shard_shape) != p.num_elements() || p.dest.offset != 0) {
    return std::nullopt;
  }
  const Shape dense = RowMajorStrides(p.shape);
  for (size_t k = 0; k < p.shape.size(); ++k) {
    if (p.shape[k] != 1 && p.dest.strides[k] != dense[k]) return std::nullopt;
  }
  return PieceAsBox(p, map.valid_shape());
}

// Rank r's shard of several pieces (a fused or interleaved target layout) when each piece is an
// unscaled box of F and together they fill the shard: each box read from the stored chunks it
// overlaps into memory of its own and copied to its place, so that the shard and one piece are
// held, not the array. nullopt when the shard is not so.
std::optional<Status> ReadShardByPieces(ShardSource& source, size_t i, const ParamMap& map,
                                        DType dtype, Rank r, std::span<std::byte> buffer) {
  const RankShard& s = map.rank(r);
  if (map.has_padding() || s.is_buffered() || s.pieces.size() < 2) return std::nullopt;
  std::vector<std::pair<Shape, Shape>> boxes;
  Index covered = 0;
  for (const Piece& p : s.pieces) {
    std::optional<std::pair<Shape, Shape>> box =
        p.scale == 1.0 ? PieceAsBox(p, map.valid_shape()) : std::nullopt;
    if (!box) return std::nullopt;
    boxes.push_back(*std::move(box));
    covered += p.num_elements();
  }
  if (covered != ProductOf(s.shard_shape)) return std::nullopt;
  const size_t esize = DTypeSize(dtype);
  std::vector<std::byte> piece;
  for (size_t k = 0; k < boxes.size(); ++k) {
    const Piece& p = s.pieces[k];
    piece.resize(static_cast<size_t>(p.num_elements()) * esize);
    RESHARD_RETURN_IF_ERROR(source.ReadRegion(i, boxes[k].first, boxes[k].second, piece, 1));
    const StridedMove move{.shape = p.shape,
                           .src = piece.data(),
                           .src_strides = RowMajorStrides(p.shape),
                           .dst = buffer.data() + static_cast<size_t>(p.dest.offset) * esize,
                           .dst_strides = p.dest.strides,
                           .op = ScaleOp::None()};
    RESHARD_RETURN_IF_ERROR(StridedCopy(dtype, std::span(&move, 1), 1));
  }
  return Status::Ok();
}

// Rank r's shard of any layout (pieces that are not boxes: a strided interleave, a transpose,
// padding) from a source's stored chunks, one chunk at a time: the chunks taken as the shards
// of a map of their own (chunk k the one piece of "rank" k) and composed with the target map;
// each chunk that feeds rank r is read once and its moves executed, so that the shard and one
// chunk are held. nullopt when the source does not list its chunks.
std::optional<Status> ReadShardByChunks(ShardSource& source, size_t i, const ShardedParam& param,
                                        Rank r, std::span<std::byte> buffer,
                                        const CheckpointOptions& options) {
  if (param.map.rank(r).is_buffered()) return std::nullopt;
  const std::vector<std::pair<Shape, Shape>> boxes = source.StoredChunks(i);
  if (boxes.empty()) return std::nullopt;
  std::vector<DcpChunk> chunks;
  for (size_t k = 0; k < boxes.size(); ++k) {
    chunks.push_back(DcpChunk{boxes[k].first, boxes[k].second, static_cast<Rank>(k), {}});
  }
  const auto world = static_cast<int>(chunks.size());
  Result<ParamMap> stored = ChunksToMap(param.name, param.map.valid_shape(), chunks, world);
  if (!stored.ok()) return stored.status();
  Result<ParamPlan> plan = Compose(param.map, *stored);
  if (!plan.ok()) return plan.status();
  std::map<Rank, ParamPlan> by_chunk;  // the moves into rank r, by the chunk they read
  for (const Move& mv : plan->moves) {
    if (mv.dst_rank == r) by_chunk[mv.src_rank].moves.push_back(mv);
  }
  ParamPlan padding;  // rank r's elements no chunk holds
  for (const UnwrittenBlock& u : plan->unwritten) {
    if (u.dst_rank == r) padding.unwritten.push_back(u);
  }
  const size_t esize = DTypeSize(param.dtype);
  std::vector<MutableBuffer> targets(static_cast<size_t>(param.map.world_size()));
  targets[static_cast<size_t>(r)] = {buffer.data(), param.map.shard_num_elements(r)};
  std::vector<ConstBuffer> sources(static_cast<size_t>(world));
  std::vector<std::byte> chunk;
  const ExecOptions exec = ExecOptionsFor(options, param.scale_power);
  for (auto& [k, part] : by_chunk) {
    const auto& [offsets, sizes] = boxes[static_cast<size_t>(k)];
    chunk.resize(static_cast<size_t>(ProductOf(sizes)) * esize);
    RESHARD_RETURN_IF_ERROR(source.ReadRegion(i, offsets, sizes, chunk, 1));
    part.source_world = world;
    part.target_world = param.map.world_size();
    sources.assign(sources.size(), ConstBuffer{});
    sources[static_cast<size_t>(k)] = {chunk.data(), ProductOf(sizes)};
    RESHARD_RETURN_IF_ERROR(ExecutePlan(part, param.dtype, sources, targets, exec));
  }
  if (!padding.unwritten.empty()) {
    padding.source_world = world;
    padding.target_world = param.map.world_size();
    sources.assign(sources.size(), ConstBuffer{});
    RESHARD_RETURN_IF_ERROR(ExecutePlan(padding, param.dtype, sources, targets, exec));
  }
  return Status::Ok();
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
  const std::unique_ptr<ShardSource> source = SourceOfShardedDir(
      sharded_dir, std::make_shared<const ShardedCheckpoint>(*std::move(opened)));
  return ConvertFrom(*source, world_size, target_maps, out_dir, all_options);
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
        // A source that reads regions fills a shard that is a box of F from the stored chunks
        // it overlaps, without the source's shards (their replicas hold one copy each).
        if (source.ReadsRegions()) {
          if (buffer.empty()) return Status::Ok();
          if (const auto box = ShardAsBox(dst.params[i].map, r)) {
            counters.read += buffer.size();
            return source.ReadRegion(i, box->first, box->second, buffer, 1);
          }
          const ShardedParam& param = dst.params[i];
          if (std::optional<Status> read =
                  ReadShardByPieces(source, i, param.map, param.dtype, r, buffer)) {
            counters.read += buffer.size();
            return *read;
          }
          if (std::optional<Status> read =
                  ReadShardByChunks(source, i, param, r, buffer, per_file)) {
            counters.read += buffer.size();
            return *read;
          }
        }
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

}  // namespace reshard
