#include "reshard/ir/block_grid.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "reshard/base/status.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/infer.h"

namespace reshard {

namespace {

Index CeilDiv(Index a, Index b) { return a == 0 ? 0 : (a - 1) / b + 1; }

// `block` for a tensor of `ndim` dimensions: aligned to its last dimensions, 1 before.
Result<Shape> AlignBlock(size_t ndim, const Shape& block) {
  if (block.size() > ndim) {
    return InvalidArgumentError(
        fmt::format("block {} has more dimensions than a tensor of {}", FormatShape(block), ndim));
  }
  Shape out(ndim - block.size(), 1);
  for (Index b : block) {
    if (b < 1)
      return InvalidArgumentError(
          fmt::format("block {} has an extent below 1", FormatShape(block)));
    out.push_back(b);
  }
  return out;
}

// One dimension of a piece (extent > 1) as a step along one dimension of a space.
struct Step {
  int dim = 0;
  Index step = 0;
};

// The piece dimensions of a view into a dense tensor of `space`, each as a step along one of
// the space's dimensions, and the coordinates of the view's first element. Unimplemented when
// a dimension's stride is not a multiple of one space dimension's stride or its span crosses
// into the next dimension.
Status StepsOf(const Shape& piece_shape, const StridedView& view, const Shape& space,
               std::vector<Step>& steps, Shape& start) {
  const Shape strides = RowMajorStrides(space);
  start = UnravelIndex(view.offset, space);
  Shape reach = start;
  steps.assign(piece_shape.size(), Step{-1, 0});
  for (size_t k = 0; k < piece_shape.size(); ++k) {
    if (piece_shape[k] <= 1) continue;
    const Index s = view.strides[k];
    for (int j = static_cast<int>(space.size()) - 1; j >= 0; --j) {
      const auto u = static_cast<size_t>(j);
      if (space[u] > 1 && s >= strides[u] && s % strides[u] == 0 && s / strides[u] < space[u]) {
        steps[k] = Step{j, s / strides[u]};
        reach[u] += (piece_shape[k] - 1) * (s / strides[u]);
        break;
      }
    }
    if (steps[k].dim < 0) {
      return UnimplementedError(
          fmt::format("piece dimension {} (stride {}) does not step along one dimension of {}", k,
                      s, FormatShape(space)));
    }
  }
  for (size_t j = 0; j < space.size(); ++j) {
    if (reach[j] >= space[j]) {
      return UnimplementedError(
          fmt::format("a piece crosses dimension {} of {}", j, FormatShape(space)));
    }
  }
  return Status::Ok();
}

// One axis of the enumeration of a piece's scale elements: `count` values, each adding its
// entry of the offsets (flat, into the scale grid and the local grid).
struct Axis {
  // Listed (a blocked dimension's runs of local blocks) ...
  std::vector<Index> grid;   // flat offsets into the global scale grid
  std::vector<Index> local;  // flat offsets into the rank's local scale grid
  // ... or an arithmetic progression (an unblocked dimension), which costs nothing to hold.
  bool arithmetic = false;
  Index count = 0, grid_step = 0, local_step = 0;

