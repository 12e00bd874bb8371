#include "reshard/ir/param_map.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "reshard/ir/box_cover.h"

namespace reshard {

using internal::BoxSet;
using internal::PaddingSpec;
using internal::Radix;

namespace {

// Validation stores one [lo, hi) pair per radix digit for each box and sweeps the boxes, so
// both its memory and its time grow with boxes x digits. They are bounded per map: all checks
// together may build at most kMaxBoxDigits box-digits (64 MB of bounds, about a second of
// sweeping); beyond that the map is refused as too fragmented. (A count of boxes per check
// bounded neither: a 300-byte map with a 40-digit radix, or with many fragmented ranks,
// needed gigabytes and minutes.)
constexpr size_t kMaxBoxDigits = size_t{1} << 22;

// How many boxes of `radix` fit in what is left of the budget.
size_t BoxLimit(const Radix& radix, size_t used_digits) {
  if (used_digits >= kMaxBoxDigits) return 0;
  return (kMaxBoxDigits - used_digits) / static_cast<size_t>(std::max(radix.rank(), 1));
}

std::string FormatRanks(std::span<const Rank> ranks) {
  return fmt::format("[{}]", fmt::join(ranks, ", "));
}

Status CheckShape(const Shape& shape, std::string_view what) {
  auto n = CheckedProduct(shape);
  if (!n.ok()) return n.status().Annotate(what);
  return Status::Ok();
}

// Checks one piece on its own: lengths, signs, locations, scale, and that both views lie
// inside their buffers.
Status CheckPiece(Piece& piece, Rank rank, int world, Index full_elems, Index shard_elems) {
  const size_t nd = piece.shape.size();
  if (piece.source.strides.size() != nd || piece.dest.strides.size() != nd) {
    return InvalidArgumentError(
        fmt::format("shape has {} dimensions but source has {} strides and dest has {}", nd,
                    piece.source.strides.size(), piece.dest.strides.size()));
  }
  auto numel = CheckedProduct(piece.shape);
  if (!numel.ok()) return numel.status();
  for (size_t k = 0; k < nd; ++k) {
    if (piece.source.strides[k] < 0 || piece.dest.strides[k] < 0) {
      return InvalidArgumentError(
          fmt::format("negative stride on dimension {} (source {}, dest {})", k,
                      piece.source.strides[k], piece.dest.strides[k]));
    }
    if (*numel > 0 && piece.shape[k] > 1 &&
        (piece.source.strides[k] == 0 || piece.dest.strides[k] == 0)) {
      return InvalidArgumentError(fmt::format(
          "stride 0 on dimension {} of extent {} repeats one element; replication is said "
          "with locations, not with a zero stride",
          k, piece.shape[k]));
    }
  }
  if (piece.source.offset < 0 || piece.dest.offset < 0) {
    return OutOfRangeError(fmt::format("negative offset (source {}, dest {})", piece.source.offset,
                                       piece.dest.offset));
  }
  if (!std::isfinite(piece.scale) || piece.scale == 0.0) {
    return InvalidArgumentError(
        fmt::format("scale {} is not a finite non-zero number", piece.scale));
  }
  if (piece.locations.empty()) {
    return InvalidArgumentError("locations is empty; it must list every rank holding the piece");
  }
  std::sort(piece.locations.begin(), piece.locations.end());
  for (size_t i = 0; i < piece.locations.size(); ++i) {
    const Rank r = piece.locations[i];
    if (r < 0 || r >= world) {
      return InvalidArgumentError(
          fmt::format("locations names rank {}, outside the world of {} ranks", r, world));
    }
    if (i > 0 && piece.locations[i - 1] == r) {
      return InvalidArgumentError(fmt::format("locations names rank {} twice", r));
    }
  }
  if (!std::binary_search(piece.locations.begin(), piece.locations.end(), rank)) {
    return InvalidArgumentError(
        fmt::format("locations {} do not include rank {}, which lists the piece",
                    FormatRanks(piece.locations), rank));
  }
  if (*numel == 0) return Status::Ok();
  auto source_end = LastOffset(piece.source.offset, piece.shape, piece.source.strides);
  if (!source_end || *source_end >= full_elems) {
    return OutOfRangeError(source_end
                               ? fmt::format("source view ends at offset {} but F has {} elements",
                                             *source_end + 1, full_elems)
                               : std::string("source view overflows 2^62 elements"));
  }
  auto dest_end = LastOffset(piece.dest.offset, piece.shape, piece.dest.strides);
  if (!dest_end || *dest_end >= shard_elems) {
    return OutOfRangeError(
        dest_end ? fmt::format("dest view ends at offset {} but the shard has {} elements",
                               *dest_end + 1, shard_elems)
                 : std::string("dest view overflows 2^62 elements"));
  }
  return Status::Ok();
}

// Exact shards: every element of the rank's shard is written by exactly one piece element (of a
// shared buffer: at most one).
Status CheckShardExact(const RankShard& shard, Rank rank, size_t& used_digits) {
  const Index n = ProductOf(shard.shard_shape);
  Index held = 0;
  for (const Piece& p : shard.pieces) held += p.num_elements();
  if (n == 0 && held == 0) return Status::Ok();
  std::vector<Index> candidates;
  for (const Piece& p : shard.pieces) {
    candidates.insert(candidates.end(), p.dest.strides.begin(), p.dest.strides.end());
  }
  const Radix radix = Radix::Build(n, RowMajorStrides(shard.shard_shape), candidates);
  BoxSet boxes(radix);
  for (size_t i = 0; i < shard.pieces.size(); ++i) {
    const Piece& p = shard.pieces[i];
    RESHARD_RETURN_IF_ERROR(boxes
                                .AddView(p.dest.offset, p.shape, p.dest.strides,
                                         static_cast<int32_t>(i), BoxLimit(radix, used_digits))
                                .Annotate(RankPath(rank)));
  }
  used_digits += boxes.size() * static_cast<size_t>(radix.rank());
  return internal::SweepCells(
      boxes, PaddingSpec{},
      [&](std::span<const Index> cell_lo, std::span<const int32_t> active, bool) -> Status {
        if (active.size() == 1) return Status::Ok();
        // Elements of a shared buffer that this map does not write belong to other maps.
        if (active.empty() && shard.is_buffered()) return Status::Ok();
        const Shape where =
            UnravelIndex(internal::OffsetOfDigits(radix, cell_lo), shard.shard_shape);
        if (active.empty()) {
          return InvalidArgumentError(fmt::format(
              "{}: shard element {} (shard shape {}) is written by no piece; its "
              "pieces account for {} of {} elements",
              RankPath(rank), FormatShape(where), FormatShape(shard.shard_shape), held, n));
        }
        return InvalidArgumentError(
            fmt::format("{}: shard element {} is written by pieces {} and {}", RankPath(rank),
                        FormatShape(where), boxes.tag(static_cast<size_t>(active[0])),
                        boxes.tag(static_cast<size_t>(active[1]))));
      });
}

// Coverage (P1), homogeneity, and that no rank holds an element of F twice.
Status CheckSourceCover(const Shape& logical, const Shape& valid,
                        const std::vector<RankShard>& ranks, bool require_coverage,
                        size_t used_digits) {
  const Index n = ProductOf(logical);
  if (n == 0) return Status::Ok();
  std::vector<Index> candidates;
  struct Ref {
    Rank rank;
    int32_t piece;
  };
  std::vector<Ref> refs;
  for (const RankShard& shard : ranks) {
    for (const Piece& p : shard.pieces) {
      candidates.insert(candidates.end(), p.source.strides.begin(), p.source.strides.end());
    }
  }
  const Radix radix = Radix::Build(n, RowMajorStrides(logical), candidates);
  BoxSet boxes(radix);
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (size_t i = 0; i < ranks[r].pieces.size(); ++i) {
      const Piece& p = ranks[r].pieces[i];
      const auto tag = static_cast<int32_t>(refs.size());
      refs.push_back({static_cast<Rank>(r), static_cast<int32_t>(i)});
      RESHARD_RETURN_IF_ERROR(boxes.AddView(p.source.offset, p.shape, p.source.strides, tag,
                                            BoxLimit(radix, used_digits)));
    }
  }
  const PaddingSpec padding = internal::MakePaddingSpec(radix, logical, valid);
  std::vector<Rank> holders;
  return internal::SweepCells(
      boxes, padding,
      [&](std::span<const Index> cell_lo, std::span<const int32_t> active,
          bool is_padding) -> Status {
        auto where = [&] {
          return FormatShape(UnravelIndex(internal::OffsetOfDigits(radix, cell_lo), logical));
        };
        if (active.empty()) {
          if (is_padding || !require_coverage) return Status::Ok();
          return InvalidArgumentError(fmt::format("element {} of F (shape {}) is held by no rank",
                                                  where(), FormatShape(logical)));
        }
        holders.clear();
        for (int32_t box : active)
          holders.push_back(refs[static_cast<size_t>(boxes.tag(box))].rank);
        std::sort(holders.begin(), holders.end());
        for (size_t i = 1; i < holders.size(); ++i) {
          if (holders[i] != holders[i - 1]) continue;
          std::vector<int32_t> twice;
          for (int32_t box : active) {
            const Ref& ref = refs[static_cast<size_t>(boxes.tag(box))];
            if (ref.rank == holders[i]) twice.push_back(ref.piece);
          }
          return InvalidArgumentError(fmt::format(
              "{}: holds element {} of F twice (pieces {} and {}); a shard holds each element "
              "of F at most once",
              RankPath(holders[i]), where(), twice[0], twice.size() > 1 ? twice[1] : twice[0]));
        }
        for (int32_t box : active) {
          const Ref& ref = refs[static_cast<size_t>(boxes.tag(box))];
          const Piece& p =
              ranks[static_cast<size_t>(ref.rank)].pieces[static_cast<size_t>(ref.piece)];
          if (p.locations != holders) {
            return InvalidArgumentError(fmt::format(
                "{}: element {} of F is held by ranks {} but the piece's locations are {}; a "
                "piece must not span elements with different holders",
                PiecePath(ref.rank, static_cast<size_t>(ref.piece)), where(), FormatRanks(holders),
                FormatRanks(p.locations)));
          }
        }
        return Status::Ok();
      });
}

}  // namespace

