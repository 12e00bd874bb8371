#include "reshard/exec/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reshard/exec/dequantize.h"
#include "reshard/exec/strided_copy.h"

namespace reshard {
namespace {

// The element-wise ops a piece needs: extract applies scale^p, rebuild undoes it.
struct PieceOps {
  ScaleOp extract;
  ScaleOp rebuild;
};

// scale^|p| is applied as one factor; a negative power divides where a positive one
// multiplies, so a power of -1 divides by the scale itself rather than multiplying by a
// rounded reciprocal.
Result<PieceOps> OpsFor(const Piece& piece, Rank rank, size_t index, DType dtype,
                        const ExecOptions& options) {
  const int p = options.scale_power;
  if (piece.scale == 1.0 || p == 0) return PieceOps{};
  if (p != 1 && !options.allow_scaled_optimizer_state) {
    return FailedPreconditionError(fmt::format(
        "{}: refusing to move a tensor of scale power {} through a piece of scale {}: an "
        "optimizer's learning rate and epsilon stay in the source coordinate, so a resumed run "
        "would silently diverge (allow scaled optimizer state to move it anyway)",
        PiecePath(rank, index), p, piece.scale));
  }
  double magnitude = 1.0;
  for (int i = 0; i < std::abs(p); ++i) magnitude *= piece.scale;
  PieceOps ops;
  ops.extract = p > 0 ? ScaleOp::Multiply(magnitude) : ScaleOp::Divide(magnitude);
  ops.rebuild = p > 0 ? ScaleOp::Divide(magnitude) : ScaleOp::Multiply(magnitude);
  RESHARD_RETURN_IF_ERROR(CheckScaleOp(dtype, ops.extract).Annotate(PiecePath(rank, index)));
  RESHARD_RETURN_IF_ERROR(CheckScaleOp(dtype, ops.rebuild).Annotate(PiecePath(rank, index)));
  return ops;
}

Status CheckFull(const ParamMap& map, Index given, const void* data) {
  const Index expected = map.num_elements();
  if (given != expected) {
    return FailedPreconditionError(
        fmt::format("the F buffer has {} elements but the map's logical shape {} has {}", given,
                    FormatShape(map.logical_shape()), expected));
  }
  if (data == nullptr && expected != 0) {
    return InvalidArgumentError(fmt::format("the F buffer is null but holds {} elements", given));
  }
  return Status::Ok();
}

Status CheckShard(const ParamMap& map, Rank rank, Index given, const void* data) {
  const Index expected = map.shard_num_elements(rank);
  if (given != expected) {
    return FailedPreconditionError(fmt::format(
        "the shard buffer of rank {} has {} elements but the map gives rank {} a shard of "
        "shape {} ({} elements)",
        rank, given, rank, FormatShape(map.rank(rank).shard_shape), expected));
  }
  if (data == nullptr && expected != 0) {
    return InvalidArgumentError(
        fmt::format("the shard buffer of rank {} is null but holds {} elements", rank, given));
  }
  return Status::Ok();
}

// Zeroes the padding of F: for each padded dimension k, the box with dimensions before k
// inside valid_shape, dimension k past it, and dimensions after k whole. The boxes are
// disjoint and together are exactly the padding.
Status ZeroPadding(const ParamMap& map, DType dtype, std::byte* full, int num_threads) {
  const Shape& logical = map.logical_shape();
  const Shape& valid = map.valid_shape();
  const Shape strides = RowMajorStrides(logical);
  const Index es = static_cast<Index>(DTypeSize(dtype));
  for (size_t k = 0; k < logical.size(); ++k) {
    if (valid[k] >= logical[k]) continue;
    Shape box = logical;
    for (size_t j = 0; j < k; ++j) box[j] = valid[j];
    box[k] = logical[k] - valid[k];
    RESHARD_RETURN_IF_ERROR(
        StridedZero(dtype, box, full + valid[k] * strides[k] * es, strides, num_threads));
  }
  return Status::Ok();
}

// The smallest positive normal value of a floating-point dtype.
double SmallestNormal(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return std::numeric_limits<double>::min();
    case DType::kF16:
      return 0x1p-14;
    default:
      return std::numeric_limits<float>::min();  // F32 and BF16
  }
}

// The refusal of a scaled copy that lost `e`: `where` names the piece or move, `element` the
// element, `op` is what was applied.
Status InexactError(std::string_view where, std::string_view element, DType dtype,
                    const ScaleOp& op, const InexactElement& e) {
  const double after = ElementToDouble(dtype, e.after);
  std::string why = "it rounds";
  if (std::isinf(after)) {
    why = fmt::format("it overflows {} to infinity", DTypeName(dtype));
  } else if (after == 0.0) {
    why = "it underflows to zero";
  } else if (std::abs(after) < SmallestNormal(dtype)) {
    why = fmt::format("it underflows into the subnormals of {}, which keep fewer bits",
                      DTypeName(dtype));
  }
  return FailedPreconditionError(fmt::format(
      "{}: {} does not survive the scale: {} {} by {} gives {} ({}), which scales back to {}; "
      "refusing to change a value silently (allow lossy scale to apply the scale anyway)",
      where, element, FormatElement(dtype, e.before),
      op.kind == ScaleOp::Kind::kDivide ? "divided" : "multiplied", op.factor,
      FormatElement(dtype, e.after), why, FormatElement(dtype, e.back)));
}

// Runs the moves; unless lossy scales are allowed, checks in the same pass that every scaled
// element survives the round trip, and turns the first that does not into an error with
// `describe`.
Status CopyExactly(DType dtype, std::span<const StridedMove> moves, const ExecOptions& options,
                   const std::function<Status(const InexactElement&)>& describe) {
  const bool scaled = std::any_of(moves.begin(), moves.end(),
                                  [](const StridedMove& m) { return !m.op.is_identity(); });
  if (!scaled || options.allow_lossy_scale) {
    return StridedCopy(dtype, moves, options.num_threads);
  }
  RESHARD_ASSIGN_OR_RETURN(const std::optional<InexactElement> lost,
                           StridedCopyExact(dtype, moves, options.num_threads));
  return lost ? describe(*lost) : Status::Ok();
}

std::string ElementOfF(const ParamMap& map, Index offset) {
  return fmt::format("element {} of F (offset {})",
                     FormatShape(UnravelIndex(offset, map.logical_shape())), offset);
}

Status CheckShards(const ParamMap& map, std::span<const ConstBuffer> shards) {
  if (shards.size() != static_cast<size_t>(map.world_size())) {
    return FailedPreconditionError(fmt::format("{} shard buffers given for a map of world size {}",
                                               shards.size(), map.world_size()));
  }
  for (Rank r = 0; r < map.world_size(); ++r) {
    const ConstBuffer& s = shards[static_cast<size_t>(r)];
    RESHARD_RETURN_IF_ERROR(CheckShard(map, r, s.num_elements, s.data));
  }
  return Status::Ok();
}

// Rebuilding F (or the part of it that replicated pieces cover) from the shards: the copies of
// the first holder of every piece into F, and, with verify_replicas, the comparisons of every
// other holder's piece against what those copies write. `f` is the address of F's element
// `f_origin`.
struct RebuildMoves {
  std::vector<StridedMove> writes;
  std::vector<std::pair<Rank, size_t>> write_pieces;  // (rank, piece index) of each write
  std::vector<StridedCompareMove> checks;
  std::vector<std::pair<Rank, size_t>> check_pieces;
};

Result<RebuildMoves> MakeRebuildMoves(const ParamMap& map, DType dtype,
                                      std::span<const ConstBuffer> shards, std::byte* f,
                                      Index f_origin, bool replicated_only,
                                      const ExecOptions& options) {
  const Index es = static_cast<Index>(DTypeSize(dtype));
  RebuildMoves out;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const std::vector<Piece>& pieces = map.rank(r).pieces;
    const std::byte* shard = shards[static_cast<size_t>(r)].data;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& piece = pieces[i];
      if (replicated_only && piece.locations.size() < 2) continue;
      const bool primary = piece.locations.empty() || piece.locations.front() == r;
      if (!primary && !options.verify_replicas) continue;
      RESHARD_ASSIGN_OR_RETURN(const PieceOps ops, OpsFor(piece, r, i, dtype, options));
      if (piece.num_elements() == 0) continue;
      const std::byte* src = shard + piece.dest.offset * es;
      std::byte* dst = f + (piece.source.offset - f_origin) * es;
      if (primary) {
        out.writes.push_back(
            {piece.shape, src, piece.dest.strides, dst, piece.source.strides, ops.rebuild});
        out.write_pieces.emplace_back(r, i);
      } else {
        out.checks.push_back(
            {piece.shape, src, piece.dest.strides, dst, piece.source.strides, ops.rebuild});
        out.check_pieces.emplace_back(r, i);
      }
    }
  }
  return out;
}