  size_t size() const { return arithmetic ? static_cast<size_t>(count) : grid.size(); }
  Index G(size_t i) const { return arithmetic ? static_cast<Index>(i) * grid_step : grid[i]; }
  Index L(size_t i) const { return arithmetic ? static_cast<Index>(i) * local_step : local[i]; }
};

// The local blocks a run of `length` elements along a blocked dimension covers (from `dest`
// in the shard, reading `src` in the data) and the data block each takes.
Status BlockedRun(Index src, Index dest, Index length, Index block, int rank, size_t dim,
                  Index grid_stride, Index local_stride, Axis& axis) {
  for (Index beta = dest / block; beta <= (dest + length - 1) / block; ++beta) {
    const Index first = std::max(dest, beta * block);
    const Index last = std::min(dest + length, (beta + 1) * block) - 1;
    const Index g0 = (first - dest + src) / block, g1 = (last - dest + src) / block;
    if (g0 != g1) {
      return FailedPreconditionError(fmt::format(
          "rank {}'s local block {} along dimension {} (its elements {} to {}) would hold "
          "elements {} to {} of the data, which lie in blocks {} and {} of {}: one scale "
          "cannot describe it without requantizing",
          rank, beta, dim, first, last, first - dest + src, last - dest + src, g0, g1, block));
    }
    axis.grid.push_back(g0 * grid_stride);
    axis.local.push_back(beta * local_stride);
  }
  return Status::Ok();
}

// The axes of one piece's scale elements on `rank`: its blocked dimensions as runs of local
// blocks, its other dimensions as they step.
Status PieceAxes(const Piece& p, const Shape& data_shape, const Shape& data_block,
                 const Shape& dest_shape, const Shape& dest_block, int rank,
                 std::vector<Axis>& axes, Index& grid_base, Index& local_base) {
  std::vector<Step> src_steps, dst_steps;
  Shape src_start, dst_start;
  RESHARD_RETURN_IF_ERROR(StepsOf(p.shape, p.source, data_shape, src_steps, src_start));
  RESHARD_RETURN_IF_ERROR(StepsOf(p.shape, p.dest, dest_shape, dst_steps, dst_start));
  RESHARD_ASSIGN_OR_RETURN(const Shape grid, BlockGridShape(data_shape, data_block));
  RESHARD_ASSIGN_OR_RETURN(const Shape local, BlockGridShape(dest_shape, dest_block));
  const Shape gs = RowMajorStrides(grid), ls = RowMajorStrides(local);
  const size_t lead = dest_shape.size() - data_shape.size();
  grid_base = local_base = 0;
  // Unblocked dimensions: fixed coordinates, and each piece dimension that steps them.
  for (size_t j = 0; j < data_shape.size(); ++j) {
    if (data_block[j] == 1) grid_base += src_start[j] * gs[j];
  }
  for (size_t j = 0; j < dest_shape.size(); ++j) {
    if (dest_block[j] == 1) local_base += dst_start[j] * ls[j];
  }
  std::vector<int> run_of_dim(data_shape.size(), -1);  // the piece dim running along it
  for (size_t k = 0; k < p.shape.size(); ++k) {
    if (p.shape[k] <= 1) continue;
    const auto sj = static_cast<size_t>(src_steps[k].dim);
    const auto dj = static_cast<size_t>(dst_steps[k].dim);
    const bool src_blocked = data_block[sj] > 1, dst_blocked = dest_block[dj] > 1;
    if (!src_blocked && !dst_blocked) {
      Axis a;
      a.arithmetic = true;
      a.count = p.shape[k];
      a.grid_step = src_steps[k].step * gs[sj];
      a.local_step = dst_steps[k].step * ls[dj];
      axes.push_back(std::move(a));
      continue;
    }
    const Index src_step = src_steps[k].step, dst_step = dst_steps[k].step;
    if (src_blocked && dst_blocked && dj == sj + lead && src_step > 1 && dst_step > 1 &&
        src_step % data_block[sj] == 0 && dst_step % dest_block[dj] == 0) {
      // Runs whole blocks apart in the data and in the shard (a fused layout's parts): each
      // repeats the first's blocks, shifted by whole blocks.
      Axis a;
      a.arithmetic = true;
      a.count = p.shape[k];
      a.grid_step = src_step / data_block[sj] * gs[sj];
      a.local_step = dst_step / dest_block[dj] * ls[dj];
      axes.push_back(std::move(a));
      continue;
    }
    if (!src_blocked || !dst_blocked || dj != sj + lead || src_steps[k].step != 1 ||
        dst_steps[k].step != 1 || run_of_dim[sj] >= 0) {
      // Exactness is checked run by run: a piece that takes the dimension in several runs,
      // strided, or onto another dimension of the shard is refused as a local block over two
      // blocks is (a check the map fails, not a malformed map).
      return FailedPreconditionError(fmt::format(
          "rank {}: a piece ({}) takes blocked dimension {} of the data other than in one "
          "contiguous run onto the same dimension of the shard, so its local blocks may hold "
          "elements of several blocks of the data; reshard gives a rank a block's scale only "
          "where each of its local blocks lies inside one block",
          rank, FormatShape(p.shape), sj));
    }
    run_of_dim[sj] = static_cast<int>(k);
  }
  // Blocked dimensions: one run each (a single element when no piece dimension steps it).
  for (size_t j = 0; j < data_shape.size(); ++j) {
    if (data_block[j] == 1) continue;
    if (dest_block[j + lead] != data_block[j]) {
      return UnimplementedError(fmt::format(
          "rank {}: blocked dimension {} lands on a shard dimension of another block", rank, j));
    }
    const Index length = run_of_dim[j] >= 0 ? p.shape[static_cast<size_t>(run_of_dim[j])] : 1;
    Axis a;
    RESHARD_RETURN_IF_ERROR(BlockedRun(src_start[j], dst_start[j + lead], length, data_block[j],
                                       rank, j, gs[j], ls[j + lead], a));
    axes.push_back(std::move(a));
  }
  return Status::Ok();
}

// Writes the scale index of every element the axes enumerate into `index` (the local grid's
// row-major entries); FailedPrecondition when an element is given two different blocks.
Status FillIndex(const std::vector<Axis>& axes, Index grid_base, Index local_base, int rank,
                 std::vector<Index>& index) {
  std::vector<size_t> at(axes.size(), 0);
  for (const Axis& a : axes) {
    if (a.size() == 0) return Status::Ok();
  }
  while (true) {
    Index g = grid_base, l = local_base;
    for (size_t i = 0; i < axes.size(); ++i) {
      g += axes[i].G(at[i]);
      l += axes[i].L(at[i]);
    }
    Index& slot = index[static_cast<size_t>(l)];
    if (slot >= 0 && slot != g) {
      return FailedPreconditionError(fmt::format(
          "rank {}'s local block at scale offset {} would take elements of two blocks of the data "
          "(scale offsets {} and {}): one scale cannot describe it without requantizing",
          rank, l, slot, g));
    }
    slot = g;
    size_t i = axes.size();
    while (true) {
      if (i == 0) return Status::Ok();
      --i;
      if (++at[i] < axes[i].size()) break;
      at[i] = 0;
    }
  }
}

// A rank's local grid shaped as the scales are stored: the stored shape's dimensions, each
// the local extent of the grid dimension it stands for (unit dimensions the stored shape adds
// stay 1). An empty local grid is stored with a zero first dimension.
Shape StoredLocalShape(const Shape& grid, const Shape& stored, const Shape& local) {
  Shape out(stored.size(), 1);
  size_t g = 0;
  for (size_t j = 0; j < stored.size(); ++j) {
    if (stored[j] == 1) continue;
    while (g < grid.size() && grid[g] == 1) ++g;
    if (g < grid.size()) out[j] = local[g++];
  }
  if (ProductOf(local) == 0 && !out.empty()) out[0] = 0;
  return out;
}

// Every rank holds the one scale of a per-tensor quantized tensor.
Result<ParamMap> ReplicatedScale(const ParamMap& data, const Shape& scale_shape) {
  ParamMapBuilder b;
  b.set_logical_shape(scale_shape).set_world_size(data.world_size());
  std::vector<Rank> all;
  for (Rank r = 0; r < data.world_size(); ++r) all.push_back(r);
  const Shape strides = RowMajorStrides(scale_shape);
  for (Rank r = 0; r < data.world_size(); ++r) {
    b.set_shard_shape(r, scale_shape);
    b.add_piece(r, Piece{scale_shape, {0, strides}, {0, strides}, all, 1.0});
  }
  return b.Finalize();
}

}  // namespace

Result<Shape> BlockGridShape(const Shape& shape, const Shape& block) {
  RESHARD_ASSIGN_OR_RETURN(const Shape aligned, AlignBlock(shape.size(), block));
  Shape grid(shape.size());
  for (size_t j = 0; j < shape.size(); ++j) grid[j] = CeilDiv(shape[j], aligned[j]);
  return grid;
}

Status CheckBlockScaleDType(std::string_view format, std::string_view scale, std::string_view data,
                            DType dtype) {
  std::vector<DType> stored;
  if (format == "fp8-block" || format == "fp8-tensor" || format == "fp8-channel") {
    stored = {DType::kF32, DType::kBF16, DType::kF16};
  } else if (format == "mxfp4") {
    stored = {DType::kU8};
  } else if (format == "nvfp4") {
    stored = {DType::kF8E4M3, DType::kF32, DType::kBF16, DType::kF16};
  } else {
    return InvalidArgumentError(
        fmt::format("the scales \"{}\" of \"{}\" are of format \"{}\", which reshard does not know "
                    "(fp8-block, fp8-tensor, fp8-channel, mxfp4, nvfp4)",
                    scale, data, format));
  }
  if (std::find(stored.begin(), stored.end(), dtype) != stored.end()) return Status::Ok();
  std::vector<std::string_view> names;
  for (DType d : stored) names.push_back(DTypeName(d));
  return FailedPreconditionError(
      fmt::format("the scales \"{}\" of \"{}\" are {}, which {} does not store its block scales "
                  "in (it stores {}{})",
                  scale, data, DTypeName(dtype), format, fmt::join(names, ", "),
                  format == "mxfp4" ? ": E8M0 exponents, one byte each" : ""));
}

bool MatchesGrid(const Shape& stored, const Shape& grid) {
  Shape a, b;
  for (Index x : stored)
    if (x != 1) a.push_back(x);
  for (Index x : grid)
    if (x != 1) b.push_back(x);
  return a == b;
}

namespace {

// One rank of a block image being built: its local grid as stored, its buffer, and the axes of
// the scale elements each of its data pieces touches.
struct ImageRank {
  Shape stored;  // the scale shard's shape (or the scale buffer's)
  Index local_size = 0;
  std::string buffer;
  struct PieceAxes {
    std::vector<Axis> axes;
    Index grid_base = 0, local_base = 0;
  };
  std::vector<PieceAxes> pieces;
};

// Runs of an axis along which both offsets step by one non-zero grid step and one local step.
std::vector<std::pair<size_t, size_t>> RunsOf(const Axis& a) {
  std::vector<std::pair<size_t, size_t>> runs;  // [begin, end)
  if (a.arithmetic) return {{0, a.size()}};
  size_t begin = 0;
  for (size_t i = 1; i <= a.grid.size(); ++i) {
    const bool extends =
        i < a.grid.size() && a.grid[i] != a.grid[i - 1] &&
        (i - begin < 2 || (a.grid[i] - a.grid[i - 1] == a.grid[begin + 1] - a.grid[begin] &&
                           a.local[i] - a.local[i - 1] == a.local[begin + 1] - a.local[begin]));
    if (!extends) {
      runs.emplace_back(begin, i);
      begin = i;
    }
  }
  return runs;
}

// The scale pieces of one data piece (locations unset): one per combination of runs.
void EmitPieces(const ImageRank::PieceAxes& pa, std::vector<Piece>& out) {
  std::vector<std::vector<std::pair<size_t, size_t>>> runs;
  for (const Axis& a : pa.axes) {
    if (a.size() == 0) return;
    runs.push_back(RunsOf(a));
  }
  std::vector<size_t> at(runs.size(), 0);
  while (true) {
    Piece p;
    p.source.offset = pa.grid_base;
    p.dest.offset = pa.local_base;
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto [b, e] = runs[i][at[i]];
      const Axis& a = pa.axes[i];
      p.source.offset += a.G(b);
      p.dest.offset += a.L(b);
      if (e - b < 2) continue;
      p.shape.push_back(static_cast<Index>(e - b));
      p.source.strides.push_back(a.G(b + 1) - a.G(b));
      p.dest.strides.push_back(a.L(b + 1) - a.L(b));
    }
    if (p.shape.empty()) {
      p.shape = {1};
      p.source.strides = {1};
      p.dest.strides = {1};
    }
    out.push_back(std::move(p));
    size_t i = runs.size();
    while (true) {
      if (i == 0) return;
      --i;
      if (++at[i] < runs[i].size()) break;
      at[i] = 0;
    }
  }
}

// The image from its pieces: each piece held by the ranks whose pieces reach into the same
// range of the scale grid. Fails (and the caller takes the element path) when that guess is not
// the pieces' true holders, or a rank's pieces write a local scale twice.
Result<ParamMap> ImageFromPieces(const std::vector<ImageRank>& ranks, const Shape& scale_shape) {
  std::vector<std::vector<Piece>> pieces(ranks.size());
  struct Range {
    Index lo, hi;
    Rank rank;
  };
  std::vector<Range> ranges;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const ImageRank::PieceAxes& pa : ranks[r].pieces) EmitPieces(pa, pieces[r]);
    for (const Piece& p : pieces[r]) {
      const Index hi = *LastOffset(p.source.offset, p.shape, p.source.strides);
      ranges.push_back({p.source.offset, hi, static_cast<Rank>(r)});
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.lo < b.lo; });
  ParamMapBuilder b;
  b.set_logical_shape(scale_shape).set_world_size(static_cast<int>(ranks.size()));
  for (size_t r = 0; r < ranks.size(); ++r) {
    b.set_shard_shape(static_cast<Rank>(r), ranks[r].stored);
    if (!ranks[r].buffer.empty()) b.set_buffer(static_cast<Rank>(r), ranks[r].buffer);
    for (Piece& p : pieces[r]) {
      const Index hi = *LastOffset(p.source.offset, p.shape, p.source.strides);
      std::vector<Rank> holders;
      for (const Range& q : ranges) {
        if (q.lo > hi) break;
        if (q.hi >= p.source.offset) holders.push_back(q.rank);
      }
      std::sort(holders.begin(), holders.end());
      holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
      p.locations = std::move(holders);
      b.add_piece(static_cast<Rank>(r), std::move(p));
    }
  }
  return b.Finalize();
}