std::string RankPath(Rank rank) { return fmt::format("ranks[\"{}\"]", rank); }

std::string PiecePath(Rank rank, size_t piece_index) {
  return fmt::format("ranks[\"{}\"].pieces[{}]", rank, piece_index);
}

bool ParamMap::has_buffers() const {
  return std::any_of(ranks_.begin(), ranks_.end(),
                     [](const RankShard& r) { return r.is_buffered(); });
}

Index ParamMap::num_pieces() const {
  Index n = 0;
  for (const RankShard& r : ranks_) n += static_cast<Index>(r.pieces.size());
  return n;
}

bool ParamMap::IsPadding(Index offset) const {
  if (!has_padding()) return false;
  const Shape index = UnravelIndex(offset, logical_shape_);
  for (size_t k = 0; k < index.size(); ++k) {
    if (index[k] >= valid_shape_[k]) return true;
  }
  return false;
}

ParamMapBuilder::ParamMapBuilder(const ParamMap& map)
    : logical_shape_(map.logical_shape_), ranks_(map.ranks_) {
  if (map.has_padding()) valid_shape_ = map.valid_shape_;
}

ParamMapBuilder& ParamMapBuilder::set_logical_shape(Shape shape) {
  logical_shape_ = std::move(shape);
  return *this;
}

