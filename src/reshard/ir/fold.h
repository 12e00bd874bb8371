// Folding: the fewest affine pieces that describe a sequence of source offsets.
//
// A rank's shard, read in row-major order, is a sequence of offsets into F. Where that
// sequence is affine in the mixed-radix digits of the shard position, it is one piece. The
// fold finds that structure bottom-up, one level at a time: at each level the sequence is a
// list of equal-shaped *units*; let d be the difference between the first two unit starts and
// call a position a *break* when the difference there is not d. The largest period P that
// keeps every break on a group boundary is the gcd of all break positions (and the unit
// count); when P > 1, groups of P units become the units of the next level. Taking the gcd of
// every break - rather than the longest run - is what finds the hierarchical period: a
// CodeGen shard whose fifth and sixth rows happen to be contiguous in F still folds into one
// 4-D piece, where merging runs greedily stops at five.
//
// The sequence is never expanded to elements: it is given as *items*, each an affine block
// of units (an offset and (extent, stride) dims), and every step works on items, so folding
// an already-folded map costs in proportion to its pieces.
#ifndef RESHARD_IR_FOLD_H_
#define RESHARD_IR_FOLD_H_

#include <vector>

#include "reshard/base/index.h"

namespace reshard::internal {

struct FoldDim {
  Index extent;
  Index stride;
  friend bool operator==(const FoldDim&, const FoldDim&) = default;
};

/// An affine block of consecutive sequence elements: offsets `offset + sum i_k * stride_k`
/// for i in row-major order over `dims` (outermost first). Zero dims: one element.
struct FoldItem {
  Index offset = 0;
  std::vector<FoldDim> dims;
};

/// One folded piece: offsets `source_offset + sum i_k * dims[k].stride` in row-major order of
/// `dims`; it covers `num_elements` consecutive positions of the sequence.
struct FoldedPiece {
  Index source_offset = 0;
  std::vector<FoldDim> dims;
  Index num_elements = 1;
};

/// Drops extent-1 dims and merges dims that are contiguous with each other.
void NormalizeDims(std::vector<FoldDim>& dims);

/// Appends `item` to `items`, merging it into the last item when the two continue one
/// arithmetic run (a representation choice only: the fold's result does not depend on it).
void AppendItem(std::vector<FoldItem>& items, FoldItem item);

/// The fewest pieces (within the limits documented in docs/design.md) whose concatenation
/// is the sequence `items`. Deterministic: equal sequences give equal pieces, however they
/// are cut into items.
std::vector<FoldedPiece> FoldSequence(const std::vector<FoldItem>& items);

}  // namespace reshard::internal

#endif  // RESHARD_IR_FOLD_H_