// Compares every other holder's piece against what the first holders wrote (P2).
Status CompareReplicas(const ParamMap& map, DType dtype, const RebuildMoves& moves,
                       int num_threads) {
  if (moves.checks.empty()) return Status::Ok();
  auto offset_in_f = [&](const CompareMismatch& m) {
    const auto [rank, index] = moves.check_pieces[m.move_index];
    return map.rank(rank).pieces[index].source.offset + m.ref_offset;
  };
  RESHARD_ASSIGN_OR_RETURN(
      const std::optional<CompareMismatch> mismatch,
      StridedCompare(
          dtype, moves.checks,
          [&](const CompareMismatch& m) { return !map.IsPadding(offset_in_f(m)); }, num_threads));
  if (!mismatch) return Status::Ok();
  const auto [rank, index] = moves.check_pieces[mismatch->move_index];
  const Rank holder = map.rank(rank).pieces[index].locations.front();
  return FailedPreconditionError(fmt::format("ranks {} and {} hold different data for {}: {} vs {}",
                                             holder, rank, ElementOfF(map, offset_in_f(*mismatch)),
                                             FormatElement(dtype, mismatch->ref_value),
                                             FormatElement(dtype, mismatch->value)));
}

// Replicas with identical bytes agree whatever their scale does, so a replica held at the same
// scale and at the same place of F as a piece of its first holder is compared with that
// piece's bytes directly, shard to shard, without rebuilding anything. True when every
// replica of the map could be compared that way and all agree; false sends the caller to the
// comparison in F, which decides (and names the element) in every other case.
Result<bool> ReplicasMatchByteForByte(const ParamMap& map, DType dtype,
                                      std::span<const ConstBuffer> shards, int num_threads) {
  const Index es = static_cast<Index>(DTypeSize(dtype));
  std::vector<StridedCompareMove> pairs;
  for (Rank r = 0; r < map.world_size(); ++r) {
    for (const Piece& piece : map.rank(r).pieces) {
      if (piece.locations.size() < 2 || piece.locations.front() == r) continue;
      if (piece.num_elements() == 0) continue;
      const Rank holder = piece.locations.front();
      const std::vector<Piece>& theirs = map.rank(holder).pieces;
      auto twin = std::find_if(theirs.begin(), theirs.end(), [&](const Piece& q) {
        return q.shape == piece.shape && q.source == piece.source && q.scale == piece.scale;
      });
      if (twin == theirs.end()) return false;
      pairs.push_back({piece.shape, shards[static_cast<size_t>(r)].data + piece.dest.offset * es,
                       piece.dest.strides,
                       shards[static_cast<size_t>(holder)].data + twin->dest.offset * es,
                       twin->dest.strides, ScaleOp::None()});
    }
  }
  RESHARD_ASSIGN_OR_RETURN(const std::optional<CompareMismatch> mismatch,
                           StridedCompare(dtype, pairs, {}, num_threads));
  return !mismatch.has_value();
}

}  // namespace