// The image from the scale index of every local element (Infer): exact whatever the holders,
// at a cost in scale elements.
Result<ParamMap> ImageFromElements(const std::vector<ImageRank>& ranks, const Shape& scale_shape) {
  constexpr Index kMaxElements = Index{1} << 26;
  Index total = 0;
  for (const ImageRank& r : ranks) total += r.local_size;
  if (total > kMaxElements) {
    return ResourceExhaustedError(fmt::format(
        "the block image splits blocks between ranks in a way reshard resolves element by "
        "element, and its {} scale elements are more than {}",
        total, kMaxElements));
  }
  IndexMaps observed{scale_shape, std::nullopt, {}};
  for (size_t r = 0; r < ranks.size(); ++r) {
    ObservedShard obs;
    obs.rank = static_cast<Rank>(r);
    obs.shard_shape = ranks[r].stored;
    obs.buffer = ranks[r].buffer;
    obs.index_map.assign(static_cast<size_t>(ranks[r].local_size), -1);
    for (const ImageRank::PieceAxes& pa : ranks[r].pieces) {
      RESHARD_RETURN_IF_ERROR(
          FillIndex(pa.axes, pa.grid_base, pa.local_base, obs.rank, obs.index_map));
    }
    observed.ranks.push_back(std::move(obs));
  }
  return Infer(observed);
}

}  // namespace

