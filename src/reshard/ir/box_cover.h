// Set algebra on strided views, at a cost set by pieces and contiguous runs, not elements.
//
// A strided view is a set of offsets into a flat buffer of n elements. To reason about many
// views at once (do they overlap? do they cover everything? who holds what?) we pick one
// mixed-radix coordinate system for [0, n) - a `Radix` whose digit strides divide each other
// and include the views' strides - in which most views are boxes (a product of one
// interval per digit). A column split of a matrix, a fused QKV block or CodeGen's 4-D
// interleave is then a single box, and a view that is not a box in the radix is cut into
// boxes along its offending dimensions (in the worst case one box per contiguous run).
//
// `SweepCells` then walks the coarsest grid of cells on which the set of covering boxes is
// constant, dimension by dimension, skipping sub-problems it has already seen, so a layout
// of k boxes costs about k log k whatever the tensor size.
#ifndef RESHARD_IR_BOX_COVER_H_
#define RESHARD_IR_BOX_COVER_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/status.h"

namespace reshard::internal {

/// One digit of a mixed radix: `extent` values, each worth `stride` elements.
struct RadixDim {
  Index extent;
  Index stride;
};

/// Mixed-radix coordinates of [0, n): digits outermost first, stride[last] == 1,
/// stride[k] == stride[k+1] * extent[k+1], and stride[0] * extent[0] == n.
class Radix {
 public:
  /// Builds a radix for n > 0 elements from candidate strides. `required` strides (those of
  /// a logical shape: already a divisibility chain) are always digits; each `candidate` is
  /// added when it fits the chain (divides the next larger stride and is divisible by the
  /// next smaller one). Candidates outside (1, n) are ignored.
  static Radix Build(Index n, std::span<const Index> required, std::span<const Index> candidates);

  int rank() const { return static_cast<int>(dims_.size()); }
  const RadixDim& dim(int k) const { return dims_[static_cast<size_t>(k)]; }
  /// The digit whose stride is exactly `stride`, or -1.
  int DigitOfStride(Index stride) const;
  /// Digits of `offset` (0 <= offset < n), outermost first.
  void Digits(Index offset, Index* digits) const;

 private:
  std::vector<RadixDim> dims_;
};

/// For a run of `n` steps of the digit `j` starting at `digits` (the digits of its first
/// offset) that is not a box as a whole: the length of a prefix after which the rest is better
/// aligned (up to where digit j, or the first non-zero digit above it, wraps; or the largest
/// multiple of digit j's extent). Cutting runs there decomposes any interval into O(digits)
/// boxes instead of one box per step. Returns n when no cut helps.
Index AlignedPrefix(const Radix& radix, const Index* digits, int j, Index n);

/// Boxes in a radix: per box, an interval [lo, hi) per digit, and an integer tag.
class BoxSet {
 public:
  explicit BoxSet(const Radix& radix) : radix_(&radix) {}

  const Radix& radix() const { return *radix_; }
  size_t size() const { return tags_.size(); }
  Index lo(size_t box, int digit) const {
    return bounds_[Base(box) + 2 * static_cast<size_t>(digit)];
  }
  Index hi(size_t box, int digit) const {
    return bounds_[Base(box) + 2 * static_cast<size_t>(digit) + 1];
  }
  int32_t tag(size_t box) const { return tags_[box]; }

  /// Adds the offsets of the view (offset, shape, strides) as boxes tagged `tag`. The view
  /// must be inside [0, n) and have no zero stride on an extent above 1 (callers check
  /// both). ResourceExhausted when the total number of boxes would pass `max_boxes`.
  Status AddView(Index offset, std::span<const Index> shape, std::span<const Index> strides,
                 int32_t tag, size_t max_boxes);

 private:
  struct Dim {
    Index extent;
    Index stride;
  };
  size_t Base(size_t box) const { return box * 2 * static_cast<size_t>(radix_->rank()); }
  Status AddDims(Index offset, std::vector<Dim>& dims, int32_t tag, size_t max_boxes);
  // Tries to place the whole view as one box; returns the index (into dims) of the first
  // dimension that does not fit, or -1 on success (and then appends the box).
  int TryAddBox(Index offset, const std::vector<Dim>& dims, int32_t tag);

  const Radix* radix_;
  std::vector<Index> bounds_;
  std::vector<int32_t> tags_;
};

/// Describes where padding starts, so a cell can be classified without visiting elements.
/// Logical dimension k of the tensor spans the radix digits [first_digit[k], last_digit[k]]
/// and its elements at index >= valid[k] are padding. Empty `valid` means no padding.
struct PaddingSpec {
  std::vector<int> first_digit;
  std::vector<int> last_digit;
  Shape valid;
};

/// The padding spec of a tensor of shape `logical` whose elements at or beyond `valid` are
/// padding, in `radix` (which must contain the logical strides). Empty when there is none.
PaddingSpec MakePaddingSpec(const Radix& radix, const Shape& logical, const Shape& valid);

/// Visited for each maximal cell (a box of digits on which the set of covering boxes is
/// constant): `cell_lo` holds the cell's smallest digits (the smallest offset in it),
/// `active` the covering boxes (indices into the BoxSet), and `padding` whether the whole
/// cell is padding (a cell is either all padding or starts with a non-padding element).
using CellVisitor = std::function<Status(std::span<const Index> cell_lo,
                                         std::span<const int32_t> active, bool padding)>;

/// Visits every maximal cell of [0, n), uncovered cells included, in increasing order of
/// their smallest offset, and stops at the first error the visitor returns. Cells whose
/// sub-problem (the set of covering boxes and padding state) has been seen before are
/// skipped: a visitor must depend only on `active`, `padding` and, for its message,
/// `cell_lo`.
Status SweepCells(const BoxSet& boxes, const PaddingSpec& padding, const CellVisitor& visit);

/// Offset of the element whose digits are `digits`.
Index OffsetOfDigits(const Radix& radix, std::span<const Index> digits);

}  // namespace reshard::internal

#endif  // RESHARD_IR_BOX_COVER_H_