Status Extract(const ParamMap& map, DType dtype, Rank rank, ConstBuffer full, MutableBuffer shard,
               const ExecOptions& options) {
  if (rank < 0 || rank >= map.world_size()) {
    return InvalidArgumentError(
        fmt::format("rank {} is outside the map's world of size {}", rank, map.world_size()));
  }
  RESHARD_RETURN_IF_ERROR(CheckFull(map, full.num_elements, full.data));
  RESHARD_RETURN_IF_ERROR(CheckShard(map, rank, shard.num_elements, shard.data));
  const Index es = static_cast<Index>(DTypeSize(dtype));
  const std::vector<Piece>& pieces = map.rank(rank).pieces;
  std::vector<StridedMove> moves;
  std::vector<size_t> piece_of;  // moves[k] copies pieces[piece_of[k]]
  moves.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& piece = pieces[i];
    RESHARD_ASSIGN_OR_RETURN(const PieceOps ops, OpsFor(piece, rank, i, dtype, options));
    if (piece.num_elements() == 0) continue;
    moves.push_back({piece.shape, full.data + piece.source.offset * es, piece.source.strides,
                     shard.data + piece.dest.offset * es, piece.dest.strides, ops.extract});
    piece_of.push_back(i);
  }
  return CopyExactly(dtype, moves, options, [&](const InexactElement& e) {
    const size_t i = piece_of[e.move_index];
    return InexactError(PiecePath(rank, i), ElementOfF(map, pieces[i].source.offset + e.src_offset),
                        dtype, moves[e.move_index].op, e);
  });
}