Result<ParamMap> BlockImage(const ParamMap& data_in, const Shape& block, const Shape& scale_shape,
                            const BlockImageOptions& options) {
  const Shape& shape = data_in.logical_shape();
  if (block.size() != shape.size()) {
    return InvalidArgumentError(
        fmt::format("block {} for data of shape {}: one extent per dimension", FormatShape(block),
                    FormatShape(shape)));
  }
  RESHARD_ASSIGN_OR_RETURN(const Shape grid, BlockGridShape(shape, block));
  if (!MatchesGrid(scale_shape, grid)) {
    return InvalidArgumentError(fmt::format(
        "scales of shape {} are not the block grid {} of data {} in blocks of {}",
        FormatShape(scale_shape), FormatShape(grid), FormatShape(shape), FormatShape(block)));
  }
  if (data_in.has_padding()) {
    return UnimplementedError("block-quantized data with padding (a valid_shape)");
  }
  if (ProductOf(grid) == 1) return ReplicatedScale(data_in, scale_shape);
  RESHARD_ASSIGN_OR_RETURN(const ParamMap data, Canonicalize(data_in));
  std::vector<ImageRank> ranks(static_cast<size_t>(data.world_size()));
  for (Rank r = 0; r < data.world_size(); ++r) {
    const RankShard& shard = data.rank(r);
    ImageRank& out = ranks[static_cast<size_t>(r)];
    if (shard.shard_shape.size() < shape.size()) {
      return UnimplementedError(
          fmt::format("rank {}'s shard {} has fewer dimensions than the data {}", r,
                      FormatShape(shard.shard_shape), FormatShape(shape)));
    }
    RESHARD_ASSIGN_OR_RETURN(const Shape dest_block, AlignBlock(shard.shard_shape.size(), block));
    RESHARD_ASSIGN_OR_RETURN(const Shape local, BlockGridShape(shard.shard_shape, dest_block));
    out.local_size = ProductOf(local);
    if (shard.is_buffered()) {
      if (!options.scale_buffer) {
        return InvalidArgumentError(
            fmt::format("rank {} holds the data in buffer \"{}\", and no scale buffer is named", r,
                        shard.buffer));
      }
      out.buffer = options.scale_buffer(r, shard.buffer);
      out.stored = local;
    } else {
      // The local grid, stored as the global one is: with the same unit dimensions.
      out.stored = StoredLocalShape(grid, scale_shape, local);
    }
    for (const Piece& p : shard.pieces) {
      if (p.num_elements() == 0) continue;
      ImageRank::PieceAxes pa;
      RESHARD_RETURN_IF_ERROR(PieceAxes(p, shape, block, shard.shard_shape, dest_block, r, pa.axes,
                                        pa.grid_base, pa.local_base));
      out.pieces.push_back(std::move(pa));
    }
  }
  if (Result<ParamMap> fast = ImageFromPieces(ranks, scale_shape); fast.ok()) {
    return Canonicalize(*fast);
  }
  return ImageFromElements(ranks, scale_shape);
}