ParamMapBuilder& ParamMapBuilder::set_valid_shape(std::optional<Shape> shape) {
  valid_shape_ = std::move(shape);
  return *this;
}

ParamMapBuilder& ParamMapBuilder::set_world_size(int n) {
  ranks_.resize(static_cast<size_t>(std::max(n, 0)));
  return *this;
}

ParamMapBuilder& ParamMapBuilder::set_shard_shape(Rank rank, Shape shape) {
  if (rank >= 0 && static_cast<size_t>(rank) >= ranks_.size())
    ranks_.resize(static_cast<size_t>(rank) + 1);
  if (rank >= 0) ranks_[static_cast<size_t>(rank)].shard_shape = std::move(shape);
  return *this;
}

ParamMapBuilder& ParamMapBuilder::add_piece(Rank rank, Piece piece) {
  if (rank >= 0 && static_cast<size_t>(rank) >= ranks_.size())
    ranks_.resize(static_cast<size_t>(rank) + 1);
  if (rank >= 0) ranks_[static_cast<size_t>(rank)].pieces.push_back(std::move(piece));
  return *this;
}

ParamMapBuilder& ParamMapBuilder::set_buffer(Rank rank, std::string buffer) {
  if (rank >= 0 && static_cast<size_t>(rank) >= ranks_.size())
    ranks_.resize(static_cast<size_t>(rank) + 1);
  if (rank >= 0) ranks_[static_cast<size_t>(rank)].buffer = std::move(buffer);
  return *this;
}

