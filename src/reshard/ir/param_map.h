// The affine IR: pieces and param maps.
//
// A param map says, for one parameter, exactly which elements of the full logical tensor F
// each rank's shard holds. For every multi-index i inside a piece's shape:
//
//   shard_r[dest.offset + sum_k i_k * dest.strides_k] =
//       scale * F[source.offset + sum_k i_k * source.strides_k]
//
// Offsets and strides are in elements of the flat row-major storage of F (source) and of the
// shard (dest) - exactly `torch.as_strided` argument lists. A `ParamMap` exists only in
// validated form: it is built through `ParamMapBuilder::Finalize()`, which checks every
// invariant of DESIGN.md 2.1 that does not need data (bounds, exact shards, coverage,
// homogeneity). Consistency of replicated data (P2) is checked by the executor.
#ifndef RESHARD_IR_PARAM_MAP_H_
#define RESHARD_IR_PARAM_MAP_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard {

/// A rank of a tensor-parallel group, 0 <= rank < world_size.
using Rank = int32_t;

/// An affine view into a flat row-major buffer: the element at multi-index i of the owning
/// piece's shape lives at `offset + sum_k i_k * strides[k]`. Units: elements.
struct StridedView {
  Index offset = 0;
  Shape strides;
  friend bool operator==(const StridedView&, const StridedView&) = default;
};

/// One affine block: `shape` elements of F (at `source`) held in a shard (at `dest`),
/// multiplied by `scale`.
struct Piece {
  Shape shape;
  StridedView source;  // into F
  StridedView dest;    // into the shard of the rank that lists this piece
  /// Every rank that holds these same elements of F, sorted ascending, without repeats.
  /// A piece listed under rank r always includes r.
  std::vector<Rank> locations;
  /// The shard holds F * scale. Finite and non-zero; 1 for an unscaled piece.
  double scale = 1.0;

  Index num_elements() const { return ProductOf(shape); }
  bool is_replicated() const { return locations.size() > 1; }
  friend bool operator==(const Piece&, const Piece&) = default;
};

/// What one rank holds: a dense row-major shard and the pieces that fill it.
///
/// Buffered form (DESIGN.md 16): when `buffer` is set, the pieces' dest views index a named rank
/// tensor that the maps of several parameters share (an MoE layer's fused `gate_up_proj`,
/// vLLM's `qkv_proj`), `shard_shape` is that buffer's shape on this rank, and the pieces write
/// only this parameter's part of it: each buffer element at most once, the rest left to the
/// other maps over the buffer. Exactness over the whole buffer is the buffer set's invariant
/// (ir/buffer_set.h), checked once for all maps together.
struct RankShard {
  Shape shard_shape;
  std::vector<Piece> pieces;
  /// The rank tensor the pieces write into; empty: the parameter's own shard.
  std::string buffer;

  bool is_buffered() const { return !buffer.empty(); }
  friend bool operator==(const RankShard&, const RankShard&) = default;
};

/// Options for `ParamMapBuilder::Finalize`.
struct ValidateOptions {
  /// P1: every non-padding element of F has a holder. Off only for deliberately partial
  /// observations (`reshard infer --allow-uncovered`).
  bool require_coverage = true;
};

/// A validated, immutable param map. Copyable value type.
class ParamMap {
 public:
  /// Shape of the full tensor F (including padding, when there is any).
  const Shape& logical_shape() const { return logical_shape_; }
  /// Elements at or beyond `valid_shape` along any dimension are padding. Equal to
  /// `logical_shape()` when the parameter has no padding.
  const Shape& valid_shape() const { return valid_shape_; }
  bool has_padding() const { return valid_shape_ != logical_shape_; }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  const RankShard& rank(Rank r) const { return ranks_[static_cast<size_t>(r)]; }
  std::span<const RankShard> ranks() const { return ranks_; }
  /// Number of elements of F (padded).
  Index num_elements() const { return ProductOf(logical_shape_); }
  Index shard_num_elements(Rank r) const { return ProductOf(rank(r).shard_shape); }
  /// Total number of pieces over all ranks.
  Index num_pieces() const;
  /// Whether any rank's pieces write into a shared buffer rather than an own shard.
  bool has_buffers() const;
  /// The buffer rank `r`'s pieces write into; empty for an own shard.
  const std::string& buffer(Rank r) const { return rank(r).buffer; }
  /// Whether `offset` (into F) is padding.
  bool IsPadding(Index offset) const;

  friend bool operator==(const ParamMap&, const ParamMap&) = default;

 private:
  friend class ParamMapBuilder;
  ParamMap() = default;
  Shape logical_shape_;
  Shape valid_shape_;
  std::vector<RankShard> ranks_;
};

/// Collects the parts of a param map, then checks every invariant at once in `Finalize`.
/// The builder accepts anything (it is what a reader fills from untrusted input); only
/// `Finalize` decides whether it is a map.
class ParamMapBuilder {
 public:
  ParamMapBuilder() = default;
  /// Starts from an existing map, to edit it.
  explicit ParamMapBuilder(const ParamMap& map);

  ParamMapBuilder& set_logical_shape(Shape shape);
  /// nullopt (the default) means no padding.
  ParamMapBuilder& set_valid_shape(std::optional<Shape> shape);
  /// Ranks 0..n-1, each with an empty shard shape and no pieces until set.
  ParamMapBuilder& set_world_size(int n);
  /// Grows the world as needed.
  ParamMapBuilder& set_shard_shape(Rank rank, Shape shape);
  ParamMapBuilder& add_piece(Rank rank, Piece piece);
  /// Puts rank `rank`'s pieces into the named buffer (DESIGN.md 16); `shard_shape` is then the
  /// buffer's shape on that rank. Empty: the rank's own shard (the default).
  ParamMapBuilder& set_buffer(Rank rank, std::string buffer);

  const Shape& logical_shape() const { return logical_shape_; }
  const std::optional<Shape>& valid_shape() const { return valid_shape_; }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<RankShard>& ranks() const { return ranks_; }

  /// Validates and returns the map. Locations are sorted. A buffered rank's pieces must lie in
  /// the buffer and write no element twice; the rest of the buffer is other maps' (checked by
  /// BufferSetBuilder::Finalize). Errors are InvalidArgument (or
  /// OutOfRange for a view past an end, ResourceExhausted for a map too fragmented to
  /// check) and name the rank, the piece index and the first offending multi-index, e.g.
  /// `ranks["3"].pieces[1]: source view ends at offset 512 but F has 384 elements`.
  Result<ParamMap> Finalize(const ValidateOptions& options = {}) const;

 private:
  Shape logical_shape_;
  std::optional<Shape> valid_shape_;
  std::vector<RankShard> ranks_;
};

/// The JSON path of a rank or piece in error messages: `ranks["3"]`, `ranks["3"].pieces[1]`.
std::string RankPath(Rank rank);
std::string PiecePath(Rank rank, size_t piece_index);

}  // namespace reshard

#endif  // RESHARD_IR_PARAM_MAP_H_