namespace {

// MXFP4 data is stored [..., groups, 16] and vLLM's parameters hold it [..., groups x 16]. Where
// a rank's shard has fewer dimensions than the data and the block is 1 along the data's
// next-to-last dimension, the tie is checked on the data seen with its last two dimensions as
// one (the same elements in the same order: every piece's views unchanged) and the block
// [..., 1, b] as [..., b]. Anything else is returned as it is.
Result<std::pair<ParamMap, Shape>> WithMergedGroups(const ParamMap& data, const Shape& block) {
  const Shape& shape = data.logical_shape();
  const size_t nd = shape.size();
  bool fewer = false;
  for (Rank r = 0; r < data.world_size(); ++r) fewer |= data.rank(r).shard_shape.size() < nd;
  if (!fewer || nd < 2 || block.size() != nd || block[nd - 2] != 1 || block[nd - 1] <= 0 ||
      shape[nd - 1] % block[nd - 1] != 0 || data.has_padding()) {
    return std::pair{data, block};
  }
  Shape merged(shape.begin(), shape.end() - 2);
  merged.push_back(shape[nd - 2] * shape[nd - 1]);
  Shape merged_block(block.begin(), block.end() - 2);
  merged_block.push_back(block[nd - 1]);
  ParamMapBuilder b(data);
  b.set_logical_shape(merged).set_valid_shape(std::nullopt);
  RESHARD_ASSIGN_OR_RETURN(const ParamMap m, b.Finalize());
  RESHARD_ASSIGN_OR_RETURN(ParamMap canonical, Canonicalize(m));
  return std::pair{std::move(canonical), std::move(merged_block)};
}

}  // namespace

