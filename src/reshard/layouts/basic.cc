#include "reshard/layouts/basic.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace reshard {

namespace {

Status CheckDim(const Shape& shape, int dim) {
  if (dim < 0 || static_cast<size_t>(dim) >= shape.size()) {
    return InvalidArgumentError(
        fmt::format("dimension {} is outside shape {}", dim, FormatShape(shape)));
  }
  return Status::Ok();
}

// A map of more pieces, or of more holder entries (a replicated piece lists every rank), than
// these would not fit in memory: such a layout is a typo (a count of parts or a world size),
// refused before anything is allocated for it.
constexpr Index kMaxSegmentedPieces = Index{1} << 22;
constexpr Index kMaxSegmentedHolders = Index{1} << 24;

}  // namespace

Status CheckSegmentCount(Index count, Index replicated, int world_size) {
  if (world_size < 1) return InvalidArgumentError("world size must be at least 1");
  const auto world = static_cast<Index>(world_size);
  // Both counts are compared by division, so that neither product can overflow.
  const bool too_many_pieces = count > kMaxSegmentedPieces / world;
  const bool too_many_holders = replicated > 0 && replicated > kMaxSegmentedHolders / world / world;
  if (too_many_pieces || too_many_holders) {
    return InvalidArgumentError(fmt::format(
        "{} segments at {} ranks make a map of more than {} pieces or {} holder entries", count,
        world_size, kMaxSegmentedPieces, kMaxSegmentedHolders));
  }
  return Status::Ok();
}

Result<ParamMap> ReplicatedMap(const Shape& shape, int world_size, double scale) {
  if (world_size < 1) return InvalidArgumentError("world size must be at least 1");
  ParamMapBuilder b;
  b.set_logical_shape(shape).set_world_size(world_size);
  std::vector<Rank> all;
  for (Rank r = 0; r < world_size; ++r) all.push_back(r);
  const Shape strides = RowMajorStrides(shape);
  for (Rank r = 0; r < world_size; ++r) {
    b.set_shard_shape(r, shape);
    b.add_piece(r, Piece{shape, {0, strides}, {0, strides}, all, scale});
  }
  return b.Finalize();
}

std::vector<Index> EvenSplitSizes(Index extent, int world_size) {
  std::vector<Index> sizes(static_cast<size_t>(std::max(world_size, 0)), 0);
  for (size_t r = 0; r < sizes.size(); ++r) {
    sizes[r] = extent / world_size + (static_cast<Index>(r) < extent % world_size ? 1 : 0);
  }
  return sizes;
}

Result<ParamMap> SplitMap(const Shape& shape, int dim, const std::vector<Index>& sizes) {
  return SegmentedMap(
      shape, dim,
      {Segment{
          dim >= 0 && static_cast<size_t>(dim) < shape.size() ? shape[static_cast<size_t>(dim)] : 0,
          false, sizes}},
      static_cast<int>(sizes.size()));
}

Result<ParamMap> SegmentedMap(const Shape& shape, int dim, const std::vector<Segment>& segments,
                              int world_size) {
  RESHARD_RETURN_IF_ERROR(CheckDim(shape, dim));
  if (world_size < 1) return InvalidArgumentError("world size must be at least 1");
  // Every offset below is at most the tensor's element count: bound that once.
  RESHARD_RETURN_IF_ERROR(CheckedProduct(shape).status());
  Index replicated = 0;
  for (const Segment& seg : segments) replicated += seg.replicated ? 1 : 0;
  RESHARD_RETURN_IF_ERROR(
      CheckSegmentCount(static_cast<Index>(segments.size()), replicated, world_size));
  const auto d = static_cast<size_t>(dim);
  Index total = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& seg = segments[s];
    if (seg.size < 0) return InvalidArgumentError(fmt::format("segment {} has a negative size", s));
    const std::optional<Index> next_total = CheckedAdd(total, seg.size);
    if (!next_total || *next_total > shape[d]) {
      return InvalidArgumentError(
          fmt::format("segments cover more than the {} indices of dimension {}", shape[d], dim));
    }
    total = *next_total;
    if (seg.replicated) continue;
    Index sum = 0;
    for (Index w : seg.widths) {
      if (w < 0) return InvalidArgumentError(fmt::format("segment {} has a negative width", s));
      const std::optional<Index> next_sum = CheckedAdd(sum, w);
      if (!next_sum) {
        return InvalidArgumentError(
            fmt::format("segment {} of {} indices has widths summing past 2^62", s, seg.size));
      }
      sum = *next_sum;
    }
    if (seg.widths.size() != static_cast<size_t>(world_size) || sum != seg.size) {
      return InvalidArgumentError(
          fmt::format("segment {} of {} indices is split as {} across {} ranks", s, seg.size,
                      fmt::join(seg.widths, "+"), world_size));
    }
  }
  if (total != shape[d]) {
    return InvalidArgumentError(fmt::format(
        "segments cover {} indices of dimension {} but it has {}", total, dim, shape[d]));
  }
  std::vector<Rank> all;
  for (Rank r = 0; r < world_size; ++r) all.push_back(r);
  const Shape full_strides = RowMajorStrides(shape);
  ParamMapBuilder b;
  b.set_logical_shape(shape).set_world_size(world_size);
  // Where rank r's width of each segment starts within it: the widths of ranks 0..r-1, kept
  // as the ranks are walked so that the map costs one pass per rank, not one per rank pair.
  std::vector<Index> rank_offset(segments.size(), 0);
  for (Rank r = 0; r < world_size; ++r) {
    Shape shard = shape;
    shard[d] = 0;
    for (const Segment& seg : segments)
      shard[d] += seg.replicated ? seg.size : seg.widths[static_cast<size_t>(r)];
    const Shape shard_strides = RowMajorStrides(shard);
    b.set_shard_shape(r, shard);
    Index seg_start = 0;
    Index dest_start = 0;
    for (size_t s = 0; s < segments.size(); ++s) {
      const Segment& seg = segments[s];
      Index start = seg_start;
      Index width = seg.size;
      if (!seg.replicated) {
        width = seg.widths[static_cast<size_t>(r)];
        start += rank_offset[s];
        rank_offset[s] += width;
      }
      if (width > 0) {
        Shape piece_shape = shape;
        piece_shape[d] = width;
        b.add_piece(r, Piece{piece_shape,
                             {start * full_strides[d], full_strides},
                             {dest_start * shard_strides[d], shard_strides},
                             seg.replicated ? all : std::vector<Rank>{r},
                             1.0});
      }
      dest_start += width;
      seg_start += seg.size;
    }
  }
  return b.Finalize();
}