Status Rebuild(const ParamMap& map, DType dtype, std::span<const ConstBuffer> shards,
               MutableBuffer full, const ExecOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckShards(map, shards));
  RESHARD_RETURN_IF_ERROR(CheckFull(map, full.num_elements, full.data));
  RESHARD_ASSIGN_OR_RETURN(
      const RebuildMoves moves,
      MakeRebuildMoves(map, dtype, shards, full.data, 0, /*replicated_only=*/false, options));
  // Padding first, so pieces that do hold padding overwrite the zeros.
  if (map.has_padding()) {
    RESHARD_RETURN_IF_ERROR(ZeroPadding(map, dtype, full.data, options.num_threads));
  }
  // The lowest-ranked holders' pieces are disjoint in F: one pass, in parallel.
  RESHARD_RETURN_IF_ERROR(CopyExactly(dtype, moves.writes, options, [&](const InexactElement& e) {
    const auto [rank, index] = moves.write_pieces[e.move_index];
    return InexactError(PiecePath(rank, index),
                        ElementOfF(map, map.rank(rank).pieces[index].source.offset + e.dst_offset),
                        dtype, moves.writes[e.move_index].op, e);
  }));
  return CompareReplicas(map, dtype, moves, options.num_threads);
}

Status VerifyReplicas(const ParamMap& map, DType dtype, std::span<const ConstBuffer> shards,
                      const ExecOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckShards(map, shards));
  RESHARD_ASSIGN_OR_RETURN(const bool identical,
                           ReplicasMatchByteForByte(map, dtype, shards, options.num_threads));
  if (identical) return Status::Ok();
  // The span of F that replicated pieces cover.
  Index begin = std::numeric_limits<Index>::max();
  Index end = 0;
  for (const RankShard& shard : map.ranks()) {
    for (const Piece& piece : shard.pieces) {
      if (piece.locations.size() < 2 || piece.num_elements() == 0) continue;
      const std::optional<Index> last =
          LastOffset(piece.source.offset, piece.shape, piece.source.strides);
      begin = std::min(begin, piece.source.offset);
      end = std::max(end, last.value_or(piece.source.offset) + 1);
    }
  }
  if (end <= begin) return Status::Ok();
  // Every element compared is written first, so the buffer needs no zeroing.
  const auto span = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(end - begin) *
                                                                DTypeSize(dtype));
  ExecOptions verify = options;
  verify.verify_replicas = true;
  RESHARD_ASSIGN_OR_RETURN(
      const RebuildMoves moves,
      MakeRebuildMoves(map, dtype, shards, span.get(), begin, /*replicated_only=*/true, verify));
  RESHARD_RETURN_IF_ERROR(StridedCopy(dtype, moves.writes, options.num_threads));
  return CompareReplicas(map, dtype, moves, options.num_threads);
}

namespace {

// Checks that the view of `shape` at `view` lies inside a buffer of `size` elements.
Status CheckView(std::span<const Index> shape, const StridedView& view, Index size,
                 std::string_view what) {
  if (ProductOf(shape) == 0) return Status::Ok();
  for (Index s : view.strides) {
    if (s < 0) return OutOfRangeError(fmt::format("{} has a negative stride", what));
  }
  auto last = LastOffset(view.offset, shape, view.strides);
  if (view.offset < 0 || !last || *last >= size) {
    return OutOfRangeError(
        fmt::format("{} reaches past the end of a shard of {} elements", what, size));
  }
  return Status::Ok();
}

}  // namespace

