// Folding: the fewest affine pieces that describe a sequence of (shard, F) offset pairs.
//
// What one rank holds under one key (holders and scale), read in shard order, is a sequence
// of pairs: a position in the shard and the offset in F it holds. Where both are affine in
// the mixed-radix digits of the sequence position, the sequence is one piece. The fold finds
// that structure bottom-up, one level at a time: at each level the sequence is a list of
// equal-shaped *units*; let d be the (shard, F) step between the first two units and call a
// position a *break* when the step there is not d. The largest period P that keeps every break
// on a group boundary is the gcd of all break positions (and the unit count); when P > 1,
// groups of P units become the units of the next level. Taking the gcd of every break - rather
// than the longest run - is what finds the hierarchical period: a CodeGen shard whose fifth and
// sixth rows happen to be contiguous in F still folds into one 4-D piece, where merging runs
// greedily stops at five.
//
// The sequence is never expanded to elements: it is given as *items*, each an affine block of
// units, and every step works on items, so folding an already-folded map costs in proportion
// to its pieces.
#ifndef RESHARD_IR_FOLD_H_
#define RESHARD_IR_FOLD_H_

#include <map>
#include <utility>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/ir/param_map.h"

namespace reshard::internal {

/// A pair of offsets (or strides): into the shard (`dst`) and into F (`src`).
struct Pair {
  Index dst = 0;
  Index src = 0;
  friend bool operator==(const Pair&, const Pair&) = default;
  Pair operator+(const Pair& o) const { return {dst + o.dst, src + o.src}; }
  Pair operator-(const Pair& o) const { return {dst - o.dst, src - o.src}; }
  Pair operator*(Index k) const { return {dst * k, src * k}; }
};

struct FoldDim {
  Index extent;
  Pair stride;
  friend bool operator==(const FoldDim&, const FoldDim&) = default;
};

/// An affine block of consecutive sequence elements: offsets `offset + sum i_k * stride_k` for
/// i in row-major order over `dims` (outermost first). Zero dims: one element.
struct FoldItem {
  Pair offset;
  std::vector<FoldDim> dims;
};

/// One folded piece, covering `num_elements` consecutive elements of the sequence.
struct FoldedPiece {
  Pair offset;
  std::vector<FoldDim> dims;
  Index num_elements = 1;
};

/// Drops extent-1 dims and merges dims that are contiguous with each other on both sides.
void NormalizeDims(std::vector<FoldDim>& dims);

/// Appends `item` to `items`, merging it into the last item when the two continue one
/// arithmetic run (a representation choice only: the fold's result does not depend on it).
void AppendItem(std::vector<FoldItem>& items, FoldItem item);

/// The fewest pieces (within the limits documented in docs/inference.md) whose concatenation
/// is the sequence `items`; every stride non-negative. Deterministic: equal sequences give
/// equal pieces, however they are cut into items.
std::vector<FoldedPiece> FoldSequence(const std::vector<FoldItem>& items);

/// The elements of one rank that share one key (holders and scale), in shard order.
struct KeyedSequence {
  std::vector<Rank> locations;
  double scale = 1.0;
  std::vector<FoldItem> items;
};

/// Folds each sequence and adds the pieces to rank `rank` of `builder` in shard order, dims
/// split where they cross a dimension of F (whose row-major strides are `logical_strides`).
/// Defined in canonicalize.cc.
void EmitFolded(const std::vector<KeyedSequence>& sequences, Rank rank,
                const Shape& logical_strides, ParamMapBuilder& builder);

}  // namespace reshard::internal

#endif  // RESHARD_IR_FOLD_H_