Result<ParamMap> BlockGatherMap(const Shape& shape, int dim, Index num_blocks,
                                const std::vector<std::vector<Index>>& rank_blocks) {
  RESHARD_RETURN_IF_ERROR(CheckDim(shape, dim));
  const int world_size = static_cast<int>(rank_blocks.size());
  if (world_size < 1) return InvalidArgumentError("world size must be at least 1");
  const auto d = static_cast<size_t>(dim);
  // Every block gets a list of holders, so the count is bounded before it is allocated.
  constexpr Index kMaxBlocks = Index{1} << 20;
  if (num_blocks > kMaxBlocks) {
    return InvalidArgumentError(fmt::format(
        "{} blocks are more than the {} a map may cut a dimension into", num_blocks, kMaxBlocks));
  }
  if (num_blocks < 1 || shape[d] % num_blocks != 0) {
    return InvalidArgumentError(
        fmt::format("dimension {} of {} indices cannot be cut into {} equal blocks", dim, shape[d],
                    num_blocks));
  }
  const Index block = shape[d] / num_blocks;
  std::vector<std::vector<Rank>> holders(static_cast<size_t>(num_blocks));
  for (Rank r = 0; r < world_size; ++r) {
    for (Index id : rank_blocks[static_cast<size_t>(r)]) {
      if (id < 0 || id >= num_blocks) {
        return InvalidArgumentError(
            fmt::format("rank {} lists block {}, outside 0..{}", r, id, num_blocks - 1));
      }
      std::vector<Rank>& h = holders[static_cast<size_t>(id)];
      if (!h.empty() && h.back() == r) {
        return InvalidArgumentError(fmt::format("rank {} lists block {} twice", r, id));
      }
      h.push_back(r);
    }
  }
  for (Index id = 0; id < num_blocks; ++id) {
    if (holders[static_cast<size_t>(id)].empty()) {
      return InvalidArgumentError(fmt::format("block {} of {} is held by no rank", id, num_blocks));
    }
  }
  const Shape full_strides = RowMajorStrides(shape);
  ParamMapBuilder b;
  b.set_logical_shape(shape).set_world_size(world_size);
  for (Rank r = 0; r < world_size; ++r) {
    const std::vector<Index>& ids = rank_blocks[static_cast<size_t>(r)];
    Shape shard = shape;
    shard[d] = static_cast<Index>(ids.size()) * block;
    const Shape shard_strides = RowMajorStrides(shard);
    b.set_shard_shape(r, shard);
    Shape piece_shape = shape;
    piece_shape[d] = block;
    if (block == 0) continue;
    for (size_t k = 0; k < ids.size(); ++k) {
      b.add_piece(r, Piece{piece_shape,
                           {ids[k] * block * full_strides[d], full_strides},
                           {static_cast<Index>(k) * block * shard_strides[d], shard_strides},
                           holders[static_cast<size_t>(ids[k])],
                           1.0});
    }
  }
  return b.Finalize();
}

}  // namespace reshard