Result<ParamMap> ParamMapBuilder::Finalize(const ValidateOptions& options) const {
  ParamMap map;
  map.logical_shape_ = logical_shape_;
  map.ranks_ = ranks_;
  RESHARD_RETURN_IF_ERROR(CheckShape(map.logical_shape_, "logical_shape"));
  if (valid_shape_) {
    if (valid_shape_->size() != logical_shape_.size()) {
      return InvalidArgumentError(
          fmt::format("valid_shape {} and logical_shape {} have different ranks",
                      FormatShape(*valid_shape_), FormatShape(logical_shape_)));
    }
    for (size_t k = 0; k < logical_shape_.size(); ++k) {
      if ((*valid_shape_)[k] < 0 || (*valid_shape_)[k] > logical_shape_[k]) {
        return InvalidArgumentError(
            fmt::format("valid_shape {} is not within logical_shape {} (dimension {})",
                        FormatShape(*valid_shape_), FormatShape(logical_shape_), k));
      }
    }
    map.valid_shape_ = *valid_shape_;
  } else {
    map.valid_shape_ = logical_shape_;
  }
  if (map.ranks_.empty())
    return InvalidArgumentError("ranks is empty: a map needs at least one rank");
  const int world = static_cast<int>(map.ranks_.size());
  const Index full_elems = ProductOf(map.logical_shape_);
  for (Rank r = 0; r < world; ++r) {
    RankShard& shard = map.ranks_[static_cast<size_t>(r)];
    RESHARD_RETURN_IF_ERROR(CheckShape(shard.shard_shape, RankPath(r) + ".shard_shape"));
    const Index shard_elems = ProductOf(shard.shard_shape);
    Index held = 0;
    for (size_t i = 0; i < shard.pieces.size(); ++i) {
      RESHARD_RETURN_IF_ERROR(
          CheckPiece(shard.pieces[i], r, world, full_elems, shard_elems).Annotate(PiecePath(r, i)));
      auto sum = CheckedAdd(held, shard.pieces[i].num_elements());
      if (!sum) return InvalidArgumentError(RankPath(r) + ": pieces hold more than 2^62 elements");
      held = *sum;
    }
    if (shard.is_buffered() && held > shard_elems) {
      return InvalidArgumentError(fmt::format(
          "{}: pieces account for {} elements but buffer \"{}\" (shape {}) has {}", RankPath(r),
          held, shard.buffer, FormatShape(shard.shard_shape), shard_elems));
    }
    if (!shard.is_buffered() && held != shard_elems) {
      return InvalidArgumentError(fmt::format(
          "{}: pieces account for {} elements but the shard (shape {}) has {}; every shard "
          "element must be written by exactly one piece",
          RankPath(r), held, FormatShape(shard.shard_shape), shard_elems));
    }
  }
  size_t used_digits = 0;  // of kMaxBoxDigits, over all checks
  for (Rank r = 0; r < world; ++r) {
    RESHARD_RETURN_IF_ERROR(CheckShardExact(map.ranks_[static_cast<size_t>(r)], r, used_digits));
  }
  RESHARD_RETURN_IF_ERROR(CheckSourceCover(map.logical_shape_, map.valid_shape_, map.ranks_,
                                           options.require_coverage, used_digits));
  return map;
}

}  // namespace reshard