Status ExecutePlan(const ParamPlan& plan, DType dtype, std::span<const ConstBuffer> sources,
                   std::span<const MutableBuffer> targets, const ExecOptions& options) {
  if (static_cast<int>(sources.size()) != plan.source_world ||
      static_cast<int>(targets.size()) != plan.target_world) {
    return FailedPreconditionError(
        fmt::format("the plan moves {} source shards to {} target shards but {} and {} were given",
                    plan.source_world, plan.target_world, sources.size(), targets.size()));
  }
  const size_t elem = DTypeSize(dtype);
  std::vector<StridedMove> moves;
  std::vector<size_t> move_of;  // moves[k] runs plan.moves[move_of[k]]
  moves.reserve(plan.moves.size());
  for (size_t i = 0; i < plan.moves.size(); ++i) {
    const Move& m = plan.moves[i];
    const std::string what = fmt::format("moves[{}]", i);
    if (m.src_rank < 0 || m.src_rank >= plan.source_world || m.dst_rank < 0 ||
        m.dst_rank >= plan.target_world) {
      return OutOfRangeError(what + " names a rank outside the plan's worlds");
    }
    const ConstBuffer& src = sources[static_cast<size_t>(m.src_rank)];
    const MutableBuffer& dst = targets[static_cast<size_t>(m.dst_rank)];
    RESHARD_RETURN_IF_ERROR(CheckView(m.shape, m.src, src.num_elements, what + ".src"));
    RESHARD_RETURN_IF_ERROR(CheckView(m.shape, m.dst, dst.num_elements, what + ".dst"));
    ScaleOp op;
    const int p = options.scale_power;
    if (m.factor != 1.0 && p != 0) {
      if (p != 1 && !options.allow_scaled_optimizer_state) {
        return FailedPreconditionError(fmt::format(
            "{}: refusing to move a tensor of scale power {} through a factor of {}: an "
            "optimizer's learning rate and epsilon stay in the source coordinate, so a resumed "
            "run would silently diverge (allow scaled optimizer state to move it anyway)",
            what, p, m.factor));
      }
      double magnitude = 1.0;
      for (int k = 0; k < std::abs(p); ++k) magnitude *= m.factor;
      op = p > 0 ? ScaleOp::Multiply(magnitude) : ScaleOp::Divide(magnitude);
      RESHARD_RETURN_IF_ERROR(CheckScaleOp(dtype, op).Annotate(what));
    }
    if (m.num_elements() == 0) continue;
    moves.push_back(StridedMove{m.shape, src.data + static_cast<size_t>(m.src.offset) * elem,
                                m.src.strides, dst.data + static_cast<size_t>(m.dst.offset) * elem,
                                m.dst.strides, op});
    move_of.push_back(i);
  }
  for (size_t i = 0; i < plan.unwritten.size(); ++i) {
    const UnwrittenBlock& u = plan.unwritten[i];
    if (u.dst_rank < 0 || u.dst_rank >= plan.target_world) {
      return OutOfRangeError(fmt::format("unwritten[{}] names a rank outside the target world", i));
    }
    const MutableBuffer& dst = targets[static_cast<size_t>(u.dst_rank)];
    RESHARD_RETURN_IF_ERROR(
        CheckView(u.shape, u.dst, dst.num_elements, fmt::format("unwritten[{}]", i)));
  }
  RESHARD_RETURN_IF_ERROR(CopyExactly(dtype, moves, options, [&](const InexactElement& e) {
    const Move& m = plan.moves[move_of[e.move_index]];
    return InexactError(
        fmt::format("moves[{}] (source rank {} -> target rank {})", move_of[e.move_index],
                    m.src_rank, m.dst_rank),
        fmt::format("element {} of the target shard (element {} of the source shard)",
                    m.dst.offset + e.dst_offset, m.src.offset + e.src_offset),
        dtype, moves[e.move_index].op, e);
  }));
  for (const UnwrittenBlock& u : plan.unwritten) {
    if (ProductOf(u.shape) == 0) continue;
    const MutableBuffer& dst = targets[static_cast<size_t>(u.dst_rank)];
    RESHARD_RETURN_IF_ERROR(StridedZero(dtype, u.shape,
                                        dst.data + static_cast<size_t>(u.dst.offset) * elem,
                                        u.dst.strides, options.num_threads));
  }
  return Status::Ok();
}

}  // namespace reshard