Status CheckBlockTie(const ParamMap& data_in, const ParamMap& scale, const Shape& block_in) {
  if (scale.world_size() != data_in.world_size()) {
    return FailedPreconditionError(fmt::format("the scales have {} ranks and the data {}",
                                               scale.world_size(), data_in.world_size()));
  }
  RESHARD_ASSIGN_OR_RETURN(const auto merged, WithMergedGroups(data_in, block_in));
  const auto& [data, block] = merged;
  BlockImageOptions options;
  options.scale_buffer = [&](Rank r, const std::string&) { return scale.rank(r).buffer; };
  RESHARD_ASSIGN_OR_RETURN(const ParamMap image,
                           BlockImage(data, block, scale.logical_shape(), options));
  RESHARD_ASSIGN_OR_RETURN(const ParamMap canonical, Canonicalize(scale));
  for (Rank r = 0; r < data.world_size(); ++r) {
    if (image.rank(r) == canonical.rank(r)) continue;
    return FailedPreconditionError(fmt::format(
        "on rank {} the scales' map is not the block image of the data's map in blocks of {} "
        "(expected shard {} with {} pieces, got shard {} with {})",
        r, FormatShape(block), FormatShape(image.rank(r).shard_shape), image.rank(r).pieces.size(),
        FormatShape(canonical.rank(r).shard_shape), canonical.rank(r).pieces.size()));
  }
  return Status::Ok();
}

}  // namespace reshard
